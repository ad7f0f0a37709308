"""Producer-state snapshots in the log: one per segment roll (checksummed), rebuild from the tail only."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from cursus.storage import PartitionLog
from cursus.storage.producer_state import (
    ProducerState,
    chunk_producer_span,
    snapshot_offsets,
    snapshot_path,
)
from cursus.wire.batch import Record, encode_record
from tests.unit.test_storage_support import PYTHON, REPO_ROOT, records_section, small_config, subprocess_env

CONFIG = small_config(segment_bytes=2048)


def batch(producer: str, epoch: int, first_seq: int, count: int) -> bytes:
    """A records section of ``count`` idempotent records with sequence numbers from ``first_seq``."""
    return records_section([encode_record(Record("t", 0, b"payload-%d" % seq, producer_id=producer,
                                                 seq_num=seq, producer_epoch=epoch))
                            for seq in range(first_seq, first_seq + count)])


def append_batches(log: PartitionLog, batches: int, producers: int = 3, count: int = 3) -> None:
    """``batches`` idempotent batches, round robin over ``producers`` producers."""
    for n in range(batches):
        producer, round_ = n % producers, n // producers
        body = batch(f"p{producer}", 1, 1 + round_ * count, count)
        log.append_chunk(log.log_end_offset, count, body)


def state_of(log: PartitionLog) -> dict[str, tuple[int, int, list[tuple[int, int, int]]]]:
    return {pid: (e.epoch, e.last_seq, list(e.batches)) for pid, e in log.producer_state.entries.items()}


def test_chunk_producer_span_reads_first_and_last_record() -> None:
    assert chunk_producer_span(batch("p", 2, 5, 4), 4) == ("p", 2, 5, 8)
    assert chunk_producer_span(records_section([b"not a record"]), 1) is None


def test_snapshot_checksum_is_verified() -> None:
    state = ProducerState(1000)
    state.record("p", 1, 1, 3, 0, 5)
    data = state.encode_snapshot(3)
    loaded, end = ProducerState.decode_snapshot(data, 1000)
    assert end == 3 and loaded.entries["p"].batches == state.entries["p"].batches
    damaged = bytearray(data)
    damaged[-3] ^= 0x01
    with pytest.raises(ValueError, match="checksum"):
        ProducerState.decode_snapshot(bytes(damaged), 1000)


def test_every_roll_writes_a_snapshot_and_an_unclean_open_replays_only_the_tail(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    log = PartitionLog.open(directory, CONFIG)
    append_batches(log, 120)
    log.flush()
    bases = [info.base_offset for info in log.segments_info()]
    assert len(bases) > 10 and snapshot_offsets(directory) == bases[1:]
    expected = state_of(log)
    chunks_in_last_segment = (log.log_end_offset - bases[-1]) // 3
    log._close_files()  # a crash: no clean-shutdown snapshot, no final checkpoint
    log = PartitionLog.open(directory, CONFIG)
    stats = log.recovery_stats
    assert stats.producer_snapshot_offset == bases[-1]
    assert stats.producer_chunks_replayed == chunks_in_last_segment < 120 // 10
    assert state_of(log) == expected
    log.close()
    # A clean close snapshots at the LEO: the next open reads no chunk at all.
    log = PartitionLog.open(directory, CONFIG, clean_shutdown=True)
    assert log.recovery_stats.producer_chunks_replayed == 0 and state_of(log) == expected
    log.close()


def test_a_damaged_or_stale_snapshot_is_skipped(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    log = PartitionLog.open(directory, CONFIG)
    append_batches(log, 60)
    log.flush()
    expected = state_of(log)
    snapshots = snapshot_offsets(directory)
    log._close_files()
    snapshot_path(directory, snapshots[-1]).write_bytes(b"CPS1 torn")      # fails its checksum
    snapshot_path(directory, 10 ** 9).write_bytes(b"above the log end")   # its chunks were cut
    log = PartitionLog.open(directory, CONFIG)
    assert log.recovery_stats.producer_snapshot_offset == snapshots[-2]
    assert state_of(log) == expected
    assert snapshot_offsets(directory) == snapshots[:-1]
    log.close()


def test_truncation_and_retention_keep_snapshots_consistent(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    log = PartitionLog.open(directory, CONFIG)
    append_batches(log, 30, producers=1)
    log.flush()
    bases = [info.base_offset for info in log.segments_info()]
    cut = bases[3] + 3  # inside the fourth segment, at a chunk boundary
    log.truncate_to(cut)
    assert snapshot_offsets(directory) == bases[1:4]
    entry = log.producer_state.entries["p0"]
    assert entry.last_seq == cut and entry.batches[-1] == (cut - 2, cut, cut - 3)
    log.set_hwm(cut)
    log.delete_segments_before(bases[2])
    assert snapshot_offsets(directory) == bases[2:4]
    log.close()
    log = PartitionLog.open(directory, CONFIG)
    assert log.producer_state.entries["p0"].last_seq == cut
    log.close()


CHILD = """
import os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from tests.unit.test_storage_producer_state import CONFIG, append_batches
from cursus.storage import PartitionLog
log = PartitionLog.open(Path(sys.argv[1]), CONFIG)
append_batches(log, 90)
log.flush()
print("flushed", flush=True)
sys.stdin.read()  # killed here
"""


def test_kill9_then_rebuild_reads_only_the_last_segment(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    child = subprocess.Popen([PYTHON, "-c", CHILD, str(directory), str(REPO_ROOT)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=subprocess_env(), cwd=REPO_ROOT)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "flushed"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    log = PartitionLog.open(directory, CONFIG)
    last_base = log.segments_info()[-1].base_offset
    assert log.recovery_stats.producer_snapshot_offset == last_base
    assert log.recovery_stats.producer_chunks_replayed == (log.log_end_offset - last_base) // 3
    assert log.log_end_offset == 270
    assert {pid: e.last_seq for pid, e in log.producer_state.entries.items()} == {"p0": 90, "p1": 90, "p2": 90}
    log.close()


def test_idle_producers_expire_at_a_snapshot(tmp_path: Path) -> None:
    now = [1_000_000]
    config = small_config(segment_bytes=2048, producer_state_ttl_ms=60_000)
    log = PartitionLog.open(tmp_path / "p", config, clock_ms=lambda: now[0])
    log.append_chunk(0, 3, batch("old", 1, 1, 3))
    now[0] += 120_000  # "old" is idle past the TTL; "new" is not
    while len(log.segments_info()) == 1:
        log.append_chunk(log.log_end_offset, 3, batch("new", 1, 1 + log.log_end_offset - 3, 3))
    assert set(log.producer_state.entries) == {"new"}
    log.close()
