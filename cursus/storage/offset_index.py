"""Sparse offset index of one segment: ``<base_offset:020d>.index``.

On-disk layout: a flat array of 8-byte big-endian entries ``(relative_offset u32, position u32)``, where
``relative_offset = chunk.base_offset - segment.base_offset`` and ``position`` is the byte position of that
chunk's header in the ``.log`` file. No header, no checksum.

Invariants (checked at load, asserted at append):

* relative offsets and positions are strictly increasing;
* every position is > 0 (the chunk at position 0 is implicit: a lookup below the first entry answers 0);
* an entry is added for a chunk when at least ``interval_bytes`` of log bytes lie between the previous
  entry's position (or 0) and the chunk's position, so lookups walk at most about one interval of headers.

The index is derived data: it is not fsynced on the hot path, and recovery rebuilds it from the segment
when it is missing, has a partial entry, is not monotonic or points past the segment's valid end.

Thread-safety: the owning :class:`~cursus.storage.log.PartitionLog` serializes every call under its lock;
the in-memory arrays are then safe to read from the event-loop thread under the same lock.
"""

from __future__ import annotations

import os
import struct
from array import array
from bisect import bisect_right
from collections.abc import Iterable
from pathlib import Path

ENTRY = struct.Struct(">II")
ENTRY_SIZE = ENTRY.size
U32_MAX = 0xFFFFFFFF

assert ENTRY_SIZE == 8


class OffsetIndex:
    """The in-memory copy of one segment's index plus an append-only fd to its file."""

    __slots__ = ("path", "base_offset", "interval_bytes", "_relative_offsets", "_positions", "_fd", "_unwritten")

    def __init__(self, path: Path, base_offset: int, interval_bytes: int,
                 entries: Iterable[tuple[int, int]] = (), *, rewrite: bool = True) -> None:
        """Create the index for the segment at ``base_offset``.

        Args:
            entries: ``(relative_offset, position)`` pairs, already validated.
            rewrite: write ``entries`` to ``path`` (replacing its content); ``False`` keeps the file as is
                (it was just loaded and holds exactly ``entries``).
        """
        assert interval_bytes >= 1
        self.path = path
        self.base_offset = base_offset
        self.interval_bytes = interval_bytes
        self._relative_offsets = array("Q")
        self._positions = array("Q")
        #: Entries added to memory but not yet written to the file (see :meth:`write_pending`).
        self._unwritten = bytearray()
        for relative_offset, position in entries:
            self._relative_offsets.append(relative_offset)
            self._positions.append(position)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if rewrite else 0)
        self._fd = os.open(path, flags, 0o644)
        if rewrite and self._relative_offsets:
            os.write(self._fd, self._encoded())

    # ------------------------------------------------------------------------------------ loading

    @staticmethod
    def read_entries(path: Path, segment_size_bytes: int) -> list[tuple[int, int]] | None:
        """Read and sanity-check the entries of an index file.

        Returns:
            the entries, or ``None`` when the file is missing, has a partial entry, is not strictly
            increasing, has a zero position, or points at or past ``segment_size_bytes``.
        """
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if len(data) % ENTRY_SIZE != 0:
            return None
        entries = list(ENTRY.iter_unpack(data))
        previous_offset = 0
        previous_position = 0
        for relative_offset, position in entries:
            if relative_offset <= previous_offset or position <= previous_position:
                return None
            previous_offset, previous_position = relative_offset, position
        if previous_position >= segment_size_bytes and entries:
            return None
        return entries

    # ---------------------------------------------------------------------------------- accessors

    @property
    def entry_count(self) -> int:
        """Number of entries."""
        return len(self._relative_offsets)

    @property
    def last_entry(self) -> tuple[int, int]:
        """``(relative_offset, position)`` of the last entry, or ``(0, 0)`` when empty."""
        if not self._relative_offsets:
            return 0, 0
        return self._relative_offsets[-1], self._positions[-1]

    def entries(self) -> list[tuple[int, int]]:
        """A copy of all entries (for tests and diagnostics)."""
        return list(zip(self._relative_offsets, self._positions, strict=True))

    def lookup(self, offset: int) -> tuple[int, int]:
        """``(chunk_base_offset, position)`` of the last indexed chunk whose base offset is <= ``offset``;
        ``(base_offset, 0)`` (the segment's first chunk) when there is none."""
        relative_offset = offset - self.base_offset
        assert relative_offset >= 0
        slot = bisect_right(self._relative_offsets, relative_offset)
        if slot == 0:
            return self.base_offset, 0
        return self.base_offset + self._relative_offsets[slot - 1], self._positions[slot - 1]

    # ---------------------------------------------------------------------------------- mutation

    def maybe_append(self, chunk_base_offset: int, position: int) -> bool:
        """Add an entry for the chunk at ``position`` if an interval of bytes passed since the last one.

        The entry is usable at once; it reaches the file at the next :meth:`write_pending` (one ``write``
        per batch of appends).

        Returns:
            True when an entry was added.
        """
        last_relative_offset, last_position = self.last_entry
        if position - last_position < self.interval_bytes:
            return False
        relative_offset = chunk_base_offset - self.base_offset
        assert last_relative_offset < relative_offset <= U32_MAX, (last_relative_offset, relative_offset)
        assert last_position < position <= U32_MAX, (last_position, position)
        self._unwritten += ENTRY.pack(relative_offset, position)
        self._relative_offsets.append(relative_offset)
        self._positions.append(position)
        return True

    def write_pending(self) -> None:
        """Append the entries added since the last call to the file (no fsync: derived data).

        Raises:
            OSError: the write failed.
        """
        if self._unwritten:
            data, self._unwritten = bytes(self._unwritten), bytearray()
            os.write(self._fd, data)

    def truncate_to_position(self, position: int) -> None:
        """Drop every entry whose position is >= ``position`` (the segment is being cut there)."""
        self.write_pending()
        keep = bisect_right(self._positions, position - 1)
        if keep == len(self._positions):
            return
        del self._relative_offsets[keep:]
        del self._positions[keep:]
        os.ftruncate(self._fd, keep * ENTRY_SIZE)

    def close(self) -> None:
        """Write pending entries (best effort) and close the file descriptor (idempotent)."""
        if self._fd >= 0:
            try:
                self.write_pending()
            except OSError:
                pass  # derived data: recovery rebuilds a short index
            os.close(self._fd)
            self._fd = -1

    def _encoded(self) -> bytes:
        return b"".join(ENTRY.pack(o, p) for o, p in zip(self._relative_offsets, self._positions, strict=True))
