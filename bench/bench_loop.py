"""The broker event loop's worst stall under a mixed load (broker and load generator share this machine).

Load, for ``CURSUS_BENCH_LOOP_SECONDS`` (default 6 s), each in its own process:

* a publisher of large uncompressed CBV2 batches (4 MiB, 64 KiB records, acks=1);
* a publisher of large gzip-compressed frames (4 MiB of compressible records, acks=1): decompression;
* a consumer of large lz4-compressed CONSUME replies (max_bytes 16 MiB): read, CRC checks, compression;
* a consumer of large gzip-compressed CONSUME replies (max_bytes 4 MiB);
* a consumer of large uncompressed CONSUME replies (max_bytes 16 MiB).

A probe connection meanwhile sends one small request (``LIST_OFFSETS`` of one partition) every 10 ms and
records each round trip. A small request waits for whatever the loop is doing, so the probe's worst round
trip bounds the loop's worst stall from outside. The broker's own stall probe (the
``cursus_event_loop_stall_seconds`` histogram, sampled every ``loop_probe_interval_ms``) is reported next to
it, for the load phase only (topic creation and preload are excluded).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import tempfile
import time
import urllib.request
from pathlib import Path

from cursus.client.connection import Connection
from cursus.wire import Batch, Command, Record, Status, encode_batch, encode_crq2, parse_command_text

SECONDS = float(os.environ.get("CURSUS_BENCH_LOOP_SECONDS", "6"))
BATCH_BYTES = 4 * 1024 * 1024
RECORD_BYTES = 64 * 1024
PROBE_INTERVAL_S = 0.010
PRELOAD_BATCHES = 8


def _batch(topic: str, partition: int, *, compressible: bool) -> bytes:
    count = BATCH_BYTES // RECORD_BYTES
    if compressible:
        payloads = [(b"cursus %06d " % i) * (RECORD_BYTES // 14) for i in range(count)]
    else:
        payloads = [os.urandom(RECORD_BYTES) for _ in range(count)]
    records = [Record(topic=topic, partition=partition, payload=p) for p in payloads]
    return encode_batch(Batch(topic=topic, partition=partition, acks="1", records=records))


def _publisher(port: int, topic: str, partition: int, compression: str, stop_at: float, out: mp.Queue) -> None:
    payload = _batch(topic, partition, compressible=compression != "none")
    done = 0
    with Connection("127.0.0.1", port, compression=compression, timeout_s=60) as conn:
        while time.monotonic() < stop_at:
            frame = conn.request(Command.PUBLISH, payload)
            assert frame.status == Status.OK, frame.payload[:200]
            done += 1
    out.put((f"publish_{compression}", done))


def _consumer(port: int, topic: str, partition: int, compression: str, stop_at: float, out: mp.Queue,
              max_bytes: int) -> None:
    done = 0
    with Connection("127.0.0.1", port, compression=compression, timeout_s=60) as conn:
        while time.monotonic() < stop_at:
            _, text = parse_command_text(
                f"CONSUME topic={topic} partition={partition} offset=0 batch=100000 max_bytes={max_bytes}")
            frame = conn.request(Command.CONSUME, encode_crq2(text))
            assert frame.status == Status.OK, frame.payload[:200]
            done += 1
    out.put((f"consume_{compression}_{max_bytes >> 20}mib", done))


def _stall_buckets(port: int) -> dict[float, float]:
    """The broker's ``cursus_event_loop_stall_seconds`` histogram: upper bound (s) -> cumulative count."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    pattern = r'^cursus_event_loop_stall_seconds_bucket{le="([^"]+)"} (\S+)$'
    return {float(le): float(count) for le, count in re.findall(pattern, text, re.MULTILINE)}


def _stalls_during(before: dict[float, float], after: dict[float, float]) -> dict:
    """Probe samples taken during the load: total, above 10 ms and 50 ms, and the bound of the worst (empty
    for a broker without the stall probe)."""
    if not before or not after:
        return {}
    total = after[float("inf")] - before[float("inf")]
    above = {le: total - (after[le] - before[le]) for le in after}  # samples slower than le
    worst = min((le for le in sorted(after) if above[le] == 0), default=float("inf"))
    return {"broker_probe_samples": int(total), "broker_stalls_over_10ms": int(above[0.01]),
            "broker_stalls_over_50ms": int(above[0.05]), "broker_worst_stall_le_ms": worst * 1000}


def run() -> list[dict]:
    from tests.brokerproc import BrokerProcess

    with tempfile.TemporaryDirectory() as tmp:
        broker = BrokerProcess(Path(tmp) / "data", health=False, settings={"exporter_port": 0, "loop_probe_interval_ms": 10})
        broker.start()
        try:
            port = broker.port
            with Connection("127.0.0.1", port) as conn:
                conn.command("CREATE topic=loadraw partitions=2")
                conn.command("CREATE topic=loadz partitions=2")
                conn.command("CREATE topic=probe partitions=1")
                raw, packed = _batch("loadraw", 1, compressible=False), _batch("loadz", 1, compressible=True)
                for _ in range(PRELOAD_BATCHES):  # partition 1 of each: the consumers' data
                    assert conn.request(Command.PUBLISH, raw).status == Status.OK
                    assert conn.request(Command.PUBLISH, packed).status == Status.OK
            stalls_before = _stall_buckets(broker.metrics_port)
            stop_at = time.monotonic() + SECONDS
            ctx = mp.get_context("fork")
            out: mp.Queue = ctx.Queue()
            procs = [
                ctx.Process(target=_publisher, args=(port, "loadraw", 0, "none", stop_at, out)),
                ctx.Process(target=_publisher, args=(port, "loadz", 0, "gzip", stop_at, out)),
                ctx.Process(target=_consumer, args=(port, "loadz", 1, "lz4", stop_at, out, 16 << 20)),
                ctx.Process(target=_consumer, args=(port, "loadz", 1, "gzip", stop_at, out, 4 << 20)),
                ctx.Process(target=_consumer, args=(port, "loadraw", 1, "none", stop_at, out, 16 << 20)),
            ]
            for p in procs:
                p.start()
            latencies = []
            _, text = parse_command_text("LIST_OFFSETS topic=probe partition=0")
            probe = encode_crq2(text)
            with Connection("127.0.0.1", port, timeout_s=60) as conn:
                next_at = time.monotonic()
                while time.monotonic() < stop_at:
                    t0 = time.perf_counter()
                    assert conn.request(Command.LIST_OFFSETS, probe).status == Status.OK
                    latencies.append(time.perf_counter() - t0)
                    next_at += PROBE_INTERVAL_S
                    time.sleep(max(0.0, next_at - time.monotonic()))
            load = dict(out.get(timeout=60) for _ in procs)  # before join: a full queue blocks its writer
            for p in procs:
                p.join()
                assert p.exitcode == 0
            stalls = _stalls_during(stalls_before, _stall_buckets(broker.metrics_port))
        finally:
            broker.stop()
    latencies.sort()
    result = {
        "bench": "loop_stall_mixed_load", "seconds": SECONDS, "probes": len(latencies),
        "probe_p50_ms": round(latencies[len(latencies) // 2] * 1000, 2),
        "probe_p99_ms": round(latencies[int(len(latencies) * 0.99)] * 1000, 2),
        "probe_max_ms": round(latencies[-1] * 1000, 2),
        "load_avg_1m": round(os.getloadavg()[0], 2), "load_requests": load,
    }
    return [{**result, **stalls}]

