"""Leader epochs: the pure history functions, the epoch in chunk headers, the durable history and its repair."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cursus.storage import CorruptLogError, PartitionLog
from cursus.storage.chunk import encode_header
from cursus.storage.epochs import (
    UNDEFINED,
    EpochEnd,
    end_offset_for_epoch,
    rebuild,
    truncate_from_end,
    truncate_from_start,
    truncation_offset,
)
from cursus.storage.segment import log_file_name
from tests.unit.test_storage_support import (
    append_records,
    read_all,
    record_for,
    records_section,
    small_config,
)

HISTORY = [(1, 0), (3, 10), (4, 25)]


# ------------------------------------------------------------------------------------ pure functions


@pytest.mark.parametrize(("requested", "expected"), [
    (4, (4, 40)),                   # the latest epoch ends at the LEO
    (3, (3, 25)),                   # a known epoch ends where the next one starts
    (2, (1, 10)),                   # an unknown epoch in a gap: the largest epoch below it
    (0, (0, 0)),                    # below every epoch: the requested epoch, ending at the first start
    (5, (UNDEFINED, UNDEFINED)),    # above every epoch
    (UNDEFINED, (UNDEFINED, UNDEFINED)),
])
def test_end_offset_for_epoch_has_kafka_semantics(requested: int, expected: tuple[int, int]) -> None:
    assert end_offset_for_epoch(HISTORY, requested, 40) == EpochEnd(*expected)
    assert end_offset_for_epoch([], 1, 40) == EpochEnd(UNDEFINED, UNDEFINED)


histories = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5)), max_size=6).map(
    lambda steps: [(sum(e for e, _ in steps[:n + 1]) + n, sum(o for _, o in steps[:n + 1]))
                   for n in range(len(steps))])


@given(histories, st.integers(-1, 25), st.integers(0, 10))
def test_end_offset_for_epoch_matches_a_model(history: list[tuple[int, int]], requested: int,
                                              extra: int) -> None:
    leo = (history[-1][1] if history else 0) + extra
    answer = end_offset_for_epoch(history, requested, leo)
    known = [epoch for epoch, _ in history]
    if requested < 0 or not history or requested > known[-1]:
        assert answer == (UNDEFINED, UNDEFINED)
        return
    # Every offset below the answer's end is in an epoch <= requested; the offset at the end is not.
    epoch_of = {offset: max(e for e, s in history if s <= offset) for offset in range(history[0][1], leo)}
    assert all(epoch <= requested for offset, epoch in epoch_of.items() if offset < answer.end_offset)
    assert answer.end_offset == leo or epoch_of.get(answer.end_offset, requested + 1) > requested
    assert answer.epoch == max([e for e in known if e <= requested], default=requested)


def test_truncation_of_the_history() -> None:
    assert truncate_from_end(HISTORY, 25) == [(1, 0), (3, 10)]
    assert truncate_from_end(HISTORY, 26) == HISTORY
    assert truncate_from_start(HISTORY, 15) == [(3, 15), (4, 25)]
    assert truncate_from_start(HISTORY, 25) == [(4, 25)]
    assert truncate_from_start(HISTORY, 30) == [(4, 30)]
    assert truncate_from_start(HISTORY, 0) == HISTORY


def test_rebuild_completes_a_checkpoint_that_is_behind_and_refuses_a_broken_lineage() -> None:
    assert rebuild(HISTORY, None, [], 30) == HISTORY
    assert rebuild(HISTORY, None, [], 20) == [(1, 0), (3, 10)]
    # Chunks validated from offset 12: epoch 3, then epochs 4 and 6 (6 never reached the checkpoint).
    assert rebuild(HISTORY, 12, [(3, 12), (4, 25), (6, 33)], 40) == [(1, 0), (3, 10), (4, 25), (6, 33)]
    # The chunks are the truth from offset 12 on (the checkpoint's epoch 4 was torn off with its chunks).
    assert rebuild(HISTORY, 12, [(3, 12)], 20) == [(1, 0), (3, 10)]
    # An epoch begun by a reset (no chunk yet) is kept.
    assert rebuild([(2, 50)], 50, [], 50) == [(2, 50)]
    with pytest.raises(ValueError, match="below epoch 3"):
        rebuild(HISTORY, 12, [(2, 12)], 20)


def test_truncation_offset_follows_kip_279() -> None:
    follower = [(1, 0), (2, 10)]
    # The leader knows epoch 2 and it ended at 15: keep the follower's records up to 15.
    assert truncation_offset(follower, 20, EpochEnd(2, 15), 5) == (15, True)
    assert truncation_offset(follower, 12, EpochEnd(2, 15), 5) == (12, True)
    # The leader answered with epoch 1 (it never had epoch 2), which ended at 8 on the leader.
    assert truncation_offset(follower, 20, EpochEnd(1, 8), 5) == (8, True)
    # The leader answered with an epoch the follower does not have: cut to the end of the epoch below it
    # on the follower and ask again.
    assert truncation_offset([(1, 0), (3, 10)], 20, EpochEnd(2, 12), 5) == (10, False)
    assert truncation_offset(follower, 20, EpochEnd(UNDEFINED, UNDEFINED), 5) == (5, True)


# ------------------------------------------------------------------------------------------ the log


def test_a_new_epoch_is_durable_before_its_first_chunk_counts_as_durable(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    log = PartitionLog.open(directory, small_config())
    append_records(log, [3], leader_epoch=0)
    append_records(log, [2], leader_epoch=5)
    assert log.durable_end_offset == 0 and log.leader_epochs == [(0, 0), (5, 3)]
    log.flush()
    # No close and no periodic checkpoint: the flush itself wrote the history.
    assert json.loads((directory / "checkpoints.json").read_text())["leader_epochs"] == [[0, 0], [5, 3]]
    assert log.end_offset_for_epoch(0) == (0, 3) and log.end_offset_for_epoch(5) == (5, 5)
    assert log.end_offset_for_epoch(3) == (0, 3) and log.end_offset_for_epoch(6) == (UNDEFINED, UNDEFINED)
    log.close()


@pytest.mark.parametrize("damage", ["behind", "missing"])
def test_recovery_rebuilds_the_history_from_chunk_headers(tmp_path: Path, damage: str) -> None:
    directory = tmp_path / "p"
    log = PartitionLog.open(directory, small_config())
    append_records(log, [4] * 10, leader_epoch=1)
    log.flush()
    log.checkpoint()
    behind = (directory / "checkpoints.json").read_bytes()
    append_records(log, [4] * 10, leader_epoch=2)
    append_records(log, [4] * 10, leader_epoch=7)
    log.flush()
    log.close()
    # A crash between the chunks' fsync and the checkpoint's: the checkpoint does not know epochs 2 and 7.
    if damage == "behind":
        (directory / "checkpoints.json").write_bytes(behind)
    else:
        (directory / "checkpoints.json").unlink()
    log = PartitionLog.open(directory, small_config())
    assert log.leader_epochs == [(1, 0), (2, 40), (7, 80)]
    assert log.recovery_stats.epochs_repaired == (2 if damage == "behind" else 3)
    assert json.loads((directory / "checkpoints.json").read_text())["leader_epochs"] == [[1, 0], [2, 40], [7, 80]]
    log.close()


def _write_chunk(path: Path, base_offset: int, epoch: int) -> None:
    body = records_section([record_for(base_offset)])
    with path.open("ab") as handle:
        handle.write(encode_header(base_offset, 1, body, 0, epoch) + body)


@pytest.mark.parametrize("clean", [True, False])
def test_recovery_refuses_a_chunk_whose_epoch_goes_back(tmp_path: Path, clean: bool) -> None:
    directory = tmp_path / "p"
    PartitionLog.open(directory, small_config()).close()
    segment = directory / log_file_name(0)
    _write_chunk(segment, 0, 3)
    _write_chunk(segment, 1, 3)
    _write_chunk(segment, 2, 2)  # intact (CRC matches), but the lineage goes back: not a torn tail
    with pytest.raises(CorruptLogError, match="leader epoch 2 is below the epoch 3"):
        PartitionLog.open(directory, small_config(), clean_shutdown=clean)


def test_truncation_and_retention_keep_the_history_consistent(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    config = small_config(segment_bytes=200)
    log = PartitionLog.open(directory, config)
    for epoch in (1, 2, 3):
        append_records(log, [2] * 10, leader_epoch=epoch)
    log.flush()
    assert log.leader_epochs == [(1, 0), (2, 20), (3, 40)]
    log.truncate_to(41)
    assert log.leader_epochs == [(1, 0), (2, 20), (3, 40)]
    log.truncate_to(40)
    assert log.leader_epochs == [(1, 0), (2, 20)] and log.leader_epoch == 2
    append_records(log, [2], leader_epoch=4)  # a follower taking the new leader's chunks
    log.flush()
    log.set_hwm(log.log_end_offset)
    cut = next(i.next_offset for i in log.segments_info() if i.next_offset > 25)
    log.delete_segments_before(cut)
    start = log.log_start_offset
    assert 20 < start < 40 and log.leader_epochs == [(2, start), (4, 40)]
    log.close()
    log = PartitionLog.open(directory, config)
    assert log.leader_epochs == [(2, start), (4, 40)] and read_all(log)[-1] == record_for(41)
    log.truncate_to(start)  # everything: the log restarts empty at the start, without epochs
    assert log.leader_epochs == [] and log.log_end_offset == start
    log.close()
