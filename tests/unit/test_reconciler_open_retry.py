"""The reconciler retries a failed partition open with a bounded exponential backoff, never on every
metadata change, and gives up after ``open_max_attempts`` (issue 14: an unrepairable replica made it spin)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from cursus.broker.reconciler import Reconciler
from cursus.metadata.apply import apply
from cursus.metadata.commands import BrokerHeartbeat
from cursus.storage import CorruptLogError
from tests.unit.test_reconciler_generations import Host, _cluster, _create


class FailingHost(Host):
    def __init__(self, topics: Path, failures: int) -> None:
        super().__init__(topics)
        self.failures = failures
        self.attempts = 0

    def open_partition(self, topic: str, partition: int):  # type: ignore[override]
        self.attempts += 1
        if self.attempts <= self.failures:
            raise CorruptLogError(self.topics / topic / str(partition), 0, 0, "test damage")
        return super().open_partition(topic, partition)


def _heartbeats(state, n: int):
    """``n`` metadata changes that do not touch the topic (heartbeats), as a live cluster applies them."""
    states = [state]
    for i in range(n):
        states.append(apply(states[-1], BrokerHeartbeat(f"hb-{i}", states[-1].brokers["b"], 4))[0])
    return states


def test_a_failed_open_backs_off_instead_of_retrying_on_every_metadata_change(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = FailingHost(tmp_path / "topics", failures=2)
        outcomes: list[bool] = []
        rec = Reconciler(host, tmp_path, 1, open_retry_backoff_ms=200, open_max_attempts=5)
        rec.on_open_failed = outcomes.append
        state = _create(_cluster(), "c1")
        rec.on_metadata(_cluster(), state)
        await asyncio.sleep(0.05)
        assert host.attempts == 1 and outcomes == [False]
        states = _heartbeats(state, 30)
        for old, new in zip(states, states[1:], strict=False):  # 30 metadata changes inside the backoff
            rec.on_metadata(old, new)
            await asyncio.sleep(0.001)
        assert host.attempts == 1, "retried on a metadata change during the backoff"
        deadline = asyncio.get_running_loop().time() + 5
        while ("t", 0) not in host.replicas and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        assert ("t", 0) in host.replicas and host.attempts == 3  # 200 ms, then 400 ms
        assert outcomes == [False, False] and ("t", 0) not in rec.open_failures
        await rec.close()

    asyncio.run(scenario())


def test_the_reconciler_gives_up_after_the_maximum_attempts_until_asked_again(tmp_path: Path) -> None:
    async def scenario() -> None:
        host = FailingHost(tmp_path / "topics", failures=100)
        outcomes: list[bool] = []
        rec = Reconciler(host, tmp_path, 1, open_retry_backoff_ms=10, open_max_attempts=3)
        rec.on_open_failed = outcomes.append
        state = _create(_cluster(), "c1")
        rec.on_metadata(_cluster(), state)
        deadline = asyncio.get_running_loop().time() + 5
        while True not in outcomes and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert outcomes == [False, False, True] and host.attempts == 3
        await asyncio.sleep(0.3)
        states = _heartbeats(state, 5)
        for old, new in zip(states, states[1:], strict=False):
            rec.on_metadata(old, new)
        await asyncio.sleep(0.05)
        assert host.attempts == 3, "an abandoned partition was retried"
        host.failures = 0
        await rec.wait_open([("t", 0)])  # an explicit wait retries at once
        assert ("t", 0) in host.replicas and host.attempts == 4
        await rec.close()

    asyncio.run(scenario())
