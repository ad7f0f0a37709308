"""PartitionLog.skip_gap: a follower copies its leader's cleaned segments as stored, offset gaps included
(issue 18); the gaps survive a flush, a restart (recovery) and segment rolls, and reads skip them."""

from __future__ import annotations

from pathlib import Path

import pytest

from cursus.storage import PartitionLog
from tests.unit.test_storage_support import record_for, records_section, small_config, split_section


def _append(log: PartitionLog, base: int, count: int) -> None:
    log.append_chunk(base, count, records_section([record_for(base + i) for i in range(count)]), leader_epoch=0)


def _offsets(log: PartitionLog) -> list[int]:
    """Every durable record's offset, read run by run (a read stops before a gap)."""
    out: list[int] = []
    offset = log.log_start_offset
    while offset < log.durable_end_offset:
        result = log.read(offset, max_offset=log.durable_end_offset, max_records=1 << 20, max_bytes=1 << 30)
        records = split_section(result.records)
        assert records == [record_for(result.first_offset + i) for i in range(len(records))]
        out += range(result.first_offset, result.first_offset + len(records))
        assert result.next_offset > offset
        offset = result.next_offset
    return out


@pytest.mark.parametrize("at_start", [True, False])
def test_gaps_survive_flush_restart_and_rolls(tmp_path: Path, at_start: bool) -> None:
    log = PartitionLog.open(tmp_path / "p", small_config())
    expected: list[int] = []
    base = 0
    if not at_start:
        _append(log, 0, 2)
        expected += [0, 1]
        base = 2
    for step in range(40):  # gaps of 3, chunks of 2, over many 1 KiB segments
        log.skip_gap(base + 3)
        assert log.log_end_offset == base + 3
        _append(log, base + 3, 2)
        expected += [base + 3, base + 4]
        base += 5
        if step % 7 == 0:
            log.flush()
    log.flush()
    assert log.durable_end_offset == base
    assert _offsets(log) == expected
    assert len(log.segments_info()) > 3
    log.close()
    again = PartitionLog.open(tmp_path / "p", small_config())
    assert again.log_end_offset == base and again.durable_end_offset == base
    assert _offsets(again) == expected
    again.skip_gap(base + 10)  # a trailing gap, then a crash before the chunk: the log ends after the gap
    again.flush()
    again.close()
    third = PartitionLog.open(tmp_path / "p", small_config())
    assert third.log_end_offset == base + 10 and _offsets(third) == expected
    _append(third, base + 10, 1)
    third.flush()
    assert _offsets(third) == [*expected, base + 10]
    third.close()


def test_skip_gap_refuses_to_go_backwards(tmp_path: Path) -> None:
    log = PartitionLog.open(tmp_path / "p", small_config())
    _append(log, 0, 3)
    with pytest.raises(AssertionError):
        log.skip_gap(3)
    with pytest.raises(AssertionError):
        log.skip_gap(1)
    log.close()


def test_the_leader_serves_the_chunk_after_a_gap_and_answers_a_divergence_inside_a_chunk(tmp_path: Path) -> None:
    from cursus.replication.leader import read_stored_chunks

    log = PartitionLog.open(tmp_path / "p", small_config())
    _append(log, 0, 3)
    chunks, first = read_stored_chunks(log, 1, 3, 1 << 20)  # inside a chunk: no bytes (a divergence)
    assert chunks == b"" and first is not None and first.base_offset == 0
    log.skip_gap(8)
    _append(log, 8, 2)
    log.flush()
    chunks, first = read_stored_chunks(log, 3, 10, 1 << 20)  # in the gap: the next chunk, as stored
    assert first is not None and first.base_offset == 8 and len(chunks) == first.size_bytes
    chunks, first = read_stored_chunks(log, 0, 10, 1 << 20)
    assert first is not None and first.base_offset == 0 and chunks.count(b"CCK2") >= 2
    log.close()


def test_the_leader_names_the_end_of_a_gap_that_ends_its_log(tmp_path: Path) -> None:
    from cursus.replication.leader import trailing_gap_end

    log = PartitionLog.open(tmp_path / "p", small_config())
    _append(log, 0, 3)
    log.flush()
    assert trailing_gap_end(log, 3, 3) is None  # at the end: nothing to skip
    assert trailing_gap_end(log, 0, 3) is None  # chunks stored, and no cleaned segment anyway
    log.skip_gap(8)
    log.flush()
    assert trailing_gap_end(log, 3, 8) == 8  # nothing stored from 3 to the written end
    assert trailing_gap_end(log, 0, 8) is None  # a chunk lies in the range
    _append(log, 8, 2)
    log.flush()
    assert trailing_gap_end(log, 3, 10) is None  # the gap no longer ends the log: the chunk at 8 is served
    assert trailing_gap_end(log, 3, 8) == 8  # (a chunk at or past the end given does not count)
    log.close()
