"""The coordinator service through its seam (cursus.coordinator.ports): a test GroupLog whose commits the test
controls, a fake timer and fake clocks. Deterministic: nothing waits on real time.

* state a reader can observe (FETCH_OFFSET, resume offsets, GROUP_STATUS, LIST_GROUPS, HEARTBEAT) is durable;
* a failed append leaves memory as it was and the command gets the log's typed error;
* concurrent commits to one partition apply in log order;
* a retried JOIN_GROUP gets the same member;
* session expiry runs on the injected monotonic clock, not the wall clock;
* a hypothesis state machine over random commits, log commits and log failures.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cursus.coordinator.offsets import GroupRecord, MembershipRecord, OffsetSnapshotRecord, Snapshot
from cursus.coordinator.ports import PartitionOffsets
from cursus.coordinator.service import GroupCoordinator
from cursus.metadata.topics import TopicDefinition
from cursus.wire.errors import BrokerError

SESSION_MS = 1_000


class ControlledLog:
    """A GroupLog whose appends become durable (or fail) when the test says so (``auto``: at once)."""

    def __init__(self) -> None:
        self.auto = True
        self.refuse = False
        self.appended: list[tuple[str, list[GroupRecord]]] = []
        self.pending: list[asyncio.Future[None]] = []

    async def replay(self) -> Snapshot:
        return Snapshot()

    def append(self, group: str, records: Sequence[GroupRecord]) -> asyncio.Future[None]:
        if self.refuse:
            raise BrokerError.of("storage_unavailable", reason="fenced")
        self.appended.append((group, list(records)))
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.auto:
            fut.set_result(None)
        else:
            self.pending.append(fut)
        return fut

    def commit_next(self) -> None:
        self.pending.pop(0).set_result(None)

    def fail_last(self) -> None:
        """The latest pending write failed while the earlier ones are still in flight (a cluster follower
        whose earlier command the old Raft leader had already accepted, the later one not)."""
        self.pending.pop().set_exception(BrokerError.of("request_timeout", outcome="unknown"))

    def fail_all(self) -> None:
        """A write failed: it and every later pending one fail (as a fenced partition does)."""
        for fut in self.pending:
            fut.set_exception(BrokerError.of("storage_unavailable", reason="outcome_unknown"))
        self.pending.clear()
        self.refuse = True

    async def close(self) -> None:
        pass


class FakeTimer:
    def __init__(self, delay_s: float, callback: Callable[[], None]) -> None:
        self.delay_s, self.callback, self.cancelled = delay_s, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class Env:
    def __init__(self) -> None:
        self.mono = 5_000_000
        self.wall = 1_767_225_600_000  # 2026-01-01T00:00:00Z
        self.log = ControlledLog()
        self.timers: list[FakeTimer] = []
        self.reasons: list[str | None] = []
        self.topics = {"t": TopicDefinition("t", 2)}
        self.coord = GroupCoordinator(
            open_log=self._open, topic=self.topics.get, topic_names=lambda: list(self.topics),
            partition_offsets=lambda t, p: PartitionOffsets(0, 100, 100) if t in self.topics else None,
            report=self.reasons.append, call_later=self._call_later, clock_ms=lambda: self.mono,
            wall_ms=lambda: self.wall, session_timeout_ms=SESSION_MS, rng=random.Random(7))

    async def _open(self) -> ControlledLog:
        return self.log

    def _call_later(self, delay_s: float, callback: Callable[[], None]) -> FakeTimer:
        timer = FakeTimer(delay_s, callback)
        self.timers.append(timer)
        return timer

    def fire_timers(self) -> None:
        for timer in [t for t in self.timers if not t.cancelled]:
            self.timers.remove(timer)
            timer.callback()


async def started() -> Env:
    env = Env()
    await env.coord.open()
    assert env.reasons == ["replay not started", None] and env.coord.ready
    return env


async def running(coro) -> asyncio.Task:
    """Start ``coro`` and let it run until it waits (for the log)."""
    task = asyncio.ensure_future(coro)
    for _ in range(3):
        await asyncio.sleep(0)
    return task


def code_of(task: asyncio.Task) -> str:
    exc = task.exception()
    assert isinstance(exc, BrokerError), exc
    return exc.error.code


async def test_a_commit_is_visible_only_once_durable_and_a_failed_one_changes_nothing():
    env = await started()
    coord, log = env.coord, env.log
    member = (await coord.join("g", "c", topic="t", generation=None)).member_id
    log.auto = False

    task = await running(coord.commit("g", "t", member, 1, {0: 5}))
    assert not task.done()
    assert coord.fetch_offset("g", "t", 0) == 0 and coord.committed("g", "t", 0) is None
    assert coord.status("g")["offsets"][0]["committed_offset"] is None
    log.commit_next()
    assert await task == 1
    assert coord.fetch_offset("g", "t", 0) == 5 and coord.committed("g", "t", 0) == 5

    task = await running(coord.commit("g", "t", member, 1, {0: 9}))
    assert coord.fetch_offset("g", "t", 0) == 5
    log.fail_all()
    await asyncio.wait([task])
    assert code_of(task) == "storage_unavailable"
    assert coord.fetch_offset("g", "t", 0) == 5 and coord.committed("g", "t", 0) == 5
    assert coord.table.groups["g"].offsets[("t", 0)] == 5  # the staged state was rolled back too

    with pytest.raises(BrokerError) as refused:  # the log refuses at once: nothing changes either
        await coord.commit("g", "t", member, 1, {0: 7})
    assert refused.value.error.code == "storage_unavailable"
    assert coord.fetch_offset("g", "t", 0) == 5 and coord.table.groups["g"].offsets[("t", 0)] == 5


async def test_a_later_failed_commit_does_not_roll_back_an_earlier_one_still_in_flight():
    """Chaos seed 2 (issue 14): commit A (p1=706) and commit B (p0=773) in flight; B fails (the Raft leader
    changed), A then becomes durable and is acknowledged. The rollback used to put the staged state back to the
    durable copy *before A*, so the next commit's offset snapshot wrote p1=700 over the acknowledged 706 and
    FETCH_OFFSET went backwards (offsets scaled down here)."""
    env = await started()
    coord, log = env.coord, env.log
    member = (await coord.join("g", "c", topic="t", generation=None)).member_id
    await coord.commit("g", "t", member, 1, {0: 70, 1: 60})
    log.auto = False
    a = await running(coord.commit("g", "t", member, 1, {1: 76}))
    b = await running(coord.commit("g", "t", member, 1, {0: 73}))
    log.fail_last()  # B
    await asyncio.wait([b])
    assert code_of(b) == "request_timeout"
    assert coord.table.groups["g"].offsets == {("t", 0): 70, ("t", 1): 76}  # A stays staged
    assert coord.fetch_offset("g", "t", 1) == 60 and not a.done()  # A is not durable yet
    log.commit_next()  # A
    assert await a == 1
    assert coord.fetch_offset("g", "t", 1) == 76
    c = await running(coord.commit("g", "t", member, 1, {0: 80}))
    log.commit_next()
    assert await c == 1
    assert log.appended[-1][1][0].offsets == {0: 80, 1: 76}  # the snapshot keeps the acknowledged 76
    assert coord.fetch_offset("g", "t", 1) == 76 and coord.fetch_offset("g", "t", 0) == 80


async def test_a_later_failed_commit_then_the_earlier_one_failing_too_rolls_back_to_durable():
    env = await started()
    coord, log = env.coord, env.log
    member = (await coord.join("g", "c", topic="t", generation=None)).member_id
    await coord.commit("g", "t", member, 1, {0: 5})
    log.auto = False
    a = await running(coord.commit("g", "t", member, 1, {1: 6}))
    b = await running(coord.commit("g", "t", member, 1, {0: 7}))
    log.fail_last()
    await asyncio.wait([b])
    assert coord.table.groups["g"].offsets == {("t", 0): 5, ("t", 1): 6}
    log.fail_last()  # now A as well
    await asyncio.wait([a])
    assert code_of(a) == "request_timeout"
    assert coord.table.groups["g"].offsets == coord.visible["g"].offsets == {("t", 0): 5}


async def test_concurrent_commits_to_one_partition_apply_in_log_order():
    env = await started()
    coord, log = env.coord, env.log
    member = (await coord.join("g", "c", topic="t", generation=None)).member_id
    log.auto = False
    first = await running(coord.commit("g", "t", member, 1, {0: 10}))
    second = await running(coord.commit("g", "t", member, 1, {0: 12}))
    lower = await running(coord.commit("g", "t", member, 1, {0: 11}))  # checked against 12, in log order
    snapshots = [r for _, recs in log.appended for r in recs if isinstance(r, OffsetSnapshotRecord)]
    assert [dict(r.offsets) for r in snapshots] == [{0: 10}, {0: 12}]
    log.commit_next()
    await first
    assert coord.fetch_offset("g", "t", 0) == 10
    assert not lower.done()  # its error reflects 12, which is not durable yet
    log.commit_next()
    await second
    await asyncio.wait([lower])
    assert code_of(lower) == "offset_regression" and coord.fetch_offset("g", "t", 0) == 12
    same = await running(coord.commit("g", "t", member, 1, {0: 12}))  # same value: accepted, nothing appended
    assert await same == 1 and len(snapshots) == 2


async def test_joins_and_registrations_are_visible_only_once_durable():
    env = await started()
    coord, log = env.coord, env.log
    log.auto = False
    join = await running(coord.join("g", "a", topic="t", generation=None))
    assert coord.list_groups() == [] and coord.committed("g", "t", 0) is None
    with pytest.raises(BrokerError, match="group_not_found"):
        coord.fetch_offset("g", "t", 0)
    log.commit_next()
    a = (await join).member_id
    assert coord.list_groups() == ["g"] and coord.status("g")["generation"] == 1

    join_b = await running(coord.join("g", "b", topic="t", generation=None))
    assert coord.heartbeat("g", a, 1).generation == 1  # generation 2 is not durable yet
    assert coord.status("g")["member_count"] == 1
    log.commit_next()
    b = await join_b
    assert b.group.generation == 2 and set(b.group.members) == {a, b.member_id}
    with pytest.raises(BrokerError, match="GEN_MISMATCH"):
        coord.heartbeat("g", a, 1)

    leave = await running(coord.leave("g", b.member_id, 2))
    log.fail_all()
    await asyncio.wait([leave])
    assert code_of(leave) == "storage_unavailable"
    assert set(coord.table.groups["g"].members) == {a, b.member_id} and coord.status("g")["member_count"] == 2


async def test_a_join_retried_from_the_same_host_gets_the_same_member():
    env = await started()
    coord, log = env.coord, env.log
    log.auto = False
    lost = await running(coord.join("g", "c", topic="t", generation=None, origin="10.0.0.7"))
    retry = await running(coord.join("g", "c", topic="t", generation=None, origin="10.0.0.7"))
    log.commit_next()
    first, again = await lost, await retry
    assert first.member_id == again.member_id and again.group.generation == 1 and not again.rebalanced
    assert len(log.appended) == 1 and coord.status("g")["member_count"] == 1
    log.auto = True
    elsewhere = await coord.join("g", "c", topic="t", generation=None, origin="10.0.0.8")
    assert elsewhere.member_id != first.member_id and elsewhere.group.generation == 2
    coord.heartbeat("g", first.member_id, None)  # heard from under its full id: no longer a retry target
    later = await coord.join("g", "c", topic="t", generation=None, origin="10.0.0.7")
    assert later.member_id not in (first.member_id, elsewhere.member_id) and later.group.generation == 3


async def test_session_expiry_follows_the_monotonic_clock_not_the_wall_clock():
    env = await started()
    coord, log = env.coord, env.log
    a = (await coord.join("g", "a", topic="t", generation=None)).member_id
    b = (await coord.join("g", "b", topic="t", generation=None)).member_id
    assert [t.delay_s for t in env.timers if not t.cancelled] == [SESSION_MS / 1000]
    env.wall += 86_400_000  # the wall clock jumps a day ahead: nobody expires
    env.mono += SESSION_MS // 2
    env.fire_timers()
    assert set(coord.status("g")["members"][i]["member_id"] for i in range(2)) == {a, b}
    # displayed in wall time: half a session before the (jumped) wall clock
    assert coord.status("g")["members"][0]["last_heartbeat"] == "2026-01-01T23:59:59.500Z"
    coord.heartbeat("g", a, None)
    env.mono += SESSION_MS // 2  # b's deadline; a heartbeat half a session ago
    env.fire_timers()
    doc = coord.status("g")
    assert [m["member_id"] for m in doc["members"]] == [a] and doc["generation"] == 3
    memberships = [r for _, recs in log.appended for r in recs if isinstance(r, MembershipRecord)]
    assert [m for m, _ in memberships[-1].members] == [a]
    env.wall -= 2 * 86_400_000  # and back, two days: still nothing expires early
    env.mono += SESSION_MS // 2 - 1
    env.fire_timers()
    assert coord.status("g")["member_count"] == 1
    env.mono += 1
    env.fire_timers()
    assert coord.status("g")["member_count"] == 0


class DurabilityMachine(RuleBasedStateMachine):
    """Random commits, log commits and log failures: readers only ever see the latest durable offsets, every
    acknowledged commit is durable, and after a failure memory equals the durable state."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.env = Env()
        self.loop.run_until_complete(self.env.coord.open())
        self.member = self.loop.run_until_complete(
            self.env.coord.join("g", "c", topic="t", generation=None)).member_id
        self.env.log.auto = False
        self.tasks: list[tuple[asyncio.Task, dict[int, int]]] = []
        self.durable: dict[int, int] = {}  # partition -> offset, from resolved offset snapshots only
        self.snapshots: list[dict[int, int]] = []  # appended, not yet resolved, in log order
        self.seen = 0

    def _step(self) -> None:
        self.loop.run_until_complete(asyncio.sleep(0))
        appended = [r for _, recs in self.env.log.appended for r in recs if isinstance(r, OffsetSnapshotRecord)]
        self.snapshots += [dict(r.offsets) for r in appended[self.seen:]]
        self.seen = len(appended)

    @rule(partition=st.integers(0, 1), offset=st.integers(0, 20))
    def commit(self, partition, offset):
        if self.env.log.refuse:
            return
        task = self.loop.create_task(self.env.coord.commit("g", "t", self.member, 1, {partition: offset}))
        self.tasks.append((task, {partition: offset}))
        self._step()

    @precondition(lambda self: self.env.log.pending)
    @rule()
    def log_commits_one(self):
        self.env.log.commit_next()
        self.durable = self.snapshots.pop(0)
        self._step()

    @precondition(lambda self: self.env.log.pending)
    @rule()
    def log_fails(self):
        self.env.log.fail_all()
        self.snapshots.clear()
        self._step()

    @precondition(lambda self: self.env.log.pending)
    @rule()
    def log_fails_the_latest(self):
        """Only the latest write fails; the earlier ones may still become durable."""
        self.env.log.fail_last()
        self.snapshots.pop()
        self._step()

    @invariant()
    def readers_see_exactly_the_durable_state(self):
        coord = self.env.coord
        for p in (0, 1):
            assert coord.committed("g", "t", p) == self.durable.get(p)
            assert coord.fetch_offset("g", "t", p) == self.durable.get(p, 0)
        if not self.env.log.pending:
            assert coord.table.groups["g"].offsets == coord.visible["g"].offsets
        for task, offsets in self.tasks:
            if task.done() and task.exception() is None:
                assert all(self.durable.get(p, -1) >= o for p, o in offsets.items())

    def teardown(self):
        for task, _ in self.tasks:
            if not task.done():
                task.cancel()
        self.loop.run_until_complete(asyncio.sleep(0))
        self.loop.close()


TestDurabilityMachine = DurabilityMachine.TestCase
TestDurabilityMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
