"""Repair of a damaged replica log: quarantine everything from the first invalid chunk, keep the valid prefix.

Cluster only (a replica whose log fails to open with :class:`~cursus.storage.errors.CorruptLogError`; the
broker then re-fetches the rest from the partition leader as a follower). Standalone never calls it: a single
copy cannot be repaired, it fails closed.

:func:`truncate_to_last_valid_chunk` walks **every** chunk of the partition from its first segment, fully
validated (header sanity, base offset continuity, CRC32C, records walk, non-decreasing leader epochs: the
checks of recovery pass 3), and stops at the first invalid chunk at byte ``position`` of segment file
``path``, where offset ``offset`` was expected. Then, in this order, each step durable before the next:

1. a quarantine folder ``<partition>/quarantine/<UTC time>-offset-<offset>/`` is created; it receives a copy
   of the damaged segment file (all of it, the valid prefix included), every later segment file moved there
   (with its ``.compacted`` marker), and ``repair.json`` naming the file, position, offset, reason and the
   checkpoint seen. Nothing is deleted: the quarantine is evidence for an operator, removed by hand (or with
   the topic);
2. the damaged segment is cut at ``position`` (a later segment cut at byte 0 is moved whole instead) and
   its index removed (recovery rebuilds it);
3. ``checkpoints.json`` is rewritten with ``recovery_point = offset`` (so recovery validates the cut
   segment again), ``hwm = min(hwm, offset)`` and the leader-epoch history cut at ``offset``.

A log with no invalid chunk but an end below its checkpointed recovery point (segments lost) is repaired by
step 3 alone. The caller reopens the log (:meth:`PartitionLog.open`, unclean path) afterwards; the repaired
log ends at ``offset``, which may be below the committed HWM: such a replica fails closed if made leader and
fetches the rest as a follower (docs/cluster.md "Repair of a corrupted replica").

Every step can be re-run after a crash: a second run finds the cut log valid up to its end and at most
lowers the checkpoint again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from cursus.storage.atomic import fsync_dir
from cursus.storage.checkpoint import Checkpoint, read_checkpoint, write_checkpoint
from cursus.storage.epochs import rebuild as rebuild_epochs
from cursus.storage.epochs import truncate_from_end, truncate_from_start
from cursus.storage.errors import CorruptLogError
from cursus.storage.recovery import RecoveryStats, _pass1_cleanup, _segment_bases, _validate_segment
from cursus.storage.segment import COMPACTED_SUFFIX, LOG_SUFFIX, Segment
from cursus.storage.swap import read_compacted_next_offset, write_compacted_marker

logger = logging.getLogger("cursus.storage")

#: Sub-folder of a partition directory that holds quarantined (damaged) data.
QUARANTINE_DIR_NAME = "quarantine"
#: The description written into every quarantine folder.
REPAIR_REPORT_FILE_NAME = "repair.json"
_INDEX_INTERVAL_BYTES = 4096  # only for the throw-away validation walk; the reopen rebuilds the real indexes


@dataclass(frozen=True, slots=True)
class RepairReport:
    """What :func:`truncate_to_last_valid_chunk` did.

    Attributes:
        path: the damaged segment file (or the partition directory when only the checkpoint was lowered).
        position: byte position of the first invalid chunk in ``path`` (None: no invalid chunk).
        offset: the new end of the log (first offset dropped).
        reason: why the chunk at ``position`` is invalid.
        quarantine: the quarantine folder (None when no byte was moved aside).
        bytes_quarantined: bytes removed from the log (the cut tail plus the later segments).
        segments_moved: later segment files moved into the quarantine.
        previous_recovery_point: the checkpointed recovery point before the repair (None: no checkpoint).
    """

    path: Path
    position: int | None
    offset: int
    reason: str
    quarantine: Path | None
    bytes_quarantined: int
    segments_moved: int
    previous_recovery_point: int | None


@dataclass(slots=True)
class _Damage:
    number: int
    position: int
    offset: int
    reason: str


def _read_checkpoint_or_quarantine(directory: Path) -> tuple[Checkpoint | None, str | None]:
    """The checkpoint, or (None, why) when the file itself is damaged (it is then quarantined too)."""
    try:
        return read_checkpoint(directory), None
    except CorruptLogError as exc:
        return None, exc.reason


def _first_damage(segments: list[Segment]) -> tuple[_Damage | None, int, list[tuple[int, int]]]:
    """Validate every chunk; return the first damage (None), the end of valid data and the observed epochs."""
    stats = RecoveryStats()
    expected = segments[0].base_offset
    epoch = -1
    observed: list[tuple[int, int]] = []
    for number, segment in enumerate(segments):
        walk = _validate_segment(segment, expected, _INDEX_INTERVAL_BYTES, stats, epoch)
        if walk.bad_position is not None:
            observed.extend(walk.epochs)
            return _Damage(number, walk.bad_position, walk.next_offset, walk.bad_reason), walk.next_offset, observed
        expected = walk.next_offset
        epoch = walk.last_epoch
        observed.extend(walk.epochs)
    return None, expected, observed


def _stamp(now: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))


def truncate_to_last_valid_chunk(directory: Path, *, now: float | None = None) -> RepairReport | None:
    """Quarantine the partition log in ``directory`` from its first invalid chunk on and cut it there
    (see the module docstring). Blocking; the log must not be open.

    Returns:
        what was done, or None when the log is valid up to its checkpointed recovery point (nothing to
        repair: the open failed for another reason, which the caller re-raises).

    Raises:
        OSError: an I/O error (the repair can be run again).
        StorageError: the directory cannot be repaired (e.g. a checkpoint of an unknown format).
    """
    now = time.time() if now is None else now
    checkpoint, checkpoint_damage = _read_checkpoint_or_quarantine(directory)
    checkpoint = _pass1_cleanup(directory, checkpoint, RecoveryStats())
    bases = _segment_bases(directory, LOG_SUFFIX)
    log_start = checkpoint.log_start_offset if checkpoint is not None else (bases[0] if bases else 0)
    if not bases:
        if checkpoint is None or checkpoint.recovery_point <= checkpoint.log_start_offset:
            return None
        Segment.create(directory, log_start, 1).close()
        fsync_dir(directory)
        bases = [log_start]
    segments = [Segment.open_existing(directory, base) for base in bases]
    try:
        for segment in segments:
            segment.compacted_next_offset = read_compacted_next_offset(directory, segment.base_offset)
        damage, end, observed = _first_damage(segments)
        recovery_point = checkpoint.recovery_point if checkpoint is not None else None
        if damage is None and checkpoint_damage is None and (recovery_point is None or end >= recovery_point):
            return None
        quarantine: Path | None = None
        moved = 0
        quarantined_bytes = 0
        path = directory
        reason = checkpoint_damage or f"the log ends at offset {end}, below the recovery point {recovery_point}"
        if damage is not None:
            damaged = segments[damage.number]
            path, reason = damaged.path, damage.reason
            quarantine = directory / QUARANTINE_DIR_NAME / f"{_stamp(now)}-offset-{damage.offset}"
            quarantine.mkdir(parents=True, exist_ok=True)
            fsync_dir(quarantine.parent)
            fsync_dir(directory)
            quarantined_bytes = _quarantine_tail(directory, segments, damage, quarantine)
            moved = len(segments) - damage.number - 1 + (1 if damage.position == 0 and damage.number > 0 else 0)
        elif checkpoint_damage is not None:
            quarantine = directory / QUARANTINE_DIR_NAME / f"{_stamp(now)}-checkpoint"
            quarantine.mkdir(parents=True, exist_ok=True)
            fsync_dir(quarantine.parent)
        if checkpoint_damage is not None and quarantine is not None:
            damaged_checkpoint = directory / "checkpoints.json"
            if damaged_checkpoint.exists():
                os.replace(damaged_checkpoint, quarantine / "checkpoints.json")
        report = RepairReport(path, damage.position if damage is not None else None, end, reason, quarantine,
                              quarantined_bytes, moved, recovery_point)
        if quarantine is not None:
            _write_report(quarantine, report, checkpoint)
        first_base = segments[0].base_offset
    finally:
        for segment in segments:
            segment.close()
    checkpointed = checkpoint.leader_epochs if checkpoint is not None else ()
    try:
        epochs = rebuild_epochs(checkpointed, first_base, observed, end)
    except ValueError:
        epochs = list(observed)  # the chunks are the truth
    epochs = truncate_from_end(epochs, end)
    new_start = min(max(log_start, first_base), end)
    epochs = truncate_from_start(epochs, new_start)
    hwm = min(checkpoint.hwm, end) if checkpoint is not None else new_start
    write_checkpoint(directory, Checkpoint(end, new_start, max(hwm, new_start), tuple(epochs)))
    fsync_dir(directory)
    logger.error("REPAIRED corrupt replica log %s: first invalid chunk at byte position %s (offset %d: %s); "
                 "log cut to end at offset %d (recovery point was %s), %d byte(s) and %d later segment(s) moved "
                 "to %s", report.path, report.position, report.offset, report.reason, end, recovery_point,
                 report.bytes_quarantined, report.segments_moved, report.quarantine)
    return report


def _quarantine_tail(directory: Path, segments: list[Segment], damage: _Damage, quarantine: Path) -> int:
    """Steps 1 and 2 for damage at ``damage``: returns the bytes removed from the log."""
    removed = 0
    damaged = segments[damage.number]
    later = segments[damage.number + 1:]
    whole = damage.position == 0 and damage.number > 0
    if whole:
        later = segments[damage.number:]
    else:
        target = quarantine / damaged.path.name
        if not target.exists():  # a re-run after a crash keeps the first (undamaged-by-us) copy
            shutil.copyfile(damaged.path, target)
            with open(target, "rb") as copy:
                os.fsync(copy.fileno())
        fsync_dir(quarantine)
    for segment in later:
        removed += os.fstat(segment.fd).st_size
        os.replace(segment.path, quarantine / segment.path.name)
        compacted = directory / f"{segment.base_offset:020d}{COMPACTED_SUFFIX}"
        if compacted.exists():
            os.replace(compacted, quarantine / compacted.name)
        segment.index_path.unlink(missing_ok=True)
    fsync_dir(quarantine)
    fsync_dir(directory)
    if not whole:
        size = os.fstat(damaged.fd).st_size
        removed += size - damage.position
        damaged.truncate(damage.position)
        damaged.sync()
        damaged.index_path.unlink(missing_ok=True)
        if damaged.compacted_next_offset is not None:  # a cleaned segment now ends at the cut
            if damaged.compacted_path.exists():
                shutil.copyfile(damaged.compacted_path, quarantine / damaged.compacted_path.name)
            write_compacted_marker(directory, damaged.base_offset, damage.offset)
        fsync_dir(directory)
    return removed


def _write_report(quarantine: Path, report: RepairReport, checkpoint: Checkpoint | None) -> None:
    document = {
        "path": str(report.path), "position": report.position, "offset": report.offset, "reason": report.reason,
        "bytes_quarantined": report.bytes_quarantined, "segments_moved": report.segments_moved,
        "checkpoint": None if checkpoint is None else json.loads(checkpoint.encode()),
        "time": _stamp(time.time()),
    }
    target = quarantine / REPAIR_REPORT_FILE_NAME
    with open(target, "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=1)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    fsync_dir(quarantine)


__all__ = ["QUARANTINE_DIR_NAME", "REPAIR_REPORT_FILE_NAME", "RepairReport", "truncate_to_last_valid_chunk"]
