"""Recovery at open: torn tails, corruption, index rebuilds, interrupted operations."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cursus.storage import CorruptLogError, LogConfig, PartitionLog, UnsupportedFormatError
from cursus.storage.chunk import HEADER_SIZE
from cursus.storage.recovery import RESET_MARKER_FILE_NAME
from tests.unit.test_storage_support import append_records, read_all, records_section, small_config

CONFIG = small_config(segment_bytes=2048, index_interval_bytes=100)


def segment_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.log"))


def build_crashed_log(directory: Path, durable_counts: list[int], tail_counts: list[int]) -> list[bytes]:
    """A log whose checkpoint covers ``durable_counts`` and whose later chunks are on disk but not in
    the checkpoint (written and fsynced after the last checkpoint, then the process 'crashed')."""
    log = PartitionLog.open(directory, CONFIG)
    records = append_records(log, durable_counts)
    log.flush()
    log.checkpoint()
    records += append_records(log, tail_counts)
    log.flush()
    log._close_files()  # drop the fds without a final checkpoint, as a crash would
    return records


def chunk_ends(path: Path) -> list[int]:
    """Byte positions where each chunk of a segment file ends."""
    data = path.read_bytes()
    ends, position = [], 0
    while position < len(data):
        body_length = int.from_bytes(data[position + 16:position + 20], "big")
        position += HEADER_SIZE + body_length
        ends.append(position)
    return ends


def reopen(directory: Path, *, clean: bool = False) -> PartitionLog:
    return PartitionLog.open(directory, CONFIG, clean_shutdown=clean)


# ----------------------------------------------------------------------------------------- torn tails


@pytest.mark.parametrize("damage", ["cut_mid_header", "cut_mid_body", "garbage", "zero_fill"])
def test_torn_tail_is_truncated(tmp_path: Path, damage: str) -> None:
    directory = tmp_path / "p"
    records = build_crashed_log(directory, [3] * 10, [4] * 5)
    last = segment_files(directory)[-1]
    ends = chunk_ends(last)
    size = last.stat().st_size
    with open(last, "r+b") as handle:
        if damage == "cut_mid_header":
            handle.truncate(ends[-2] + 10)
            kept = len(records) - 4
        elif damage == "cut_mid_body":
            handle.truncate(size - 3)
            kept = len(records) - 4
        elif damage == "garbage":
            handle.seek(size)
            handle.write(os.urandom(500).replace(b"CCK2", b"XXXX"))
            kept = len(records)
        else:
            handle.truncate(size + 4096)
            kept = len(records)
    log = reopen(directory)
    assert log.log_end_offset == log.durable_end_offset == kept
    assert log.recovery_stats.bytes_truncated > 0
    assert read_all(log) == records[:kept]
    append_records(log, [2], tag="after")
    log.close()
    log = reopen(directory, clean=True)
    assert log.recovery_stats.clean_shutdown_trusted and log.log_end_offset == kept + 2
    log.close()


def test_torn_tail_removes_later_empty_or_garbage_segments(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    records = build_crashed_log(directory, [3] * 10, [4] * 30)
    files = segment_files(directory)
    assert len(files) >= 3
    # the next-to-last segment loses its last chunk; the last one is zero-filled garbage
    with open(files[-2], "r+b") as handle:
        handle.truncate(chunk_ends(files[-2])[-1] - 1)
    files[-1].write_bytes(b"\0" * 300)
    log = reopen(directory)
    assert not files[-1].exists()
    last_kept = log.segments_info()[-1]
    assert last_kept.base_offset == int(files[-2].stem)
    assert read_all(log) == records[:log.log_end_offset]
    assert log.log_end_offset < int(files[-1].stem)
    log.close()


def test_empty_segment_after_a_roll_is_dropped(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    records = build_crashed_log(directory, [3] * 10, [])
    (directory / f"{len(records):020d}.log").write_bytes(b"")
    log = reopen(directory)
    assert log.log_end_offset == len(records) and read_all(log) == records
    log.close()


# ----------------------------------------------------------------------------------------- corruption


def test_corruption_below_the_recovery_point_is_fatal(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    log = PartitionLog.open(directory, LogConfig())
    append_records(log, [3] * 10)
    log.close()
    segment = segment_files(directory)[0]
    ends = chunk_ends(segment)
    data = bytearray(segment.read_bytes())
    data[ends[3] + HEADER_SIZE + 2] ^= 0x40  # body of the 5th chunk (offsets 12..14)
    segment.write_bytes(data)
    with pytest.raises(CorruptLogError) as raised:
        PartitionLog.open(directory, LogConfig(), clean_shutdown=False)
    error = raised.value
    assert error.path == segment and error.position == ends[3] and error.offset == 12
    message = str(error)
    assert str(segment) in message and f"byte position {ends[3]}" in message
    assert "offset 12" in message and "recovery point" in message
    # A trusted (clean) open checks only the tail, like Kafka; the damage then surfaces on read.
    log = PartitionLog.open(directory, LogConfig(), clean_shutdown=True)
    assert log.read(0, max_offset=12, max_records=100, max_bytes=1 << 20).record_count == 12
    with pytest.raises(CorruptLogError, match="CRC"):
        log.read(13, max_offset=30, max_records=100, max_bytes=1 << 20)
    log.close()


def test_corruption_followed_by_a_valid_chunk_is_fatal(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    build_crashed_log(directory, [3] * 2, [3] * 8)
    segment = segment_files(directory)[-1]
    ends = chunk_ends(segment)
    data = bytearray(segment.read_bytes())
    data[ends[4] + HEADER_SIZE + 1] ^= 0x01  # chunk 6 (above the recovery point 6), valid chunks follow
    segment.write_bytes(data)
    with pytest.raises(CorruptLogError) as raised:
        reopen(directory)
    assert raised.value.offset == 15 and raised.value.position == ends[4]
    assert "valid chunk follows" in str(raised.value)


def test_valid_chunk_in_a_later_segment_makes_a_bad_tail_fatal(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    build_crashed_log(directory, [3] * 2, [4] * 40)
    files = segment_files(directory)
    with open(files[-3], "r+b") as handle:
        handle.truncate(chunk_ends(files[-3])[-1] - 5)
    with pytest.raises(CorruptLogError, match="valid chunk follows"):
        reopen(directory)


def test_missing_durable_data_is_fatal(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    log = PartitionLog.open(directory, CONFIG)
    append_records(log, [3] * 40)
    log.close()
    files = segment_files(directory)
    files[-1].unlink()  # a whole segment below the recovery point vanished
    with pytest.raises(CorruptLogError, match="data is missing"):
        reopen(directory)


def test_gap_between_segments_is_fatal(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    log = PartitionLog.open(directory, CONFIG)
    append_records(log, [3] * 60)
    log.close()
    files = segment_files(directory)
    files[1].unlink()
    (directory / "checkpoints.json").unlink()  # no checkpoint: full validation
    with pytest.raises(CorruptLogError, match="does not continue the log"):
        reopen(directory)


def test_damaged_or_unknown_checkpoint_fails_closed(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    PartitionLog.open(directory, CONFIG).close()
    checkpoint = directory / "checkpoints.json"
    checkpoint.write_bytes(b'{"version":1,"recovery_point":')
    with pytest.raises(CorruptLogError, match="checkpoints.json"):
        reopen(directory)
    checkpoint.write_text(json.dumps({"version": 2, "recovery_point": 0, "log_start_offset": 0, "hwm": 0,
                                      "leader_epochs": []}))
    with pytest.raises(UnsupportedFormatError):
        reopen(directory)


def test_missing_checkpoint_means_full_validation(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    log = PartitionLog.open(directory, CONFIG)
    records = append_records(log, [3] * 60)
    log.close()
    (directory / "checkpoints.json").unlink()
    log = reopen(directory, clean=True)
    assert log.recovery_stats.segments_validated == log.recovery_stats.segments > 1
    assert read_all(log) == records
    log.close()


# --------------------------------------------------------------------------------------------- indexes


@pytest.mark.parametrize("damage", ["missing", "short", "garbage", "partial_entry", "past_end"])
def test_damaged_index_is_rebuilt(tmp_path: Path, damage: str) -> None:
    directory = tmp_path / "p"
    config = LogConfig(index_interval_bytes=64)
    log = PartitionLog.open(directory, config)
    records = append_records(log, [2] * 200)
    original = log._segments[0].index.entries()
    log.close()
    index = directory / "00000000000000000000.index"
    assert len(original) > 50 and index.stat().st_size == 8 * len(original)
    if damage == "missing":
        index.unlink()
    elif damage == "short":
        index.write_bytes(index.read_bytes()[:8 * 10])
    elif damage == "garbage":
        index.write_bytes(os.urandom(8 * 30))
    elif damage == "partial_entry":
        index.write_bytes(index.read_bytes() + b"\1\2\3")
    else:
        index.write_bytes(index.read_bytes() + (10**6).to_bytes(4, "big") * 2)
    log = PartitionLog.open(directory, config, clean_shutdown=True)
    assert log.recovery_stats.clean_shutdown_trusted and log.recovery_stats.indexes_rebuilt == 1
    assert log._segments[0].index.entries() == original
    assert index.read_bytes() == b"".join(o.to_bytes(4, "big") + p.to_bytes(4, "big") for o, p in original)
    assert read_all(log) == records
    for offset in (0, 1, 77, 201, 399):
        assert log.read(offset, max_offset=400, max_records=1, max_bytes=100).next_offset == offset + 1
    log.close()


def test_stale_index_entry_pointing_at_the_wrong_chunk_is_rebuilt(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    config = LogConfig(index_interval_bytes=64)
    log = PartitionLog.open(directory, config)
    records = append_records(log, [2] * 50)
    log.close()
    index = directory / "00000000000000000000.index"
    data = bytearray(index.read_bytes())
    data[-8:-4] = (int.from_bytes(data[-8:-4], "big") + 1).to_bytes(4, "big")  # wrong relative offset
    index.write_bytes(data)
    log = PartitionLog.open(directory, config, clean_shutdown=True)
    assert log.recovery_stats.indexes_rebuilt == 1 and read_all(log) == records
    log.close()


# ------------------------------------------------------------------------------ interrupted operations


def test_leftover_temp_files_are_removed(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    PartitionLog.open(directory, CONFIG).close()
    (directory / "checkpoints.json.tmp").write_text("half")
    (directory / "00000000000000000999.index").write_bytes(b"")  # orphan index
    log = reopen(directory, clean=True)
    assert log.recovery_stats.temp_files_removed == 1
    assert not (directory / "checkpoints.json.tmp").exists()
    assert not (directory / "00000000000000000999.index").exists()
    log.close()


def test_interrupted_reset_is_completed(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    log = PartitionLog.open(directory, CONFIG)
    append_records(log, [3] * 30, leader_epoch=2)
    log.close()
    (directory / RESET_MARKER_FILE_NAME).write_text('{"new_start_offset": 0, "leader_epochs": [[2, 0]]}\n')
    log = reopen(directory)
    assert (log.log_start_offset, log.log_end_offset, log.leader_epochs) == (0, 0, [(2, 0)])
    assert not (directory / RESET_MARKER_FILE_NAME).exists()
    assert [p.name for p in segment_files(directory)] == ["00000000000000000000.log"]
    log.close()


def test_interrupted_retention_is_completed(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    log = PartitionLog.open(directory, CONFIG)
    records = append_records(log, [3] * 60)
    log.close()
    files = segment_files(directory)
    new_start = int(files[3].stem)
    checkpoint = directory / "checkpoints.json"
    document = json.loads(checkpoint.read_text())
    document["log_start_offset"] = new_start  # checkpoint written, crash before the unlinks
    checkpoint.write_text(json.dumps(document))
    log = reopen(directory, clean=True)
    assert log.log_start_offset == new_start and not files[0].exists() and not files[2].exists()
    assert read_all(log) == records[new_start:]
    log.close()


def test_crash_inside_a_mid_chunk_truncation_recovers(tmp_path: Path) -> None:
    """Replay the state after step 2 of a cut inside a chunk: new header, old records still behind it."""
    directory = tmp_path / "p"
    log = PartitionLog.open(directory, LogConfig())
    records = append_records(log, [4, 6])
    log.close()
    segment = segment_files(directory)[0]
    before = segment.read_bytes()
    log = PartitionLog.open(directory, LogConfig())
    log.truncate_to(7)
    log.close()
    after = segment.read_bytes()
    # the crash left the rewritten chunk followed by the tail of the old one
    segment.write_bytes(after + before[len(after):])
    log = PartitionLog.open(directory, LogConfig())
    assert log.log_end_offset == 7 and read_all(log) == records[:7]
    log.close()


def test_records_section_helper_roundtrip() -> None:
    assert records_section([]) == b""
