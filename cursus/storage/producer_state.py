"""Idempotent-producer state of one partition log, and its checksummed snapshots.

Per producer id the log keeps the producer epoch, the last sequence number and the last
:data:`REMEMBERED_BATCHES` batches ``(first seq, last seq, first offset)``: what the broker needs to
detect duplicates (the rules themselves are in :mod:`cursus.broker.producer_state`). The state is a
function of the chunks: :meth:`ProducerState.apply_chunk` folds one chunk in, reading only the producer
fields of the chunk's first and last records (an idempotent batch is one chunk with contiguous sequence
numbers). The log folds in every chunk it appends, for a leader and a follower alike.

Snapshots: ``<offset:020d>.snapshot`` holds the state of the chunks below ``offset``. The log writes one
at every segment roll (``offset`` = the new segment's base) and at a clean close (``offset`` = the LEO),
so recovery reads only the chunks after the last valid snapshot. File format::

    0   magic    4 bytes   "CPS1"
    4   crc      u32       CRC32C of the document
    8   document           compact JSON {"end_offset":N,"producers":{id:{epoch,last_seq,last_active_ms,batches}}}

A snapshot that fails its checksum or does not parse is ignored (the rebuild reads further back). Thread-
safety: the log's state is owned by the writer thread; the broker works on its own copy.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import crc32c

from cursus.storage.atomic import atomic_write
from cursus.storage.chunk import Buffer
from cursus.storage.segment import OFFSET_DIGITS, parse_file_base_offset

logger = logging.getLogger("cursus.storage")

#: How many recent batches per producer are remembered for duplicate detection (Kafka uses 5 as well).
REMEMBERED_BATCHES = 5
SNAPSHOT_SUFFIX = ".snapshot"
SNAPSHOT_MAGIC = b"CPS1"
_CRC = struct.Struct(">I")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_PRODUCER_TAIL = struct.Struct(">Qq")


@dataclass(slots=True)
class ProducerEntry:
    """Sequence state of one producer id on one partition."""

    epoch: int
    last_seq: int
    last_active_ms: int
    batches: deque[tuple[int, int, int]] = field(default_factory=lambda: deque(maxlen=REMEMBERED_BATCHES))


class ProducerState:
    """Producer sequence state of one partition: ``entries`` by producer id. ``ttl_ms``: idle time after
    which :meth:`expire` drops a producer."""

    def __init__(self, ttl_ms: int) -> None:
        self.ttl_ms = ttl_ms
        self.entries: dict[str, ProducerEntry] = {}

    def record(self, producer_id: str, epoch: int, first_seq: int, last_seq: int, first_offset: int,
               now_ms: int) -> None:
        """Remember an appended batch (its first record at ``first_offset``). A batch of an older epoch
        than the one known (a fenced session, seen while rebuilding) is ignored."""
        entry = self.entries.get(producer_id)
        if entry is None or epoch != entry.epoch:
            if entry is not None and epoch < entry.epoch:
                return
            entry = ProducerEntry(epoch=epoch, last_seq=0, last_active_ms=now_ms)
            self.entries[producer_id] = entry
        entry.last_seq = last_seq
        entry.last_active_ms = now_ms
        entry.batches.append((first_seq, last_seq, first_offset))

    def apply_chunk(self, base_offset: int, record_count: int, body: Buffer, append_time_ms: int) -> None:
        """Fold in one chunk (a records section whose first record has offset ``base_offset``)."""
        span = chunk_producer_span(body, record_count)
        if span is not None:
            self.record(span[0], span[1], span[2], span[3], base_offset, append_time_ms)

    def expire(self, now_ms: int) -> int:
        """Drop producers idle longer than the TTL; return how many were dropped."""
        stale = [pid for pid, e in self.entries.items() if now_ms - e.last_active_ms > self.ttl_ms]
        for pid in stale:
            del self.entries[pid]
        return len(stale)

    def copy_entries(self) -> dict[str, ProducerEntry]:
        """A deep copy of :attr:`entries`."""
        return {pid: ProducerEntry(e.epoch, e.last_seq, e.last_active_ms, deque(e.batches, REMEMBERED_BATCHES))
                for pid, e in self.entries.items()}

    # ------------------------------------------------------------------------------------- snapshots

    def encode_snapshot(self, end_offset: int) -> bytes:
        """The snapshot file's bytes for the state of the chunks below ``end_offset``."""
        producers = {pid: {"epoch": e.epoch, "last_seq": e.last_seq, "last_active_ms": e.last_active_ms,
                           "batches": [list(b) for b in e.batches]} for pid, e in self.entries.items()}
        document = json.dumps({"end_offset": end_offset, "producers": producers},
                              separators=(",", ":")).encode("utf-8")
        return SNAPSHOT_MAGIC + _CRC.pack(crc32c.crc32c(document)) + document

    @classmethod
    def decode_snapshot(cls, data: bytes, ttl_ms: int) -> tuple[ProducerState, int]:
        """Parse :meth:`encode_snapshot` output; returns ``(state, end_offset)``.

        Raises:
            ValueError: wrong magic, checksum mismatch or a malformed document.
        """
        if data[:4] != SNAPSHOT_MAGIC or len(data) < 8:
            raise ValueError("not a producer-state snapshot")
        document = data[8:]
        if _CRC.unpack_from(data, 4)[0] != crc32c.crc32c(document):
            raise ValueError("checksum mismatch")
        try:
            doc = json.loads(document)
            state = cls(ttl_ms)
            for pid, e in doc["producers"].items():
                entry = ProducerEntry(epoch=int(e["epoch"]), last_seq=int(e["last_seq"]),
                                      last_active_ms=int(e["last_active_ms"]))
                entry.batches.extend((int(f), int(last), int(o)) for f, last, o in e["batches"])
                state.entries[str(pid)] = entry
            return state, int(doc["end_offset"])
        except (KeyError, TypeError, AttributeError, UnicodeDecodeError) as error:
            raise ValueError(f"malformed snapshot: {error!r}") from None


def snapshot_path(directory: Path, offset: int) -> Path:
    """``<directory>/<offset:020d>.snapshot``."""
    return directory / f"{offset:0{OFFSET_DIGITS}d}{SNAPSHOT_SUFFIX}"


def snapshot_offsets(directory: Path) -> list[int]:
    """Offsets of the snapshot files in ``directory``, ascending."""
    offsets = (parse_file_base_offset(name, SNAPSHOT_SUFFIX) for name in os.listdir(directory))
    return sorted(offset for offset in offsets if offset is not None)


def write_snapshot(directory: Path, state: ProducerState, offset: int) -> None:
    """Durably write the snapshot of ``state`` as of ``offset`` (atomic replace).

    Raises:
        OSError: the write failed (a snapshot only saves replay work: callers log it and go on).
    """
    atomic_write(snapshot_path(directory, offset), state.encode_snapshot(offset), mode=0o644)


def delete_snapshots(directory: Path, *, below: int | None = None, above: int | None = None) -> None:
    """Remove snapshots at offsets ``< below`` or ``> above``; every snapshot when neither is given (no
    fsync: a stale one left by a crash is removed again at the next open)."""
    for offset in snapshot_offsets(directory):
        everything = below is None and above is None
        if everything or (below is not None and offset < below) or (above is not None and offset > above):
            snapshot_path(directory, offset).unlink(missing_ok=True)


def load_latest_snapshot(directory: Path, ttl_ms: int, start_offset: int,
                         end_offset: int) -> tuple[ProducerState, int]:
    """The state from the latest valid snapshot at an offset in ``[start_offset, end_offset]``, and that
    offset; an empty state at ``start_offset`` when there is none. Invalid snapshots are deleted."""
    for offset in reversed(snapshot_offsets(directory)):
        if not start_offset <= offset <= end_offset:
            continue
        path = snapshot_path(directory, offset)
        try:
            state, snapshot_end = ProducerState.decode_snapshot(path.read_bytes(), ttl_ms)
            if snapshot_end != offset:
                raise ValueError(f"end offset {snapshot_end} does not match the file name")
            return state, offset
        except (OSError, ValueError) as error:
            logger.warning("ignoring producer-state snapshot %s: %s", path, error)
            path.unlink(missing_ok=True)
    return ProducerState(ttl_ms), start_offset


# ------------------------------------------------------------------------------- producer fields


def record_producer(record: Buffer, start: int = 0) -> tuple[str, int, int] | None:
    """(producer id, seq, epoch) of one encoded record (facts B3.2), or None without the producer bit.

    ``record`` holds an already validated record starting at ``start``. Raises struct.error / ValueError on
    malformed bytes (callers only pass validated records).
    """
    presence = _U64.unpack_from(record, start + 2)[0]
    if not presence & 0x2:
        return None
    pos = start + 10
    pos += 4 + _U32.unpack_from(record, pos)[0]  # topic
    pos += 4 + 8  # partition, offset
    pos += 4 + _U32.unpack_from(record, pos)[0]  # payload
    if presence & 0x1:
        pos += 8  # timestamp
    id_len = _U32.unpack_from(record, pos)[0]
    producer_id = bytes(record[pos + 4 : pos + 4 + id_len]).decode("utf-8")
    seq, epoch = _PRODUCER_TAIL.unpack_from(record, pos + 4 + id_len)
    return producer_id, seq, epoch


def chunk_producer_span(body: Buffer, record_count: int) -> tuple[str, int, int, int] | None:
    """(producer id, epoch, first seq, last seq) from the first and last record of a records section.

    Only the first and last records are parsed: an idempotent batch is one chunk with contiguous sequences.
    Returns None when the first record has no producer or sequence numbers are 0 (no dedup), or the
    records are not CBV2 records (e.g. a broker-internal topic).
    """
    try:
        first = record_producer(body, 4)
        if first is None or first[1] == 0:
            return None
        pos = 0
        for _ in range(record_count - 1):
            pos += 4 + _U32.unpack_from(body, pos)[0]
        last = record_producer(body, pos + 4)
    except (struct.error, ValueError):
        return None
    if last is None or last[0] != first[0] or last[2] != first[2]:
        return None
    return first[0], first[2], first[1], last[1]
