"""Record values handed to applications, and the SDK's fast CBV2 record codec paths.

* :class:`ConsumerRecord`: one consumed record: topic, partition, offset, key, value (the payload bytes,
  untouched) and the record's optional fields (timestamp, producer id/sequence/epoch, event fields ...) as
  attributes (facts A5 5b).
* :class:`RecordMetadata`: what a producer's delivery future resolves to.
* :func:`decode_consumed_batch`: CONSUME/STREAM reply -> records. The common record shapes (optional
  timestamp, producer and key only) are decoded with a few ``struct`` calls; anything else goes through the
  strict :func:`cursus.wire.decode_record`. Both paths accept and reject exactly what
  :func:`cursus.wire.decode_batch` does (a unit test checks it).
* :class:`RecordEncoder`: producer records -> CBV2 record bytes, byte-identical to
  :func:`cursus.wire.encode_record` for the fields a producer sets.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

from cursus.wire import (
    ACKS_VALUES,
    BATCH_MAGIC,
    BATCH_VERSION,
    MAX_RECORDS_PER_BATCH,
    TXN_CONTROL_MARKER_PAYLOAD,
    InvalidFrame,
    Record,
    decode_record,
)

__all__ = ["ConsumerRecord", "RecordEncoder", "RecordMetadata", "decode_consumed_batch"]


@dataclass(slots=True)
class ConsumerRecord:
    """One record read from a partition.

    ``value`` is the payload exactly as produced (bytes; use ``.text`` for UTF-8). Optional wire fields are
    None when the record does not carry them; ``seq_num``/``producer_epoch`` are 0 without a producer.
    ``timestamp`` is whatever the producer put there (milliseconds since the epoch by convention).
    """

    topic: str
    partition: int
    offset: int
    value: bytes
    key: str | None = None
    timestamp: int | None = None
    producer_id: str | None = None
    seq_num: int = 0
    producer_epoch: int = 0
    event_type: str | None = None
    schema_version: int | None = None
    aggregate_version: int | None = None
    metadata: str | None = None
    event_id: str | None = None
    payload_digest: str | None = None
    transactional_id: str | None = None
    transaction_state: str | None = None
    transaction_marker: str | None = None
    version: int = 2

    @property
    def payload(self) -> bytes:
        """Alias of ``value`` (the spec's name)."""
        return self.value

    @property
    def text(self) -> str:
        """``value`` decoded as UTF-8 (invalid bytes replaced)."""
        return self.value.decode("utf-8", "replace")

    @classmethod
    def from_wire(cls, r: Record) -> ConsumerRecord:
        """Copy a decoded wire :class:`~cursus.wire.Record`."""
        return cls(r.topic, r.partition, r.offset, bytes(r.payload), r.key, r.timestamp, r.producer_id,
                   r.seq_num, r.producer_epoch, r.event_type, r.schema_version, r.aggregate_version,
                   r.metadata, r.event_id, r.payload_digest, r.transactional_id, r.transaction_state,
                   r.transaction_marker, r.version)


class RecordMetadata(NamedTuple):
    """Where a produced record landed (an immutable named tuple: cheap to build once per record).

    ``offset`` is None for acks=0 (the broker never says). ``producer_id``/``producer_epoch``/``seq_num``
    are the identity the record was written with.
    """

    topic: str
    partition: int
    offset: int | None
    producer_id: str
    producer_epoch: int
    seq_num: int


# ------------------------------------------------------------------------------------------- decoding

_U32 = struct.Struct(">I")
_BATCH_HEAD = struct.Struct(">IHH")
_BATCH_TAIL = struct.Struct(">QQI")
_RECORD_HEAD = struct.Struct(">HQ")
_PARTITION_OFFSET_LENGTH = struct.Struct(">iQI")
_OFFSET_LENGTH = struct.Struct(">QI")
_I64 = struct.Struct(">q")
_SEQ_EPOCH = struct.Struct(">Qq")
_FAST_PRESENCE = 0b111  # timestamp, producer, key
_BATCH_FLAG_IDEMPOTENT = 0x0001  # the only defined batch flag (facts A5 5b)
_MIN_RECORD = 2 + 8 + 4 + 4 + 8 + 4


def _string(buf: bytes, pos: int, end: int, what: str) -> tuple[str, int]:
    if pos + 4 > end:
        raise InvalidFrame(f"truncated before {what} length")
    (length,) = _U32.unpack_from(buf, pos)
    pos += 4
    if length > end - pos:
        raise InvalidFrame(f"{what} length {length} exceeds its container")
    try:
        return buf[pos:pos + length].decode("utf-8"), pos + length
    except UnicodeDecodeError as exc:
        raise InvalidFrame(f"{what} is not valid UTF-8") from exc


def _batch_head(buf: bytes) -> tuple[str, bytes, int, int, int]:
    """Validate the batch header; return (topic, topic field bytes, partition, count, records position)."""
    end = len(buf)
    if end < _BATCH_HEAD.size:
        raise InvalidFrame("batch is shorter than its header")
    magic, version, flags = _BATCH_HEAD.unpack_from(buf, 0)
    if magic != BATCH_MAGIC or version != BATCH_VERSION:
        raise InvalidFrame("not a CBV2 version 2 batch")
    if flags & ~_BATCH_FLAG_IDEMPOTENT:
        raise InvalidFrame(f"batch flags 0x{flags:04x} set unknown bits")
    topic, pos = _string(buf, _BATCH_HEAD.size, end, "batch topic")
    topic_field = buf[_BATCH_HEAD.size:pos]
    if pos + 4 > end:
        raise InvalidFrame("batch truncated in partition")
    (partition,) = struct.unpack_from(">i", buf, pos)
    acks, pos = _string(buf, pos + 4, end, "batch acks")
    if acks not in ACKS_VALUES:
        raise InvalidFrame(f"batch acks {acks!r} is not valid")
    if pos + _BATCH_TAIL.size > end:
        raise InvalidFrame("batch truncated before its record count")
    _, _, count = _BATCH_TAIL.unpack_from(buf, pos)
    if count > MAX_RECORDS_PER_BATCH:
        raise InvalidFrame(f"batch declares {count} records")
    return topic, topic_field, partition, count, pos + _BATCH_TAIL.size


def _fast_record(buf: bytes, start: int, end: int, topic: str, topic_field: bytes, partition: int,
                 presence: int, version: int) -> ConsumerRecord:
    pos = start + _RECORD_HEAD.size
    if not buf.startswith(topic_field, pos):
        raise InvalidFrame("record topic differs from the batch's")
    pos += len(topic_field)
    if pos + _PARTITION_OFFSET_LENGTH.size > end:
        raise InvalidFrame("record truncated before its payload")
    record_partition, offset, length = _PARTITION_OFFSET_LENGTH.unpack_from(buf, pos)
    if record_partition != partition:
        raise InvalidFrame("record partition differs from the batch's")
    pos += _PARTITION_OFFSET_LENGTH.size
    if length > end - pos:
        raise InvalidFrame("record payload exceeds the record")
    value = buf[pos:pos + length]
    pos += length
    record = ConsumerRecord(topic, partition, offset, value, version=version)
    if presence & 1:
        if pos + 8 > end:
            raise InvalidFrame("record truncated in timestamp")
        (record.timestamp,) = _I64.unpack_from(buf, pos)
        pos += 8
    if presence & 2:
        record.producer_id, pos = _string(buf, pos, end, "producer id")
        if pos + _SEQ_EPOCH.size > end:
            raise InvalidFrame("record truncated in producer seq/epoch")
        record.seq_num, record.producer_epoch = _SEQ_EPOCH.unpack_from(buf, pos)
        pos += _SEQ_EPOCH.size
    if presence & 4:
        record.key, pos = _string(buf, pos, end, "key")
    if pos != end:
        raise InvalidFrame(f"record has {end - pos} trailing bytes")
    return record


def decode_consumed_batch(payload: bytes, *, skip_control: bool = True) -> tuple[str, int, list[ConsumerRecord]]:
    """Decode a CBV2 batch from a CONSUME/STREAM reply into (topic, partition, records).

    Args:
        payload: the batch bytes.
        skip_control: drop transaction control markers (payload ``__cursus_txn_control_marker__``, facts A5).

    Raises:
        cursus.wire.InvalidFrame: anything :func:`cursus.wire.decode_batch` would reject.
    """
    buf = bytes(payload)
    topic, topic_field, partition, count, pos = _batch_head(buf)
    end_all = len(buf)
    records: list[ConsumerRecord] = []
    append = records.append
    for index in range(count):
        if pos + 4 > end_all:
            raise InvalidFrame(f"records section truncated before record {index} length")
        (length,) = _U32.unpack_from(buf, pos)
        start = pos + 4
        end = start + length
        if end > end_all:
            raise InvalidFrame(f"record {index} length {length} exceeds the batch")
        if length < _MIN_RECORD:
            raise InvalidFrame(f"record of {length} bytes is shorter than the minimum")
        version, presence = _RECORD_HEAD.unpack_from(buf, start)
        if version == 2 and not presence & ~_FAST_PRESENCE:
            record = _fast_record(buf, start, end, topic, topic_field, partition, presence, version)
        else:
            wire = decode_record(buf[start:end])
            if wire.topic != topic or wire.partition != partition:
                raise InvalidFrame("record topic/partition differs from the batch's")
            record = ConsumerRecord.from_wire(wire)
        if not (skip_control and record.value == TXN_CONTROL_MARKER_PAYLOAD):
            append(record)
        pos = end
    if pos != end_all:
        raise InvalidFrame(f"batch has {end_all - pos} trailing bytes after its records")
    return topic, partition, records


# ------------------------------------------------------------------------------------------- encoding


def encode_string_field(value: str) -> bytes:
    """A CBV2 string: u32 length + UTF-8 bytes. Raises ``UnicodeEncodeError`` for unencodable text."""
    raw = value.encode("utf-8")
    return _U32.pack(len(raw)) + raw


class RecordEncoder:
    """Encodes producer records for one (topic, partition) and one producer session.

    Each record is version 2 with presence bits: timestamp (when given), producer (always: id, sequence,
    epoch, facts A5), key (when given). Output equals :func:`cursus.wire.encode_record` for the same
    ``Record``, prefixed by its u32 length, ready to join into a batch's records section.
    """

    __slots__ = ("_heads", "_producer_field", "_epoch")

    def __init__(self, topic: str, partition: int, producer_id: str, producer_epoch: int) -> None:
        tail = encode_string_field(topic) + struct.pack(">i", partition)
        self._heads = [_RECORD_HEAD.pack(2, presence) + tail for presence in range(8)]
        self._producer_field = encode_string_field(producer_id)
        self._epoch = producer_epoch

    def encode(self, value: bytes, key_field: bytes | None, timestamp: int | None, seq_num: int) -> bytes:
        """One length-prefixed record. ``key_field`` is :func:`encode_string_field` of the key, or None."""
        presence = 2 | (4 if key_field is not None else 0) | (1 if timestamp is not None else 0)
        parts = [self._heads[presence], _OFFSET_LENGTH.pack(0, len(value)), value]
        if timestamp is not None:
            parts.append(_I64.pack(timestamp))
        parts.append(self._producer_field)
        parts.append(_SEQ_EPOCH.pack(seq_num, self._epoch))
        if key_field is not None:
            parts.append(key_field)
        body = b"".join(parts)
        return _U32.pack(len(body)) + body
