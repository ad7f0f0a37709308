"""Record values handed to applications.

* :class:`ConsumerRecord`: one consumed record: topic, partition, offset, key, value (the payload bytes,
  untouched) and the record's optional fields (timestamp, producer id/sequence/epoch, event fields ...) as
  attributes (facts A5 5b).
* :class:`RecordMetadata`: what a producer's delivery future resolves to.
* :func:`decode_consumed_batch`: CONSUME/STREAM reply -> records, on the one CBV2 codec in
  :mod:`cursus.wire` (:func:`cursus.wire.decode_batch_records`; producers encode with
  :class:`cursus.wire.RecordEncoder`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from cursus.wire import TXN_CONTROL_MARKER_PAYLOAD, Record, decode_batch_records

__all__ = ["ConsumerRecord", "RecordMetadata", "decode_consumed_batch"]


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


def decode_consumed_batch(payload: bytes, *, skip_control: bool = True) -> tuple[str, int, list[ConsumerRecord]]:
    """Decode a CBV2 batch from a CONSUME/STREAM reply into (topic, partition, records).

    The codec is :func:`cursus.wire.decode_batch_records` (validation exactly as
    :func:`cursus.wire.decode_batch`); this only says how records become :class:`ConsumerRecord`.

    Args:
        payload: the batch bytes.
        skip_control: drop transaction control markers (payload ``__cursus_txn_control_marker__``, facts A5).

    Raises:
        cursus.wire.InvalidFrame: anything :func:`cursus.wire.decode_batch` would reject.
    """
    topic, partition, records = decode_batch_records(payload, ConsumerRecord, ConsumerRecord.from_wire)
    if skip_control:
        records = [r for r in records if r.value != TXN_CONTROL_MARKER_PAYLOAD]
    return topic, partition, records
