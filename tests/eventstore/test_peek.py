"""peek_event agrees with the strict record decoder on every record shape."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cursus.eventstore.peek import peek_event
from cursus.wire import Record, decode_record, encode_record

text = st.text(max_size=8)
maybe = st.none() | text
records = st.builds(
    Record, topic=st.text(min_size=1, max_size=5), partition=st.integers(0, 9), payload=st.binary(max_size=20),
    offset=st.integers(0, 1 << 40), timestamp=st.none() | st.integers(-(1 << 40), 1 << 40),
    producer_id=st.none() | st.text(min_size=1, max_size=4), key=maybe, event_type=maybe,
    schema_version=st.none() | st.integers(0, 1 << 31), aggregate_version=st.none() | st.integers(0, 1 << 60),
    metadata=maybe, transactional_id=maybe, transaction_state=maybe, transaction_marker=maybe,
    control_type=maybe, control_version=st.none() | st.integers(-100, 100),
    control_coordinator_epoch=st.none() | st.integers(-5, 5), control_key=st.none() | st.binary(max_size=4),
    control_value=st.none() | st.binary(max_size=4), event_id=maybe, payload_digest=maybe)


@given(records, st.binary(max_size=3))
def test_peek_matches_decode(record: Record, prefix: bytes) -> None:
    raw = encode_record(record)
    decoded = decode_record(raw)
    buf = prefix + raw + b"trailing"
    fields = peek_event(buf, len(prefix), len(prefix) + len(raw))
    if decoded.key is None or decoded.aggregate_version is None:
        assert fields is None
        return
    assert fields is not None
    assert (fields.offset, fields.key, fields.aggregate_version, fields.event_id, fields.payload_digest) == (
        decoded.offset, decoded.key, decoded.aggregate_version, decoded.event_id, decoded.payload_digest)
    assert fields.transactional == (decoded.transactional_id is not None)
    assert fields.control == (decoded.control_type is not None)
