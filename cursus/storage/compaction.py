"""The log-compaction planner: which records of the cleanable range survive a cleaner pass (pure, no I/O).

Rules (Kafka's log cleaner, spec "CREATE" cleanup_policy=compact, issue 18):

* The *cleanable range* is ``[log_start_offset, cleanable_end)``; ``cleanable_end`` is at most the HWM (the
  committed HWM in a cluster), the LSO (no record of an open transaction is ever touched) and the base of
  the active segment. Records at or above it are never planned.
* A keyed data record survives iff it is the latest non-aborted record of its key in the cleanable range
  (:func:`latest_offsets`). A later value in the active segment does not remove an older one yet: the next
  pass, once that segment is closed, does.
* A *tombstone* (a keyed record with an empty payload) that is the latest of its key survives until it is
  ``delete_retention_ms`` old (its chunk's append time), so consumers that lag by less than that see the
  delete; then it is removed too.
* Records without a key cannot be compacted and always survive.
* Records of aborted transactions (offsets in ``aborted``, every one below the LSO) are removed; they never
  supersede a committed value. Transaction markers (control records) always survive: startup replay of the
  transaction index needs the marker of every transaction that still has records (dropping markers of
  fully cleaned transactions after the retention window is left for later).
* Offsets never change: survivors keep their offsets and their order; a reader sees gaps (Kafka semantics).

A record is described by :class:`RecordInfo` (:func:`describe_record` decodes a stored CBV2 record). A pass
asks a :class:`Planner`: :class:`KeyPlanner` applies the rules above; ``__consumer_offsets`` uses the
group-aware :class:`cursus.coordinator.offsets_compaction.OffsetsPlanner`.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from cursus.wire.batch import RECORD_VERSION_2, RECORD_VERSION_3, TXN_CONTROL_MARKER_PAYLOAD, decode_record


@dataclass(frozen=True, slots=True)
class RecordInfo:
    """What the planner needs of one stored record.

    Attributes:
        offset: the record's offset.
        key: the record key (``None``: no key, never compacted).
        tombstone: the payload is empty (a delete of ``key``).
        marker: a transaction control record (always kept).
        time_ms: the append time of its chunk (ms since the epoch), for the tombstone window.
    """

    offset: int
    key: str | None
    tombstone: bool
    marker: bool
    time_ms: int


_HEAD = struct.Struct(">HQ")
_U32 = struct.Struct(">I")
_TRANSACTION_MARKER_BIT = 1 << 9


def describe_record(record: bytes | memoryview, offset: int, time_ms: int) -> RecordInfo:
    """Describe one stored CBV2 record (without its u32 length) as a :class:`RecordInfo`.

    Fast path: walks the head, topic, partition, offset and payload, then only the optional groups before
    the key (timestamp, producer) and the key itself (facts B3.2 field order); a marker is recognised by its
    ``transaction_marker`` presence bit or its payload. Anything unexpected falls back to the strict decoder
    (:func:`describe_record_strict`).

    Raises:
        InvalidFrame: the bytes are not a valid record (the chunk passed its CRC: a bug upstream).
    """
    view = memoryview(record)
    try:
        version, presence = _HEAD.unpack_from(view, 0)
        if version not in (RECORD_VERSION_2, RECORD_VERSION_3):
            return describe_record_strict(record, offset, time_ms)
        position = _HEAD.size
        position += _U32.size + _U32.unpack_from(view, position)[0] + 12  # topic, partition i32, offset u64
        payload_length = _U32.unpack_from(view, position)[0]
        payload_start = position + _U32.size
        position = payload_start + payload_length
        if presence & 1:  # timestamp i64
            position += 8
        if presence & 2:  # producer id string, seq u64, epoch i64
            position += _U32.size + _U32.unpack_from(view, position)[0] + 16
        key = None
        if presence & 4:
            key_length = _U32.unpack_from(view, position)[0]
            start = position + _U32.size
            if start + key_length > len(view):
                return describe_record_strict(record, offset, time_ms)
            key = bytes(view[start:start + key_length]).decode("utf-8")
        if position > len(view) or payload_start + payload_length > len(view):
            return describe_record_strict(record, offset, time_ms)
    except (struct.error, UnicodeDecodeError):
        return describe_record_strict(record, offset, time_ms)
    marker = bool(presence & _TRANSACTION_MARKER_BIT) or (
        payload_length == len(TXN_CONTROL_MARKER_PAYLOAD)
        and view[payload_start:payload_start + payload_length] == TXN_CONTROL_MARKER_PAYLOAD)
    return RecordInfo(offset, key, payload_length == 0, marker, time_ms)


def describe_record_strict(record: bytes | memoryview, offset: int, time_ms: int) -> RecordInfo:
    """:func:`describe_record` through the strict decoder (:func:`cursus.wire.batch.decode_record`).

    Raises:
        InvalidFrame: the bytes are not a valid record.
    """
    r = decode_record(record)
    marker = r.transaction_marker is not None or r.payload == TXN_CONTROL_MARKER_PAYLOAD
    return RecordInfo(offset, r.key, len(r.payload) == 0, marker, time_ms)


def in_ranges(offset: int, ranges: Sequence[tuple[int, int]]) -> bool:
    """True when ``offset`` lies in one of the sorted disjoint half-open ``ranges``."""
    slot = bisect.bisect_right(ranges, (offset, float("inf"))) - 1
    return slot >= 0 and ranges[slot][0] <= offset < ranges[slot][1]


def latest_offsets(records: Iterable[RecordInfo], aborted: Sequence[tuple[int, int]] = ()) -> dict[str, int]:
    """Key -> offset of its latest non-aborted data record (``records`` in offset order)."""
    latest: dict[str, int] = {}
    for record in records:
        if record.key is None or record.marker or (aborted and in_ranges(record.offset, aborted)):
            continue
        latest[record.key] = record.offset
    return latest


def keeps(record: RecordInfo, latest: dict[str, int], *, now_ms: int, delete_retention_ms: int,
          aborted: Sequence[tuple[int, int]] = ()) -> bool:
    """Whether ``record`` (inside the cleanable range) survives the pass; see the module rules."""
    if record.marker:
        return True
    if aborted and in_ranges(record.offset, aborted):
        return False
    if record.key is None:
        return True
    if latest.get(record.key) != record.offset:
        return False
    return not (record.tombstone and now_ms - record.time_ms >= delete_retention_ms)


def plan(records: Sequence[RecordInfo], *, now_ms: int, delete_retention_ms: int,
         aborted: Sequence[tuple[int, int]] = (), latest: dict[str, int] | None = None) -> list[int]:
    """Offsets of the survivors among ``records`` (offset order, all in the cleanable range), ascending.

    ``latest`` defaults to :func:`latest_offsets` of ``records`` (pass it when the map was built over a
    wider range than the records planned, as the cleaner does per segment).
    """
    if latest is None:
        latest = latest_offsets(records, aborted)
    return [r.offset for r in records
            if keeps(r, latest, now_ms=now_ms, delete_retention_ms=delete_retention_ms, aborted=aborted)]


class Planner(Protocol):
    """Decides a pass's survivors: :meth:`observe` sees every record of the cleanable range in offset order
    (the map phase), then :meth:`keeps` is asked about each of them (the copy phase, segment by segment)."""

    def observe(self, info: RecordInfo, record: bytes | memoryview) -> None:
        """Map phase: one stored CBV2 record (without its u32 length) and its description."""

    def keeps(self, info: RecordInfo) -> bool:
        """Copy phase: whether the record survives."""


class KeyPlanner:
    """The per-key :class:`Planner` of the module rules (latest non-aborted record per key, tombstones for
    ``delete_retention_ms``). Memory: one entry per key of the range."""

    def __init__(self, *, now_ms: int, delete_retention_ms: int, aborted: Sequence[tuple[int, int]] = ()) -> None:
        self.now_ms = now_ms
        self.delete_retention_ms = delete_retention_ms
        self.aborted = aborted
        #: key -> offset of its latest non-aborted data record (:func:`latest_offsets`).
        self.latest: dict[str, int] = {}

    def observe(self, info: RecordInfo, record: bytes | memoryview) -> None:
        """Map phase (see :class:`Planner`); ``record`` is not needed."""
        if info.key is None or info.marker or (self.aborted and in_ranges(info.offset, self.aborted)):
            return
        self.latest[info.key] = info.offset

    def keeps(self, info: RecordInfo) -> bool:
        """Copy phase: :func:`keeps`."""
        return keeps(info, self.latest, now_ms=self.now_ms, delete_retention_ms=self.delete_retention_ms,
                     aborted=self.aborted)


def runs(offsets: Sequence[int]) -> list[tuple[int, int]]:
    """Split ascending ``offsets`` into maximal contiguous runs ``(first_offset, count)``."""
    out: list[tuple[int, int]] = []
    for offset in offsets:
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((offset, 1))
    return out


def dirty_ratio(dirty_bytes: int, total_bytes: int) -> float:
    """Dirty bytes over the cleanable bytes (0.0 when there is nothing cleanable)."""
    return 0.0 if total_bytes <= 0 else dirty_bytes / total_bytes
