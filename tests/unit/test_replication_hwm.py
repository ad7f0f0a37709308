"""HwmCommitter: one CommitHwm in flight, coalescing (latest candidate wins), retry after a failed or
unknown-outcome submit, and the committed HWM reaching a real leader replica through applied metadata."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from cursus.metadata.apply import ApplyResult, apply
from cursus.metadata.commands import BrokerHeartbeat, CommitHwm, CreateTopic
from cursus.metadata.state import BrokerInfo, MetadataState
from cursus.metadata.topics import TopicSpec
from cursus.params import parse_args
from cursus.replication.hwm import HwmCommitter, LocalHwmCommitter
from cursus.wire.errors import BrokerError
from tests.unit.test_replica_roles import Node, records


@dataclasses.dataclass
class FakeReplica:
    """The part of a leader replica the committer uses."""

    topic: str
    partition: int
    candidate_hwm: int = 0
    hwm: int = 0
    leader_epoch: int = 1
    lifecycle_epoch: int = 0
    writable: bool = True
    on_candidate_hwm: Callable[..., None] | None = None

    def move(self, candidate: int) -> None:
        self.candidate_hwm = candidate
        assert self.on_candidate_hwm is not None
        self.on_candidate_hwm(self)

    def on_committed_hwm(self, leader_epoch: int, hwm: int) -> None:
        if leader_epoch == self.leader_epoch:
            self.hwm = max(self.hwm, hwm)


class Submits:
    """A submit whose every call waits until the test answers it."""

    def __init__(self) -> None:
        self.commands: list[CommitHwm] = []
        self._answers: list[asyncio.Future[ApplyResult]] = []
        self.arrived = asyncio.Event()

    async def __call__(self, command: CommitHwm) -> ApplyResult:
        self.commands.append(command)
        fut: asyncio.Future[ApplyResult] = asyncio.get_running_loop().create_future()
        self._answers.append(fut)
        self.arrived.set()
        return await fut

    async def next(self, count: int) -> CommitHwm:
        """Wait until ``count`` commands arrived; return the last one."""
        while len(self.commands) < count:
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), 5)
        return self.commands[count - 1]

    def answer(self, index: int, result: ApplyResult | BaseException) -> None:
        if isinstance(result, BaseException):
            self._answers[index].set_exception(result)
        else:
            self._answers[index].set_result(result)


def _entries(command: CommitHwm) -> list[tuple[str, int, int]]:
    return [(e.topic, e.partition, e.hwm) for e in command.entries]


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_one_command_in_flight_and_everything_meanwhile_coalesces() -> None:
    submits = Submits()
    committer = HwmCommitter("a", submits, retry_backoff_s=0)
    p0, p1, p2 = FakeReplica("t", 0), FakeReplica("t", 1), FakeReplica("u", 0, leader_epoch=4, lifecycle_epoch=2)
    for r in (p0, p1, p2):
        committer.attach(r)
    p0.move(3)
    first = await submits.next(1)
    assert _entries(first) == [("t", 0, 3)] and first.broker_id == "a" and committer.in_flight
    for candidate in (4, 5, 9):
        p0.move(candidate)
    p1.move(2)
    p2.move(7)
    await _settle()
    assert len(submits.commands) == 1  # at most one in flight
    p0.hwm = 3
    submits.answer(0, ApplyResult(changed=True, hwm_accepted=(("t", 0),)))
    second = await submits.next(2)
    assert _entries(second) == [("t", 0, 9), ("t", 1, 2), ("u", 0, 7)]  # latest candidate per partition
    assert (second.entries[2].leader_epoch, second.entries[2].lifecycle_epoch) == (4, 2)
    submits.answer(1, ApplyResult(changed=True))
    await _settle()
    assert not committer.in_flight and len(submits.commands) == 2
    await committer.close()


@pytest.mark.asyncio
async def test_pipelined_commands_go_out_at_once_up_to_the_bound_then_coalesce() -> None:
    submits = Submits()
    committer = HwmCommitter("a", submits, retry_backoff_s=0, max_in_flight=2)
    p0, p1 = FakeReplica("t", 0), FakeReplica("t", 1)
    committer.attach(p0)
    committer.attach(p1)
    p0.move(3)
    first = await submits.next(1)
    p0.move(5)  # the first is still in flight: the second goes out now, not after it
    second = await submits.next(2)
    assert _entries(first) == [("t", 0, 3)] and _entries(second) == [("t", 0, 5)]
    for candidate in (6, 8):
        p0.move(candidate)
    p1.move(2)
    await _settle()
    assert len(submits.commands) == 2  # both busy: what moves meanwhile waits, coalesced
    # The later command commits first; the earlier one lands after it and is skipped by the FSM.
    p0.hwm = 5
    submits.answer(1, ApplyResult(changed=True, hwm_accepted=(("t", 0),)))
    third = await submits.next(3)
    assert _entries(third) == [("t", 0, 8), ("t", 1, 2)]
    submits.answer(0, ApplyResult(hwm_rejected=(("t", 0, "hwm_not_above_committed"),)))
    submits.answer(2, ApplyResult(changed=True))
    await _settle()
    assert not committer.in_flight and len(submits.commands) == 3
    await committer.close()


@pytest.mark.asyncio
async def test_a_failed_or_unknown_submit_is_retried_with_the_latest_candidates() -> None:
    submits = Submits()
    committer = HwmCommitter("a", submits, retry_backoff_s=0)
    p0, p1 = FakeReplica("t", 0), FakeReplica("t", 1)
    committer.attach(p0)
    committer.attach(p1)
    p0.move(5)
    await submits.next(1)
    p1.move(1)
    submits.answer(0, BrokerError.of("request_timeout", outcome="unknown"))
    retry = await submits.next(2)
    assert sorted(_entries(retry)) == [("t", 0, 5), ("t", 1, 1)] and committer.submit_failures == 1
    submits.answer(1, BrokerError.of("no_raft_leader"))
    p0.move(6)
    third = await submits.next(3)
    assert sorted(_entries(third)) == [("t", 0, 6), ("t", 1, 1)]
    submits.answer(2, ApplyResult(changed=True, hwm_rejected=(("t", 1, "STALE_LEADER_EPOCH"),)))
    await _settle()
    assert committer.entries_rejected == 1 and len(submits.commands) == 3  # a rejection is not retried
    await committer.close()


@pytest.mark.asyncio
async def test_replicas_that_stopped_leading_or_have_nothing_new_are_skipped_and_detach_works() -> None:
    submits = Submits()
    committer = HwmCommitter("a", submits, retry_backoff_s=0, max_command_bytes=60)
    p0, p1, p2 = FakeReplica("t", 0), FakeReplica("t", 1), FakeReplica("t", 2)
    for r in (p0, p1, p2):
        committer.attach(r)
    p0.move(3)
    await submits.next(1)
    p1.move(4)
    p1.writable = False  # deposed meanwhile
    p2.move(2)
    p2.hwm = 2           # already committed
    submits.answer(0, ApplyResult(changed=True))
    await _settle()
    assert len(submits.commands) == 1
    p1.writable = True
    p1.move(5)
    p2.move(8)
    await submits.next(2)
    assert _entries(submits.commands[1]) == [("t", 1, 5)]  # the size bound: one entry per command here
    submits.answer(1, ApplyResult(changed=True))
    await submits.next(3)
    assert _entries(submits.commands[2]) == [("t", 2, 8)]
    committer.detach(p0)
    assert p0.on_candidate_hwm is None
    await committer.close()
    assert p1.on_candidate_hwm is None and not committer.in_flight


@pytest.mark.asyncio
async def test_local_committer_applies_at_once() -> None:
    local = LocalHwmCommitter()
    replica = FakeReplica("t", 0)
    local.attach(replica)
    replica.move(4)
    assert replica.hwm == 4
    local.detach(replica)
    assert replica.on_candidate_hwm is None


# ------------------------------------------------- end to end with a real replica and applied metadata


@pytest_asyncio.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    made = Node(tmp_path / "a", "a")
    yield made
    await made.close()


@pytest.mark.asyncio
async def test_committed_hwm_reaches_the_leader_replica_through_applied_metadata(node: Node) -> None:
    state = MetadataState(cluster=True)
    for b in ("a", "b"):
        state, _ = apply(state, BrokerHeartbeat(f"hb-{b}", BrokerInfo(b, f"{b}:1"), 50))
    spec = parse_args(TopicSpec, {"topic": "t", "partitions": "1", "replication_factor": "2"}, "CREATE")
    state, _ = apply(state, CreateTopic("c", spec))
    key = ("t", 0)
    state = dataclasses.replace(state, assignments={
        key: dataclasses.replace(state.assignments[key], replicas=("a", "b"), leader="a", isr=("a", "b"))})
    box = {"state": state}
    replica = node.replica

    def take_role() -> None:  # what the broker's metadata listener does
        a = box["state"].assignments[key]
        replica.lifecycle_epoch = a.lifecycle_epoch
        replica.become_leader(a.leader_epoch, a.isr, committed_hwm=a.committed_hwm)

    async def submit(command: CommitHwm) -> ApplyResult:
        await asyncio.sleep(0)
        box["state"], result = apply(box["state"], command)
        take_role()
        return result

    committer = HwmCommitter("a", submit, retry_backoff_s=0)
    committer.attach(replica)
    take_role()
    await replica.wait_writable()
    replica.append(records(0, 5), 5)
    acked = replica.wait_committed(5, ("a", "b"))
    await replica.wait_durable(5)
    assert replica.hwm == 0 and box["state"].assignments[key].committed_hwm == 0
    replica.update_replica_end("b", 5)
    await asyncio.wait_for(acked, 5)
    assert replica.hwm == 5 == box["state"].assignments[key].committed_hwm
    await committer.close()
