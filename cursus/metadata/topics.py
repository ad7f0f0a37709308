"""Topic definitions: validation, CREATE patch semantics and the standalone manifest.

A :class:`TopicDefinition` is the authoritative, revisioned description of a topic. CREATE on an existing
topic is a presence-aware patch (spec "CREATE"): omitted fields keep their value, explicit values apply,
the partition count only grows, immutable fields may be restated but not changed, and the revision bumps
only on an effective change.

Standalone mode persists every definition in ``{log_dir}/__topic_metadata.json`` (manifest format 3,
facts B6), replaced atomically before a change becomes visible.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cursus.params import Args, Converter, param
from cursus.parsing import parse_int
from cursus.storage.atomic import atomic_write
from cursus.wire.errors import BrokerError

MANIFEST_NAME = "__topic_metadata.json"
MANIFEST_VERSION = 3
MANIFEST_MAX_BYTES = 16 * 1024 * 1024
#: Upper bound on partitions per topic: keeps per-partition state (files, fds, memory) bounded.
MAX_PARTITIONS = 4096

_TOPIC_NAME = re.compile(r"[A-Za-z0-9._=-]{1,249}")
INTERNAL_TOPIC_PREFIX = "__"
CLEANUP_POLICIES = ("delete", "compact", "delete,compact")
PARTITIONERS = ("hash_key", "round_robin")
AUTH_POLICIES = ("open", "deny_write", "deny_read", "acl")


def validate_topic_name(name: str | None, *, command: str) -> str:
    """Check the portable topic-name rule (spec CREATE): 1-249 ASCII letters, digits, ``. _ - =``.

    Raises:
        BrokerError: ``missing_topic`` when absent, ``invalid_topic_name`` when the rule is broken.
    """
    if name is None or name == "":
        raise BrokerError.of("missing_topic", command=command)
    if not _TOPIC_NAME.fullmatch(name) or name in (".", ".."):
        raise BrokerError.of("invalid_topic_name", topic=name, reason="must be 1-249 of A-Z a-z 0-9 . _ - =")
    return name


def is_internal_topic(name: str) -> bool:
    """Broker-owned topics (``__consumer_offsets`` and friends) start with ``__``."""
    return name.startswith(INTERNAL_TOPIC_PREFIX)


@dataclass(frozen=True, slots=True)
class TopicPolicy:
    """Per-topic policy (manifest ``policy`` object)."""

    cleanup_policy: str = "delete"
    partitioner: str = "hash_key"
    auth_policy: str = "open"
    read_acl: tuple[str, ...] = ()
    write_acl: tuple[str, ...] = ()
    retention_hours: int = 0
    retention_bytes: int = 0


@dataclass(frozen=True, slots=True)
class TopicDefinition:
    """The authoritative definition of one topic (manifest format 3 entry)."""

    name: str
    partitions: int
    revision: int = 1
    replication_factor: int = 1
    lifecycle_epoch: int = 0
    idempotent: bool = False
    event_sourcing: bool = False
    policy: TopicPolicy = field(default_factory=TopicPolicy)
    min_in_sync_replicas: int | None = None
    #: Retained aggregate replay (spec "Aggregate replay proof"); needs event_sourcing and idempotent.
    aggregate_replay: bool = False

    def effective_min_isr(self, broker_default: int) -> int:
        return self.min_in_sync_replicas if self.min_in_sync_replicas is not None else broker_default

    def to_manifest(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "name": self.name,
            "revision": self.revision,
            "partitions": self.partitions,
            "replication_factor": self.replication_factor,
            "lifecycle_epoch": self.lifecycle_epoch,
            "idempotent": self.idempotent,
            "event_sourcing": self.event_sourcing,
            "policy": {
                "cleanup_policy": self.policy.cleanup_policy,
                "partitioner": self.policy.partitioner,
                "auth_policy": self.policy.auth_policy,
                "read_acl": list(self.policy.read_acl),
                "write_acl": list(self.policy.write_acl),
                "retention_hours": self.policy.retention_hours,
                "retention_bytes": self.policy.retention_bytes,
            },
        }
        if self.min_in_sync_replicas is not None:
            entry["min_in_sync_replicas"] = self.min_in_sync_replicas
        if self.aggregate_replay:
            entry["aggregate_replay"] = True
        return entry

    @classmethod
    def from_manifest(cls, entry: Mapping[str, Any]) -> TopicDefinition:
        """Strictly parse one manifest entry; unknown or missing fields raise ValueError."""
        required = {"name", "revision", "partitions", "replication_factor", "lifecycle_epoch", "idempotent",
                    "event_sourcing", "policy"}
        allowed = required | {"min_in_sync_replicas", "aggregate_replay"}
        if not isinstance(entry, Mapping) or set(entry) - allowed or required - set(entry):
            raise ValueError(f"bad manifest topic entry fields: {sorted(entry) if isinstance(entry, Mapping) else entry!r}")
        pol = entry["policy"]
        pol_fields = {"cleanup_policy", "partitioner", "auth_policy", "read_acl", "write_acl", "retention_hours",
                      "retention_bytes"}
        if not isinstance(pol, Mapping) or set(pol) != pol_fields:
            raise ValueError(f"bad manifest policy for topic {entry['name']!r}")
        ints = [entry["revision"], entry["partitions"], entry["replication_factor"], entry["lifecycle_epoch"],
                pol["retention_hours"], pol["retention_bytes"]]
        if not all(type(v) is int for v in ints) or not isinstance(entry["name"], str):
            raise ValueError(f"bad manifest value types for topic {entry['name']!r}")
        min_isr = entry.get("min_in_sync_replicas")
        if min_isr is not None and type(min_isr) is not int:
            raise ValueError(f"bad min_in_sync_replicas for topic {entry['name']!r}")
        return cls(
            name=entry["name"],
            partitions=entry["partitions"],
            revision=entry["revision"],
            replication_factor=entry["replication_factor"],
            lifecycle_epoch=entry["lifecycle_epoch"],
            idempotent=bool(entry["idempotent"]),
            event_sourcing=bool(entry["event_sourcing"]),
            policy=TopicPolicy(
                cleanup_policy=pol["cleanup_policy"],
                partitioner=pol["partitioner"],
                auth_policy=pol["auth_policy"],
                read_acl=tuple(pol["read_acl"]),
                write_acl=tuple(pol["write_acl"]),
                retention_hours=pol["retention_hours"],
                retention_bytes=pol["retention_bytes"],
            ),
            min_in_sync_replicas=min_isr,
            aggregate_replay=entry.get("aggregate_replay") is True,
        )


# ---------------------------------------------------------------------------------------------- CREATE


def topic_name(raw: str, command: str) -> str:
    """`invalid_topic_name` unless 1-249 of A-Z a-z 0-9 . _ - ="""
    return validate_topic_name(raw, command=command)


def _positive(code: str, maximum: int | None = None) -> Converter:
    def convert(raw: str, command: str) -> int:
        value = parse_int(raw, minimum=1)
        if value is None:
            raise BrokerError.of(code, reason="must be a positive integer", value=raw)
        if maximum is not None and value > maximum:
            raise BrokerError.of(code, reason=f"at most {maximum}", value=value)
        return value
    convert.__doc__ = f"`{code}` unless an integer >= 1" + (f" and <= {maximum}" if maximum else "")
    return convert


def _non_negative(code: str) -> Converter:
    def convert(raw: str, command: str) -> int:
        value = parse_int(raw, minimum=0)
        if value is None:
            raise BrokerError.of(code, value=raw)
        return value
    convert.__doc__ = f"`{code}` unless an integer >= 0"
    return convert


def _policy_choice(key: str, choices: tuple[str, ...]) -> Converter:
    def convert(raw: str, command: str) -> str:
        if raw not in choices:
            raise BrokerError.of("invalid_topic_policy", field=key, reason=f"invalid {key} {raw}")
        return raw
    convert.__doc__ = f"`invalid_topic_policy` unless one of {', '.join(choices)}"
    return convert


def min_isr_value(raw: str, command: str) -> int | str:
    """`invalid_min_in_sync_replicas` unless an integer >= 1 or `default`"""
    if raw == "default":
        return "default"
    value = parse_int(raw, minimum=1)
    if value is None:
        raise BrokerError.of("invalid_min_in_sync_replicas", value=raw)
    return value


@dataclass(frozen=True)
class TopicSpec(Args):
    """CREATE topic= [partitions=] [...policy]: a new topic or a presence-aware patch (None = omitted).

    The request's typed arguments and, unchanged, the payload of the ``CreateTopic`` metadata command:
    :meth:`to_fields` is its canonical wire form and :func:`cursus.params.parse_args` reads it back.
    """

    STRICT = True
    # An empty value is a malformed value here, never an omission (a typo must not silently keep a default).
    topic: str = param(kind="custom", convert=topic_name, required=True, doc="topic name")
    partitions: int | None = param(
        empty_ok=True, kind="custom", convert=_positive("invalid_partitions", MAX_PARTITIONS),
                                   doc="partition count (only grows)")
    replication_factor: int | None = param(
        empty_ok=True, kind="custom", convert=_positive("invalid_replication_factor"),
                                           doc="standalone stores 1")
    idempotent: bool | None = param(empty_ok=True, kind="bool", invalid="invalid_idempotent", doc="immutable")
    event_sourcing: bool | None = param(
        empty_ok=True, kind="bool", invalid="invalid_event_sourcing", doc="immutable")
    cleanup_policy: str | None = param(
        empty_ok=True, kind="custom", convert=_policy_choice("cleanup_policy", CLEANUP_POLICIES))
    partitioner: str | None = param(
        empty_ok=True, kind="custom", convert=_policy_choice("partitioner", PARTITIONERS))
    auth_policy: str | None = param(
        empty_ok=True, kind="custom", convert=_policy_choice("auth_policy", AUTH_POLICIES))
    retention_hours: int | None = param(
        empty_ok=True, kind="custom", convert=_non_negative("invalid_retention_hours"),
                                        doc="0 = the broker default")
    retention_bytes: int | None = param(
        empty_ok=True, kind="custom", convert=_non_negative("invalid_retention_bytes"),
                                        doc="0 = the broker default")
    read_acl: tuple[str, ...] | None = param(kind="csv", empty_ok=True, doc="principals (empty clears)")
    write_acl: tuple[str, ...] | None = param(kind="csv", empty_ok=True, doc="principals (empty clears)")
    min_in_sync_replicas: int | str | None = param(empty_ok=True, kind="custom", convert=min_isr_value,
                                                   doc="N (at most the stored replication factor) or default")
    aggregate_replay: bool | None = param(
        empty_ok=True, kind="bool", invalid="invalid_topic_policy",
        doc="immutable; needs event_sourcing=true idempotent=true")

    def to_fields(self) -> dict[str, str]:
        """The canonical CRQ2 fields of this spec (present values only); parses back to an equal spec."""
        out: dict[str, str] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, bool):
                out[f.name] = "true" if value else "false"
            elif isinstance(value, tuple):
                out[f.name] = ",".join(value)
            else:
                out[f.name] = str(value)
        return out


def is_compacted_policy(cleanup_policy: str) -> bool:
    """True for ``compact`` and ``delete,compact`` (the log cleaner keeps the latest record per key)."""
    return "compact" in cleanup_policy.split(",")


def apply_create(
    current: TopicDefinition | None,
    spec: TopicSpec,
    *,
    default_partitions: int,
    default_cleanup_policy: str,
    max_replication_factor: int = 1,
    default_replication_factor: int = 1,
) -> TopicDefinition:
    """Build a new definition, or patch ``current``, from a validated CREATE spec (spec "CREATE", facts B5).

    A new topic records the requested replication factor capped at ``max_replication_factor`` (the active
    brokers; standalone 1, facts decision 11), and a min-ISR override must not exceed the *stored*
    replication factor (so acks=all stays writable). Restating any value is not a change. Returns
    ``current`` itself when nothing effectively changes.

    Raises:
        BrokerError: ``invalid_partitions`` (shrink), ``invalid_idempotent`` / ``invalid_event_sourcing``
            (immutable), ``invalid_min_in_sync_replicas`` (above the stored replication factor),
            ``invalid_topic_policy`` (``compact`` or ``delete,compact`` for an event-sourcing topic).
    """
    name = spec.topic
    # The replication factor that will be stored: a new topic gets the requested value capped by the
    # brokers available for placement (standalone: 1, facts decision 11); an existing topic keeps its own.
    stored_rf = current.replication_factor if current else min(spec.replication_factor or default_replication_factor,
                                                                max(1, max_replication_factor))
    min_isr = spec.min_in_sync_replicas
    if isinstance(min_isr, int):
        check_min_isr(min_isr, stored_rf)

    _check_event_sourcing_policy(current, spec)
    # Compaction (spec "ALTER_TOPIC_CONFIG"): an event-sourcing topic needs its whole history, so neither a new
    # nor an existing one may be compacted (a restated event_sourcing=false cannot bypass this).
    cleanup = spec.cleanup_policy if spec.cleanup_policy is not None else (
        current.policy.cleanup_policy if current is not None else default_cleanup_policy)
    event_sourcing = current.event_sourcing if current is not None else bool(spec.event_sourcing)
    if is_compacted_policy(cleanup) and (event_sourcing or bool(spec.event_sourcing)):
        raise BrokerError.of("invalid_topic_policy", field="cleanup_policy", value=cleanup,
                             reason="event-sourcing topics cannot be compacted")

    if current is None:
        policy = TopicPolicy(
            cleanup_policy=spec.cleanup_policy or default_cleanup_policy,
            partitioner=spec.partitioner or "hash_key",
            auth_policy=spec.auth_policy or "open",
            read_acl=spec.read_acl or (),
            write_acl=spec.write_acl or (),
            retention_hours=spec.retention_hours or 0,
            retention_bytes=spec.retention_bytes or 0,
        )
        return TopicDefinition(
            name=name,
            partitions=spec.partitions or default_partitions,
            revision=1,
            replication_factor=stored_rf,
            lifecycle_epoch=0,
            idempotent=bool(spec.idempotent),
            event_sourcing=bool(spec.event_sourcing),
            policy=policy,
            min_in_sync_replicas=min_isr if isinstance(min_isr, int) else None,
            aggregate_replay=bool(spec.aggregate_replay),
        )

    if spec.partitions is not None and spec.partitions < current.partitions:
        raise BrokerError.of("invalid_partitions", reason="partition count can only increase",
                             current=current.partitions, value=spec.partitions)
    if spec.idempotent is not None and spec.idempotent != current.idempotent:
        raise BrokerError.of("invalid_idempotent", value=str(spec.idempotent).lower(),
                             reason="immutable after creation")
    if spec.event_sourcing is not None and spec.event_sourcing != current.event_sourcing:
        raise BrokerError.of("invalid_event_sourcing", value=str(spec.event_sourcing).lower(),
                             reason="immutable after creation")
    pol = current.policy

    def keep(new: Any, old: Any) -> Any:
        return old if new is None else new

    new_policy = TopicPolicy(
        cleanup_policy=keep(spec.cleanup_policy, pol.cleanup_policy),
        partitioner=keep(spec.partitioner, pol.partitioner),
        auth_policy=keep(spec.auth_policy, pol.auth_policy),
        read_acl=keep(spec.read_acl, pol.read_acl),
        write_acl=keep(spec.write_acl, pol.write_acl),
        retention_hours=keep(spec.retention_hours, pol.retention_hours),
        retention_bytes=keep(spec.retention_bytes, pol.retention_bytes),
    )
    if min_isr is None:
        new_min_isr = current.min_in_sync_replicas
    else:
        new_min_isr = None if min_isr == "default" else int(min_isr)
    patched = dataclasses.replace(
        current,
        partitions=keep(spec.partitions, current.partitions),
        policy=new_policy,
        min_in_sync_replicas=new_min_isr,
    )
    if patched == current:
        return current
    return dataclasses.replace(patched, revision=current.revision + 1)


def _check_event_sourcing_policy(current: TopicDefinition | None, spec: TopicSpec) -> None:
    """Aggregate-replay rules of CREATE (spec "Event Sourcing Commands", "Aggregate replay proof"; the
    compaction refusal of event-sourcing topics is in :func:`apply_create`): ``aggregate_replay`` needs
    ``event_sourcing=true idempotent=true`` and is immutable; the partition count of every event-sourcing
    topic never changes (keys must keep their partition).

    Raises:
        BrokerError: ``invalid_topic_policy``.
    """
    if current is None:
        if spec.aggregate_replay and not (spec.event_sourcing and spec.idempotent):
            raise BrokerError.of("invalid_topic_policy", field="aggregate_replay",
                                 reason="aggregate_replay needs event_sourcing=true idempotent=true")
        return
    if spec.aggregate_replay is not None and spec.aggregate_replay != current.aggregate_replay:
        raise BrokerError.of("invalid_topic_policy", field="aggregate_replay",
                             value=str(spec.aggregate_replay).lower(), reason="immutable after creation")
    if current.event_sourcing and spec.partitions is not None and spec.partitions != current.partitions:
        # keys route by hash modulo the partition count: another count would move existing aggregates to a
        # partition without their stream (version 0 again, a forked stream)
        raise BrokerError.of("invalid_topic_policy", field="partitions", value=spec.partitions,
                             reason="event-sourcing topics keep their partition count")


def check_min_isr(value: int, replication_factor: int) -> int:
    """A min-ISR override must lie in ``1..replication_factor`` (the topic's *stored* replication factor).

    Raises:
        BrokerError: ``invalid_min_in_sync_replicas``.
    """
    if not 1 <= value <= replication_factor:
        raise BrokerError.of("invalid_min_in_sync_replicas", value=value,
                             reason=f"must be between 1 and the replication factor {replication_factor}")
    return value


def definition_fields(defn: TopicDefinition, broker_min_isr: int) -> list[tuple[str, object]]:
    """The CREATE reply fields in the reference order (facts B5)."""
    return [
        ("topic", defn.name),
        ("partitions", defn.partitions),
        ("cleanup_policy", defn.policy.cleanup_policy),
        ("partitioner", defn.policy.partitioner),
        ("auth_policy", defn.policy.auth_policy),
        ("read_acl", ",".join(defn.policy.read_acl)),
        ("write_acl", ",".join(defn.policy.write_acl)),
        ("retention_hours", defn.policy.retention_hours),
        ("retention_bytes", defn.policy.retention_bytes),
        ("revision", defn.revision),
        ("replication_factor", defn.replication_factor),
        ("idempotent", defn.idempotent),
        ("event_sourcing", defn.event_sourcing),
        ("lifecycle_epoch", defn.lifecycle_epoch),
        ("min_in_sync_replicas",
         defn.min_in_sync_replicas if defn.min_in_sync_replicas is not None else "default"),
        ("effective_min_in_sync_replicas", defn.effective_min_isr(broker_min_isr)),
    ] + ([("aggregate_replay", True)] if defn.aggregate_replay else [])


# -------------------------------------------------------------------------------------------- manifest


class ManifestError(RuntimeError):
    """The topic manifest is unreadable, malformed, or missing while topic data exists."""


def load_manifest(log_dir: Path) -> dict[str, TopicDefinition]:
    """Read ``__topic_metadata.json`` (only version 3). A missing file is an empty catalog.

    Raises:
        ManifestError: oversized, unparsable, wrong version, unknown fields, duplicate names.
    """
    path = log_dir / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    if len(raw) > MANIFEST_MAX_BYTES:
        raise ManifestError(f"{path}: larger than {MANIFEST_MAX_BYTES} bytes")
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or set(doc) != {"version", "topics"}:
            raise ValueError("top level must be {version, topics}")
        if doc["version"] != MANIFEST_VERSION:
            raise ValueError(f"unsupported manifest version {doc['version']!r} (want {MANIFEST_VERSION})")
        topics: dict[str, TopicDefinition] = {}
        for entry in doc["topics"]:
            defn = TopicDefinition.from_manifest(entry)
            if defn.name in topics:
                raise ValueError(f"duplicate topic {defn.name!r}")
            topics[defn.name] = defn
        return topics
    except (ValueError, TypeError, KeyError) as exc:
        raise ManifestError(f"{path}: {exc}") from None


def save_manifest(log_dir: Path, topics: Mapping[str, TopicDefinition]) -> None:
    """Atomically replace the manifest (temp file, fsync, rename, directory fsync). Raises OSError."""
    doc = {"version": MANIFEST_VERSION, "topics": [topics[n].to_manifest() for n in sorted(topics)]}
    atomic_write(log_dir / MANIFEST_NAME, json.dumps(doc, indent=2).encode("utf-8") + b"\n")
