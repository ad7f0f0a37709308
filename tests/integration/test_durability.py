"""Crash and fault tests with real broker processes: kill -9, torn tails, corruption, fsync failures."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import pytest

from cursus.client.connection import ConnectionClosed
from tests.integration.conftest import connect
from tests.integration.helpers import ack_of, consume_all, create_topic, error_of, ok_fields, publish_batch

pytestmark = pytest.mark.timeout(120)


def _segments(log_dir: Path, topic: str, partition: int) -> list[Path]:
    return sorted((log_dir / "topics" / topic / str(partition)).glob("*.log"))


def _wait_recovery_point(log_dir: Path, topic: str, partition: int, at_least: int, timeout_s: float = 10) -> None:
    path = log_dir / "topics" / topic / str(partition) / "checkpoints.json"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if json.loads(path.read_text())["recovery_point"] >= at_least:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"recovery point never reached {at_least}")


def test_kill9_during_acked_publishes_loses_and_duplicates_nothing(broker_factory):
    broker = broker_factory().start()
    topic = "crash"
    with connect(broker) as conn:
        create_topic(conn, topic, partitions=2)
    acked: dict[tuple[int, int], bytes] = {}
    stop = threading.Event()
    errors: list[BaseException] = []

    def producer(partition: int) -> None:
        seq = 0
        try:
            with connect(broker) as conn:
                while not stop.is_set():
                    payloads = [f"p{partition}-{seq + i}".encode() for i in range(50)]
                    seq += 50
                    ack = ack_of(publish_batch(conn, topic, partition, payloads, acks="1"))
                    first = ack["last_offset"] - len(payloads) + 1
                    for i, payload in enumerate(payloads):
                        acked[(partition, first + i)] = payload
        except (ConnectionClosed, ConnectionError, OSError):
            return  # the broker was killed mid-request: outcome unknown, not acknowledged
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=producer, args=(p,)) for p in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while len(acked) < 3000 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(random.uniform(0, 0.1))
    broker.kill()
    stop.set()
    for t in threads:
        t.join(timeout=10)
    assert not errors, errors
    assert len(acked) >= 3000
    broker.start()
    with connect(broker) as conn:
        for p in range(2):
            records = consume_all(conn, topic, p)
            assert [r.offset for r in records] == list(range(len(records)))
            payloads = [r.payload for r in records]
            assert len(set(payloads)) == len(payloads), "duplicate record after restart"
            by_offset = {r.offset: r.payload for r in records}
            for (part, offset), payload in acked.items():
                if part == p:
                    assert by_offset.get(offset) == payload, (p, offset)


def test_torn_tail_is_truncated_and_acked_data_kept(broker_factory):
    broker = broker_factory().start()
    with connect(broker) as conn:
        create_topic(conn, "torn")
        for i in range(5):
            ack_of(publish_batch(conn, "torn", 0, [f"r{i}-{j}".encode() for j in range(10)]))
    broker.kill()
    segment = _segments(broker.log_dir, "torn", 0)[-1]
    with open(segment, "ab") as f:
        f.write(b"CCK2" + b"\x00\x00\x00\x00\x00\x00\x00\x32" + b"\xff" * 17)  # a chunk cut mid-header
    broker.start()
    with connect(broker) as conn:
        records = consume_all(conn, "torn", 0)
        assert len(records) == 50
        ack = ack_of(publish_batch(conn, "torn", 0, [b"after"]))
        assert ack["last_offset"] == 50


def test_corruption_before_recovery_point_refuses_startup(broker_factory):
    broker = broker_factory(settings={"log_recovery_point_interval_ms": 50}).start()
    with connect(broker) as conn:
        create_topic(conn, "rot")
        for i in range(4):
            ack_of(publish_batch(conn, "rot", 0, [f"value-{i}-{j}".encode() * 4 for j in range(20)]))
    _wait_recovery_point(broker.log_dir, "rot", 0, 80)
    broker.kill()
    segment = _segments(broker.log_dir, "rot", 0)[0]
    data = bytearray(segment.read_bytes())
    data[200] ^= 0x55  # inside the first chunk's body: acknowledged data
    segment.write_bytes(bytes(data))
    broker.start(expect_ready=False)
    assert broker.wait_exit(30) == 1
    out = broker.output()
    assert segment.name in out and "startup failed" in out


def test_second_broker_on_same_log_dir_is_refused(broker_factory):
    first = broker_factory().start()
    second = broker_factory()
    second.log_dir = first.log_dir
    second.start(expect_ready=False)
    assert second.wait_exit(30) == 1
    assert "lock" in second.output().lower()
    with connect(first) as conn:
        ok_fields(conn.command("LIST"))


def test_injected_fsync_failure_fails_publish_and_fences_partition(broker_factory, tmp_path):
    trigger = tmp_path / "fail-fsync"
    broker = broker_factory(env={"CURSUS_STORAGE_FAULTS": f"fsync_fail_file={trigger}"}).start()
    with connect(broker) as conn:
        create_topic(conn, "fsync")
        ack_of(publish_batch(conn, "fsync", 0, [b"durable"]))
        trigger.touch()
        err = error_of(publish_batch(conn, "fsync", 0, [b"never acked"]))
        assert err.code == "storage_unavailable"
        trigger.unlink()
        # Never retried into an acknowledgement: the partition stays fenced until a restart.
        assert error_of(publish_batch(conn, "fsync", 0, [b"still fenced"])).code == "storage_unavailable"
        assert [r.payload for r in consume_all(conn, "fsync", 0)] == [b"durable"]
    status, body = broker.http_get("/ready")
    assert status == 503 and b"storage" in body


def test_keyed_routing_and_producer_state_survive_restart(broker_factory):
    broker = broker_factory().start()
    with connect(broker) as conn:
        create_topic(conn, "keys", partitions=5)
        before = {}
        for i in range(20):
            conn.command(f"PUBLISH topic=keys acks=1 producerId=p key=k{i} message=v{i}")
        for p in range(5):
            for rec in consume_all(conn, "keys", p):
                before[rec.key] = p
        ack1 = ack_of(publish_batch(conn, "keys", 0, [b"i1", b"i2"], acks="all", producer=("idem", 1, 1),
                                    idempotent=True))
    broker.restart(kill=True)
    with connect(broker) as conn:
        for i in range(20):
            conn.command(f"PUBLISH topic=keys acks=1 producerId=p key=k{i} message=again{i}")
        after = {}
        for p in range(5):
            for rec in consume_all(conn, "keys", p):
                if rec.payload.startswith(b"again"):
                    after[rec.key] = p
        assert after == before
        dup = ack_of(publish_batch(conn, "keys", 0, [b"i1", b"i2"], acks="all", producer=("idem", 1, 1),
                                   idempotent=True))
        assert dup["last_offset"] == ack1["last_offset"]
    # After a clean shutdown the state comes from the producer snapshot (plus any later chunks).
    broker.restart(kill=False)
    with connect(broker) as conn:
        dup = ack_of(publish_batch(conn, "keys", 0, [b"i1", b"i2"], acks="all", producer=("idem", 1, 1),
                                   idempotent=True))
        assert dup["last_offset"] == ack1["last_offset"]
        err = error_of(publish_batch(conn, "keys", 0, [b"i4"], acks="all", producer=("idem", 1, 4),
                                     idempotent=True))
        assert err.code == "idempotency_gap"


def test_sigterm_flushes_and_restart_is_clean(broker_factory):
    broker = broker_factory().start()
    with connect(broker) as conn:
        create_topic(conn, "clean", partitions=1)
        publish_batch(conn, "clean", 0, [b"zero"] * 10, acks="0")
        ack_of(publish_batch(conn, "clean", 0, [b"one"]))
    assert broker.terminate() == 0
    assert (broker.log_dir / ".clean-shutdown").exists()
    broker.start()
    with connect(broker) as conn:
        assert len(consume_all(conn, "clean", 0)) == 11


def test_corrupt_chunk_found_at_read_time_is_refused_not_served(broker_factory):
    broker = broker_factory(settings={"log_segment_bytes": 4096}).start()
    with connect(broker) as conn:
        create_topic(conn, "bitrot")
        for i in range(20):
            ack_of(publish_batch(conn, "bitrot", 0, [f"{i}-{j}".encode() * 20 for j in range(5)]))
    assert broker.terminate() == 0  # clean: the next start trusts its checkpoints and validates nothing
    first = _segments(broker.log_dir, "bitrot", 0)[0]
    data = bytearray(first.read_bytes())
    data[100] ^= 0x01
    first.write_bytes(bytes(data))
    broker.start()
    with connect(broker) as conn:
        err = error_of(conn.command("CONSUME topic=bitrot partition=0 offset=0"))
        assert err.code == "corrupt_log_data" and err.fields["offset"] == "0"
        tail = consume_all(conn, "bitrot", 0, start=95)
        assert [r.offset for r in tail] == [95, 96, 97, 98, 99]
