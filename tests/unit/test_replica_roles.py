"""Replica roles: the transition table (every pair), and leader / follower behaviour on real logs."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from cursus.broker.replica import Replica
from cursus.broker.replica_role import TRANSITIONS, Event, Role, TransitionRefused, check_epoch, next_role
from cursus.storage import Completion, GroupCommitWriter, PartitionLog
from cursus.storage.chunk import HEADER_SIZE, decode_header, encode_header
from cursus.storage.epochs import EpochEnd
from cursus.wire.errors import BrokerError
from tests.unit.test_replication_support import apply_completions, node_pool
from tests.unit.test_storage_support import record_for, records_section, small_config

OP, L, F, X, D = Role.OPENED, Role.LEADER, Role.FOLLOWER, Role.FENCED, Role.DELETED
LEAD, FOLLOW, FENCE, DELETE = Event.BECOME_LEADER, Event.BECOME_FOLLOWER, Event.FENCE, Event.DELETE

#: The allowed transitions, written out independently of the module's table.
ALLOWED = {
    (OP, LEAD): L, (OP, FOLLOW): F, (OP, FENCE): X, (OP, DELETE): D,
    (L, LEAD): L, (L, FOLLOW): F, (L, FENCE): X, (L, DELETE): D,
    (F, LEAD): L, (F, FOLLOW): F, (F, FENCE): X, (F, DELETE): D,
    (X, FENCE): X, (X, DELETE): D,
    (D, DELETE): D,
}


@pytest.mark.parametrize(("state", "event"), list(itertools.product(Role, Event)))
def test_every_transition_is_allowed_or_refused_as_specified(state: Role, event: Event) -> None:
    if (state, event) in ALLOWED:
        assert next_role(state, event) is ALLOWED[(state, event)]
    else:
        with pytest.raises(TransitionRefused, match="not an allowed transition"):
            next_role(state, event)


def test_the_table_is_exactly_the_allowed_set() -> None:
    assert dict(TRANSITIONS) == ALLOWED


@pytest.mark.parametrize(("state", "event", "current", "new", "outcome"), [
    (OP, LEAD, 3, 3, True),          # the first role may keep the stored epoch
    (OP, FOLLOW, 3, 4, True),
    (L, LEAD, 3, 3, False),         # a retry: nothing changes
    (L, LEAD, 3, 5, True),
    (F, FOLLOW, 3, 3, False),
    (F, LEAD, 3, 4, True),
    (L, FOLLOW, 3, 4, True),
    (L, FOLLOW, 3, 3, "stays"),     # a leader epoch names one leader
    (F, LEAD, 3, 3, "stays"),
    (L, LEAD, 3, 2, "below"),
    (OP, LEAD, 3, 2, "below"),
    (X, LEAD, 3, 4, "not an allowed"),
    (D, FOLLOW, 3, 4, "not an allowed"),
])
def test_epoch_rules(state: Role, event: Event, current: int, new: int, outcome: bool | str) -> None:
    if isinstance(outcome, bool):
        assert check_epoch(state, event, current, new) is outcome
    else:
        with pytest.raises(TransitionRefused, match=outcome):
            check_epoch(state, event, current, new)


# ------------------------------------------------------------------------------ replicas on real logs


class Node:
    """One broker's storage for a partition: a log, a writer and the completion glue the broker has."""

    def __init__(self, directory: Path, broker_id: str) -> None:
        self.directory = directory
        self.broker_id = broker_id
        self.loop = asyncio.get_running_loop()
        self.writer = GroupCommitWriter(self._notify)
        self.writer.start()
        self.replica = self.open()

    def open(self) -> Replica:
        return Replica("t", 0, PartitionLog.open(self.directory, small_config()), self.writer,
                       broker_id=self.broker_id)

    def _notify(self, completions: list[Completion]) -> None:
        self.loop.call_soon_threadsafe(self._apply, completions)

    _apply = staticmethod(apply_completions)

    async def close(self) -> None:
        await self.loop.run_in_executor(None, self.writer.close)
        self.replica.log.close()


@pytest_asyncio.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[Callable[[str], Node]]:
    async with node_pool(tmp_path, Node) as make:
        yield make


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll ``condition`` on the loop until it holds (the writer reports through the loop)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.005)


def records(base: int, count: int, tag: str = "r") -> bytes:
    return records_section([record_for(base + i, tag) for i in range(count)])


async def publish(replica: Replica, count: int, tag: str = "r") -> int:
    """Append ``count`` records as one client chunk and wait for the HWM to cover them."""
    base = replica.append(records(replica.leo, count, tag), count)
    await replica.wait_hwm(base + count)
    return base


def stored_chunks(replica: Replica, start: int = 0) -> list[bytes]:
    return [bytes(chunk) for _, chunk in replica.log.iter_stored_chunks(start)]


@pytest.mark.asyncio
async def test_hwm_comes_from_its_checkpoint_and_a_one_member_isr_moves_it_to_the_durable_end(nodes) -> None:
    node = nodes("a")
    node.replica.become_leader(1)
    await publish(node.replica, 5)
    node.replica.log.set_hwm(2)   # as a cluster leader would have left it: only 2 records committed
    await node.loop.run_in_executor(None, node.writer.close)
    node.replica.log.close()      # the checkpoint keeps HWM 2; the log holds 5 durable records
    node.writer = GroupCommitWriter(node._notify)
    node.writer.start()
    node.replica = node.open()
    assert node.replica.role is Role.OPENED
    assert (node.replica.hwm, node.replica.durable_end_offset) == (2, 5)  # not the durable end
    with pytest.raises(BrokerError) as refused:
        node.replica.append(records(5, 1), 1)
    assert refused.value.error.code == "NOT_LEADER"
    node.replica.become_leader(1)  # standalone: leader of a one-member ISR
    assert node.replica.hwm == 5 and node.replica.leader_epoch == 1


@pytest.mark.asyncio
async def test_leader_hwm_is_the_min_durable_end_over_the_isr(nodes) -> None:
    leader = nodes("a").replica
    leader.become_leader(1, isr=("a", "b"))
    base = leader.append(records(0, 4), 4)
    waiter = leader.wait_hwm(base + 4)
    await until(lambda: leader.durable_end_offset == 4)
    assert leader.hwm == 0 and not waiter.done()
    leader.update_replica_end("b", 3)
    assert leader.hwm == 3 and not waiter.done()
    leader.update_replica_end("b", 4)
    await waiter
    leader.become_leader(1, isr=("a",))  # a retry at the same epoch only changes the ISR
    assert leader.role is Role.LEADER and leader.isr == ("a",)


@pytest.mark.asyncio
async def test_follower_appends_the_leaders_stored_chunks_byte_for_byte(nodes) -> None:
    leader, follower = nodes("a").replica, nodes("b").replica
    leader.become_leader(3, isr=("a",))
    follower.become_follower(3, "a")
    for count in (2, 5, 1, 7):
        await publish(leader, count)
    chunks = stored_chunks(leader)
    for chunk in chunks:
        follower.append_replicated(chunk, 3)
    follower.advance_hwm(leader.hwm)
    await until(lambda: follower.durable_end_offset == leader.leo)
    assert stored_chunks(follower) == chunks and follower.log.leader_epochs == [(3, 0)]
    assert follower.hwm == leader.hwm == 15
    # A retried fetch: identical chunks at existing offsets are no-ops.
    assert follower.append_replicated(chunks[1], 3) == 7
    assert follower.leo == 15

    def refused(chunk: bytes, epoch: int = 3) -> str:
        with pytest.raises(BrokerError) as error:
            follower.append_replicated(chunk, epoch)
        return error.value.error.code

    other = bytearray(chunks[1])
    other[-1] ^= 0x01
    assert refused(bytes(other)) == "corrupt_log_data"                     # not a valid chunk
    await publish(leader, 3, tag="x")
    (tail,) = stored_chunks(leader, 15)
    assert refused(tail, epoch=2) == "STALE_LEADER_EPOCH"                   # a fetch from an old leader
    leader2 = nodes("c").replica
    leader2.become_leader(3)
    for count in (2, 5, 1, 7, 3):
        await publish(leader2, count, tag="z")
    assert refused(stored_chunks(leader2)[1]) == "version_conflict"         # other bytes at offset 2
    assert refused(_shifted(tail)) == "OFFSET_OUT_OF_RANGE"                 # a gap after the LEO
    with pytest.raises(BrokerError) as client:
        follower.append(records(15, 1), 1)
    assert client.value.error.code == "NOT_LEADER" and client.value.error.fields["leader"] == "a"
    assert follower.leo == 15 and follower.log.log_end_offset == 15


def _shifted(chunk: bytes) -> bytes:
    """The same chunk re-encoded 10 offsets later (valid, but not continuing the log)."""
    header = decode_header(chunk, 0)
    assert header is not None
    body = chunk[HEADER_SIZE:]
    return encode_header(header.base_offset + 10, header.record_count, body, header.append_time_ms,
                         header.leader_epoch) + body


@pytest.mark.asyncio
async def test_follower_hwm_is_learned_from_the_leader_and_clamped_to_its_leo(nodes) -> None:
    leader, follower = nodes("a").replica, nodes("b").replica
    leader.become_leader(1)
    follower.become_follower(1, "a")
    for _ in range(4):
        await publish(leader, 5)
    chunks = stored_chunks(leader)
    follower.append_replicated(chunks[0], 1)
    follower.advance_hwm(leader.hwm)  # 20, ahead of the follower's LEO 5: no assertion, clamped
    assert follower.hwm == 5
    follower.append_replicated(chunks[1], 1)
    assert follower.hwm == 10  # the remembered leader HWM applies as the log catches up
    follower.advance_hwm(7)    # never backward
    assert follower.hwm == 10


@pytest.mark.asyncio
async def test_old_leader_becomes_follower_fails_pending_acks_and_truncates_by_epoch(nodes) -> None:
    old, new = nodes("a").replica, nodes("b").replica
    old.become_leader(1, isr=("a", "b"))
    new.become_follower(1, "a")
    old.update_replica_end("b", 0)
    base = old.append(records(0, 6), 6)
    await until(lambda: old.durable_end_offset == 6)
    old.update_replica_end("b", 6)
    await old.wait_hwm(6)
    for chunk in stored_chunks(old):
        new.append_replicated(chunk, 1)
    await until(lambda: new.durable_end_offset == 6)
    # The old leader appends records the follower never gets, then loses leadership.
    unacked = old.wait_hwm(old.append(records(6, 4, "lost"), 4) + 4)
    await until(lambda: old.durable_end_offset == 10)
    new.become_leader(2, isr=("b",))
    await publish(new, 3, tag="new")
    old.become_follower(2, "b")
    with pytest.raises(BrokerError) as failed:
        await unacked
    assert failed.value.error.code == "NOT_LEADER"  # outcome unknown: the new leader decides
    assert base == 0 and old.end_offset_for_epoch(1) == (1, 10)
    # KIP-279: the old leader asks the new one where its latest epoch (1) ended there.
    answer = new.end_offset_for_epoch(old.log.leader_epoch)
    assert answer == EpochEnd(1, 6)
    assert await old.truncate_to_epoch(answer) == (6, True)
    assert old.leo == old.log.log_end_offset == 6
    for chunk in stored_chunks(new, 6):
        old.append_replicated(chunk, 2)
    await until(lambda: old.durable_end_offset == 9)
    assert stored_chunks(old) == stored_chunks(new)
    assert old.log.leader_epochs == [(1, 0), (2, 6)]
    with pytest.raises(BrokerError) as leader_truncate:
        await new.truncate_to(0)
    assert leader_truncate.value.error.code == "PARTITION_LEADER_FENCED"
    with pytest.raises(TransitionRefused):
        old.become_leader(1)  # an older epoch from stale metadata


@pytest.mark.asyncio
async def test_a_new_leaders_epoch_is_stamped_on_its_chunks(nodes) -> None:
    node = nodes("a")
    node.replica.become_leader(4)
    await publish(node.replica, 2)
    node.replica.become_leader(6)
    assert node.replica.end_offset_for_epoch(6) == (6, 2)  # no chunk yet: the epoch starts at the LEO
    assert node.replica.end_offset_for_epoch(5) == (4, 2)
    await publish(node.replica, 1)
    assert node.replica.log.leader_epochs == [(4, 0), (6, 2)]
    node.replica.on_failure(OSError("disk"))
    assert node.replica.role is Role.FENCED
    with pytest.raises(TransitionRefused):
        node.replica.become_leader(7)
