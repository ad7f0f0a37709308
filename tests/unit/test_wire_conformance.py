"""Every vector of the shared conformance file decodes to its documented values and re-encodes.

The vectors are the committed copy in ``tests/data/conformance/`` (so a clone with nothing beside it
passes); when the project's shared folder exists, the copy must equal it byte for byte. The expected
values are the ones listed in the conformance ``README.md``.
"""

from __future__ import annotations

import json
from functools import cache

import pytest

from cursus.wire import (
    COMMAND_BY_NAME,
    Batch,
    Command,
    CommandPayload,
    Compression,
    ErrorClass,
    FrameDecoder,
    Kind,
    NegotiationRequest,
    Status,
    decode_batch,
    decode_crq2,
    decode_error,
    decode_header,
    decode_negotiation_request,
    decode_negotiation_response,
    encode_batch,
    encode_crq2,
    encode_error,
    encode_frame,
    encode_negotiation_request,
    encode_negotiation_response,
    parse_command_text,
    scan_batch,
)
from tests.conftest import CONFORMANCE_PATH, SHARED_DIR

APPEND_STREAM_TEXT = (
    'APPEND_STREAM topic=events key=aggregate-7 expectedVersion=3 eventType=Updated schemaVersion=2 '
    'metadata={"trace":"a b"} message={"value":"x y"}'
)
COMPRESSED_PAYLOAD = (b"cross-language-compression-" * 4)[:80]


@cache
def conformance() -> dict:
    return json.loads(CONFORMANCE_PATH.read_text())


def test_committed_vectors_match_shared_folder():
    shared = SHARED_DIR / "conformance"
    if not shared.is_dir():
        pytest.skip("no shared folder beside this checkout (a user's clone): the committed copy is used")
    for name in ("wire-v2.json", "README.md"):
        assert (CONFORMANCE_PATH.parent / name).read_bytes() == (shared / name).read_bytes(), name


def vector(name: str) -> bytes:
    for entry in conformance()["vectors"]:
        if entry["name"] == name:
            return bytes.fromhex(entry["hex"])
    raise KeyError(name)


def test_file_metadata_matches_codec() -> None:
    data = conformance()
    assert data["wire_version"] == 2
    assert data["header_size"] == 32
    assert data["max_payload"] == 64 * 1024 * 1024
    assert data["compression_ids"] == {c.name.lower(): c.value for c in Compression}


def test_command_table_equals_conformance_command_ids() -> None:
    assert {name: int(cmd) for name, cmd in COMMAND_BY_NAME.items()} == conformance()["command_ids"]


def test_negotiation_request_vector() -> None:
    raw = vector("negotiation_request_all_compressions")
    request = decode_negotiation_request(raw)
    assert request == NegotiationRequest(
        2, 2, (Compression.GZIP, Compression.SNAPPY, Compression.LZ4, Compression.NONE)
    )
    assert encode_negotiation_request(request) == raw


def test_negotiation_response_vector() -> None:
    raw = vector("negotiation_response_lz4")
    assert decode_negotiation_response(raw) == (2, Compression.LZ4)
    assert encode_negotiation_response(2, Compression.LZ4) == raw


def test_uncompressed_publish_frame_vector() -> None:
    raw = vector("uncompressed_publish_frame")
    header = decode_header(raw[:32])
    assert (header.kind, header.flags, header.command, header.status, header.request_id) == (
        Kind.REQUEST, 0x01, Command.PUBLISH, Status.NONE, 42,
    )
    decoder = FrameDecoder(negotiated=Compression.NONE)
    decoder.feed(raw)
    frame = decoder.next_frame()
    assert frame is not None and frame.payload == b"hello" and frame.compression == Compression.NONE
    assert encode_frame(Kind.REQUEST, Command.PUBLISH, Status.NONE, 42, b"hello") == raw


@pytest.mark.parametrize(
    ("name", "codec", "flags"),
    [
        ("gzip_publish_frame", Compression.GZIP, 0x03),
        ("snappy_publish_frame", Compression.SNAPPY, 0x05),
        ("lz4_publish_frame", Compression.LZ4, 0x07),
    ],
)
def test_compressed_publish_frame_vectors(name: str, codec: Compression, flags: int) -> None:
    raw = vector(name)
    header = decode_header(raw[:32])
    assert header.flags == flags and header.compression == codec
    decoder = FrameDecoder(negotiated=codec)
    decoder.feed(raw)
    frame = decoder.next_frame()
    assert frame is not None
    assert (frame.kind, frame.command, frame.status, frame.request_id) == (
        Kind.REQUEST, Command.PUBLISH, Status.NONE, 77,
    )
    assert frame.payload == COMPRESSED_PAYLOAD
    # Our compressor's bytes may differ from the vector's; our own output must round-trip.
    again = encode_frame(Kind.REQUEST, Command.PUBLISH, Status.NONE, 77, frame.payload, compression=codec)
    assert again[7] == flags
    decoder = FrameDecoder(negotiated=codec)
    decoder.feed(again)
    assert decoder.next_frame() == frame


def test_append_stream_command_payload_vector() -> None:
    raw = vector("append_stream_command_payload")
    payload = decode_crq2(raw)
    assert payload.positionals == ()
    assert list(payload.fields.items()) == [
        ("topic", "events"),
        ("key", "aggregate-7"),
        ("expectedVersion", "3"),
        ("eventType", "Updated"),
        ("schemaVersion", "2"),
        ("metadata", '{"trace":"a b"}'),
        ("message", '{"value":"x y"}'),
    ]
    assert encode_crq2(payload) == raw
    command, parsed = parse_command_text(APPEND_STREAM_TEXT)
    assert command == Command.APPEND_STREAM
    assert parsed == payload and list(parsed.fields) == list(payload.fields)
    assert encode_crq2(parsed) == raw
    assert encode_crq2(CommandPayload((), dict(payload.fields))) == raw


@pytest.mark.parametrize(("name", "version"), [("full_record_batch", 3), ("full_record_batch_record_v2", 2)])
def test_full_record_batch_vectors(name: str, version: int) -> None:
    raw = vector(name)
    batch = decode_batch(raw)
    assert (batch.topic, batch.partition, batch.acks, batch.idempotent) == ("events", 2, "all", True)
    assert (batch.seq_start, batch.seq_end) == (9, 9)
    assert len(batch.records) == 1
    record = batch.records[0]
    assert record.version == version
    assert (record.topic, record.partition, record.offset) == ("events", 2, 7)
    assert record.timestamp == -123
    assert (record.producer_id, record.seq_num, record.producer_epoch) == ("producer-1", 9, -2)
    assert (record.key, record.event_type, record.schema_version, record.aggregate_version) == (
        "aggregate-7", "Updated", 2, 3,
    )
    assert record.metadata == '{"trace":"a b"}'
    assert (record.transactional_id, record.transaction_state, record.transaction_marker) == (
        "txn-1", "aborted", "abort",
    )
    assert (record.control_type, record.control_version, record.control_coordinator_epoch) == ("transaction", 2, 11)
    assert record.control_key == b"\x00\x01\xff"
    assert record.control_value == b"control-value"
    assert record.event_id is None and record.payload_digest is None
    # Opaque payload: leading/trailing spaces, NUL, multi-byte UTF-8 and a tab, untouched.
    assert record.payload.startswith(b"  ") and record.payload.endswith(b"  ")
    assert b"\x00" in record.payload and b"\t" in record.payload
    assert "한글".encode() in record.payload
    assert int(record.presence) == 0x7FFF
    assert encode_batch(batch) == raw
    assert isinstance(batch, Batch)


@pytest.mark.parametrize("name", ["full_record_batch", "full_record_batch_record_v2"])
def test_full_record_batch_scan(name: str) -> None:
    raw = vector(name)
    view = scan_batch(raw)
    assert (view.topic, view.partition, view.acks, view.idempotent, view.record_count) == ("events", 2, "all", True, 1)
    assert (view.producer_id, view.producer_epoch, view.first_seq, view.last_seq) == ("producer-1", -2, 9, 9)
    assert view.uniform_producer and view.has_transactional
    assert view.max_record_size == len(raw) - view.records_offset - 4
    assert raw[view.offset_positions[0] : view.offset_positions[0] + 8] == (7).to_bytes(8, "big")


def test_structured_availability_error_vector() -> None:
    raw = vector("structured_availability_error")
    error = decode_error(raw)
    assert error.code == "replication_unavailable"
    assert error.error_class == ErrorClass.AVAILABILITY and error.retryable is True
    assert error.message == "replication quorum unavailable"
    assert dict(error.fields) == {"offset": "7", "reason": "replica timeout"}
    assert encode_error(error) == raw
    assert error.render() == (
        'ERROR: replication_unavailable class=availability retryable=true offset=7 reason="replica timeout" '
        "replication quorum unavailable"
    )
