"""Snapshot file format version 9 (our own; pysyncobj's pickle dump is never used).

Layout (little-endian)::

    magic b"CRSNAP\\r\\n" (8) | version u32 = 9 | crc32 u32 of payload | payload length u64 | payload
    payload = entry(last) | entry(prev) | members | blob(dedup table) | blob(FSM snapshot)
    entry   = u64 index | u64 term | blob(command bytes)
    members = u32 count | blob(node address)*
    blob    = u32 length | bytes

``last``/``prev`` are the last applied Raft entry and the one before it (pysyncobj keeps both in the
journal after compaction). :func:`write_snapshot` fsyncs the file before returning; making the rename
into place durable is the caller's job (see :mod:`.compat`).
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from cursus.cluster.raft.errors import UnsupportedRecoveryProtocol

SNAPSHOT_VERSION = 9
MAGIC = b"CRSNAP\r\n"
_HEADER = struct.Struct("<8sIIQ")
_U32 = struct.Struct("<I")
_ENTRY = struct.Struct("<QQ")

#: A Raft journal entry as pysyncobj holds it: (command bytes, index, term).
Entry = tuple[bytes, int, int]


class SnapshotCorrupt(ValueError):
    """The snapshot bytes are truncated or fail their checksum."""


@dataclass(frozen=True)
class Snapshot:
    """One decoded snapshot: the applied position, the members, the dedup table and the FSM bytes."""

    last: Entry
    prev: Entry
    members: tuple[str, ...]
    dedup: bytes
    fsm: bytes


def _blob(data: bytes) -> bytes:
    return _U32.pack(len(data)) + data


def _entry(entry: Entry) -> bytes:
    command, index, term = entry
    return _ENTRY.pack(index, term) + _blob(bytes(command))


def encode_snapshot(snapshot: Snapshot) -> bytes:
    """The complete file bytes (header + payload) of ``snapshot``."""
    payload = b"".join((
        _entry(snapshot.last), _entry(snapshot.prev),
        _U32.pack(len(snapshot.members)), *(_blob(member.encode()) for member in snapshot.members),
        _blob(snapshot.dedup), _blob(snapshot.fsm),
    ))
    return _HEADER.pack(MAGIC, SNAPSHOT_VERSION, zlib.crc32(payload), len(payload)) + payload


class _Reader:
    def __init__(self, data: memoryview) -> None:
        self.data, self.pos = data, 0

    def take(self, size: int) -> memoryview:
        if self.pos + size > len(self.data):
            raise SnapshotCorrupt("truncated snapshot payload")
        chunk = self.data[self.pos:self.pos + size]
        self.pos += size
        return chunk

    def u32(self) -> int:
        return int(_U32.unpack(self.take(_U32.size))[0])

    def blob(self) -> bytes:
        return bytes(self.take(self.u32()))

    def entry(self) -> Entry:
        index, term = _ENTRY.unpack(self.take(_ENTRY.size))
        return (self.blob(), int(index), int(term))


def decode_snapshot(data: bytes) -> Snapshot:
    """Parse file bytes written by :func:`encode_snapshot`.

    Raises:
        UnsupportedRecoveryProtocol: another magic or format version.
        SnapshotCorrupt: truncated, trailing bytes or checksum mismatch.
    """
    if len(data) < _HEADER.size:
        raise SnapshotCorrupt("truncated snapshot header")
    magic, version, crc, length = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise UnsupportedRecoveryProtocol("the snapshot file is not a Cursus Raft snapshot")
    if version != SNAPSHOT_VERSION:
        raise UnsupportedRecoveryProtocol(
            f"snapshot format {version}, this version reads only {SNAPSHOT_VERSION}")
    payload = memoryview(data)[_HEADER.size:]
    if len(payload) != length:
        raise SnapshotCorrupt(f"snapshot payload is {len(payload)} bytes, header says {length}")
    if zlib.crc32(payload) != crc:
        raise SnapshotCorrupt("snapshot checksum mismatch")
    reader = _Reader(payload)
    last, prev = reader.entry(), reader.entry()
    members = tuple(reader.blob().decode() for _ in range(reader.u32()))
    dedup, fsm = reader.blob(), reader.blob()
    if reader.pos != len(payload):
        raise SnapshotCorrupt("trailing bytes in snapshot payload")
    return Snapshot(last, prev, members, dedup, fsm)


def write_snapshot(path: Path | str, snapshot: Snapshot) -> None:
    """Write ``snapshot`` to ``path`` (created or truncated) and fsync it.

    Raises:
        OSError: write or fsync failed (the file content is then unspecified).
    """
    data = encode_snapshot(snapshot)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def read_snapshot(path: Path | str) -> Snapshot:
    """Read, fsync (a received snapshot may not be synced yet) and decode the snapshot at ``path``.

    Raises:
        OSError, UnsupportedRecoveryProtocol, SnapshotCorrupt.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        with os.fdopen(os.dup(fd), "rb") as handle:
            data = handle.read()
    finally:
        os.close(fd)
    return decode_snapshot(data)
