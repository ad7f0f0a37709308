"""Payload compression codecs with bounded decompression (facts A2, B1.1; decision 3).

We *emit* a gzip member, a raw snappy block, or an LZ4 frame. We *accept* gzip (one or
more members), a raw snappy block or xerial-framed snappy (what the Python SDK sends),
and one LZ4 frame with nothing after it.

Decompression never produces more than ``decoded_length + 1`` bytes, whatever the
input claims: zlib and LZ4 are driven with ``max_length``, and snappy's declared
uncompressed length (a varint at the start of every raw block) is checked before the
block is expanded. So a 20-byte "bomb" that would inflate to gigabytes costs a few
microseconds and a few hundred bytes.
"""

from __future__ import annotations

import struct
import zlib
from enum import IntEnum

import lz4.frame
import snappy

from cursus.limits import DECOMPRESSION_INPUT_SLICE_BYTES
from cursus.wire.errors import DecompressionRejected, LocalProtocolError


class Compression(IntEnum):
    """Compression ids used in negotiation and in frame flags bits 1-3 (facts A2)."""

    NONE = 0
    GZIP = 1
    SNAPPY = 2
    LZ4 = 3


XERIAL_MAGIC = b"\x82SNAPPY\x00"
"""First 8 bytes of a xerial snappy stream; the header is 16 bytes (magic, u32, u32)."""
XERIAL_HEADER_SIZE = 16

_GZIP_WBITS = 16 + zlib.MAX_WBITS  # gzip container, not raw deflate or zlib
_GZIP_LEVEL = 6
_U32 = struct.Struct(">I")


def compress(codec: Compression, data: bytes | memoryview) -> bytes:
    """Compress ``data`` for the wire (decision 3).

    GZIP -> one gzip member (mtime 0); SNAPPY -> one raw snappy block; LZ4 -> one LZ4
    frame; NONE -> ``data`` unchanged. Raises ``LocalProtocolError`` for an unknown codec.
    """
    if codec == Compression.NONE:
        return bytes(data)
    if codec == Compression.GZIP:
        compressor = zlib.compressobj(_GZIP_LEVEL, zlib.DEFLATED, _GZIP_WBITS)
        return compressor.compress(data) + compressor.flush()
    if codec == Compression.SNAPPY:
        return snappy.compress(bytes(data))
    if codec == Compression.LZ4:
        return lz4.frame.compress(bytes(data))
    raise LocalProtocolError(f"unknown compression {codec!r}")


def decompress(codec: Compression, data: bytes | memoryview, decoded_length: int) -> bytes:
    """Decompress ``data`` to exactly ``decoded_length`` bytes (decision 3, facts A2).

    Accepts gzip (one or more members), raw or xerial-framed snappy, one LZ4 frame, or
    NONE (then ``len(data)`` must equal ``decoded_length``). Raises
    ``DecompressionRejected`` on any codec error, on output that would exceed
    ``decoded_length`` (inflation stops at ``decoded_length + 1`` bytes), on short output,
    or on trailing input. ``decoded_length`` is bytes, already checked against the
    64 MiB limit by the frame header.
    """
    if decoded_length < 0:
        raise DecompressionRejected(f"negative decoded length {decoded_length}")
    if codec == Compression.NONE:
        if len(data) != decoded_length:
            raise DecompressionRejected(
                f"uncompressed payload is {len(data)} bytes, header says {decoded_length}"
            )
        return bytes(data)
    if codec == Compression.GZIP:
        out = _gunzip_bounded(memoryview(data), decoded_length)
    elif codec == Compression.SNAPPY:
        out = _unsnappy_bounded(bytes(data), decoded_length)
    elif codec == Compression.LZ4:
        out = _unlz4_bounded(bytes(data), decoded_length)
    else:
        raise DecompressionRejected(f"unknown compression {codec!r}")
    if len(out) != decoded_length:
        raise DecompressionRejected(f"{codec.name.lower()} produced {len(out)} bytes, header says {decoded_length}")
    return out


def _gunzip_bounded(view: memoryview, decoded_length: int) -> bytes:
    """Inflate one or more gzip members, never producing more than decoded_length + 1 bytes.

    Input is fed in bounded slices so that the leftover input zlib hands back after each
    member (``unused_data``) is small; otherwise a payload of many tiny members would
    copy the tail once per member.
    """
    out = bytearray()
    decompressor = zlib.decompressobj(_GZIP_WBITS)
    member_complete = False  # an empty input is not a gzip stream
    pending: bytes | memoryview = b""
    position = 0
    total = len(view)
    while True:
        if not pending:
            if position >= total:
                break
            pending = view[position : position + DECOMPRESSION_INPUT_SLICE_BYTES]
            position += len(pending)
        budget = decoded_length + 1 - len(out)
        try:
            out += decompressor.decompress(pending, budget)
        except zlib.error as exc:
            raise DecompressionRejected(f"gzip: {exc}") from exc
        if len(out) > decoded_length:
            raise DecompressionRejected(f"gzip output exceeds decoded length {decoded_length}")
        if decompressor.eof:
            pending = decompressor.unused_data
            decompressor = zlib.decompressobj(_GZIP_WBITS)
            member_complete = True
        else:
            pending = decompressor.unconsumed_tail
            member_complete = False
    if not member_complete:
        raise DecompressionRejected("gzip stream is truncated")
    return bytes(out)


def _snappy_declared_length(block: bytes | memoryview) -> int:
    """Read the uncompressed-length varint that starts every raw snappy block."""
    result = 0
    for index in range(min(5, len(block))):
        byte = block[index]
        result |= (byte & 0x7F) << (7 * index)
        if byte < 0x80:
            if result > 0xFFFFFFFF:
                break
            return result
    raise DecompressionRejected("snappy block has an invalid length varint")


def _unsnappy_block(block: bytes, budget: int) -> bytes:
    declared = _snappy_declared_length(block)
    if declared > budget:
        raise DecompressionRejected(f"snappy block declares {declared} bytes, at most {budget} allowed")
    try:
        out = snappy.uncompress(block)
    except Exception as exc:  # snappy.UncompressError and any other codec failure
        raise DecompressionRejected(f"snappy: {exc!r}") from exc
    if len(out) != declared:
        raise DecompressionRejected("snappy block output differs from its declared length")
    return out


def _unsnappy_bounded(data: bytes, decoded_length: int) -> bytes:
    if not data.startswith(XERIAL_MAGIC):
        return _unsnappy_block(data, decoded_length)
    if len(data) < XERIAL_HEADER_SIZE:
        raise DecompressionRejected("xerial snappy header is truncated")
    # Sum every block's declared length before expanding anything.
    blocks: list[bytes] = []
    declared_total = 0
    position = XERIAL_HEADER_SIZE
    while position < len(data):
        if position + 4 > len(data):
            raise DecompressionRejected("xerial snappy block length is truncated")
        (length,) = _U32.unpack_from(data, position)
        position += 4
        if length > len(data) - position:
            raise DecompressionRejected("xerial snappy block exceeds payload")
        block = data[position : position + length]
        position += length
        declared_total += _snappy_declared_length(block)
        if declared_total > decoded_length:
            raise DecompressionRejected(f"xerial snappy blocks declare more than {decoded_length} bytes")
        blocks.append(block)
    return b"".join(_unsnappy_block(block, decoded_length) for block in blocks)


def _unlz4_bounded(data: bytes, decoded_length: int) -> bytes:
    decompressor = lz4.frame.LZ4FrameDecompressor()
    try:
        out = decompressor.decompress(data, max_length=decoded_length + 1)
    except Exception as exc:  # lz4 raises RuntimeError for corrupt frames
        raise DecompressionRejected(f"lz4: {exc!r}") from exc
    if len(out) > decoded_length:
        raise DecompressionRejected(f"lz4 output exceeds decoded length {decoded_length}")
    if not decompressor.eof:
        raise DecompressionRejected("lz4 frame is truncated")
    if decompressor.unused_data:
        raise DecompressionRejected("lz4 frame has trailing data")
    return out
