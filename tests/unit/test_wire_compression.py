"""Codecs and bounded decompression (decision 3, facts A2)."""

from __future__ import annotations

import struct
import time
import tracemalloc
import zlib

import lz4.frame
import pytest
import snappy
from hypothesis import given
from hypothesis import strategies as st

from cursus.wire import Compression, DecompressionRejected, compress, decompress
from cursus.wire.compression import XERIAL_MAGIC

BOMB_BYTES = 50 * 1024 * 1024
BOMB_CLAIM = 100


def xerial(data: bytes, block: int = 32 * 1024) -> bytes:
    """Xerial snappy framing as the Python SDK writes it."""
    out = [XERIAL_MAGIC, struct.pack(">ii", 1, 1)]
    for start in range(0, len(data), block):
        chunk = snappy.compress(data[start : start + block])
        out.append(struct.pack(">I", len(chunk)) + chunk)
    return b"".join(out)


@given(st.sampled_from(list(Compression)), st.binary(max_size=2000) | st.text(max_size=500).map(str.encode))
def test_roundtrip(codec: Compression, data: bytes) -> None:
    assert decompress(codec, compress(codec, data), len(data)) == data


@given(st.binary(max_size=100_000))
def test_xerial_snappy_is_accepted(data: bytes) -> None:
    assert decompress(Compression.SNAPPY, xerial(data, 1000), len(data)) == data


def test_gzip_multiple_members_and_memoryview() -> None:
    data = compress(Compression.GZIP, b"abc") + compress(Compression.GZIP, b"") + compress(Compression.GZIP, b"def")
    assert decompress(Compression.GZIP, memoryview(data), 6) == b"abcdef"


def test_gzip_many_tiny_members_is_linear() -> None:
    member = compress(Compression.GZIP, b"x")
    data = member * 50_000  # ~1 MB of 21-byte members
    started = time.perf_counter()
    assert decompress(Compression.GZIP, data, 50_000) == b"x" * 50_000
    assert time.perf_counter() - started < 2.0


@pytest.mark.parametrize("codec", list(Compression))
def test_wrong_length_is_rejected(codec: Compression) -> None:
    data = b"hello world" * 10
    encoded = compress(codec, data)
    for claimed in (len(data) - 1, len(data) + 1, 0):
        with pytest.raises(DecompressionRejected):
            decompress(codec, encoded, claimed)


@pytest.mark.parametrize(
    ("codec", "encoded"),
    [
        (Compression.GZIP, b""),
        (Compression.GZIP, b"\x1f\x8b\x08\x00garbage"),
        (Compression.GZIP, compress(Compression.GZIP, b"abc")[:-1]),
        (Compression.GZIP, compress(Compression.GZIP, b"abc") + b"\x00"),
        (Compression.SNAPPY, b""),
        (Compression.SNAPPY, b"\xff\xff\xff\xff\xff\xff"),
        (Compression.SNAPPY, snappy.compress(b"abc")[:-1]),
        (Compression.SNAPPY, XERIAL_MAGIC + b"\x00\x00"),
        (Compression.SNAPPY, xerial(b"abc")[:-1]),
        (Compression.LZ4, b""),
        (Compression.LZ4, compress(Compression.LZ4, b"abc")[:-1]),
        (Compression.LZ4, compress(Compression.LZ4, b"abc") + b"\x00"),
        (Compression.LZ4, compress(Compression.LZ4, b"abc") * 2),
    ],
)
def test_corrupt_input_is_rejected(codec: Compression, encoded: bytes) -> None:
    with pytest.raises(DecompressionRejected):
        decompress(codec, encoded, 3)


def _gzip_bomb() -> bytes:
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = bytes(1 << 20)
    parts = [compressor.compress(chunk) for _ in range(BOMB_BYTES >> 20)]
    return b"".join(parts) + compressor.flush()


def _lz4_bomb() -> bytes:
    compressor = lz4.frame.LZ4FrameCompressor()
    chunk = bytes(1 << 20)
    parts = [compressor.begin()] + [compressor.compress(chunk) for _ in range(BOMB_BYTES >> 20)]
    return b"".join(parts) + compressor.flush()


def _snappy_bomb() -> bytes:
    return snappy.compress(bytes(BOMB_BYTES))


def _xerial_bomb() -> bytes:
    block = snappy.compress(bytes(32 * 1024))
    framed = struct.pack(">I", len(block)) + block
    return XERIAL_MAGIC + struct.pack(">ii", 1, 1) + framed * (BOMB_BYTES // (32 * 1024))


@pytest.mark.parametrize(
    ("codec", "build"),
    [
        (Compression.GZIP, _gzip_bomb),
        (Compression.LZ4, _lz4_bomb),
        (Compression.SNAPPY, _snappy_bomb),
        (Compression.SNAPPY, _xerial_bomb),
    ],
    ids=["gzip", "lz4", "snappy", "xerial"],
)
def test_decompression_bomb_is_rejected_cheaply(codec: Compression, build) -> None:  # noqa: ANN001
    bomb = build()
    assert len(bomb) < BOMB_BYTES // 20
    tracemalloc.start()
    try:
        started = time.perf_counter()
        with pytest.raises(DecompressionRejected):
            decompress(codec, bomb, BOMB_CLAIM)
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < 0.5
    assert peak < 5 * 1024 * 1024, peak  # the bomb itself was allocated before tracing started


def test_unknown_codec() -> None:
    with pytest.raises(DecompressionRejected):
        decompress(7, b"", 0)  # type: ignore[arg-type]
