"""The per-partition stream index: aggregate key -> ordered (version, offset) entries (sans-IO).

The index is a *derived view of the committed log*: the broker feeds it the event records of the
partition in offset order, up to the committed HWM (:meth:`StreamIndex.apply` then
:meth:`StreamIndex.advance`), so leader, follower and restart share one code path and an entry above the
committed HWM is never visible. :meth:`StreamIndex.truncate` drops entries at or above an offset (a log
truncated below the indexed offset, e.g. a checkpoint written ahead of a recovered log).

The checkpoint (:meth:`StreamIndex.encode` / :meth:`StreamIndex.decode`) lets a restart resume the scan at
``indexed_offset`` instead of offset 0. Format: magic ``CESI``, u16 version 1, u32 CRC-32 of the body,
u32 body length, body = JSON. A torn or corrupt checkpoint raises :class:`IndexCheckpointError`; the
caller then rebuilds from the log (the log is the authority, the checkpoint only a shortcut).
"""

from __future__ import annotations

import bisect
import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

_MAGIC = b"CESI"
_HEAD = struct.Struct(">4sHII")
CHECKPOINT_VERSION = 1


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


class StreamIndex:
    """Aggregate key -> entries in offset order, for one partition; ``indexed_offset`` is the next log
    offset to scan (everything below it was applied)."""

    def __init__(self) -> None:
        self._streams: dict[str, list[StreamEntry]] = {}
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
        self._streams.setdefault(key, []).append(entry)
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
            entries = self._streams[key]
            cut = bisect.bisect_left([e.offset for e in entries], offset)
            if cut < len(entries):
                self.event_count -= len(entries) - cut
                del entries[cut:]
                if not entries:
                    del self._streams[key]
        self.indexed_offset = offset

    # ------------------------------------------------------------------------------------ queries

    def version(self, key: str) -> int:
        """The aggregate's current (committed) version: its last entry's version, 0 when absent."""
        entries = self._streams.get(key)
        return entries[-1].version if entries else 0

    def entries(self, key: str, from_version: int = 1) -> list[StreamEntry]:
        """The aggregate's entries with version >= ``from_version``, in offset order."""
        entries = self._streams.get(key, [])
        if from_version <= 1:
            return list(entries)
        return [e for e in entries if e.version >= from_version]

    def find(self, key: str, version: int) -> StreamEntry | None:
        """The entry of ``key`` at ``version`` (the last one if the log holds several), or None."""
        for entry in reversed(self._streams.get(key, [])):
            if entry.version == version:
                return entry
        return None

    def keys(self) -> Iterator[str]:
        return iter(self._streams)

    def __len__(self) -> int:
        return len(self._streams)

    # --------------------------------------------------------------------------------- checkpoint

    def encode(self) -> bytes:
        """The checkpoint bytes (see the module docstring)."""
        streams = {
            key: [[e.version, e.offset] + ([e.event_id or "", e.digest or ""] if (e.event_id or e.digest) else [])
                  for e in entries]
            for key, entries in self._streams.items()
        }
        body = json.dumps({"indexed_offset": self.indexed_offset, "streams": streams},
                          separators=(",", ":")).encode("utf-8")
        return _HEAD.pack(_MAGIC, CHECKPOINT_VERSION, zlib.crc32(body), len(body)) + body

    @classmethod
    def decode(cls, data: bytes) -> StreamIndex:
        """Parse checkpoint bytes. Raises :class:`IndexCheckpointError` when torn, corrupt or unknown."""
        if len(data) < _HEAD.size:
            raise IndexCheckpointError("checkpoint shorter than its header")
        magic, version, crc, length = _HEAD.unpack_from(data)
        body = data[_HEAD.size:]
        if magic != _MAGIC or version != CHECKPOINT_VERSION:
            raise IndexCheckpointError("not a stream index checkpoint of version 1")
        if len(body) != length or zlib.crc32(body) != crc:
            raise IndexCheckpointError("torn or corrupt checkpoint")
        try:
            doc = json.loads(body)
            index = cls()
            index.indexed_offset = int(doc["indexed_offset"])
            for key, rows in doc["streams"].items():
                entries = [StreamEntry(int(r[0]), int(r[1]), (r[2] or None) if len(r) > 2 else None,
                                       (r[3] or None) if len(r) > 3 else None) for r in rows]
                if entries:
                    index._streams[str(key)] = entries
                    index.event_count += len(entries)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise IndexCheckpointError(f"malformed checkpoint: {exc}") from None
        return index
