"""The per-partition transaction index and the read_committed filter (pure; no I/O).

Per partition: the *unresolved* transactions (producer id -> first offset, the offsets it wrote, its
transactional id and epoch) and the *hidden* offsets (records of aborted transactions and every marker) as
sorted disjoint ``[start, end)`` ranges. A transaction stays unresolved (it pins the last stable offset)
from its first record until the coordinator's final decision: a commit marker alone does not expose it
(:meth:`PartitionTxnIndex.on_marker` with ``final=False``, then :meth:`PartitionTxnIndex.finalize`).

``LSO = min(first offset of every unresolved transaction, HWM)``; read_committed never reads at or past it
and drops hidden records below it. A partition that never held a transactional record has no index at
all, so a plain read takes exactly the old path.

Rebuilt from the log at startup (the coordinator feeds every stored record in): markers found in the log are final (the
coordinator's recovery finishes any prepared commit before the broker is ready).
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

_U32 = struct.Struct(">I")


@dataclass(slots=True)
class OpenTxn:
    """One unresolved transaction on one partition."""

    transactional_id: str
    producer_epoch: int
    first_offset: int
    #: the offsets this transaction wrote here, as sorted disjoint [start, end) ranges
    ranges: list[list[int]] = field(default_factory=list)
    #: offset of its marker once written (None before); ``commit`` is the marker's decision
    marker_offset: int | None = None
    commit: bool = False
    #: seqNum -> offset of its data records here (a retried TXN_PUBLISH appends nothing)
    seqs: dict[int, int] = field(default_factory=dict)

    def add(self, offset: int) -> None:
        if self.ranges and self.ranges[-1][1] == offset:
            self.ranges[-1][1] = offset + 1
        else:
            self.ranges.append([offset, offset + 1])


class PartitionTxnIndex:
    """Open transactions, hidden ranges and the LSO of one partition."""

    def __init__(self) -> None:
        #: called after a transaction resolves (the LSO may have moved): the coordinator wakes readers
        self.on_resolved: Callable[[], None] | None = None
        self.open: dict[str, OpenTxn] = {}
        self._starts: list[int] = []
        self._ends: list[int] = []
        #: offsets of every marker, sorted (a reply may end on one so a consumer moves past it)
        self._markers: list[int] = []
        #: data records of committed transactions seen (for tests and metrics)
        self.committed_transactions = 0
        self.aborted_transactions = 0

    # ------------------------------------------------------------------------------------ updates

    def on_data(self, producer_id: str, offset: int, *, transactional_id: str, producer_epoch: int,
                seq_num: int = 0) -> None:
        """A transactional data record was appended at ``offset`` (``seq_num`` > 0: its TXN_PUBLISH seqNum)."""
        txn = self.open.get(producer_id)
        if txn is None or txn.marker_offset is not None:
            if txn is not None:  # a record after a pending marker: the old one resolves as decided
                self.finalize(producer_id)
            txn = self.open[producer_id] = OpenTxn(transactional_id, producer_epoch, offset)
        txn.add(offset)
        if seq_num > 0:
            txn.seqs[seq_num] = offset

    def published(self, producer_id: str, producer_epoch: int, seq_num: int) -> int | None:
        """The offset of the open transaction's record with ``seq_num`` in ``producer_epoch``, if any."""
        txn = self.open.get(producer_id)
        if txn is None or txn.producer_epoch != producer_epoch or txn.marker_offset is not None:
            return None
        return txn.seqs.get(seq_num)

    def on_marker(self, producer_id: str, offset: int, *, commit: bool, final: bool) -> None:
        """A marker was appended at ``offset`` for ``producer_id``'s transaction (hidden at once). With
        ``final`` the transaction resolves now, else at :meth:`finalize`."""
        self._hide(offset, offset + 1)
        bisect.insort(self._markers, offset)
        txn = self.open.get(producer_id)
        if txn is None:
            return
        txn.marker_offset, txn.commit = offset, commit
        if final:
            self.finalize(producer_id)

    def finalize(self, producer_id: str) -> None:
        """The coordinator's decision for ``producer_id``'s marked transaction is durable: resolve it
        (aborted records become hidden; the LSO moves on). No-op without a marked transaction."""
        txn = self.open.get(producer_id)
        if txn is None or txn.marker_offset is None:
            return
        del self.open[producer_id]
        if self.on_resolved is not None:
            self.on_resolved()
        if txn.commit:
            self.committed_transactions += 1
        else:
            self.aborted_transactions += 1
            for start, end in txn.ranges:
                self._hide(start, end)

    def unresolved(self, producer_id: str) -> OpenTxn | None:
        """The unresolved transaction of ``producer_id`` here, if any."""
        return self.open.get(producer_id)

    def needs_marker(self, producer_id: str) -> bool:
        """Has ``producer_id`` an open transaction here that no marker closed yet?"""
        txn = self.open.get(producer_id)
        return txn is not None and txn.marker_offset is None

    def _hide(self, start: int, end: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        if i > 0 and self._ends[i - 1] == start:  # extends the previous range
            self._ends[i - 1] = end
            if i < len(self._starts) and self._starts[i] == end:
                self._ends[i - 1] = self._ends[i]
                del self._starts[i], self._ends[i]
            return
        if i < len(self._starts) and self._starts[i] == end:
            self._starts[i] = start
            return
        self._starts.insert(i, start)
        self._ends.insert(i, end)

    def truncate(self, end_offset: int) -> None:
        """The log was truncated to ``end_offset``: forget what lay at or above it."""
        for pid in [p for p, t in self.open.items() if t.first_offset >= end_offset]:
            del self.open[pid]
        for txn in self.open.values():
            txn.ranges = [[s, min(e, end_offset)] for s, e in txn.ranges if s < end_offset]
            if txn.marker_offset is not None and txn.marker_offset >= end_offset:
                txn.marker_offset = None
        del self._markers[bisect.bisect_left(self._markers, end_offset):]
        i = bisect.bisect_left(self._starts, end_offset)
        del self._starts[i:], self._ends[i:]
        if self._ends and self._ends[-1] > end_offset:
            self._ends[-1] = end_offset

    # -------------------------------------------------------------------------------------- reads

    def lso(self, hwm: int) -> int:
        """The last stable offset: the first offset of the earliest unresolved transaction, capped by ``hwm``."""
        if not self.open:
            return hwm
        return min(hwm, min(t.first_offset for t in self.open.values()))

    def hidden_overlaps(self, start: int, end: int) -> bool:
        """Does any hidden range intersect ``[start, end)``?"""
        i = bisect.bisect_right(self._starts, start)
        if i > 0 and self._ends[i - 1] > start:
            return True
        return i < len(self._starts) and self._starts[i] < end

    def is_hidden(self, offset: int) -> bool:
        i = bisect.bisect_right(self._starts, offset)
        return i > 0 and self._ends[i - 1] > offset

    @property
    def hidden_ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends, strict=True))

    def hidden_slice(self, start: int, end: int) -> tuple[tuple[int, int], ...]:
        """The hidden ranges intersecting ``[start, end)`` (a snapshot another thread may filter with)."""
        i = bisect.bisect_right(self._starts, start)
        if i > 0 and self._ends[i - 1] > start:
            i -= 1
        j = bisect.bisect_left(self._starts, end)
        return tuple(zip(self._starts[i:j], self._ends[i:j], strict=True))


    def markers_slice(self, start: int, end: int) -> tuple[int, ...]:
        """Marker offsets in ``[start, end)``."""
        return tuple(self._markers[bisect.bisect_left(self._markers, start):bisect.bisect_left(self._markers, end)])


def filter_records(records: bytes, first_offset: int, count: int, hidden: tuple[tuple[int, int], ...],
                   markers: tuple[int, ...] = ()) -> tuple[bytes, int]:
    """Drop the records whose offsets lie in ``hidden`` (sorted disjoint ranges) from a records section
    (u32 length + record, ``count`` of them at offsets ``first_offset, first_offset + 1, ...``). Pure; any
    thread. Returns (section, kept count): the input itself when nothing is hidden.

    When the section ends with hidden records and its last record is a marker (offset in ``markers``), that
    marker is kept: clients advance to the last record's offset + 1 and skip markers by their payload
    (facts A6), so a partition whose tail is a marker never holds a consumer below it."""
    if count == 0 or not hidden:
        return records, count
    last = first_offset + count - 1
    i = bisect.bisect_left(markers, last)
    keep_last = i < len(markers) and markers[i] == last
    view = memoryview(records)
    unpack = _U32.unpack_from
    # the byte position of every record (one tight walk), then whole runs between hidden ranges
    starts = [0] * (count + 1)
    pos = 0
    for n in range(count):
        starts[n] = pos
        pos += 4 + unpack(view, pos)[0]
    starts[count] = pos
    parts: list[memoryview] = []
    kept = 0
    cursor = 0  # index of the first record not yet emitted or dropped
    for start, end in hidden:
        lo, hi = max(start - first_offset, 0), min(end - first_offset, count)
        if hi <= lo:
            continue
        if keep_last and hi == count:
            hi -= 1  # the final marker stays
        if lo > cursor:
            parts.append(view[starts[cursor]:starts[lo]])
            kept += lo - cursor
        cursor = max(cursor, hi)
    if cursor < count:
        parts.append(view[starts[cursor]:starts[count]])
        kept += count - cursor
    if kept == count:
        return records, count
    return b"".join(parts), kept
