"""Event store: APPEND_STREAM throughput and latency, READ_STREAM with and without a snapshot, index rebuild.

1. ``eventstore_append`` (one connection) and ``eventstore_append_concurrent`` (8 connections, each its own
   aggregates): ``CURSUS_BENCH_APPENDS`` (default 2000) APPEND_STREAM requests against a standalone broker
   process; appends/s and latency p50/p99 (ms). Each append is answered once committed (fsynced).
2. ``eventstore_read``: READ_STREAM of a 1,000-event aggregate (payloads of 100 bytes, interleaved in the
   log with another aggregate's): the whole stream (no snapshot) and with a snapshot at version 990 (10
   events after it); median ms of 20 reads.
3. ``eventstore_index_rebuild``: the sans-IO stream index fed 1,000,000 events over 10,000 aggregates (what
   a restart without checkpoint does after reading the log), and the checkpoint's encode and decode.
4. ``eventstore_log_scan``: the rebuild's log side, the index scan (:func:`cursus.broker.eventstore._scan`)
   over a real partition log of ``CURSUS_BENCH_SCAN_EVENTS`` (default 200,000) event records.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from cursus.client.connection import Connection
from cursus.eventstore import StreamEntry, StreamIndex
from cursus.wire import Command, CommandPayload, Status, encode_crq2

APPENDS = int(os.environ.get("CURSUS_BENCH_APPENDS", "2000"))
REBUILD_EVENTS = int(os.environ.get("CURSUS_BENCH_INDEX_EVENTS", "1000000"))
SCAN_EVENTS = int(os.environ.get("CURSUS_BENCH_SCAN_EVENTS", "200000"))


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _appends(port: int, topic: str, prefix: str, count: int, aggregates: int) -> list[float]:
    latencies = []
    with Connection("127.0.0.1", port, timeout_s=60) as conn:
        for i in range(count):
            key, version = f"{prefix}-{i % aggregates}", i // aggregates + 1
            started = time.perf_counter()
            frame = conn.command(f"APPEND_STREAM topic={topic} key={key} version={version} event_type=E "
                                 f"message={'x' * 100}")
            latencies.append((time.perf_counter() - started) * 1000)
            assert frame.status == Status.OK, frame.payload[:200]
    return latencies


def _append_result(name: str, connections: int, latencies: list[float], elapsed: float) -> dict:
    return {"bench": name, "connections": connections, "appends": len(latencies),
            "appends_per_s": round(len(latencies) / elapsed), "p50_ms": round(_pct(latencies, 0.5), 3),
            "p99_ms": round(_pct(latencies, 0.99), 3)}


def _read_ms(conn: Connection, topic: str, key: str, rounds: int = 20) -> tuple[float, int]:
    times, count = [], 0
    payload = encode_crq2(CommandPayload((), {"topic": topic, "key": key}))
    for _ in range(rounds):
        started = time.perf_counter()
        request_id = conn.send(Command.READ_STREAM, payload)
        envelope = conn.receive(request_id, Command.READ_STREAM)
        conn.receive(request_id, Command.READ_STREAM)
        times.append((time.perf_counter() - started) * 1000)
        count = json.loads(envelope.payload)["count"]
    return statistics.median(times), count


def _bench_broker() -> list[dict]:
    from tests.brokerproc import BrokerProcess

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        broker = BrokerProcess(Path(tmp) / "data", health=False).start(timeout_s=60)
        try:
            with Connection("127.0.0.1", broker.port, timeout_s=60) as conn:
                assert conn.command("CREATE topic=es partitions=4 event_sourcing=true").status == Status.OK
            started = time.perf_counter()
            latencies = _appends(broker.port, "es", "one", APPENDS, 100)
            results.append(_append_result("eventstore_append", 1, latencies, time.perf_counter() - started))
            per_thread: list[list[float]] = [[] for _ in range(8)]

            def worker(n: int) -> None:
                per_thread[n] = _appends(broker.port, "es", f"c{n}", APPENDS // 8, 50)

            threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
            started = time.perf_counter()
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            elapsed = time.perf_counter() - started
            results.append(_append_result("eventstore_append_concurrent", 8, sum(per_thread, []), elapsed))
            with Connection("127.0.0.1", broker.port, timeout_s=60) as conn:
                for v in range(1, 1001):  # interleaved: neither aggregate's events are contiguous in the log
                    for key in ("big", "snap"):
                        frame = conn.command(f"APPEND_STREAM topic=es key={key} version={v} message={'y' * 100}")
                        assert frame.status == Status.OK
                assert conn.command("SAVE_SNAPSHOT topic=es key=snap version=990 message=state").status == Status.OK
                full_ms, full_count = _read_ms(conn, "es", "big")
                snap_ms, snap_count = _read_ms(conn, "es", "snap")
            results.append({"bench": "eventstore_read", "events": 1000, "no_snapshot_ms": round(full_ms, 3),
                            "no_snapshot_events": full_count, "snapshot_ms": round(snap_ms, 3),
                            "snapshot_events": snap_count})
        finally:
            broker.stop()
    return results


def _bench_rebuild() -> dict:
    keys = [f"aggregate-{i}" for i in range(10_000)]
    started = time.perf_counter()
    index = StreamIndex()
    versions = [0] * len(keys)
    for offset in range(REBUILD_EVENTS):
        k = offset % len(keys)
        versions[k] += 1
        index.apply(keys[k], StreamEntry(versions[k], offset))
    index.advance(REBUILD_EVENTS)
    apply_s = time.perf_counter() - started
    started = time.perf_counter()
    blob = index.encode()
    encode_s = time.perf_counter() - started
    started = time.perf_counter()
    StreamIndex.decode(blob)
    decode_s = time.perf_counter() - started
    return {"bench": "eventstore_index_rebuild", "events": REBUILD_EVENTS, "aggregates": len(keys),
            "rebuild_s": round(apply_s, 3), "events_per_s": round(REBUILD_EVENTS / apply_s),
            "checkpoint_bytes": len(blob), "checkpoint_encode_s": round(encode_s, 3),
            "checkpoint_decode_s": round(decode_s, 3)}


def _bench_log_scan() -> dict:
    from cursus.broker.eventstore import _never, _scan
    from cursus.storage import LogConfig, PartitionLog
    from cursus.wire import Record, encode_record

    with tempfile.TemporaryDirectory() as tmp:
        log = PartitionLog.open(Path(tmp), LogConfig(segment_bytes=64 << 20), clean_shutdown=False)
        try:
            batch: list[bytes] = []
            for i in range(SCAN_EVENTS):
                record = encode_record(Record(topic="es", partition=0, payload=b"x" * 100, offset=i, timestamp=1,
                                              key=f"aggregate-{i % 1000}", event_type="E", schema_version=1,
                                              aggregate_version=i // 1000 + 1))
                batch.append(len(record).to_bytes(4, "big") + record)
                if len(batch) == 1000:
                    log.append_chunk(i - 999, 1000, b"".join(batch))
                    batch = []
            log.flush()
            started = time.perf_counter()
            found, _ = _scan(log, 0, log.log_end_offset, _never)
            elapsed = time.perf_counter() - started
        finally:
            log.close()
    return {"bench": "eventstore_log_scan", "events": len(found), "scan_s": round(elapsed, 3),
            "events_per_s": round(len(found) / elapsed)}


def run() -> list[dict]:
    return _bench_broker() + [_bench_rebuild(), _bench_log_scan()]


if __name__ == "__main__":
    for result in run():
        print(json.dumps({"module": "bench_eventstore", **result}), flush=True)
