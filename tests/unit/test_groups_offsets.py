"""Durable group records (cursus.coordinator.offsets) and the standalone group log over them
(cursus.broker.group_log): strict codec, replay, consistency checks, a cleaner pass."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from cursus.broker.core import now_ms as wall_ms
from cursus.broker.group_log import OffsetsTopicLog, _chunk
from cursus.broker.replica import Replica
from cursus.coordinator.groups import Selector
from cursus.coordinator.offsets import (
    OFFSETS_TOPIC,
    MembershipRecord,
    OffsetSnapshotRecord,
    RecordError,
    RegistrationRecord,
    ReplayError,
    TombstoneRecord,
    decode_payload,
    encode_payload,
    group_key,
    offset_key,
    partition_for,
)
from cursus.coordinator.offsets_compaction import OffsetsPlanner
from cursus.storage import GroupCommitWriter, LogConfig, PartitionLog
from cursus.storage.cleaner import clean_pass

RECORDS = [
    RegistrationRecord("g", Selector.single("t"), {"t": 3}, 1, 1, "2026-01-01T00:00:00.000Z"),
    RegistrationRecord("g", Selector("topics", ("a", "b")), {"a": 2}, 1, 2, "2026-01-01T00:00:00.000Z"),
    RegistrationRecord("g", Selector("pattern", (), "ev-*"), {"ev-1": 1, "ev-2": 2}, 2, 1, "2026-01-01T00:00:00Z"),
    TombstoneRecord("g", 3, 9, "2026-01-01T00:00:00.000Z"),
    OffsetSnapshotRecord("g", "t", {0: 5, 2: 7}, 1, 4, "2026-01-01T00:00:00.000Z"),
    MembershipRecord("g", 4, (("m-0001", (("t", 0), ("t", 2))), ("m-0002", ())), 1, 3, "2026-01-01T00:00:00.000Z"),
]


@pytest.mark.parametrize("rec", RECORDS, ids=lambda r: type(r).__name__)
def test_codec_round_trip(rec):
    assert decode_payload(rec.key, encode_payload(rec)) == rec


def test_payload_shapes_follow_the_documented_field_order():
    doc = json.loads(encode_payload(RECORDS[4]))
    assert list(doc) == ["version", "type", "group", "topic", "epoch", "revision", "offsets", "timestamp"]
    assert doc["offsets"] == [{"partition": 0, "offset": 5}, {"partition": 2, "offset": 7}]
    assert json.loads(encode_payload(RECORDS[0]))["version"] == 1
    assert json.loads(encode_payload(RECORDS[1]))["version"] == 2


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d.pop("version"), "unversioned"),
    (lambda d: d.update(version=9), "unsupported record version"),
    (lambda d: d.update(extra=1), "unexpected fields"),
    (lambda d: d.pop("epoch"), "missing fields"),
    (lambda d: d.update(epoch=0), "epoch"),
    (lambda d: d.update(revision=True), "revision"),
    (lambda d: d.update(timestamp="yesterday"), "RFC 3339"),
    (lambda d: d.update(offsets=[{"partition": 0, "offset": -1}]), "offset"),
    (lambda d: d.update(offsets=[{"partition": 0, "offset": 1}, {"partition": 0, "offset": 2}]), "repeats"),
])
def test_decoding_is_strict(mutate, message):
    doc = json.loads(encode_payload(RECORDS[4]))
    mutate(doc)
    with pytest.raises(RecordError, match=message):
        decode_payload(RECORDS[4].key, json.dumps(doc).encode())


def test_key_must_match_content():
    with pytest.raises(RecordError, match="does not match"):
        decode_payload(group_key("other"), encode_payload(RECORDS[0]))
    with pytest.raises(RecordError, match="not JSON"):
        decode_payload(None, b"\xff")


# ------------------------------------------------------------------------------------------ store harness


class Harness:
    """Internal-topic replicas on real partition logs with a running group-commit writer."""

    def __init__(self, root: Path, partitions: int = 1, segment_bytes: int = 1 << 20) -> None:
        self.root = root
        self.partitions = partitions
        self.config = LogConfig(segment_bytes=segment_bytes)
        self.loop = asyncio.get_running_loop()
        self.writer = GroupCommitWriter(lambda done: self.loop.call_soon_threadsafe(self._apply, done))
        self.writer.start()
        self.replicas = [self._open(p) for p in range(partitions)]

    def _open(self, p: int) -> Replica:
        plog = PartitionLog.open(self.root / f"p{p}", self.config)
        replica = Replica(OFFSETS_TOPIC, p, plog, self.writer)
        replica.become_leader(plog.leader_epoch)  # standalone: the leader of a one-member ISR
        return replica

    def _apply(self, completions) -> None:
        for c in completions:
            if isinstance(c.token, Replica):
                c.token.on_durable(c.durable_end_offset)
            elif isinstance(c.token, asyncio.Future) and not c.token.done():
                if c.error is not None:
                    c.token.set_exception(c.error)
                else:
                    c.token.set_result(c.result)

    async def run_blocking(self, fn):
        fut = self.loop.create_future()
        self.writer.submit_call(fn, fut)
        return await fut

    def store(self, **kwargs) -> OffsetsTopicLog:
        return OffsetsTopicLog(self.replicas, self.run_blocking, wall_ms=wall_ms, **kwargs)

    async def close(self) -> None:
        await self.loop.run_in_executor(None, self.writer.close)
        for r in self.replicas:
            r.log.close()


async def write(store: OffsetsTopicLog, group: str, records) -> None:
    await store.append(group, records)


async def test_replay_restores_latest_records(tmp_path):
    h = Harness(tmp_path, partitions=3)
    store = h.store()
    reg = RegistrationRecord("g", Selector.single("t"), {"t": 2}, 1)
    await write(store, "g", [reg, MembershipRecord("g", 1, (("m-0001", (("t", 0), ("t", 1))),), 1)])
    for n in range(1, 6):
        await write(store, "g", [OffsetSnapshotRecord("g", "t", {0: n, 1: 2 * n}, 1)])
    await write(store, "h", [RegistrationRecord("h", Selector.single("t"), {"t": 2}, 1)])
    await write(store, "h", [TombstoneRecord("h", 1)])
    await h.close()

    h2 = Harness(tmp_path, partitions=3)
    snap = await h2.store().replay()
    assert snap.registrations["g"].partitions == {"t": 2} and snap.registrations["g"].revision == 1
    assert snap.offsets[("g", "t")].offsets == {0: 5, 1: 10} and snap.offsets[("g", "t")].revision == 5
    assert snap.memberships["g"].generation == 1
    assert "h" not in snap.registrations and snap.tombstones["h"].epoch == 1
    assert snap.records == 9
    assert all(partition_for(g, 3) == partition_for(g, 3) for g in ("g", "h"))
    await h2.close()


async def _append_raw(h: Harness, group: str, payload: bytes, key: str) -> None:
    replica = h.replicas[partition_for(group, h.partitions)]
    replica.append(_chunk(replica.partition, replica.leo, [(key, payload)], 0), 1)
    await replica.wait_hwm(replica.leo)


@pytest.mark.parametrize("case", ["unversioned", "garbage", "backwards", "orphan_offsets", "future_epoch"])
async def test_replay_refuses_corrupt_or_inconsistent_logs(tmp_path, case):
    h = Harness(tmp_path)
    store = h.store()
    await write(store, "g", [RegistrationRecord("g", Selector.single("t"), {"t": 1}, 1)])
    await write(store, "g", [OffsetSnapshotRecord("g", "t", {0: 3}, 1)])
    if case == "unversioned":
        await _append_raw(h, "g", b'{"type":"offset_snapshot","group":"g"}', offset_key("g", "t"))
    elif case == "garbage":
        await _append_raw(h, "g", b"not json", offset_key("g", "t"))
    elif case == "backwards":
        old = OffsetSnapshotRecord("g", "t", {0: 1}, 1, 1, "2026-01-01T00:00:00.000Z")
        await _append_raw(h, "g", encode_payload(old), old.key)
    elif case == "orphan_offsets":
        rec = OffsetSnapshotRecord("x", "t", {0: 1}, 1, 1, "2026-01-01T00:00:00.000Z")
        await _append_raw(h, "x", encode_payload(rec), rec.key)
    else:
        rec = OffsetSnapshotRecord("g", "t", {0: 9}, 5, 9, "2026-01-01T00:00:00.000Z")
        await _append_raw(h, "g", encode_payload(rec), rec.key)
    await h.close()
    h2 = Harness(tmp_path)
    with pytest.raises(ReplayError):
        await h2.store().replay()
    await h2.close()


async def test_stale_epochs_are_dropped_not_errors(tmp_path):
    h = Harness(tmp_path)
    store = h.store()
    await write(store, "g", [RegistrationRecord("g", Selector.single("t"), {"t": 1}, 1)])
    await write(store, "g", [OffsetSnapshotRecord("g", "t", {0: 3}, 1)])
    await write(store, "g", [TombstoneRecord("g", 1)])
    await write(store, "g", [RegistrationRecord("g", Selector.single("t"), {"t": 1}, 2)])
    await h.close()
    h2 = Harness(tmp_path)
    snap = await h2.store().replay()
    assert snap.registrations["g"].epoch == 2 and ("g", "t") not in snap.offsets and snap.stale == 1
    await h2.close()


async def test_cleaner_pass_bounds_replay(tmp_path):
    """The log cleaner with the group-aware planner (closed segments below the HWM) bounds replay; the
    replayed state is the one before the pass."""
    h = Harness(tmp_path, segment_bytes=16 * 1024)
    store = h.store()
    groups = [f"g{i}" for i in range(5)]
    for g in groups:
        await write(store, g, [RegistrationRecord(g, Selector.single("t"), {"t": 4}, 1)])
    commits = 3000
    for n in range(commits):
        g = groups[n % len(groups)]
        await write(store, g, [OffsetSnapshotRecord(g, "t", {0: n, 1: n}, 1)])
    await write(store, "gone", [RegistrationRecord("gone", Selector.single("t"), {"t": 1}, 1)])
    await write(store, "gone", [OffsetSnapshotRecord("gone", "t", {0: 1}, 1)])
    await write(store, "gone", [TombstoneRecord("gone", 1)])
    replica = h.replicas[0]
    before_bytes = sum(s.size_bytes for s in replica.log.segments_info())
    stats = clean_pass(replica.log, replica.hwm, now_ms=wall_ms(), delete_retention_ms=86_400_000,
                       planner=OffsetsPlanner(now_ms=wall_ms(), delete_retention_ms=86_400_000))
    assert stats.copies and stats.records_removed > commits - 100
    for copy in stats.copies:
        await h.run_blocking(lambda c=copy: replica.log.replace_with_cleaned(
            c.base_offset, c.old_size_bytes, c.next_offset, c.size_bytes, c.index_entries))
    after_bytes = sum(s.size_bytes for s in replica.log.segments_info())
    assert after_bytes < before_bytes / 5, (before_bytes, after_bytes)
    await h.close()
    h2 = Harness(tmp_path, segment_bytes=16 * 1024)
    snap = await h2.store().replay()
    active = h2.replicas[0].log.segments_info()[-1]
    assert snap.records <= len(groups) * 2 + 1 + (active.next_offset - active.base_offset)
    last = {g: max(n for n in range(commits) if groups[n % len(groups)] == g) for g in groups}
    assert {g: snap.offsets[(g, "t")].offsets[0] for g in groups} == last
    assert set(snap.registrations) == set(groups) and snap.tombstones["gone"].epoch == 1
    assert ("gone", "t") not in snap.offsets
    await h2.close()
