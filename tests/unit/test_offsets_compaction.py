"""The group-aware planner of ``__consumer_offsets`` (cursus.coordinator.offsets_compaction): replaying the
records a pass keeps gives exactly the state replaying the whole log gives (expired tombstones aside)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import given, settings
from hypothesis import strategies as st

from cursus.coordinator.groups import Selector
from cursus.coordinator.offsets import (
    GroupRecord,
    LatestRecords,
    MembershipRecord,
    OffsetSnapshotRecord,
    RegistrationRecord,
    Snapshot,
    TombstoneRecord,
    build_snapshot,
    encode_payload,
    group_key,
    offset_key,
    replay_partition,
    utc_timestamp,
)
from cursus.coordinator.offsets_compaction import OffsetsPlanner
from cursus.storage.compaction import RecordInfo
from cursus.wire import Record, encode_record

GROUPS = ("a", "b", "c")
TOPICS = ("t1", "t2")
RETENTION_MS = 1_000
T0 = 1_800_000_000_000


@dataclass(frozen=True, slots=True)
class Entry:
    offset: int
    key: str
    payload: bytes
    time_ms: int
    tombstone: bool

    @property
    def info(self) -> RecordInfo:
        return RecordInfo(self.offset, self.key, False, False, self.time_ms)


class Coordinator:
    """What the standalone coordinator writes (OffsetsTopicLog.append's revision rule, GroupTable's epochs)."""

    def __init__(self) -> None:
        self.log: list[Entry] = []
        self.now = T0
        self.epoch: dict[str, int] = {}  # registered groups
        self.tombstone: dict[str, int] = {}
        self.revision: dict[str, tuple[str, int]] = {}  # key -> (group, revision)

    def write(self, rec: GroupRecord) -> None:
        revision = self.revision.get(rec.key, (rec.group, 0))[1] + 1
        rec = replace(rec, revision=revision, timestamp=utc_timestamp(self.now))
        if isinstance(rec, TombstoneRecord):
            self.revision = {k: v for k, v in self.revision.items() if v[0] != rec.group}
        self.revision[rec.key] = (rec.group, revision)
        self.log.append(Entry(len(self.log), rec.key, encode_payload(rec), self.now,
                              isinstance(rec, TombstoneRecord)))

    def apply(self, op: tuple) -> None:
        kind, *args = op
        if kind == "tick":
            self.now += args[0]
            return
        group = args[0]
        epoch = self.epoch.get(group)
        if kind == "register":
            topic, count = args[1], args[2]
            if epoch is None:
                epoch = self.epoch[group] = self.tombstone.pop(group, 0) + 1
            self.write(RegistrationRecord(group, Selector.single(topic), {topic: count}, epoch))
        elif epoch is None:
            return  # the coordinator writes nothing else for a group that is not registered
        elif kind == "commit":
            self.write(OffsetSnapshotRecord(group, args[1], dict(args[2]), epoch))
        elif kind == "members":
            members = tuple((f"m-{n}", (("t1", n),)) for n in range(args[2]))
            self.write(MembershipRecord(group, args[1], members, epoch))
        elif kind == "delete":
            del self.epoch[group]
            self.tombstone[group] = epoch
            self.write(TombstoneRecord(group, epoch))


def replay(entries: list[Entry]) -> Snapshot:
    """The real replay (OffsetsTopicLog.replay's per-partition step and the cross-check)."""
    latest = LatestRecords(0)
    count = replay_partition(latest, ((e.offset, e.key, e.payload) for e in entries), 1)
    snap = build_snapshot([latest])
    snap.records = count
    return snap


def clean(kept: list[Entry], end: int, now_ms: int) -> list[Entry]:
    """One pass below ``end`` with the planner, as the cleaner runs it (map phase, then copy phase)."""
    planner = OffsetsPlanner(now_ms=now_ms, delete_retention_ms=RETENTION_MS)
    in_range = [e for e in kept if e.offset < end]
    for e in in_range:
        planner.observe(e.info, encode_record(Record(topic="__consumer_offsets", partition=0, payload=e.payload,
                                                     offset=e.offset, timestamp=e.time_ms, key=e.key)))
    assert planner.undecodable == 0
    return [e for e in kept if e.offset >= end or planner.keeps(e.info)]


def state(snap: Snapshot) -> tuple:
    return snap.registrations, snap.tombstones, snap.offsets, snap.memberships


groups = st.sampled_from(GROUPS)
topics = st.sampled_from(TOPICS)
operations = st.lists(st.one_of(
    st.tuples(st.just("register"), groups, topics, st.integers(1, 3)),
    st.tuples(st.just("commit"), groups, topics, st.dictionaries(st.integers(0, 2), st.integers(0, 99), max_size=3)),
    st.tuples(st.just("commit"), groups, topics, st.dictionaries(st.integers(0, 2), st.integers(0, 99), max_size=3)),
    st.tuples(st.just("members"), groups, st.integers(0, 9), st.integers(0, 3)),
    st.tuples(st.just("delete"), groups),
    st.tuples(st.just("tick"), st.integers(1, 700)),
    st.tuples(st.just("clean"), st.floats(0.0, 1.0), st.floats(0.0, 1.0)),
), max_size=80)


@settings(max_examples=400, deadline=None)
@given(operations)
def test_replaying_the_survivors_gives_the_same_state(ops):
    coordinator = Coordinator()
    kept: list[Entry] = []
    expired: set[int] = set()  # offsets of tombstones a pass was allowed to drop
    for op in ops:
        if op[0] != "clean":
            before = len(coordinator.log)
            coordinator.apply(op)
            kept.extend(coordinator.log[before:])
            continue
        end = int(op[1] * len(coordinator.log))
        expired |= {e.offset for e in kept
                    if e.tombstone and e.offset < end and coordinator.now - e.time_ms >= RETENTION_MS}
        survivors = clean(kept, end, coordinator.now)
        removed_tombstones = {e.offset for e in kept if e.tombstone} - {e.offset for e in survivors}
        last_of_key = {e.key: e.offset for e in coordinator.log}
        assert all(last_of_key[coordinator.log[o].key] != o or o in expired for o in removed_tombstones)
        # A crash between two segment swaps (oldest first): the cleaned prefix, then the old suffix.
        split = int(op[2] * end)
        torn = [e for e in survivors if e.offset < split] + [e for e in kept if e.offset >= split]
        for log in (torn, survivors):
            present = {e.offset for e in log}
            full = replay(coordinator.log)
            for name in list(full.tombstones):
                last = last_of_key[group_key(name)]
                if last in expired and last not in present:
                    del full.tombstones[name]
            assert state(replay(log)) == state(full)
        kept = survivors

    # A pass over everything, every tombstone expired: exactly one record per live key survives.
    later = coordinator.now + RETENTION_MS
    final = clean(kept, len(coordinator.log), later)
    snap = replay(final)
    full = replay(coordinator.log)
    assert (snap.registrations, snap.offsets, snap.memberships) == (full.registrations, full.offsets,
                                                                   full.memberships)
    assert snap.tombstones == {} and snap.stale == 0
    assert len(final) == len(snap.registrations) + len(snap.offsets) + len(snap.memberships)


def test_tombstone_supersedes_other_keys_and_waits_for_the_retention_window():
    c = Coordinator()
    for op in [("register", "a", "t1", 2), ("commit", "a", "t1", {0: 5}), ("members", "a", 1, 2),
               ("commit", "a", "t1", {0: 7}), ("delete", "a"), ("tick", 10)]:
        c.apply(op)
    kept = clean(list(c.log), len(c.log), c.now)
    assert [e.tombstone for e in kept] == [True]  # registration, offsets, membership all superseded
    assert replay(kept).tombstones["a"].epoch == 1
    assert clean(kept, len(c.log), c.now + RETENTION_MS) == []
    c.apply(("register", "a", "t2", 1))  # a new incarnation after the tombstone
    assert replay(kept + c.log[-1:]).registrations["a"].epoch == 2


def test_undecodable_records_are_kept_and_supersede_nothing():
    c = Coordinator()
    c.apply(("register", "a", "t1", 1))
    c.apply(("commit", "a", "t1", {0: 1}))
    key = offset_key("a", "t1")
    garbage = Entry(len(c.log), key, b"not json", c.now, False)
    c.log.append(garbage)
    c.apply(("commit", "a", "t1", {0: 2}))
    planner = OffsetsPlanner(now_ms=c.now, delete_retention_ms=RETENTION_MS)
    for e in c.log:
        planner.observe(e.info, encode_record(Record(topic="__consumer_offsets", partition=0, payload=e.payload,
                                                     offset=e.offset, timestamp=e.time_ms, key=e.key)))
    assert planner.undecodable == 1
    assert planner.survivors([e.info for e in c.log]) == [0, 2, 3]
