"""Durable group records in the internal ``__consumer_offsets`` topic: codec, replay, compaction.

This module is pure (no I/O): the record codec and the latest-record bookkeeping replay uses. The standalone
:class:`~cursus.coordinator.ports.GroupLog` that writes these records to the internal topic and replays it
is :class:`cursus.broker.group_log.OffsetsTopicLog`; the log cleaner compacts it with
:class:`cursus.coordinator.offsets_compaction.OffsetsPlanner`.

Spec "Offset Lifecycle and Delivery Guarantees", facts B6 ``__consumer_offsets``, decision 16 (formats ours).

**Records.** Each record is an ordinary CBV2 record of the internal topic whose ``key`` names what it is about
and whose payload is one compact JSON object (field order as listed; decoding is strict: unknown or missing
fields, wrong types, an unknown ``version``/``type`` pair or a key that does not match the content are
errors):

==============================  =====================================================================
``group_registration`` v1       ``version, type, group, topic, partition_count, epoch, revision, timestamp``
``group_registration`` v2       ``version, type, group, topics | topic_pattern, topic_partitions[{topic,
                                partition}], epoch, revision, timestamp`` (multi-topic subscriptions)
``group_tombstone`` v1          ``version, type, group, epoch, revision, timestamp``
``offset_snapshot`` v1          ``version, type, group, topic, epoch, revision, offsets[{partition,
                                offset}], timestamp``: every committed offset of one (group, topic)
``group_membership`` v4         ``version, type, group, epoch, revision, generation, members[{member_id,
                                assignments[{topic, partition}]}], timestamp``
==============================  =====================================================================

Keys: ``cursus.consumer.group.v1.<sha256(group)>`` (registrations and tombstones),
``cursus.consumer.offset.v1.<sha256(group \\0 topic)>`` and ``cursus.consumer.member.v1.<sha256(group)>``.
``epoch`` is the group's lifecycle epoch (a name registered again after a tombstone gets a higher one);
``revision`` counts the writes of one key. Per key, (epoch, revision) never decreases along the log.

**Placement.** Every record of a group goes to partition ``crc32(group) % partitions`` of the internal topic,
so one partition's log order is the group's history, and an acknowledged write implies that every earlier
write of the same group is durable too.

**Replay** reads every retained record before the broker reports ready and keeps the latest record per key.
A record that fails to decode, an unversioned record, a key whose (epoch, revision) goes backwards, offsets or
a membership newer than their group's registration, or a record in the wrong partition raise
:class:`ReplayError`: the broker stays not ready rather than start with an empty coordinator.

**Compaction** keeps replay bounded: the broker's log cleaner rewrites closed segments below the HWM with
the group-aware planner of :mod:`cursus.coordinator.offsets_compaction` (latest record per key; offsets and
memberships of a tombstoned or re-registered group dropped; tombstones kept for
``log_cleaner_delete_retention_ms``). Replaying the cleaned log gives the same state; each segment swap is
crash-safe (:mod:`cursus.storage.swap`). The topic has unlimited retention (the broker's retention task skips
internal topics).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cursus.coordinator.groups import Group, GroupTable, Selector, TopicPartition
from cursus.metadata.topics import validate_topic_name

OFFSETS_TOPIC = "__consumer_offsets"
_TIMESTAMP = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,9})?Z")


class RecordError(ValueError):
    """A ``__consumer_offsets`` record that does not decode (strict codec)."""


class ReplayError(RuntimeError):
    """Replay found a corrupt, unversioned or inconsistent record; ``str()`` is the not-ready reason."""


# ----------------------------------------------------------------------------------------------- keys


def _digest(identity: str) -> str:
    return hashlib.sha256(identity.encode("utf-8")).hexdigest()


def group_key(group: str) -> str:
    """Key of a group's registration/tombstone records."""
    return f"cursus.consumer.group.v1.{_digest(group)}"


def member_key(group: str) -> str:
    """Key of a group's membership records."""
    return f"cursus.consumer.member.v1.{_digest(group)}"


def offset_key(group: str, topic: str) -> str:
    """Key of the offset snapshots of one (group, topic)."""
    return f"cursus.consumer.offset.v1.{_digest(group + chr(0) + topic)}"


def partition_for(group: str, partitions: int) -> int:
    """The internal-topic partition holding every record of ``group`` (stable across restarts)."""
    return zlib.crc32(group.encode("utf-8")) % partitions


def utc_timestamp(now_ms: int) -> str:
    """RFC 3339 UTC with milliseconds, e.g. ``2026-01-01T00:00:00.000Z``."""
    moment = datetime.datetime.fromtimestamp(now_ms / 1000.0, tz=datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


# ----------------------------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class RegistrationRecord:
    """A group's subscription and its expansion ``{topic: partition count}`` (v1 single topic, v2 otherwise)."""

    group: str
    selector: Selector
    partitions: Mapping[str, int]
    epoch: int
    revision: int = 0
    timestamp: str = ""

    @property
    def key(self) -> str:
        """The record key."""
        return group_key(self.group)


@dataclass(frozen=True, slots=True)
class TombstoneRecord:
    """The group (name) was deleted at ``epoch``; its offsets and membership are gone."""

    group: str
    epoch: int
    revision: int = 0
    timestamp: str = ""

    @property
    def key(self) -> str:
        """The record key."""
        return group_key(self.group)


@dataclass(frozen=True, slots=True)
class OffsetSnapshotRecord:
    """Every committed next offset of one (group, topic) ``{partition: offset}`` (empty: none)."""

    group: str
    topic: str
    offsets: Mapping[int, int]
    epoch: int
    revision: int = 0
    timestamp: str = ""

    @property
    def key(self) -> str:
        """The record key."""
        return offset_key(self.group, self.topic)


@dataclass(frozen=True, slots=True)
class MembershipRecord:
    """A generation: its number and each member's assignment."""

    group: str
    generation: int
    members: tuple[tuple[str, tuple[TopicPartition, ...]], ...]
    epoch: int
    revision: int = 0
    timestamp: str = ""

    @property
    def key(self) -> str:
        """The record key."""
        return member_key(self.group)


GroupRecord = RegistrationRecord | TombstoneRecord | OffsetSnapshotRecord | MembershipRecord


def encode_payload(rec: GroupRecord) -> bytes:
    """The record's JSON payload (compact, fields in the documented order)."""
    doc: dict[str, Any]
    if isinstance(rec, RegistrationRecord):
        if rec.selector.kind == "topic":
            topic = rec.selector.topics[0]
            doc = {"version": 1, "type": "group_registration", "group": rec.group, "topic": topic,
                   "partition_count": rec.partitions.get(topic, 0)}
        else:
            doc = {"version": 2, "type": "group_registration", "group": rec.group}
            if rec.selector.kind == "topics":
                doc["topics"] = list(rec.selector.topics)
            else:
                doc["topic_pattern"] = rec.selector.pattern
            doc["topic_partitions"] = [{"topic": t, "partition": p}
                                       for t in sorted(rec.partitions) for p in range(rec.partitions[t])]
    elif isinstance(rec, TombstoneRecord):
        doc = {"version": 1, "type": "group_tombstone", "group": rec.group}
    elif isinstance(rec, OffsetSnapshotRecord):
        doc = {"version": 1, "type": "offset_snapshot", "group": rec.group, "topic": rec.topic}
    else:
        doc = {"version": 4, "type": "group_membership", "group": rec.group}
    doc["epoch"] = rec.epoch
    doc["revision"] = rec.revision
    if isinstance(rec, OffsetSnapshotRecord):
        doc["offsets"] = [{"partition": p, "offset": o} for p, o in sorted(rec.offsets.items())]
    elif isinstance(rec, MembershipRecord):
        doc["generation"] = rec.generation
        doc["members"] = [{"member_id": m, "assignments": [{"topic": t, "partition": p} for t, p in tps]}
                          for m, tps in rec.members]
    doc["timestamp"] = rec.timestamp
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


_COMMON = ("version", "type", "group", "epoch", "revision", "timestamp")
_SHAPES: dict[tuple[int, str], frozenset[str]] = {
    (1, "group_registration"): frozenset(_COMMON + ("topic", "partition_count")),
    (2, "group_registration"): frozenset(_COMMON + ("topic_partitions",)),
    (1, "group_tombstone"): frozenset(_COMMON),
    (1, "offset_snapshot"): frozenset(_COMMON + ("topic", "offsets")),
    (4, "group_membership"): frozenset(_COMMON + ("generation", "members")),
}


def _int(doc: Mapping[str, Any], key: str, minimum: int) -> int:
    value = doc.get(key)
    if type(value) is not int or value < minimum:
        raise RecordError(f"field {key} must be an integer >= {minimum}, got {value!r}")
    return value


def _str(doc: Mapping[str, Any], key: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or not value:
        raise RecordError(f"field {key} must be a non-empty string, got {value!r}")
    return value


def _topic(value: Any) -> str:
    try:
        return validate_topic_name(value if isinstance(value, str) else None, command="REPLAY")
    except Exception:
        raise RecordError(f"invalid topic name {value!r}") from None


def _pairs(items: Any, what: str) -> list[TopicPartition]:
    if not isinstance(items, list):
        raise RecordError(f"{what} must be a list")
    pairs = []
    for item in items:
        if not isinstance(item, dict) or set(item) != {"topic", "partition"}:
            raise RecordError(f"{what} entries must be {{topic, partition}}")
        pairs.append((_topic(item["topic"]), _int(item, "partition", 0)))
    if len(set(pairs)) != len(pairs):
        raise RecordError(f"{what} repeats a topic-partition")
    return pairs


def decode_payload(key: str | None, payload: bytes) -> GroupRecord:
    """Strictly decode one record; ``key`` must be the key its content implies.

    Raises:
        RecordError: not JSON, unversioned, unknown version/type, unknown or missing fields, bad values, or a
            key mismatch.
    """
    try:
        doc = json.loads(payload)
    except (UnicodeDecodeError, ValueError) as exc:
        raise RecordError(f"payload is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise RecordError("payload is not a JSON object")
    if "version" not in doc:
        raise RecordError("unversioned record")
    version, kind = doc.get("version"), doc.get("type")
    if type(version) is not int or not isinstance(kind, str):
        raise RecordError(f"bad version/type {version!r}/{kind!r}")
    shape = _SHAPES.get((version, kind))
    if shape is None:
        raise RecordError(f"unsupported record version {version} type {kind}")
    extra = set(doc) - shape
    if version == 2 and kind == "group_registration":
        selectors = extra & {"topics", "topic_pattern"}
        if len(selectors) != 1:
            raise RecordError("a v2 registration needs exactly one of topics, topic_pattern")
        extra -= selectors
    if extra or shape - set(doc):
        raise RecordError(f"unexpected fields {sorted(extra)} / missing fields {sorted(shape - set(doc))}")
    group = _str(doc, "group")
    epoch = _int(doc, "epoch", 1)
    revision = _int(doc, "revision", 1)
    timestamp = _str(doc, "timestamp")
    if not _TIMESTAMP.fullmatch(timestamp):
        raise RecordError(f"timestamp {timestamp!r} is not RFC 3339 UTC")
    rec: GroupRecord
    if kind == "group_registration":
        if version == 1:
            topic = _topic(doc["topic"])
            count = _int(doc, "partition_count", 0)
            rec = RegistrationRecord(group, Selector.single(topic), {topic: count} if count else {}, epoch,
                                     revision, timestamp)
        else:
            counts: dict[str, int] = {}
            for topic, partition in _pairs(doc["topic_partitions"], "topic_partitions"):
                if partition != counts.get(topic, 0):
                    raise RecordError("topic_partitions must list partitions 0..n-1 in order")
                counts[topic] = partition + 1
            if "topics" in doc:
                topics = doc["topics"]
                if not isinstance(topics, list) or not topics:
                    raise RecordError("topics must be a non-empty list")
                selector = Selector("topics", tuple(_topic(t) for t in topics))
            else:
                selector = Selector("pattern", (), _str(doc, "topic_pattern"))
            if any(not selector.matches(t) for t in counts):
                raise RecordError("topic_partitions names a topic outside the subscription")
            rec = RegistrationRecord(group, selector, dict(sorted(counts.items())), epoch, revision, timestamp)
    elif kind == "group_tombstone":
        rec = TombstoneRecord(group, epoch, revision, timestamp)
    elif kind == "offset_snapshot":
        entries = doc["offsets"]
        if not isinstance(entries, list):
            raise RecordError("offsets must be a list")
        offsets: dict[int, int] = {}
        for entry in entries:
            if not isinstance(entry, dict) or set(entry) != {"partition", "offset"}:
                raise RecordError("offsets entries must be {partition, offset}")
            partition = _int(entry, "partition", 0)
            if partition in offsets:
                raise RecordError("offsets repeats a partition")
            offsets[partition] = _int(entry, "offset", 0)
        rec = OffsetSnapshotRecord(group, _topic(doc["topic"]), offsets, epoch, revision, timestamp)
    else:
        raw_members = doc["members"]
        if not isinstance(raw_members, list):
            raise RecordError("members must be a list")
        members = []
        for entry in raw_members:
            if not isinstance(entry, dict) or set(entry) != {"member_id", "assignments"}:
                raise RecordError("members entries must be {member_id, assignments}")
            members.append((_str(entry, "member_id"), tuple(_pairs(entry["assignments"], "assignments"))))
        if len({m for m, _ in members}) != len(members):
            raise RecordError("members repeats a member id")
        rec = MembershipRecord(group, _int(doc, "generation", 0), tuple(members), epoch, revision, timestamp)
    if key is not None and key != rec.key:
        raise RecordError(f"record key {key!r} does not match its {kind} content")
    return rec


# ----------------------------------------------------------------------------------------------- replay


@dataclass(slots=True)
class Snapshot:
    """The coordinator state replay produced: the latest live record of every key.

    Attributes:
        registrations: group -> its registration.
        tombstones: group -> its tombstone (names deleted and not registered again).
        offsets: (group, topic) -> its latest snapshot (same epoch as the group's registration).
        memberships: group -> its latest membership (same epoch).
        records: records replayed; stale: records dropped as superseded by a newer epoch.
    """

    registrations: dict[str, RegistrationRecord] = field(default_factory=dict)
    tombstones: dict[str, TombstoneRecord] = field(default_factory=dict)
    offsets: dict[tuple[str, str], OffsetSnapshotRecord] = field(default_factory=dict)
    memberships: dict[str, MembershipRecord] = field(default_factory=dict)
    records: int = 0
    stale: int = 0


class LatestRecords:
    """Latest record (and its payload bytes) per key of one internal partition, with ordering checks."""

    def __init__(self, partition: int) -> None:
        self.partition = partition
        self.records: dict[str, tuple[GroupRecord, bytes]] = {}

    def put(self, rec: GroupRecord, payload: bytes, where: str) -> None:
        """Keep ``rec`` as its key's latest. Raises ReplayError when it would go backwards."""
        previous = self.records.get(rec.key)
        if previous is not None:
            old = previous[0]
            if (rec.epoch, rec.revision) < (old.epoch, old.revision):
                raise ReplayError(f"{where}: {type(rec).__name__} of group {rec.group!r} goes back from epoch "
                                  f"{old.epoch} revision {old.revision} to epoch {rec.epoch} revision {rec.revision}")
            if (rec.epoch, rec.revision) == (old.epoch, old.revision) and payload != previous[1]:
                raise ReplayError(f"{where}: two different records of group {rec.group!r} share epoch "
                                  f"{rec.epoch} revision {rec.revision}")
            if isinstance(rec, RegistrationRecord) and isinstance(old, TombstoneRecord) and rec.epoch <= old.epoch:
                raise ReplayError(f"{where}: group {rec.group!r} registered again at epoch {rec.epoch} after its "
                                  f"tombstone at epoch {old.epoch}")
        self.records[rec.key] = (rec, payload)


def replay_partition(latest: LatestRecords, records: Iterable[tuple[int, str | None, bytes]], partitions: int) -> int:
    """Replay one internal partition's records ``(offset, key, payload)`` (offset order) into ``latest``;
    returns how many. Then :func:`build_snapshot` over every partition gives the state.

    Raises:
        ReplayError: a record does not decode, goes backwards, or belongs to another of ``partitions``.
    """
    count = 0
    p = latest.partition
    for offset, key, payload in records:
        where = f"{OFFSETS_TOPIC}/{p} offset {offset}"
        try:
            rec = decode_payload(key, payload)
        except RecordError as exc:
            raise ReplayError(f"{where}: {exc}") from None
        if partition_for(rec.group, partitions) != p:
            raise ReplayError(f"{where}: record of group {rec.group!r} is in the wrong partition")
        latest.put(rec, payload, where)
        count += 1
    return count


def build_snapshot(latest: list[LatestRecords]) -> Snapshot:
    """Cross-check the latest records of every partition and drop superseded ones (mutates ``latest``).

    Raises:
        ReplayError: offsets or a membership without a registration, or newer than it.
    """
    snap = Snapshot()
    for part in latest:
        for rec, _ in part.records.values():
            if isinstance(rec, RegistrationRecord):
                snap.registrations[rec.group] = rec
            elif isinstance(rec, TombstoneRecord):
                snap.tombstones[rec.group] = rec
    for part in latest:
        for key, (rec, _) in list(part.records.items()):
            if isinstance(rec, (RegistrationRecord, TombstoneRecord)):
                continue
            reg = snap.registrations.get(rec.group)
            tomb = snap.tombstones.get(rec.group)
            if reg is not None and reg.epoch == rec.epoch:
                if isinstance(rec, OffsetSnapshotRecord):
                    snap.offsets[(rec.group, rec.topic)] = rec
                else:
                    assert isinstance(rec, MembershipRecord)
                    snap.memberships[rec.group] = rec
                continue
            epochs = [r.epoch for r in (reg, tomb) if r is not None]
            if not epochs:
                raise ReplayError(f"{type(rec).__name__} of group {rec.group!r} has no registration")
            newest_epoch = max(epochs)
            if rec.epoch > newest_epoch:
                raise ReplayError(f"{type(rec).__name__} of group {rec.group!r} has epoch {rec.epoch}, newer than "
                                  f"its registration (epoch {newest_epoch})")
            del part.records[key]  # superseded by a tombstone or a newer registration
            snap.stale += 1
    return snap


def restore_snapshot(table: GroupTable, snapshot: Snapshot, now_ms: int) -> None:
    """Load replayed state into an empty ``table`` (pure): registrations, tombstones, offsets inside each
    expansion, and memberships whose members get a fresh session from ``now_ms`` (monotonic)."""
    for name, reg in snapshot.registrations.items():
        table.groups[name] = Group(name, reg.selector, dict(reg.partitions), reg.epoch)
    for name, tomb in snapshot.tombstones.items():
        table.tombstones[name] = tomb.epoch
    for (name, topic), snap in snapshot.offsets.items():
        group = table.groups[name]
        count = group.partitions.get(topic, 0)
        for partition, offset in snap.offsets.items():
            if partition < count:
                group.offsets[(topic, partition)] = offset
    for name, membership in snapshot.memberships.items():
        group = table.groups[name]
        table.restore_membership(group, membership.generation, dict(membership.members), now_ms)
        group.last_rebalance_ms = now_ms
