"""Topic administration and cluster metadata: :class:`Admin` (blocking) and :class:`AsyncAdmin` (asyncio).

Every method returns a dataclass parsed from the broker's reply (spec "Topic Management", "METADATA",
"LIST_OFFSETS"; facts A6, B5), never raw text, and raises the typed errors of
:mod:`cursus.client.errors` (``TopicNotFoundError``, ``ValidationError``, ``UnsupportedFeatureError`` ...).
Requests go to the bootstrap broker and follow ``NOT_LEADER``/``NOT_COORDINATOR`` redirects; requests that
are safe to repeat (all but ``delete_topic(if_exists=False)``) are retried across reconnects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from cursus.client.aio import AsyncClient
from cursus.client.connection import (
    DEFAULT_ADDRESS,
    Address,
    Client,
    ConnectionOptions,
    json_reply,
    ok_fields,
    parse_address,
)
from cursus.client.errors import NotLeaderError, ProtocolViolationError
from cursus.wire import Command, Frame

__all__ = [
    "Admin",
    "AsyncAdmin",
    "DeleteResult",
    "TruncateResult",
    "GroupOffset",
    "PartitionDescription",
    "PartitionOffsets",
    "TopicConfig",
    "TopicDescription",
    "TopicMetadata",
    "parse_list_offsets",
    "parse_metadata",
    "parse_topic_config",
]


def _int(fields: Mapping[str, str], key: str, default: int = 0) -> int:
    raw = fields.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ProtocolViolationError(f"reply field {key}={raw!r} is not an integer") from None


def _optional_int(fields: Mapping[str, str], key: str) -> int | None:
    raw = fields.get(key)
    if raw is None or raw in ("", "default"):
        return None
    return _int(fields, key)


def _bool(fields: Mapping[str, str], key: str) -> bool:
    return fields.get(key, "false").lower() == "true"


def _csv(raw: str | None) -> tuple[str, ...]:
    return tuple(part for part in (raw or "").split(",") if part)


# ------------------------------------------------------------------------------------------ dataclasses


class _PlainDict:
    """Base of the result dataclasses: :meth:`to_dict`."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (tuples become lists)."""
        return _jsonable(asdict(self))  # type: ignore[call-overload]  # every subclass is a dataclass


@dataclass(frozen=True, slots=True)
class TopicConfig(_PlainDict):
    """A topic definition as CREATE and ALTER_TOPIC_CONFIG report it.

    ``min_in_sync_replicas`` is the topic override (None: the broker default applies);
    ``effective_min_in_sync_replicas`` the value in force. Retention 0 means "broker default".
    ``extra`` keeps reply fields this SDK does not know yet.
    """

    topic: str
    partitions: int
    revision: int
    lifecycle_epoch: int
    replication_factor: int
    idempotent: bool
    event_sourcing: bool
    cleanup_policy: str
    partitioner: str
    auth_policy: str
    read_acl: tuple[str, ...]
    write_acl: tuple[str, ...]
    retention_hours: int
    retention_bytes: int
    min_in_sync_replicas: int | None
    effective_min_in_sync_replicas: int | None
    extra: Mapping[str, str] = field(default_factory=dict)


_CONFIG_KEYS = frozenset({
    "topic", "partitions", "revision", "lifecycle_epoch", "replication_factor", "idempotent", "event_sourcing",
    "cleanup_policy", "partitioner", "auth_policy", "read_acl", "write_acl", "retention_hours",
    "retention_bytes", "min_in_sync_replicas", "effective_min_in_sync_replicas",
})


def parse_topic_config(fields: Mapping[str, str]) -> TopicConfig:
    """Build a :class:`TopicConfig` from CREATE/ALTER_TOPIC_CONFIG reply fields.

    Raises ``ProtocolViolationError`` when ``topic`` is missing or a number does not parse.
    """
    if not fields.get("topic"):
        raise ProtocolViolationError("topic reply has no topic= field")
    return TopicConfig(
        topic=fields["topic"], partitions=_int(fields, "partitions"), revision=_int(fields, "revision"),
        lifecycle_epoch=_int(fields, "lifecycle_epoch"), replication_factor=_int(fields, "replication_factor", 1),
        idempotent=_bool(fields, "idempotent"), event_sourcing=_bool(fields, "event_sourcing"),
        cleanup_policy=fields.get("cleanup_policy", "delete"), partitioner=fields.get("partitioner", "hash_key"),
        auth_policy=fields.get("auth_policy", "open"), read_acl=_csv(fields.get("read_acl")),
        write_acl=_csv(fields.get("write_acl")), retention_hours=_int(fields, "retention_hours"),
        retention_bytes=_int(fields, "retention_bytes"),
        min_in_sync_replicas=_optional_int(fields, "min_in_sync_replicas"),
        effective_min_in_sync_replicas=_optional_int(fields, "effective_min_in_sync_replicas"),
        extra={k: v for k, v in fields.items() if k not in _CONFIG_KEYS},
    )


@dataclass(frozen=True, slots=True)
class TopicMetadata(_PlainDict):
    """METADATA: partition leaders and epochs plus the topic policy.

    ``leaders[p]`` is partition p's leader as ``host:port`` (the advertised client address); ``epochs[p]``
    its leader epoch. Use :meth:`leader_address` to get a connectable address.
    """

    topic: str
    partitions: int
    leaders: tuple[str, ...]
    epochs: tuple[int, ...]
    revision: int
    replication_factor: int
    idempotent: bool
    event_sourcing: bool
    cleanup_policy: str
    partitioner: str
    auth_policy: str
    read_acl: tuple[str, ...]
    write_acl: tuple[str, ...]
    retention_hours: int
    retention_bytes: int
    lifecycle_epoch: int
    extra: Mapping[str, str] = field(default_factory=dict)

    def leader_address(self, partition: int) -> Address | None:
        """Partition ``partition``'s leader as ``(host, port)``, or None when unknown or leaderless."""
        if not 0 <= partition < len(self.leaders) or not self.leaders[partition]:
            return None
        try:
            return parse_address(self.leaders[partition])
        except ValueError:
            return None


_METADATA_KEYS = frozenset({
    "topic", "partitions", "leaders", "epochs", "revision", "replication_factor", "idempotent",
    "event_sourcing", "cleanup_policy", "partitioner", "auth_policy", "read_acl", "write_acl",
    "retention_hours", "retention_bytes", "lifecycle_epoch",
})


def parse_metadata(fields: Mapping[str, str], topic: str) -> TopicMetadata:
    """Build :class:`TopicMetadata` from METADATA reply fields (``topic`` fills a missing ``topic=``).

    The partition count is ``partitions=`` or, failing that, the number of ``leaders=`` entries.
    """
    leaders = tuple(fields.get("leaders", "").split(",")) if fields.get("leaders") else ()
    epochs = tuple(int(e) for e in _csv(fields.get("epochs")) if e.lstrip("-").isdigit())
    partitions = _int(fields, "partitions", len(leaders))
    return TopicMetadata(
        topic=fields.get("topic") or topic, partitions=partitions, leaders=leaders, epochs=epochs,
        revision=_int(fields, "revision"), replication_factor=_int(fields, "replication_factor", 1),
        idempotent=_bool(fields, "idempotent"), event_sourcing=_bool(fields, "event_sourcing"),
        cleanup_policy=fields.get("cleanup_policy", "delete"), partitioner=fields.get("partitioner", "hash_key"),
        auth_policy=fields.get("auth_policy", "open"), read_acl=_csv(fields.get("read_acl")),
        write_acl=_csv(fields.get("write_acl")), retention_hours=_int(fields, "retention_hours"),
        retention_bytes=_int(fields, "retention_bytes"), lifecycle_epoch=_int(fields, "lifecycle_epoch"),
        extra={k: v for k, v in fields.items() if k not in _METADATA_KEYS},
    )


@dataclass(frozen=True, slots=True)
class PartitionOffsets(_PlainDict):
    """LIST_OFFSETS for one partition.

    ``earliest``: first retained offset. ``latest``: next readable (committed) offset, where a consumer
    starting "at the end" begins. ``leo``: log end offset. ``hwm``: high-water mark.
    """

    partition: int
    earliest: int
    latest: int
    leo: int
    hwm: int


def parse_list_offsets(fields: Mapping[str, str]) -> list[PartitionOffsets]:
    """Parse ``offsets=P0:earliest=E:latest=L:leo=X:hwm=H,...`` (facts A6); raises
    ``ProtocolViolationError`` for an entry that is not exactly that shape."""
    result = []
    for entry in _csv(fields.get("offsets")):
        parts = entry.split(":")
        if len(parts) != 5 or not parts[0].startswith("P") or not parts[0][1:].isdigit():
            raise ProtocolViolationError(f"bad LIST_OFFSETS entry {entry!r}")
        values: dict[str, int] = {}
        for part in parts[1:]:
            key, sep, raw = part.partition("=")
            if not sep or not raw.lstrip("-").isdigit():
                raise ProtocolViolationError(f"bad LIST_OFFSETS entry {entry!r}")
            values[key] = int(raw)
        if set(values) != {"earliest", "latest", "leo", "hwm"}:
            raise ProtocolViolationError(f"bad LIST_OFFSETS entry {entry!r}")
        result.append(PartitionOffsets(int(parts[0][1:]), **values))
    return result


@dataclass(frozen=True, slots=True)
class PartitionDescription:
    """One partition in DESCRIBE: leader address, replica and ISR broker ids, log end offset and HWM.
    ``leader_epoch`` and ``log_start_offset`` are None when the broker does not report them."""

    id: int
    leader: str
    replicas: tuple[str, ...]
    isr: tuple[str, ...]
    leo: int
    hwm: int
    leader_epoch: int | None = None
    log_start_offset: int | None = None


@dataclass(frozen=True, slots=True)
class TopicDescription:
    """DESCRIBE: the authoritative definition and per-partition state.

    ``policy`` holds the policy object as reported (cleanup_policy, partitioner, auth_policy, acls,
    retention); ``raw`` the whole JSON document.
    """

    topic: str
    revision: int
    partitions: int
    replication_factor: int
    idempotent: bool
    event_sourcing: bool
    lifecycle_epoch: int
    min_in_sync_replicas: int | None
    policy: Mapping[str, Any]
    partition_states: tuple[PartitionDescription, ...]
    raw: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The broker's JSON document."""
        return dict(self.raw)


def parse_describe(doc: Mapping[str, Any]) -> TopicDescription:
    """Build :class:`TopicDescription` from the DESCRIBE JSON (spec "DESCRIBE")."""
    if doc.get("status") != "OK":
        raise ProtocolViolationError(f"DESCRIBE status is {doc.get('status')!r}")
    definition = doc.get("definition") or {}
    if not isinstance(definition, Mapping):
        raise ProtocolViolationError("DESCRIBE definition is not an object")
    states = []
    for p in doc.get("partitions") or []:
        try:
            states.append(PartitionDescription(
                id=int(p["id"]), leader=str(p.get("leader", "")), replicas=tuple(map(str, p.get("replicas", ()))),
                isr=tuple(map(str, p.get("isr", ()))), leo=int(p.get("leo", 0)), hwm=int(p.get("hwm", 0)),
                leader_epoch=int(p["leader_epoch"]) if "leader_epoch" in p else None,
                log_start_offset=int(p["log_start_offset"]) if "log_start_offset" in p else None))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolViolationError(f"bad DESCRIBE partition entry {p!r}: {exc}") from None
    min_isr = definition.get("min_in_sync_replicas")
    return TopicDescription(
        topic=str(doc.get("topic") or definition.get("name", "")),
        revision=int(definition.get("revision", 0)), partitions=int(definition.get("partitions", len(states))),
        replication_factor=int(definition.get("replication_factor", 1)),
        idempotent=bool(definition.get("idempotent", False)),
        event_sourcing=bool(definition.get("event_sourcing", False)),
        lifecycle_epoch=int(definition.get("lifecycle_epoch", 0)),
        min_in_sync_replicas=int(min_isr) if isinstance(min_isr, int) else None,
        policy=dict(definition.get("policy") or doc.get("policy") or {}),
        partition_states=tuple(states), raw=dict(doc),
    )


@dataclass(frozen=True, slots=True)
class DeleteResult(_PlainDict):
    """DELETE: ``deleted`` is False when ``if_exists`` found nothing; ``cleanup_pending`` when storage
    cleanup must still be retried by the broker."""

    topic: str
    deleted: bool
    cleanup_pending: bool


@dataclass(frozen=True, slots=True)
class TruncateResult(_PlainDict):
    """TRUNCATE: the topic's new definition ``revision`` and ``lifecycle_epoch`` (both one higher); every
    partition is empty again (``leo`` = ``hwm`` = 0). ``cleanup_pending`` when the broker that answered
    could not reset its local storage yet (the topic stays unavailable there until its retry succeeds)."""

    topic: str
    revision: int
    lifecycle_epoch: int
    leo: int
    hwm: int
    cleanup_pending: bool


@dataclass(frozen=True, slots=True)
class GroupOffset(_PlainDict):
    """One topic-partition of a consumer group: committed offset and owner from GROUP_STATUS, log end from
    LIST_OFFSETS on the partition's leader (:func:`merge_group_offsets`).

    Attributes:
        topic, partition: the topic-partition.
        committed: the committed next offset (None: nothing committed).
        log_end: the partition's HWM, as its leader reports it.
        lag: records between the committed offset (or the log start) and the HWM.
        owner: the member holding the partition (None: nobody).
    """

    topic: str
    partition: int
    committed: int | None
    log_end: int
    lag: int
    owner: str | None


def parse_group_offsets(status: Mapping[str, Any]) -> list[GroupOffset]:
    """The ``offsets`` of a GROUP_STATUS document, sorted by (topic, partition)."""
    rows = [GroupOffset(str(o.get("topic")), int(o.get("partition", 0)),
                        None if o.get("committed_offset") is None else int(o["committed_offset"]),
                        int(o.get("log_end_offset") or 0), int(o.get("lag") or 0), o.get("owner") or None)
            for o in status.get("offsets") or []]
    return sorted(rows, key=lambda r: (r.topic, r.partition))


def merge_group_offsets(status: Mapping[str, Any],
                        bounds: Mapping[str, Sequence[PartitionOffsets]]) -> list[GroupOffset]:
    """GROUP_STATUS ``offsets`` (committed offset, owner) with the log bounds the partition leaders report
    (``bounds``: topic -> LIST_OFFSETS entries). The coordinator's own ``log_end_offset`` comes from its local
    replica, which in a cluster may be a follower behind the leader (or hold no replica at all): the leader's
    HWM and log start replace it; lag = HWM - committed (HWM - log start when nothing is committed), never
    negative. A partition missing from ``bounds`` keeps the coordinator's figures."""
    by_partition = {(topic, b.partition): b for topic, entries in bounds.items() for b in entries}
    rows = []
    for row in parse_group_offsets(status):
        found = by_partition.get((row.topic, row.partition))
        if found is not None:
            start = row.committed if row.committed is not None else found.earliest
            row = replace(row, log_end=found.hwm, lag=max(0, found.hwm - start))
        rows.append(row)
    return rows


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


# ------------------------------------------------------------------------------------------ requests


def _text_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple | set | frozenset):
        return ",".join(str(v) for v in value)
    return str(value)


def create_fields(topic: str, partitions: int | None = None, **settings: object) -> dict[str, str]:
    """CREATE fields: ``topic``, ``partitions`` and every setting that is not None, in call order.

    Raises ``ValueError`` for values containing whitespace (CRQ2 values cannot carry it in text form).
    """
    fields = {"topic": topic}
    if partitions is not None:
        fields["partitions"] = str(partitions)
    for key, value in settings.items():
        if value is None:
            continue
        text = _text_value(value)
        if any(ch.isspace() for ch in text):
            raise ValueError(f"{key} value {text!r} contains whitespace")
        fields[key] = text
    return fields


#: The settings :meth:`Admin.alter_topic` patches through CREATE (the mutable ones; min ISR has its own command).
ALTERABLE_SETTINGS = ("partitions", "cleanup_policy", "retention_hours", "retention_bytes", "partitioner",
                      "auth_policy", "read_acl", "write_acl")


def alter_patch(**settings: Any) -> dict[str, Any]:
    """The given (non-None) alterable settings; ``TypeError`` for any other name (immutable or unknown)."""
    unknown = set(settings) - set(ALTERABLE_SETTINGS)
    if unknown:
        raise TypeError(f"not alterable: {', '.join(sorted(unknown))} (alterable: {', '.join(ALTERABLE_SETTINGS)}, "
                        "min_in_sync_replicas)")
    return {k: v for k, v in settings.items() if v is not None}


def _delete_result(frame: Frame, topic: str) -> DeleteResult:
    fields = ok_fields(frame)
    return DeleteResult(fields.get("topic", topic), _bool(fields, "deleted"), _bool(fields, "cleanup_pending"))


def _truncate_result(frame: Frame, topic: str) -> TruncateResult:
    fields = ok_fields(frame)
    return TruncateResult(fields.get("topic", topic), _int(fields, "revision"), _int(fields, "lifecycle_epoch"),
                          _int(fields, "leo"), _int(fields, "hwm"), _bool(fields, "cleanup_pending"))


class Admin:
    """Blocking admin client.

    Args:
        bootstrap: ``host:port`` of a broker (or a list).
        options: :class:`~cursus.client.connection.ConnectionOptions`; keyword arguments override fields
            (``compression``, ``timeout_s``, ``ssl_context``, ``principal``, ``token``, ``backoff`` ...).
        client: share an existing :class:`~cursus.client.connection.Client` instead (not closed by
            :meth:`close`).

    Every method raises :class:`~cursus.client.errors.CursusError` subclasses: the broker's typed error, or
    ``BrokerUnavailableError``/``RequestTimeoutError`` when the broker cannot be reached.
    """

    def __init__(self, bootstrap: str | Sequence[str] = DEFAULT_ADDRESS, *,
                 options: ConnectionOptions | None = None, client: Client | None = None,
                 **overrides: Any) -> None:
        self._owns_client = client is None
        self.client = client or Client(bootstrap, options, **overrides)

    def create_topic(self, topic: str, partitions: int | None = None, *, idempotent: bool | None = None,
                     event_sourcing: bool | None = None, replication_factor: int | None = None,
                     min_in_sync_replicas: int | str | None = None, cleanup_policy: str | None = None,
                     retention_hours: int | None = None, retention_bytes: int | None = None,
                     partitioner: str | None = None, auth_policy: str | None = None,
                     read_acl: Sequence[str] | str | None = None,
                     write_acl: Sequence[str] | str | None = None) -> TopicConfig:
        """Create ``topic``, or patch it when it exists (CREATE is a presence-aware patch: omitted settings
        keep their value; partitions can only grow; idempotent/event_sourcing/replication_factor can only be
        restated).

        Args:
            topic: 1-249 of letters, digits, ``.``, ``_``, ``-``, ``=``.
            partitions: partition count (broker default 4 for a new topic).
            idempotent, event_sourcing: immutable topic flags.
            replication_factor: replicas (recorded as 1 on a standalone broker).
            min_in_sync_replicas: override of the broker minimum ISR, or ``"default"``.
            cleanup_policy: ``delete`` | ``compact`` | ``delete,compact``.
            retention_hours, retention_bytes: retention overrides (0: broker default).
            partitioner: ``hash_key`` (FNV-1a 64 of the key) | ``round_robin``.
            auth_policy: ``open`` | ``deny_write`` | ``deny_read`` | ``acl``; ``read_acl``/``write_acl``
                are principal lists.

        Returns:
            The resulting :class:`TopicConfig` (``revision`` unchanged when nothing changed).

        Raises:
            ValidationError: invalid name or setting (``invalid_topic_name``, ``invalid_partitions``,
                ``invalid_field`` ...); ``UnsupportedFeatureError`` for settings this broker refuses.
        """
        fields = create_fields(topic, partitions, idempotent=idempotent, event_sourcing=event_sourcing,
                               replication_factor=replication_factor, min_in_sync_replicas=min_in_sync_replicas,
                               cleanup_policy=cleanup_policy, retention_hours=retention_hours,
                               retention_bytes=retention_bytes, partitioner=partitioner, auth_policy=auth_policy,
                               read_acl=read_acl, write_acl=write_acl)
        return parse_topic_config(ok_fields(self.client.call(Command.CREATE, fields, retry_safe=True)))

    def alter_topic_config(self, topic: str, *, min_in_sync_replicas: int | str) -> TopicConfig:
        """Replace the topic's minimum in-sync replicas override (``"default"`` removes it).

        Raises:
            ValidationError: ``invalid_min_in_sync_replicas`` (outside 1..replication factor).
            TopicNotFoundError: no such topic.
            UnsupportedFeatureError: the broker does not serve ALTER_TOPIC_CONFIG.
        """
        fields = {"topic": topic, "min_in_sync_replicas": str(min_in_sync_replicas)}
        return parse_topic_config(ok_fields(self.client.call(Command.ALTER_TOPIC_CONFIG, fields,
                                                             retry_safe=True)))

    def alter_topic(self, topic: str, *, partitions: int | None = None,
                    min_in_sync_replicas: int | str | None = None, cleanup_policy: str | None = None,
                    retention_hours: int | None = None, retention_bytes: int | None = None,
                    partitioner: str | None = None, auth_policy: str | None = None,
                    read_acl: Sequence[str] | str | None = None,
                    write_acl: Sequence[str] | str | None = None) -> TopicConfig:
        """Change the mutable settings of an existing topic; omitted (None) settings keep their value.

        Everything but the minimum ISR is a presence-aware CREATE patch of the existing topic (spec "CREATE":
        partitions can only grow; 0 retention means the broker default; an empty ACL list clears it); the
        minimum ISR goes through ALTER_TOPIC_CONFIG (``"default"`` removes the override), after the patch.
        Immutable flags (idempotent, event_sourcing, replication_factor) are not alterable.

        Returns:
            The resulting :class:`TopicConfig` (``revision`` unchanged when nothing changed).

        Raises:
            TopicNotFoundError: no such topic (alter never creates one).
            ValidationError: ``invalid_partitions`` (a decrease), ``invalid_min_in_sync_replicas``,
                ``unsupported_topic_policy`` (a cleanup policy the broker refuses) and other bad values.
            ValueError: nothing to change.
        """
        patch = alter_patch(partitions=partitions, cleanup_policy=cleanup_policy, retention_hours=retention_hours,
                            retention_bytes=retention_bytes, partitioner=partitioner, auth_policy=auth_policy,
                            read_acl=read_acl, write_acl=write_acl)
        if not patch and min_in_sync_replicas is None:
            raise ValueError("alter_topic needs at least one setting to change")
        config = None
        self.metadata(topic)  # TopicNotFoundError: CREATE would create it
        if patch:
            config = self.create_topic(topic, **patch)
        if min_in_sync_replicas is not None:
            config = self.alter_topic_config(topic, min_in_sync_replicas=min_in_sync_replicas)
        assert config is not None
        return config

    def delete_topic(self, topic: str, *, if_exists: bool = False) -> DeleteResult:
        """Delete ``topic`` and its data. With ``if_exists`` a missing topic gives ``deleted=False``.

        Not retried after a lost reply unless ``if_exists`` (a repeat would report ``topic_not_found``).

        Raises:
            TopicNotFoundError: missing topic without ``if_exists``.
            CursusError: ``topic_delete_blocked`` (active group or transaction) and other broker errors.
        """
        fields = {"topic": topic, "if_exists": "true" if if_exists else "false"}
        return _delete_result(self.client.call(Command.DELETE, fields, retry_safe=if_exists), topic)

    def truncate_topic(self, topic: str, *, expected_revision: int | None = None) -> TruncateResult:
        """Remove every record of ``topic`` but keep its definition (spec TRUNCATE, admin only): its
        revision and lifecycle epoch grow by one, every partition restarts at offset 0, and inactive
        consumer groups of it, idempotent-producer state and finished transactions' references to it are
        dropped. ``expected_revision`` is the compare-and-set guard (None: the revision DESCRIBE reports
        now; pass it explicitly to be sure nobody changed the topic in between).

        Not retried after a lost reply (a repeat would answer ``version_conflict``: check
        :meth:`describe_topic`).

        Raises:
            TopicNotFoundError: no such topic.
            CursusError: ``version_conflict`` (another revision), ``topic_truncate_blocked`` (a group with
                members or an open transaction uses the topic), ``internal_topic_delete_forbidden``,
                ``unsupported_topic_policy`` (a cluster broker without lifecycle protocol 1).
        """
        if expected_revision is None:
            expected_revision = self.describe_topic(topic).revision
        fields = {"topic": topic, "expected_revision": str(expected_revision)}
        return _truncate_result(self.client.call(Command.TRUNCATE, fields), topic)

    def list_topics(self) -> list[str]:
        """Names of all application topics (internal topics hidden), in broker order."""
        return list(_csv(ok_fields(self.client.call(Command.LIST)).get("topics")))

    def describe_topic(self, topic: str) -> TopicDescription:
        """The definition and per-partition leader, replicas, ISR, LEO and HWM.

        Raises:
            TopicNotFoundError: no such topic. ``UnsupportedFeatureError`` if the broker lacks DESCRIBE.
        """
        return parse_describe(json_reply(self.client.call(Command.DESCRIBE, {"topic": topic})))

    def metadata(self, topic: str) -> TopicMetadata:
        """Partition leaders, leader epochs and the topic policy.

        Raises:
            TopicNotFoundError: no such topic.
        """
        return parse_metadata(ok_fields(self.client.call(Command.METADATA, {"topic": topic})), topic)

    def list_offsets(self, topic: str, partition: int | None = None) -> list[PartitionOffsets]:
        """Earliest/latest/LEO/HWM of every partition (or just ``partition``), sorted by partition.

        Raises:
            TopicNotFoundError: no such topic; ``NotFoundError`` (``partition_not_found``) for a bad partition.
        """
        if partition is not None:
            return parse_list_offsets(ok_fields(self.client.call(
                Command.LIST_OFFSETS, {"topic": topic, "partition": str(partition)})))
        try:
            return parse_list_offsets(ok_fields(self.client.call(Command.LIST_OFFSETS, {"topic": topic})))
        except NotLeaderError:  # a cluster: the partitions have different leaders; ask each (redirects followed)
            return [o for p in range(self.metadata(topic).partitions) for o in self.list_offsets(topic, p)]

    def help(self) -> list[str]:
        """Command names the broker serves (HELP)."""
        return list(_csv(ok_fields(self.client.call(Command.HELP)).get("commands")))

    def list_groups(self) -> list[str]:
        """Names of the registered consumer groups (LIST_GROUPS)."""
        return list(_csv(ok_fields(self.client.call(Command.LIST_GROUPS)).get("groups")))

    def describe_group(self, group: str) -> dict[str, Any]:
        """The GROUP_STATUS document: ``state`` (``Stable``/``Empty``), ``generation``, ``epoch``,
        ``subscription``, ``members`` (``member_id``, ``assignments``, ``last_heartbeat``), ``offsets``
        (see [groups.md](groups.md)).

        Raises:
            NotFoundError: ``group_not_found``.
        """
        return json_reply(self.client.call(Command.GROUP_STATUS, {"group": group}))

    def group_offsets(self, group: str) -> list[GroupOffset]:
        """Committed offset and owner of every topic-partition of ``group`` (GROUP_STATUS on its coordinator),
        with HWM and lag from LIST_OFFSETS on each partition's leader (:func:`merge_group_offsets`). Raises as
        :meth:`describe_group`, and ``TopicNotFoundError`` when a topic goes away meanwhile."""
        status = self.describe_group(group)
        topics = sorted({str(o.get("topic")) for o in status.get("offsets") or []})
        return merge_group_offsets(status, {t: self.list_offsets(t) for t in topics})

    def group_lag(self, group: str) -> int:
        """Total lag of ``group`` (records between its committed offsets and the leaders' HWMs). Raises as
        :meth:`group_offsets`."""
        return sum(o.lag for o in self.group_offsets(group))

    def close(self) -> None:
        """Close the connections (when this admin created its client)."""
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> Admin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncAdmin:
    """asyncio admin client: the methods of :class:`Admin` as coroutines, same arguments and errors."""

    def __init__(self, bootstrap: str | Sequence[str] = DEFAULT_ADDRESS, *,
                 options: ConnectionOptions | None = None, client: AsyncClient | None = None,
                 **overrides: Any) -> None:
        self._owns_client = client is None
        self.client = client or AsyncClient(bootstrap, options, **overrides)

    async def create_topic(self, topic: str, partitions: int | None = None, **settings: Any) -> TopicConfig:
        """See :meth:`Admin.create_topic` (settings as keyword arguments)."""
        fields = create_fields(topic, partitions, **settings)
        return parse_topic_config(ok_fields(await self.client.call(Command.CREATE, fields, retry_safe=True)))

    async def alter_topic_config(self, topic: str, *, min_in_sync_replicas: int | str) -> TopicConfig:
        """See :meth:`Admin.alter_topic_config`."""
        fields = {"topic": topic, "min_in_sync_replicas": str(min_in_sync_replicas)}
        return parse_topic_config(ok_fields(await self.client.call(Command.ALTER_TOPIC_CONFIG, fields,
                                                                   retry_safe=True)))

    async def alter_topic(self, topic: str, *, min_in_sync_replicas: int | str | None = None,
                          **settings: Any) -> TopicConfig:
        """See :meth:`Admin.alter_topic` (settings as keyword arguments)."""
        patch = alter_patch(**settings)
        if not patch and min_in_sync_replicas is None:
            raise ValueError("alter_topic needs at least one setting to change")
        config = None
        await self.metadata(topic)
        if patch:
            config = await self.create_topic(topic, **patch)
        if min_in_sync_replicas is not None:
            config = await self.alter_topic_config(topic, min_in_sync_replicas=min_in_sync_replicas)
        assert config is not None
        return config

    async def delete_topic(self, topic: str, *, if_exists: bool = False) -> DeleteResult:
        """See :meth:`Admin.delete_topic`."""
        fields = {"topic": topic, "if_exists": "true" if if_exists else "false"}
        return _delete_result(await self.client.call(Command.DELETE, fields, retry_safe=if_exists), topic)

    async def truncate_topic(self, topic: str, *, expected_revision: int | None = None) -> TruncateResult:
        """See :meth:`Admin.truncate_topic`."""
        if expected_revision is None:
            expected_revision = (await self.describe_topic(topic)).revision
        fields = {"topic": topic, "expected_revision": str(expected_revision)}
        return _truncate_result(await self.client.call(Command.TRUNCATE, fields), topic)

    async def list_topics(self) -> list[str]:
        """See :meth:`Admin.list_topics`."""
        return list(_csv(ok_fields(await self.client.call(Command.LIST)).get("topics")))

    async def describe_topic(self, topic: str) -> TopicDescription:
        """See :meth:`Admin.describe_topic`."""
        return parse_describe(json_reply(await self.client.call(Command.DESCRIBE, {"topic": topic})))

    async def metadata(self, topic: str) -> TopicMetadata:
        """See :meth:`Admin.metadata`."""
        return parse_metadata(ok_fields(await self.client.call(Command.METADATA, {"topic": topic})), topic)

    async def list_offsets(self, topic: str, partition: int | None = None) -> list[PartitionOffsets]:
        """See :meth:`Admin.list_offsets`."""
        if partition is not None:
            return parse_list_offsets(ok_fields(await self.client.call(
                Command.LIST_OFFSETS, {"topic": topic, "partition": str(partition)})))
        try:
            return parse_list_offsets(ok_fields(await self.client.call(Command.LIST_OFFSETS, {"topic": topic})))
        except NotLeaderError:  # a cluster: the partitions have different leaders; ask each (redirects followed)
            count = (await self.metadata(topic)).partitions
            return [o for p in range(count) for o in await self.list_offsets(topic, p)]

    async def help(self) -> list[str]:
        """See :meth:`Admin.help`."""
        return list(_csv(ok_fields(await self.client.call(Command.HELP)).get("commands")))

    async def list_groups(self) -> list[str]:
        """See :meth:`Admin.list_groups`."""
        return list(_csv(ok_fields(await self.client.call(Command.LIST_GROUPS)).get("groups")))

    async def describe_group(self, group: str) -> dict[str, Any]:
        """See :meth:`Admin.describe_group`."""
        return json_reply(await self.client.call(Command.GROUP_STATUS, {"group": group}))

    async def group_offsets(self, group: str) -> list[GroupOffset]:
        """See :meth:`Admin.group_offsets`."""
        status = await self.describe_group(group)
        topics = sorted({str(o.get("topic")) for o in status.get("offsets") or []})
        return merge_group_offsets(status, {t: await self.list_offsets(t) for t in topics})

    async def group_lag(self, group: str) -> int:
        """See :meth:`Admin.group_lag`."""
        return sum(o.lag for o in await self.group_offsets(group))

    async def close(self) -> None:
        """Close the connections (when this admin created its client)."""
        if self._owns_client:
            await self.client.close()

    async def __aenter__(self) -> AsyncAdmin:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
