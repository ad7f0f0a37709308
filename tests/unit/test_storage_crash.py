"""Crash tests with real processes: SIGKILL at random moments, power-cut emulation (lose_unsynced)."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cursus.storage import LogConfig, PartitionLog
from tests.unit.test_storage_support import PYTHON, read_all, record_for, subprocess_env

LOG_COUNT = 4

WRITER_CHILD = """
import os, random, sys, time
from pathlib import Path
from cursus.storage import GroupCommitWriter, LogConfig, PartitionLog
from tests.unit.test_storage_support import record_for, records_section

root, seed, out_path, LOG_COUNT = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
config = LogConfig(segment_bytes=32 * 1024, index_interval_bytes=256, recovery_point_interval_ms=20)
logs = [PartitionLog.open(root / str(n), config) for n in range(LOG_COUNT)]

def notify(completions):
    lines = "".join(f"{c.token} {c.durable_end_offset}\\n" for c in completions if c.error is None)
    if lines:
        os.write(out, lines.encode())  # reported only after the fsync that made it durable

writer = GroupCommitWriter(notify)
writer.start()
rng = random.Random(seed)
offsets = [log.log_end_offset for log in logs]
os.write(out, b"ready\\n")
while True:
    n = rng.randrange(len(logs))
    count = rng.randint(1, 12)
    body = records_section([record_for(offsets[n] + i, f"log{n}") for i in range(count)])
    writer.submit_append(logs[n], offsets[n], count, body, n)
    offsets[n] += count
    while writer.queued_items > 300:
        time.sleep(0.0005)
"""

UNSYNCED_CHILD = """
import sys, time
from pathlib import Path
from cursus.storage import LogConfig, PartitionLog
from tests.unit.test_storage_support import record_for, records_section

log = PartitionLog.open(Path(sys.argv[1]), LogConfig())
log.append_chunk(0, 10, records_section([record_for(o) for o in range(10)]))
log.flush()
log.append_chunk(10, 10, records_section([record_for(o) for o in range(10, 20)]))  # never fsynced
print("ready", flush=True)
time.sleep(60)
"""


def wait_for_ready(path: Path, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if path.exists() and b"ready\n" in path.read_bytes():
            return
        assert process.poll() is None, "child died"
        time.sleep(0.01)
    raise AssertionError("child never became ready")


def reported_durable_offsets(path: Path) -> dict[int, int]:
    durable: dict[int, int] = {}
    for line in path.read_bytes().split(b"\n")[:-1]:  # complete lines only
        if line == b"ready":
            continue
        number, offset = (int(v) for v in line.split())
        durable[number] = max(durable.get(number, 0), offset)
    return durable


@pytest.mark.parametrize("fault_spec", ["", "lose_unsynced=1,fsync_delay_ms=1"])
def test_sigkill_at_random_moments_never_loses_reported_durable_offsets(tmp_path: Path, fault_spec: str) -> None:
    script = tmp_path / "child.py"
    script.write_text(WRITER_CHILD)
    root = tmp_path / "data"
    rng = random.Random(fault_spec)
    durable: dict[int, int] = {}
    for cycle in range(2):  # crash, recover, continue, crash again
        out = tmp_path / f"out{cycle}"
        child = subprocess.Popen([PYTHON, str(script), str(root), str(cycle), str(out), str(LOG_COUNT)],
                                 env=subprocess_env(CURSUS_STORAGE_FAULTS=fault_spec))
        try:
            wait_for_ready(out, child)
            time.sleep(rng.uniform(0.15, 0.5))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=20)
        for number, offset in reported_durable_offsets(out).items():
            durable[number] = max(durable.get(number, 0), offset)
        assert sum(durable.values()) > 0, "the child made no progress"
        for number in range(LOG_COUNT):
            log = PartitionLog.open(root / str(number), LogConfig(), clean_shutdown=False)
            try:
                assert log.log_end_offset >= durable.get(number, 0), (number, log.recovery_stats)
                # every offset reported durable, and anything else recovery kept, has identical bytes
                assert read_all(log) == [record_for(o, f"log{number}") for o in range(log.log_end_offset)]
            finally:
                log.close()


@pytest.mark.parametrize("fault_spec, expected_end", [("lose_unsynced=1", 10), ("", 20)])
def test_unsynced_bytes_are_lost_on_sigkill_only_under_lose_unsynced(
        tmp_path: Path, fault_spec: str, expected_end: int) -> None:
    child = subprocess.Popen([PYTHON, "-c", UNSYNCED_CHILD, str(tmp_path / "p")], stdout=subprocess.PIPE,
                             env=subprocess_env(CURSUS_STORAGE_FAULTS=fault_spec))
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=20)
    log = PartitionLog.open(tmp_path / "p", LogConfig())
    # without the fault the page cache survives a process kill, so the unsynced chunk is still there
    assert log.log_end_offset == expected_end
    assert read_all(log) == [record_for(o) for o in range(expected_end)]
    log.close()
