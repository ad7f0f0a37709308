"""Replica committed-HWM semantics on real logs: candidate over the maximal ISR, visible HWM = committed
HWM, acks waiters (durable, committed with a captured ISR), progress listeners, and a new cluster leader
truncating its tail above the committed HWM (or failing closed below it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from cursus.broker.producer_state import ProducerStateTable
from cursus.broker.replica import Replica
from cursus.broker.replica_role import Role
from cursus.wire.errors import BrokerError
from tests.unit.test_replica_roles import Node, records, stored_chunks, until
from tests.unit.test_replication_support import node_pool
from tests.unit.test_storage_producer_state import batch


class Commits:
    """A committer stand-in: records candidate notifications; the test decides what gets committed."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, replica: Replica) -> None:
        self.calls.append(replica.candidate_hwm)


@pytest_asyncio.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[Callable[[str], Node]]:
    async with node_pool(tmp_path, Node) as make:
        yield make


def _code(fut: asyncio.Future[None]) -> str:
    error = fut.exception()
    assert isinstance(error, BrokerError), error
    return error.error.code


def _outcome(fut: asyncio.Future[None]) -> str | None:
    exc = fut.exception()
    assert isinstance(exc, BrokerError), exc
    return exc.error.fields.get("outcome")


async def _cluster_leader(node: Node, epoch: int, isr: tuple[str, ...], committed: int = 0) -> Commits:
    commits = Commits()
    node.replica.on_candidate_hwm = commits
    node.replica.become_leader(epoch, isr, committed_hwm=committed)
    await node.replica.wait_writable()
    assert node.replica.writable
    return commits


@pytest.mark.asyncio
async def test_visible_hwm_is_the_committed_hwm_and_the_candidate_covers_the_maximal_isr(nodes) -> None:
    node = nodes("a")
    leader = node.replica
    commits = await _cluster_leader(node, 1, ("a", "b"))
    seen: list[tuple[int, int, Role]] = []
    leader.add_progress_listener(lambda r: seen.append((r.durable_end_offset, r.hwm, r.role)))
    leader.append(records(0, 4), 4)
    durable = leader.wait_durable(4)
    acked = leader.wait_committed(4, ("a", "b"))
    await durable  # acks=1: the leader's durable append is enough
    assert leader.durable_end_offset == 4 and leader.candidate_hwm == 0 and leader.hwm == 0
    assert (4, 0, Role.LEADER) in seen
    leader.update_replica_end("b", 3)
    assert leader.candidate_hwm == 3 and commits.calls == [3] and leader.hwm == 0  # not visible yet
    leader.expand_isr_pending("c")  # a proposed expansion counts at once (maximal ISR)
    assert leader.maximal_isr == ("a", "b", "c") and leader.candidate_hwm == 0
    leader.update_replica_end("b", 4)
    leader.update_replica_end("c", 4)
    assert leader.candidate_hwm == 4 and commits.calls == [3, 4]
    leader.on_committed_hwm(1, 3)
    assert leader.hwm == 3 and not acked.done()
    leader.on_committed_hwm(0, 4)  # another epoch: ignored
    leader.on_committed_hwm(1, 2)  # never backward
    assert leader.hwm == 3
    leader.on_committed_hwm(1, 4)
    await acked
    assert (4, 4, Role.LEADER) in seen
    # the applied ISR shows c: it is no longer pending; a withdrawn expansion stops counting
    leader.become_leader(1, ("a", "b", "c"), committed_hwm=4)
    assert leader.maximal_isr == ("a", "b", "c")
    leader.expand_isr_pending("d")
    assert leader.candidate_hwm == 4  # never below the visible HWM
    leader.clear_isr_pending("d")
    assert leader.maximal_isr == ("a", "b", "c")


@pytest.mark.asyncio
async def test_acks_all_waits_for_captured_members_still_in_the_isr_and_for_the_minimum(nodes) -> None:
    node = nodes("a")
    leader = node.replica
    await _cluster_leader(node, 1, ("a", "b", "c"))
    leader.append(records(0, 2), 2)
    acked = leader.wait_committed(2, ("a", "b", "c"), min_isr=2)
    await leader.wait_durable(2)
    leader.update_replica_end("b", 2)
    await asyncio.sleep(0)
    assert not acked.done()  # c (captured, still in the ISR) has not reported
    leader.become_leader(1, ("a", "b"), committed_hwm=0)  # c shrunk out: it can never be elected now
    leader.on_committed_hwm(1, 2)
    await acked  # the committed HWM covers every remaining member and the ISR meets the minimum
    leader.append(records(2, 1), 1)
    alone = leader.wait_committed(3, ("a", "b"), min_isr=2)
    await leader.wait_durable(3)
    leader.become_leader(1, ("a",), committed_hwm=2)  # b shrunk out too: the ISR is below the minimum
    leader.on_committed_hwm(1, 3)
    await asyncio.sleep(0)
    assert not alone.done()  # only the leader has it: never acknowledged as acks=all (the caller times out)
    leader.become_leader(1, ("a", "b"), committed_hwm=3)
    leader.update_replica_end("b", 3)
    await alone
    already = leader.wait_committed(3, ("a", "b"))
    assert already.done() and already.exception() is None


@pytest.mark.asyncio
async def test_waiters_fail_on_role_or_epoch_change_and_on_fencing(nodes) -> None:
    node = nodes("a")
    leader = node.replica
    await _cluster_leader(node, 1, ("a", "b"))
    leader.append(records(0, 2), 2)
    first = leader.wait_committed(2, ("a", "b"))
    await leader.wait_durable(2)
    leader.update_replica_end("b", 2)
    leader.become_leader(2, ("a", "b"), committed_hwm=0)  # re-elected under a new epoch
    await asyncio.sleep(0)
    assert _code(first) == "NOT_LEADER"  # never a false success
    # above the committed HWM (0) of the new assignment: truncated by the new epoch, a definite refusal
    assert _outcome(first) is None
    await leader.wait_writable()
    assert leader.leo == 0  # nothing was committed: the new epoch starts from the committed HWM
    second = leader.wait_committed(1, ("a",))
    durable = leader.wait_durable(1)
    leader.become_follower(3, "b")
    assert _code(second) == "NOT_LEADER" and _code(durable) == "NOT_LEADER"
    # no committed HWM given: the outcome is unknown (break-it finding: a plain NOT_LEADER for records
    # that may be committed made clients resend them)
    assert _outcome(second) == "unknown" and _outcome(durable) == "unknown"
    late = leader.wait_committed(1, ("a",))
    assert _code(late) == "NOT_LEADER" and _outcome(late) == "unknown"

    other = nodes("c")
    await _cluster_leader(other, 1, ("c",))
    pending = other.replica.wait_committed(5, ("c",))
    durable = other.replica.wait_durable(5)
    other.replica.on_failure(OSError("disk"))
    assert _code(pending) == "storage_unavailable" and _code(durable) == "storage_unavailable"


@pytest.mark.asyncio
async def test_a_new_leader_truncates_above_the_committed_hwm_before_it_accepts_writes(nodes) -> None:
    old_node, new_node = nodes("a"), nodes("b")
    old, new = old_node.replica, new_node.replica
    old.become_leader(1, ("a", "b"))  # no committer hook: commits locally (standalone-style)
    new.become_follower(1, "a")
    old.append(batch("p", 1, 1, 3), 3)
    old.append(batch("p", 1, 4, 2), 2)   # seq 4-5 at offsets 3-4: replicated, never committed
    await until(lambda: old.durable_end_offset == 5)
    for chunk in stored_chunks(old):
        new.append_replicated(chunk, 1)
    await until(lambda: new.durable_end_offset == 5)
    assert new.log.producer_state.entries["p"].last_seq == 5
    tables: list[ProducerStateTable] = []
    new.on_leader_ready = lambda replica, table: tables.append(table)
    new.on_candidate_hwm = Commits()
    new.become_leader(2, ("b", "a"), committed_hwm=3)
    with pytest.raises(BrokerError) as refused:
        new.check_writable()
    assert refused.value.error.code == "leader_not_available"  # truncating: not writable yet
    assert new.leo == 3
    await new.wait_writable()
    assert new.writable and (new.leo, new.log.log_end_offset, new.hwm) == (3, 3, 3)
    (table,) = tables
    assert table.entries["p"].last_seq == 3  # the truncated batch is forgotten: a retry appends it again
    base = new.append(records(3, 1), 1)
    await new.wait_durable(4)
    assert base == 3 and new.log.leader_epochs[-1] == (2, 3)


@pytest.mark.asyncio
async def test_a_new_leader_below_the_committed_hwm_fails_closed(nodes) -> None:
    node = nodes("a")
    node.replica.become_follower(1, "x")
    node.replica.become_leader(2, ("a", "b"), committed_hwm=7)
    assert node.replica.role is Role.LEADER and not node.replica.writable
    with pytest.raises(BrokerError) as refused:
        node.replica.append(records(0, 1), 1)
    assert refused.value.error.code == "storage_unavailable" and "below the committed HWM" in str(refused.value)
    assert refused.value.error.retryable  # transient: the node hands the partition over or catches up
    node.replica.on_committed_hwm(2, 9)
    assert node.replica.hwm == 0  # never serves an HWM it cannot back
    node.replica.become_follower(3, "b")  # a follower may fetch what it lacks
    assert node.replica.unavailable is None


@pytest.mark.asyncio
async def test_standalone_without_a_committer_commits_the_candidate_at_once(nodes) -> None:
    node = nodes("a")
    node.replica.become_leader(0)
    node.replica.append(records(0, 3), 3)
    await node.replica.wait_committed(3, ("a",))
    assert node.replica.hwm == node.replica.durable_end_offset == 3


@pytest.mark.asyncio
async def test_durable_reports_from_before_a_leader_truncation_do_not_resurrect_offsets(nodes) -> None:
    old_node, new_node = nodes("a"), nodes("b")
    old, new = old_node.replica, new_node.replica
    old.become_leader(1, ("a",))
    new.become_follower(1, "a")
    old.append(records(0, 5), 5)
    await old.wait_durable(5)
    for chunk in stored_chunks(old):
        new.append_replicated(chunk, 1)  # still in flight on the writer when leadership arrives
    commits = Commits()
    new.on_candidate_hwm = commits
    new.become_leader(2, ("b", "a"), committed_hwm=2)
    await new.wait_writable()  # the writer reported the appends before the preparation: all applied now
    assert (new.leo, new.durable_end_offset, new.hwm, new.log.log_end_offset) == (2, 2, 2, 2)
    new.update_replica_end("a", 5)  # a follower ahead of the new leader (it will truncate by epoch)
    assert new.candidate_hwm == 2 and commits.calls == []


@pytest.mark.asyncio
async def test_acks_all_times_out_with_an_unknown_outcome_and_acks_1_needs_only_the_local_append(nodes) -> None:
    from types import SimpleNamespace

    from cursus.broker.config import load_config
    from cursus.broker.handlers.produce import _wait_ack
    from cursus.broker.metrics import BrokerMetrics

    node = nodes("a")
    leader = node.replica
    await _cluster_leader(node, 1, ("a", "b"))
    config = load_config(environ={}).replace(replica_ack_timeout_ms=50)
    broker = SimpleNamespace(config=config, metrics=BrokerMetrics(), metadata=SimpleNamespace(get=lambda name: None))
    leader.append(records(0, 2), 2)
    await _wait_ack(broker, leader, "leader", 2, leader.isr)  # type: ignore[arg-type]
    with pytest.raises(BrokerError) as timed_out:
        await _wait_ack(broker, leader, "all", 2, leader.isr)  # type: ignore[arg-type]
    error = timed_out.value.error
    assert error.code == "replication_unavailable" and error.retryable
    assert (error.fields["outcome"], error.fields["reason"], error.fields["offset"]) == ("unknown", "replica timeout", "1")
    leader.update_replica_end("b", 2)
    leader.on_committed_hwm(1, 2)
    await _wait_ack(broker, leader, "all", 2, ("a", "b"))  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_a_closed_committer_never_makes_a_cluster_leaders_candidate_visible(tmp_path: Path) -> None:
    """Issue 13 anomaly: at shutdown the committer closes (the replica loses its hook) while the writer
    still drains appends; the durable reports moved the candidate, which a hook-less replica used to commit
    locally (the standalone rule), so the final checkpoint held an HWM above the committed one."""
    from cursus.replication.hwm import HwmCommitter
    from cursus.storage import PartitionLog
    from tests.unit.test_storage_support import small_config

    node = Node(tmp_path / "a", "a")
    leader = node.replica
    never: asyncio.Future[object] = asyncio.get_running_loop().create_future()

    async def submit(command: object) -> object:
        return await never  # the CommitHwm in flight is never applied (Raft lost its majority)

    committer = HwmCommitter("a", submit)
    committer.attach(leader)
    leader.become_leader(1, ("a", "b"), committed_hwm=0)
    await leader.wait_writable()
    leader.append(records(0, 5), 5)
    await until(lambda: leader.durable_end_offset == 5)
    leader.update_replica_end("b", 5)
    assert leader.candidate_hwm == 5 and committer.in_flight and leader.hwm == 0
    await committer.close()
    assert leader.on_candidate_hwm is None
    leader.append(records(5, 3), 3)  # drained by the writer after the committer closed
    leader.update_replica_end("b", 8)
    await until(lambda: leader.durable_end_offset == 8)
    assert leader.candidate_hwm == 8
    assert leader.hwm == 0 and leader.log.hwm == 0  # nothing became visible without a commit
    await node.close()
    reopened = PartitionLog.open(tmp_path / "a", small_config())
    try:
        assert reopened.hwm == 0  # the checkpoint holds no HWM above the committed one
    finally:
        reopened.close()
    never.cancel()


@pytest.mark.asyncio
async def test_a_leader_that_once_led_in_a_cluster_commits_only_what_metadata_applied(nodes) -> None:
    node = nodes("a")
    leader = node.replica
    await _cluster_leader(node, 1, ("a", "b"))
    leader.on_candidate_hwm = None  # detached (e.g. the committer closed)
    leader.append(records(0, 2), 2)
    leader.update_replica_end("b", 2)
    await until(lambda: leader.durable_end_offset == 2)
    assert leader.candidate_hwm == 2 and leader.hwm == 0
    leader.on_committed_hwm(1, 2)  # only an applied commit moves it
    assert leader.hwm == 2


@pytest.mark.asyncio
async def test_waiters_of_committed_records_fail_with_an_unknown_outcome_the_others_are_refused(nodes) -> None:
    """Break-it finding: a leader deposed while an acks=all batch waited answered a plain ``NOT_LEADER`` even
    when the batch was already committed (only a member's confirmation missing), so a client took the
    redirect for a refusal and resent it (a duplicate without idempotence). Records at or below the moving
    assignment's committed HWM now fail with ``outcome=unknown``; records above it (the next leader
    truncates them) keep the plain refusal."""
    node = nodes("a")
    leader = node.replica
    await _cluster_leader(node, 1, ("a", "b"))
    leader.append(records(0, 2), 2)
    await leader.wait_durable(2)
    leader.append(records(2, 2), 2)
    await leader.wait_durable(4)
    low = leader.wait_committed(2, ("a", "b"))
    high = leader.wait_committed(4, ("a", "b"))
    leader.become_follower(2, "b", committed_hwm=2)
    await asyncio.sleep(0)
    assert _code(low) == "NOT_LEADER" and _outcome(low) == "unknown"
    assert _code(high) == "NOT_LEADER" and _outcome(high) is None
