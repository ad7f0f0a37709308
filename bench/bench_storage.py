"""Storage throughput: group-committed appends, reads, and recovery, on real files.

``run()`` returns one dict per measurement (a few seconds in total, in a temp dir under ``$TMPDIR``):

* ``group_commit_append`` - one thread submits chunks to 8 logs through :class:`GroupCommitWriter`
  (bounded in-flight window, like the event loop with back-pressure); every append is fsynced before its
  completion. Reports appends/s, MiB/s of records, and appends per fsync. Two chunk shapes: 10 x 100-byte
  records (about 1 KiB) and 64 x 1 KiB records (about 64 KiB).
* ``direct_append`` - ``append_chunk`` in a loop on one log with a single flush at the end (the write path
  without fsync cost).
* ``read`` - sequential ``read()`` of a durable 64 MiB log with ``max_bytes`` = 1 MiB (CRC verified).
  ``read_small`` and ``read_tiny`` are consumer-at-the-tail shapes: 100 and 10 records per read.
* ``recovery`` - unclean open of that log without a checkpoint (every chunk validated: header, CRC, length
  walk) versus a clean open.
"""

from __future__ import annotations

import struct
import tempfile
import threading
import time
from pathlib import Path

from cursus.storage import Completion, GroupCommitWriter, LogConfig, PartitionLog

_U32 = struct.Struct(">I")
LOG_COUNT = 8
IN_FLIGHT_MAX = 2_000


def _section(record_count: int, record_bytes: int) -> bytes:
    record = b"x" * record_bytes
    return (_U32.pack(record_bytes) + record) * record_count


def _group_commit(root: Path, record_count: int, record_bytes: int, seconds: float) -> dict[str, object]:
    body = _section(record_count, record_bytes)
    logs = [PartitionLog.open(root / f"gc-{record_bytes}-{n}", LogConfig()) for n in range(LOG_COUNT)]
    condition = threading.Condition()
    state = {"completed": 0, "errors": 0}

    def notify(completions: list[Completion]) -> None:
        with condition:
            state["completed"] += len(completions)
            state["errors"] += sum(1 for c in completions if c.error is not None)
            condition.notify()

    writer = GroupCommitWriter(notify)
    writer.start()
    offsets = [0] * LOG_COUNT
    submitted = 0
    started = time.perf_counter()
    deadline = started + seconds
    while time.perf_counter() < deadline:
        for _ in range(64):
            number = submitted % LOG_COUNT
            writer.submit_append(logs[number], offsets[number], record_count, body, number)
            offsets[number] += record_count
            submitted += 1
        with condition:
            while submitted - state["completed"] > IN_FLIGHT_MAX:
                condition.wait()
    with condition:
        while state["completed"] < submitted:
            condition.wait()
    elapsed = time.perf_counter() - started
    writer.close()
    for log in logs:
        log.close()
    assert state["errors"] == 0
    return {
        "bench": "group_commit_append",
        "logs": LOG_COUNT,
        "chunk_records": record_count,
        "chunk_bytes": len(body),
        "appends_per_s": round(submitted / elapsed),
        "mib_per_s": round(submitted * len(body) / elapsed / (1 << 20), 1),
        "appends_per_fsync": round(submitted / max(1, writer.flushes), 1),
        "rounds": writer.rounds,
    }


def _direct_append(root: Path, record_count: int, record_bytes: int, total_bytes: int) -> dict[str, object]:
    body = _section(record_count, record_bytes)
    log = PartitionLog.open(root / f"direct-{record_bytes}", LogConfig())
    appends = total_bytes // len(body)
    started = time.perf_counter()
    for n in range(appends):
        log.append_chunk(n * record_count, record_count, body)
    log.flush()
    elapsed = time.perf_counter() - started
    log.close()
    return {
        "bench": "direct_append",
        "chunk_bytes": len(body),
        "appends_per_s": round(appends / elapsed),
        "mib_per_s": round(appends * len(body) / elapsed / (1 << 20), 1),
    }


def _read(log: PartitionLog, name: str, max_records: int, max_bytes: int) -> dict[str, object]:
    offset = log.log_start_offset
    end = log.durable_end_offset
    total_bytes = 0
    reads = 0
    started = time.perf_counter()
    while offset < end:
        result = log.read(offset, max_offset=end, max_records=max_records, max_bytes=max_bytes)
        total_bytes += len(result.records)
        offset = result.next_offset
        reads += 1
    elapsed = time.perf_counter() - started
    return {
        "bench": name,
        "max_records": max_records,
        "max_bytes": max_bytes,
        "reads_per_s": round(reads / elapsed),
        "mib_per_s": round(total_bytes / elapsed / (1 << 20), 1),
    }


def _recovery(directory: Path, config: LogConfig) -> dict[str, object]:
    (directory / "checkpoints.json").unlink()  # no recovery point: every chunk is validated
    started = time.perf_counter()
    log = PartitionLog.open(directory, config, clean_shutdown=False)
    unclean_ms = (time.perf_counter() - started) * 1000
    stats = log.recovery_stats
    log.close()
    started = time.perf_counter()
    PartitionLog.open(directory, config, clean_shutdown=True).close()
    clean_ms = (time.perf_counter() - started) * 1000
    return {
        "bench": "recovery",
        "validated_mib": round(stats.bytes_validated / (1 << 20), 1),
        "validated_chunks": stats.chunks_validated,
        "unclean_open_ms": round(unclean_ms, 1),
        "clean_open_ms": round(clean_ms, 1),
        "validate_mib_per_s": round(stats.bytes_validated / (1 << 20) / max(unclean_ms / 1000, 1e-9), 1),
    }


def run() -> list[dict[str, object]]:
    """Run every storage measurement."""
    results: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="cursus-bench-storage-") as temp:
        root = Path(temp)
        results.append(_group_commit(root, 10, 100, 2.0))
        results.append(_group_commit(root, 64, 1024, 2.0))
        results.append(_direct_append(root, 10, 100, 32 << 20))
        results.append(_direct_append(root, 64, 1024, 64 << 20))
        config = LogConfig(segment_bytes=64 << 20)
        log = PartitionLog.open(root / "read", config)
        body = _section(64, 1024)
        for n in range((64 << 20) // len(body)):
            log.append_chunk(n * 64, 64, body)
        log.close()
        log = PartitionLog.open(root / "read", config, clean_shutdown=True)
        results.append(_read(log, "read", 100_000, 1 << 20))
        results.append(_read(log, "read_small", 100, 1 << 20))
        results.append(_read(log, "read_tiny", 10, 1 << 20))
        log.close()
        results.append(_recovery(root / "read", config))
    return results


if __name__ == "__main__":
    import json

    for line in run():
        print(json.dumps(line))
