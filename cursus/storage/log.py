"""PartitionLog: one partition replica's local log, a list of segments in one directory.

Directory ``topics/<topic>/<partition>/``::

    <base:020d>.log      chunks back to back (cursus.storage.chunk)
    <base:020d>.index    sparse offset index (cursus.storage.offset_index), derived data
    checkpoints.json     recovery point, log start offset, HWM, leader epochs (cursus.storage.checkpoint)
    reset.pending        present only while a reset is in progress

Offsets (half-open, Kafka style): ``log_start_offset <= durable_end_offset <= log_end_offset``.
``log_end_offset`` (LEO) is the next offset to write; everything below ``durable_end_offset`` is fsynced.
Reads never go past ``durable_end_offset``, so they never serve bytes a crash could take back.

Thread-safety: appends, flush, truncation, reset, retention, checkpoints and close run on one thread
(the writer thread). :meth:`PartitionLog.read`, :meth:`segments_info`, :meth:`size_bytes`,
:meth:`set_hwm` and the read-only properties may be called from another thread (the event loop)
concurrently. An internal lock guards the segment list and the offsets; disk reads and writes happen
outside it. Readers *pin* the segment they read, so a segment deleted (or the log closed) meanwhile keeps
its file descriptor open until the last reader is done (no read ever hits a closed or reused descriptor).
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from cursus.storage import faults
from cursus.storage.atomic import fsync_dir
from cursus.storage.checkpoint import Checkpoint, write_checkpoint
from cursus.storage.chunk import (
    CHUNK_BODY_BYTES_MAX,
    HEADER_SIZE,
    LEADER_EPOCH_MAX,
    RECORD_LENGTH_SIZE,
    Buffer,
    ChunkHeader,
    buffer_size_bytes,
    crc_matches,
    cut_records,
    encode_header,
    records_walk_ok,
    skip_records,
)
from cursus.storage.epochs import EpochEnd, end_offset_for_epoch, truncate_from_end, truncate_from_start
from cursus.storage.errors import CorruptLogError, OffsetOutOfRange, StorageFencedError, invariant
from cursus.storage.offset_index import U32_MAX, OffsetIndex
from cursus.storage.producer_state import (
    ProducerState,
    delete_snapshots,
    load_latest_snapshot,
    write_snapshot,
)
from cursus.storage.recovery import (
    RESET_MARKER_FILE_NAME,
    RecoveryStats,
    recover_partition,
    reset_leader_epochs,
    write_reset_marker,
)
from cursus.storage.segment import Segment, WindowReader
from cursus.storage.swap import commit_swap, discard_cleaned, finish_swap, write_compacted_marker

logger = logging.getLogger("cursus.storage")

#: Largest segment: chunk positions are u32 in the index, and a chunk starts below ``segment_bytes``.
SEGMENT_BYTES_MAX = (1 << 31) - 1
#: Smallest read-ahead of a read. The read-ahead is sized from ``max_bytes`` and ``max_records`` times the
#: segment's average record size, so one pread usually covers the index gap, the chunks and the reply.
READ_AHEAD_BYTES_MIN = 16 * 1024
#: Largest single read-ahead (bounds memory per read; larger replies use one pread per range).
READ_AHEAD_BYTES_MAX = 16 * 1024 * 1024
#: Read size of :meth:`PartitionLog.iter_chunks`.
ITER_READ_BYTES = 1024 * 1024


def wall_clock_ms() -> int:
    """Milliseconds since the epoch (the default ``clock_ms``)."""
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class LogConfig:
    """Per-log settings. Units are in the names.

    Attributes:
        segment_bytes: roll when the active segment would exceed this (a larger single chunk gets a
            segment of its own). At most 2 GiB - 1 (index positions are u32).
        segment_roll_ms: roll when the active segment's first chunk is older than this (checked at append).
        index_interval_bytes: add an index entry once this many log bytes passed since the last one.
        recovery_point_interval_ms: how often the writer thread persists ``checkpoints.json`` for a log it
            touched (off the hot path), plus at close.
        producer_state_ttl_ms: idle time after which a producer's sequence state is dropped (at snapshots).

    Raises:
        ValueError: a value out of range.
    """

    segment_bytes: int = 1 << 30
    segment_roll_ms: int = 7 * 24 * 3600 * 1000
    index_interval_bytes: int = 4096
    recovery_point_interval_ms: int = 1000
    producer_state_ttl_ms: int = 1_800_000

    def __post_init__(self) -> None:
        if not HEADER_SIZE + RECORD_LENGTH_SIZE <= self.segment_bytes <= SEGMENT_BYTES_MAX:
            raise ValueError(f"segment_bytes must be in [{HEADER_SIZE + RECORD_LENGTH_SIZE}, "
                             f"{SEGMENT_BYTES_MAX}], got {self.segment_bytes}")
        if self.segment_roll_ms < 1:
            raise ValueError(f"segment_roll_ms must be >= 1, got {self.segment_roll_ms}")
        if self.index_interval_bytes < 1:
            raise ValueError(f"index_interval_bytes must be >= 1, got {self.index_interval_bytes}")
        if self.recovery_point_interval_ms < 0:
            raise ValueError(f"recovery_point_interval_ms must be >= 0, got {self.recovery_point_interval_ms}")
        if self.producer_state_ttl_ms < 1:
            raise ValueError(f"producer_state_ttl_ms must be >= 1, got {self.producer_state_ttl_ms}")


@dataclass(frozen=True, slots=True)
class ReadResult:
    """Records ``[first_offset, next_offset)`` as a records section (u32 length + bytes, repeated)."""

    first_offset: int
    record_count: int
    records: bytes
    next_offset: int


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """A segment as retention sees it. ``last_append_time_ms`` is ``None`` for an empty segment."""

    base_offset: int
    next_offset: int
    size_bytes: int
    last_append_time_ms: int | None
    is_active: bool
    #: Rewritten by the log cleaner at least once (its chunks may leave offset gaps).
    is_compacted: bool = False


def _chunk_error(expected_offset: int, base_offset: int, record_count: int, body: Buffer,
                 body_length: int, leader_epoch: int, latest_epoch: int) -> AssertionError | None:
    """Why a chunk must not be appended (a programmer error), or ``None``."""
    if base_offset != expected_offset:
        return AssertionError(f"append at offset {base_offset} but the log end offset is {expected_offset}")
    if not latest_epoch <= leader_epoch <= LEADER_EPOCH_MAX:
        return AssertionError(f"chunk leader epoch {leader_epoch} is below the log's latest epoch {latest_epoch} "
                              f"or out of range")
    if record_count < 1:
        return AssertionError(f"record_count must be >= 1, got {record_count}")
    if body_length > CHUNK_BODY_BYTES_MAX:
        return AssertionError(f"chunk body of {body_length} bytes is too large")
    if not records_walk_ok(body, record_count):
        return AssertionError(f"body of {body_length} bytes is not a records section of {record_count} records")
    return None


class _Staged:
    """Chunks staged for one ``pwritev`` into one segment."""

    __slots__ = ("start_position", "end_position", "next_offset", "buffers", "positions", "new_epochs",
                 "first_time_ms", "last_time_ms", "chunks")

    def __init__(self, start_position: int) -> None:
        self.start_position = start_position
        self.end_position = start_position
        self.next_offset = -1
        self.buffers: list[Buffer] = []
        self.positions: list[tuple[int, int]] = []
        #: ``(epoch, start_offset)`` of each staged chunk that starts a new leader epoch.
        self.new_epochs: list[tuple[int, int]] = []
        self.first_time_ms: int | None = None
        self.last_time_ms: int | None = None
        #: ``(base_offset, record_count, body, append_time_ms)`` per staged chunk, for the producer state.
        self.chunks: list[tuple[int, int, Buffer, int]] = []

    def add(self, base_offset: int, record_count: int, header: bytes, body: Buffer, body_length: int,
            time_ms: int) -> None:
        if self.first_time_ms is None:
            self.first_time_ms = time_ms
        self.last_time_ms = time_ms
        self.chunks.append((base_offset, record_count, body, time_ms))
        self.positions.append((base_offset, self.end_position))
        self.buffers.append(header)
        self.buffers.append(body)
        self.end_position += HEADER_SIZE + body_length
        self.next_offset = base_offset + record_count


@dataclass(slots=True)
class _ReadState:
    """Progress of one :meth:`PartitionLog.read`."""

    next_offset: int
    limit_offset: int
    records_left: int
    bytes_left: int
    count: int = 0
    done: bool = False
    #: Offset of the first record taken (moves forward over a cleaned segment's gap while nothing is taken).
    first_offset: int = -1
    #: Take the first record even when it alone exceeds ``bytes_left``.
    at_least_one: bool = True

    def skip_gap(self, to_offset: int) -> None:
        """Nothing was taken yet and the offsets before ``to_offset`` are a cleaned gap: start there."""
        assert self.count == 0 and to_offset >= self.next_offset
        self.next_offset = min(to_offset, self.limit_offset)
        self.first_offset = self.next_offset
        if self.next_offset >= self.limit_offset:
            self.done = True

    def take(self, count: int, size_bytes: int) -> None:
        self.next_offset += count
        self.count += count
        self.records_left -= count
        self.bytes_left -= size_bytes


@dataclass(slots=True)
class _Pin:
    """A pinned segment plus the snapshot a reader works against."""

    segment: Segment
    #: Where to start walking: an indexed chunk at or before the wanted offset, and its base offset.
    position: int
    position_offset: int
    next_offset: int
    truncations: int
    #: Average bytes per record in the segment (chunk headers included), to size read-ahead.
    record_bytes_average: float
    #: The segment's size when pinned (a cleaned segment may end in an offset gap: its walk stops here).
    size_bytes: int = 0


class PartitionLog:
    """One partition replica's local log. Open with :meth:`open`.

    See the module docstring for the directory layout, offsets and thread-safety.
    """

    def __init__(self, directory: Path, config: LogConfig, clock_ms: Callable[[], int],
                 segments: list[Segment], end_offset: int, log_start_offset: int, hwm: int,
                 leader_epochs: list[tuple[int, int]], recovery_stats: RecoveryStats) -> None:
        """Use :meth:`open`; this constructor takes the output of recovery."""
        assert segments and end_offset == segments[-1].next_offset
        self.directory = directory
        self.config = config
        self.recovery_stats = recovery_stats
        self._clock_ms = clock_ms
        self._lock = threading.Lock()
        self._segments = segments
        self._bases = [segment.base_offset for segment in segments]
        self._log_start_offset = log_start_offset
        self._log_end_offset = end_offset
        self._durable_end_offset = end_offset
        self._hwm = hwm
        self._leader_epochs = list(leader_epochs)
        self._failed: BaseException | None = None
        #: Segments written since their last fsync, by base offset, in roll order.
        self._dirty: dict[int, Segment] = {}
        #: A segment file was created since the last directory fsync.
        self._directory_dirty = False
        #: Deleted segments still pinned by readers; closed when the last pin goes.
        self._doomed: list[Segment] = []
        self._last_checkpoint: Checkpoint | None = None
        #: A chunk started a new leader epoch since the last checkpoint: the next flush writes one first.
        self._epochs_dirty = False
        #: Idempotent-producer state of every chunk appended (writer thread), see :attr:`producer_state`.
        self._producer_state = ProducerState(config.producer_state_ttl_ms)
        self._closed = False
        #: Some segment was rewritten by the log cleaner (see :meth:`has_compacted_segments`).
        self._has_compacted = any(segment.allows_gaps for segment in segments)

    @classmethod
    def open(cls, directory: Path, config: LogConfig, *, clean_shutdown: bool = False,
             clock_ms: Callable[[], int] = wall_clock_ms) -> PartitionLog:
        """Recover (see :mod:`cursus.storage.recovery`) and open the log in ``directory`` (created if
        missing), then write a fresh ``checkpoints.json``.

        Args:
            clean_shutdown: the log dir had a clean-shutdown marker; recovery may trust the checkpoint.
            clock_ms: wall clock in ms (injected by tests), for append times and time-based rolls.

        Raises:
            CorruptLogError: corruption of data that must not be dropped (names file, position, offset).
            UnsupportedFormatError: a checkpoint of an unknown version.
            OSError: an I/O error.
        """
        recovered = recover_partition(Path(directory), config.index_interval_bytes,
                                      clean_shutdown=clean_shutdown)
        log = cls(Path(directory), config, clock_ms, recovered.segments, recovered.end_offset,
                  recovered.log_start_offset, recovered.hwm, recovered.leader_epochs, recovered.stats)
        try:
            log.checkpoint()
            log._rebuild_producer_state(log.log_end_offset)
        except BaseException:
            log._close_files()
            raise
        stats = recovered.stats
        logger.info("opened %s: offsets [%d, %d), %d segments, trusted=%s, validated %d chunks, "
                    "truncated %d bytes in %.1f ms", directory, log.log_start_offset, log.log_end_offset,
                    stats.segments, stats.clean_shutdown_trusted, stats.chunks_validated,
                    stats.bytes_truncated, stats.duration_ms)
        return log

    # ---------------------------------------------------------------------------------- properties

    @property
    def log_start_offset(self) -> int:
        """First retained offset."""
        return self._log_start_offset

    @property
    def log_end_offset(self) -> int:
        """LEO: the next offset to be written (chunks below it are written, maybe not fsynced)."""
        return self._log_end_offset

    @property
    def durable_end_offset(self) -> int:
        """Every offset below this is fsynced."""
        return self._durable_end_offset

    @property
    def replicable_end_offset(self) -> int:
        """Chunks below this may be served to followers (:meth:`iter_stored_chunks` with
        ``written=True``): every written chunk, fsynced or not (they are in the file, so in the page cache),
        except under the ``lose_unsynced`` test fault, whose unsynced bytes are not in the file yet."""
        active = faults.ACTIVE
        if active is not None and active.lose_unsynced:
            return self._durable_end_offset
        return self._log_end_offset

    @property
    def hwm(self) -> int:
        """Last HWM set by the broker (restored from the checkpoint at open, capped at the LEO)."""
        return self._hwm

    @property
    def leader_epoch(self) -> int:
        """Latest leader epoch in the history (0 for a new log): the epoch of the last chunk appended."""
        return self._leader_epochs[-1][0] if self._leader_epochs else 0

    @property
    def leader_epochs(self) -> list[tuple[int, int]]:
        """The leader-epoch history ``[(epoch, start_offset), ...]`` (a copy), see :mod:`cursus.storage.epochs`."""
        with self._lock:
            return list(self._leader_epochs)

    def end_offset_for_epoch(self, epoch: int) -> EpochEnd:
        """OffsetsForLeaderEpoch (Kafka semantics, see :func:`cursus.storage.epochs.end_offset_for_epoch`):
        ``(largest epoch <= epoch, its end offset)``, the end being the next epoch's start or the LEO;
        ``(-1, -1)`` for an epoch above every known one. Any thread."""
        with self._lock:
            return end_offset_for_epoch(self._leader_epochs, epoch, self._log_end_offset)

    @property
    def producer_state(self) -> ProducerState:
        """Idempotent-producer state of the chunks appended so far. Owned by the writer thread: read it
        only while no append runs (at open, to copy it)."""
        return self._producer_state

    def has_compacted_segments(self) -> bool:
        """True when a segment may have been rewritten by the log cleaner (reads may meet offset gaps); it
        stays true after retention removed such segments, until a reset. Any thread, lock-free."""
        return self._has_compacted

    @property
    def is_closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def failed(self) -> BaseException | None:
        """The write or fsync error that fenced this log, or ``None``."""
        return self._failed

    # -------------------------------------------------------------------------------------- append

    def append_chunk(self, base_offset: int, record_count: int, body: Buffer,
                     append_time_ms: int | None = None, *, leader_epoch: int | None = None) -> None:
        """Append one chunk (no fsync). Writer thread only.

        Rolls the segment first when the chunk would push the active segment past ``segment_bytes``, or its
        first chunk is older than ``segment_roll_ms``. Then writes header + body with one ``pwritev``,
        updates the index and advances :attr:`log_end_offset`.

        Args:
            base_offset: must equal :attr:`log_end_offset` (assertion).
            record_count: >= 1; ``body`` must walk to exactly this many records (assertion).
            body: the records section, offsets already stamped by the broker.
            append_time_ms: stored in the header; defaults to ``clock_ms()``.
            leader_epoch: stored in the header; defaults to :attr:`leader_epoch`. Must be >= it (assertion);
                a higher epoch starts a new entry of the history at ``base_offset``, made durable by the
                next :meth:`flush` before it moves :attr:`durable_end_offset`.

        Raises:
            AssertionError: a precondition above does not hold (nothing is written).
            StorageFencedError: the log is fenced by an earlier error.
            OSError: the write failed; the log is now fenced.
        """
        error = self.append_chunks([(base_offset, record_count, body, leader_epoch, append_time_ms)])[0]
        if error is not None:
            raise error

    def append_chunks(self, chunks: Sequence[tuple[int, int, Buffer, int | None, int | None]]
                      ) -> list[AssertionError | None]:
        """Append several chunks ``(base_offset, record_count, body, leader_epoch, append_time_ms)`` (``None``:
        the defaults of :meth:`append_chunk`) in order, exactly as that many
        :meth:`append_chunk` calls would, but with one ``pwritev`` per segment touched and one index write
        (the writer thread's batch path: fewer syscalls, fewer GIL hand-offs). Writer thread only.

        Returns:
            per chunk, ``None`` when appended or the ``AssertionError`` that rejected it (a programmer
            error: wrong base offset, bad records section). A rejected chunk does not advance the offset.

        Raises:
            StorageFencedError: the log is fenced by an earlier error.
            OSError: a write failed; the log is now fenced (chunks staged before a roll may be appended).
        """
        self._check_writable()
        now_ms = self._clock_ms()
        errors: list[AssertionError | None] = []
        expected_offset = self._log_end_offset
        latest_epoch = self._leader_epochs[-1][0] if self._leader_epochs else -1
        segment = self._segments[-1]
        staged = _Staged(segment.size_bytes)
        try:
            for base_offset, record_count, body, chunk_epoch, append_time_ms in chunks:
                time_ms = now_ms if append_time_ms is None else append_time_ms
                body_length = buffer_size_bytes(body)
                epoch = max(latest_epoch, 0) if chunk_epoch is None else chunk_epoch
                error = _chunk_error(expected_offset, base_offset, record_count, body, body_length, epoch,
                                     latest_epoch)
                errors.append(error)
                if error is not None:
                    continue
                if self._should_roll(segment, staged.end_position, base_offset, body_length, now_ms):
                    self._commit(segment, staged)
                    segment = self._roll(base_offset)
                    staged = _Staged(0)
                staged.add(base_offset, record_count,
                           encode_header(base_offset, record_count, body, time_ms, epoch), body, body_length,
                           time_ms)
                if epoch > latest_epoch:
                    staged.new_epochs.append((epoch, base_offset))
                    latest_epoch = epoch
                expected_offset = base_offset + record_count
            self._commit(segment, staged)
        except OSError as error:
            self.fence(error)
            raise
        return errors

    def _should_roll(self, segment: Segment, size_bytes: int, base_offset: int, body_length: int,
                     now_ms: int) -> bool:
        """Roll before a chunk when the segment (holding ``size_bytes``, staged bytes included) is not
        empty and the chunk would exceed ``segment_bytes``, overflow the u32 relative offset of the index,
        or the segment's first chunk is at least ``segment_roll_ms`` old."""
        if size_bytes == 0:
            return False
        if size_bytes + HEADER_SIZE + body_length > self.config.segment_bytes:
            return True
        if base_offset - segment.base_offset > U32_MAX:
            return True
        if segment.size_bytes == 0:
            return False  # the first chunk is staged in this very batch: it is not old
        if segment.first_append_time_ms is None:
            header = segment.read_header(0)
            segment.first_append_time_ms = None if header is None else header.append_time_ms
        first_ms = segment.first_append_time_ms
        return first_ms is not None and now_ms - first_ms >= self.config.segment_roll_ms

    def _commit(self, segment: Segment, staged: _Staged) -> None:
        """Write the staged chunks to ``segment`` with one pwritev, then publish them."""
        if not staged.positions:
            return
        segment.write(staged.start_position, staged.buffers, staged.end_position - staged.start_position)
        index = segment.index
        assert index is not None
        with self._lock:
            for base_offset, position in staged.positions:
                index.maybe_append(base_offset, position)
            if staged.start_position == 0:
                segment.first_append_time_ms = staged.first_time_ms
            segment.size_bytes = staged.end_position
            segment.next_offset = staged.next_offset
            segment.last_append_time_ms = staged.last_time_ms
            self._log_end_offset = staged.next_offset
            if staged.new_epochs:
                self._leader_epochs.extend(staged.new_epochs)
                self._epochs_dirty = True
        self._dirty[segment.base_offset] = segment
        index.write_pending()
        for base_offset, record_count, body, time_ms in staged.chunks:
            self._producer_state.apply_chunk(base_offset, record_count, body, time_ms)

    def _roll(self, base_offset: int) -> Segment:
        self._snapshot_producer_state(base_offset)
        segment = Segment.create(self.directory, base_offset, self.config.index_interval_bytes)
        with self._lock:
            self._segments.append(segment)
            self._bases.append(base_offset)
        self._directory_dirty = True
        return segment

    # --------------------------------------------------------------------------------------- flush

    def flush(self) -> None:
        """fsync every segment written since the last flush (and the directory if a segment was created),
        write the checkpoint when a chunk started a new leader epoch, then set :attr:`durable_end_offset`
        to :attr:`log_end_offset`. Writer thread only.

        Raises:
            StorageFencedError: the log is fenced by an earlier error.
            OSError: an fsync or the checkpoint failed; the log is now fenced (a failed fsync is never
                retried).
        """
        self._check_writable()
        end_offset = self._log_end_offset
        if self._dirty or self._directory_dirty or self._epochs_dirty:
            try:
                for segment in list(self._dirty.values()):
                    segment.sync()
                if self._directory_dirty:
                    fsync_dir(self.directory)
                if self._epochs_dirty:
                    # Before the new epoch's chunks count as durable (and can be acknowledged).
                    self._write_checkpoint(self._current_checkpoint())
            except OSError as error:
                self.fence(error)
                raise
            self._dirty.clear()
            self._directory_dirty = False
        with self._lock:
            self._durable_end_offset = end_offset

    def skip_gap(self, offset: int) -> None:
        """Continue the log at ``offset`` (> :attr:`log_end_offset`) without records in between: a follower
        copying its leader's cleaned segments, whose chunks keep their offsets and leave gaps (the leader's
        bytes are stored as they are). The active segment becomes one that allows gaps: its ``.compacted``
        marker (written durably first) records ``offset`` as its end, as a cleaned segment ending in a gap
        does, so recovery accepts the gap and a roll continues at ``offset``. The gap counts as durable at
        the next :meth:`flush`. Writer thread only.

        Raises:
            AssertionError: ``offset`` is not above the log end, or too far from the segment base.
            StorageFencedError: the log is fenced; OSError: the marker write failed (the log is then fenced).
        """
        self._check_writable()
        segment = self._segments[-1]
        invariant(offset > self._log_end_offset, f"gap to {offset} does not pass the log end {self._log_end_offset}")
        invariant(offset - segment.base_offset <= U32_MAX, f"gap to {offset} is too far from the segment base")
        try:
            write_compacted_marker(self.directory, segment.base_offset, offset)
        except OSError as error:
            self.fence(error)
            raise
        with self._lock:
            segment.compacted_next_offset = offset
            segment.next_offset = offset
            self._has_compacted = True
            self._log_end_offset = offset
        self._dirty[segment.base_offset] = segment

    # ---------------------------------------------------------------------------------------- read

    def read(self, offset: int, *, max_offset: int, max_records: int, max_bytes: int,
             at_least_one: bool = True) -> ReadResult:
        """Read records from ``offset`` up to (excluding) ``max_offset``. Any thread.

        ``max_offset`` is capped at :attr:`durable_end_offset`. Returns at most ``max_records`` records and
        at most ``max_bytes`` of records section, but at least one record when one is available. Whole
        chunk bodies are copied as they are; length prefixes are walked only in the first chunk (to skip to
        ``offset``) and the last (to cut). Each chunk's CRC is verified. An ``offset`` at or past the
        readable end (up to the LEO) gives an empty result. ``at_least_one=False`` makes ``max_bytes`` strict.

        A result is one contiguous run ``[first_offset, next_offset)``. In a segment rewritten by the log
        cleaner the offsets may have gaps: a read from inside a gap starts at the next stored record
        (``first_offset > offset``), and a read stops before a gap (read on from ``next_offset``). An empty
        result's ``next_offset`` may lie past ``offset`` when only a gap lies in between.

        Raises:
            OffsetOutOfRange: ``offset`` below :attr:`log_start_offset` or above :attr:`log_end_offset`
                (also when a concurrent truncation removed the range being read).
            CorruptLogError: a chunk failed its CRC or header check (never returns wrong bytes).
        """
        invariant(max_records >= 1, f"max_records must be >= 1, got {max_records}")
        invariant(max_bytes >= 0, f"max_bytes must be >= 0, got {max_bytes}")
        with self._lock:
            if offset < self._log_start_offset or offset > self._log_end_offset:
                raise OffsetOutOfRange(self._log_start_offset, self._log_end_offset, offset)
            limit_offset = min(max_offset, self._durable_end_offset)
            if offset >= limit_offset:
                return ReadResult(offset, 0, b"", offset)
            pin = self._pin(offset)
        assert pin is not None
        state = _ReadState(offset, limit_offset, max_records, max_bytes, first_offset=offset,
                           at_least_one=at_least_one)
        parts: list[memoryview] = []
        try:
            while True:
                self._read_segment(pin, state, parts)
                if state.done or state.next_offset >= limit_offset:
                    break
                with self._lock:
                    self._unpin(pin.segment)
                    pin = self._pin(state.next_offset)
                if pin is None:
                    break
        finally:
            if pin is not None:
                with self._lock:
                    self._unpin(pin.segment)
        if state.count == 0:
            return ReadResult(state.next_offset, 0, b"", state.next_offset)
        return ReadResult(state.first_offset, state.count, b"".join(parts), state.next_offset)

    def _pin(self, offset: int) -> _Pin | None:
        """Pin the segment holding ``offset`` and find the index position to start from. Lock held."""
        slot = bisect_right(self._bases, offset) - 1
        if slot < 0:
            return None
        segment = self._segments[slot]
        if offset >= segment.next_offset:
            return None
        assert segment.index is not None
        segment.pins += 1
        record_bytes_average = segment.size_bytes / max(1, segment.next_offset - segment.base_offset)
        position_offset, position = segment.index.lookup(offset)
        return _Pin(segment, position, position_offset, segment.next_offset, segment.truncations,
                    record_bytes_average, segment.size_bytes)

    def _unpin(self, segment: Segment) -> None:
        """Release a pin; close a deleted segment when its last reader leaves. Lock held."""
        segment.pins -= 1
        assert segment.pins >= 0
        if segment.pins == 0 and segment.doomed:
            segment.close()
            if segment in self._doomed:
                self._doomed.remove(segment)

    def _read_segment(self, pin: _Pin, state: _ReadState, parts: list[memoryview]) -> None:
        """Read from one pinned segment into ``parts`` until a limit or the segment's end."""
        slack_bytes = self.config.index_interval_bytes + 2 * HEADER_SIZE
        wanted_bytes = min(state.bytes_left, 1.25 * state.records_left * pin.record_bytes_average)
        readahead = int(min(READ_AHEAD_BYTES_MAX, max(READ_AHEAD_BYTES_MIN, wanted_bytes + slack_bytes)))
        window = WindowReader(pin.segment, readahead)
        position = pin.position
        header = self._header_at(window, pin, position, pin.position_offset)
        while header is not None and header.next_offset <= state.next_offset:  # walk to the first chunk
            position += header.size_bytes
            header = self._header_at(window, pin, position, header.next_offset)
        while True:
            if header is None or header.base_offset > state.next_offset:  # a gap left by the cleaner
                if state.count:
                    state.done = True  # a result is one contiguous run of offsets
                else:
                    state.skip_gap(pin.next_offset if header is None else header.base_offset)
                if header is None or state.done:
                    return
                continue
            chunks, end = self._plan(window, pin, position, header, state)
            data = window.view(position, end - position)
            if data is None:
                self._read_anomaly(pin, position, state.next_offset, "segment shorter than its chunks")
            assert data is not None
            for chunk_position, chunk_header in chunks:
                chunk = data[chunk_position - position:chunk_position - position + chunk_header.size_bytes]
                if not crc_matches(chunk, 0, chunk_header):
                    self._read_anomaly(pin, chunk_position, state.next_offset, "CRC32C mismatch")
                self._take_from_chunk(chunk[HEADER_SIZE:], chunk_header, state, parts)
                if state.done:
                    return
            if state.next_offset >= pin.next_offset:
                return  # segment exhausted; the caller moves to the next one
            position = end
            header = self._header_at(window, pin, position, state.next_offset)

    def _plan(self, window: WindowReader, pin: _Pin, position: int, header: ChunkHeader,
              state: _ReadState) -> tuple[list[tuple[int, ChunkHeader]], int]:
        """Chunks from ``position`` likely needed (bodies estimated whole), and the end of the range."""
        chunks = [(position, header)]
        estimated_records = header.next_offset - state.next_offset
        estimated_bytes = header.body_length
        end = position + header.size_bytes
        while (estimated_records < state.records_left
               and estimated_bytes + RECORD_LENGTH_SIZE <= state.bytes_left
               and header.next_offset < state.limit_offset and header.next_offset < pin.next_offset):
            following = self._header_at(window, pin, end, header.next_offset)
            if following is None or following.base_offset != header.next_offset:
                break  # the end of a cleaned segment, or a gap: the caller stops there
            header = following
            chunks.append((end, header))
            estimated_records += header.record_count
            estimated_bytes += header.body_length
            end += header.size_bytes
        return chunks, end

    def _header_at(self, window: WindowReader, pin: _Pin, position: int,
                   expected_offset: int) -> ChunkHeader | None:
        """The header at ``position``, which must be a chunk starting at ``expected_offset`` (in a cleaned
        segment: at or after it). ``None`` at the end of a cleaned segment whose last offsets are a gap."""
        gaps = pin.segment.allows_gaps
        if gaps and position >= pin.size_bytes:
            return None
        header = window.header(position)
        if header is None:
            self._read_anomaly(pin, position, expected_offset, "invalid chunk header")
        assert header is not None
        if header.base_offset != expected_offset and not (gaps and header.base_offset > expected_offset):
            self._read_anomaly(pin, position, expected_offset,
                               f"chunk base offset {header.base_offset} does not continue the log")
        return header

    @staticmethod
    def _take_from_chunk(body: memoryview, header: ChunkHeader, state: _ReadState,
                         parts: list[memoryview]) -> None:
        """Append the wanted part of one verified chunk body; set ``state.done`` at a limit."""
        start = 0
        if state.next_offset > header.base_offset:
            start = skip_records(body, 0, state.next_offset - header.base_offset)
        available = header.next_offset - state.next_offset
        wanted = min(available, state.records_left, state.limit_offset - state.next_offset)
        if wanted == available and header.body_length - start <= state.bytes_left:
            parts.append(body[start:])
            state.take(wanted, header.body_length - start)
        else:
            end, count = cut_records(body, start, wanted, state.bytes_left,
                                     at_least_one=state.count == 0 and state.at_least_one)
            if count:
                parts.append(body[start:end])
                state.take(count, end - start)
            state.done = True
            return
        if (state.records_left == 0 or state.next_offset >= state.limit_offset
                or state.bytes_left < RECORD_LENGTH_SIZE):
            state.done = True

    def _read_anomaly(self, pin: _Pin, position: int, offset: int, reason: str) -> None:
        """Raise for unexpected bytes: OffsetOutOfRange if a concurrent cut explains them, else corruption."""
        with self._lock:
            raced = (pin.segment.truncations != pin.truncations or offset >= self._log_end_offset
                     or offset < self._log_start_offset)
            earliest, latest = self._log_start_offset, self._log_end_offset
        if raced:
            raise OffsetOutOfRange(earliest, latest, offset)
        raise CorruptLogError(pin.segment.path, position, offset, reason)

    # ------------------------------------------------------------------------------ iterate chunks

    def iter_chunks(self, from_offset: int | None = None) -> Iterator[tuple[int, int, bytes]]:
        """Yield ``(base_offset, record_count, body)`` for every durable chunk from the one holding
        ``from_offset`` (default :attr:`log_start_offset`), CRC-verified; see :meth:`iter_stored_chunks`.

        Raises:
            OffsetOutOfRange: ``from_offset`` outside ``[log_start_offset, durable_end_offset]``.
            CorruptLogError: a chunk failed its checks.
        """
        for header, chunk in self.iter_stored_chunks(from_offset):
            yield header.base_offset, header.record_count, bytes(chunk[HEADER_SIZE:])

    def iter_stored_chunks(self, from_offset: int | None = None, *, written: bool = False
                           ) -> Generator[tuple[ChunkHeader, memoryview], None, None]:
        """Yield ``(header, chunk)`` for every durable chunk from the one holding ``from_offset`` (default
        :attr:`log_start_offset`): ``chunk`` is the stored bytes, header included, CRC-verified (a follower
        re-appends it with the header's leader epoch and append time, which reproduces the same bytes). For rebuilding state and for replication;
        consume it fully or close it (it pins the segment it is reading). Any thread. ``written``: up to
        :attr:`replicable_end_offset` instead (written chunks not yet fsynced too: a leader serving its
        followers).

        Raises:
            OffsetOutOfRange: ``from_offset`` outside ``[log_start_offset, durable_end_offset]`` (or the
                replicable end with ``written``).
            CorruptLogError: a chunk failed its checks.
        """
        with self._lock:
            offset = self._log_start_offset if from_offset is None else from_offset
            end_offset = self.replicable_end_offset if written else self._durable_end_offset
            if offset < self._log_start_offset or offset > end_offset:
                raise OffsetOutOfRange(self._log_start_offset, end_offset, offset)
        while offset < end_offset:
            with self._lock:
                pin = self._pin(offset)
            if pin is None:
                return
            try:
                window = WindowReader(pin.segment, ITER_READ_BYTES)
                position, chunk_offset = pin.position, pin.position_offset
                while offset < min(end_offset, pin.next_offset):
                    header = self._header_at(window, pin, position, chunk_offset)
                    if header is None:  # a cleaned segment ending in a gap
                        offset = pin.next_offset
                        break
                    chunk_offset = header.next_offset
                    if header.next_offset > offset:
                        chunk = window.view(position, header.size_bytes)
                        if chunk is None or not crc_matches(chunk, 0, header):
                            self._read_anomaly(pin, position, offset, "CRC32C mismatch")
                        assert chunk is not None
                        yield header, chunk
                        offset = header.next_offset
                    position += header.size_bytes
            finally:
                with self._lock:
                    self._unpin(pin.segment)

    # ------------------------------------------------------------------------------ producer state

    def _snapshot_producer_state(self, offset: int) -> None:
        """Snapshot the producer state of the chunks below ``offset`` (at a roll, and at close). A failed
        write only costs replay work at the next open, so it is logged, not raised."""
        self._producer_state.expire(self._clock_ms())
        try:
            write_snapshot(self.directory, self._producer_state, offset)
        except OSError as error:
            logger.warning("%s: producer-state snapshot at offset %d not written: %s", self.directory, offset,
                           error)

    def _rebuild_producer_state(self, end_offset: int) -> None:
        """Producer state of the chunks below ``end_offset`` (== the durable end): the latest valid snapshot
        in ``[log_start_offset, end_offset]`` plus the chunks after it. Snapshots outside that range are
        stale (above: their chunks were cut; below: retention) and are deleted."""
        delete_snapshots(self.directory, below=self._log_start_offset, above=end_offset)
        state, offset = load_latest_snapshot(self.directory, self.config.producer_state_ttl_ms,
                                             self._log_start_offset, end_offset)
        replayed = 0
        for header, chunk in self.iter_stored_chunks(offset):
            state.apply_chunk(header.base_offset, header.record_count, chunk[HEADER_SIZE:], header.append_time_ms)
            replayed += 1
        self._producer_state = state
        self.recovery_stats.producer_snapshot_offset = offset
        self.recovery_stats.producer_chunks_replayed = replayed

    # ---------------------------------------------------------------------------------- truncation

    def truncate_to(self, offset: int) -> None:
        """Drop every record at or above ``offset`` (follower divergence, torn tails). Writer thread only.

        Afterwards ``log_end_offset == durable_end_offset == offset`` and everything is fsynced. A cut inside
        a chunk rewrites that chunk's header in place. ``offset >= log_end_offset`` is a no-op; an offset at
        or below the first segment's base (or below the log start) resets the log to start at ``offset``.
        Crash-safe: the checkpoint (recovery point lowered to ``offset``) is written first.

        Raises:
            StorageFencedError: the log is fenced; OSError: an I/O error (the log is then fenced).
        """
        self._check_writable()
        invariant(offset >= 0, f"offset must be >= 0, got {offset}")
        if offset >= self._log_end_offset:
            return
        if offset <= self._segments[0].base_offset or offset < self._log_start_offset:
            self._reset(offset, truncate_from_end(self._leader_epochs, offset))
            return
        try:
            with self._lock:
                epochs = truncate_from_end(self._leader_epochs, offset)
                checkpoint = Checkpoint(min(self._durable_end_offset, offset), self._log_start_offset,
                                        min(self._hwm, offset), tuple(epochs))
            self._write_checkpoint(checkpoint)
            with self._lock:
                slot = bisect_right(self._bases, offset) - 1
                if self._bases[slot] == offset:
                    slot -= 1
                removed = self._segments[slot + 1:]
                kept = self._segments[slot]
                kept.truncations += 1
                self._log_end_offset = offset
                self._durable_end_offset = min(self._durable_end_offset, offset)
                self._hwm = min(self._hwm, offset)
                self._leader_epochs = epochs
            for segment in reversed(removed):
                segment.unlink()
            if removed:
                # The unlinks must be durable before the cut: later segments reappearing after a power cut
                # behind a cut segment would look like corruption (a gap followed by valid chunks).
                fsync_dir(self.directory)
            with self._lock:
                del self._segments[slot + 1:]
                del self._bases[slot + 1:]
                for segment in removed:
                    self._doom(segment)
            self._cut_segment(kept, offset)
            for segment in list(self._dirty.values()):
                segment.sync()
            kept.sync()
            fsync_dir(self.directory)
            self._dirty.clear()
            self._directory_dirty = False
            with self._lock:
                self._durable_end_offset = offset
        except OSError as error:
            self.fence(error)
            raise
        self._rebuild_producer_state(offset)

    def _cut_segment(self, segment: Segment, offset: int) -> None:
        """Cut ``segment`` so that it ends exactly at ``offset`` (which lies inside it)."""
        if segment.next_offset == offset:
            return
        assert segment.base_offset < offset < segment.next_offset and segment.index is not None
        if segment.allows_gaps:  # the cut may fall into a gap: record the new end first
            write_compacted_marker(self.directory, segment.base_offset, offset)
            segment.compacted_next_offset = offset
        window = WindowReader(segment, READ_AHEAD_BYTES_MIN)
        _, position = segment.index.lookup(offset)
        previous_time_ms: int | None = None
        header = window.header(position) if position < segment.size_bytes else None
        while header is not None and header.next_offset <= offset:
            previous_time_ms = header.append_time_ms
            position += header.size_bytes
            header = window.header(position) if position < segment.size_bytes else None
        if segment.allows_gaps and (header is None or header.base_offset >= offset):
            cut_position, last_time_ms = position, previous_time_ms  # cut at a chunk boundary
            segment.truncate(cut_position)
        elif header is None or header.base_offset > offset:
            raise CorruptLogError(segment.path, position, offset, "cannot find the chunk to cut")
        elif header.base_offset == offset:
            assert position > 0  # the segment keeps at least one chunk (its base is below offset)
            cut_position, last_time_ms = position, previous_time_ms
            segment.truncate(cut_position)
        else:
            cut_position = self._cut_inside_chunk(segment, position, header, offset)
            last_time_ms = header.append_time_ms
        with self._lock:
            assert segment.index is not None
            segment.index.truncate_to_position(cut_position)
            segment.size_bytes = cut_position
            segment.next_offset = offset
            segment.last_append_time_ms = last_time_ms

    @staticmethod
    def _cut_inside_chunk(segment: Segment, position: int, header: ChunkHeader, offset: int) -> int:
        """Keep the records of the chunk at ``position`` below ``offset``; returns the new segment end.

        Three durable steps, each leaving a state recovery handles: cut after the chunk (later chunks gone);
        rewrite the header for the shorter body (the old tail records are then a torn tail); cut them off.
        """
        chunk_end = position + header.size_bytes
        segment.truncate(chunk_end)
        segment.sync()
        chunk = segment.read(position, header.size_bytes)
        if len(chunk) != header.size_bytes or not crc_matches(chunk, 0, header):
            raise CorruptLogError(segment.path, position, header.base_offset, "CRC32C mismatch in the chunk to cut")
        body = memoryview(chunk)[HEADER_SIZE:]
        kept_bytes = skip_records(body, 0, offset - header.base_offset)
        new_header = encode_header(header.base_offset, offset - header.base_offset, body[:kept_bytes],
                                   header.append_time_ms, header.leader_epoch)
        segment.overwrite(position, new_header)
        segment.sync()
        cut_position = position + HEADER_SIZE + kept_bytes
        segment.truncate(cut_position)
        return cut_position

    def reset(self, new_start_offset: int = 0) -> None:
        """Delete every segment and start empty at ``new_start_offset`` (the TRUNCATE command).

        Afterwards ``log_start_offset == log_end_offset == durable_end_offset == hwm == new_start_offset``;
        the leader-epoch history keeps only the latest epoch, starting at ``new_start_offset``. Crash-safe:
        a ``reset.pending`` marker is written first and recovery completes an interrupted reset.
        Writer thread only.

        Raises:
            StorageFencedError: the log is fenced; OSError: an I/O error (the log is then fenced).
        """
        self._check_writable()
        invariant(new_start_offset >= 0, f"new_start_offset must be >= 0, got {new_start_offset}")
        self._reset(new_start_offset, reset_leader_epochs(self._leader_epochs, new_start_offset))

    def _reset(self, new_start_offset: int, epochs: list[tuple[int, int]]) -> None:
        """:meth:`reset`, leaving the leader-epoch history ``epochs``."""
        try:
            write_reset_marker(self.directory, new_start_offset, epochs)
            delete_snapshots(self.directory)
            self._producer_state = ProducerState(self.config.producer_state_ttl_ms)
            old_segments = list(self._segments)
            for segment in reversed(old_segments):
                segment.unlink()
            segment = Segment.create(self.directory, new_start_offset, self.config.index_interval_bytes)
            with self._lock:
                self._segments = [segment]
                self._bases = [new_start_offset]
                self._has_compacted = False
                self._log_start_offset = self._log_end_offset = new_start_offset
                self._durable_end_offset = self._hwm = new_start_offset
                self._leader_epochs = epochs
                self._dirty.clear()
                for old in old_segments:
                    old.truncations += 1
                    self._doom(old)
            self._directory_dirty = False
            self._write_checkpoint(self._current_checkpoint())
            (self.directory / RESET_MARKER_FILE_NAME).unlink()
            fsync_dir(self.directory)
        except OSError as error:
            self.fence(error)
            raise

    # ----------------------------------------------------------------------------------- retention

    def segments_info(self) -> list[SegmentInfo]:
        """Every segment, oldest first, for retention decisions. Any thread."""
        with self._lock:
            last = len(self._segments) - 1
            return [SegmentInfo(s.base_offset, s.next_offset, s.size_bytes, s.last_append_time_ms, n == last,
                                s.allows_gaps) for n, s in enumerate(self._segments)]

    def delete_segments_before(self, offset: int) -> int:
        """Delete whole closed segments whose ``next_offset <= offset``; never the active one.

        ``log_start_offset`` advances to the first remaining segment's base, durably: ``checkpoints.json``
        is written before any file is unlinked (recovery finishes an interrupted deletion). Readers of a
        deleted segment keep reading from its open descriptor; offsets below the new start raise
        :class:`OffsetOutOfRange` from then on. Writer thread only.

        Returns:
            the number of segments deleted.

        Raises:
            StorageFencedError: the log is fenced; OSError: an I/O error (the log is then fenced).
        """
        self._check_writable()
        with self._lock:
            count = 0
            while count < len(self._segments) - 1 and self._segments[count + 1].base_offset <= offset:
                count += 1
            if count == 0:
                return 0
            removed = self._segments[:count]
            new_start_offset = max(self._log_start_offset, self._segments[count].base_offset)
            epochs = truncate_from_start(self._leader_epochs, new_start_offset)
            checkpoint = Checkpoint(self._durable_end_offset, new_start_offset,
                                    max(self._hwm, new_start_offset), tuple(epochs))
        try:
            self._write_checkpoint(checkpoint)
            for segment in removed:
                segment.unlink()
            delete_snapshots(self.directory, below=new_start_offset)
            with self._lock:
                del self._segments[:count]
                del self._bases[:count]
                self._log_start_offset = new_start_offset
                self._hwm = max(self._hwm, new_start_offset)
                self._leader_epochs = epochs
                for segment in removed:
                    self._doom(segment)
            fsync_dir(self.directory)
        except OSError as error:
            self.fence(error)
            raise
        return count

    def replace_with_cleaned(self, base_offset: int, old_size_bytes: int, next_offset: int, size_bytes: int,
                             index_entries: Sequence[tuple[int, int]],
                             crash_hook: Callable[[str], None] | None = None) -> bool:
        """Swap the closed segment at ``base_offset`` for its cleaned copy ``<base>.log.cleaned`` (written and
        fsynced by the cleaner, ``size_bytes`` long, chunks at or after ``base_offset`` with gaps allowed,
        ``index_entries`` its sparse index). Writer thread only. Crash-safe, see :mod:`cursus.storage.swap`.

        Readers that pinned the old segment keep reading the old file through its open descriptor (its inode
        outlives the rename); readers pinning afterwards read the new one. Nothing else changes: offsets,
        the LEO, the HWM and the leader epochs stay as they were.

        Returns:
            True when swapped; False (the copy is deleted) when the segment no longer exists, became
            active, or changed size since the cleaner read it (retention or truncation ran meanwhile).

        Raises:
            StorageFencedError: the log is fenced; OSError: an I/O error (the log is then fenced; recovery
                completes or discards the swap).
        """
        self._check_writable()
        with self._lock:
            slot = bisect_right(self._bases, base_offset) - 1
            old = self._segments[slot] if slot >= 0 else None
            usable = (old is not None and old.base_offset == base_offset and slot < len(self._segments) - 1
                      and old.size_bytes == old_size_bytes and old.next_offset == next_offset
                      and self._segments[slot + 1].base_offset == next_offset)
        if not usable or old is None:
            discard_cleaned(self.directory, base_offset)
            return False
        try:
            commit_swap(self.directory, base_offset, next_offset, size_bytes, crash_hook)
            new = Segment.open_existing(self.directory, base_offset)
            try:
                new.size_bytes = size_bytes
                new.next_offset = next_offset
                new.compacted_next_offset = next_offset
                new.last_append_time_ms = old.last_append_time_ms  # retention by time sees the same age
                new.first_append_time_ms = old.first_append_time_ms
                new.index_path.unlink(missing_ok=True)  # the old index object keeps its own inode
                new.index = OffsetIndex(new.index_path, base_offset, self.config.index_interval_bytes,
                                        index_entries, rewrite=True)
                if crash_hook is not None:
                    crash_hook("after_index")
                finish_swap(self.directory, base_offset)
            except BaseException:
                new.close()
                raise
            with self._lock:
                self._segments[slot] = new
                self._has_compacted = True
                self._doom(old)
        except OSError as error:
            self.fence(error)
            raise
        return True

    def _doom(self, segment: Segment) -> None:
        """Mark a removed segment deleted; close it now unless a reader still pins it. Lock held."""
        segment.doomed = True
        if self._dirty.get(segment.base_offset) is segment:
            del self._dirty[segment.base_offset]
        if segment.pins == 0:
            segment.close()
        else:
            self._doomed.append(segment)

    def size_bytes(self) -> int:
        """Total bytes of all segments (chunk data only). Any thread."""
        with self._lock:
            return sum(segment.size_bytes for segment in self._segments)

    # --------------------------------------------------------------------------------- checkpoints

    def set_hwm(self, hwm: int) -> None:
        """Record the HWM; persisted at the next checkpoint. Any thread."""
        invariant(hwm >= 0, f"hwm must be >= 0, got {hwm}")
        self._hwm = hwm

    def checkpoint(self) -> None:
        """Write ``checkpoints.json`` atomically (recovery point = :attr:`durable_end_offset`) unless it
        would be identical to the last one written. Writer thread only.

        Raises:
            OSError: the write failed; the previous checkpoint stays in place.
        """
        checkpoint = self._current_checkpoint()
        if checkpoint != self._last_checkpoint:
            self._write_checkpoint(checkpoint)

    def _current_checkpoint(self) -> Checkpoint:
        with self._lock:
            hwm = min(self._hwm, self._log_end_offset)
            return Checkpoint(self._durable_end_offset, self._log_start_offset, hwm, tuple(self._leader_epochs))

    def _write_checkpoint(self, checkpoint: Checkpoint) -> None:
        write_checkpoint(self.directory, checkpoint)
        self._last_checkpoint = checkpoint
        if checkpoint.leader_epochs == tuple(self._leader_epochs):
            self._epochs_dirty = False

    # -------------------------------------------------------------------------------------- close

    def close(self) -> None:
        """Flush (unless fenced), checkpoint, close every file. Idempotent. Writer thread (or after it
        stopped).

        Raises:
            OSError: the final flush or checkpoint failed (files are closed anyway).
        """
        if self._closed:
            return
        try:
            if self._failed is None:
                self.flush()
                self._snapshot_producer_state(self._log_end_offset)
                self.checkpoint()
        finally:
            self._close_files()

    def _close_files(self) -> None:
        with self._lock:
            self._closed = True
            for segment in self._segments + self._doomed:
                if segment.pins:  # a reader on another thread is inside it: its last unpin closes it
                    segment.doomed = True
                else:
                    segment.close()
            self._doomed = [segment for segment in self._segments + self._doomed if segment.pins]

    def _check_writable(self) -> None:
        invariant(not self._closed, f"log {self.directory} is closed")
        if self._failed is not None:
            raise StorageFencedError(self._failed)

    def fence(self, error: BaseException) -> None:
        """Fence the log after ``error``: every later append, flush or truncation raises
        :class:`StorageFencedError`. Idempotent (the first error is kept). Writer thread only."""
        if self._failed is None:
            self._failed = error
            logger.error("log %s fenced after a storage error: %r", self.directory, error)

    def __repr__(self) -> str:
        return (f"PartitionLog({self.directory}, start={self._log_start_offset}, "
                f"durable={self._durable_end_offset}, end={self._log_end_offset})")
