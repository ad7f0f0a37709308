"""Transaction control records: exact control bytes, recognition, forged markers ignored."""

from __future__ import annotations

from cursus.transactions.markers import control_key, control_value, data_record, marker_record, txn_info
from cursus.wire import TXN_CONTROL_MARKER_PAYLOAD, Record, decode_record, encode_record


def test_control_bytes():
    assert control_key(True) == b"\x00\x00\x00\x01" and control_key(False) == b"\x00\x00\x00\x00"
    assert control_value(7) == b"\x00\x00\x00\x00\x00\x07"


def test_marker_record_fields_and_recognition():
    raw = marker_record("t", 2, transactional_id="tx", producer_id="9", producer_epoch=3, commit=True,
                        coordinator_epoch=5, timestamp_ms=1)
    r = decode_record(raw)
    assert (r.payload, r.transaction_marker, r.control_type, r.control_version) == (
        TXN_CONTROL_MARKER_PAYLOAD, "commit", "transaction", 2)
    assert (r.control_coordinator_epoch, r.control_key, r.control_value) == (5, control_key(True), control_value(5))
    assert r.version == 2 and r.producer_id == "9" and r.producer_epoch == 3 and r.seq_num == 0
    info = txn_info(raw)
    assert info is not None and info.marker == "commit" and info.coordinator_epoch == 5
    data = txn_info(data_record("t", 0, transactional_id="tx", producer_id="9", producer_epoch=3, seq_num=4,
                                key=None, payload=b"p", timestamp_ms=1))
    assert data is not None and data.marker is None and data.seq_num == 4
    assert txn_info(encode_record(Record(topic="t", partition=0, payload=b"plain", producer_id="p"))) is None


def test_a_marker_whose_bytes_disagree_is_ignored():
    forged = encode_record(Record(topic="t", partition=0, payload=TXN_CONTROL_MARKER_PAYLOAD, producer_id="9",
                                  producer_epoch=1, transactional_id="tx", transaction_marker="commit",
                                  control_type="transaction", control_version=2, control_coordinator_epoch=0,
                                  control_key=control_key(False), control_value=control_value(0)))
    assert txn_info(forged) is None
