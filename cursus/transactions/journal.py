"""``{log_dir}/__transaction_state.journal``: the standalone coordinator's durable transitions (facts B6).

Frame: ``u32 big-endian length | JSON bytes | u32 big-endian CRC32-IEEE(JSON)``; the JSON is at most
:data:`MAX_RECORD_BYTES` (32 MiB). Record kinds (``"version": 3``):

* ``{"version": 3, "kind": "entry", "entry": {...}, "next_producer_id": N}``: the latest state of one
  transactional id (:class:`cursus.transactions.state.TxnEntry`);
* ``{"version": 3, "kind": "touched", "partitions": [[topic, p], ...], "next_producer_id": N}``: partitions that
  ever took transactional records (their transaction index is rebuilt from the log at startup).

Recovery (:meth:`TxnJournal.open`): a torn or checksum-corrupt *final* record is truncated away; a bad
record followed by a valid one is non-tail corruption and refuses startup (:class:`JournalCorruptError`).
Every append is written and fsynced before it returns; compaction rewrites the latest record per id (and one
``touched`` record) to a temporary file, fsyncs it, renames it over the journal and fsyncs the directory,
once at least ``compact_min_superseded`` records, and at least as many as there are live ids, are superseded
(so its cost is amortized over the appends and replay stays bounded by about twice the live state).

All methods block (file I/O): call them off the event loop (one caller at a time).
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cursus.storage.atomic import fsync_dir
from cursus.transactions.state import TopicPartition, TxnEntry

JOURNAL_NAME = "__transaction_state.journal"
MAX_RECORD_BYTES = 32 * 1024 * 1024
VERSION = 3
_U32 = struct.Struct(">I")


class JournalCorruptError(Exception):
    """A complete journal record before the tail is corrupt: startup must stop (never guess state)."""


class JournalRecordTooLarge(ValueError):
    """One encoded journal record would exceed :data:`MAX_RECORD_BYTES`."""


@dataclass(slots=True)
class JournalState:
    """What replay restores: the latest entry per transactional id, the touched partitions, the producer-id
    counter, and bookkeeping for compaction."""

    entries: dict[str, TxnEntry] = field(default_factory=dict)
    touched: set[TopicPartition] = field(default_factory=set)
    next_producer_id: int = 1
    records: int = 0
    truncated_bytes: int = 0


def encode_frame(record: dict[str, Any]) -> bytes:
    """One journal frame. Raises JournalRecordTooLarge."""
    body = json.dumps(record, separators=(",", ":"), sort_keys=True).encode("utf-8")
    if len(body) > MAX_RECORD_BYTES:
        raise JournalRecordTooLarge(f"journal record of {len(body)} bytes exceeds {MAX_RECORD_BYTES}")
    return _U32.pack(len(body)) + body + _U32.pack(zlib.crc32(body) & 0xFFFFFFFF)


def _parse_frames(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """Decode frames from the start; returns (records, end of the last valid record).

    Raises:
        JournalCorruptError: a bad record is followed by a valid one (non-tail corruption).
    """
    records: list[dict[str, Any]] = []
    pos = 0
    while pos < len(data):
        record, end = _frame_at(data, pos)
        if record is None:
            if _valid_frame_after(data, pos + 1):
                raise JournalCorruptError(f"corrupt transaction journal record at byte {pos} before valid records")
            break
        records.append(record)
        pos = end
    return records, pos


def _frame_at(data: bytes, pos: int) -> tuple[dict[str, Any] | None, int]:
    if pos + 4 > len(data):
        return None, pos
    (length,) = _U32.unpack_from(data, pos)
    end = pos + 4 + length + 4
    if length > MAX_RECORD_BYTES or end > len(data):
        return None, pos
    body = data[pos + 4:pos + 4 + length]
    if zlib.crc32(body) & 0xFFFFFFFF != _U32.unpack_from(data, pos + 4 + length)[0]:
        return None, pos
    try:
        record = json.loads(body)
    except ValueError:
        return None, pos
    if not isinstance(record, dict) or record.get("version") != VERSION:
        return None, pos
    return record, end


def _valid_frame_after(data: bytes, start: int) -> bool:
    """Is there a complete, checksummed record starting anywhere after ``start``? (Distinguishes a torn tail
    from corruption in the middle.)"""
    for pos in range(start, max(start, len(data) - 8) + 1):
        (length,) = _U32.unpack_from(data, pos) if pos + 4 <= len(data) else (0,)
        if 2 <= length <= len(data) - pos - 8 and data[pos + 4:pos + 5] == b"{":
            record, _ = _frame_at(data, pos)
            if record is not None:
                return True
    return False


def apply_record(state: JournalState, record: dict[str, Any]) -> None:
    """Fold one decoded record into ``state``. Raises JournalCorruptError on an unknown or malformed kind."""
    try:
        kind = record["kind"]
        state.next_producer_id = max(state.next_producer_id, int(record.get("next_producer_id", 1)))
        if kind == "entry":
            entry = TxnEntry.from_json(record["entry"])
            state.entries[entry.transactional_id] = entry
        elif kind == "touched":
            state.touched.update((str(t), int(p)) for t, p in record["partitions"])
        elif kind == "forget":
            state.entries.pop(str(record["transactional_id"]), None)
        else:
            raise ValueError(f"unknown journal record kind {kind!r}")
    except (KeyError, TypeError, ValueError) as exc:
        raise JournalCorruptError(f"malformed transaction journal record: {exc}") from None
    state.records += 1


class TxnJournal:
    """The open journal file. Create with :meth:`open`."""

    def __init__(self, path: Path, state: JournalState, size: int, *, compact_min_superseded: int) -> None:
        self.path = path
        self.state = state
        self.size = size
        self.compact_min_superseded = compact_min_superseded
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    @classmethod
    def open(cls, log_dir: Path, *, compact_min_superseded: int = 256) -> TxnJournal:
        """Replay ``log_dir/__transaction_state.journal`` (created empty when absent).

        Raises:
            JournalCorruptError: non-tail corruption or a malformed record (startup must stop).
        """
        path = log_dir / JOURNAL_NAME
        data = path.read_bytes() if path.exists() else b""
        records, end = _parse_frames(data)
        state = JournalState()
        for record in records:
            apply_record(state, record)
        if end < len(data):
            state.truncated_bytes = len(data) - end
            with open(path, "r+b") as f:
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
        elif not path.exists():
            path.touch(mode=0o600)
            fsync_dir(log_dir)
        return cls(path, state, end, compact_min_superseded=compact_min_superseded)

    @property
    def superseded(self) -> int:
        """Records replay would skip (older than the latest per id)."""
        return self.state.records - len(self.state.entries) - (1 if self.state.touched else 0)

    def append(self, records: Iterable[dict[str, Any]]) -> None:
        """Write ``records`` (each gets ``version``), fsync, then fold them into :attr:`state`; compacts when
        enough records are superseded. Raises OSError (the caller fences the coordinator) or
        JournalRecordTooLarge."""
        records = [{"next_producer_id": self.state.next_producer_id, **r, "version": VERSION} for r in records]
        frames = b"".join(encode_frame(r) for r in records)
        written = 0
        while written < len(frames):
            written += os.write(self._fd, frames[written:])
        os.fsync(self._fd)
        self.size += len(frames)
        for record in records:
            apply_record(self.state, record)
        if self.superseded >= max(self.compact_min_superseded, len(self.state.entries)):
            self.compact()  # amortized: the file stays within about twice its live records

    def compact(self) -> None:
        """Rewrite the journal as its latest records only (temp file, fsync, rename, directory fsync)."""
        state = self.state
        records: list[dict[str, Any]] = []
        if state.touched:
            records.append({"version": VERSION, "kind": "touched", "next_producer_id": state.next_producer_id,
                            "partitions": sorted([t, p] for t, p in state.touched)})
        for tid in sorted(state.entries):
            records.append({"version": VERSION, "kind": "entry", "next_producer_id": state.next_producer_id,
                            "entry": state.entries[tid].to_json()})
        data = b"".join(encode_frame(r) for r in records)
        tmp = self.path.with_name(self.path.name + ".compacting")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND, 0o600)
        self.size = len(data)
        state.records = len(records)

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
