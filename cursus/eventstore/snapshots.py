"""The per-partition snapshot store (spec SAVE_SNAPSHOT / READ_SNAPSHOT), sans-IO.

In memory: the latest snapshot per aggregate key (a save never replaces a snapshot of a higher version).
On disk: an append-only log of records, each ``u32 length, u32 CRC-32, body``, body = JSON
``{"k": key, "v": version, "p": payload}``. :func:`decode_snapshot_log` returns the records up to the
first torn or corrupt one and the byte length of that valid prefix, so a crash mid-write discards only the
final, never acknowledged, record and keeps every earlier snapshot.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

_HEAD = struct.Struct(">II")
#: One snapshot record may hold at most this many bytes (a larger length is treated as a torn tail).
MAX_SNAPSHOT_RECORD_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An aggregate's state at ``version`` (``payload``: the client's serialized state, opaque text)."""

    key: str
    version: int
    payload: str

    def to_json(self) -> dict[str, object]:
        """The wire shape ``{"version": N, "payload": "..."}`` (READ_SNAPSHOT, READ_STREAM envelope)."""
        return {"version": self.version, "payload": self.payload}


def encode_snapshot_record(snapshot: Snapshot) -> bytes:
    """One on-disk record for ``snapshot``."""
    body = json.dumps({"k": snapshot.key, "v": snapshot.version, "p": snapshot.payload},
                      separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return _HEAD.pack(len(body), zlib.crc32(body)) + body


def decode_snapshot_log(data: bytes) -> tuple[list[Snapshot], int]:
    """The snapshots of a snapshot file, and the byte length of its valid prefix (the rest is torn)."""
    out: list[Snapshot] = []
    pos = 0
    while pos + _HEAD.size <= len(data):
        length, crc = _HEAD.unpack_from(data, pos)
        end = pos + _HEAD.size + length
        if length > MAX_SNAPSHOT_RECORD_BYTES or end > len(data):
            break
        body = data[pos + _HEAD.size:end]
        if zlib.crc32(body) != crc:
            break
        try:
            doc = json.loads(body)
            snap = Snapshot(str(doc["k"]), int(doc["v"]), str(doc["p"]))
        except (ValueError, KeyError, TypeError):
            break
        out.append(snap)
        pos = end
    return out, pos


class SnapshotStore:
    """Latest snapshot per aggregate key of one partition."""

    def __init__(self, snapshots: list[Snapshot] | None = None) -> None:
        self._latest: dict[str, Snapshot] = {}
        for snap in snapshots or ():
            self.put(snap)

    def put(self, snapshot: Snapshot) -> bool:
        """Keep ``snapshot`` unless a snapshot of a higher version exists; True when kept."""
        current = self._latest.get(snapshot.key)
        if current is not None and current.version > snapshot.version:
            return False
        self._latest[snapshot.key] = snapshot
        return True

    def get(self, key: str) -> Snapshot | None:
        return self._latest.get(key)

    def drop_above(self, key: str, version: int) -> None:
        """Forget the snapshot of ``key`` if it claims a version above ``version`` (the stream it described
        was not committed, e.g. the index was rebuilt shorter)."""
        snap = self._latest.get(key)
        if snap is not None and snap.version > version:
            del self._latest[key]

    def __iter__(self) -> Iterator[Snapshot]:
        return iter(list(self._latest.values()))

    def __len__(self) -> int:
        return len(self._latest)
