"""Log cleaner throughput, and its effect on concurrent publish latency.

* ``cleaner_throughput`` - one :func:`cursus.storage.cleaner.clean_pass` (unthrottled) plus the segment
  swaps over a 32 MiB log of keyed 200-byte CBV2 records (2,000 keys, so most records are superseded), 4 MiB
  segments: MB/s of log read (both passes) and of log processed, records removed, bytes before and after.
* ``publish_latency`` - single-batch (10 keyed records) acks=1 PUBLISH round trips against a real broker
  process, p50/p99 in ms, on a compacted topic with the cleaner idle (``log_cleanup_interval`` 1 h) and
  with it running continuously (interval 0.05 s, dirty ratio 0.01, 64 KiB segments, rate limit 64 MiB/s).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from cursus.storage import LogConfig, PartitionLog
from cursus.storage.cleaner import clean_pass
from cursus.wire import Batch, Command, Record, Status, encode_batch, encode_record

LOG_BYTES = int(os.environ.get("CURSUS_BENCH_COMPACTION_BYTES", str(32 * 1024 * 1024)))
KEYS = 2_000
LATENCY_SECONDS = float(os.environ.get("CURSUS_BENCH_COMPACTION_SECONDS", "4"))


def _fill(log: PartitionLog, total_bytes: int) -> int:
    """Append keyed records in chunks of 100 until ``total_bytes``; returns the record count."""
    written = count = 0
    while written < total_bytes:
        base = log.log_end_offset
        records = [encode_record(Record("t", 0, b"v" * 200, base + i, key=f"key-{(base + i) % KEYS}"))
                   for i in range(100)]
        body = b"".join(len(r).to_bytes(4, "big") + r for r in records)
        log.append_chunk(base, len(records), body)
        written += len(body)
        count += len(records)
    log.flush()
    return count


def _cleaner_throughput(root: Path) -> dict[str, object]:
    log = PartitionLog.open(root / "clean", LogConfig(segment_bytes=4 * 1024 * 1024))
    records = _fill(log, LOG_BYTES)
    started = time.perf_counter()
    stats = clean_pass(log, log.log_end_offset, now_ms=int(time.time() * 1000), delete_retention_ms=0)
    for copy in stats.copies:
        log.replace_with_cleaned(copy.base_offset, copy.old_size_bytes, copy.next_offset, copy.size_bytes,
                                 copy.index_entries)
    seconds = time.perf_counter() - started
    log.close()
    return {"bench": "cleaner_throughput", "records": records, "seconds": round(seconds, 3),
            "read_mb_per_s": round(stats.bytes_read / seconds / 1e6, 1),
            "log_mb_per_s": round(stats.bytes_before / seconds / 1e6, 1),
            "records_removed": stats.records_removed, "bytes_before": stats.bytes_before,
            "bytes_after": stats.bytes_after, "segments_rewritten": stats.segments_rewritten}


def _latencies(port: int, topic: str, seconds: float) -> list[float]:
    from cursus.client.connection import Connection

    out: list[float] = []
    with Connection("127.0.0.1", port) as conn:
        ok = conn.command(f"CREATE topic={topic} partitions=1 cleanup_policy=compact")
        assert ok.status == Status.OK, ok.payload
        deadline = time.perf_counter() + seconds
        n = 0
        while time.perf_counter() < deadline:
            records = [Record(topic, 0, b"v" * 200, key=f"key-{(n + i) % KEYS}") for i in range(10)]
            payload = encode_batch(Batch(topic, 0, "1", records))
            started = time.perf_counter()
            frame = conn.request(Command.PUBLISH, payload)
            out.append(time.perf_counter() - started)
            assert frame.status == Status.OK, frame.payload
            n += 10
    return out


def _publish_latency(root: Path, cleaner: bool) -> dict[str, object]:
    from tests.brokerproc import BrokerProcess

    settings: dict[str, object] = {"log_segment_bytes": 64 * 1024, "log_cleanup_interval": 0.05 if cleaner else 3600,
                                   "log_min_cleanable_dirty_ratio": 0.01}
    broker = BrokerProcess(root / ("on" if cleaner else "off"), settings=settings, health=False).start()
    try:
        samples = _latencies(broker.port, "bench-compacted", LATENCY_SECONDS)
    finally:
        broker.stop()
    passes = broker.output().count("cleaned bench-compacted/0")
    ordered = sorted(samples)
    return {"bench": "publish_latency", "cleaner": "running" if cleaner else "idle", "publishes": len(samples),
            "p50_ms": round(statistics.median(ordered) * 1000, 3),
            "p99_ms": round(ordered[int(len(ordered) * 0.99) - 1] * 1000, 3), "cleaner_passes": passes}


def run() -> list[dict[str, object]]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        return [_cleaner_throughput(root), _publish_latency(root, False), _publish_latency(root, True)]


if __name__ == "__main__":
    import json

    for result in run():
        print(json.dumps(result))
