"""PartitionLog: appends, reads, rolls, truncation, reset, retention, checkpoints, fencing."""

from __future__ import annotations

import errno
import json
import os
import random
import tempfile
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cursus.storage import (
    CorruptLogError,
    LogConfig,
    OffsetOutOfRange,
    PartitionLog,
    StorageFencedError,
)
from cursus.storage.chunk import HEADER_SIZE
from cursus.storage.segment import Segment
from tests.unit.test_storage_support import (
    append_records,
    read_all,
    record_for,
    records_section,
    small_config,
    split_section,
)


def open_log(path: Path, config: LogConfig | None = None, **kwargs) -> PartitionLog:
    return PartitionLog.open(path, config or small_config(), **kwargs)


# ------------------------------------------------------------------------------------------ round trips


def test_new_log_is_empty_with_one_segment(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p")
    assert (log.log_start_offset, log.log_end_offset, log.durable_end_offset, log.hwm) == (0, 0, 0, 0)
    assert log.leader_epoch == 0 and log.failed is None
    assert [s.base_offset for s in log.segments_info()] == [0]
    assert (tmp_path / "p" / "00000000000000000000.log").exists()
    assert json.loads((tmp_path / "p" / "checkpoints.json").read_text()) == {
        "version": 1, "recovery_point": 0, "log_start_offset": 0, "hwm": 0, "leader_epochs": []}
    assert log.read(0, max_offset=0, max_records=10, max_bytes=100).record_count == 0
    log.close()


def test_round_trip_across_many_segments(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p")
    rng = random.Random(1)
    records = append_records(log, [rng.randint(1, 9) for _ in range(300)])
    assert log.durable_end_offset == 0  # nothing fsynced yet
    log.flush()
    assert log.durable_end_offset == log.log_end_offset == len(records)
    infos = log.segments_info()
    assert len(infos) > 20
    assert [i.is_active for i in infos] == [False] * (len(infos) - 1) + [True]
    for previous, current in zip(infos, infos[1:], strict=False):
        assert previous.next_offset == current.base_offset
        assert previous.size_bytes <= 1024
    assert log.size_bytes() == sum(i.size_bytes for i in infos)
    assert read_all(log) == records
    log.close()


def test_reads_start_mid_chunk_and_cut_by_records_and_bytes(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p")
    records = append_records(log, [5, 5, 5, 5])
    log.flush()
    result = log.read(7, max_offset=20, max_records=6, max_bytes=1 << 20)
    assert (result.first_offset, result.record_count, result.next_offset) == (7, 6, 13)
    assert split_section(result.records) == records[7:13]
    # a byte limit that cuts inside the second chunk
    budget = sum(4 + len(r) for r in records[2:8])
    result = log.read(2, max_offset=20, max_records=100, max_bytes=budget + 3)
    assert split_section(result.records) == records[2:8] and result.next_offset == 8
    # max_offset cuts inside a chunk
    result = log.read(0, max_offset=12, max_records=100, max_bytes=1 << 20)
    assert split_section(result.records) == records[:12]
    log.close()


def test_at_least_one_record_even_if_larger_than_max_bytes(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p", LogConfig())
    big = [b"x" * 5000, b"y" * 10]
    log.append_chunk(0, 2, records_section(big))
    log.flush()
    for max_bytes in (0, 1, 100):
        result = log.read(0, max_offset=2, max_records=10, max_bytes=max_bytes)
        assert split_section(result.records) == big[:1] and result.next_offset == 1
    result = log.read(1, max_offset=2, max_records=10, max_bytes=0)
    assert split_section(result.records) == big[1:]
    log.close()


def test_reads_stop_at_durable_end_and_check_ranges(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p")
    records = append_records(log, [3, 3])
    log.flush()
    append_records(log, [4])  # written, not fsynced
    result = log.read(0, max_offset=log.log_end_offset, max_records=100, max_bytes=1 << 20)
    assert split_section(result.records) == records and result.next_offset == 6
    empty = log.read(8, max_offset=10, max_records=1, max_bytes=1)
    assert (empty.record_count, empty.records, empty.next_offset) == (0, b"", 8)
    with pytest.raises(OffsetOutOfRange) as raised:
        log.read(11, max_offset=11, max_records=1, max_bytes=1)
    assert (raised.value.earliest, raised.value.latest) == (0, 10)
    log.close()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=40), st.integers(0, 2**32 - 1),
       st.sampled_from([32, 200, 4096]))
def test_random_reads_agree_with_a_simple_model(chunk_counts: list[int], seed: int, interval: int) -> None:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as directory:
        log = PartitionLog.open(Path(directory), LogConfig(segment_bytes=rng.choice([300, 700, 1 << 20]),
                                                           index_interval_bytes=interval))
        model: list[bytes] = []
        for count in chunk_counts:
            records = [rng.randbytes(rng.randint(0, 90)) for _ in range(count)]
            log.append_chunk(len(model), count, records_section(records))
            model.extend(records)
        log.flush()
        for _ in range(20):
            offset = rng.randrange(len(model))
            max_offset = rng.randint(offset, len(model))
            max_records = rng.randint(1, 30)
            max_bytes = rng.randint(0, 600)
            result = log.read(offset, max_offset=max_offset, max_records=max_records, max_bytes=max_bytes)
            expected: list[bytes] = []
            used = 0
            for record in model[offset:max_offset][:max_records]:
                if expected and used + 4 + len(record) > max_bytes:
                    break
                expected.append(record)
                used += 4 + len(record)
            assert split_section(result.records) == expected
            assert result.record_count == len(expected) and result.next_offset == offset + len(expected)
        log.close()


def test_crc_mismatch_on_read_raises_corruption(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p", LogConfig())
    append_records(log, [4, 4])
    log.flush()
    segment_path = tmp_path / "p" / "00000000000000000000.log"
    data = bytearray(segment_path.read_bytes())
    data[-3] ^= 0xFF  # inside the second chunk's body
    segment_path.write_bytes(data)
    assert log.read(0, max_offset=4, max_records=10, max_bytes=1 << 20).record_count == 4
    with pytest.raises(CorruptLogError) as raised:
        log.read(5, max_offset=8, max_records=10, max_bytes=1 << 20)
    assert raised.value.path == segment_path and raised.value.offset == 5
    assert str(segment_path) in str(raised.value) and "CRC" in str(raised.value)
    log.close()


def test_iter_chunks_yields_durable_chunks(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p")
    records = append_records(log, [2, 3, 1] * 20)
    log.flush()
    append_records(log, [5])  # not durable: not yielded
    chunks = list(log.iter_chunks())
    assert [base for base, _, _ in chunks][:3] == [0, 2, 5]
    assert sum(count for _, count, _ in chunks) == len(records)
    assert [r for _, _, body in chunks for r in split_section(body)] == records
    from_mid = list(log.iter_chunks(7))
    assert from_mid[0][0] == 6  # the chunk holding offset 7
    log.close()


def test_append_preconditions_are_assertions(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p")
    with pytest.raises(AssertionError, match="log end offset"):
        log.append_chunk(5, 1, records_section([b"a"]))
    with pytest.raises(AssertionError, match="records section"):
        log.append_chunk(0, 2, records_section([b"a"]))
    with pytest.raises(AssertionError):
        log.append_chunk(0, 0, b"")
    assert log.failed is None and log.log_end_offset == 0
    log.close()


# ------------------------------------------------------------------------------------------ rolling


def test_roll_by_size_never_splits_a_chunk(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p", LogConfig(segment_bytes=500))
    log.append_chunk(0, 1, records_section([b"a" * 100]))
    log.append_chunk(1, 1, records_section([b"b" * 1000]))   # larger than a segment: alone in its own
    log.append_chunk(2, 1, records_section([b"c" * 10]))
    log.flush()
    infos = log.segments_info()
    assert [(i.base_offset, i.next_offset) for i in infos] == [(0, 1), (1, 2), (2, 3)]
    assert infos[1].size_bytes == HEADER_SIZE + 4 + 1000
    log.close()


def test_roll_by_time_uses_the_injected_clock(tmp_path: Path) -> None:
    now = [1_000_000]
    config = LogConfig(segment_roll_ms=60_000)
    log = open_log(tmp_path / "p", config, clock_ms=lambda: now[0])
    append_records(log, [1])
    now[0] += 59_999
    append_records(log, [1])
    assert len(log.segments_info()) == 1
    now[0] += 1
    append_records(log, [1])
    infos = log.segments_info()
    assert [i.base_offset for i in infos] == [0, 2]
    assert infos[0].last_append_time_ms == 1_059_999 and infos[1].last_append_time_ms == 1_060_000
    log.close()
    # after reopening, the active segment's age comes from its first chunk on disk
    log = open_log(tmp_path / "p", config, clean_shutdown=True, clock_ms=lambda: now[0])
    now[0] += 60_000
    append_records(log, [1])
    assert [i.base_offset for i in log.segments_info()] == [0, 2, 3]
    log.close()


# ------------------------------------------------------------------------------ reopen and checkpoint


def test_reopen_after_clean_close_trusts_the_checkpoint(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p")
    records = append_records(log, [3] * 100)
    log.set_hwm(250)
    log.close()
    log = open_log(tmp_path / "p", clean_shutdown=True)
    stats = log.recovery_stats
    assert stats.clean_shutdown_trusted and stats.chunks_validated == 0 and stats.indexes_rebuilt == 0
    assert (log.log_end_offset, log.durable_end_offset, log.hwm) == (300, 300, 250)
    assert read_all(log) == records
    log.close()


def test_reopen_after_unclean_stop_validates_from_the_recovery_point(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p")
    records = append_records(log, [3] * 100)
    log.flush()
    log.checkpoint()
    records += append_records(log, [2] * 10)
    log.flush()  # durable, but the checkpoint still says 300: simulated crash, no close
    reopened = open_log(tmp_path / "p", clean_shutdown=False)
    stats = reopened.recovery_stats
    assert not stats.clean_shutdown_trusted
    assert 0 < stats.segments_validated < stats.segments
    assert stats.chunks_validated >= 10
    assert reopened.log_end_offset == 320 and read_all(reopened) == records
    reopened.close()
    log.close()


def test_clean_marker_with_a_stale_checkpoint_falls_back_to_validation(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p")
    append_records(log, [3] * 10)
    log.close()
    checkpoint = tmp_path / "p" / "checkpoints.json"
    document = json.loads(checkpoint.read_text())
    document["recovery_point"] = 20
    checkpoint.write_text(json.dumps(document))
    log = open_log(tmp_path / "p", clean_shutdown=True)
    assert not log.recovery_stats.clean_shutdown_trusted and log.log_end_offset == 30
    log.close()


def test_hwm_and_leader_epochs_persist(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p")
    append_records(log, [5, 5], leader_epoch=1)
    append_records(log, [2], leader_epoch=3)
    append_records(log, [1])  # the default is the latest epoch
    with pytest.raises(AssertionError, match="below the log's latest epoch"):
        append_records(log, [1], leader_epoch=2)
    log.flush()
    log.set_hwm(7)
    log.close()
    log = open_log(tmp_path / "p", clean_shutdown=True)
    assert log.leader_epoch == 3 and log.leader_epochs == [(1, 0), (3, 10)] and log.hwm == 7
    log.truncate_to(8)
    assert log.leader_epochs == [(1, 0)] and log.leader_epoch == 1 and log.hwm == 7
    log.close()


# --------------------------------------------------------------------------------- truncate and reset


@pytest.mark.parametrize("cut", [0, 1, 5, 6, 9, 12, 20, 31, 47])
def test_truncate_to_any_offset_then_append_and_reopen(tmp_path: Path, cut: int) -> None:
    log = open_log(tmp_path / "p", small_config(segment_bytes=200))
    records = append_records(log, [5, 1, 3, 7, 2, 4, 6, 8, 10, 2])
    log.flush()
    log.set_hwm(40)
    log.truncate_to(cut)
    assert log.log_end_offset == log.durable_end_offset == cut
    assert log.hwm == min(40, cut)
    assert read_all(log) == records[:cut]
    tail = append_records(log, [3], tag="new")
    log.flush()
    assert read_all(log) == records[:cut] + tail
    with pytest.raises(OffsetOutOfRange):
        log.read(cut + 4, max_offset=cut + 4, max_records=1, max_bytes=1)
    log.close()
    for clean in (True, False):
        log = open_log(tmp_path / "p", small_config(segment_bytes=200), clean_shutdown=clean)
        assert log.recovery_stats.clean_shutdown_trusted == clean
        assert read_all(log) == records[:cut] + tail
        log.close()


def test_truncate_at_or_past_the_end_is_a_no_op(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p")
    records = append_records(log, [3, 3])
    log.flush()
    log.truncate_to(6)
    log.truncate_to(100)
    assert log.log_end_offset == 6 and read_all(log) == records
    log.close()


def test_reset_starts_empty_at_a_new_offset(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p")
    append_records(log, [3] * 50, leader_epoch=4)
    log.flush()
    log.reset(1000)
    assert (log.log_start_offset, log.log_end_offset, log.durable_end_offset, log.hwm) == (1000,) * 4
    assert log.leader_epochs == [(4, 1000)]
    assert [i.base_offset for i in log.segments_info()] == [1000]
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == [
        "00000000000000001000.index", "00000000000000001000.log", "checkpoints.json"]
    with pytest.raises(OffsetOutOfRange):
        log.read(5, max_offset=1000, max_records=1, max_bytes=1)
    records = append_records(log, [2, 2])
    log.close()
    log = open_log(tmp_path / "p")
    assert log.log_start_offset == 1000 and read_all(log) == records
    log.reset()  # back to offset 0, reusing the name of an old segment file
    assert log.log_end_offset == 0 and append_records(log, [1]) and log.log_end_offset == 1
    log.close()


# ----------------------------------------------------------------------------------------- retention


def test_delete_segments_before(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p")
    records = append_records(log, [4] * 100)
    log.flush()
    infos = log.segments_info()
    assert log.delete_segments_before(infos[0].next_offset - 1) == 0
    deleted = log.delete_segments_before(infos[3].next_offset)
    assert deleted == 4 and log.log_start_offset == infos[4].base_offset
    assert not (tmp_path / "p" / f"{infos[0].base_offset:020d}.log").exists()
    with pytest.raises(OffsetOutOfRange) as raised:
        log.read(0, max_offset=10, max_records=1, max_bytes=1)
    assert raised.value.earliest == infos[4].base_offset
    assert read_all(log) == records[infos[4].base_offset:]
    # never the active segment
    assert log.delete_segments_before(10**9) == len(infos) - 5
    assert len(log.segments_info()) == 1 and log.log_start_offset == infos[-1].base_offset
    log.close()
    log = open_log(tmp_path / "p", clean_shutdown=True)
    assert log.log_start_offset == infos[-1].base_offset
    log.close()


def test_delete_segments_with_a_concurrent_reader(tmp_path: Path) -> None:
    fds_before = len(os.listdir("/proc/self/fd"))
    log = open_log(tmp_path / "p", small_config(segment_bytes=600))
    records = append_records(log, [3] * 400)
    log.flush()
    stop = threading.Event()
    problems: list[str] = []
    counters = {"ok": 0, "out_of_range": 0}

    def reader() -> None:
        rng = random.Random(7)
        while not stop.is_set():
            start = log.log_start_offset
            offset = rng.randrange(max(0, start - 50), len(records))
            try:
                result = log.read(offset, max_offset=len(records), max_records=50, max_bytes=4000)
            except OffsetOutOfRange as error:
                if offset >= error.earliest:
                    problems.append(f"offset {offset} >= earliest {error.earliest}")
                counters["out_of_range"] += 1
                continue
            except Exception as error:  # noqa: BLE001
                problems.append(repr(error))
                continue
            if split_section(result.records) != records[offset:result.next_offset]:
                problems.append(f"wrong bytes at {offset}")
            counters["ok"] += 1

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        infos = log.segments_info()[:-1]
        for info in infos[::max(1, len(infos) // 12)] + infos[-1:]:
            log.delete_segments_before(info.next_offset)
            for _ in range(3):
                if counters["ok"] > 0:
                    break
                stop.wait(0.001)
        for _ in range(500):  # let the reader also hit offsets below the final log start
            if counters["out_of_range"] > 0 and counters["ok"] > 0:
                break
            stop.wait(0.01)
    finally:
        stop.set()
        thread.join()
    assert not problems, problems[:5]
    assert counters["ok"] > 0 and counters["out_of_range"] > 0
    assert len(log.segments_info()) == 1
    log.close()
    assert len(os.listdir("/proc/self/fd")) == fds_before  # every doomed segment got closed


# ------------------------------------------------------------------------------------------- fencing


def test_write_error_fences_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = open_log(tmp_path / "p")
    append_records(log, [2])
    log.flush()

    def failing_write(self: Segment, position: int, buffers: list[bytes], size_bytes: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Segment, "write", failing_write)
    with pytest.raises(OSError):
        log.append_chunk(2, 1, records_section([b"x"]))
    assert isinstance(log.failed, OSError)
    monkeypatch.undo()
    with pytest.raises(StorageFencedError) as raised:
        log.append_chunk(2, 1, records_section([b"x"]))
    assert raised.value.cause is log.failed
    with pytest.raises(StorageFencedError):
        log.flush()
    # reads of durable data still work; close does not flush a fenced log
    assert log.read(0, max_offset=2, max_records=5, max_bytes=100).record_count == 2
    log.close()


def test_fsync_error_fences_and_is_not_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = open_log(tmp_path / "p")
    append_records(log, [2])
    calls = []

    def failing_sync(self: Segment) -> None:
        calls.append(self.path)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(Segment, "sync", failing_sync)
    with pytest.raises(OSError):
        log.flush()
    assert log.durable_end_offset == 0 and len(calls) == 1
    with pytest.raises(StorageFencedError):
        log.flush()
    assert len(calls) == 1  # never retried
    log.close()


def test_record_for_is_deterministic() -> None:
    assert record_for(5) == record_for(5) and record_for(5) != record_for(6)


def test_append_chunks_batches_with_rejections_and_rolls(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p", small_config(segment_bytes=300))
    chunks = [(n * 2, 2, records_section([record_for(n * 2), record_for(n * 2 + 1)]), None, None)
              for n in range(30)]
    bad = (20, 3, records_section([b"x"]), None, None)            # wrong record count: rejected
    wrong_offset = (99, 1, records_section([b"y"]), None, None)   # wrong base offset: rejected
    errors = log.append_chunks(chunks[:10] + [bad, wrong_offset] + chunks[10:])
    assert [e is None for e in errors] == [True] * 10 + [False, False] + [True] * 20
    assert "records section" in str(errors[10]) and "log end offset" in str(errors[11])
    log.flush()
    assert len(log.segments_info()) > 3 and all(i.size_bytes <= 300 for i in log.segments_info())
    assert read_all(log) == [record_for(o) for o in range(60)]
    log.close()


def test_roll_when_relative_offsets_would_overflow(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p")
    append_records(log, [1])
    segment = log._segments[-1]
    assert not log._should_roll(segment, segment.size_bytes, 2**32 - 1, 10, 0)
    assert log._should_roll(segment, segment.size_bytes, 2**32, 10, 0)
    log.close()


@pytest.mark.parametrize("field, value", [("segment_bytes", 10), ("segment_bytes", 1 << 31),
                                          ("index_interval_bytes", 0), ("segment_roll_ms", 0),
                                          ("recovery_point_interval_ms", -1)])
def test_log_config_rejects_out_of_range_values(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        LogConfig(**{field: value})


def test_damaged_tail_after_a_clean_shutdown_is_corruption(tmp_path: Path) -> None:
    log = open_log(tmp_path / "p")
    append_records(log, [3] * 20)
    log.close()
    last = sorted((tmp_path / "p").glob("*.log"))[-1]
    with open(last, "r+b") as handle:
        handle.truncate(last.stat().st_size - 2)
    with pytest.raises(CorruptLogError, match="recovery point"):
        open_log(tmp_path / "p", clean_shutdown=True)
