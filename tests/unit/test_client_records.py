"""The SDK's fast record paths agree byte for byte with the reference codec in cursus.wire."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cursus.client.records import ConsumerRecord, decode_consumed_batch
from cursus.wire import (
    TXN_CONTROL_MARKER_PAYLOAD,
    Batch,
    InvalidFrame,
    Record,
    RecordEncoder,
    decode_batch,
    encode_batch,
    encode_record,
    encode_text_field,
)

TOPIC = "orders-ü"
texts = st.text(max_size=12)


@st.composite
def records(draw: st.DrawFn, partition: int = 3) -> Record:
    rec = Record(topic=TOPIC, partition=partition, payload=draw(st.binary(max_size=40)),
                 offset=draw(st.integers(0, 2**40)))
    if draw(st.booleans()):
        rec.timestamp = draw(st.integers(-(2**63), 2**63 - 1))
    if draw(st.booleans()):
        rec.producer_id = draw(texts)
        rec.seq_num = draw(st.integers(0, 2**64 - 1))
        rec.producer_epoch = draw(st.integers(-(2**63), 2**63 - 1))
    if draw(st.booleans()):
        rec.key = draw(texts)
    if draw(st.integers(0, 4)) == 0:  # rarer shapes take the strict path
        rec.event_type = draw(texts)
        rec.schema_version = draw(st.integers(0, 2**32 - 1))
        rec.metadata = draw(texts)
    if draw(st.integers(0, 6)) == 0:
        rec.event_id = draw(texts)
    return rec


def _as_consumer(r: Record) -> ConsumerRecord:
    return ConsumerRecord.from_wire(r)


@given(st.lists(records(), max_size=8))
def test_fast_decode_matches_wire_decode(recs: list[Record]) -> None:
    data = encode_batch(Batch(topic=TOPIC, partition=3, acks="1", records=recs))
    topic, partition, decoded = decode_consumed_batch(data, skip_control=False)
    assert (topic, partition) == (TOPIC, 3)
    assert decoded == [_as_consumer(r) for r in decode_batch(data).records]


@given(st.lists(records(), min_size=1, max_size=4), st.data())
def test_fast_decode_rejects_exactly_what_wire_rejects(recs: list[Record], data: st.DataObject) -> None:
    raw = bytearray(encode_batch(Batch(topic=TOPIC, partition=3, acks="1", records=recs)))
    # Corrupt: flip a byte, truncate, or append garbage.
    action = data.draw(st.sampled_from(["flip", "truncate", "append"]))
    if action == "flip":
        index = data.draw(st.integers(0, len(raw) - 1))
        raw[index] ^= data.draw(st.integers(1, 255))
    elif action == "truncate":
        del raw[data.draw(st.integers(0, len(raw) - 1)):]
    else:
        raw += data.draw(st.binary(min_size=1, max_size=4))
    try:
        expected = [_as_consumer(r) for r in decode_batch(bytes(raw)).records]
    except InvalidFrame:
        with pytest.raises(InvalidFrame):
            decode_consumed_batch(bytes(raw), skip_control=False)
    else:
        assert decode_consumed_batch(bytes(raw), skip_control=False)[2] == expected


def test_control_markers_are_skipped_by_default() -> None:
    recs = [Record(topic=TOPIC, partition=0, payload=b"a", offset=0),
            Record(topic=TOPIC, partition=0, payload=TXN_CONTROL_MARKER_PAYLOAD, offset=1),
            Record(topic=TOPIC, partition=0, payload=b"b", offset=2)]
    data = encode_batch(Batch(topic=TOPIC, partition=0, acks="1", records=recs))
    assert [r.offset for r in decode_consumed_batch(data)[2]] == [0, 2]
    assert len(decode_consumed_batch(data, skip_control=False)[2]) == 3


@given(value=st.binary(max_size=64), key=st.none() | texts, timestamp=st.none() | st.integers(-(2**63), 2**63 - 1),
       seq=st.integers(0, 2**64 - 1), epoch=st.integers(-(2**63), 2**63 - 1), producer=texts,
       partition=st.integers(0, 2**31 - 1))
def test_record_encoder_matches_encode_record(value: bytes, key: str | None, timestamp: int | None, seq: int,
                                              epoch: int, producer: str, partition: int) -> None:
    encoder = RecordEncoder(TOPIC, partition, producer, epoch)
    ours = encoder.encode(value, None if key is None else encode_text_field(key), timestamp, seq)
    reference = encode_record(Record(topic=TOPIC, partition=partition, payload=value, timestamp=timestamp,
                                     producer_id=producer, seq_num=seq, producer_epoch=epoch, key=key))
    assert ours == struct.pack(">I", len(reference)) + reference


def test_consumer_record_conveniences() -> None:
    record = ConsumerRecord("t", 0, 5, "héllo".encode())
    assert record.payload == record.value and record.text == "héllo"


@given(count=st.integers(64, 120), payload_length=st.integers(0, 24), timestamps=st.booleans(),
       producer=st.none() | texts, key=st.none() | texts, data=st.data())
def test_matrix_shaped_batches_decode_like_wire(count: int, payload_length: int, timestamps: bool,
                                                producer: str | None, key: str | None,
                                                data: st.DataObject) -> None:
    """Batches whose records all have one length take the column path; they must still match, and a
    batch that breaks the pattern in one record (a different key) must too."""
    recs = []
    for index in range(count):
        rec = Record(topic=TOPIC, partition=1, payload=data.draw(st.binary(min_size=payload_length,
                                                                           max_size=payload_length)),
                     offset=data.draw(st.integers(0, 2**63)), key=key)
        if timestamps:
            rec.timestamp = data.draw(st.integers(-(2**63), 2**63 - 1))
        if producer is not None:
            rec.producer_id, rec.seq_num, rec.producer_epoch = producer, 7 + index, 3
        recs.append(rec)
    if data.draw(st.booleans()) and key:
        recs[data.draw(st.integers(0, count - 1))].key = key[::-1] + "x"[: len(key) - len(key[::-1])]
    encoded = encode_batch(Batch(topic=TOPIC, partition=1, acks="1", records=recs))
    assert decode_consumed_batch(encoded, skip_control=False)[2] == [
        _as_consumer(r) for r in decode_batch(encoded).records]
