"""The join barrier end to end: while members join and leave a group under load, no record is processed by
two live members (issue 19 "Two members own a partition at once during a rebalance").

Members are :class:`GroupConsumer` threads against a real broker; each processes what ``poll()`` returns and
commits after every batch, and leaves with ``close()``. Nothing crashes, so every produced record must be
processed exactly once: a partition moves only after its holder committed its processed work and rejoined.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from cursus.client import FencingError, GroupConsumer, Producer
from tests.integration.conftest import connect
from tests.integration.helpers import create_topic

pytestmark = pytest.mark.timeout(120)
PARTITIONS = 6


class Member(threading.Thread):
    """One group member: poll, "process" (record it), commit, until stopped; then leave."""

    def __init__(self, address: str, topic: str, group: str, name: str, mode: str) -> None:
        super().__init__(daemon=True, name=f"member-{name}")
        self.consumer = GroupConsumer(topic, group, address, client_id=name, mode=mode, auto_commit=False,
                                      heartbeat_interval_s=0.2, wait_ms=100, batch_size=20)
        self.seen: list[tuple[int, int]] = []
        self.halt = threading.Event()
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                batch = self.consumer.poll(0.1)
                self.seen.extend((r.partition, r.offset) for r in batch)
                if batch:
                    try:
                        self.consumer.commit()
                    except FencingError:
                        pass  # the membership ended; the next poll commits it before rejoining
        except BaseException as exc:  # reported by the test
            self.failure = exc
        finally:
            self.consumer.close()

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=30)
        assert not self.is_alive() and self.failure is None, self.failure


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("mode", ["poll", "stream"])
def test_no_record_processed_by_two_members_across_joins_and_leaves(shared_broker, topic_name, mode):
    address = f"127.0.0.1:{shared_broker.port}"
    group = f"g-{topic_name}"
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name, partitions=PARTITIONS)
    produced: list[tuple[int, int]] = []
    producing = threading.Event()
    producing.set()

    def produce() -> None:
        with Producer(address, linger_ms=1) as producer:
            i = 0
            while producing.is_set():
                futures = [producer.send(topic_name, f"r{i + n}".encode(), key=f"k{i + n}") for n in range(20)]
                producer.flush()
                produced.extend((f.result().partition, f.result().offset) for f in futures)
                i += 20
                time.sleep(0.005)  # load, not synchronisation: about 2,000 records a second

    producer_thread = threading.Thread(target=produce, daemon=True)
    producer_thread.start()
    members: list[Member] = []

    def start(name: str) -> Member:
        member = Member(address, topic_name, group, name, mode)
        members.append(member)
        member.start()
        return member

    def converged(live: list[Member]) -> bool:
        owned = sorted(p for m in live for p in m.consumer.state.assignment)
        return owned == list(range(PARTITIONS)) and all(m.consumer.state.assignment for m in live)

    try:
        a = start("a")
        wait_until(lambda: len(a.seen) > 200, 20, "a to process records")
        b = start("b")  # two members
        wait_until(lambda: converged([a, b]) and len(b.seen) > 100, 30, "a and b to share the partitions")
        c = start("c")  # three members
        wait_until(lambda: converged([a, b, c]) and len(c.seen) > 100, 30, "three members sharing")
        b.stop()  # a leave under load
        seen_c = len(c.seen)
        wait_until(lambda: converged([a, c]) and len(c.seen) > seen_c + 100, 30, "a and c after b left")
        d = start("d")  # a join right after a leave
        wait_until(lambda: converged([a, c, d]) and len(d.seen) > 50, 30, "a, c and d")
        c.stop()
        d.stop()
        wait_until(lambda: converged([a]), 30, "a alone")
    finally:
        producing.clear()
        producer_thread.join(timeout=30)
    total = set(produced)
    wait_until(lambda: total <= {r for m in members for r in m.seen}, 30, "every record processed")
    a.stop()
    counts = Counter(r for m in members for r in m.seen)
    twice = {r: n for r, n in counts.items() if n > 1}
    assert not twice, f"{len(twice)} records processed more than once, e.g. {sorted(twice)[:5]}"
    assert len(total) > 1000
