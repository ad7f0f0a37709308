"""Pure pieces of the broker: byte budget, health responses, producer state, topic patch rules."""

from __future__ import annotations

import asyncio

import pytest

from cursus.broker.health import health_response
from cursus.broker.producer_state import Duplicate, ProducerStateTable
from cursus.broker.session import ByteBudget
from cursus.metadata.topics import TopicDefinition, TopicSpec, apply_create
from cursus.params import parse_args
from cursus.wire.errors import BrokerError


async def test_byte_budget_blocks_until_released():
    budget = ByteBudget(100)
    first = await budget.acquire(80)
    waiter = asyncio.ensure_future(budget.acquire(40))
    await asyncio.sleep(0)
    assert not waiter.done()
    budget.release(first)
    assert await asyncio.wait_for(waiter, 1) == 40
    # A reservation larger than the whole budget is clamped, so it can never wait forever.
    budget.release(40)
    assert await budget.acquire(1000) == 100


def test_health_responses():
    assert health_response("GET", "/live", dict) == (200, {"status": "live"})
    assert health_response("GET", "/ready", lambda: {"recovery": "in progress"}) == (
        503, {"status": "not_ready", "checks": {"recovery": "in progress"}})
    assert health_response("GET", "/ready", dict)[0] == 200
    assert health_response("POST", "/ready", dict)[0] == 405
    assert health_response("GET", "/other", dict)[0] == 404


def test_producer_state_rules_and_ttl():
    table = ProducerStateTable(ttl_ms=1000)
    assert table.check("p", 1, 1, 3, now_ms=0) is None
    table.record("p", 1, 1, 3, first_offset=10, now_ms=0)
    assert table.check("p", 1, 1, 3, now_ms=1) == Duplicate(10)
    assert table.check("p", 1, 4, 4, now_ms=1) is None
    with pytest.raises(BrokerError) as gap:
        table.check("p", 1, 6, 6, now_ms=1)
    assert gap.value.error.code == "idempotency_gap"
    with pytest.raises(BrokerError) as stale:
        table.check("p", 0, 1, 1, now_ms=1)
    assert stale.value.error.code == "stale_producer_epoch"
    with pytest.raises(BrokerError):
        table.check("p", 2, 2, 2, now_ms=1)  # a new epoch must start at 1
    assert table.check("p", 2, 1, 1, now_ms=1) is None
    # Only the last five batches are remembered.
    for i in range(4, 12):
        table.record("p", 1, i, i, first_offset=100 + i, now_ms=2)
    assert table.check("p", 1, 11, 11, now_ms=3) == Duplicate(111)
    with pytest.raises(BrokerError):
        table.check("p", 1, 4, 4, now_ms=3)
    # Idle past the TTL: the state is gone and a session must start again at 1.
    assert table.expire(now_ms=5000) == 1
    assert table.entries == {}


def _spec(fields: dict[str, str]) -> TopicSpec:
    return parse_args(TopicSpec, {"topic": "t", **fields}, "CREATE")


def test_create_patch_rules():
    base = apply_create(None, _spec({"partitions": "2"}), default_partitions=4, default_cleanup_policy="delete")
    assert base == TopicDefinition(name="t", partitions=2)
    assert apply_create(base, _spec({"partitions": "2", "replication_factor": "3"}), default_partitions=4,
                        default_cleanup_policy="delete") is base
    patched = apply_create(base, _spec({"read_acl": ""}), default_partitions=4, default_cleanup_policy="delete")
    assert patched is base  # empty acl restated: no change
    patched = apply_create(base, _spec({"retention_hours": "5"}), default_partitions=4, default_cleanup_policy="delete")
    assert patched.revision == 2 and patched.policy.retention_hours == 5
    with pytest.raises(BrokerError) as exc:
        _spec({"event_sourcing": "yes"})
    assert exc.value.error.code == "invalid_event_sourcing"
    with pytest.raises(BrokerError) as exc:
        apply_create(base, _spec({"event_sourcing": "true"}), default_partitions=4, default_cleanup_policy="delete")
    assert exc.value.error.code == "invalid_event_sourcing"
