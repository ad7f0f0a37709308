"""A durable Raft journal with pysyncobj's journal interface (``add``, ``deleteEntriesFrom``, ...).

pysyncobj's FileJournal writes through an mmap and never fsyncs. This journal buffers appended records
in memory and writes + fsyncs them in :meth:`DurableJournal.sync`, which the node calls once per poll
round - before any AppendEntries reply leaves and before the leader sends or counts the new entries -
so a group of entries costs one fsync. Term and vote are written with a synchronous atomic replace
(temp file, fsync, rename, directory fsync) before the vote or request that depends on them is sent.
The commit index is volatile (Raft paper, figure 2): ``getRaftCommitIndex`` always returns 1.

File ``journal.log`` (little-endian): records ``u32 body length | u32 crc32(body) | body`` with
``body = u64 index | u64 term | command``. A torn or corrupt tail (only possible for unsynced
records) is cut off when the journal is opened. A failed write or fsync raises; the node then stops
and never answers with the unsynced state.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import zlib
from pathlib import Path
from typing import Any

from cursus.storage.atomic import atomic_write, fsync_dir

logger = logging.getLogger(__name__)

JOURNAL_NAME = "journal.log"
META_NAME = "raft-meta.json"
_RECORD = struct.Struct("<II")
_BODY = struct.Struct("<QQ")

Entry = tuple[bytes, int, int]


def _record(command: bytes, index: int, term: int) -> bytes:
    body = _BODY.pack(index, term) + command
    return _RECORD.pack(len(body), zlib.crc32(body)) + body


class DurableJournal:
    """Raft log entries ``(command, index, term)`` backed by ``<directory>/journal.log``.

    Not thread-safe: only pysyncobj's tick thread touches it.
    """

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._path = directory / JOURNAL_NAME
        self._meta_path = directory / META_NAME
        self._entries: list[Entry] = []
        self._offsets: list[int] = []
        self._pending = bytearray()
        self._dirty = False
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        self._written = self._load()
        self._end = self._written
        self._meta = self._read_meta()

    # -- opening ---------------------------------------------------------------------------------

    def _load(self) -> int:
        with os.fdopen(os.dup(self._fd), "rb") as handle:
            data = handle.read()
        pos = 0
        while pos + _RECORD.size <= len(data):
            size, crc = _RECORD.unpack_from(data, pos)
            body = data[pos + _RECORD.size:pos + _RECORD.size + size]
            if size < _BODY.size or len(body) != size or zlib.crc32(body) != crc:
                break
            index, term = _BODY.unpack_from(body)
            self._entries.append((bytes(body[_BODY.size:]), index, term))
            self._offsets.append(pos)
            pos += _RECORD.size + size
        if pos != len(data):
            logger.warning("raft journal %s: cutting %d bytes of torn tail", self._path, len(data) - pos)
            os.ftruncate(self._fd, pos)
            os.fsync(self._fd)
        return pos

    def _read_meta(self) -> dict:
        try:
            return dict(json.loads(self._meta_path.read_bytes()))
        except FileNotFoundError:
            return {}

    # -- pysyncobj's journal interface -----------------------------------------------------------

    def add(self, command: bytes | str, idx: int, term: int) -> None:
        """Append an entry (durable after the next :meth:`sync`)."""
        data = command if isinstance(command, bytes) else str(command).encode()
        self._entries.append((data, idx, term))
        self._offsets.append(self._end)
        record = _record(data, idx, term)
        self._pending += record
        self._end += len(record)

    def clear(self) -> None:
        """Delete every entry (durable after the next :meth:`sync`)."""
        self.deleteEntriesFrom(0)

    def deleteEntriesFrom(self, entryFrom: int) -> None:  # noqa: N802 - pysyncobj's interface
        """Delete entries at list positions ``entryFrom`` and after."""
        if entryFrom >= len(self._entries):
            return
        cut = self._offsets[entryFrom]
        del self._entries[entryFrom:]
        del self._offsets[entryFrom:]
        if cut >= self._written:
            del self._pending[cut - self._written:]
        else:
            self._pending.clear()
            os.ftruncate(self._fd, cut)
            self._written = cut
            self._dirty = True
        self._end = cut

    def deleteEntriesTo(self, entryTo: int) -> None:  # noqa: N802
        """Delete entries before list position ``entryTo`` (log compaction after a snapshot).

        pysyncobj calls this after renaming a new snapshot into place; the directory is fsynced first
        so the snapshot is durable before the entries it replaces disappear. The remaining entries
        (buffered ones included) are then atomically rewritten (temp file, fsync, rename, dir fsync).
        """
        fsync_dir(self._dir)
        keep = self._entries[entryTo:]
        offsets, pos, chunks = [], 0, []
        for command, index, term in keep:
            record = _record(command, index, term)
            offsets.append(pos)
            chunks.append(record)
            pos += len(record)
        atomic_write(self._path, b"".join(chunks))
        os.close(self._fd)
        self._fd = os.open(self._path, os.O_RDWR, 0o600)
        self._entries, self._offsets = list(keep), offsets
        self._pending.clear()
        self._written = self._end = pos
        self._dirty = False

    def __getitem__(self, item: Any) -> Any:  # an int or a slice, like a list
        return self._entries[item]

    def __len__(self) -> int:
        return len(self._entries)

    def _destroy(self) -> None:
        os.close(self._fd)

    def setRaftCommitIndex(self, raftCommitIndex: int) -> None:  # noqa: N802, N803
        """Ignored: the commit index is volatile and re-learnt from the leader."""

    def getRaftCommitIndex(self) -> int:  # noqa: N802
        return 1

    def setCurrentTerm(self, term: int, votedForNodeId: str | None) -> None:  # noqa: N802, N803
        """Durably store term and vote before returning (atomic replace with fsyncs)."""
        meta = {"term": int(term), "voted_for": votedForNodeId}
        atomic_write(self._meta_path, json.dumps(meta, sort_keys=True).encode())
        self._meta = meta

    def getCurrentTerm(self) -> int:  # noqa: N802
        return int(self._meta.get("term", 0))

    def getVotedForNodeId(self) -> str | None:  # noqa: N802
        return self._meta.get("voted_for")

    def onOneSecondTimer(self) -> None:  # noqa: N802
        pass

    # -- ours ------------------------------------------------------------------------------------

    @property
    def needs_sync(self) -> bool:
        """True when entries were added or removed since the last :meth:`sync`."""
        return bool(self._pending) or self._dirty

    def sync(self) -> None:
        """Write buffered records and fsync the journal; a no-op when nothing changed.

        Raises:
            OSError: write or fsync failed; the caller must stop (never retry into an ack).
        """
        if self._pending:
            view = memoryview(bytes(self._pending))
            offset = self._written
            while view:
                written = os.pwrite(self._fd, view, offset)
                view, offset = view[written:], offset + written
            self._written = self._end
            self._pending.clear()
            self._dirty = True
        if self._dirty:
            os.fdatasync(self._fd)  # data and the file size; mtime is not needed to read it back
            self._dirty = False

    def compact_to(self, entry: Entry, following: Entry) -> bool:
        """If ``entry`` and ``following`` are consecutive in the journal, drop what precedes ``entry``.

        Used before Raft starts: a crash between a snapshot's rename and the journal compaction leaves
        a journal that starts earlier than the snapshot, which pysyncobj would clear entirely (losing
        the entries after the snapshot). Returns True when the journal now starts at ``entry``.
        """
        for position in range(len(self._entries) - 1):
            if self._entries[position] == entry and self._entries[position + 1] == following:
                if position:
                    self.deleteEntriesTo(position)
                return True
        return False
