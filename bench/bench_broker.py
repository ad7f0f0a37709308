"""Broker throughput and latency on this machine (broker and load generator share its cores).

* publish: 100-byte records in pre-encoded CBV2 batches of 1,000, acks=1 (fsync before ack), 4 connections
  (one process each, one partition each);
* consume: CONSUME the same records back, counting records from each reply's record count (nothing decoded);
* latency: single-record acks=1 PUBLISH round trips, p50/p99 and the broker's CPU per publish (all threads,
  and the event-loop thread alone; the rest is mostly the storage writer thread and its fdatasync).

Reports records/s plus broker and client CPU seconds, so broker limits and client limits can be told apart.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import struct
import tempfile
import time
from pathlib import Path

from bench.support import PAYLOAD_BYTES, RECORDS_PER_BATCH, proc_cpu_s, publisher
from cursus.client.connection import Connection
from cursus.wire import Batch, Command, Record, encode_batch, encode_crq2, parse_command_text

CONNECTIONS = 4
BATCHES_PER_CONNECTION = int(os.environ.get("CURSUS_BENCH_BATCHES", "150"))
LATENCY_SAMPLES = int(os.environ.get("CURSUS_BENCH_LATENCY_SAMPLES", "500"))
_U32 = struct.Struct(">I")


def _consumer(port: int, topic: str, partition: int, expected: int, out: mp.Queue) -> None:
    start_cpu = time.process_time()
    count = 0
    offset = 0
    header_skip = None
    with Connection("127.0.0.1", port, timeout_s=60) as conn:
        while count < expected:
            _, payload = parse_command_text(
                f"CONSUME topic={topic} partition={partition} offset={offset} batch=8192")
            frame = conn.request(Command.CONSUME, encode_crq2(payload))
            data = frame.payload
            # Batch header: magic u32, version u16, flags u16, topic string, i32, acks string, u64, u64, u32 count.
            if header_skip is None:
                tlen = _U32.unpack_from(data, 8)[0]
                alen = _U32.unpack_from(data, 12 + tlen + 4)[0]
                header_skip = 12 + tlen + 4 + 4 + alen + 16
            n = _U32.unpack_from(data, header_skip)[0]  # the batch's record count: no per-record work here,
            count += n                                   # so the figure is the broker's, not this loop's
            offset += n
    out.put(time.process_time() - start_cpu)


def _timed_phase(target, port: int, topic: str, per_worker: int) -> tuple[float, float]:
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(port, topic, p, per_worker, out)) for p in range(CONNECTIONS)]
    started = time.perf_counter()
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    elapsed = time.perf_counter() - started
    client_cpu = sum(out.get() for _ in procs)
    return elapsed, client_cpu


def run() -> list[dict]:
    from tests.brokerproc import BrokerProcess

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        broker = BrokerProcess(Path(tmp) / "data", health=False).start()
        try:
            port = broker.port
            topic = "bench"
            with Connection("127.0.0.1", port) as conn:
                conn.command(f"CREATE topic={topic} partitions={CONNECTIONS}")
            assert broker.proc is not None
            pid = broker.proc.pid

            cpu0 = proc_cpu_s(pid)
            elapsed, client_cpu = _timed_phase(publisher, port, topic, BATCHES_PER_CONNECTION)
            total = CONNECTIONS * BATCHES_PER_CONNECTION * RECORDS_PER_BATCH
            results.append({
                "bench": "broker_publish_acks1", "records": total, "record_bytes": PAYLOAD_BYTES,
                "batch_records": RECORDS_PER_BATCH, "connections": CONNECTIONS, "seconds": round(elapsed, 3),
                "records_per_s": round(total / elapsed), "mb_per_s": round(total * PAYLOAD_BYTES / elapsed / 1e6, 1),
                "broker_cpu_s": round(proc_cpu_s(pid) - cpu0, 2), "client_cpu_s": round(client_cpu, 2),
            })

            cpu0 = proc_cpu_s(pid)
            per_partition = BATCHES_PER_CONNECTION * RECORDS_PER_BATCH
            elapsed, client_cpu = _timed_phase(_consumer, port, topic, per_partition)
            results.append({
                "bench": "broker_consume_raw", "records": total, "connections": CONNECTIONS,
                "seconds": round(elapsed, 3), "records_per_s": round(total / elapsed),
                "broker_cpu_s": round(proc_cpu_s(pid) - cpu0, 2), "client_cpu_s": round(client_cpu, 2),
            })

            latencies = []
            record = Record(topic=topic, partition=0, payload=b"x" * PAYLOAD_BYTES)
            payload = encode_batch(Batch(topic=topic, partition=0, acks="1", records=[record]))
            with Connection("127.0.0.1", port) as conn:
                cpu0, loop0 = proc_cpu_s(pid), proc_cpu_s(pid, pid)  # the main thread runs the event loop
                for _ in range(LATENCY_SAMPLES):
                    t0 = time.perf_counter()
                    conn.request(Command.PUBLISH, payload)
                    latencies.append(time.perf_counter() - t0)
                broker_cpu_s, loop_cpu_s = proc_cpu_s(pid) - cpu0, proc_cpu_s(pid, pid) - loop0
            latencies.sort()
            results.append({
                "bench": "broker_publish_latency_acks1", "samples": len(latencies),
                "p50_ms": round(latencies[len(latencies) // 2] * 1000, 3),
                "p99_ms": round(latencies[int(len(latencies) * 0.99)] * 1000, 3),
                "broker_cpu_us_per_publish": round(broker_cpu_s / len(latencies) * 1e6, 1),
                "broker_loop_thread_cpu_us_per_publish": round(loop_cpu_s / len(latencies) * 1e6, 1),
            })
        finally:
            broker.stop()
    return results
