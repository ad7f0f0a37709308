"""Repair of a damaged replica log (cluster): quarantine from the first invalid chunk, keep the valid prefix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cursus.storage import CorruptLogError, PartitionLog
from cursus.storage.checkpoint import read_checkpoint
from cursus.storage.chunk import HEADER_SIZE
from cursus.storage.repair import QUARANTINE_DIR_NAME, REPAIR_REPORT_FILE_NAME, truncate_to_last_valid_chunk
from tests.unit.test_storage_recovery import chunk_ends, segment_files
from tests.unit.test_storage_support import append_records, read_all, small_config

CONFIG = small_config(segment_bytes=2048, index_interval_bytes=100)


def build(directory: Path, counts: list[int], epochs: int = 1) -> list[bytes]:
    """A cleanly closed log (checkpoint recovery point = its end) of ``counts`` chunks, leader epochs
    spread over ``epochs``."""
    log = PartitionLog.open(directory, CONFIG)
    records: list[bytes] = []
    per_epoch = max(1, len(counts) // epochs)
    for number, count in enumerate(counts):
        records += append_records(log, [count], leader_epoch=min(number // per_epoch, epochs - 1))
    log.close()
    return records


def all_chunks(directory: Path) -> list[tuple[Path, int, int]]:
    """(segment file, chunk start position, chunk end position) of every chunk, in log order."""
    found = []
    for path in segment_files(directory):
        start = 0
        for end in chunk_ends(path):
            found.append((path, start, end))
            start = end
    return found


def flip(path: Path, position: int) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 0x5A
    path.write_bytes(data)


def quarantine_dirs(directory: Path) -> list[Path]:
    root = directory / QUARANTINE_DIR_NAME
    return sorted(root.iterdir()) if root.exists() else []


def test_a_valid_log_needs_no_repair(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    build(directory, [3] * 30)
    assert truncate_to_last_valid_chunk(directory) is None
    assert quarantine_dirs(directory) == []


def test_damage_below_the_recovery_point_is_quarantined_and_cut(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    records = build(directory, [3] * 60, epochs=3)
    chunks = all_chunks(directory)
    assert len({path for path, _, _ in chunks}) >= 3
    victim = 25  # a chunk in the middle of the log, below the recovery point
    path, start, _ = chunks[victim]
    original = path.read_bytes()
    flip(path, start + HEADER_SIZE + 3)
    report = truncate_to_last_valid_chunk(directory, now=0.0)
    assert report is not None
    assert report.path == path and report.position == start and report.offset == victim * 3
    assert "CRC" in report.reason
    later = [p for p in {p for p, _, _ in chunks} if p.name > path.name]
    assert report.segments_moved == len(later)
    (quarantine,) = quarantine_dirs(directory)
    assert quarantine.name == f"19700101T000000Z-offset-{victim * 3}"
    copied = (quarantine / path.name).read_bytes()
    assert copied[:start] == original[:start] and copied != original  # the damaged file, bad bytes and all
    assert all((quarantine / p.name).exists() and not p.exists() for p in later)
    document = json.loads((quarantine / REPAIR_REPORT_FILE_NAME).read_text())
    assert document["offset"] == victim * 3 and document["position"] == start
    checkpoint = read_checkpoint(directory)
    assert checkpoint is not None and checkpoint.recovery_point == victim * 3 and checkpoint.hwm <= victim * 3
    log = PartitionLog.open(directory, CONFIG)
    try:
        assert log.log_end_offset == victim * 3
        assert read_all(log) == records[:victim * 3]
        assert all(start < victim * 3 for _, start in log.leader_epochs)
        append_records(log, [2], tag="refetched", leader_epoch=log.leader_epoch)  # appends continue
    finally:
        log.close()
    assert truncate_to_last_valid_chunk(directory) is None  # idempotent: nothing left to repair


def test_damage_at_the_start_of_a_later_segment_moves_it_whole(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    records = build(directory, [3] * 60)
    files = segment_files(directory)
    victim = files[2]
    flip(victim, 2)  # header magic of its first chunk
    report = truncate_to_last_valid_chunk(directory)
    assert report is not None and report.position == 0 and report.path == victim
    base = int(victim.name.split(".")[0])
    assert report.offset == base and report.segments_moved == len(files) - 2
    assert not victim.exists()
    log = PartitionLog.open(directory, CONFIG)
    try:
        assert log.log_end_offset == base and read_all(log) == records[:base]
    finally:
        log.close()


def test_missing_segments_lower_the_recovery_point(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    records = build(directory, [3] * 40)
    files = segment_files(directory)
    files[-1].unlink()
    with pytest.raises(CorruptLogError, match="data is missing"):
        PartitionLog.open(directory, CONFIG)
    report = truncate_to_last_valid_chunk(directory)
    assert report is not None and report.quarantine is None and report.position is None
    end = int(files[-1].name.split(".")[0])
    assert report.offset == end
    log = PartitionLog.open(directory, CONFIG)
    try:
        assert log.log_end_offset == end and read_all(log) == records[:end]
    finally:
        log.close()


def test_a_damaged_checkpoint_is_quarantined(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    records = build(directory, [3] * 10)
    (directory / "checkpoints.json").write_bytes(b'{"version":1,"recov')
    with pytest.raises(CorruptLogError):
        PartitionLog.open(directory, CONFIG)
    report = truncate_to_last_valid_chunk(directory)
    assert report is not None and report.quarantine is not None
    assert (report.quarantine / "checkpoints.json").read_bytes() == b'{"version":1,"recov'
    log = PartitionLog.open(directory, CONFIG)
    try:
        assert read_all(log) == records and log.hwm == 0  # the HWM is relearned from the leader
    finally:
        log.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunk=st.integers(min_value=0, max_value=44), at=st.floats(min_value=0.0, max_value=0.999),
       clean=st.booleans())
def test_repair_keeps_exactly_the_chunks_before_the_damage(tmp_path: Path, chunk: int, at: float,
                                                           clean: bool) -> None:
    """Wherever one byte is flipped, the repaired log holds exactly the chunks before the damaged one
    (never a damaged byte), opens, and accepts appends."""
    directory = tmp_path / f"p{chunk}-{int(at * 1000)}-{clean}"
    shutil.rmtree(directory, ignore_errors=True)
    records = build(directory, [3] * 45, epochs=2)
    path, start, end = all_chunks(directory)[chunk]
    flip(path, start + int((end - start) * at))
    report = truncate_to_last_valid_chunk(directory)
    assert report is not None
    assert report.offset == chunk * 3
    base = int(path.name.split(".")[0])
    assert (path.stat().st_size == start) if path.exists() else (start == 0 and base == chunk * 3 > 0)
    log = PartitionLog.open(directory, CONFIG, clean_shutdown=clean)
    try:
        assert log.log_end_offset == chunk * 3
        assert read_all(log) == records[:chunk * 3]
        append_records(log, [1], leader_epoch=log.leader_epoch)
    finally:
        log.close()
