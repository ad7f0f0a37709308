"""At-least-once delivery for a consumer group sharing a 6-partition topic (issue 6 "Tests").

Consumers are real processes running :class:`cursus.client.group.GroupConsumer`; each writes every record it
processes to its own file *before* committing (lastProcessedOffset + 1, every few records). One consumer is
killed with SIGKILL while it is in the middle of a batch, the broker is killed with SIGKILL and restarted
on the same port, more records are produced, and every produced record must appear in some consumer's file
(duplicates are allowed: at least once).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.conftest import connect
from tests.integration.helpers import create_topic, ok_fields, publish_batch

PARTITIONS = 6
PER_PARTITION = 200

CONSUMER = r"""
import sys, time
from cursus.client.connection import Backoff
from cursus.client.errors import CursusError
from cursus.client.group import GroupConsumer

topic, group, address, out_path, mode = sys.argv[1:6]
consumer = GroupConsumer(topic, group, address, mode=mode, auto_commit=False, heartbeat_interval_s=0.3,
                         wait_ms=200, batch_size=40, timeout_s=2.0,
                         backoff=Backoff(initial_s=0.05, max_s=0.3, attempts_max=6))
processed = 0
done = {}  # partition -> last processed offset + 1 (what the spec says to commit)
with open(out_path, "a", buffering=1) as out:
    while True:
        try:
            records = consumer.poll(0.5)
        except CursusError:
            time.sleep(0.05)  # broker restarting or membership changing: poll again
            continue
        for record in records:
            out.write(f"{record.partition}:{record.offset}\n")
            done[record.partition] = record.offset + 1
            processed += 1
            time.sleep(0.001)  # "processing": keeps the consumer mid-batch most of the time
            if processed % 25 == 0:
                try:
                    consumer.commit(done)
                except CursusError:
                    pass
"""


def produce(conn, topic: str, start: int, count: int) -> set[tuple[int, int]]:
    """``count`` records per partition; returns the (partition, offset) pairs written."""
    written = set()
    for p in range(PARTITIONS):
        for chunk in range(0, count, 100):
            n = min(100, count - chunk)
            publish_batch(conn, topic, p, [f"{p}-{start + chunk + i}".encode() for i in range(n)])
        written |= {(p, o) for o in range(start, start + count)}
    return written


def processed(paths: list[Path]) -> list[tuple[int, int]]:
    seen = []
    for path in paths:
        if path.exists():
            for line in path.read_text().splitlines():
                if line.count(":") == 1:
                    p, o = line.split(":")
                    seen.append((int(p), int(o)))
    return seen


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize(("consumers", "mode"), [(2, "poll"), (3, "stream")])
def test_every_record_processed_across_consumer_kill_and_broker_restart(broker_factory, tmp_path, consumers,
                                                                        mode):
    broker = broker_factory(settings={"consumer_session_timeout_ms": 1500}).start()
    topic, group = f"deliver-{mode}", f"g-{mode}"
    with connect(broker) as conn:
        create_topic(conn, topic, partitions=PARTITIONS)
        produced = produce(conn, topic, 0, PER_PARTITION)
    address = f"127.0.0.1:{broker.port}"
    outputs = [tmp_path / f"consumer-{i}.txt" for i in range(consumers)]
    procs = [subprocess.Popen([sys.executable, "-c", CONSUMER, topic, group, address, str(out), mode],
                              stdout=subprocess.DEVNULL, stderr=(tmp_path / f"consumer-{i}.err").open("wb"))
             for i, out in enumerate(outputs)]
    try:
        # kill consumer 0 while it is busy with a batch (it has processed some records, not all)
        wait_until(lambda: len(processed(outputs[:1])) >= 30, 30, "consumer 0 to start processing")
        procs[0].kill()
        procs[0].wait(timeout=10)
        wait_until(lambda: len(set(processed(outputs))) >= len(produced) // 2, 30, "half the records")
        broker.kill()
        broker.start()  # same port and data directory
        with connect(broker) as conn:
            produced |= produce(conn, topic, PER_PARTITION, PER_PARTITION // 2)
        missing: set[tuple[int, int]] = set()

        def all_seen() -> bool:
            nonlocal missing
            missing = produced - set(processed(outputs))
            return not missing

        try:
            wait_until(all_seen, 60, "every record to be processed")
        except AssertionError:
            raise AssertionError(f"never processed: {sorted(missing)[:20]} ({len(missing)} records)") from None
        with connect(broker) as conn:
            doc = conn.command(f"GROUP_STATUS group={group}").payload
            assert b'"status":"OK"' in doc
            # the dead consumer's membership expired: only the live consumers remain
            assert ok_fields(conn.command("LIST_GROUPS"))["groups"]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    seen = processed(outputs)
    assert produced <= set(seen)
    assert len(seen) >= len(produced)  # duplicates allowed, losses not
