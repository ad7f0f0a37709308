"""The per-partition stream index: aggregate key -> ordered (version, offset) entries (sans-IO).

The index is a *derived view of the committed log*: the broker feeds it the event records of the
partition in offset order, up to the committed HWM (:meth:`StreamIndex.apply` then
:meth:`StreamIndex.advance`), so leader, follower and restart share one code path and an entry above the
committed HWM is never visible. :meth:`StreamIndex.truncate` drops entries at or above an offset (a log
truncated below the indexed offset, e.g. a checkpoint written ahead of a recovered log).

Per aggregate the entries are two ``array('Q')`` columns (versions, offsets: 16 bytes per event) plus the
identities of aggregate-replay events; :class:`StreamEntry` objects are built only for the entries a
query returns.

The checkpoint (:meth:`StreamIndex.encode` / :meth:`StreamIndex.decode`) lets a restart resume the scan at
``indexed_offset`` instead of offset 0. Format (integers big-endian unless noted): magic ``CESI``, u16
version 2, u32 CRC-32 of the body, u64 body length; body = u64 indexed_offset, u32 stream count, then per
stream: u32 key length + UTF-8 key, u32 entry count n, n u64 versions and n u64 offsets (little-endian,
the arrays' bytes), u32 identity count, then per identity: u32 entry position, u32 length + event id,
u32 length + digest. A torn or corrupt checkpoint raises :class:`IndexCheckpointError`; the caller then
rebuilds from the log (the log is the authority, the checkpoint only a shortcut).
"""

from __future__ import annotations

import bisect
import struct
import sys
import zlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass

_MAGIC = b"CESI"
_HEAD = struct.Struct(">4sHIQ")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
CHECKPOINT_VERSION = 2
_SWAP = sys.byteorder != "little"


class IndexCheckpointError(ValueError):
    """The checkpoint bytes are torn, corrupt or of an unknown version (rebuild from the log)."""


@dataclass(frozen=True, slots=True)
class StreamEntry:
    """One indexed event: its aggregate ``version``, log ``offset`` and, on aggregate-replay topics, its
    ``event_id`` and SHA-256 ``digest`` (hex) of the payload."""

    version: int
    offset: int
    event_id: str | None = None
    digest: str | None = None


class _Stream:
    """One aggregate's entries as columns; ``ids`` maps an entry position to its (event id, digest)."""

    __slots__ = ("ids", "offsets", "versions")

    def __init__(self) -> None:
        self.versions = array("Q")
        self.offsets = array("Q")
        self.ids: dict[int, tuple[str | None, str | None]] = {}

    def entry(self, i: int) -> StreamEntry:
        event_id, digest = self.ids.get(i, (None, None))
        return StreamEntry(self.versions[i], self.offsets[i], event_id, digest)


def _le_bytes(column: array) -> bytes:
    if not _SWAP:
        return column.tobytes()
    swapped = array("Q", column)
    swapped.byteswap()
    return swapped.tobytes()


def _le_array(data: bytes) -> array:
    column = array("Q")
    column.frombytes(data)
    if _SWAP:
        column.byteswap()
    return column


class StreamIndex:
    """Aggregate key -> entries in offset order, for one partition; ``indexed_offset`` is the next log
    offset to scan (everything below it was applied)."""

    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}
        self.indexed_offset = 0
        self.event_count = 0

    # ------------------------------------------------------------------------------------ updates

    def apply(self, key: str, entry: StreamEntry) -> None:
        """Index one event record at ``entry.offset`` (>= :attr:`indexed_offset`, increasing).

        Entries are stored as the log holds them (a version that is not current + 1 is kept: the replay
        proof reports it); the broker only appends current + 1.

        Raises:
            ValueError: ``entry.offset`` below :attr:`indexed_offset` (offsets must increase).
        """
        if entry.offset < self.indexed_offset:
            raise ValueError(f"offset {entry.offset} below the indexed offset {self.indexed_offset}")
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = _Stream()
        if entry.event_id is not None or entry.digest is not None:
            stream.ids[len(stream.versions)] = (entry.event_id, entry.digest)
        stream.versions.append(entry.version)
        stream.offsets.append(entry.offset)
        self.event_count += 1
        self.indexed_offset = entry.offset + 1

    def advance(self, offset: int) -> None:
        """Everything below ``offset`` was scanned (records without events included)."""
        self.indexed_offset = max(self.indexed_offset, offset)

    def truncate(self, offset: int) -> None:
        """Drop every entry at or above ``offset`` and rescan from there."""
        if offset >= self.indexed_offset:
            return
        for key in list(self._streams):
            stream = self._streams[key]
            cut = bisect.bisect_left(stream.offsets, offset)
            if cut < len(stream.offsets):
                self.event_count -= len(stream.offsets) - cut
                del stream.versions[cut:]
                del stream.offsets[cut:]
                stream.ids = {i: ident for i, ident in stream.ids.items() if i < cut}
                if not stream.offsets:
                    del self._streams[key]
        self.indexed_offset = offset

    # ------------------------------------------------------------------------------------ queries

    def version(self, key: str) -> int:
        """The aggregate's current (committed) version: its last entry's version, 0 when absent."""
        stream = self._streams.get(key)
        return stream.versions[-1] if stream is not None else 0

    def entries(self, key: str, from_version: int = 1) -> list[StreamEntry]:
        """The aggregate's entries with version >= ``from_version``, in offset order."""
        stream = self._streams.get(key)
        if stream is None:
            return []
        versions = stream.versions
        return [stream.entry(i) for i in range(len(versions)) if versions[i] >= from_version]

    def find(self, key: str, version: int) -> StreamEntry | None:
        """The entry of ``key`` at ``version`` (the last one if the log holds several), or None."""
        stream = self._streams.get(key)
        if stream is None:
            return None
        versions = stream.versions
        for i in range(len(versions) - 1, -1, -1):
            if versions[i] == version:
                return stream.entry(i)
        return None

    def keys(self) -> Iterator[str]:
        return iter(self._streams)

    def __len__(self) -> int:
        return len(self._streams)

    # --------------------------------------------------------------------------------- checkpoint

    def encode(self) -> bytes:
        """The checkpoint bytes (see the module docstring)."""
        parts = [_U64.pack(self.indexed_offset), _U32.pack(len(self._streams))]
        for key, stream in self._streams.items():
            raw = key.encode("utf-8")
            parts += [_U32.pack(len(raw)), raw, _U32.pack(len(stream.versions)), _le_bytes(stream.versions),
                      _le_bytes(stream.offsets), _U32.pack(len(stream.ids))]
            for i, (event_id, digest) in sorted(stream.ids.items()):
                ident, dig = (event_id or "").encode("utf-8"), (digest or "").encode("utf-8")
                parts += [_U32.pack(i), _U32.pack(len(ident)), ident, _U32.pack(len(dig)), dig]
        body = b"".join(parts)
        return _HEAD.pack(_MAGIC, CHECKPOINT_VERSION, zlib.crc32(body), len(body)) + body

    @classmethod
    def decode(cls, data: bytes) -> StreamIndex:
        """Parse checkpoint bytes. Raises :class:`IndexCheckpointError` when torn, corrupt or unknown."""
        if len(data) < _HEAD.size:
            raise IndexCheckpointError("checkpoint shorter than its header")
        magic, version, crc, length = _HEAD.unpack_from(data)
        body = memoryview(data)[_HEAD.size:]
        if magic != _MAGIC or version != CHECKPOINT_VERSION:
            raise IndexCheckpointError(f"not a stream index checkpoint of version {CHECKPOINT_VERSION}")
        if len(body) != length or zlib.crc32(body) != crc:
            raise IndexCheckpointError("torn or corrupt checkpoint")
        try:
            return cls._parse(body)
        except (ValueError, struct.error, UnicodeDecodeError, IndexError) as exc:
            raise IndexCheckpointError(f"malformed checkpoint: {exc}") from None

    @classmethod
    def _parse(cls, body: memoryview) -> StreamIndex:
        index = cls()
        pos = 0

        def take(n: int) -> memoryview:
            nonlocal pos
            if pos + n > len(body):
                raise ValueError("truncated field")
            out = body[pos:pos + n]
            pos += n
            return out

        def u32() -> int:
            return int(_U32.unpack(take(4))[0])

        index.indexed_offset = int(_U64.unpack(take(8))[0])
        for _ in range(u32()):
            key = bytes(take(u32())).decode("utf-8")
            n = u32()
            stream = _Stream()
            stream.versions = _le_array(bytes(take(8 * n)))
            stream.offsets = _le_array(bytes(take(8 * n)))
            for _ in range(u32()):
                i = u32()
                event_id = bytes(take(u32())).decode("utf-8") or None
                digest = bytes(take(u32())).decode("utf-8") or None
                if not 0 <= i < n:
                    raise ValueError("identity position out of range")
                stream.ids[i] = (event_id, digest)
            if n:
                index._streams[key] = stream
                index.event_count += n
        if pos != len(body):
            raise ValueError("trailing bytes")
        return index
