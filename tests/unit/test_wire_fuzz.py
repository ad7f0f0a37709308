"""Fuzzing invariant (h11's afl target, STYLE-MODELS s1): any byte string fed to any decoder
either decodes or raises a ProtocolError subclass with a known ``reason`` - never IndexError,
struct.error, UnicodeDecodeError, MemoryError, ValueError or a hang.

Inputs: seeded random bytes (plain and behind each magic), and every truncation and every
single-bit flip of every conformance vector. A few tens of thousands of decoder calls.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from functools import cache

import pytest

from cursus.wire import (
    HEADER_SIZE,
    PROTOCOL_FAILURE_REASONS,
    CommandTextError,
    Compression,
    FrameDecoder,
    ProtocolError,
    decode_batch,
    decode_crq2,
    decode_error,
    decode_header,
    decode_negotiation_request,
    decode_negotiation_response,
    decode_record,
    decompress,
    iter_record_slices,
    parse_command_text,
    parse_error_text,
    scan_batch,
)
from cursus.wire.compression import XERIAL_MAGIC
from tests.conftest import CONFORMANCE_PATH

Decoder = Callable[[bytes], object]


@cache
def vectors() -> dict[str, bytes]:
    data = json.loads(CONFORMANCE_PATH.read_text())
    return {entry["name"]: bytes.fromhex(entry["hex"]) for entry in data["vectors"]}


def frame_decoder(negotiated: Compression | None) -> Decoder:
    def run(data: bytes) -> object:
        decoder = FrameDecoder(negotiated=negotiated)
        decoder.feed(data)
        frames = []
        for _ in range(4):
            frame = decoder.next_frame()
            if frame is None:
                break
            frames.append(frame)
        return frames

    return run


def header_decoder(data: bytes) -> object:
    return decode_header(data[:HEADER_SIZE]) if len(data) >= HEADER_SIZE else None


def record_slices(data: bytes) -> object:
    return [bytes(s) for s in iter_record_slices(data, 3)]


def decompressor(codec: Compression, length: int) -> Decoder:
    return lambda data: decompress(codec, data, length)


FRAME_DECODERS: list[Decoder] = [header_decoder, *(frame_decoder(c) for c in (None, *Compression))]
BATCH_DECODERS: list[Decoder] = [decode_batch, scan_batch, lambda d: scan_batch(bytearray(d)), decode_record,
                                 lambda d: decode_record(d[53:]), record_slices]
DECOMPRESSORS: list[Decoder] = [decompressor(c, n) for c in Compression for n in (0, 80, 1000)]
ALL_DECODERS: list[Decoder] = [
    *FRAME_DECODERS, *BATCH_DECODERS, *DECOMPRESSORS, decode_negotiation_request, decode_negotiation_response,
    decode_crq2, decode_error,
]
FAMILY: dict[str, list[Decoder]] = {
    "negotiation_request_all_compressions": [decode_negotiation_request],
    "negotiation_response_lz4": [decode_negotiation_response],
    "uncompressed_publish_frame": FRAME_DECODERS,
    "gzip_publish_frame": FRAME_DECODERS + [lambda d: decompress(Compression.GZIP, d[32:], 80)],
    "snappy_publish_frame": FRAME_DECODERS + [lambda d: decompress(Compression.SNAPPY, d[32:], 80)],
    "lz4_publish_frame": FRAME_DECODERS + [lambda d: decompress(Compression.LZ4, d[32:], 80)],
    "append_stream_command_payload": [decode_crq2],
    "full_record_batch": BATCH_DECODERS,
    "full_record_batch_record_v2": BATCH_DECODERS,
    "structured_availability_error": [decode_error],
}


def only_protocol_errors(decoder: Decoder, data: bytes) -> bool:
    """Run one decoder; True when it accepted. Anything but a ProtocolError fails the test."""
    try:
        decoder(data)
    except ProtocolError as exc:
        assert exc.reason in PROTOCOL_FAILURE_REASONS
        return False
    return True


def mutations(raw: bytes) -> list[bytes]:
    out = [raw[:cut] for cut in range(len(raw))]
    for position in range(len(raw)):
        for bit in range(8):
            flipped = bytearray(raw)
            flipped[position] ^= 1 << bit
            out.append(bytes(flipped))
    return out


def test_every_vector_has_a_family() -> None:
    assert set(FAMILY) == set(vectors())


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_truncations_and_bit_flips_of_vectors(name: str) -> None:
    raw = vectors()[name]
    for decoder in FAMILY[name]:
        only_protocol_errors(decoder, raw)
    for data in mutations(raw):
        for decoder in FAMILY[name]:
            only_protocol_errors(decoder, data)


def test_truncations_of_vectors_through_every_decoder() -> None:
    for raw in vectors().values():
        for cut in range(0, len(raw), 3):
            for decoder in ALL_DECODERS:
                only_protocol_errors(decoder, raw[:cut])


PREFIXES = [
    b"",
    b"CRS2\x00\x02",
    b"CRQ2\x00\x02",
    b"CBV2\x00\x02\x00\x00",
    b"CBV2\x00\x02\x00\x01\x00\x00\x00\x01t",
    b"\x1f\x8b\x08\x00",
    b"\x04\x22\x4d\x18",
    XERIAL_MAGIC + b"\x00\x00\x00\x01\x00\x00\x00\x01",
    b"\x00\x02\x00\x02\x00",
    b"\x00\x00\x00\x05",
]


def test_random_bytes_through_every_decoder() -> None:
    rng = random.Random(20260101)
    for _ in range(150):
        prefix = rng.choice(PREFIXES)
        data = prefix + rng.randbytes(rng.choice([0, 1, 5, 20, 64, 300]))
        for decoder in ALL_DECODERS:
            only_protocol_errors(decoder, data)


def test_random_header_fields_through_frame_decoder() -> None:
    rng = random.Random(7)
    base = vectors()["uncompressed_publish_frame"]
    for _ in range(1500):
        data = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(4, HEADER_SIZE)] = rng.randrange(256)
        for decoder in FRAME_DECODERS:
            only_protocol_errors(decoder, bytes(data) + rng.randbytes(rng.randint(0, 8)))


def test_text_parsers_never_raise_unexpected_errors() -> None:
    rng = random.Random(3)
    alphabet = 'AZaz09_=" \t\n\\:{}éPUBLISHmessagemetadatapayloadERROR'
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        parse_error_text(text)
        parse_error_text("ERROR: " + text)
        try:
            parse_command_text(rng.choice(["PUBLISH ", "APPEND_STREAM ", ""]) + text)
        except CommandTextError:
            pass
