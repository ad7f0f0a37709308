"""Transaction control records (markers) and transactional data records (spec "Transaction Coordinator").

A marker is an ordinary CBV2 record (version 2) with payload ``__cursus_txn_control_marker__`` (clients
skip it by payload, facts A6), the producer group (producer id, seq 0, producer epoch), ``transactional_id``,
``transaction_marker`` = ``commit`` | ``abort``, and the Cursus control metadata:
``control_batch_type`` = ``transaction``, ``control_batch_version`` = 2, ``control_coordinator_epoch`` =
the coordinator epoch, control key = ``int16 version (0) | int16 markerType (0 abort, 1 commit)`` and
control value = ``int16 version (0) | int32 coordinatorEpoch`` (big-endian).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from cursus.wire import (
    TRANSACTIONAL_PRESENCE_MASK,
    TXN_CONTROL_MARKER_PAYLOAD,
    Record,
    decode_record,
    encode_record,
)

CONTROL_TYPE = "transaction"
CONTROL_VERSION = 2
CONTROL_KEY_VERSION = 0
CONTROL_VALUE_VERSION = 0
MARKER_ABORT = 0
MARKER_COMMIT = 1
_KEY = struct.Struct(">hh")
_VALUE = struct.Struct(">hi")
_PRESENCE = struct.Struct(">Q")


def control_key(commit: bool) -> bytes:
    """The 4 control-key bytes: int16 version 0, int16 markerType (1 commit, 0 abort)."""
    return _KEY.pack(CONTROL_KEY_VERSION, MARKER_COMMIT if commit else MARKER_ABORT)


def control_value(coordinator_epoch: int) -> bytes:
    """The 6 control-value bytes: int16 version 0, int32 coordinatorEpoch."""
    return _VALUE.pack(CONTROL_VALUE_VERSION, coordinator_epoch)


def marker_record(topic: str, partition: int, *, transactional_id: str, producer_id: str, producer_epoch: int,
                  commit: bool, coordinator_epoch: int, timestamp_ms: int) -> bytes:
    """The encoded marker record (offset 0: the caller stamps it). Raises LocalProtocolError on bad values."""
    return encode_record(Record(
        topic=topic, partition=partition, payload=TXN_CONTROL_MARKER_PAYLOAD, timestamp=timestamp_ms,
        producer_id=producer_id, seq_num=0, producer_epoch=producer_epoch, transactional_id=transactional_id,
        transaction_marker="commit" if commit else "abort", control_type=CONTROL_TYPE,
        control_version=CONTROL_VERSION, control_coordinator_epoch=coordinator_epoch,
        control_key=control_key(commit), control_value=control_value(coordinator_epoch)))


@dataclass(frozen=True, slots=True)
class EventSpec:
    """The event-sourcing fields of a TXN_APPEND_STREAM record (the key is the aggregate key)."""

    aggregate_version: int
    event_type: str | None = None
    schema_version: int | None = None
    metadata: str | None = None


def data_record(topic: str, partition: int, *, transactional_id: str, producer_id: str, producer_epoch: int,
                seq_num: int, key: str | None, payload: bytes, timestamp_ms: int,
                event: EventSpec | None = None) -> bytes:
    """One TXN_PUBLISH record (``transaction_state=open``), offset 0; with ``event`` a TXN_APPEND_STREAM
    record (aggregate_version, event_type, schema_version, metadata in their presence bits). Raises
    LocalProtocolError."""
    return encode_record(Record(
        topic=topic, partition=partition, payload=payload, timestamp=timestamp_ms, producer_id=producer_id,
        seq_num=seq_num, producer_epoch=producer_epoch, key=key, transactional_id=transactional_id,
        transaction_state="open",
        aggregate_version=event.aggregate_version if event is not None else None,
        event_type=event.event_type if event is not None else None,
        schema_version=event.schema_version if event is not None else None,
        metadata=event.metadata if event is not None else None))


@dataclass(frozen=True, slots=True)
class TxnRecordInfo:
    """What the transaction index needs from one stored record."""

    offset: int
    producer_id: str
    producer_epoch: int
    seq_num: int
    transactional_id: str
    #: ``commit`` / ``abort`` for a marker, None for a data record
    marker: str | None
    coordinator_epoch: int | None


def txn_info(record_bytes: bytes | memoryview) -> TxnRecordInfo | None:
    """Decode one stored record; its transaction facts, or None for a non-transactional record.

    A marker whose control bytes disagree with its ``transaction_marker`` is ignored (None): it cannot
    authorize visibility. A record without transaction fields is recognised from its presence bitmap alone
    (no decode). Raises the decoder's errors for bytes that are not a valid record.
    """
    if len(record_bytes) >= 10 and not _PRESENCE.unpack_from(record_bytes, 2)[0] & TRANSACTIONAL_PRESENCE_MASK:
        return None
    r = decode_record(record_bytes)
    if r.transactional_id is None or r.producer_id is None:
        return None
    if r.transaction_marker is not None:
        if r.control_type != CONTROL_TYPE or r.control_key is None or len(r.control_key) != _KEY.size:
            return None
        _, marker_type = _KEY.unpack(r.control_key)
        if (marker_type == MARKER_COMMIT) != (r.transaction_marker == "commit"):
            return None
        return TxnRecordInfo(r.offset, r.producer_id, r.producer_epoch, 0, r.transactional_id,
                             r.transaction_marker, r.control_coordinator_epoch)
    return TxnRecordInfo(r.offset, r.producer_id, r.producer_epoch, r.seq_num, r.transactional_id, None, None)
