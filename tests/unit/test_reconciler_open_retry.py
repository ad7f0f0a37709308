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
        now = [100.0]
        rec = Reconciler(host, tmp_path, 1, open_retry_backoff_ms=1000, open_max_attempts=5,
                         clock=lambda: now[0])
        rec.on_open_failed = outcomes.append

        async def until(predicate) -> None:
            deadline = asyncio.get_running_loop().time() + 10
            while not predicate() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            assert predicate()

        state = _create(_cluster(), "c1")
        rec.on_metadata(_cluster(), state)
        await until(lambda: outcomes == [False])
        assert host.attempts == 1 and rec.open_failures[("t", 0)][1:] == (1, 101.0)
        states = _heartbeats(state, 30)
        for old, new in zip(states, states[1:], strict=False):  # 30 metadata changes inside the backoff
            rec.on_metadata(old, new)
        await asyncio.sleep(0.05)
        assert host.attempts == 1, "retried on a metadata change during the backoff"
        now[0] = 101.0  # the backoff elapsed: the next metadata change (or the timer) retries
        rec.on_metadata(states[-2], states[-1])
        await until(lambda: outcomes == [False, False])
        assert host.attempts == 2 and rec.open_failures[("t", 0)][1:] == (2, 103.0)  # doubled
        now[0] = 103.0
        rec.on_metadata(states[-2], states[-1])
        await until(lambda: ("t", 0) in host.replicas)
        assert host.attempts == 3 and outcomes == [False, False] and ("t", 0) not in rec.open_failures
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
