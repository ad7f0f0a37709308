"""The log cleaner's I/O: one compaction pass over the closed segments of a :class:`PartitionLog`.

A pass (:func:`clean_pass`) runs on the cleaner thread, never on the event loop or the writer thread:

1. *Map*: read every chunk in ``[log_start_offset, end)`` (``end`` = the next offset of the last closed
   segment wholly below ``cleanable_end``) and show each record to the pass's
   :class:`~cursus.storage.compaction.Planner` (default :class:`~cursus.storage.compaction.KeyPlanner`:
   key -> latest offset; ``__consumer_offsets``: the group-aware
   :class:`~cursus.coordinator.offsets_compaction.OffsetsPlanner`).
2. *Copy*: for each such segment, ask the planner which records survive; if any
   record goes, write ``<base>.log.cleaned``: every original chunk's survivors, split into maximal runs of
   consecutive offsets, each run one new chunk (same base offset as its first record, same append time and
   leader epoch as the original chunk, new CRC32C over the new header and body). Record bytes are copied
   unchanged: each stored CBV2 record carries its absolute offset (no offset deltas exist in the format),
   so no record is re-encoded; a chunk that keeps every record is copied as stored. The copy is streamed
   (memory: one chunk) with its sparse index (same interval rule as appends), then fsynced.
3. *Swap*: the caller runs :meth:`PartitionLog.replace_with_cleaned` on the writer thread for each copy
   (crash-safe rename protocol of :mod:`cursus.storage.swap`).

Reads and writes are paced by a :class:`Throttle` (``log_cleaner_io_max_bytes_per_second``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from cursus.storage.atomic import fsync_dir
from cursus.storage.chunk import HEADER_SIZE, RECORD_LENGTH, ChunkHeader, encode_header
from cursus.storage.compaction import KeyPlanner, Planner, RecordInfo, describe_record, runs
from cursus.storage.log import PartitionLog, SegmentInfo
from cursus.storage.swap import cleaned_file_name, discard_cleaned


class PassAborted(Exception):
    """The pass was stopped (broker shutdown); its copies are discarded, nothing was swapped."""


class Throttle:
    """Paces I/O to ``bytes_per_second`` (0: unlimited) by sleeping when ahead of the budget, and stops a
    pass: :meth:`consume` raises :class:`PassAborted` once ``stopped()`` is true.

    ``clock`` (seconds, monotonic) and ``sleep`` are injectable (tests; the broker passes an event's
    ``wait`` so shutdown wakes a throttled pass). Thread-safety: one thread.
    """

    def __init__(self, bytes_per_second: int, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], object] = time.sleep, stopped: Callable[[], bool] | None = None) -> None:
        self.bytes_per_second = bytes_per_second
        self._clock = clock
        self._sleep = sleep
        self._stopped = stopped
        self._start = clock()
        self._bytes = 0
        self.slept_s = 0.0

    def consume(self, size_bytes: int) -> None:
        """Account ``size_bytes`` of I/O; sleep until the average rate is back at the limit.

        Raises:
            PassAborted: ``stopped()`` is true.
        """
        if self._stopped is not None and self._stopped():
            raise PassAborted("log cleaner stopped")
        if self.bytes_per_second <= 0:
            return
        self._bytes += size_bytes
        ahead_s = self._bytes / self.bytes_per_second - (self._clock() - self._start)
        if ahead_s > 0.001:
            self._sleep(ahead_s)
            self.slept_s += ahead_s


@dataclass(frozen=True, slots=True)
class CleanedCopy:
    """A fsynced ``<base>.log.cleaned`` ready for :meth:`PartitionLog.replace_with_cleaned`."""

    base_offset: int
    old_size_bytes: int
    next_offset: int
    size_bytes: int
    index_entries: tuple[tuple[int, int], ...]
    records_removed: int


@dataclass(slots=True)
class PassStats:
    """What one pass read and produced (bytes of chunk data)."""

    bytes_read: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    records_removed: int = 0
    segments_rewritten: int = 0
    copies: list[CleanedCopy] = field(default_factory=list)


def cleanable_segments(infos: Sequence[SegmentInfo], cleanable_end: int) -> list[SegmentInfo]:
    """The closed segments wholly below ``cleanable_end`` (oldest first); never the active one."""
    return [s for s in infos if not s.is_active and s.next_offset <= cleanable_end]


def _records(body: memoryview, header: ChunkHeader) -> Iterator[tuple[int, memoryview]]:
    """``(offset, record with its u32 length prefix)`` of a verified chunk body."""
    position = 0
    unpack = RECORD_LENGTH.unpack_from
    for number in range(header.record_count):
        end = position + RECORD_LENGTH.size + unpack(body, position)[0]
        yield header.base_offset + number, body[position:end]
        position = end


def _infos(body: memoryview, header: ChunkHeader) -> list[tuple[RecordInfo, memoryview]]:
    return [(describe_record(record[RECORD_LENGTH.size:], offset, header.append_time_ms), record)
            for offset, record in _records(body, header)]


def _chunks(log: PartitionLog, start: int, end: int, throttle: Throttle,
            stats: PassStats) -> Iterator[tuple[ChunkHeader, memoryview]]:
    """Verified chunks holding offsets in ``[start, end)``, paced."""
    with contextlib.closing(log.iter_stored_chunks(start)) as chunks:
        for header, chunk in chunks:
            if header.base_offset >= end:
                return
            stats.bytes_read += header.size_bytes
            throttle.consume(header.size_bytes)
            yield header, chunk


def observe_range(log: PartitionLog, start: int, end: int, planner: Planner, throttle: Throttle,
                  stats: PassStats) -> None:
    """Pass step 1: show every record in ``[start, end)`` to ``planner`` (offset order)."""
    for header, chunk in _chunks(log, start, end, throttle, stats):
        for info, record in _infos(chunk[HEADER_SIZE:], header):
            planner.observe(info, record[RECORD_LENGTH.size:])


class _Copy:
    """The cleaned copy being written: chunk bytes back to back plus the sparse index (append rule)."""

    def __init__(self, log: PartitionLog, base_offset: int, throttle: Throttle) -> None:
        self.path = log.directory / cleaned_file_name(base_offset)
        self.base_offset = base_offset
        self.interval = log.config.index_interval_bytes
        self.throttle = throttle
        self.entries: list[tuple[int, int]] = []
        self.position = self._last_index_position = 0
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write_chunk(self, chunk_base_offset: int, data: bytes | memoryview) -> None:
        if self.position - self._last_index_position >= self.interval:
            self.entries.append((chunk_base_offset - self.base_offset, self.position))
            self._last_index_position = self.position
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        self.position += len(data)
        self.throttle.consume(len(data))


def copy_segment(log: PartitionLog, segment: SegmentInfo, planner: Planner, *, throttle: Throttle,
                 stats: PassStats, crash_hook: Callable[[str], None] | None = None) -> CleanedCopy | None:
    """Pass step 2 for one segment: write and fsync its cleaned copy, or ``None`` when nothing goes.

    Streams chunk by chunk (memory: one chunk). Nothing is written while every record survives; at the first
    chunk that loses one, the copy is started with the chunks before it (their stored bytes, re-read), and a
    chunk that keeps all its records is copied as it is stored (same header and CRC).

    Raises:
        OSError: writing the copy failed (the partial copy is removed).
    """
    start = max(segment.base_offset, log.log_start_offset)
    copy: _Copy | None = None
    removed = 0
    try:
        for header, chunk in _chunks(log, start, segment.next_offset, throttle, stats):
            records = _infos(chunk[HEADER_SIZE:], header)
            keep = {info.offset for info, _ in records if planner.keeps(info)}
            if copy is None:
                if len(keep) == len(records):
                    continue
                copy = _Copy(log, segment.base_offset, throttle)
                for earlier, stored in _chunks(log, start, header.base_offset, throttle, stats):
                    copy.write_chunk(earlier.base_offset, stored)
            removed += len(records) - len(keep)
            if len(keep) == len(records):
                copy.write_chunk(header.base_offset, chunk)
                continue
            by_offset = {info.offset: record for info, record in records if info.offset in keep}
            for first, count in runs(sorted(keep)):
                body = b"".join(by_offset[offset] for offset in range(first, first + count))
                copy.write_chunk(first, encode_header(first, count, body, header.append_time_ms,
                                                      header.leader_epoch) + body)
        stats.bytes_before += segment.size_bytes
        if copy is None:
            stats.bytes_after += segment.size_bytes
            return None
        os.fsync(copy.fd)
    except BaseException:
        if copy is not None:
            os.close(copy.fd)
            discard_cleaned(log.directory, segment.base_offset)
        raise
    os.close(copy.fd)
    fsync_dir(log.directory)
    if crash_hook is not None:
        crash_hook("after_cleaned_written")
    stats.bytes_after += copy.position
    stats.records_removed += removed
    stats.segments_rewritten += 1
    return CleanedCopy(segment.base_offset, segment.size_bytes, segment.next_offset, copy.position,
                       tuple(copy.entries), removed)


def clean_pass(log: PartitionLog, cleanable_end: int, *, now_ms: int, delete_retention_ms: int,
               aborted: Sequence[tuple[int, int]] = (), throttle: Throttle | None = None,
               crash_hook: Callable[[str], None] | None = None, planner: Planner | None = None) -> PassStats:
    """Steps 1 and 2 of a pass (see the module docstring); ``stats.copies`` are ready to swap, oldest first.

    ``aborted``: sorted disjoint offset ranges of aborted transactions (markers inside are kept).
    ``planner``: a fresh planner for this pass (default: a :class:`~cursus.storage.compaction.KeyPlanner`
    from ``now_ms``, ``delete_retention_ms`` and ``aborted``; a given one must have been built with them).

    Raises:
        OffsetOutOfRange: retention removed the range meanwhile (the pass is simply retried later).
        CorruptLogError: a chunk failed its CRC (nothing is written for it).
        OSError: writing a copy failed.
    """
    throttle = throttle or Throttle(0)
    stats = PassStats()
    segments = cleanable_segments(log.segments_info(), cleanable_end)
    if not segments:
        return stats
    start = max(log.log_start_offset, segments[0].base_offset)
    if planner is None:
        planner = KeyPlanner(now_ms=now_ms, delete_retention_ms=delete_retention_ms, aborted=aborted)
    observe_range(log, start, segments[-1].next_offset, planner, throttle, stats)
    try:
        for segment in segments:
            if segment.next_offset <= log.log_start_offset:
                continue
            copy = copy_segment(log, segment, planner, throttle=throttle, stats=stats, crash_hook=crash_hook)
            if copy is not None:
                stats.copies.append(copy)
    except BaseException:
        for copy in stats.copies:
            discard_cleaned(log.directory, copy.base_offset)
        raise
    return stats
