"""Versioned, deterministic metadata commands and their byte encoding.

A command is everything :func:`cursus.metadata.apply.apply` needs to compute the next state, including the
broker defaults that CREATE falls back to, so applying the same bytes to the same state always gives the
same result (the Raft FSM applies exactly these bytes). The encoding is sorted-key compact JSON with a
``v`` (format version) and a ``type`` field; decoding is strict (unknown or missing fields raise).

Every command has a ``request_id`` (a retried command applies once) and topic commands an optional
``expected_revision``: compare-and-set on the topic's revision (0 = the topic must not exist).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cursus.metadata.state import BrokerInfo
from cursus.metadata.topics import TopicDefinition, TopicSpec
from cursus.params import parse_args
from cursus.transactions.state import TxnEntry
from cursus.wire.errors import BrokerError

COMMAND_VERSION = 1


@dataclass(frozen=True, slots=True)
class CreateTopic:
    """CREATE: a new topic, or a presence-aware patch of an existing one (spec "CREATE").

    ``spec`` is the request's validated arguments (a :class:`TopicSpec`, encoded as its canonical fields);
    the defaults are the broker's ``default_partitions`` and ``log_cleanup_policy``.
    """

    request_id: str
    spec: TopicSpec
    default_partitions: int = 1
    default_cleanup_policy: str = "delete"
    expected_revision: int | None = None
    default_replication_factor: int = 1

    @property
    def topic(self) -> str:
        return self.spec.topic


@dataclass(frozen=True, slots=True)
class PutTopic:
    """Install a complete definition (broker-owned topics such as ``__consumer_offsets``, manifest restore).

    The partition count may only grow; a changed definition gets at least the current revision + 1.
    """

    request_id: str
    definition: TopicDefinition
    expected_revision: int | None = None


@dataclass(frozen=True, slots=True)
class AlterTopicConfig:
    """ALTER_TOPIC_CONFIG: replace the min-ISR override (None = the broker default)."""

    request_id: str
    topic: str
    min_in_sync_replicas: int | None
    expected_revision: int | None = None


@dataclass(frozen=True, slots=True)
class DeleteTopic:
    """DELETE: remove the topic and its partition assignments."""

    request_id: str
    topic: str
    expected_revision: int | None = None


@dataclass(frozen=True, slots=True)
class TruncateTopic:
    """TRUNCATE (the Raft log's TOPIC_TRUNCATE transition): keep the definition, bump its revision and
    lifecycle epoch, and reset every partition to committed HWM 0 under the new lifecycle epoch and the next
    leader epoch. ``expected_revision`` is required (spec TRUNCATE)."""

    request_id: str
    topic: str
    expected_revision: int


@dataclass(frozen=True, slots=True)
class RegisterBroker:
    """Add or update a broker registration (id, addresses, status)."""

    request_id: str
    broker: BrokerInfo


@dataclass(frozen=True, slots=True)
class BrokerHeartbeat:
    """A cluster broker's liveness heartbeat: register or refresh it as ``active``.

    ``coordinator_shards`` is the broker's configured ``transaction_coordinator_shards``: the first
    heartbeat fixes the cluster's count, a broker configured with another count is refused
    (``cluster_join_failed``). A broker returning from ``inactive`` leads again every leaderless partition
    whose ISR is just itself (the last ISR member holds the committed data).
    """

    request_id: str
    broker: BrokerInfo
    coordinator_shards: int


@dataclass(frozen=True, slots=True)
class FenceBroker:
    """The controller saw no heartbeat of ``broker_id`` in time: mark it ``inactive``; it leaves every ISR.

    A partition it led gets the first remaining ISR member (replica order) as leader, leader epoch + 1; a
    partition whose ISR was only this broker becomes leaderless (leader None, epoch + 1, ISR kept as the
    last member: never an unclean election).
    """

    request_id: str
    broker_id: str


@dataclass(frozen=True, slots=True)
class ElectLeader:
    """ELECT_LEADER: make ``broker_id`` the leader of one partition (spec "ELECT_LEADER").

    The target must be active and in both the replicas and the ISR; ``expected_leader_epoch`` (None: the
    current one) must match; the epoch grows by exactly one. Electing the current leader changes nothing.
    """

    request_id: str
    topic: str
    partition: int
    broker_id: str
    expected_leader_epoch: int | None = None


@dataclass(frozen=True, slots=True)
class ChangeIsr:
    """Replace a partition's ISR (the replication pipeline's shrink/expand), fenced by the leader epoch.

    ``isr`` must contain the leader and be a subset of the replicas; it is stored in replica order.
    """

    request_id: str
    topic: str
    partition: int
    leader_epoch: int
    isr: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class HwmEntry:
    """One partition's candidate committed HWM (records, half-open) under the leader's epochs."""

    topic: str
    partition: int
    leader_epoch: int
    lifecycle_epoch: int
    hwm: int


@dataclass(frozen=True, slots=True)
class CommitHwm:
    """The partition leader ``broker_id`` commits the HWMs of many partitions (coalesced, group commit).

    Each entry is applied on its own: accepted only when ``broker_id`` still leads the partition, the
    leader epoch and lifecycle epoch match the assignment and ``hwm`` is above the committed HWM (a
    committed HWM never moves back). Other entries are skipped with a reason; one stale entry never fails
    the command. Resubmitting the same entries is harmless (monotonic), so an unknown outcome may be
    retried with a new request id.
    """

    request_id: str
    broker_id: str
    entries: tuple[HwmEntry, ...]


@dataclass(frozen=True, slots=True)
class GroupRecords:
    """The group coordinator on ``origin`` appends records of one consumer group (cluster only).

    ``records`` are the payload texts of :mod:`cursus.coordinator.offsets` records (revisions and
    timestamps stamped by the origin), applied all-or-nothing by the fold rules of
    :mod:`cursus.metadata.groups`: ``origin`` must own ``group`` on the ring of active brokers in the
    state the command is applied to, and ``sequence`` must be the group's sequence + 1. The encoded
    command stays under the Raft cap (64 KiB); the submitter refuses larger ones before submitting.
    """

    request_id: str
    group: str
    origin: str
    sequence: int
    records: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class TxnSync:
    """The transaction coordinator on ``origin`` persists transitions of one shard (cluster only; the
    reference's ``TXN_SYNC``): the same per-transactional-id snapshots the standalone journal appends.

    Applied only when ``origin`` owns ``shard`` at ``shard_epoch`` in the state it is applied to (else
    ``NOT_COORDINATOR owner=``: a previous owner is fenced), every entry's id maps to ``shard`` and no
    entry's producer epoch moves back. ``next_producer_id`` raises the shard's counter; ``touched`` adds
    partitions that take transactional records. ``expect`` = (producerId, epoch), when set: every entry's id
    must hold exactly that session in the state it is applied to (else ``producer_fenced``): the guard of
    INIT_PRODUCER_ID ``producerId= epoch=`` checked in Raft order. Encoded only when set.
    """

    request_id: str
    origin: str
    shard: int
    shard_epoch: int
    entries: tuple[TxnEntry, ...]
    next_producer_id: int = 1
    touched: tuple[tuple[str, int], ...] = ()
    expect: tuple[str, int] | None = None


Command = (CreateTopic | PutTopic | AlterTopicConfig | DeleteTopic | TruncateTopic | RegisterBroker | BrokerHeartbeat
           | FenceBroker | ElectLeader | ChangeIsr | CommitHwm | GroupRecords | TxnSync)

_TYPES: dict[str, type] = {
    "create_topic": CreateTopic,
    "put_topic": PutTopic,
    "alter_topic_config": AlterTopicConfig,
    "delete_topic": DeleteTopic,
    "truncate_topic": TruncateTopic,
    "register_broker": RegisterBroker,
    "broker_heartbeat": BrokerHeartbeat,
    "fence_broker": FenceBroker,
    "elect_leader": ElectLeader,
    "change_isr": ChangeIsr,
    "commit_hwm": CommitHwm,
    "group_records": GroupRecords,
    "txn_sync": TxnSync,
}
_NAMES = {cls: name for name, cls in _TYPES.items()}


def _body(command: Command) -> dict[str, Any]:
    if isinstance(command, CreateTopic):
        return {"spec": command.spec.to_fields(),
                "default_partitions": command.default_partitions,
                "default_cleanup_policy": command.default_cleanup_policy,
                "default_replication_factor": command.default_replication_factor,
                "expected_revision": command.expected_revision}
    if isinstance(command, PutTopic):
        return {"definition": command.definition.to_manifest(), "expected_revision": command.expected_revision}
    if isinstance(command, AlterTopicConfig):
        return {"topic": command.topic, "min_in_sync_replicas": command.min_in_sync_replicas,
                "expected_revision": command.expected_revision}
    if isinstance(command, (DeleteTopic, TruncateTopic)):
        return {"topic": command.topic, "expected_revision": command.expected_revision}
    if isinstance(command, BrokerHeartbeat):
        return {"broker": command.broker.to_dict(), "coordinator_shards": command.coordinator_shards}
    if isinstance(command, FenceBroker):
        return {"broker_id": command.broker_id}
    if isinstance(command, ElectLeader):
        return {"topic": command.topic, "partition": command.partition, "broker_id": command.broker_id,
                "expected_leader_epoch": command.expected_leader_epoch}
    if isinstance(command, ChangeIsr):
        return {"topic": command.topic, "partition": command.partition, "leader_epoch": command.leader_epoch,
                "isr": list(command.isr)}
    if isinstance(command, CommitHwm):
        return {"broker_id": command.broker_id,
                "entries": [[e.topic, e.partition, e.leader_epoch, e.lifecycle_epoch, e.hwm]
                            for e in command.entries]}
    if isinstance(command, GroupRecords):
        return {"group": command.group, "origin": command.origin, "sequence": command.sequence,
                "records": list(command.records)}
    if isinstance(command, TxnSync):
        body: dict[str, Any] = {
            "origin": command.origin, "shard": command.shard, "shard_epoch": command.shard_epoch,
            "entries": [e.to_json() for e in command.entries], "next_producer_id": command.next_producer_id,
            "touched": [list(tp) for tp in command.touched]}
        if command.expect is not None:
            body["expect"] = list(command.expect)
        return body
    return {"broker": command.broker.to_dict()}


def encode(command: Command) -> bytes:
    """The canonical bytes of ``command`` (sorted-key compact JSON, UTF-8)."""
    doc = {"v": COMMAND_VERSION, "type": _NAMES[type(command)], "request_id": command.request_id,
           **_body(command)}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _opt_int(value: Any) -> int | None:
    if value is not None and type(value) is not int:
        raise ValueError(f"expected an integer or null, got {value!r}")
    return value


def _int(value: Any) -> int:
    if type(value) is not int:
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


_FIELDS = {
    "create_topic": {"spec", "default_partitions", "default_cleanup_policy", "default_replication_factor",
                     "expected_revision"},
    "put_topic": {"definition", "expected_revision"},
    "alter_topic_config": {"topic", "min_in_sync_replicas", "expected_revision"},
    "delete_topic": {"topic", "expected_revision"},
    "truncate_topic": {"topic", "expected_revision"},
    "register_broker": {"broker"},
    "broker_heartbeat": {"broker", "coordinator_shards"},
    "fence_broker": {"broker_id"},
    "elect_leader": {"topic", "partition", "broker_id", "expected_leader_epoch"},
    "change_isr": {"topic", "partition", "leader_epoch", "isr"},
    "commit_hwm": {"broker_id", "entries"},
    "group_records": {"group", "origin", "sequence", "records"},
    "txn_sync": {"origin", "shard", "shard_epoch", "entries", "next_producer_id", "touched"},
}
#: Fields a command may carry in addition to :data:`_FIELDS` (encoded only when set).
_OPTIONAL_FIELDS: dict[str, set[str]] = {"txn_sync": {"expect"}}


def _hwm_entry(row: Any) -> HwmEntry:
    if not isinstance(row, list) or len(row) != 5:
        raise ValueError("a commit_hwm entry is [topic, partition, leader_epoch, lifecycle_epoch, hwm]")
    topic, partition, leader_epoch, lifecycle_epoch, hwm = row
    entry = HwmEntry(_str(topic), _int(partition), _int(leader_epoch), _int(lifecycle_epoch), _int(hwm))
    if min(entry.partition, entry.leader_epoch, entry.lifecycle_epoch, entry.hwm) < 0:
        raise ValueError("commit_hwm entry values must not be negative")
    return entry


def decode(data: bytes) -> Command:
    """Parse command bytes strictly. Raises ValueError (bad JSON, version, type, fields or value types)."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"bad metadata command: {exc}") from None
    if not isinstance(doc, dict) or doc.get("v") != COMMAND_VERSION:
        raise ValueError("bad metadata command version")
    kind = doc.get("type")
    if kind not in _TYPES or set(doc) - _OPTIONAL_FIELDS.get(kind, set()) != _FIELDS[kind] | {"v", "type",
                                                                                             "request_id"}:
        raise ValueError(f"bad metadata command fields for {kind!r}")
    request_id = _str(doc["request_id"])
    try:
        if kind == "create_topic":
            fields = doc["spec"]
            if not isinstance(fields, dict) or not all(isinstance(v, str) for v in fields.values()):
                raise ValueError("spec must map strings to strings")
            try:
                spec = parse_args(TopicSpec, fields, "CREATE")
            except BrokerError as exc:
                raise ValueError(f"bad CREATE spec: {exc.error.code}") from None
            return CreateTopic(request_id, spec, _int(doc["default_partitions"]),
                               _str(doc["default_cleanup_policy"]), _opt_int(doc["expected_revision"]),
                               _int(doc["default_replication_factor"]))
        if kind == "put_topic":
            return PutTopic(request_id, TopicDefinition.from_manifest(doc["definition"]),
                            _opt_int(doc["expected_revision"]))
        if kind == "alter_topic_config":
            return AlterTopicConfig(request_id, _str(doc["topic"]), _opt_int(doc["min_in_sync_replicas"]),
                                    _opt_int(doc["expected_revision"]))
        if kind == "delete_topic":
            return DeleteTopic(request_id, _str(doc["topic"]), _opt_int(doc["expected_revision"]))
        if kind == "truncate_topic":
            return TruncateTopic(request_id, _str(doc["topic"]), _int(doc["expected_revision"]))
        if kind == "fence_broker":
            return FenceBroker(request_id, _str(doc["broker_id"]))
        if kind == "elect_leader":
            return ElectLeader(request_id, _str(doc["topic"]), _int(doc["partition"]), _str(doc["broker_id"]),
                               _opt_int(doc["expected_leader_epoch"]))
        if kind == "change_isr":
            if not isinstance(doc["isr"], list):
                raise ValueError("isr must be a list")
            return ChangeIsr(request_id, _str(doc["topic"]), _int(doc["partition"]), _int(doc["leader_epoch"]),
                             tuple(_str(b) for b in doc["isr"]))
        if kind == "commit_hwm":
            if not isinstance(doc["entries"], list):
                raise ValueError("entries must be a list")
            return CommitHwm(request_id, _str(doc["broker_id"]), tuple(_hwm_entry(e) for e in doc["entries"]))
        if kind == "group_records":
            if not isinstance(doc["records"], list):
                raise ValueError("records must be a list")
            sequence = _int(doc["sequence"])
            if sequence < 1:
                raise ValueError("group_records sequence must be >= 1")
            return GroupRecords(request_id, _str(doc["group"]), _str(doc["origin"]), sequence,
                                tuple(_str(r) for r in doc["records"]))
        if kind == "txn_sync":
            if not isinstance(doc["entries"], list) or not isinstance(doc["touched"], list):
                raise ValueError("entries and touched must be lists")
            touched = []
            for row in doc["touched"]:
                if not isinstance(row, list) or len(row) != 2:
                    raise ValueError("a touched partition is [topic, partition]")
                touched.append((_str(row[0]), _int(row[1])))
            expect = None
            if "expect" in doc:
                raw = doc["expect"]
                if not isinstance(raw, list) or len(raw) != 2:
                    raise ValueError("expect is [producer_id, epoch]")
                expect = (_str(raw[0]), _int(raw[1]))
            return TxnSync(request_id, _str(doc["origin"]), _int(doc["shard"]), _int(doc["shard_epoch"]),
                           tuple(TxnEntry.from_json(e) for e in doc["entries"]), _int(doc["next_producer_id"]),
                           tuple(touched), expect)
        if not isinstance(doc["broker"], dict):
            raise ValueError("broker must be an object")
        broker = BrokerInfo.from_dict(doc["broker"])
        if kind == "broker_heartbeat":
            return BrokerHeartbeat(request_id, broker, _int(doc["coordinator_shards"]))
        return RegisterBroker(request_id, broker)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"bad metadata command: {exc}") from None
