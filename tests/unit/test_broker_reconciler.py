"""The broker's metadata seam in process: reconciliation, not-yet-local partitions, injected clocks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cursus.broker.config import load_config
from cursus.broker.core import Broker, Clock
from cursus.broker.metrics import BrokerMetrics
from cursus.metadata.commands import CreateTopic, DeleteTopic
from cursus.metadata.topics import TopicSpec
from cursus.params import parse_args
from cursus.wire.errors import BrokerError


def create_topic(request_id: str, topic: str, fields: dict[str, str], default_partitions: int = 1,
                 default_cleanup_policy: str = "delete", expected_revision: int | None = None) -> CreateTopic:
    """A CreateTopic command from CREATE's string fields (validated as the session would)."""
    spec = parse_args(TopicSpec, {"topic": topic, **fields}, "CREATE")
    return CreateTopic(request_id, spec, default_partitions, default_cleanup_policy, expected_revision)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000

    def __call__(self) -> int:
        return self.now


async def _open(path: Path, clock: Clock | None = None, **settings: object) -> Broker:
    config = load_config(environ={}, overrides={"log_dir": str(path), "broker_port": 9000, **settings})
    return await Broker.open(config, BrokerMetrics(), clock=clock)


def test_partition_assigned_but_not_yet_open_is_a_retryable_error(tmp_path):
    async def scenario() -> None:
        broker = await _open(tmp_path)
        try:
            assert broker.broker_id == "127.0.0.1-9000"
            await broker.metadata.submit(create_topic("r1", "t", {"partitions": "3"}, 1, "delete"))
            # committed, but the reconciler's pool has not installed the replicas yet
            with pytest.raises(BrokerError) as info:
                broker.replica("t", 2)
            assert info.value.error.code == "leader_not_available" and info.value.error.retryable
            with pytest.raises(BrokerError) as missing:
                broker.replica("t", 3)
            assert missing.value.error.code == "partition_not_found"
            await broker.reconciler.wait_open(("t", p) for p in range(3))
            assert broker.replica("t", 2).leo == 0
        finally:
            await broker.close()

    asyncio.run(scenario())


def test_delete_while_partitions_are_opening_leaves_no_storage(tmp_path):
    async def scenario() -> None:
        broker = await _open(tmp_path, recovery_threads=1)
        try:
            await broker.metadata.submit(create_topic("r1", "t", {"partitions": "20"}, 1, "delete"))
            await broker.metadata.submit(DeleteTopic("r2", "t"))
            assert await broker.reconciler.removal("t") is False
            await broker.reconciler.wait_open(("t", p) for p in range(20))
            assert not [k for k in broker.replicas if k[0] == "t"]
            assert not (tmp_path / "topics" / "t").exists()
        finally:
            await broker.close()

    asyncio.run(scenario())


def test_create_then_restart_reopens_every_partition_in_parallel(tmp_path):
    async def scenario() -> None:
        broker = await _open(tmp_path, recovery_threads=3)
        await broker.create_topic(parse_args(TopicSpec, {"topic": "t", "partitions": "12"}, "CREATE"))
        await broker.close()
        again = await _open(tmp_path, recovery_threads=3)
        try:
            assert {p for (t, p) in again.replicas if t == "t"} == set(range(12))
            assert again.metadata.state.assignment("t", 11) is not None
        finally:
            await again.close()

    asyncio.run(scenario())


def test_producer_expiry_follows_the_injected_clock(tmp_path):
    async def scenario() -> None:
        wall = FakeClock()
        broker = await _open(tmp_path, Clock(monotonic_ms=FakeClock(), wall_ms=wall), producer_state_ttl_ms=1000)
        try:
            await broker.create_topic(parse_args(TopicSpec, {"topic": "t", "partitions": "1", "idempotent": "true"}, "CREATE"))
            table = broker.producer_table("t", 0)
            table.record("p1", 0, 0, 0, 0, wall())
            wall.now += 1000
            assert broker.expire_producers() == 0
            wall.now += 1
            assert broker.expire_producers() == 1
        finally:
            await broker.close()

    asyncio.run(scenario())
