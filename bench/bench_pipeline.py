"""Pipelined requests on one connection, and the broker's CPU per single-record publish.

* ``latency``: single-record acks=1 CBV2 PUBLISH round trips on one connection (send, wait for the ack,
  repeat): p50/p99 and the broker's CPU per publish (all threads, and the event-loop thread alone), from
  ``/proc/<pid>/stat`` before and after the samples;
* ``window``: 1,000-record acks=1 batches of 100-byte records to one partition on one connection, with
  ``window`` requests written before the oldest reply is read (1: one at a time; 5: the broker's default
  ``max_in_flight_requests_per_connection``): records/s and broker CPU per record.

Settings: ``CURSUS_BENCH_PIPELINE_SAMPLES`` (single-record round trips, default 3,000),
``CURSUS_BENCH_PIPELINE_BATCHES`` (batches per window run, default 1,000).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import deque
from pathlib import Path

from bench.support import proc_cpu_s as _proc_cpu_s
from cursus.client.connection import Connection
from cursus.wire import Batch, Command, Record, Status, encode_batch

SAMPLES = int(os.environ.get("CURSUS_BENCH_PIPELINE_SAMPLES", "3000"))
BATCHES = int(os.environ.get("CURSUS_BENCH_PIPELINE_BATCHES", "1000"))
RECORDS_PER_BATCH = 1000
PAYLOAD_BYTES = 100
WARMUP = 200


def _latency(port: int, pid: int, topic: str) -> dict:
    record = Record(topic=topic, partition=0, payload=b"x" * PAYLOAD_BYTES)
    payload = encode_batch(Batch(topic=topic, partition=0, acks="1", records=[record]))
    latencies = []
    with Connection("127.0.0.1", port) as conn:
        for _ in range(WARMUP):
            conn.request(Command.PUBLISH, payload)
        cpu0, loop0, client0 = _proc_cpu_s(pid), _proc_cpu_s(pid, pid), time.process_time()
        for _ in range(SAMPLES):
            t0 = time.perf_counter()
            frame = conn.request(Command.PUBLISH, payload)
            latencies.append(time.perf_counter() - t0)
            assert frame.status == Status.OK, frame.payload[:200]
        broker_s, loop_s = _proc_cpu_s(pid) - cpu0, _proc_cpu_s(pid, pid) - loop0
        client_s = time.process_time() - client0
    latencies.sort()
    return {
        "bench": "pipeline_single_record_acks1", "samples": SAMPLES,
        "p50_us": round(latencies[len(latencies) // 2] * 1e6), "p99_us": round(latencies[int(SAMPLES * 0.99)] * 1e6),
        "broker_cpu_us_per_publish": round(broker_s / SAMPLES * 1e6, 1),
        "broker_loop_thread_cpu_us_per_publish": round(loop_s / SAMPLES * 1e6, 1),
        "client_cpu_us_per_publish": round(client_s / SAMPLES * 1e6, 1),
    }


def _window(port: int, pid: int, topic: str, window: int) -> dict:
    records = [Record(topic=topic, partition=0, payload=b"y" * PAYLOAD_BYTES) for _ in range(RECORDS_PER_BATCH)]
    payload = encode_batch(Batch(topic=topic, partition=0, acks="1", records=records))
    with Connection("127.0.0.1", port, timeout_s=60) as conn:
        cpu0, started = _proc_cpu_s(pid), time.perf_counter()
        outstanding: deque[int] = deque()
        for _ in range(BATCHES):
            if len(outstanding) >= window:
                assert conn.receive(outstanding.popleft(), Command.PUBLISH).status == Status.OK
            outstanding.append(conn.send(Command.PUBLISH, payload))
        while outstanding:
            assert conn.receive(outstanding.popleft(), Command.PUBLISH).status == Status.OK
        elapsed, broker_s = time.perf_counter() - started, _proc_cpu_s(pid) - cpu0
    total = BATCHES * RECORDS_PER_BATCH
    return {
        "bench": "pipeline_window_acks1", "window": window, "records": total, "seconds": round(elapsed, 3),
        "records_per_s": round(total / elapsed),
        "broker_cpu_us_per_record": round(broker_s / total * 1e6, 3),
    }


def run() -> list[dict]:
    from tests.brokerproc import BrokerProcess

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        broker = BrokerProcess(Path(tmp) / "data", health=False).start()
        try:
            assert broker.proc is not None
            with Connection("127.0.0.1", broker.port) as conn:
                conn.command("CREATE topic=lat partitions=1")
                conn.command("CREATE topic=win partitions=1")
            results.append(_latency(broker.port, broker.proc.pid, "lat"))
            for window in (1, 5):
                results.append(_window(broker.port, broker.proc.pid, "win", window))
        finally:
            broker.stop()
    return results
