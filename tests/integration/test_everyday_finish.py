"""Issue 19, the last pieces of everyday use, each against a real standalone broker: idle connections, topic
alter, produce progress, TLS messages, group lag from partition leaders, producer sequences after a delivery
timeout, multi-topic and pattern group consumers."""

from __future__ import annotations

import asyncio
import json
import os
import select
import subprocess
import sys

import pytest

from cursus.client import (
    Admin,
    AsyncProducer,
    Client,
    Consumer,
    DeliveryFailedError,
    DeliveryUnknownError,
    GroupConsumer,
    Producer,
)
from cursus.wire import Command
from tests.integration.conftest import connect
from tests.integration.helpers import create_topic

pytestmark = pytest.mark.timeout(90)


def _address(broker) -> str:
    host, port = broker.address
    return f"{host}:{port}"


def _create(broker, topic: str, partitions: int = 1) -> None:
    with connect(broker) as conn:
        create_topic(conn, topic, partitions=partitions)


def _wait_closed_by_broker(broker, timeout_s: float = 10.0) -> None:
    """Open a sentinel connection now and wait until the broker closes it for idleness: every connection
    idle since before this call is closed by then too."""
    with connect(broker) as sentinel:
        readable, _, _ = select.select([sentinel.sock], [], [], timeout_s)
        assert readable and sentinel.sock.recv(1) == b"", "the broker did not close the idle connection"


# ------------------------------------------------------------------------------ idle connections


def test_idle_timeout_default_is_ten_minutes():
    from cursus.broker.config import load_config
    assert load_config(environ={}).client_idle_timeout_ms == 600_000


def test_sdk_reopens_connections_the_broker_closed_for_idleness(broker_factory, topic_name):
    broker = broker_factory(settings={"client_idle_timeout_ms": 300}).start()
    _create(broker, topic_name)
    with Client(_address(broker)) as client, \
            Producer(_address(broker), acks=1) as producer:
        client.call(Command.LIST)
        producer.send(topic_name, b"before").result(timeout=10)
        _wait_closed_by_broker(broker)
        # not retry-safe: on the closed connection it would fail as DeliveryUnknownError
        client.call(Command.CREATE, {"topic": f"{topic_name}-2", "partitions": "1"}, retry_safe=False)
        assert producer.send(topic_name, b"after").result(timeout=10).offset == 1

    async def run() -> None:
        async with AsyncProducer(_address(broker), acks=1) as aproducer:
            await (await aproducer.send(topic_name, b"async-before"))
            await asyncio.to_thread(_wait_closed_by_broker, broker)
            assert (await (await aproducer.send(topic_name, b"async-after"))).offset == 3

    asyncio.run(run())


# ------------------------------------------------------------------------------ idempotent sequence after a timeout


def test_idempotent_producer_restarts_sequence_after_unknown_outcome(broker_factory, topic_name):
    """Break-it 5b: a batch that times out with an unknown outcome must not leave a sequence gap. The broker is
    paused (the batch sits unread in its socket buffer), the delivery times out, the broker is killed (the
    batch is lost) and restarted: the next record is accepted (new epoch, sequence 1), never refused as a gap."""
    broker = broker_factory().start()
    _create(broker, topic_name)
    with Producer(_address(broker), idempotent=True, linger_ms=0, delivery_timeout_s=1.5,
                  request_timeout_s=0.3, timeout_s=0.3) as producer:
        first = producer.send(topic_name, b"r1").result(timeout=10)
        assert first.seq_num == 1
        broker.pause()
        try:
            lost = producer.send(topic_name, b"r2")
            with pytest.raises(DeliveryUnknownError):
                lost.result(timeout=20)
            with pytest.raises(DeliveryFailedError):
                producer.flush()  # reports (and clears) the failure
        finally:
            broker.kill()
        broker.start()
        after = producer.send(topic_name, b"r3").result(timeout=20)
        assert (after.producer_epoch, after.seq_num) == (first.producer_epoch + 1, 1)
        assert producer.send(topic_name, b"r4").result(timeout=10).seq_num == 2
    with Consumer(topic_name, _address(broker)) as consumer:
        values = [r.value for r in consumer.records(until_end=True)]
    assert values == [b"r1", b"r3", b"r4"]


# ------------------------------------------------------------------------------ cursusctl topic alter, produce progress


def ctl(broker, *args: str, stdin=None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CURSUS_BROKER": _address(broker)}
    return subprocess.run([sys.executable, "-m", "cursus.cli.ctl", *args], stdin=stdin, capture_output=True,
                          text=True, env=env, timeout=60)


def test_topic_alter_covers_every_mutable_setting(shared_broker, topic_name):
    broker = shared_broker
    assert ctl(broker, "topic", "create", topic_name, "--partitions", "1").returncode == 0
    done = ctl(broker, "--json", "topic", "alter", topic_name, "--partitions", "3", "--retention-hours", "5",
               "--retention-bytes", "4096", "--cleanup-policy", "delete", "--partitioner", "round_robin",
               "--min-isr", "1")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["result"] == "updated"
    assert (doc["partitions"], doc["retention_hours"], doc["retention_bytes"], doc["partitioner"],
            doc["cleanup_policy"], doc["min_in_sync_replicas"]) == (3, 5, 4096, "round_robin", "delete", 1)
    again = json.loads(ctl(broker, "--json", "topic", "alter", topic_name, "--partitions", "3").stdout)
    assert again["result"] == "unchanged" and again["revision"] == doc["revision"]
    reset = json.loads(ctl(broker, "--json", "topic", "alter", topic_name, "--min-isr", "default").stdout)
    assert reset["min_in_sync_replicas"] is None and reset["partitions"] == 3
    shrink = ctl(broker, "topic", "alter", topic_name, "--partitions", "2")
    assert shrink.returncode != 0 and "partitions" in shrink.stderr
    missing = ctl(broker, "topic", "alter", f"{topic_name}-missing", "--retention-hours", "1")
    assert missing.returncode != 0 and "topic_not_found" in missing.stderr
    with Admin(_address(broker)) as admin:
        assert f"{topic_name}-missing" not in admin.list_topics()  # alter never creates
        assert admin.alter_topic(topic_name, retention_hours=0).retention_hours == 0
        with pytest.raises(TypeError):
            admin.alter_topic(topic_name, idempotent=True)  # type: ignore[call-arg]
    nothing = ctl(broker, "topic", "alter", topic_name)
    assert nothing.returncode == 2 and "at least one setting" in nothing.stderr


def test_produce_progress_shows_total_and_percentage_when_the_size_is_known(shared_broker, topic_name, tmp_path):
    broker = shared_broker
    path = tmp_path / "lines.txt"
    path.write_text("".join(f"record-{i}\n" for i in range(2500)))
    size = path.stat().st_size
    assert ctl(broker, "topic", "create", topic_name, "--partitions", "2").returncode == 0
    by_file = ctl(broker, "--json", "produce", topic_name, "--file", str(path), "--progress", "lines")
    assert by_file.returncode == 0, by_file.stderr
    last = by_file.stderr.strip().splitlines()[-1]
    assert "2,500 records" in last and "(100%)" in last and " of " in last, by_file.stderr
    summary = json.loads(by_file.stdout)
    assert (summary["records"], summary["failed"], summary["input_bytes"], summary["input_size"]) == \
        (2500, 0, size, size)
    with open(path, "rb") as sized_stdin:  # stdin redirected from a file: its size is known too
        by_stdin = ctl(broker, "produce", topic_name, "--progress", "lines", stdin=sized_stdin)
    assert by_stdin.returncode == 0 and "(100%)" in by_stdin.stderr
    assert "records" in by_stdin.stdout and "2500" in by_stdin.stdout.replace(",", "")  # the summary line
    piped = subprocess.run(
        [sys.executable, "-m", "cursus.cli.ctl", "--json", "produce", topic_name, "--progress", "lines"],
        input="a\nb\n", capture_output=True, text=True, timeout=60,
        env={**os.environ, "CURSUS_BROKER": _address(broker)})
    assert piped.returncode == 0 and "2 records" in piped.stderr and "%" not in piped.stderr
    assert "input_size" not in json.loads(piped.stdout)


# ------------------------------------------------------------------------------ group lag from the partition leaders


def test_group_offsets_use_the_partition_leaders_list_offsets(shared_broker, topic_name):
    broker = shared_broker
    group = f"g-{topic_name}"
    with connect(broker) as conn:
        create_topic(conn, topic_name, partitions=2)
    with Producer(_address(broker), acks=1) as producer:
        for i in range(12):
            producer.send(topic_name, f"v{i}".encode(), partition=i % 2)
    with GroupConsumer(topic_name, group, _address(broker), auto_commit=False) as consumer:
        got = []
        while len(got) < 12:
            got.extend(consumer.poll(5))
        consumer.commit({0: 2, 1: 6})
        with Admin(_address(broker)) as admin:
            bounds = {b.partition: b for b in admin.list_offsets(topic_name)}
            rows = {o.partition: o for o in admin.group_offsets(group)}
            assert {p: (o.committed, o.log_end, o.lag) for p, o in rows.items()} == \
                {0: (2, bounds[0].hwm, bounds[0].hwm - 2), 1: (6, bounds[1].hwm, 0)}
            assert admin.group_lag(group) == 4
        shown = ctl(broker, "--json", "group", "offsets", group)
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    assert doc["total_lag"] == 4 and [o["log_end_offset"] for o in doc["offsets"]] == [6, 6]
