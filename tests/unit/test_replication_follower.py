"""ReplicaFetcherManager against a real LeaderFetchService (in-process transport) on real logs: catch up,
divergence by epoch, stale views, refused appends, broken streams."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from cursus.internal.v1 import replication_pb2 as pb
from cursus.metadata.state import PartitionAssignment
from cursus.replication.follower import (
    FetcherConfig,
    FollowerObserver,
    ReplicaFetcherManager,
    last_fetched_epoch,
)
from cursus.replication.isr import IsrTracker
from cursus.replication.leader import LeaderFetchConfig, LeaderFetchService
from cursus.wire.errors import TypedError
from tests.unit.test_replication_support import (
    Clock,
    InProcessStream,
    Metadata,
    Node,
    make_manager,
    make_service,
    publish,
    records,
    stored_chunks,
    until,
)

KEY = ("t", 0)


@pytest_asyncio.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[Callable[[str], Node]]:
    made: list[Node] = []
    managers: list[ReplicaFetcherManager] = []

    def make(broker_id: str) -> Node:
        made.append(Node(tmp_path / broker_id, broker_id))
        return made[-1]

    make.managers = managers  # type: ignore[attr-defined]
    yield make
    for manager in managers:
        await manager.close()
    for node in made:
        await node.close()


class Transport:
    """``open_stream`` for a follower: streams into the leader brokers' services, by address."""

    def __init__(self, follower_id: str, services: dict[str, LeaderFetchService]) -> None:
        self.follower_id = follower_id
        self.services = services
        self.opened: list[InProcessStream] = []
        self.fail_opens = 0
        self.tamper: Callable[[pb.FetchResponse], pb.FetchResponse] | None = None

    def __call__(self, address: str) -> InProcessStream:
        if self.fail_opens:
            self.fail_opens -= 1
            raise ConnectionRefusedError(address)
        stream = InProcessStream(self.services[address.split(":")[0]], self.follower_id, self.tamper)
        self.opened.append(stream)
        return stream


def assign(metadata: Metadata, leader: str, epoch: int, replicas: tuple[str, ...] = ("a", "b"),
           isr: tuple[str, ...] | None = None) -> None:
    metadata.assignments[KEY] = PartitionAssignment(replicas=replicas, leader=leader, leader_epoch=epoch,
                                                    isr=isr if isr is not None else replicas)


def start(nodes, follower, metadata: Metadata, clock: Callable[[], int], services: dict[str, LeaderFetchService],
          *, tamper: Callable[[pb.FetchResponse], pb.FetchResponse] | None = None, fail_opens: int = 0,
          **kwargs) -> tuple[ReplicaFetcherManager, Transport]:
    """A manager for ``follower`` over a :class:`Transport` into ``services`` (``tamper``/``fail_opens`` set on
    it first), refreshed once; ``kwargs`` go to :func:`make_manager`."""
    transport = Transport(follower.broker_id, services)
    transport.tamper, transport.fail_opens = tamper, fail_opens
    manager = make_manager(follower, metadata, clock, transport, **kwargs)
    nodes.managers.append(manager)
    manager.refresh()
    return manager, transport


def lead_and_follow(a: Node, b: Node, metadata: Metadata):
    """a leads leader epoch 1 (ISR a, b), b follows it, and ``metadata`` says so; (leader, follower)."""
    leader, follower = a.open(), b.open()
    leader.become_leader(1, isr=("a", "b"))
    follower.become_follower(1, "a")
    assign(metadata, "a", 1)
    return leader, follower


async def both_hold_six(nodes):
    """b leads leader epoch 1 and both b and a hold offsets [0, 6); (a, b, metadata, clock, new, old) with
    new = a's replica (following b), old = b's."""
    a, b, metadata, clock = nodes("a"), nodes("b"), Metadata(), Clock()
    new, old = a.open(), b.open()
    old.become_leader(1, isr=("b", "a"))
    new.become_follower(1, "b")
    await publish(old, 6)
    for chunk in stored_chunks(old):
        new.append_replicated(chunk, 1)
    await until(lambda: new.durable_end_offset == 6)
    return a, b, metadata, clock, new, old


@pytest.mark.asyncio
async def test_a_follower_catches_up_from_empty_byte_identical_and_learns_the_hwm(nodes) -> None:
    a, b, metadata, clock = nodes("a"), nodes("b"), Metadata(), Clock()
    leader, follower = lead_and_follow(a, b, metadata)
    for count in (3, 1, 7, 2):
        leader.append(b"".join(b"\x00\x00\x00\x02ab" for _ in range(count)), count)
    await until(lambda: leader.durable_end_offset == 13)
    assert leader.hwm == 0  # the follower has nothing yet
    manager, transport = start(nodes, b, metadata, clock, {"a": make_service(a, metadata, clock)})
    await until(lambda: follower.durable_end_offset == 13 and leader.hwm == 13 and follower.hwm == 13)
    assert stored_chunks(follower) == stored_chunks(leader) and follower.log.leader_epochs == [(1, 0)]
    # Live traffic keeps flowing through the long poll.
    await publish(leader, 4, tag="live")
    await until(lambda: follower.durable_end_offset == 17 and follower.hwm == 17)
    assert stored_chunks(follower) == stored_chunks(leader)
    assert list(manager.sessions) == ["a"] and len(transport.opened) == 1
    # Every request after the first came from the durable LEO, with the epoch of the last chunk below it.
    last = transport.opened[0].requests_seen[-1].partitions[0]
    assert last.fetch_offset == follower.durable_end_offset and last.last_fetched_epoch == 1


@pytest.mark.parametrize("scenario", ["old_leader_tail", "unknown_epoch"])
@pytest.mark.asyncio
async def test_a_divergent_tail_is_truncated_by_epoch_and_the_follower_converges(nodes, scenario) -> None:
    a, b, metadata, clock, new, old = await both_hold_six(nodes)  # epoch 1: b leads, both hold [0, 6)
    if scenario == "unknown_epoch":
        old.become_leader(3, isr=("b", "a"))  # b led epoch 3 alone; a never saw it
    await publish(old, 4, tag="lost")        # never replicated, never committed
    # a takes over and writes its own tail; b follows it now.
    new.become_leader(4 if scenario == "unknown_epoch" else 2, isr=("a", "b"))
    epoch = new.leader_epoch
    await publish(new, 3, tag="new")
    old.become_follower(epoch, "a")
    assign(metadata, "a", epoch)
    start(nodes, b, metadata, clock, {"a": make_service(a, metadata, clock)})
    await until(lambda: old.durable_end_offset == new.leo and stored_chunks(old) == stored_chunks(new))
    assert old.log.leader_epochs == new.log.leader_epochs == [(1, 0), (epoch, 6)]
    assert last_fetched_epoch(old, old.leo) == epoch


@pytest.mark.asyncio
async def test_stale_views_back_off_and_proceed_once_metadata_catches_up(nodes) -> None:
    a, b, metadata, clock = nodes("a"), nodes("b"), Metadata(), Clock()
    leader, follower = a.open(), b.open()
    leader.become_leader(2, isr=("a", "b"))
    assign(metadata, "a", 2)
    await publish(leader, 5)
    follower.become_follower(1, "a")  # b has not applied epoch 2 yet
    manager, transport = start(nodes, b, metadata, clock, {"a": make_service(a, metadata, clock)})
    await until(lambda: bool(transport.opened) and len(transport.opened[0].requests_seen) >= 1)
    session = manager.sessions["a"]
    await until(lambda: KEY in session.backoff_until)
    assert follower.leo == 0
    # A few backoffs later it is still refused (the clock has not moved: it waits, it does not spin).
    await asyncio.sleep(0.1)
    assert len(transport.opened[0].requests_seen) == 1
    follower.become_follower(2, "a")
    clock.now_ms += 1_000
    manager.refresh()
    await until(lambda: follower.durable_end_offset == 5)
    # The other direction: the leader has not applied its deposition (the follower is ahead).
    follower.become_follower(3, "a")
    clock.now_ms += 1_000
    manager.refresh()
    await until(lambda: session.backoff_until.get(KEY, 0) > clock.now_ms)
    answers = [r for s in transport.opened for r in s.requests_seen if r.partitions[0].leader_epoch == 3]
    assert answers  # it asked with epoch 3 and was fenced (PARTITION_LEADER_FENCED), not served


class Recorder(FollowerObserver):
    def __init__(self) -> None:
        self.refused: list[tuple[tuple[str, int], TypedError]] = []
        self.broken: list[BaseException] = []

    def append_refused(self, key: tuple[str, int], error: TypedError) -> None:
        self.refused.append((key, error))

    def stream_broken(self, leader_id: str, error: BaseException) -> None:
        self.broken.append(error)


@pytest.mark.asyncio
async def test_a_refused_append_stops_the_partition_until_a_new_leader_epoch(nodes) -> None:
    a, b, metadata, clock = nodes("a"), nodes("b"), Metadata(), Clock()
    leader, follower = lead_and_follow(a, b, metadata)
    await publish(leader, 3)
    recorder = Recorder()

    def corrupt(response: pb.FetchResponse) -> pb.FetchResponse:
        for data in response.partitions:
            if data.chunks:
                flipped = bytearray(data.chunks)
                flipped[-1] ^= 0xFF
                data.chunks = bytes(flipped)
        return response

    manager, transport = start(nodes, b, metadata, clock, {"a": make_service(a, metadata, clock)}, tamper=corrupt,
                               observer=recorder)
    await until(lambda: bool(recorder.refused))
    (key, error), = recorder.refused
    assert key == KEY and error.code == "corrupt_log_data" and follower.leo == 0
    session = manager.sessions["a"]
    assert session.stopped == {KEY: 1}
    requests = len(transport.opened[0].requests_seen)
    await asyncio.sleep(0.1)
    assert len(transport.opened[0].requests_seen) == requests  # nothing fetched for it meanwhile
    # A new leader epoch lifts the quarantine.
    transport.tamper = None
    leader.become_leader(2, isr=("a", "b"))
    metadata.assignments[KEY] = PartitionAssignment(("a", "b"), "a", 2, ("a", "b"))
    follower.become_follower(2, "a")
    manager.refresh()
    # The stream tampers still (it was opened with it); reopen by breaking it.
    transport.opened[0].cancel()
    await until(lambda: follower.durable_end_offset == 3)
    assert stored_chunks(follower) == stored_chunks(leader)


@pytest.mark.asyncio
async def test_a_broken_stream_is_reopened_with_backoff(nodes) -> None:
    a, b, metadata, clock = nodes("a"), nodes("b"), Metadata(), Clock()
    leader, follower = lead_and_follow(a, b, metadata)
    await publish(leader, 2)
    recorder = Recorder()
    manager, transport = start(nodes, b, metadata, clock, {"a": make_service(a, metadata, clock)}, fail_opens=2,
                               observer=recorder)
    await until(lambda: follower.durable_end_offset == 2)
    assert len(recorder.broken) == 2
    transport.opened[0].cancel()  # the leader side ends the stream
    await publish(leader, 3)
    await until(lambda: follower.durable_end_offset == 5)
    assert len(transport.opened) == 2 and len(recorder.broken) == 3
    # Leadership moves to this broker: the session ends.
    follower.become_leader(2, isr=("b",))
    manager.refresh()
    assert manager.sessions == {}


@pytest.mark.asyncio
async def test_a_restarted_leader_ends_the_reconnect_backoff_at_once(nodes) -> None:
    """Failed opens grow the session's backoff (here to 60 s); ``peer_restarted`` (the leader broker registered
    a new incarnation) resets it and the stream is reopened now, not after the backoff."""
    a, b, metadata, clock = nodes("a"), nodes("b"), Metadata(), Clock()
    leader, follower = a.open(), b.open()
    leader.become_leader(1, isr=("a", "b"))
    follower.become_follower(1, "a")
    assign(metadata, "a", 1)
    await publish(leader, 2)
    recorder = Recorder()
    transport = Transport("b", {"a": make_service(a, metadata, clock)})
    transport.fail_opens = 2
    config = FetcherConfig(max_wait_ms=200, backoff_ms=20, reconnect_backoff_ms=30_000,
                           reconnect_backoff_max_ms=60_000)
    manager = make_manager(b, metadata, clock, transport, config, observer=recorder)
    nodes.managers.append(manager)
    manager.refresh()
    await until(lambda: len(recorder.broken) == 1)  # first open refused: a 30 s backoff begins
    session = manager.sessions["a"]
    assert session.failures == 1
    assert not manager.peer_restarted("c")  # no session with that broker
    assert manager.peer_restarted("a")
    await until(lambda: len(recorder.broken) == 2, timeout_s=5)  # reopened at once (and refused again)
    assert session.failures == 1  # counted afresh, so the next backoff is the first one again
    manager.peer_restarted("a")
    await until(lambda: follower.durable_end_offset == 2, timeout_s=5)
    assert len(transport.opened) == 1 and session.failures == 0


@pytest.mark.asyncio
async def test_under_live_traffic_the_follower_stays_in_sync_and_is_shrunk_when_it_stops(nodes) -> None:
    """Real clocks: the ISR check runs every 50 ms with a 1 s lag bound while a producer appends; the
    follower dies (shrunk by lag), comes back and catches up (expanded)."""
    def clock() -> int:
        return time.monotonic_ns() // 1_000_000

    a, b, metadata = nodes("a"), nodes("b"), Metadata()
    leader, follower = lead_and_follow(a, b, metadata)
    service = LeaderFetchService(lambda: a.replicas, metadata.lookup, IsrTracker("a"),
                                 LeaderFetchConfig(lag_time_max_ms=1000, isr_check_interval_ms=50), clock,
                                 metadata.submit)
    upkeep = asyncio.ensure_future(service.maintain_forever())
    try:
        manager, _ = start(nodes, b, metadata, clock, {"a": service})
        loop = asyncio.get_running_loop()
        stop_at = loop.time() + 1.5
        while loop.time() < stop_at:
            leader.append(b"\x00\x00\x00\x03abc", 1)
            await asyncio.sleep(0.002)
        await until(lambda: follower.durable_end_offset == leader.leo)
        assert metadata.submitted == [] and metadata.assignments[KEY].isr == ("a", "b")
        await manager.close()  # the follower dies
        await until(lambda: metadata.assignments[KEY].isr == ("a",), timeout_s=5.0)
        (shrink,) = metadata.submitted
        assert shrink.isr == ("a",) and shrink.leader_epoch == 1
        # It comes back, catches up under the current leader epoch, and is expanded into the ISR again.
        leader.append(b"\x00\x00\x00\x03xyz", 1)
        start(nodes, b, metadata, clock, {"a": service})
        await until(lambda: metadata.assignments[KEY].isr == ("a", "b"), timeout_s=5.0)
        assert metadata.submitted[-1].isr == ("a", "b")
        # The expansion proves it reached what the leader had written when it checked; the record appended
        # last may still be on the leader's writer thread then, so it arrives with the next fetch.
        await until(lambda: follower.durable_end_offset == leader.leo)
    finally:
        upkeep.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await upkeep


async def _deposed_leader_with_tail(nodes, committed_hwm: int):
    """b led epoch 1 and holds [0, 10) with a local HWM of 10 (as a checkpoint written before the issue 13
    fix could say); a, the new leader of epoch 2, holds [0, 6) of epoch 1 plus 3 records of its own; the
    metadata's committed HWM is ``committed_hwm``."""
    a, b, metadata, clock, new, old = await both_hold_six(nodes)
    await publish(old, 4, tag="lost")
    old.update_replica_end("a", 10)  # the local HWM moves to 10 (standalone rule): above the committed HWM
    assert old.hwm == 10
    new.become_leader(2, isr=("a", "b"))
    await publish(new, 3, tag="new")
    old.become_follower(2, "a")
    assign(metadata, "a", 2)
    metadata.set(KEY, committed_hwm=committed_hwm)
    return a, b, metadata, clock, new, old


@pytest.mark.asyncio
async def test_a_deposed_leader_whose_local_hwm_is_above_the_committed_hwm_truncates_to_the_new_leader(
        nodes) -> None:
    a, b, metadata, clock, new, old = await _deposed_leader_with_tail(nodes, committed_hwm=6)
    recorder = Recorder()
    _, transport = start(nodes, b, metadata, clock, {"a": make_service(a, metadata, clock)}, observer=recorder)
    await until(lambda: old.durable_end_offset == new.leo and stored_chunks(old) == stored_chunks(new))
    assert old.log.leader_epochs == [(1, 0), (2, 6)] and recorder.refused == []
    diverged = [r for r in transport.opened[0].requests_seen if r.partitions[0].fetch_offset == 10]
    assert len(diverged) == 1  # one divergence, one truncation (to 6, below the stale local HWM), no loop


@pytest.mark.asyncio
async def test_a_truncation_below_the_committed_hwm_fails_closed_instead_of_looping(nodes) -> None:
    # The committed HWM (8) is above where the leader's epoch 1 ends (6): truncating to match it would drop
    # committed records, so the follower refuses, keeps its log and stops fetching the partition.
    a, b, metadata, clock, new, old = await _deposed_leader_with_tail(nodes, committed_hwm=8)
    recorder = Recorder()
    manager, transport = start(nodes, b, metadata, clock, {"a": make_service(a, metadata, clock)},
                               observer=recorder)
    await until(lambda: bool(recorder.refused))
    (key, error), = recorder.refused
    assert key == KEY and error.code == "storage_unavailable" and "committed offset 8" in error.render()
    assert old.leo == old.durable_end_offset == 10 and manager.sessions["a"].stopped == {KEY: 2}
    requests = len(transport.opened[0].requests_seen)
    await asyncio.sleep(0.1)
    assert len(transport.opened[0].requests_seen) == requests  # quarantined: no spinning


@pytest.mark.asyncio
async def test_a_truncation_that_cannot_shorten_the_log_is_refused(nodes) -> None:
    from cursus.broker.replica import TruncationRefused
    from cursus.storage.epochs import UNDEFINED, EpochEnd

    b = nodes("b")
    replica = b.open()
    replica.become_leader(1, isr=("b",))
    await publish(replica, 5)
    replica.become_follower(2, "a")
    # An undefined answer truncates to the committed HWM; at the LEO that changes nothing, and asking again
    # would get the same answer: refused, nothing truncated.
    with pytest.raises(TruncationRefused):
        await replica.truncate_to_epoch(EpochEnd(UNDEFINED, UNDEFINED), committed_hwm=5)
    with pytest.raises(TruncationRefused):
        await replica.truncate_to_epoch(EpochEnd(1, 3), committed_hwm=4)
    assert replica.leo == 5
    assert await replica.truncate_to_epoch(EpochEnd(1, 4), committed_hwm=4) == (4, True)
    assert replica.leo == 4


@pytest.mark.asyncio
async def test_the_committed_hwm_never_covers_a_deposed_leaders_divergent_tail(nodes) -> None:
    """Issue 13 anomaly, as the kill -9 and SIGSTOP cluster tests hit it: the deposed leader becomes a
    follower and applies the assignment's committed HWM (the new leader's, 9) while its own log still ends
    with a tail the new leader never had; clamped to the bare LEO, its local HWM covered that tail and was
    checkpointed above the HWM the new leader was elected with (6), and the truncation then had to go below
    it. The HWM must stay at the prefix known to match the leader until the leader checked the lineage."""
    a, b, metadata, clock, new, old = await both_hold_six(nodes)
    old.update_replica_end("a", 6)
    assert old.hwm == 6
    await publish(old, 4, tag="lost")  # never replicated, never committed
    new.become_leader(2, isr=("a", "b"))
    await publish(new, 3, tag="new")
    assign(metadata, "a", 2)
    metadata.set(KEY, committed_hwm=9)
    old.become_follower(2, "a")
    old.advance_hwm(9)  # what the broker does with the applied assignment's committed HWM
    assert old.hwm == 6 and old.log.hwm == 6  # not 9: offsets 6..8 here are the lost tail
    recorder = Recorder()
    start(nodes, b, metadata, clock, {"a": make_service(a, metadata, clock)}, observer=recorder)
    await until(lambda: stored_chunks(old) == stored_chunks(new) and old.hwm == 9)
    assert recorder.refused == [] and old.log.leader_epochs == [(1, 0), (2, 6)]


@pytest.mark.asyncio
async def test_fetched_chunks_are_checked_through_run_blocking_off_the_loop(nodes) -> None:
    """The CRC and record walk of a fetched response run through the manager's ``run_blocking`` (the
    broker.s offload pool): here a real thread."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    a, b, metadata, clock = nodes("a"), nodes("b"), Metadata(), Clock()
    leader, follower = lead_and_follow(a, b, metadata)
    for _ in range(3):
        await publish(leader, 50)
    pool = ThreadPoolExecutor(1, thread_name_prefix="offload-test")
    checked: list[tuple[int, str]] = []

    async def run_blocking(size: int, fn):
        def run():
            checked.append((size, threading.current_thread().name))
            return fn()
        return await asyncio.get_running_loop().run_in_executor(pool, run)

    try:
        start(nodes, b, metadata, clock, {"a": make_service(a, metadata, clock)}, run_blocking=run_blocking)
        await until(lambda: follower.durable_end_offset == 150)
        assert stored_chunks(follower) == stored_chunks(leader)
        assert checked and all(name.startswith("offload-test") for _, name in checked)
        assert sum(size for size, _ in checked) == sum(len(c) for c in stored_chunks(leader))
    finally:
        pool.shutdown(wait=True)


@pytest.mark.asyncio
async def test_followers_fetch_written_chunks_while_the_leader_fsyncs_but_the_hwm_waits_for_it(
        nodes, monkeypatch) -> None:
    """Every fsync takes 300 ms (the fsync_delay_ms fault): the follower gets the chunk while the leader's
    own fsync is still running (the fetch overlaps it), yet the HWM never passes the leader's durable end."""
    from cursus.storage import faults

    a, b, metadata, clock = nodes("a"), nodes("b"), Metadata(), Clock()
    leader, follower = lead_and_follow(a, b, metadata)
    start(nodes, b, metadata, clock, {"a": make_service(a, metadata, clock)})
    await publish(leader, 1)
    await until(lambda: follower.durable_end_offset == 1 and leader.hwm == 1)
    seen: list[tuple[int, int]] = []
    leader.add_progress_listener(lambda r: seen.append((r.hwm, r.durable_end_offset)))
    monkeypatch.setattr(faults, "ACTIVE", faults.Faults(fsync_delay_ms=300))
    leader.append(records(1, 3), 3)
    await until(lambda: follower.leo == 4)
    assert leader.durable_end_offset == 1  # served before the leader's fsync finished
    await until(lambda: leader.hwm == 4, timeout_s=10)
    assert all(hwm <= durable for hwm, durable in seen)
    assert stored_chunks(follower) == stored_chunks(leader)


def _leader_log_with_a_gap(node: Node, after: int = 0) -> None:
    """Records [0, 3), a gap up to 8 (as the cleaner leaves one), then ``after`` records from 8."""
    from cursus.storage import PartitionLog
    from tests.unit.test_storage_support import record_for, records_section, small_config

    prepared = PartitionLog.open(node.directory / "t-0", small_config(segment_bytes=64 * 1024))
    prepared.append_chunk(0, 3, records_section([record_for(i) for i in range(3)]), leader_epoch=1)
    prepared.skip_gap(8)
    if after:
        prepared.append_chunk(8, after, records_section([record_for(8 + i) for i in range(after)]), leader_epoch=1)
    prepared.flush()
    prepared.close()


def _gap_tamper(mode: str) -> Callable[[pb.FetchResponse], pb.FetchResponse] | None:
    """``flag``: the leader's answers as they are; ``no_flag``: as from a log never cleaned (no
    ``cleaned_gaps``); ``other_epoch``: the flag in an answer naming another leader epoch."""
    def tamper(response: pb.FetchResponse) -> pb.FetchResponse:
        for data in response.partitions:
            if mode == "no_flag":
                data.cleaned_gaps = False
            elif mode == "other_epoch" and not data.HasField("error"):
                data.leader_epoch = 2
        return response
    return None if mode == "flag" else tamper


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["flag", "no_flag", "other_epoch"])
async def test_a_follower_skips_a_gap_that_ends_the_leaders_log_only_when_the_leader_says_its_log_has_gaps(
        nodes, mode) -> None:
    """The leader's log ends in a gap its cleaner left (records [0, 3), then nothing up to its LEO 8): the
    fetch at 3 gets ``skip_to=8`` and ``cleaned_gaps``; the follower continues its log at 8 (durably) and
    the HWM reaches 8 without another append, whatever the topic's policy (the manager has no policy
    input). Without the flag, or with it for another leader epoch, the hint is ignored (a gap is refused)."""
    a, b, metadata, clock = nodes("a"), nodes("b"), Metadata(), Clock()
    _leader_log_with_a_gap(a)
    leader, follower = lead_and_follow(a, b, metadata)
    assert leader.leo == 8
    observer = FollowerObserver()
    refused: list[TypedError] = []
    observer.append_refused = lambda key, error: refused.append(error)  # type: ignore[method-assign]
    manager, transport = start(nodes, b, metadata, clock, {"a": make_service(a, metadata, clock)},
                               tamper=_gap_tamper(mode), observer=observer)
    if mode == "flag":
        await until(lambda: follower.durable_end_offset == 8 and leader.hwm == 8 and follower.hwm == 8)
        assert follower.log.log_end_offset == follower.log.durable_end_offset == 8
        assert stored_chunks(follower) == stored_chunks(leader)
    else:
        await until(lambda: transport.opened and sum(r.partitions[0].fetch_offset == 3
                                                     for r in transport.opened[0].requests_seen) >= 2)
        assert follower.leo == follower.durable_end_offset == 3 and leader.hwm == 3
    assert not refused


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["flag", "no_flag", "other_epoch"])
async def test_a_chunk_after_a_gap_is_copied_only_when_the_leader_says_its_log_has_gaps(nodes, mode) -> None:
    """Issue 18 (a topic switched from compact to delete keeps its gaps): the leader's log holds [0, 3), a
    gap, [8, 10). With ``cleaned_gaps`` in the fetched epoch a follower from empty copies it byte for byte,
    gap included; otherwise the chunk at 8 is refused (``OFFSET_OUT_OF_RANGE``: a log never cleaned has no
    gaps) and the partition stops (quarantine, fail closed) at 3."""
    a, b, metadata, clock = nodes("a"), nodes("b"), Metadata(), Clock()
    _leader_log_with_a_gap(a, after=2)
    leader, follower = lead_and_follow(a, b, metadata)
    assert leader.leo == 10
    recorder = Recorder()
    manager, transport = start(nodes, b, metadata, clock, {"a": make_service(a, metadata, clock)},
                               tamper=_gap_tamper(mode), observer=recorder)
    if mode == "flag":
        await until(lambda: follower.durable_end_offset == 10 and leader.hwm == 10 and follower.hwm == 10)
        assert stored_chunks(follower) == stored_chunks(leader)
        assert follower.log.has_compacted_segments()  # as a leader it says so in turn
        assert not recorder.refused
    else:
        await until(lambda: bool(recorder.refused))
        assert [e.code for _, e in recorder.refused] == ["OFFSET_OUT_OF_RANGE"]
        await until(lambda: follower.durable_end_offset == 3)
        assert follower.leo == 3 and manager.sessions["a"].stopped == {KEY: 1}


@pytest.mark.asyncio
async def test_a_new_leaders_first_append_in_flight_still_ends_the_old_epoch_where_it_began(nodes) -> None:
    """Finding E (chaos seed 10): the deposed leader (b) wrote one stale record at offset 6 in its epoch 1
    after the new leader (a) took epoch 2 with the same log. a then appended its own record at 6, and
    b's fetch (offset 7, last epoch 1) reached a while that append was queued on a's writer thread, before
    the log's epoch history learned epoch 2. Counting epoch 2 from the LEO (7, the append in flight
    included), a answered "epoch 1 ends at 7": no divergence. a counted b's end 7 in its candidate HWM,
    and b's HWM passed its own divergent record; the next fetch diverged at 6 below that HWM, the
    truncation was refused and b stopped replicating for good. Epoch 2 starts at a's first append (6)."""
    import threading

    a, b, metadata, clock, new, old = await both_hold_six(nodes)
    old.update_replica_end("a", 6)
    assert old.hwm == 6
    new.become_leader(2, isr=("a", "b"))
    assign(metadata, "a", 2)
    metadata.set(KEY, committed_hwm=6)
    new.on_hwm_change = lambda r: metadata.set(KEY, committed_hwm=r.hwm)  # the leader's commits reach metadata
    await publish(old, 1, tag="stale")  # the deposed leader's queued request, served before its role change
    old.become_follower(2, "a")
    old.advance_hwm(6)
    assert (old.leo, old.hwm, old.log.leader_epochs) == (7, 6, [(1, 0)])

    release = threading.Event()
    stalled: asyncio.Future[object] = asyncio.get_running_loop().create_future()
    a.writer.submit_call(lambda: release.wait(10), stalled)  # a's writer thread is busy
    new.append(records(6, 1, "new"), 1)  # the new leader's first record of epoch 2, queued behind it
    assert new.log.leader_epochs == [(1, 0)] and new.leo == 7
    assert new.end_offset_for_epoch(1) == (1, 6)  # not (1, 7): epoch 2 starts at its first append

    recorder = Recorder()
    _, transport = start(nodes, b, metadata, clock, {"a": make_service(a, metadata, clock)}, observer=recorder)
    await until(lambda: len(transport.opened) == 1 and bool(transport.opened[0].requests_seen))
    assert transport.opened[0].requests_seen[0].partitions[0].fetch_offset == 7
    # the divergence is answered while a's append is still in flight: b truncates to 6, fetches from 6, and
    # a's HWM counts b's end 6 (b's truncation and its next fetch are separate steps: wait for both)
    await until(lambda: old.leo == 6 and new.hwm == 6)
    assert old.hwm == 6 and recorder.refused == [] and not stalled.done()
    release.set()
    await until(lambda: stored_chunks(old) == stored_chunks(new) and old.hwm == 7 and new.hwm == 7)
    assert recorder.refused == [] and old.log.leader_epochs == [(1, 0), (2, 6)]
