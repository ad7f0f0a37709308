"""LeaderFetchService on real logs: fencing codes, divergence answers, byte bounds, long poll, ISR upkeep."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from cursus.broker.offload import Offload
from cursus.broker.replica import Replica
from cursus.internal.v1 import replication_pb2 as pb
from cursus.metadata.state import PartitionAssignment
from cursus.replication.convert import epoch_end_from_pb, split_chunks
from cursus.replication.leader import LeaderFetchConfig
from cursus.storage.chunk import decode_header
from cursus.storage.epochs import EpochEnd
from tests.unit.test_replication_support import (
    Clock,
    Metadata,
    Node,
    fetch_request,
    make_service,
    node_pool,
    part,
    publish,
    records,
    stored_chunks,
    until,
)

KEY = ("t", 0)


@pytest_asyncio.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[Callable[[str], Node]]:
    async with node_pool(tmp_path, Node) as make:
        yield make


def lead(node: Node, metadata: Metadata, epoch: int = 1, replicas: tuple[str, ...] = ("a", "b", "c"),
         isr: tuple[str, ...] | None = None, key: tuple[str, int] = KEY, lifecycle: int = 0) -> Replica:
    replica = node.replicas.get(key) or node.open(*key)
    members = isr if isr is not None else replicas
    replica.become_leader(epoch, isr=members)
    metadata.assignments[key] = PartitionAssignment(replicas=replicas, leader=node.broker_id, leader_epoch=epoch,
                                                    isr=members, lifecycle_epoch=lifecycle)
    return replica


def code(data: pb.PartitionData) -> str:
    return data.error.code


@pytest.mark.asyncio
async def test_fencing_answers_the_design_codes_and_fields(nodes) -> None:
    a, metadata, clock = nodes("a"), Metadata(), Clock()
    leader = lead(a, metadata, epoch=3, lifecycle=2)
    await publish(leader, 4)
    service = make_service(a, metadata, clock)

    async def one(p: pb.PartitionFetch, follower: str = "b", request_follower: str | None = None) -> pb.PartitionData:
        request = fetch_request(request_follower or follower, p)
        (data,) = (await service.fetch(follower, request)).partitions
        return data

    ok = await one(part(epoch=3, lifecycle=2))
    assert not ok.HasField("error") and len(split_chunks(ok.chunks)) == 1 and ok.leo == 4 and ok.leader_epoch == 3
    stale = await one(part(epoch=2, lifecycle=2))
    assert code(stale) == "STALE_LEADER_EPOCH" and dict(stale.error.fields).items() >= {"current": "3", "requested": "2"}.items()
    ahead = await one(part(epoch=4, lifecycle=2))
    assert code(ahead) == "PARTITION_LEADER_FENCED" and ahead.error.fields["requested"] == "4"
    lifecycle = await one(part(epoch=3, lifecycle=1))
    assert code(lifecycle) == "PARTITION_LEADER_FENCED" and lifecycle.error.fields["lifecycle_epoch"] == "2"
    unknown = await one(part(epoch=3, topic="nope"))
    assert code(unknown) == "partition_metadata_not_found"
    assert dict(unknown.error.fields) == {"topic": "nope", "partition": "0"}
    assert code(await one(part(epoch=3, lifecycle=2), follower="x")) == "internal_command_unauthorized"
    assert code(await one(part(epoch=3, lifecycle=2), request_follower="c")) == "internal_command_unauthorized"
    # A deposed leader (it applied the new assignment) names the new leader.
    leader.become_follower(4, "c")
    metadata.set(KEY, leader="c", leader_epoch=4)
    moved = await one(part(epoch=4, lifecycle=2))
    assert code(moved) == "NOT_PARTITION_LEADER"
    assert dict(moved.error.fields) == {"topic": "t", "partition": "0", "leader": "c", "requested_leader": "a"}
    # Nothing of the refused fetches was recorded as follower progress.
    assert service.tracker.fetch_offset(KEY, "x") is None


@pytest.mark.asyncio
async def test_a_new_epochs_first_append_in_flight_does_not_hide_a_divergence(nodes) -> None:
    """Finding E, leader side: a new leader's first append of its epoch is queued on the writer thread
    (the log's epoch history does not know the epoch yet, the LEO already covers the append). A deposed
    leader's fetch just past its own divergent record at that offset must still be answered with the
    divergence, and its end must not count in the candidate HWM."""
    import threading

    a, metadata, clock = nodes("a"), Metadata(), Clock()
    leader = lead(a, metadata, epoch=1, isr=("a", "b"))
    await publish(leader, 6)
    leader.update_replica_end("b", 6)
    leader.become_leader(2, isr=("a", "b"))
    metadata.set(KEY, leader_epoch=2)
    release = threading.Event()
    a.writer.submit_call(lambda: release.wait(10), asyncio.get_running_loop().create_future())
    try:
        leader.append(records(6, 1, "new"), 1)
        assert leader.log.leader_epochs == [(1, 0)] and leader.leo == 7
        service = make_service(a, metadata, clock)
        (data,) = (await service.fetch("b", fetch_request("b", part(7, 2, 1)))).partitions
        assert data.HasField("diverging_epoch") and epoch_end_from_pb(data.diverging_epoch) == EpochEnd(1, 6)
        assert service.tracker.fetch_offset(KEY, "b") is None and leader.candidate_hwm == 6
    finally:
        release.set()
    await until(lambda: leader.durable_end_offset == 7)
    assert leader.log.leader_epochs == [(1, 0), (2, 6)] and leader.end_offset_for_epoch(1) == (1, 6)


@pytest.mark.asyncio
async def test_divergence_is_answered_by_epoch_and_progress_is_not_recorded(nodes) -> None:
    a, metadata, clock = nodes("a"), Metadata(), Clock()
    leader = lead(a, metadata, epoch=1)
    await publish(leader, 6)
    leader.become_leader(4, isr=("a", "b", "c"))
    metadata.set(KEY, leader_epoch=4)
    await publish(leader, 3)
    assert leader.log.leader_epochs == [(1, 0), (4, 6)]
    service = make_service(a, metadata, clock)

    async def one(offset: int, last_epoch: int) -> pb.PartitionData:
        (data,) = (await service.fetch("b", fetch_request("b", part(offset, 4, last_epoch)))).partitions
        return data

    # The follower wrote epoch 3 (a leader that never committed) after offset 6: the leader knows epoch 1
    # as the largest <= 3, ending at 6.
    data = await one(8, 3)
    assert data.HasField("diverging_epoch") and not data.chunks
    assert epoch_end_from_pb(data.diverging_epoch) == EpochEnd(1, 6)
    # Epoch 1 ended at 6 here; a follower at 7 in epoch 1 diverges too.
    assert epoch_end_from_pb((await one(7, 1)).diverging_epoch) == EpochEnd(1, 6)
    # A follower ahead of the leader's LEO in the leader's own epoch.
    assert epoch_end_from_pb((await one(12, 4)).diverging_epoch) == EpochEnd(4, 9)
    assert service.tracker.fetch_offset(KEY, "b") is None
    # A consistent follower: no divergence, chunks from its offset.
    data = await one(6, 1)
    assert not data.HasField("diverging_epoch") and split_chunks(data.chunks) == stored_chunks(leader, 6)
    assert service.tracker.fetch_offset(KEY, "b") == 6
    # Offsets that are not a chunk boundary of ours: truncate to the chunk start.
    data = await one(7, 4)
    assert epoch_end_from_pb(data.diverging_epoch) == EpochEnd(4, 6)


@pytest.mark.asyncio
async def test_an_identical_refetch_serves_the_same_bytes_and_changes_nothing(nodes) -> None:
    a, metadata, clock = nodes("a"), Metadata(), Clock()
    leader = lead(a, metadata, replicas=("a", "b"))
    for count in (3, 2, 5):
        await publish(leader, count)
    service = make_service(a, metadata, clock)
    first = await service.fetch("b", fetch_request("b", part(0)))
    again = await service.fetch("b", fetch_request("b", part(0)))
    assert first.partitions[0].chunks == again.partitions[0].chunks == b"".join(stored_chunks(leader))
    assert leader.hwm == 0 and leader.leo == 10  # follower at 0: nothing committed yet


@pytest.mark.asyncio
async def test_a_catching_up_follower_is_served_1000_chunks_in_bounded_responses(nodes) -> None:
    a, metadata, clock = nodes("a"), Metadata(), Clock()
    leader = lead(a, metadata, replicas=("a", "b"))
    for i in range(1000):
        leader.append(b"\x00\x00\x00\x08" + i.to_bytes(8, "big"), 1)
    await until(lambda: leader.durable_end_offset == 1000)
    chunk_size = len(stored_chunks(leader, 999)[0])
    bound = 50 * chunk_size + chunk_size // 2
    offload = Offload(threshold_bytes=0, threads=1)  # every read on the offload thread
    try:
        service = make_service(a, metadata, clock, LeaderFetchConfig(partition_max_bytes=bound),
                               run_blocking=offload.run)
        offset, responses, served = 0, 0, bytearray()
        while offset < 1000:
            (data,) = (await service.fetch("b", fetch_request("b", part(offset, last_epoch=1 if offset else -1)))
                       ).partitions
            assert 0 < len(data.chunks) <= bound
            served += data.chunks
            offset = split_and_end(data.chunks)
            responses += 1
        assert responses == 20 and bytes(served) == b"".join(stored_chunks(leader))
        # The first chunk of a partition may exceed the bound: progress is always possible.
        (tiny,) = (await service.fetch("b", fetch_request("b", part(0, max_bytes=1)))).partitions
        assert len(split_chunks(tiny.chunks)) == 1
    finally:
        offload.close()


def split_and_end(chunks: bytes) -> int:
    header = decode_header(split_chunks(chunks)[-1], 0)
    assert header is not None
    return header.next_offset


@pytest.mark.asyncio
async def test_the_response_bound_rotates_between_partitions_so_none_starves(nodes) -> None:
    a, metadata, clock = nodes("a"), Metadata(), Clock()
    keys = [("t", p) for p in range(3)]
    replicas = [lead(a, metadata, replicas=("a", "b"), key=key) for key in keys]
    for replica in replicas:
        for i in range(20):
            replica.append(b"\x00\x00\x00\x08" + i.to_bytes(8, "big"), 1)
        await until(lambda r=replica: r.durable_end_offset == 20)
    chunk = len(stored_chunks(replicas[0])[0])
    service = make_service(a, metadata, clock, LeaderFetchConfig(response_max_bytes=5 * chunk))
    offsets = dict.fromkeys(keys, 0)
    for _ in range(3):
        request = fetch_request("b", *(part(offsets[k], partition=k[1], last_epoch=1 if offsets[k] else -1)
                                       for k in keys))
        response = await service.fetch("b", request)
        assert sum(len(d.chunks) for d in response.partitions) <= 5 * chunk
        for data in response.partitions:
            if data.chunks:
                offsets[(data.topic, data.partition)] = split_and_end(data.chunks)
    assert all(offset == 5 for offset in offsets.values()), offsets


@pytest.mark.asyncio
async def test_long_poll_wakes_on_a_new_append_and_times_out_otherwise(nodes) -> None:
    a, metadata, clock = nodes("a"), Metadata(), Clock()
    leader = lead(a, metadata, replicas=("a",), isr=("a",))
    metadata.set(KEY, replicas=("a", "b"))
    await publish(leader, 2)
    service = make_service(a, metadata, clock)
    loop = asyncio.get_running_loop()
    first = await service.fetch("b", fetch_request("b", part(2, last_epoch=1), max_wait_ms=5000))
    assert not first.partitions[0].chunks and first.partitions[0].hwm == 2  # the HWM was news

    started = loop.time()
    idle = await service.fetch("b", fetch_request("b", part(2, last_epoch=1), max_wait_ms=200))
    assert loop.time() - started >= 0.19 and not idle.partitions[0].chunks

    waiting = asyncio.ensure_future(service.fetch("b", fetch_request("b", part(2, last_epoch=1), max_wait_ms=5000)))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    started = loop.time()
    leader.append(b"\x00\x00\x00\x01x", 1)
    woken = await asyncio.wait_for(waiting, 2.0)
    assert loop.time() - started < 2.0
    await until(lambda: leader.durable_end_offset == 3)  # it may have been served before the leader's fsync
    assert split_chunks(woken.partitions[0].chunks) == stored_chunks(leader, 2)

    await until(lambda: leader.hwm == 3)
    news = await service.fetch("b", fetch_request("b", part(3, last_epoch=1), max_wait_ms=5000))
    assert news.partitions[0].hwm == 3  # the HWM that moved after the chunk was served ends a long poll
    # A role change during the wait answers at once with the new routing.
    waiting = asyncio.ensure_future(service.fetch("b", fetch_request("b", part(3, last_epoch=1), max_wait_ms=5000)))
    await asyncio.sleep(0.05)
    leader.become_follower(2, "b")
    moved = await asyncio.wait_for(waiting, 2.0)
    assert moved.partitions[0].error.code == "NOT_PARTITION_LEADER"


@pytest.mark.asyncio
async def test_isr_shrinks_a_lagging_or_dead_follower_and_expands_it_after_catch_up(nodes) -> None:
    a, metadata, clock = nodes("a"), Metadata(), Clock()
    leader = lead(a, metadata)
    pending: list[str] = []
    leader.expand_isr_pending = pending.append  # type: ignore[attr-defined]  # the HWM helper's hook
    service = make_service(a, metadata, clock, LeaderFetchConfig(lag_time_max_ms=1000))
    await publish(leader, 5)

    async def fetch(follower: str, offset: int) -> None:
        await service.fetch(follower, fetch_request(follower, part(offset, last_epoch=1 if offset else -1)))

    await fetch("b", 5)
    await fetch("c", 0)  # c is behind and then dies
    clock.now_ms += 600
    assert await service.maintain() == []  # within the lag (and the new leader's grace)
    await fetch("b", 5)
    clock.now_ms += 600
    (shrink,) = await service.maintain()
    assert shrink.isr == ("a", "b") and shrink.leader_epoch == 1
    assert metadata.assignments[KEY].isr == ("a", "b")
    clock.now_ms += 2000  # b is quiet too now, but the leader is never removed and b shrinks alone
    (shrink_b,) = await service.maintain()
    assert shrink_b.isr == ("a",)
    # c comes back and catches up: fetching at the leader's LEO in this epoch, >= the committed HWM.
    metadata.set(KEY, committed_hwm=5)
    await fetch("c", 3)
    assert await service.maintain() == []  # not caught up yet
    await fetch("c", 5)
    (expand,) = await service.maintain()
    assert expand.isr == ("a", "c") and pending == ["c"]
    # A new leader epoch resets what the tracker knew; nothing is decided from the old epoch's fetches.
    leader.become_leader(2, isr=("a", "c"))
    metadata.set(KEY, leader_epoch=2, isr=("a", "c"))
    assert await service.maintain() == []


@pytest.mark.asyncio
async def test_answers_say_whether_the_log_has_cleaned_gaps_whatever_the_topic_policy(nodes) -> None:
    """``cleaned_gaps`` follows the leader's log (it has cleaned segments), not a topic policy: false for
    a log never cleaned, true for one with a cleaner's gap, on the chunks after the gap and on the
    ``skip_to`` answer of a trailing gap alike (issue 18: a topic switched from compact to delete)."""
    from cursus.storage import PartitionLog
    from tests.unit.test_storage_support import record_for, records_section, small_config

    a, b, metadata, clock = nodes("a"), nodes("b"), Metadata(), Clock()
    plain = lead(a, metadata, replicas=("a", "b"))
    await publish(plain, 3)
    service = make_service(a, metadata, clock)
    data = (await service.fetch("b", fetch_request("b", part(0)))).partitions[0]
    assert data.chunks and not data.cleaned_gaps

    prepared = PartitionLog.open(b.directory / "t-0", small_config(segment_bytes=64 * 1024))
    prepared.append_chunk(0, 3, records_section([record_for(i) for i in range(3)]), leader_epoch=1)
    prepared.skip_gap(8)
    prepared.append_chunk(8, 2, records_section([record_for(8 + i) for i in range(2)]), leader_epoch=1)
    prepared.skip_gap(12)
    prepared.flush()
    prepared.close()
    gapped = lead(b, metadata, replicas=("b", "a"))
    service = make_service(b, metadata, clock)
    after_gap = (await service.fetch("a", fetch_request("a", part(3, last_epoch=1)))).partitions[0]
    assert [decode_header(c, 0).base_offset for c in split_chunks(after_gap.chunks)] == [8]
    assert after_gap.cleaned_gaps and not after_gap.skip_to
    trailing = (await service.fetch("a", fetch_request("a", part(10, last_epoch=1)))).partitions[0]
    assert not trailing.chunks and trailing.skip_to == 12 == gapped.leo and trailing.cleaned_gaps
