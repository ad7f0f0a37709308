"""One segment: a ``<base_offset:020d>.log`` file of chunks plus its sparse ``.index``.

Invariants (Kafka ``LogSegment`` style):

* ``base_offset`` equals the base offset of the segment's first chunk; it is larger than every offset in
  earlier segments, and ``next_offset`` of a segment equals ``base_offset`` of the next one (no gaps);
* the file holds whole chunks back to back from byte 0 to ``size_bytes``; a chunk never spans segments;
* only the last segment of a log (the *active* one) is appended to; an empty segment can only be last.

The file descriptor stays open for the segment's lifetime, including after :meth:`unlink` while readers
still hold a pin (see :class:`~cursus.storage.log.PartitionLog`), so a concurrent ``pread`` never hits a
closed or reused descriptor.

Thread-safety: I/O methods are called from the writer thread, except :meth:`read`, which any thread may
call while holding a pin. The mutable bookkeeping fields are guarded by the owning log's lock.
"""

from __future__ import annotations

import os
from pathlib import Path

from cursus.storage import faults
from cursus.storage.chunk import HEADER_SIZE, Buffer, ChunkHeader, buffer_size_bytes, decode_header
from cursus.storage.offset_index import OffsetIndex

LOG_SUFFIX = ".log"
INDEX_SUFFIX = ".index"
#: Marker of a segment rewritten by the log cleaner (JSON ``{"version": 1, "next_offset": N}``): its chunks
#: may leave gaps between offsets, and its ``next_offset`` is the one recorded here (see
#: :mod:`cursus.storage.cleaner`).
COMPACTED_SUFFIX = ".compacted"
#: File-name digits: 20 zero-padded digits sort numerically under ``ls`` (Kafka's convention).
OFFSET_DIGITS = 20


def log_file_name(base_offset: int) -> str:
    """``<base_offset:020d>.log``."""
    assert base_offset >= 0
    return f"{base_offset:0{OFFSET_DIGITS}d}{LOG_SUFFIX}"


def index_file_name(base_offset: int) -> str:
    """``<base_offset:020d>.index``."""
    assert base_offset >= 0
    return f"{base_offset:0{OFFSET_DIGITS}d}{INDEX_SUFFIX}"


def compacted_file_name(base_offset: int) -> str:
    """``<base_offset:020d>.compacted``."""
    assert base_offset >= 0
    return f"{base_offset:0{OFFSET_DIGITS}d}{COMPACTED_SUFFIX}"


def parse_file_base_offset(name: str, suffix: str) -> int | None:
    """The base offset encoded in a segment or index file name, or ``None`` if ``name`` is not one."""
    if not name.endswith(suffix):
        return None
    stem = name[: -len(suffix)]
    if len(stem) != OFFSET_DIGITS or not stem.isdigit():
        return None
    return int(stem)


#: Buffers per ``pwritev`` call (Linux IOV_MAX is 1024).
IOV_MAX = 1024


def _pwrite_all(fd: int, buffers: list[Buffer], position: int, size_bytes: int) -> None:
    """``pwritev`` all ``buffers`` (``size_bytes`` in total) back to back at ``position``.

    One ``pwritev`` per :data:`IOV_MAX` buffers; a partial write (rare: signals, a full disk) is completed
    with ``pwrite`` of the rest.
    """
    if len(buffers) <= IOV_MAX:
        batches = [(buffers, size_bytes)]
    else:
        batches = [(buffers[i:i + IOV_MAX], sum(buffer_size_bytes(b) for b in buffers[i:i + IOV_MAX]))
                   for i in range(0, len(buffers), IOV_MAX)]
    for batch, batch_bytes in batches:
        written = os.pwritev(fd, batch, position)
        if written != batch_bytes:
            rest = memoryview(b"".join(batch))[written:]
            while rest:
                more = os.pwrite(fd, rest, position + written)
                written += more
                rest = rest[more:]
        position += batch_bytes


class Segment:
    """A segment file and its index. Create with :meth:`create` or :meth:`open_existing`."""

    __slots__ = (
        "directory", "base_offset", "path", "index_path", "index", "fd",
        "size_bytes", "next_offset", "first_append_time_ms", "last_append_time_ms",
        "pins", "doomed", "truncations", "_pending", "_pending_position", "_pending_bytes",
        "compacted_next_offset",
    )

    def __init__(self, directory: Path, base_offset: int, fd: int, size_bytes: int) -> None:
        self.directory = directory
        self.base_offset = base_offset
        self.path = directory / log_file_name(base_offset)
        self.index_path = directory / index_file_name(base_offset)
        self.index: OffsetIndex | None = None
        self.fd = fd
        #: Valid end of the chunk data in bytes (includes bytes still buffered by ``lose_unsynced``).
        self.size_bytes = size_bytes
        #: Offset after the last chunk (== base_offset when empty); set by recovery or appends.
        self.next_offset = base_offset
        #: Append time of the first chunk (drives the time-based roll); ``None`` when unknown or empty.
        self.first_append_time_ms: int | None = None
        #: Append time of the last chunk (drives time-based retention); ``None`` when empty.
        self.last_append_time_ms: int | None = None
        #: Readers currently using ``fd``; a doomed segment is closed when this drops to 0.
        self.pins = 0
        #: Unlinked from disk and removed from the log; close as soon as ``pins == 0``.
        self.doomed = False
        #: Bumped before any in-place cut, so a reader that sees odd bytes can tell a race from corruption.
        self.truncations = 0
        self._pending: list[bytes] = []
        self._pending_position = size_bytes
        self._pending_bytes = 0
        #: Set for a segment rewritten by the log cleaner: its chunks may leave offset gaps (never
        #: backwards) and this is its ``next_offset`` (the next segment's base). ``None`` otherwise.
        self.compacted_next_offset: int | None = None

    # ------------------------------------------------------------------------------------ opening

    @classmethod
    def create(cls, directory: Path, base_offset: int, index_interval_bytes: int) -> Segment:
        """Create a new empty segment file (exclusively) and an empty index.

        Raises:
            FileExistsError: a segment with this base offset exists already (a logic error upstream).
            OSError: file creation failed.
        """
        fd = os.open(directory / log_file_name(base_offset), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        segment = cls(directory, base_offset, fd, 0)
        try:
            segment.index = OffsetIndex(segment.index_path, base_offset, index_interval_bytes)
        except BaseException:
            os.close(fd)
            raise
        return segment

    @classmethod
    def open_existing(cls, directory: Path, base_offset: int) -> Segment:
        """Open an existing segment file; ``size_bytes`` is the file size until recovery validates it."""
        fd = os.open(directory / log_file_name(base_offset), os.O_RDWR)
        return cls(directory, base_offset, fd, os.fstat(fd).st_size)

    @property
    def is_empty(self) -> bool:
        """True when the segment holds no chunk."""
        return self.size_bytes == 0

    # ---------------------------------------------------------------------------------------- I/O

    def write(self, position: int, buffers: list[Buffer], size_bytes: int) -> None:
        """Write ``buffers`` (whole chunks: header, body, header, body, ...; ``size_bytes`` in total) back
        to back at ``position``, the current end, with as few ``pwritev`` calls as possible. No fsync.

        Under the ``lose_unsynced`` fault the bytes are buffered until :meth:`sync`.

        Raises:
            OSError: the write failed; part of the data may be on disk past ``position``.
        """
        active = faults.ACTIVE
        if active is not None and active.lose_unsynced:
            assert position == self._pending_position + self._pending_bytes
            data = b"".join(buffers)
            self._pending.append(data)
            self._pending_bytes += len(data)
            return
        _pwrite_all(self.fd, buffers, position, size_bytes)

    def read(self, position: int, length: int) -> bytes:
        """Read up to ``length`` bytes at ``position``; shorter only at end of file."""
        data = os.pread(self.fd, length, position)
        if len(data) == length or not data:
            return data
        parts = [data]
        got = len(data)
        while got < length:
            more = os.pread(self.fd, length - got, position + got)
            if not more:
                break
            parts.append(more)
            got += len(more)
        return b"".join(parts)

    def read_header(self, position: int) -> ChunkHeader | None:
        """Decode the chunk header at ``position`` (``None`` if absent or implausible)."""
        return decode_header(self.read(position, HEADER_SIZE), 0)

    def sync(self) -> None:
        """Make every written byte durable (``fdatasync``: data plus the size metadata).

        Raises:
            OSError: the sync failed; the caller must fence the log and never retry.
        """
        active = faults.ACTIVE
        if active is not None:
            try:
                active.before_segment_fsync(self.path)
            except OSError:
                self._drop_pending()  # like dirty pages dropped after a failed writeback
                raise
            self._materialize()
        os.fdatasync(self.fd)

    def truncate(self, size_bytes: int) -> None:
        """Cut the file at ``size_bytes`` (no fsync). Buffered bytes are written out first."""
        self._materialize()
        os.ftruncate(self.fd, size_bytes)
        self._pending_position = size_bytes

    def overwrite(self, position: int, data: bytes) -> None:
        """Overwrite bytes in place (used to rewrite a chunk header when cutting inside a chunk)."""
        self._materialize()
        _pwrite_all(self.fd, [data], position, len(data))

    def _materialize(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        _pwrite_all(self.fd, list(pending), self._pending_position, self._pending_bytes)
        self._pending_position += self._pending_bytes
        self._pending_bytes = 0

    def _drop_pending(self) -> None:
        self._pending.clear()
        self._pending_bytes = 0

    # ------------------------------------------------------------------------------------ cleanup

    @property
    def compacted_path(self) -> Path:
        """The ``.compacted`` marker beside the segment (present only for a cleaned segment)."""
        return self.directory / compacted_file_name(self.base_offset)

    @property
    def allows_gaps(self) -> bool:
        """True for a cleaned segment: consecutive chunks may skip offsets (forward only)."""
        return self.compacted_next_offset is not None

    def unlink(self) -> None:
        """Remove the ``.log``, ``.index`` and ``.compacted`` files; the fd stays usable until :meth:`close`."""
        self.path.unlink(missing_ok=True)
        self.index_path.unlink(missing_ok=True)
        self.compacted_path.unlink(missing_ok=True)

    def close(self) -> None:
        """Close the segment and index fds (idempotent). Buffered ``lose_unsynced`` bytes are dropped."""
        self._drop_pending()
        if self.index is not None:
            self.index.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __repr__(self) -> str:
        return (f"Segment(base_offset={self.base_offset}, next_offset={self.next_offset}, "
                f"size_bytes={self.size_bytes})")


class WindowReader:
    """Reads a segment through one sliding buffer: one ``pread`` serves many nearby small reads.

    Views returned stay valid after the window moves (each window is its own ``bytes`` object).
    Thread-safety: one reader per thread; the caller holds a pin on the segment.
    """

    __slots__ = ("_segment", "_readahead_bytes", "_start", "_data")

    def __init__(self, segment: Segment, readahead_bytes: int) -> None:
        assert readahead_bytes >= 1
        self._segment = segment
        self._readahead_bytes = readahead_bytes
        self._start = 0
        self._data = b""

    def view(self, position: int, length: int) -> memoryview | None:
        """The bytes ``[position, position + length)``; ``None`` if the file ends before that.

        When the range is not in the current window, reads ``max(length, readahead_bytes)`` bytes at
        ``position`` with a single ``pread`` (short only at end of file).
        """
        offset_in_data = position - self._start
        if offset_in_data < 0 or offset_in_data + length > len(self._data):
            self._data = self._segment.read(position, max(length, self._readahead_bytes))
            self._start = position
            offset_in_data = 0
            if len(self._data) < length:
                return None
        return memoryview(self._data)[offset_in_data:offset_in_data + length]

    def header(self, position: int) -> ChunkHeader | None:
        """The chunk header at ``position`` (``None`` if absent or implausible)."""
        view = self.view(position, HEADER_SIZE)
        return None if view is None else decode_header(view, 0)
