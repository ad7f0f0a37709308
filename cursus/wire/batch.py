"""CBV2 record batches and records (facts A5 5b, B3.1, B3.2; decision 2; spec section 5).

Batch (big-endian; strings and byte arrays are u32 length + bytes)::

    u32 magic 0x43425632 "CBV2" | u16 version 2 | u16 flags (bit 0 idempotent)
    topic string | i32 partition | acks string | u64 seq_start | u64 seq_end
    u32 record count (<= 100,000) | records: (u32 length + record bytes) * count

Record::

    u16 version (2 or 3) | u64 presence | topic string | i32 partition | u64 offset
    payload bytes | optional groups for each set presence bit, in bit order

Two ways in:

* ``decode_batch``/``decode_record`` build ``Batch``/``Record`` objects (SDK, tests).
* ``scan_batch`` (module :mod:`cursus.wire.scan`) is the broker's hot path: it
  validates the whole batch exactly as ``decode_batch`` would but builds no per-record
  objects; ``decode_batch_records`` builds the SDK's consumed records on top of it.
* ``RecordEncoder`` is the SDK producer's path out: precomputed record heads, no
  ``Record`` objects, bytes identical to ``encode_record``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import IntFlag
from types import MappingProxyType

from cursus.limits import BATCH_RECORDS_COUNT_MAX
from cursus.wire.errors import InvalidFrame, LocalProtocolError

BATCH_MAGIC = 0x43425632
BATCH_VERSION = 2
BATCH_FLAG_IDEMPOTENT = 0x0001
RECORD_VERSION_2 = 2
RECORD_VERSION_3 = 3
MAX_RECORDS_PER_BATCH = BATCH_RECORDS_COUNT_MAX
ACKS_VALUES = frozenset({"", "0", "none", "1", "-1", "all"})
"""acks strings a CBV2 header may carry (facts B1.5); ``none`` decodes like the Go codec."""

TXN_CONTROL_MARKER_PAYLOAD = b"__cursus_txn_control_marker__"


class Presence(IntFlag):
    """Record presence bits (facts B3.2). Bits 15-16 exist only in record version 3."""

    TIMESTAMP = 1 << 0
    PRODUCER = 1 << 1
    KEY = 1 << 2
    EVENT_TYPE = 1 << 3
    SCHEMA_VERSION = 1 << 4
    AGGREGATE_VERSION = 1 << 5
    METADATA = 1 << 6
    TRANSACTIONAL_ID = 1 << 7
    TRANSACTION_STATE = 1 << 8
    TRANSACTION_MARKER = 1 << 9
    CONTROL_TYPE = 1 << 10
    CONTROL_VERSION = 1 << 11
    CONTROL_COORDINATOR_EPOCH = 1 << 12
    CONTROL_KEY = 1 << 13
    CONTROL_VALUE = 1 << 14
    EVENT_ID = 1 << 15
    PAYLOAD_DIGEST = 1 << 16


PRESENCE_MASK_V2 = 0x7FFF
PRESENCE_MASK_V3 = 0x1FFFF
TRANSACTIONAL_PRESENCE_MASK = 0x7F80  # bits 7-14: transaction and control-record fields
_PRESENCE_MASKS = MappingProxyType({RECORD_VERSION_2: PRESENCE_MASK_V2, RECORD_VERSION_3: PRESENCE_MASK_V3})

# The optional groups in wire order: (bit, Record attribute, encoding). Plain ints, not
# Presence members, because IntFlag arithmetic is slow on the hot path.
_OPTIONAL_FIELDS: tuple[tuple[int, str, str], ...] = (
    (1 << 0, "timestamp", "i64"),
    (1 << 1, "producer_id", "producer"),  # producer_id string, seq_num u64, epoch i64
    (1 << 2, "key", "str"),
    (1 << 3, "event_type", "str"),
    (1 << 4, "schema_version", "u32"),
    (1 << 5, "aggregate_version", "u64"),
    (1 << 6, "metadata", "str"),
    (1 << 7, "transactional_id", "str"),
    (1 << 8, "transaction_state", "str"),
    (1 << 9, "transaction_marker", "str"),
    (1 << 10, "control_type", "str"),
    (1 << 11, "control_version", "i16"),
    (1 << 12, "control_coordinator_epoch", "i64"),
    (1 << 13, "control_key", "bytes"),
    (1 << 14, "control_value", "bytes"),
    (1 << 15, "event_id", "str"),
    (1 << 16, "payload_digest", "str"),
)
_FIXED = MappingProxyType(
    {"i64": struct.Struct(">q"), "u64": struct.Struct(">Q"), "u32": struct.Struct(">I"), "i16": struct.Struct(">h")}
)
_V3_ONLY_ATTRIBUTES = ("event_id", "payload_digest")

_U32 = struct.Struct(">I")
_I32 = struct.Struct(">i")
_U64 = struct.Struct(">Q")
_I32_U64 = struct.Struct(">iQ")  # record partition, offset
_BATCH_HEAD = struct.Struct(">IHH")
_BATCH_SEQS = struct.Struct(">QQI")  # seq_start, seq_end, record count
_RECORD_HEAD = struct.Struct(">HQ")  # version, presence
_SEQ_EPOCH = struct.Struct(">Qq")
_OFFSET_LENGTH = struct.Struct(">QI")  # record offset, payload length
_MIN_RECORD_BYTES = 2 + 8 + 4 + 4 + 8 + 4


@dataclass(slots=True)
class Record:
    """One record in object form (facts B3.2), for the SDK and tests, not the broker hot path.

    An optional field is present on the wire iff it is not None (the producer group iff
    ``producer_id`` is not None). ``payload`` is opaque bytes. ``version`` is kept on
    re-encode; a version-2 record carrying ``event_id``/``payload_digest`` is written as
    version 3 (decision 2).
    """

    topic: str
    partition: int
    payload: bytes
    offset: int = 0
    version: int = RECORD_VERSION_2
    timestamp: int | None = None
    producer_id: str | None = None
    seq_num: int = 0
    producer_epoch: int = 0
    key: str | None = None
    event_type: str | None = None
    schema_version: int | None = None
    aggregate_version: int | None = None
    metadata: str | None = None
    transactional_id: str | None = None
    transaction_state: str | None = None
    transaction_marker: str | None = None
    control_type: str | None = None
    control_version: int | None = None
    control_coordinator_epoch: int | None = None
    control_key: bytes | None = None
    control_value: bytes | None = None
    event_id: str | None = None
    payload_digest: str | None = None

    @property
    def presence(self) -> Presence:
        """The presence bitmap this record encodes with."""
        bits = 0
        for bit, attribute, _ in _OPTIONAL_FIELDS:
            if getattr(self, attribute) is not None:
                bits |= bit
        return Presence(bits)


@dataclass(slots=True)
class Batch:
    """A CBV2 batch in object form (facts B3.1). ``acks`` is one of ``ACKS_VALUES``."""

    topic: str
    partition: int
    acks: str
    records: list[Record]
    idempotent: bool = False
    seq_start: int = 0
    seq_end: int = 0


# ----------------------------------------------------------------------------------------
# Encoding


def _pack(layout: struct.Struct, *values: int) -> bytes:
    try:
        return layout.pack(*values)
    except struct.error as exc:
        raise LocalProtocolError(f"value out of range for {layout.format}: {values}") from exc


def _encode_text(value: str, what: str) -> bytes:
    if not isinstance(value, str):
        raise LocalProtocolError(f"{what} must be str, got {type(value).__name__}")
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise LocalProtocolError(f"{what} is not encodable as UTF-8") from exc
    return _U32.pack(len(raw)) + raw


def _encode_blob(value: bytes | bytearray | memoryview, what: str) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise LocalProtocolError(f"{what} must be bytes, got {type(value).__name__}")
    return _U32.pack(len(value)) + bytes(value)


def record_version_for(r: Record) -> int:
    """The version ``r`` encodes with: its own, raised to 3 when it carries a v3-only field."""
    if r.version not in _PRESENCE_MASKS:
        raise LocalProtocolError(f"record version {r.version} is not 2 or 3")
    if r.version == RECORD_VERSION_2 and any(getattr(r, name) is not None for name in _V3_ONLY_ATTRIBUTES):
        return RECORD_VERSION_3
    return r.version


def encode_record(r: Record) -> bytes:
    """Encode one record without its u32 length prefix (facts B3.2, decision 2).

    Raises ``LocalProtocolError`` for a version other than 2/3, values out of range for
    their wire type, non-UTF-8-encodable strings, or a non-zero seq/epoch without a
    producer id.
    """
    version = record_version_for(r)
    presence = 0
    groups: list[bytes] = []
    for bit, attribute, encoding in _OPTIONAL_FIELDS:
        value = getattr(r, attribute)
        if value is None:
            continue
        presence |= bit
        if encoding == "str":
            groups.append(_encode_text(value, attribute))
        elif encoding == "bytes":
            groups.append(_encode_blob(value, attribute))
        elif encoding == "producer":
            groups.append(_encode_text(value, attribute))
            groups.append(_pack(_SEQ_EPOCH, r.seq_num, r.producer_epoch))
        else:
            groups.append(_pack(_FIXED[encoding], value))
    if r.producer_id is None and (r.seq_num or r.producer_epoch):
        raise LocalProtocolError("seq_num/producer_epoch need a producer_id")
    payload = _encode_blob(r.payload, "payload")
    head = _pack(_RECORD_HEAD, version, presence) + _encode_text(r.topic, "topic")
    return b"".join((head, _pack(_I32_U64, r.partition, r.offset), payload, *groups))


def encode_batch_header(
    topic: str,
    partition: int,
    *,
    acks: str = "1",
    flags: int = 0,
    seq_start: int = 0,
    seq_end: int = 0,
    record_count: int,
) -> bytes:
    """The batch bytes before the records section (facts B3.1).

    Used for CONSUME/STREAM replies built as this header + a stored records section.
    Broker-generated batches use acks ``"1"`` and flags 0. Raises ``LocalProtocolError``
    for unknown flag bits or acks, a count over 100,000, or out-of-range numbers.
    """
    if flags & ~BATCH_FLAG_IDEMPOTENT:
        raise LocalProtocolError(f"batch flags 0x{flags:04x} set unknown bits")
    if acks not in ACKS_VALUES:
        raise LocalProtocolError(f"batch acks {acks!r} is not one of {sorted(ACKS_VALUES)}")
    if not 0 <= record_count <= MAX_RECORDS_PER_BATCH:
        raise LocalProtocolError(f"batch of {record_count} records exceeds {MAX_RECORDS_PER_BATCH}")
    return b"".join(
        (
            _BATCH_HEAD.pack(BATCH_MAGIC, BATCH_VERSION, flags),
            _encode_text(topic, "topic"),
            _pack(_I32, partition),
            _encode_text(acks, "acks"),
            _pack(_BATCH_SEQS, seq_start, seq_end, record_count),
        )
    )


def encode_batch(b: Batch) -> bytes:
    """Encode a whole batch (facts B3.1).

    A ``seq_start``/``seq_end`` of 0 is filled from the first/last record's ``seq_num``.
    Every record's topic and partition must equal the batch's. Raises
    ``LocalProtocolError`` for anything ``decode_batch`` would reject.
    """
    seq_start = b.seq_start or (b.records[0].seq_num if b.records else 0)
    seq_end = b.seq_end or (b.records[-1].seq_num if b.records else 0)
    parts = [
        encode_batch_header(
            b.topic,
            b.partition,
            acks=b.acks,
            flags=BATCH_FLAG_IDEMPOTENT if b.idempotent else 0,
            seq_start=seq_start,
            seq_end=seq_end,
            record_count=len(b.records),
        )
    ]
    for r in b.records:
        if r.topic != b.topic or r.partition != b.partition:
            raise LocalProtocolError("record topic/partition differs from the batch's")
        body = encode_record(r)
        parts.append(_U32.pack(len(body)))
        parts.append(body)
    return b"".join(parts)


# ----------------------------------------------------------------------------------------
# The SDK's produce path: records without Record objects


def encode_text_field(value: str) -> bytes:
    """A CBV2 string: u32 length + UTF-8 bytes. Raises ``UnicodeEncodeError`` for unencodable text."""
    raw = value.encode("utf-8")
    return _U32.pack(len(raw)) + raw


class RecordEncoder:
    """Encodes producer records for one (topic, partition) and one producer session.

    Each record is version 2 with presence bits: timestamp (when given), producer (always:
    id, sequence, epoch, facts A5), key (when given). Output equals :func:`encode_record`
    for the same ``Record`` (offset 0), prefixed by its u32 length, ready to join into a
    batch's records section.
    """

    __slots__ = ("_heads", "_producer_field", "_epoch", "_run_prefix", "_run_tail", "_run_fixed")

    def __init__(self, topic: str, partition: int, producer_id: str, producer_epoch: int) -> None:
        tail = encode_text_field(topic) + _I32.pack(partition)
        self._heads = [_RECORD_HEAD.pack(RECORD_VERSION_2, presence) + tail for presence in range(8)]
        self._producer_field = encode_text_field(producer_id)
        self._epoch = producer_epoch
        head = self._heads[3]  # timestamp and producer (the heads differ only in presence bits: same size)
        #: length prefix, head, offset 0 and value length in one pack; timestamp, producer id, sequence and
        #: epoch in another (encode_run).
        self._run_prefix = struct.Struct(f">I{len(head)}sQI")
        self._run_tail = struct.Struct(f">q{len(self._producer_field)}sQq")
        self._run_fixed = len(head) + _OFFSET_LENGTH.size + self._run_tail.size

    def encode_run(self, values: Sequence[bytes], key_fields: Sequence[bytes | None], timestamps: Sequence[int],
                   seq_start: int) -> bytes:
        """The records ``seq_start ..`` joined, as ``b"".join(encode(v, k, t, seq_start + i))`` for each
        ``(v, k, t)`` of the three sequences (equal lengths; every record has a timestamp)."""
        prefix = self._run_prefix.pack
        tail = self._run_tail.pack
        fixed = self._run_fixed
        producer = self._producer_field
        epoch = self._epoch
        plain = self._heads[3]
        keyed = self._heads[7]
        parts: list[bytes] = []
        append = parts.append
        seq = seq_start
        for value, key_field, timestamp in zip(values, key_fields, timestamps, strict=True):
            size = len(value)
            if key_field is None:
                append(prefix(fixed + size, plain, 0, size))
                append(value)
                append(tail(timestamp, producer, seq, epoch))
            else:
                append(prefix(fixed + size + len(key_field), keyed, 0, size))
                append(value)
                append(tail(timestamp, producer, seq, epoch))
                append(key_field)
            seq += 1
        return b"".join(parts)

    def encode(self, value: bytes, key_field: bytes | None, timestamp: int | None, seq_num: int) -> bytes:
        """One length-prefixed record. ``key_field`` is :func:`encode_text_field` of the key, or None."""
        presence = 2 | (4 if key_field is not None else 0) | (1 if timestamp is not None else 0)
        parts = [self._heads[presence], _OFFSET_LENGTH.pack(0, len(value)), value]
        if timestamp is not None:
            parts.append(_FIXED["i64"].pack(timestamp))
        parts.append(self._producer_field)
        parts.append(_SEQ_EPOCH.pack(seq_num, self._epoch))
        if key_field is not None:
            parts.append(key_field)
        body = b"".join(parts)
        return _U32.pack(len(body)) + body


# ----------------------------------------------------------------------------------------
# Object decoding


def _read_text(buf: bytes | bytearray, pos: int, end: int, what: str) -> tuple[str, int]:
    raw, pos = _read_blob(buf, pos, end, what)
    try:
        return raw.decode("utf-8"), pos
    except UnicodeDecodeError as exc:
        raise InvalidFrame(f"{what} is not valid UTF-8") from exc


def _read_blob(buf: bytes | bytearray, pos: int, end: int, what: str) -> tuple[bytes | bytearray, int]:
    if pos + 4 > end:
        raise InvalidFrame(f"truncated before {what} length")
    (length,) = _U32.unpack_from(buf, pos)
    pos += 4
    if length > end - pos:
        raise InvalidFrame(f"{what} length {length} exceeds its container")
    return buf[pos : pos + length], pos + length


def _read_fixed(buf: bytes | bytearray, pos: int, end: int, layout: struct.Struct, what: str) -> tuple[int, int]:
    if pos + layout.size > end:
        raise InvalidFrame(f"truncated in {what}")
    return layout.unpack_from(buf, pos)[0], pos + layout.size


def _read_record_head(buf: bytes | bytearray, pos: int, end: int) -> tuple[int, int, int]:
    """Read and check version and presence; return (version, presence, position)."""
    if end - pos < _MIN_RECORD_BYTES:
        raise InvalidFrame(f"record of {end - pos} bytes is shorter than the minimum {_MIN_RECORD_BYTES}")
    version, presence = _RECORD_HEAD.unpack_from(buf, pos)
    mask = _PRESENCE_MASKS.get(version)
    if mask is None:
        raise InvalidFrame(f"record version {version} is not 2 or 3")
    if presence & ~mask:
        raise InvalidFrame(f"record version {version} has unknown presence bits 0x{presence & ~mask:x}")
    return version, presence, pos + _RECORD_HEAD.size


def decode_record(data: bytes | bytearray | memoryview) -> Record:
    """Decode one record (without its u32 length prefix) strictly (facts B3.2, decision 2).

    Raises ``InvalidFrame`` for: version not 2/3, presence bits outside the version's
    mask, truncation, invalid UTF-8 in a string field, or trailing bytes. The payload
    and control key/value are returned as raw bytes.
    """
    buf = bytes(data)
    end = len(buf)
    version, presence, pos = _read_record_head(buf, 0, end)
    topic, pos = _read_text(buf, pos, end, "record topic")
    partition, pos = _read_fixed(buf, pos, end, _I32, "record partition")
    offset, pos = _read_fixed(buf, pos, end, _U64, "record offset")
    payload, pos = _read_blob(buf, pos, end, "record payload")
    record = Record(topic, partition, bytes(payload), offset, version)  # bytes(bytes) is no copy
    for bit, attribute, encoding in _OPTIONAL_FIELDS:
        if not presence & bit:
            continue
        value: object
        if encoding == "str":
            value, pos = _read_text(buf, pos, end, attribute)
        elif encoding == "bytes":
            value, pos = _read_blob(buf, pos, end, attribute)
        elif encoding == "producer":
            value, pos = _read_text(buf, pos, end, attribute)
            if pos + _SEQ_EPOCH.size > end:
                raise InvalidFrame("truncated in producer seq/epoch")
            record.seq_num, record.producer_epoch = _SEQ_EPOCH.unpack_from(buf, pos)
            pos += _SEQ_EPOCH.size
        else:
            value, pos = _read_fixed(buf, pos, end, _FIXED[encoding], attribute)
        setattr(record, attribute, value)
    if pos != end:
        raise InvalidFrame(f"record has {end - pos} trailing bytes")
    return record


@dataclass(frozen=True, slots=True)
class _BatchHead:
    flags: int
    topic: str
    topic_field: bytes  # u32 length + UTF-8 topic, as every record must repeat it
    partition: int
    acks: str
    seq_start: int
    seq_end: int
    record_count: int
    records_offset: int


def is_cbv2(payload: bytes | bytearray | memoryview) -> bool:
    """True when ``payload`` starts with the CBV2 magic and batch version 2."""
    return len(payload) >= 6 and bytes(payload[:6]) == _BATCH_HEAD.pack(BATCH_MAGIC, BATCH_VERSION, 0)[:6]


def _read_batch_head(buf: bytes | bytearray) -> _BatchHead:
    """Validate the batch fields before the records section (facts B3.1)."""
    end = len(buf)
    if end < _BATCH_HEAD.size:
        raise InvalidFrame("batch is shorter than its header")
    magic, version, flags = _BATCH_HEAD.unpack_from(buf, 0)
    if magic != BATCH_MAGIC:
        raise InvalidFrame(f"bad batch magic 0x{magic:08x}")
    if version != BATCH_VERSION:
        raise InvalidFrame(f"unsupported batch version {version}")
    if flags & ~BATCH_FLAG_IDEMPOTENT:
        raise InvalidFrame(f"batch flags 0x{flags:04x} set unknown bits")
    topic, pos = _read_text(buf, _BATCH_HEAD.size, end, "batch topic")
    topic_field = bytes(buf[_BATCH_HEAD.size : pos])
    partition, pos = _read_fixed(buf, pos, end, _I32, "batch partition")
    acks, pos = _read_text(buf, pos, end, "batch acks")
    if acks not in ACKS_VALUES:
        raise InvalidFrame(f"batch acks {acks!r} is not one of {sorted(ACKS_VALUES)}")
    if pos + _BATCH_SEQS.size > end:
        raise InvalidFrame("batch truncated before its record count")
    seq_start, seq_end, count = _BATCH_SEQS.unpack_from(buf, pos)
    pos += _BATCH_SEQS.size
    if count > MAX_RECORDS_PER_BATCH:
        raise InvalidFrame(f"batch declares {count} records (max {MAX_RECORDS_PER_BATCH})")
    return _BatchHead(flags, topic, topic_field, partition, acks, seq_start, seq_end, count, pos)


def iter_record_slices(records_section: bytes | bytearray | memoryview, count: int) -> Iterator[memoryview]:
    """Yield each record's bytes (without its u32 length prefix) from a records section.

    The section must hold exactly ``count`` length-prefixed records: ``InvalidFrame`` is
    raised (lazily, while iterating) on a truncated record or trailing bytes.
    """
    view = memoryview(records_section)
    pos = 0
    end = len(view)
    for index in range(count):
        if pos + 4 > end:
            raise InvalidFrame(f"records section truncated before record {index} length")
        (length,) = _U32.unpack_from(view, pos)
        pos += 4
        if length > end - pos:
            raise InvalidFrame(f"record {index} length {length} exceeds the batch")
        yield view[pos : pos + length]
        pos += length
    if pos != end:
        raise InvalidFrame(f"batch has {end - pos} trailing bytes after its records")


def decode_batch(data: bytes | bytearray | memoryview) -> Batch:
    """Decode and fully validate a batch into objects (facts B3.1, B3.2).

    Raises ``InvalidFrame`` for a bad magic/version/flags/acks, more than 100,000
    records, any invalid record, a record whose topic or partition differs from the
    batch's, or trailing bytes.
    """
    buf = bytes(data)
    head = _read_batch_head(buf)
    records = []
    for body in iter_record_slices(memoryview(buf)[head.records_offset :], head.record_count):
        record = decode_record(body)
        if record.topic != head.topic or record.partition != head.partition:
            raise InvalidFrame("record topic/partition differs from the batch's")
        records.append(record)
    return Batch(
        head.topic,
        head.partition,
        head.acks,
        records,
        idempotent=bool(head.flags & BATCH_FLAG_IDEMPOTENT),
        seq_start=head.seq_start,
        seq_end=head.seq_end,
    )
