"""Idempotent producer state per partition (spec section 9, facts decision 13).

Per (producer id, partition) the broker keeps the producer epoch, the last sequence number and the last
five batches (first seq, last seq, first offset). A batch is checked before anything is appended:

* lower epoch: ``stale_producer_epoch`` (fenced);
* higher epoch: fences the old session and must start at sequence 1;
* an exact repeat of a remembered batch: a duplicate, answered with the offsets first assigned;
* first sequence = last sequence + 1: appended;
* anything else: ``idempotency_gap`` (no append).

State is updated when the batch is handed to the writer (so pipelined batches from several connections
chain correctly), rebuilt from the log at startup and dropped after ``producer_state_ttl_ms`` idle.
"""

from __future__ import annotations

import json
import struct
from collections import deque
from dataclasses import dataclass, field

from cursus.wire.errors import BrokerError

#: How many recent batches per producer are remembered for duplicate detection (Kafka uses 5 as well).
REMEMBERED_BATCHES = 5
#: Producer-state snapshot written at clean shutdown, consumed (deleted) at the next start.
SNAPSHOT_NAME = "producer-state.json"
SNAPSHOT_VERSION = 1


@dataclass(slots=True)
class ProducerEntry:
    """Sequence state of one producer id on one partition."""

    epoch: int
    last_seq: int
    last_active_ms: int
    batches: deque[tuple[int, int, int]] = field(default_factory=lambda: deque(maxlen=REMEMBERED_BATCHES))


@dataclass(frozen=True, slots=True)
class Duplicate:
    """The batch repeats one already appended at ``first_offset``."""

    first_offset: int


class ProducerStateTable:
    """Producer sequence state of one partition. Loop thread only."""

    def __init__(self, ttl_ms: int) -> None:
        self.ttl_ms = ttl_ms
        self.entries: dict[str, ProducerEntry] = {}

    def check(self, producer_id: str, epoch: int, first_seq: int, last_seq: int, now_ms: int) -> Duplicate | None:
        """Validate a batch against the state; return :class:`Duplicate` or None (append it).

        Raises:
            BrokerError: ``stale_producer_epoch`` or ``idempotency_gap``; ``invalid_seq_num`` when
                ``first_seq < 1`` or ``last_seq < first_seq``.
        """
        if first_seq < 1 or last_seq < first_seq:
            raise BrokerError.of("invalid_seq_num", producer=producer_id, seq_start=first_seq, seq_end=last_seq)
        entry = self.entries.get(producer_id)
        if entry is not None and now_ms - entry.last_active_ms > self.ttl_ms:
            del self.entries[producer_id]
            entry = None
        if entry is None or epoch > entry.epoch:
            if first_seq != 1:
                raise BrokerError.of(
                    "idempotency_gap", producer=producer_id, epoch=epoch, expected=1, got=first_seq,
                    reason="a new producer session must start at seqNum=1",
                )
            return None
        if epoch < entry.epoch:
            raise BrokerError.of("stale_producer_epoch", producer=producer_id, current=entry.epoch, got=epoch)
        for b_first, b_last, b_offset in entry.batches:
            if b_first == first_seq and b_last == last_seq:
                entry.last_active_ms = now_ms
                return Duplicate(b_offset)
        if first_seq != entry.last_seq + 1:
            raise BrokerError.of(
                "idempotency_gap", producer=producer_id, epoch=epoch, expected=entry.last_seq + 1, got=first_seq,
            )
        return None

    def record(self, producer_id: str, epoch: int, first_seq: int, last_seq: int, first_offset: int,
               now_ms: int) -> None:
        """Remember an appended batch (after :meth:`check` allowed it, or while rebuilding from the log)."""
        entry = self.entries.get(producer_id)
        if entry is None or epoch != entry.epoch:
            if entry is not None and epoch < entry.epoch:
                return  # a fenced session's record seen during rebuild; the newer epoch wins
            entry = ProducerEntry(epoch=epoch, last_seq=0, last_active_ms=now_ms)
            self.entries[producer_id] = entry
        entry.last_seq = last_seq
        entry.last_active_ms = now_ms
        entry.batches.append((first_seq, last_seq, first_offset))

    def to_snapshot(self, end_offset: int) -> bytes:
        """Serialize the table as of ``end_offset`` (the partition's LEO) for a clean restart."""
        producers = {
            pid: {"epoch": e.epoch, "last_seq": e.last_seq, "last_active_ms": e.last_active_ms,
                  "batches": [list(b) for b in e.batches]}
            for pid, e in self.entries.items()
        }
        return json.dumps({"version": SNAPSHOT_VERSION, "end_offset": end_offset, "producers": producers},
                          separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_snapshot(cls, data: bytes, ttl_ms: int) -> tuple[ProducerStateTable, int]:
        """Parse :meth:`to_snapshot` output; returns (table, end_offset). Raises ValueError/KeyError/TypeError."""
        doc = json.loads(data)
        if doc.get("version") != SNAPSHOT_VERSION:
            raise ValueError(f"unsupported producer snapshot version {doc.get('version')!r}")
        table = cls(ttl_ms)
        for pid, e in doc["producers"].items():
            entry = ProducerEntry(epoch=int(e["epoch"]), last_seq=int(e["last_seq"]),
                                  last_active_ms=int(e["last_active_ms"]))
            entry.batches.extend((int(f), int(last), int(o)) for f, last, o in e["batches"])
            table.entries[str(pid)] = entry
        return table, int(doc["end_offset"])

    def expire(self, now_ms: int) -> int:
        """Drop producers idle longer than the TTL; return how many were dropped."""
        stale = [pid for pid, e in self.entries.items() if now_ms - e.last_active_ms > self.ttl_ms]
        for pid in stale:
            del self.entries[pid]
        return len(stale)


_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_PRODUCER_TAIL = struct.Struct(">Qq")


def record_producer(record: bytes | memoryview, start: int = 0) -> tuple[str, int, int] | None:
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


def chunk_producer_span(body: bytes | memoryview, record_count: int) -> tuple[str, int, int, int] | None:
    """(producer id, epoch, first seq, last seq) from the first and last record of a records section.

    Only the first and last records are parsed: an idempotent batch is one chunk with contiguous sequences.
    Returns None when the first record has no producer or sequence numbers are 0 (no dedup).
    """
    first = record_producer(body, 4)
    if first is None or first[1] == 0:
        return None
    pos = 0
    for _ in range(record_count - 1):
        pos += 4 + _U32.unpack_from(body, pos)[0]
    last = record_producer(body, pos + 4)
    if last is None or last[0] != first[0] or last[2] != first[2]:
        return None
    return first[0], first[2], first[1], last[1]
