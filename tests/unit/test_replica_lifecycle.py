"""Replica answers across the topic lifecycle and follower log repair (issue 18), on real logs: a replaced
replica (TRUNCATE) fails its waiters with the retryable ``leader_not_available outcome=unknown``, a deleted one
with ``topic_not_found``; a follower appends a compacted leader's chunks with offset gaps as stored, and
restarts its log at the leader's log start."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from cursus.storage import PartitionLog
from cursus.storage.chunk import encode_header
from cursus.wire.errors import BrokerError
from tests.unit.test_replica_roles import Node, records, until
from tests.unit.test_replication_support import node_pool
from tests.unit.test_storage_support import small_config


@pytest_asyncio.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[Callable[[str], Node]]:
    async with node_pool(tmp_path, Node) as make:
        yield make


def _error(fut: asyncio.Future[None]) -> BrokerError:
    error = fut.exception()
    assert isinstance(error, BrokerError), error
    return error


@pytest.mark.asyncio
@pytest.mark.parametrize("replaced", [True, False])
async def test_waiters_of_a_replaced_replica_answer_retryable_outcome_unknown(nodes, replaced: bool) -> None:
    node = nodes("a")
    replica = node.replica
    replica.on_candidate_hwm = lambda r: None
    replica.become_leader(1, ("a", "b"), committed_hwm=0)
    await replica.wait_writable()
    base = replica.append(records(0, 3), 3)
    committed = replica.wait_committed(base + 3, replica.isr)  # "b" never reports: it waits
    durable = replica.wait_durable(base + 3 + 100)  # never reached
    await asyncio.sleep(0)
    replica.on_deleted(replaced=replaced)
    await asyncio.sleep(0)
    for fut in (committed, durable):
        err = _error(fut).error
        if replaced:
            assert (err.code, err.retryable, err.fields.get("outcome")) == ("leader_not_available", True, "unknown")
        else:
            assert (err.code, err.retryable) == ("topic_not_found", False)
    with pytest.raises(BrokerError) as refused:
        replica.check_writable()
    assert refused.value.error.code == ("leader_not_available" if replaced else "topic_not_found")
    assert "outcome" not in refused.value.error.fields  # refused before any append: nothing is unknown


def _chunk(base: int, count: int, epoch: int = 1) -> bytes:
    body = records(base, count)
    return encode_header(base, count, body, 1_700_000_000_000, epoch) + body


@pytest.mark.asyncio
async def test_a_follower_appends_chunks_after_offset_gaps_as_stored_only_when_allowed(nodes) -> None:
    node = nodes("f")
    replica = node.replica
    replica.become_follower(1, "leader")
    replica.append_replicated(_chunk(0, 2), 1)
    with pytest.raises(BrokerError) as gap:
        replica.append_replicated(_chunk(5, 2), 1)
    assert gap.value.error.code == "OFFSET_OUT_OF_RANGE"
    assert replica.append_replicated(_chunk(5, 2), 1, allow_gap=True) == 7
    assert replica.append_replicated(_chunk(9, 1), 1, allow_gap=True) == 10
    assert replica.leo == 10 and replica.matched_offset == 10
    await until(lambda: replica.durable_end_offset == 10)
    replica.advance_hwm(10)
    assert replica.hwm == 10
    stored = [(h.base_offset, h.record_count) for h, _ in replica.log.iter_stored_chunks(0)]
    assert stored == [(0, 2), (5, 2), (9, 1)]
    await node.loop.run_in_executor(None, node.writer.close)
    replica.log.close()
    reopened = PartitionLog.open(node.directory, small_config())  # recovery accepts the gaps
    assert reopened.log_end_offset == 10
    assert [(h.base_offset, h.record_count) for h, _ in reopened.iter_stored_chunks(0)] == stored
    reopened.close()
    node.writer = type(node.writer)(node._notify)  # close() of the fixture closes a fresh writer
    node.writer.start()
    node.replica = node.open()


@pytest.mark.asyncio
async def test_a_follower_restarts_its_log_at_the_leaders_log_start(nodes) -> None:
    node = nodes("f")
    replica = node.replica
    replica.become_follower(1, "leader")
    replica.append_replicated(_chunk(0, 3), 1)
    await until(lambda: replica.durable_end_offset == 3)
    await replica.restart_at(40)
    assert (replica.leo, replica.durable_end_offset, replica.hwm, replica.log_start_offset) == (40, 40, 40, 40)
    assert replica.append_replicated(_chunk(40, 2), 1) == 42
    await until(lambda: replica.durable_end_offset == 42)
    await replica.restart_at(10)  # not above the log end: nothing happens
    assert replica.leo == 42
