"""Partition log recovery at open, in numbered idempotent passes (Kafka ``LogLoader`` style).

Pass 1  Remove leftover temp files (``*.tmp``) and orphan indexes; finish an interrupted reset
        (``reset.pending``); complete or discard an interrupted cleaner swap (:mod:`cursus.storage.swap`).
Pass 2  List and open the segments; finish an interrupted retention (delete segments wholly below the
        checkpointed log start offset). A log with no segment gets an empty one.
Pass 3  Clean shutdown with a checkpoint: trust it. Load each index (rebuild it if missing or broken,
        complete it if short) and walk only the chunk headers after the last index entry; CRC-check the
        last chunk. The walk must end exactly at the checkpointed recovery point, else fall back to the
        unclean path. Unclean shutdown (or no checkpoint): segments before the one containing the recovery
        point are loaded the same way (their data was fsynced); from that segment on every chunk is
        validated: header sanity, base offset continuity, CRC32C, and the records-section length walk.
Pass 4  First invalid chunk: below the recovery point it is fatal (:class:`CorruptLogError` naming file,
        byte position and offset). Above it, if any later position of that segment or any later segment
        holds a valid chunk (header + CRC), it is corruption too (fatal). Otherwise it is a torn tail:
        cut the segment at the bad chunk and delete the later segments.
Pass 5  Indexes of validated segments are rebuilt from the validation walk (rewritten if they differ).
Pass 6  Validated segments and the directory are fsynced (what recovery keeps is then durable), and the
        offsets are restored from the checkpoint; the caller writes the new checkpoint.

Every pass can be re-run after a crash at any point and reaches the same state.
"""

from __future__ import annotations

import json
import logging
import os
import time
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path

from cursus.storage.atomic import TEMP_SUFFIX, atomic_write, fsync_dir
from cursus.storage.checkpoint import Checkpoint, read_checkpoint, write_checkpoint
from cursus.storage.chunk import HEADER, HEADER_SIZE, MAGIC, crc_matches, decode_header, records_walk_ok
from cursus.storage.epochs import rebuild as rebuild_epochs
from cursus.storage.epochs import truncate_from_start
from cursus.storage.errors import CorruptLogError
from cursus.storage.offset_index import U32_MAX, OffsetIndex
from cursus.storage.producer_state import delete_snapshots
from cursus.storage.segment import (
    COMPACTED_SUFFIX,
    INDEX_SUFFIX,
    LOG_SUFFIX,
    Segment,
    WindowReader,
    parse_file_base_offset,
)
from cursus.storage.swap import finish_interrupted_swaps, read_compacted_next_offset

logger = logging.getLogger("cursus.storage")

#: Marker of an in-progress :meth:`PartitionLog.reset`; recovery pass 1 completes the reset.
RESET_MARKER_FILE_NAME = "reset.pending"
#: Read size while validating every chunk (bodies are read anyway).
VALIDATE_WINDOW_BYTES = 4 * 1024 * 1024
#: Read size while walking headers only (bounded waste when chunks are large).
HEADER_WINDOW_BYTES = 64 * 1024
#: Block size while scanning for a later valid chunk after a bad one.
SCAN_BLOCK_BYTES = 1024 * 1024
_MAGIC_BYTES = MAGIC.to_bytes(4, "big")


@dataclass(slots=True)
class RecoveryStats:
    """What recovery did, for logs and metrics."""

    clean_shutdown_trusted: bool = False
    segments: int = 0
    segments_validated: int = 0
    chunks_validated: int = 0
    bytes_validated: int = 0
    bytes_truncated: int = 0
    segments_deleted: int = 0
    indexes_rebuilt: int = 0
    temp_files_removed: int = 0
    epochs_repaired: int = 0
    #: Offset of the producer-state snapshot the rebuild started from, and the chunks it read after it.
    producer_snapshot_offset: int = 0
    producer_chunks_replayed: int = 0
    duration_ms: float = 0.0


@dataclass(slots=True)
class RecoveredLog:
    """The outcome of :func:`recover_partition`: open segments (indexes loaded) and restored offsets."""

    segments: list[Segment]
    end_offset: int
    log_start_offset: int
    hwm: int
    leader_epochs: list[tuple[int, int]]
    stats: RecoveryStats = field(default_factory=RecoveryStats)


@dataclass(slots=True)
class _Walk:
    """Result of walking a segment's chunks from some position."""

    end_position: int
    next_offset: int
    entries: list[tuple[int, int]]
    chunks: int = 0
    first_append_time_ms: int | None = None
    last_append_time_ms: int | None = None
    last_chunk_position: int | None = None
    bad_position: int | None = None
    bad_reason: str = ""
    #: The bad chunk is intact but breaks the leader-epoch lineage: corruption wherever it is.
    bad_is_fatal: bool = False
    #: Leader epoch of the last chunk walked (starts at the walk's ``min_epoch``).
    last_epoch: int = -1
    #: ``(epoch, base_offset)`` of the first chunk walked and of each chunk whose epoch changes.
    epochs: list[tuple[int, int]] = field(default_factory=list)


def _walk(segment: Segment, start_position: int, start_offset: int, file_size: int, *,
          verify: bool, index_interval_bytes: int, min_epoch: int) -> _Walk:
    """Walk chunks from ``start_position`` (expected to hold offset ``start_offset``) to ``file_size``.

    With ``verify`` every chunk's CRC and records section are checked, else only header sanity and offset
    continuity. Leader epochs must not decrease (from ``min_epoch``, the epoch of the chunk before).
    Index entries for chunks after ``start_position`` are collected following the interval rule. Stops at
    the first invalid chunk (``bad_position``).
    """
    window = WindowReader(segment, VALIDATE_WINDOW_BYTES if verify else HEADER_WINDOW_BYTES)
    walk = _Walk(end_position=start_position, next_offset=start_offset, entries=[], last_epoch=min_epoch)
    last_index_position = start_position
    position = start_position
    while position < file_size:
        view = window.view(position, HEADER_SIZE)
        header = None if view is None else decode_header(view, 0)
        reason = ""
        if header is None:
            reason = "truncated chunk header" if view is None else "invalid chunk header"
        elif header.base_offset != walk.next_offset and not (
                segment.allows_gaps and header.base_offset > walk.next_offset):
            reason = f"chunk base offset {header.base_offset} does not continue the log"
        elif header.base_offset - segment.base_offset > U32_MAX:
            reason = "chunk base offset too far from the segment base offset"
        elif position + header.size_bytes > file_size:
            reason = "chunk extends past the end of the file"
        elif verify:
            view = window.view(position, header.size_bytes)
            if view is None or not crc_matches(view, 0, header):
                reason = "CRC32C mismatch"
            elif not records_walk_ok(view[HEADER_SIZE:], header.record_count):
                reason = "records section does not match the record count"
        if not reason and header is not None and header.leader_epoch < walk.last_epoch:
            reason = (f"leader epoch {header.leader_epoch} is below the epoch {walk.last_epoch} of the chunk "
                      f"before it")
            walk.bad_is_fatal = True
        if reason:
            walk.bad_position, walk.bad_reason = position, reason
            return walk
        assert header is not None
        if position - last_index_position >= index_interval_bytes:
            walk.entries.append((header.base_offset - segment.base_offset, position))
            last_index_position = position
        if position == 0:
            walk.first_append_time_ms = header.append_time_ms
        walk.last_append_time_ms = header.append_time_ms
        walk.last_chunk_position = position
        if not walk.epochs or header.leader_epoch != walk.last_epoch:
            walk.epochs.append((header.leader_epoch, header.base_offset))
            walk.last_epoch = header.leader_epoch
        walk.chunks += 1
        position += header.size_bytes
        walk.end_position = position
        walk.next_offset = header.next_offset
    if segment.compacted_next_offset is not None:
        # A cleaned segment may end in a gap (its marker holds its end); after a truncation into it, it is the
        # active segment and appends may have gone past the marker.
        walk.next_offset = max(walk.next_offset, segment.compacted_next_offset)
    return walk


def _load_segment(segment: Segment, index_interval_bytes: int, stats: RecoveryStats, min_epoch: int) -> _Walk:
    """Load a segment whose data is trusted: read its index and walk headers after the last entry.

    A missing or insane index (or one whose last entry does not point at a matching chunk) is rebuilt by
    walking all headers; a short one is completed. Installs ``segment.index`` unless the walk failed.
    """
    file_size = segment.size_bytes
    entries = OffsetIndex.read_entries(segment.index_path, file_size)
    start_position, start_offset = 0, segment.base_offset
    if entries:
        relative_offset, position = entries[-1]
        header = segment.read_header(position)
        if header is None or header.base_offset != segment.base_offset + relative_offset:
            entries = None
        else:
            start_position, start_offset = position, header.base_offset
    walk = _walk(segment, start_position, start_offset, file_size, verify=False,
                 index_interval_bytes=index_interval_bytes, min_epoch=min_epoch)
    if walk.bad_position is not None:
        return walk
    rewrite = entries is None or bool(walk.entries)
    if rewrite:
        stats.indexes_rebuilt += 1
    segment.index = OffsetIndex(segment.index_path, segment.base_offset, index_interval_bytes,
                                (entries or []) + walk.entries, rewrite=rewrite)
    _install_walk(segment, walk)
    return walk


def _validate_segment(segment: Segment, expected_offset: int, index_interval_bytes: int,
                      stats: RecoveryStats, min_epoch: int) -> _Walk:
    """Validate every chunk of ``segment`` from byte 0 (which must hold ``expected_offset``)."""
    file_size = segment.size_bytes
    if segment.base_offset != expected_offset:
        return _Walk(0, expected_offset, [], bad_position=0,
                     bad_reason=f"segment base offset {segment.base_offset} does not continue the log")
    walk = _walk(segment, 0, expected_offset, file_size, verify=True, index_interval_bytes=index_interval_bytes,
                 min_epoch=min_epoch)
    stats.segments_validated += 1
    stats.chunks_validated += walk.chunks
    stats.bytes_validated += walk.end_position
    return walk


def _install_walk(segment: Segment, walk: _Walk) -> None:
    segment.size_bytes = walk.end_position
    segment.next_offset = walk.next_offset
    segment.last_append_time_ms = walk.last_append_time_ms
    # None (unknown) unless the walk started at byte 0; the log reads it lazily when it needs it.
    segment.first_append_time_ms = walk.first_append_time_ms


def _install_index(segment: Segment, entries: list[tuple[int, int]], index_interval_bytes: int,
                   stats: RecoveryStats) -> None:
    """Install the index built by a validation walk, rewriting the file only if it differs."""
    on_disk = OffsetIndex.read_entries(segment.index_path, segment.size_bytes + 1)
    rewrite = on_disk != entries
    if rewrite:
        stats.indexes_rebuilt += 1
    segment.index = OffsetIndex(segment.index_path, segment.base_offset, index_interval_bytes, entries,
                                rewrite=rewrite)


def _find_valid_chunk(segments: list[Segment], first: int, position: int) -> tuple[Segment, int] | None:
    """The first position at or after ``position`` in ``segments[first]``, or anywhere in a later segment,
    holding a valid chunk (plausible header and matching CRC, whatever its offset)."""
    for number in range(first, len(segments)):
        segment = segments[number]
        file_size = os.fstat(segment.fd).st_size
        block_start = position if number == first else 0
        while block_start + HEADER_SIZE <= file_size:
            block = segment.read(block_start, SCAN_BLOCK_BYTES + HEADER_SIZE - 1)
            found = block.find(_MAGIC_BYTES)
            while 0 <= found < SCAN_BLOCK_BYTES:
                header = decode_header(block, found)
                chunk_position = block_start + found
                if header is not None and chunk_position + header.size_bytes <= file_size:
                    chunk = segment.read(chunk_position, header.size_bytes)
                    if len(chunk) == header.size_bytes and crc_matches(chunk, 0, header):
                        return segment, chunk_position
                found = block.find(_MAGIC_BYTES, found + 1)
            block_start += SCAN_BLOCK_BYTES
    return None


# ---------------------------------------------------------------------------------------- pass 1 and 2


def write_reset_marker(directory: Path, new_start_offset: int, leader_epochs: list[tuple[int, int]]) -> None:
    """Durably record that a reset to ``new_start_offset`` is in progress, leaving the leader-epoch history
    ``leader_epochs`` (see pass 1)."""
    document = {"new_start_offset": new_start_offset, "leader_epochs": [list(e) for e in leader_epochs]}
    atomic_write(directory / RESET_MARKER_FILE_NAME, json.dumps(document).encode() + b"\n", mode=0o644)


def reset_leader_epochs(epochs: list[tuple[int, int]], new_start_offset: int) -> list[tuple[int, int]]:
    """Leader epochs after a reset: the latest epoch, starting at the new start offset."""
    return [(epochs[-1][0], new_start_offset)] if epochs else []


def _segment_bases(directory: Path, suffix: str) -> list[int]:
    bases = []
    for name in os.listdir(directory):
        base = parse_file_base_offset(name, suffix)
        if base is not None:
            bases.append(base)
    return sorted(bases)


def _pass1_cleanup(directory: Path, checkpoint: Checkpoint | None, stats: RecoveryStats) -> Checkpoint | None:
    """Remove temp files and orphan indexes; complete an interrupted reset. Returns the checkpoint."""
    for name in os.listdir(directory):
        if name.endswith(TEMP_SUFFIX):
            (directory / name).unlink(missing_ok=True)
            stats.temp_files_removed += 1
    log_bases = set(_segment_bases(directory, LOG_SUFFIX))
    for base in _segment_bases(directory, INDEX_SUFFIX):
        if base not in log_bases:
            (directory / f"{base:020d}{INDEX_SUFFIX}").unlink(missing_ok=True)
    stats.temp_files_removed += finish_interrupted_swaps(directory)
    marker = directory / RESET_MARKER_FILE_NAME
    if not marker.exists():
        return checkpoint
    try:
        document = json.loads(marker.read_text())
        new_start_offset = int(document["new_start_offset"])
        epochs = [(int(epoch), int(start)) for epoch, start in document["leader_epochs"]]
    except (ValueError, KeyError, TypeError) as error:
        raise CorruptLogError(marker, None, None, f"invalid reset marker: {error}") from error
    logger.warning("%s: completing an interrupted reset to offset %d", directory, new_start_offset)
    delete_snapshots(directory)
    for base in sorted(log_bases, reverse=True):
        (directory / f"{base:020d}{LOG_SUFFIX}").unlink(missing_ok=True)
        (directory / f"{base:020d}{INDEX_SUFFIX}").unlink(missing_ok=True)
        (directory / f"{base:020d}{COMPACTED_SUFFIX}").unlink(missing_ok=True)
        stats.segments_deleted += 1
    Segment.create(directory, new_start_offset, 1).close()
    checkpoint = Checkpoint(new_start_offset, new_start_offset, new_start_offset, tuple(epochs))
    write_checkpoint(directory, checkpoint)
    marker.unlink()
    fsync_dir(directory)
    return checkpoint


def _pass2_open_segments(directory: Path, checkpoint: Checkpoint | None, stats: RecoveryStats) -> list[Segment]:
    """Open every segment, after deleting those wholly below the checkpointed log start offset."""
    bases = _segment_bases(directory, LOG_SUFFIX)
    if checkpoint is not None:
        while len(bases) > 1 and bases[1] <= checkpoint.log_start_offset:
            logger.info("%s: deleting segment %d below the log start offset", directory, bases[0])
            (directory / f"{bases[0]:020d}{LOG_SUFFIX}").unlink()
            (directory / f"{bases[0]:020d}{INDEX_SUFFIX}").unlink(missing_ok=True)
            finish_interrupted_swaps(directory)  # its .compacted marker is an orphan now
            stats.segments_deleted += 1
            bases.pop(0)
    if not bases:
        if checkpoint is not None and checkpoint.recovery_point > checkpoint.log_start_offset:
            raise CorruptLogError(directory, None, checkpoint.log_start_offset,
                                  f"no segment files, but offsets up to {checkpoint.recovery_point} "
                                  f"were checkpointed as durable")
        start = checkpoint.log_start_offset if checkpoint is not None else 0
        Segment.create(directory, start, 1).close()
        # A new log: make the segment's entry and the (maybe just created) directory chain durable.
        fsync_dir(directory)
        fsync_dir(directory.parent)
        fsync_dir(directory.parent.parent)
        bases = [start]
    segments: list[Segment] = []
    try:
        for base in bases:
            segments.append(Segment.open_existing(directory, base))
            segments[-1].compacted_next_offset = read_compacted_next_offset(directory, base)
    except BaseException:
        for segment in segments:
            segment.close()
        raise
    return segments


# --------------------------------------------------------------------------------------- pass 3 to 6


def _load_trusted(segments: list[Segment], checkpoint: Checkpoint, index_interval_bytes: int,
                  stats: RecoveryStats) -> int | None:
    """Clean-shutdown path. Returns the end offset, or ``None`` when anything disagrees with the checkpoint
    (then the caller runs the unclean path from scratch)."""
    expected = segments[0].base_offset
    last_chunk_position: int | None = None
    epoch = -1
    for segment in segments:
        if segment.base_offset != expected:
            return None
        walk = _load_segment(segment, index_interval_bytes, stats, epoch)
        if walk.bad_position is not None:
            return None
        expected = walk.next_offset
        epoch = walk.last_epoch
        last_chunk_position = walk.last_chunk_position
    if expected != checkpoint.recovery_point:
        return None
    last = segments[-1]
    if last.size_bytes > 0:
        if last_chunk_position is None:
            return None
        header = last.read_header(last_chunk_position)
        if header is None or header.next_offset != expected:
            return None
        if not crc_matches(last.read(last_chunk_position, header.size_bytes), 0, header):
            return None
    return expected


def _reset_segments(segments: list[Segment]) -> None:
    """Forget what a failed trusted load installed (indexes), so the unclean path starts from scratch."""
    for segment in segments:
        if segment.index is not None:
            segment.index.close()
            segment.index = None
        segment.size_bytes = os.fstat(segment.fd).st_size
        segment.next_offset = segment.base_offset


@dataclass(slots=True)
class _Unclean:
    """What the unclean path found: the end of valid data and the epochs of the validated chunks."""

    end_offset: int
    observed_from: int
    observed_epochs: list[tuple[int, int]]


def _recover_unclean(directory: Path, segments: list[Segment], checkpoint: Checkpoint | None,
                     index_interval_bytes: int, stats: RecoveryStats) -> _Unclean:
    """Unclean path (passes 3 to 6). Mutates ``segments`` (torn-tail deletions)."""
    recovery_point = checkpoint.recovery_point if checkpoint is not None else None
    first_validated = 0
    if recovery_point is not None:
        first_validated = max(0, bisect_right([s.base_offset for s in segments], recovery_point) - 1)
    expected = segments[0].base_offset
    epoch = -1
    for segment in segments[:first_validated]:
        if segment.base_offset != expected:
            raise CorruptLogError(segment.path, 0, expected,
                                  f"segment base offset {segment.base_offset} does not continue the log "
                                  f"(below the recovery point {recovery_point})")
        walk = _load_segment(segment, index_interval_bytes, stats, epoch)
        if walk.bad_position is not None:
            raise CorruptLogError(segment.path, walk.bad_position, walk.next_offset,
                                  f"{walk.bad_reason} (below the recovery point {recovery_point})")
        expected = walk.next_offset
        epoch = walk.last_epoch
    observed_from = expected
    observed: list[tuple[int, int]] = []
    validated: list[Segment] = []
    number = first_validated
    while number < len(segments):
        segment = segments[number]
        walk = _validate_segment(segment, expected, index_interval_bytes, stats, epoch)
        if walk.bad_position is not None:
            _handle_bad_chunk(directory, segments, number, walk, recovery_point, stats)
        if number < len(segments):  # the segment survived (a torn tail may have emptied and removed it)
            _install_walk(segment, walk)
            _install_index(segment, walk.entries, index_interval_bytes, stats)
            validated.append(segment)
            expected = walk.next_offset
            epoch = walk.last_epoch
            observed.extend(walk.epochs)
        number += 1
    if recovery_point is not None and expected < recovery_point:
        last = segments[-1]
        raise CorruptLogError(last.path, last.size_bytes, expected,
                              f"the log ends at offset {expected} but offsets up to the recovery point "
                              f"{recovery_point} were durable: data is missing")
    for segment in validated:
        segment.sync()
    fsync_dir(directory)
    return _Unclean(expected, observed_from, observed)


def _handle_bad_chunk(directory: Path, segments: list[Segment], number: int, walk: _Walk,
                      recovery_point: int | None, stats: RecoveryStats) -> None:
    """Pass 4: decide torn tail (cut it) versus corruption (raise) for the first invalid chunk."""
    segment = segments[number]
    assert walk.bad_position is not None
    position, offset = walk.bad_position, walk.next_offset
    if walk.bad_is_fatal:
        raise CorruptLogError(segment.path, position, offset, walk.bad_reason)
    if recovery_point is not None and offset < recovery_point:
        raise CorruptLogError(segment.path, position, offset,
                              f"{walk.bad_reason} below the recovery point {recovery_point}")
    found = _find_valid_chunk(segments, number, position)
    if found is not None:
        found_segment, found_position = found
        raise CorruptLogError(segment.path, position, offset,
                              f"{walk.bad_reason}, but a valid chunk follows at byte position "
                              f"{found_position} of {found_segment.path}: corruption, not a torn write")
    file_size = os.fstat(segment.fd).st_size
    logger.warning("%s: torn tail at byte position %d (offset %d, %s): truncating %d bytes and %d later "
                   "segment(s)", segment.path, position, offset, walk.bad_reason, file_size - position,
                   len(segments) - number - 1)
    for later in reversed(segments[number + 1:]):
        stats.bytes_truncated += os.fstat(later.fd).st_size
        stats.segments_deleted += 1
        later.unlink()
        later.close()
    if len(segments) > number + 1:
        fsync_dir(directory)  # unlinks durable before the cut, as in PartitionLog.truncate_to
    del segments[number + 1:]
    stats.bytes_truncated += file_size - position
    segment.truncate(position)
    segment.sync()
    if position == 0 and number > 0:
        segment.unlink()
        segment.close()
        stats.segments_deleted += 1
        del segments[number]
    fsync_dir(directory)


def recover_partition(directory: Path, index_interval_bytes: int, *, clean_shutdown: bool) -> RecoveredLog:
    """Run recovery passes 1 to 6 on the partition directory (created if missing).

    Returns:
        the open segments (contiguous, indexes loaded), the end of valid data and the restored
        ``log_start_offset``, ``hwm`` and ``leader_epochs``. The caller writes the new checkpoint.

    Raises:
        CorruptLogError: corruption of data that must not be dropped (see the module docstring).
        UnsupportedFormatError: a checkpoint of an unknown version.
        OSError: an I/O error.
    """
    started = time.monotonic()
    stats = RecoveryStats()
    directory.mkdir(parents=True, exist_ok=True)
    checkpoint = read_checkpoint(directory)
    checkpoint = _pass1_cleanup(directory, checkpoint, stats)
    segments = _pass2_open_segments(directory, checkpoint, stats)
    observed_from: int | None = None
    observed: list[tuple[int, int]] = []
    try:
        end_offset = None
        if clean_shutdown and checkpoint is not None:
            end_offset = _load_trusted(segments, checkpoint, index_interval_bytes, stats)
            if end_offset is None:
                logger.warning("%s: clean shutdown marker present but the checkpoint disagrees with the "
                               "data; validating", directory)
                _reset_segments(segments)
            else:
                stats.clean_shutdown_trusted = True
        if end_offset is None:
            unclean = _recover_unclean(directory, segments, checkpoint, index_interval_bytes, stats)
            end_offset, observed_from, observed = unclean.end_offset, unclean.observed_from, unclean.observed_epochs
        checkpointed = checkpoint.leader_epochs if checkpoint is not None else ()
        try:
            epochs = rebuild_epochs(checkpointed, observed_from, observed, end_offset)
        except ValueError as error:
            raise CorruptLogError(directory, None, None, f"leader epochs: {error}") from None
    except BaseException:
        for segment in segments:
            segment.close()
        raise
    stats.segments = len(segments)
    log_start_offset = segments[0].base_offset
    hwm = log_start_offset
    if checkpoint is not None:
        log_start_offset = min(max(checkpoint.log_start_offset, log_start_offset), end_offset)
        hwm = min(max(checkpoint.hwm, log_start_offset), end_offset)
    stats.epochs_repaired = len(set(epochs) - set(checkpointed))
    if stats.epochs_repaired and checkpoint is not None:
        logger.warning("%s: %d leader epoch(s) missing from the checkpoint were rebuilt from chunk headers",
                       directory, stats.epochs_repaired)
    epochs = truncate_from_start(epochs, log_start_offset)
    stats.duration_ms = (time.monotonic() - started) * 1000.0
    return RecoveredLog(segments, end_offset, log_start_offset, hwm, epochs, stats)


assert HEADER.size == HEADER_SIZE
