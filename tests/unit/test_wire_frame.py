"""Frame header rules, payload checks and the incremental decoder (facts A2, B1.1)."""

from __future__ import annotations

import random
import struct

import crc32c
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cursus.wire import (
    HEADER_SIZE,
    MAGIC,
    MAX_PAYLOAD_BYTES,
    ChecksumMismatch,
    Command,
    Compression,
    CompressionMismatch,
    DecompressionRejected,
    Frame,
    FrameDecoder,
    FrameTooLarge,
    InvalidFrame,
    Kind,
    LocalProtocolError,
    ProtocolError,
    Status,
    decode_header,
    decode_payload,
    encode_frame,
)

HEADER = struct.Struct(">IHBBHHQIII")

VALID_STATUSES = {
    Kind.NEGOTIATION_REQUEST: [Status.NONE],
    Kind.NEGOTIATION_RESPONSE: [Status.OK, Status.ERROR],
    Kind.REQUEST: [Status.NONE],
    Kind.RESPONSE: [Status.OK, Status.ERROR],
    Kind.STREAM: [Status.OK, Status.ERROR, Status.STREAM_END],
}


@st.composite
def frames(draw: st.DrawFn) -> Frame:
    """Any valid frame: every kind with its allowed statuses, commands and compressions."""
    kind = draw(st.sampled_from(list(Kind)))
    status = draw(st.sampled_from(VALID_STATUSES[kind]))
    negotiation = kind in (Kind.NEGOTIATION_REQUEST, Kind.NEGOTIATION_RESPONSE)
    command = Command.NEGOTIATE if negotiation else draw(st.sampled_from(list(Command)))
    low = 0 if negotiation else 1
    request_id = draw(st.integers(low, 2**64 - 1))
    compression = None if negotiation else draw(st.sampled_from(list(Compression)))
    payload = draw(st.binary(max_size=300) | st.builds(lambda n, b: b * n, st.integers(1, 200), st.binary(min_size=1, max_size=8)))
    return Frame(kind, command, status, request_id, payload, compression)


def encode(frame: Frame) -> bytes:
    return encode_frame(frame.kind, frame.command, frame.status, frame.request_id, frame.payload,
                        compression=frame.compression)


def raw_header(kind: int = 3, flags: int = 1, command: int = 10, status: int = 0, request_id: int = 1,
               encoded: int = 0, decoded: int = 0, crc: int = 0, magic: int = MAGIC, version: int = 2) -> bytes:
    return HEADER.pack(magic, version, kind, flags, command, status, request_id, encoded, decoded, crc)


@given(frames())
def test_frame_roundtrip(frame: Frame) -> None:
    data = encode(frame)
    header = decode_header(data[:HEADER_SIZE])
    assert header.compression == frame.compression
    assert header.decoded_length == len(frame.payload)
    assert decode_payload(header, data[HEADER_SIZE:], negotiated=frame.compression) == frame.payload
    decoder = FrameDecoder(negotiated=frame.compression)
    decoder.feed(data)
    assert decoder.next_frame() == frame
    assert decoder.next_frame() is None and decoder.buffered_bytes == 0


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"magic": 0x43525333}, InvalidFrame),
        ({"version": 1}, InvalidFrame),
        ({"kind": 0}, InvalidFrame),
        ({"kind": 6}, InvalidFrame),
        ({"flags": 0x11}, InvalidFrame),  # reserved bit
        ({"flags": 0x00}, InvalidFrame),  # compression not explicit on a request
        ({"flags": 0x09}, InvalidFrame),  # compression id 4
        ({"kind": 1, "flags": 1, "command": 46}, InvalidFrame),  # negotiation flags must be 0
        ({"encoded": MAX_PAYLOAD_BYTES + 1}, FrameTooLarge),
        ({"decoded": MAX_PAYLOAD_BYTES + 1}, FrameTooLarge),
        ({"command": 0}, InvalidFrame),
        ({"command": 57}, InvalidFrame),
        ({"status": 4}, InvalidFrame),
        ({"status": 1}, InvalidFrame),  # request must have status NONE
        ({"request_id": 0}, InvalidFrame),
        ({"kind": 4, "status": 0}, InvalidFrame),
        ({"kind": 4, "status": 3}, InvalidFrame),
        ({"kind": 4, "status": 1, "request_id": 0}, InvalidFrame),
        ({"kind": 5, "status": 0}, InvalidFrame),
        ({"kind": 5, "status": 1, "request_id": 0}, InvalidFrame),
        ({"kind": 1, "flags": 0, "command": 10}, InvalidFrame),  # negotiation needs NEGOTIATE
        ({"kind": 2, "flags": 0, "command": 46, "status": 0}, InvalidFrame),
        ({"kind": 1, "flags": 0, "command": 46, "status": 1}, InvalidFrame),
    ],
)
def test_decode_header_rejects(fields: dict[str, int], error: type[ProtocolError]) -> None:
    with pytest.raises(error):
        decode_header(raw_header(**fields))


def test_decode_header_order_flags_before_size() -> None:
    # B1.1: flags are checked before lengths, lengths before semantics.
    with pytest.raises(InvalidFrame):
        decode_header(raw_header(flags=0x10, encoded=MAX_PAYLOAD_BYTES + 1))
    with pytest.raises(FrameTooLarge):
        decode_header(raw_header(command=0, encoded=MAX_PAYLOAD_BYTES + 1))


def test_negotiation_request_may_have_request_id_zero() -> None:
    header = decode_header(raw_header(kind=1, flags=0, command=46, status=0, request_id=0))
    assert header.compression is None


def test_decode_header_needs_exactly_32_bytes() -> None:
    for size in (0, 31, 33):
        with pytest.raises(InvalidFrame):
            decode_header(bytes(size))


def test_decode_header_custom_limit() -> None:
    with pytest.raises(FrameTooLarge):
        decode_header(raw_header(kind=1, flags=0, command=46, encoded=1025, decoded=1025), max_payload=1024)


def test_decode_payload_checks() -> None:
    data = encode_frame(Kind.REQUEST, Command.PUBLISH, Status.NONE, 5, b"abc")
    header = decode_header(data[:32])
    with pytest.raises(CompressionMismatch):
        decode_payload(header, data[32:], negotiated=Compression.GZIP)
    with pytest.raises(CompressionMismatch):
        decode_payload(header, data[32:], negotiated=None)
    with pytest.raises(InvalidFrame):
        decode_payload(header, data[32:-1], negotiated=Compression.NONE)
    with pytest.raises(ChecksumMismatch):
        decode_payload(header, b"abd", negotiated=Compression.NONE)
    lying = raw_header(encoded=3, decoded=4, crc=crc32c.crc32c(b"abc"))
    with pytest.raises(DecompressionRejected):
        decode_payload(decode_header(lying), b"abc", negotiated=Compression.NONE)
    negotiation = encode_frame(Kind.NEGOTIATION_REQUEST, Command.NEGOTIATE, Status.NONE, 0, b"x", compression=None)
    with pytest.raises(CompressionMismatch):
        decode_payload(decode_header(negotiation[:32]), negotiation[32:], negotiated=Compression.NONE)


@pytest.mark.parametrize(
    "call",
    [
        lambda: encode_frame(Kind.REQUEST, Command.PUBLISH, Status.OK, 1),
        lambda: encode_frame(Kind.REQUEST, Command.PUBLISH, Status.NONE, 0),
        lambda: encode_frame(Kind.REQUEST, Command.PUBLISH, Status.NONE, 1, compression=None),
        lambda: encode_frame(Kind.NEGOTIATION_REQUEST, Command.NEGOTIATE, Status.NONE, 0),
        lambda: encode_frame(Kind.NEGOTIATION_REQUEST, Command.PUBLISH, Status.NONE, 0, compression=None),
        lambda: encode_frame(Kind.RESPONSE, Command.PUBLISH, Status.NONE, 1),
        lambda: encode_frame(Kind.STREAM, Command.STREAM, Status.OK, 2**64),
        lambda: encode_frame(9, Command.PUBLISH, Status.NONE, 1),  # type: ignore[arg-type]
        lambda: encode_frame(Kind.REQUEST, 0, Status.NONE, 1),  # type: ignore[arg-type]
    ],
)
def test_encode_frame_rejects(call) -> None:  # noqa: ANN001
    with pytest.raises(LocalProtocolError):
        call()


def test_encode_frame_size_limit() -> None:
    with pytest.raises(LocalProtocolError) as info:
        encode_frame(Kind.REQUEST, Command.PUBLISH, Status.NONE, 1, bytes(MAX_PAYLOAD_BYTES + 1))
    assert info.value.reason == "frame_too_large"


def sample_frames() -> list[Frame]:
    rng = random.Random(3)
    out = []
    for index in range(1, 30):
        payload = rng.randbytes(rng.choice([0, 1, 7, 100, 5000]))
        status = rng.choice([Status.OK, Status.ERROR, Status.STREAM_END])
        out.append(Frame(Kind.STREAM, Command.STREAM, status, index, payload, Compression.SNAPPY))
    return out


def test_decoder_whole_and_multiple_frames_in_one_chunk() -> None:
    frames_in = sample_frames()
    decoder = FrameDecoder(negotiated=Compression.SNAPPY)
    decoder.feed(b"".join(encode(f) for f in frames_in))
    out = []
    while (frame := decoder.next_frame()) is not None:
        out.append(frame)
    assert out == frames_in


def test_decoder_byte_by_byte() -> None:
    frames_in = sample_frames()[:6]
    decoder = FrameDecoder(negotiated=Compression.SNAPPY)
    out = []
    for byte in b"".join(encode(f) for f in frames_in):
        decoder.feed(bytes((byte,)))
        while (frame := decoder.next_frame()) is not None:
            out.append(frame)
    assert out == frames_in


@given(st.lists(st.integers(1, 400), min_size=1, max_size=40), st.integers(0, 2**32))
def test_decoder_random_chunking(sizes: list[int], seed: int) -> None:
    rng = random.Random(seed)
    frames_in = rng.sample(sample_frames(), 5)
    stream = b"".join(encode(f) for f in frames_in)
    decoder = FrameDecoder(negotiated=Compression.SNAPPY)
    out, position, turn = [], 0, 0
    while position < len(stream):
        size = sizes[turn % len(sizes)]
        turn += 1
        decoder.feed(stream[position : position + size])
        position += size
        while (frame := decoder.next_frame()) is not None:
            out.append(frame)
    assert out == frames_in


def test_decoder_trailing_partial_frame() -> None:
    frames_in = sample_frames()[:3]
    stream = b"".join(encode(f) for f in frames_in)
    partial = encode(sample_frames()[5])[:-1]
    decoder = FrameDecoder(negotiated=Compression.SNAPPY)
    decoder.feed(stream + partial)
    assert [decoder.next_frame() for _ in range(3)] == frames_in
    assert decoder.next_frame() is None
    assert decoder.buffered_bytes == len(partial)


def test_decoder_negotiation_then_requests() -> None:
    hello = encode_frame(Kind.NEGOTIATION_REQUEST, Command.NEGOTIATE, Status.NONE, 0, b"\x00\x02\x00\x02\x00\x01\x01",
                         compression=None)
    request = encode_frame(Kind.REQUEST, Command.PUBLISH, Status.NONE, 1, b"x" * 100, compression=Compression.GZIP)
    decoder = FrameDecoder()
    decoder.feed(hello + request)
    first = decoder.next_frame()
    assert first is not None and first.kind == Kind.NEGOTIATION_REQUEST and first.compression is None
    decoder.negotiated = Compression.GZIP
    second = decoder.next_frame()
    assert second is not None and second.payload == b"x" * 100


def test_decoder_stays_failed() -> None:
    decoder = FrameDecoder(negotiated=Compression.NONE)
    decoder.feed(b"\x00" * 32)
    with pytest.raises(InvalidFrame) as first:
        decoder.next_frame()
    decoder.feed(encode_frame(Kind.REQUEST, Command.PUBLISH, Status.NONE, 1))
    with pytest.raises(InvalidFrame) as second:
        decoder.next_frame()
    assert first.value is second.value


def test_decoder_rejects_compression_mismatch_from_header() -> None:
    decoder = FrameDecoder(negotiated=Compression.LZ4)
    decoder.feed(encode_frame(Kind.REQUEST, Command.PUBLISH, Status.NONE, 1, b"x" * 10)[:32])
    with pytest.raises(CompressionMismatch):
        decoder.next_frame()


def test_decoder_buffering_is_linear() -> None:
    # Many small frames fed in big chunks and byte-sized chunks: the buffer must be
    # compacted, so the total work stays proportional to the input.
    frame = encode_frame(Kind.REQUEST, Command.PUBLISH, Status.NONE, 1, b"y" * 50)
    stream = frame * 20_000  # ~1.6 MB
    decoder = FrameDecoder(negotiated=Compression.NONE)
    count = 0
    for start in range(0, len(stream), 65_536 + 13):
        decoder.feed(stream[start : start + 65_536 + 13])
        while decoder.next_frame() is not None:
            count += 1
        assert len(decoder._buffer) < 3 * 65_536 + 200  # compacted, never the whole stream
    assert count == 20_000 and decoder.buffered_bytes == 0


def test_check_header_prefix_accepts_every_prefix_of_a_valid_header_and_rejects_wrong_bytes_early():
    from cursus.wire import check_header_prefix

    header = encode_frame(Kind.REQUEST, Command.LIST, Status.NONE, 7, b"", compression=Compression.NONE)[:32]
    for n in range(1, 33):
        check_header_prefix(header[:n])
    for bad in (b"X", b"\x00", b"CRS1", b"CRS2\x00\x03", b"CRS2\x01", b"CRS2\x00\x02\x00", b"CRS2\x00\x02\x09"):
        with pytest.raises(InvalidFrame):
            check_header_prefix(bad)
