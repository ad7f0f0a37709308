"""The broker's hot path for CBV2 batches: validate and index without per-record objects.

``scan_batch`` accepts and rejects exactly what :func:`cursus.wire.batch.decode_batch` does (facts B3.1,
B3.2) and returns a :class:`BatchView` with the absolute position of each record's offset field, so that
``stamp_offsets`` can write the assigned offsets into the received bytes, which are then stored and served
as they are (ARCHITECTURE principle 3). ``decode_batch_records`` is the consumer's side of the same scan:
validated once, then one caller-made object per record, read straight from the bytes.
"""

from __future__ import annotations

import array
import functools
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import TypeVar

from cursus.wire.batch import (
    _FIXED,
    _MIN_RECORD_BYTES,
    _OPTIONAL_FIELDS,
    _PRESENCE_MASKS,
    _RECORD_HEAD,
    _SEQ_EPOCH,
    _U32,
    _U64,
    BATCH_FLAG_IDEMPOTENT,
    RECORD_VERSION_2,
    TRANSACTIONAL_PRESENCE_MASK,
    Presence,
    Record,
    _BatchHead,
    _read_batch_head,
    _read_text,
    decode_record,
)
from cursus.wire.errors import InvalidFrame, LocalProtocolError

_T = TypeVar("_T")

# Below this many records the per-column checks of the uniform fast path cost more than
# the per-record template walk they replace (measured: ~0.7 us per column).
_UNIFORM_MIN_RECORDS = 64


@dataclass(frozen=True, slots=True)
class BatchView:
    """What ``scan_batch`` learns about a valid batch, without per-record objects.

    ``records_offset`` is the buffer index where the records section (u32 length +
    record bytes, repeated) starts; it runs to the end of the buffer.
    ``offset_positions[i]`` is the absolute buffer index of record i's u64 offset field (a ``range``
    when the records are a matrix: ``uniform_stride`` apart).
    ``producer_id``/``producer_epoch``/``first_seq`` come from the first record's
    producer group and ``last_seq`` from the last record's (None/0 when absent).
    ``uniform_producer``: every record has the same producer id and epoch and the
    sequence numbers are contiguous. ``has_transactional``: some record has a presence
    bit in 7-14. ``max_record_size``: the largest record length in bytes (without its
    u32 length prefix). ``uniform_stride``: when non-zero, every record is this many
    bytes long (with its length prefix) and equals the first record outside its offset,
    payload bytes, timestamp and sequence fields (the records section is a matrix).
    """

    flags: int
    idempotent: bool
    topic: str
    partition: int
    acks: str
    seq_start: int
    seq_end: int
    record_count: int
    records_offset: int
    offset_positions: array.array | list[int] | range
    producer_id: str | None
    producer_epoch: int
    first_seq: int
    last_seq: int
    uniform_producer: bool
    has_transactional: bool
    max_record_size: int
    uniform_stride: int = 0


# ----------------------------------------------------------------------------------------
# The broker hot path: validate and index without per-record objects.
#
# Three tiers, all with the acceptance rules of decode_batch:
# 1. strict walk (_walk_record): any record, field by field, following a per-presence
#    plan of steps;
# 2. template walk: a record shaped like the first one (same version and presence,
#    identical bytes outside the offset, payload, timestamp and seq fields) is checked
#    with a few bytes.startswith calls. The groups after the producer group (key,
#    event type, ...) are compared with the first record's bytes and, when they differ
#    (typically a per-record key), walked with the strict plan. A record whose head or
#    producer group differs falls back to 1;
# 3. uniform batch: when every record also has the first one's length, the records
#    section is a byte matrix with a fixed row stride, and each constant byte column is
#    checked at once with an extended slice (C speed); any difference falls back to 2.
# A record accepted by 2 or 3 differs from the strictly validated first record only in
# fixed-width integers (every value is valid) and opaque payload bytes, so it is valid.
# Its strings (topic, producer id, key, ...) are byte-identical to the first record's,
# whose UTF-8 was checked once.

_Buffer = bytes | bytearray
_PARTITION_OFFSET_LENGTH = struct.Struct(">iQI")
_STEP_TEXT = -1
_STEP_BLOB = -2
_STEP_PRODUCER = -3
_STEP_CODES = MappingProxyType({"str": _STEP_TEXT, "bytes": _STEP_BLOB, "producer": _STEP_PRODUCER})
_Plan = tuple[tuple[int, str], ...]
_Walked = tuple[int, int, bytes | None, int, int]  # presence, payload end, producer id, seq, epoch


@functools.cache  # presence is checked against its version's mask first: a handful of values
def _plan_for(presence: int) -> _Plan:
    """The optional-group steps for ``presence``: (fixed size or _STEP_* code, field name)."""
    return tuple(
        (_STEP_CODES.get(encoding) or _FIXED[encoding].size, attribute)
        for bit, attribute, encoding in _OPTIONAL_FIELDS
        if presence & bit
    )


def _walk_optional(buf: _Buffer, pos: int, end: int, plan: _Plan) -> tuple[int, bytes | None, int, int]:
    """Walk the optional groups; return (end position, producer id bytes, seq, epoch)."""
    producer_id: bytes | None = None
    seq = epoch = 0
    for step, name in plan:
        if step > 0:
            pos += step
            if pos > end:
                raise InvalidFrame(f"record truncated in {name}")
            continue
        if pos + 4 > end:
            raise InvalidFrame(f"record truncated before {name} length")
        (length,) = _U32.unpack_from(buf, pos)
        pos += 4
        if length > end - pos:
            raise InvalidFrame(f"{name} length {length} exceeds the record")
        field_end = pos + length
        if step != _STEP_BLOB:
            raw = buf[pos:field_end]
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidFrame(f"{name} is not valid UTF-8") from exc
            if step == _STEP_PRODUCER:
                producer_id = bytes(raw)
                if field_end + _SEQ_EPOCH.size > end:
                    raise InvalidFrame("record truncated in producer seq/epoch")
                seq, epoch = _SEQ_EPOCH.unpack_from(buf, field_end)
                field_end += _SEQ_EPOCH.size
        pos = field_end
    return pos, producer_id, seq, epoch


def _walk_record(buf: _Buffer, start: int, end: int, head: _BatchHead, plans: dict[int, _Plan]) -> _Walked:
    """Tier 1: validate ``buf[start:end]`` as decode_record + decode_batch would."""
    if end - start < _MIN_RECORD_BYTES:
        raise InvalidFrame(f"record of {end - start} bytes is shorter than the minimum {_MIN_RECORD_BYTES}")
    version, presence = _RECORD_HEAD.unpack_from(buf, start)
    mask = _PRESENCE_MASKS.get(version)
    if mask is None:
        raise InvalidFrame(f"record version {version} is not 2 or 3")
    if presence & ~mask:
        raise InvalidFrame(f"record version {version} has unknown presence bits 0x{presence & ~mask:x}")
    pos = start + _RECORD_HEAD.size
    if not buf.startswith(head.topic_field, pos, end):
        _read_text(buf, pos, end, "record topic")  # same verdict as decode_batch for a bad string
        raise InvalidFrame("record topic differs from the batch's")
    pos += len(head.topic_field)
    if pos + _PARTITION_OFFSET_LENGTH.size > end:
        raise InvalidFrame("record truncated before its payload")
    partition, _, payload_length = _PARTITION_OFFSET_LENGTH.unpack_from(buf, pos)
    if partition != head.partition:
        raise InvalidFrame("record partition differs from the batch's")
    pos += _PARTITION_OFFSET_LENGTH.size
    if payload_length > end - pos:
        raise InvalidFrame(f"record payload length {payload_length} exceeds the record")
    payload_end = pos + payload_length
    plan = plans.get(presence)
    if plan is None:
        plan = plans[presence] = _plan_for(presence)
    pos, producer_id, seq, epoch = _walk_optional(buf, payload_end, end, plan)
    if pos != end:
        raise InvalidFrame(f"record has {end - pos} trailing bytes")
    return presence, payload_end, producer_id, seq, epoch


@dataclass(frozen=True, slots=True)
class _Template:
    """The shape of the first record, used to check the others cheaply (tier 2 and 3).

    ``head`` is the record's first bytes up to its offset field. The tail (everything
    after the payload) is a fixed part - timestamp and producer group, whose positions
    below are relative to the payload end - then a suffix: the remaining groups.
    """

    head: bytes  # version + presence + topic field + partition
    tail_length: int  # fixed part + suffix of the first record
    fixed_length: int
    fixed_segments: tuple[tuple[int, bytes], ...]  # constant (relative position, bytes)
    tail_free: tuple[tuple[int, int], ...]  # [low, high) that may differ: timestamp, seq
    seq_at: int  # relative position of the u64 seq in the tail, -1 without producer
    suffix: bytes  # the first record's groups after the producer group
    suffix_plan: _Plan


def _make_template(buf: _Buffer, start: int, end: int, walked: _Walked, head_length: int) -> _Template:
    presence, payload_end, producer_id, _, _ = walked
    free: list[tuple[int, int]] = []
    seq_at = -1
    fixed_length = 0
    if presence & Presence.TIMESTAMP:
        free.append((0, 8))
        fixed_length = 8
    if producer_id is not None:
        seq_at = fixed_length + 4 + len(producer_id)
        free.append((seq_at, seq_at + 8))
        fixed_length = seq_at + 16
    tail = bytes(buf[payload_end:end])
    segments = []
    position = 0
    for low, high in [*free, (fixed_length, fixed_length)]:
        if low > position:
            segments.append((position, tail[position:low]))
        position = high
    return _Template(
        head=bytes(buf[start : start + head_length]),
        tail_length=len(tail),
        fixed_length=fixed_length,
        fixed_segments=tuple(segments),
        tail_free=tuple(free),
        seq_at=seq_at,
        suffix=tail[fixed_length:],
        suffix_plan=_plan_for(presence & ~(Presence.TIMESTAMP | Presence.PRODUCER)),
    )


@dataclass(slots=True)
class _Stats:
    """Per-batch aggregates gathered while scanning."""

    producer_id: bytes | None
    producer_epoch: int
    first_seq: int
    last_seq: int
    uniform_producer: bool
    presence_union: int
    max_record_size: int
    uniform_stride: int = 0

    def add_walked(self, walked: _Walked, index: int, length: int) -> None:
        """Fold in a record that went through the strict walk."""
        presence, _, producer_id, seq, epoch = walked
        self.presence_union |= presence
        self.max_record_size = max(self.max_record_size, length)
        self.last_seq = seq if producer_id is not None else 0
        if producer_id is None or producer_id != self.producer_id or epoch != self.producer_epoch:
            self.uniform_producer = False
        elif seq != self.first_seq + index:
            self.uniform_producer = False


def _scan_uniform(buf: _Buffer, head: _BatchHead, template: _Template, stride: int, stats: _Stats) -> range | None:
    """Tier 3: check all records of one length as a byte matrix; None if one differs."""
    count = head.record_count
    first = head.records_offset
    head_length = len(template.head)
    tail_start = stride - template.tail_length
    free = [(4 + head_length, 4 + head_length + 8), (4 + head_length + 12, tail_start)]
    free.extend((tail_start + low, tail_start + high) for low, high in template.tail_free)
    column = 0
    for low, high in [*free, (stride, stride)]:
        for j in range(column, low):
            if buf[first + j :: stride] != bytes((buf[first + j],)) * count:
                return None
        column = max(column, high)
    if template.seq_at >= 0:
        seq_column = first + tail_start + template.seq_at
        (stats.last_seq,) = _U64.unpack_from(buf, seq_column + stride * (count - 1))
        if stats.last_seq != stats.first_seq + count - 1:  # also covers a run past 2**64 - 1
            stats.uniform_producer = False
        elif stats.uniform_producer:
            expected = array.array("Q", range(stats.first_seq, stats.first_seq + count))
            if sys.byteorder == "little":
                expected.byteswap()
            raw = expected.tobytes()
            stats.uniform_producer = all(buf[seq_column + k :: stride] == raw[k::8] for k in range(8))
    start = first + 4 + head_length
    return range(start, start + stride * count, stride)


def _next_record(buf: _Buffer, pos: int, index: int) -> tuple[int, int, int]:
    """Read record ``index``'s length prefix at ``pos``; return (length, start, end)."""
    if pos + 4 > len(buf):
        raise InvalidFrame(f"records section truncated before record {index} length")
    (length,) = _U32.unpack_from(buf, pos)
    start = pos + 4
    if length > len(buf) - start:
        raise InvalidFrame(f"record {index} length {length} exceeds the batch")
    return length, start, start + length


def _scan_records(buf: _Buffer, head: _BatchHead) -> tuple[array.array | range, _Stats]:
    """Validate every record; collect offset positions and aggregates."""
    count = head.record_count
    size = len(buf)
    if count == 0:
        if head.records_offset != size:
            raise InvalidFrame(f"batch has {size - head.records_offset} trailing bytes after its records")
        return array.array("Q"), _Stats(None, 0, 0, 0, False, 0, 0)
    plans: dict[int, _Plan] = {}
    head_length = _RECORD_HEAD.size + len(head.topic_field) + 4
    length, start, end = _next_record(buf, head.records_offset, 0)
    walked = _walk_record(buf, start, end, head, plans)
    presence, _, producer_id, seq, epoch = walked
    stats = _Stats(producer_id, epoch, seq, seq, producer_id is not None, presence, length)
    if count == 1:  # a lone record (one-at-a-time publishes): no template to build for the others
        if end != size:
            raise InvalidFrame(f"batch has {size - end} trailing bytes after its records")
        return array.array("Q", (start + head_length,)), stats
    template = _make_template(buf, start, end, walked, head_length)
    stride = 4 + length
    if count >= _UNIFORM_MIN_RECORDS and size - head.records_offset == stride * count:
        matrix = _scan_uniform(buf, head, template, stride, stats)
        if matrix is not None:
            stats.uniform_stride = stride
            return matrix, stats
    positions = array.array("Q", (start + head_length,))
    end = _scan_template(buf, head, template, plans, stats, positions, end)
    if end != size:
        raise InvalidFrame(f"batch has {size - end} trailing bytes after its records")
    return positions, stats


def _scan_template(
    buf: _Buffer,
    head: _BatchHead,
    template: _Template,
    plans: dict[int, _Plan],
    stats: _Stats,
    positions: array.array,
    pos: int,
) -> int:
    """Tier 2 over records 1..count-1 starting at ``pos``; return the end position.

    Written as one flat loop with locals: this is the per-record cost of a PUBLISH.
    """
    size = len(buf)
    startswith = buf.startswith
    unpack_u32 = _U32.unpack_from
    unpack_u64 = _U64.unpack_from
    append = positions.append
    head_bytes = template.head
    head_length = len(head_bytes)
    payload_length_at = head_length + 8
    payload_at = head_length + 12
    fixed_length = template.fixed_length
    length_min = payload_at + fixed_length
    segments = template.fixed_segments
    suffix = template.suffix
    suffix_length = len(suffix)
    suffix_plan = template.suffix_plan
    seq_at = template.seq_at
    first_seq = stats.first_seq
    largest = stats.max_record_size
    for index in range(1, head.record_count):
        if pos + 4 > size:
            raise InvalidFrame(f"records section truncated before record {index} length")
        (length,) = unpack_u32(buf, pos)
        start = pos + 4
        pos = start + length
        if pos > size:
            raise InvalidFrame(f"record {index} length {length} exceeds the batch")
        if length >= length_min and startswith(head_bytes, start):
            (payload_length,) = unpack_u32(buf, start + payload_length_at)
            tail = start + payload_at + payload_length
            suffix_at = tail + fixed_length
            if suffix_at <= pos:
                for relative, segment in segments:
                    if not startswith(segment, tail + relative):
                        break
                else:
                    if (pos - suffix_at != suffix_length or not startswith(suffix, suffix_at)) and (
                        _walk_optional(buf, suffix_at, pos, suffix_plan)[0] != pos
                    ):
                        raise InvalidFrame(f"record {index} has trailing bytes")
                    append(start + head_length)
                    if length > largest:
                        largest = length
                    if seq_at < 0:
                        stats.last_seq = 0
                        continue
                    (seq,) = unpack_u64(buf, tail + seq_at)
                    stats.last_seq = seq
                    if seq != first_seq + index:
                        stats.uniform_producer = False
                    continue
        stats.add_walked(_walk_record(buf, start, pos, head, plans), index, length)
        append(start + head_length)
    stats.max_record_size = max(largest, stats.max_record_size)
    return pos


def scan_batch(data: bytes | bytearray | memoryview) -> BatchView:
    """Validate a whole batch like ``decode_batch`` and index it without record objects.

    Checks magic, version, flags, acks, record count, and for every record: version 2/3,
    presence bits allowed for the version, topic and partition equal to the batch's,
    every field walked (UTF-8 strings), no trailing bytes in a record or the batch.
    Raises ``InvalidFrame`` with a precise message. ``memoryview`` input is copied once;
    positions in the result index the caller's buffer either way (facts B3.1, B3.2).
    """
    buf: _Buffer = data if isinstance(data, bytes | bytearray) else bytes(data)
    head = _read_batch_head(buf)
    positions, stats = _scan_records(buf, head)
    return BatchView(
        flags=head.flags,
        idempotent=bool(head.flags & BATCH_FLAG_IDEMPOTENT),
        topic=head.topic,
        partition=head.partition,
        acks=head.acks,
        seq_start=head.seq_start,
        seq_end=head.seq_end,
        record_count=head.record_count,
        records_offset=head.records_offset,
        offset_positions=positions,
        producer_id=None if stats.producer_id is None else stats.producer_id.decode("utf-8"),
        producer_epoch=stats.producer_epoch,
        first_seq=stats.first_seq,
        last_seq=stats.last_seq,
        uniform_producer=stats.uniform_producer,
        has_transactional=bool(stats.presence_union & TRANSACTIONAL_PRESENCE_MASK),
        max_record_size=stats.max_record_size,
        uniform_stride=stats.uniform_stride,
    )


def record_offset_field_position(topic_length: int) -> int:
    """Index of the u64 offset field inside a record: 2 + 8 + 4 + topic_length + 4.

    ``topic_length`` is the topic's UTF-8 byte length (facts B3.2).
    """
    return _RECORD_HEAD.size + 4 + topic_length + 4


_U64_MAX = (1 << 64) - 1
# Below this many positions the per-position loop beats building the column slices.
_STAMP_COLUMNS_MIN = 64


def stamp_offsets(buf: bytearray | memoryview, positions: array.array | list[int] | range, base_offset: int) -> None:
    """Write ``base_offset + i`` as a big-endian u64 at ``positions[i]`` in ``buf``.

    ``positions`` normally comes from ``BatchView.offset_positions``. When they form an
    arithmetic progression (a uniform batch) the offsets are written one byte column at a
    time with extended-slice assignment; otherwise one ``pack_into`` per record. Raises
    ``LocalProtocolError`` if an offset does not fit in u64 or a position is outside
    ``buf``.
    """
    count = len(positions)
    if count == 0:
        return
    if base_offset < 0 or base_offset + count - 1 > _U64_MAX:
        raise LocalProtocolError(f"offsets {base_offset}..{base_offset + count - 1} do not fit in u64")
    with memoryview(buf) as view:
        target = view if view.format == "B" and view.ndim == 1 else view.cast("B")
        # strided assignment into a bytearray is about 4x faster than into a memoryview of it
        if count >= _STAMP_COLUMNS_MIN and _stamp_columns(buf if type(buf) is bytearray else target, positions,
                                                          base_offset):
            return
        pack_into = _U64.pack_into
        try:
            for index, position in enumerate(positions):
                if position < 0:
                    raise struct.error(f"negative position {position}")
                pack_into(target, position, base_offset + index)
        except struct.error as exc:
            raise LocalProtocolError(f"cannot stamp offsets: {exc}") from exc


def _stamp_columns(target: bytearray | memoryview, positions: array.array | list[int] | range,
                   base_offset: int) -> bool:
    """Stamp an arithmetic progression of positions column by column; False if it is not one."""
    count = len(positions)
    first = positions[0]
    stride = positions[1] - first
    last = positions[-1]
    if stride < 8 or first < 0 or last != first + stride * (count - 1) or last + 8 > len(target):
        return False
    if type(positions) is not range:  # a range is an arithmetic progression by construction
        expected_positions = range(first, last + 1, stride)
        if isinstance(positions, array.array):
            if positions != array.array(positions.typecode, expected_positions):
                return False
        elif list(positions) != list(expected_positions):
            return False
    offsets = array.array("Q", range(base_offset, base_offset + count))
    if sys.byteorder == "little":
        offsets.byteswap()
    raw = offsets.tobytes()
    for k in range(8):
        target[first + k : last + k + 1 : stride] = raw[k::8]
    return True


# ----------------------------------------------------------------------------------------
# The SDK's consume path: one object per record, built straight from the reply bytes.

_FAST_PRESENCE = 0b111  # timestamp, producer, key: the shapes producers write
_I64 = struct.Struct(">q")


def decode_batch_records(
    data: bytes | bytearray | memoryview,
    make: Callable[..., _T],
    make_other: Callable[[Record], _T],
) -> tuple[str, int, list[_T]]:
    """Validate a batch exactly like ``decode_batch`` and build one object per record.

    ``scan_batch`` validates (its uniform and template tiers make this cheap); the
    records are then read without re-checking. A version 2 record carrying only
    timestamp, producer and key fields becomes ``make(topic, partition, offset, payload,
    key, timestamp, producer_id, seq_num, producer_epoch)`` (missing fields None,
    seq/epoch 0); any other record is decoded by :func:`decode_record` and becomes
    ``make_other(record)``. Payloads are ``bytes`` slices of the input.

    Returns ``(topic, partition, objects)`` in record order. Raises ``InvalidFrame`` for
    anything ``decode_batch`` rejects.
    """
    buf = data if isinstance(data, bytes) else bytes(data)
    view = scan_batch(buf)
    topic, partition = view.topic, view.partition
    topic_length = len(topic.encode("utf-8"))
    back = _RECORD_HEAD.size + 4 + topic_length + 4  # offset field -> record start
    if view.uniform_stride:
        uniform = _decode_uniform(buf, view, back, make)
        if uniform is not None:
            return topic, partition, uniform
    # version, presence, (topic field, partition skipped), offset, payload length: one unpack.
    head = struct.Struct(f">HQ{4 + topic_length + 4}xQI")
    unpack_head = head.unpack_from
    unpack_u32 = _U32.unpack_from
    unpack_i64 = _I64.unpack_from
    unpack_seq_epoch = _SEQ_EPOCH.unpack_from
    startswith = buf.startswith
    last_producer_raw = b""
    last_producer: str | None = None
    out: list[_T] = []
    append = out.append
    for at in view.offset_positions:
        start = at - back
        version, presence, offset, length = unpack_head(buf, start)
        pos = at + 12
        end_payload = pos + length
        if version != RECORD_VERSION_2 or presence & ~_FAST_PRESENCE:
            (record_length,) = unpack_u32(buf, start - 4)
            append(make_other(decode_record(buf[start : start + record_length])))
            continue
        value = buf[pos:end_payload]
        pos = end_payload
        timestamp = None
        if presence & 1:
            (timestamp,) = unpack_i64(buf, pos)
            pos += 8
        producer_id = None
        seq_num = epoch = 0
        if presence & 2:
            (size,) = unpack_u32(buf, pos)
            if not (size + 4 == len(last_producer_raw) and startswith(last_producer_raw, pos)):
                last_producer_raw = buf[pos : pos + 4 + size]
                last_producer = last_producer_raw[4:].decode("utf-8")  # validated by scan_batch
            producer_id = last_producer
            pos += 4 + size
            seq_num, epoch = unpack_seq_epoch(buf, pos)
            pos += 16
        key = None
        if presence & 4:
            (size,) = unpack_u32(buf, pos)
            key = buf[pos + 4 : pos + 4 + size].decode("utf-8")
        append(make(topic, partition, offset, value, key, timestamp, producer_id, seq_num, epoch))
    return topic, partition, out


def _decode_uniform(buf: bytes, view: BatchView, back: int, make: Callable[..., _T]) -> list[_T] | None:
    """Records of a matrix-shaped batch (``uniform_stride``) in one ``struct.iter_unpack`` pass.

    Every record equals the first outside offset, payload, timestamp and sequence, so one
    format reads all of them; the strings (producer id, key) are the first record's.
    None when the first record is not a fast shape.
    """
    start = view.records_offset + 4
    version, presence = _RECORD_HEAD.unpack_from(buf, start)
    if version != RECORD_VERSION_2 or presence & ~_FAST_PRESENCE:
        return None
    pos = start + back + 8
    (payload_length,) = _U32.unpack_from(buf, pos)
    pos += 4 + payload_length
    layout = [f">{4 + back}xQ4x{payload_length}s"]
    if presence & 1:
        layout.append("q")
        pos += 8
    producer_id = None
    epoch = 0
    if presence & 2:
        (size,) = _U32.unpack_from(buf, pos)
        producer_id = buf[pos + 4 : pos + 4 + size].decode("utf-8")
        pos += 4 + size
        (epoch,) = _I64.unpack_from(buf, pos + 8)
        layout.append(f"{4 + size}xQ8x")
        pos += 16
    key = None
    if presence & 4:
        (size,) = _U32.unpack_from(buf, pos)
        key = buf[pos + 4 : pos + 4 + size].decode("utf-8")
    record_end = view.records_offset + view.uniform_stride
    if record_end > pos:
        layout.append(f"{record_end - pos}x")
    rows = struct.iter_unpack("".join(layout), memoryview(buf)[view.records_offset :])
    topic, partition = view.topic, view.partition
    if presence == 2:
        return [make(topic, partition, offset, value, None, None, producer_id, seq, epoch)
                for offset, value, seq in rows]
    if presence & 3 == 3:
        return [make(topic, partition, offset, value, key, ts, producer_id, seq, epoch)
                for offset, value, ts, seq in rows]
    if presence & 1:
        return [make(topic, partition, offset, value, key, ts, None, 0, 0) for offset, value, ts in rows]
    if presence & 2:
        return [make(topic, partition, offset, value, key, None, producer_id, seq, epoch)
                for offset, value, seq in rows]
    return [make(topic, partition, offset, value, key, None, None, 0, 0) for offset, value in rows]
