"""The chunk: the unit of append, checksum and recovery. Pure functions on buffers, no I/O.

One append is one chunk: a 36-byte header followed by the body, a *records section* (``record_count``
times a u32 big-endian length and that many record bytes). Records are opaque; this module only walks the
length prefixes. Record ``i`` of a chunk has offset ``base_offset + i``.

Header layout (big-endian)::

    0   magic           u32   0x43434B32 ("CCK2")
    4   base_offset     u64   offset of the first record in the body
    12  record_count    u32   >= 1
    16  body_length     u32   bytes of the records section, >= 4 * record_count
    20  append_time_ms  i64   wall-clock ms of the append
    28  leader_epoch    u32   leader epoch of the leader that first appended the chunk
    32  crc             u32   CRC32C over header bytes [0:32] followed by the body
    36  body ...

A chunk is never split across segments.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import crc32c

MAGIC = 0x43434B32
HEADER = struct.Struct(">IQIIqII")
HEADER_SIZE = HEADER.size
#: Bytes of the header covered by the CRC (everything before the CRC field).
HEADER_CRC_COVERED_SIZE = 32
#: Upper bound on a body. Wire frames are at most 64 MiB; 256 MiB leaves room for any future batching
#: while keeping every chunk start position inside a u32 index entry (with segment_bytes <= 2 GiB).
CHUNK_BODY_BYTES_MAX = 256 * 1024 * 1024
RECORD_LENGTH = struct.Struct(">I")
RECORD_LENGTH_SIZE = RECORD_LENGTH.size
_PREFIX = struct.Struct(">IQIIqI")
#: Largest leader epoch (a u32 field).
LEADER_EPOCH_MAX = (1 << 32) - 1

assert HEADER_SIZE == 36
assert _PREFIX.size == HEADER_CRC_COVERED_SIZE

Buffer = bytes | bytearray | memoryview


class ChunkHeader(NamedTuple):
    """A decoded chunk header. ``next_offset`` and ``size_bytes`` derive from it."""

    base_offset: int
    record_count: int
    body_length: int
    append_time_ms: int
    leader_epoch: int
    crc: int

    @property
    def next_offset(self) -> int:
        """Offset right after the chunk's last record."""
        return self.base_offset + self.record_count

    @property
    def size_bytes(self) -> int:
        """Header plus body, in bytes."""
        return HEADER_SIZE + self.body_length


def buffer_size_bytes(body: Buffer) -> int:
    """Length in bytes of a bytes-like object (a memoryview's ``nbytes``)."""
    return body.nbytes if isinstance(body, memoryview) else len(body)


def encode_header(base_offset: int, record_count: int, body: Buffer, append_time_ms: int,
                  leader_epoch: int) -> bytes:
    """The 36-byte header for ``body``, CRC included. The caller has validated ``body`` (see
    :func:`records_walk_ok`) and ``0 <= leader_epoch <= LEADER_EPOCH_MAX``."""
    body_length = buffer_size_bytes(body)
    assert 1 <= record_count and RECORD_LENGTH_SIZE * record_count <= body_length <= CHUNK_BODY_BYTES_MAX
    prefix = _PREFIX.pack(MAGIC, base_offset, record_count, body_length, append_time_ms, leader_epoch)
    crc = crc32c.crc32c(body, crc32c.crc32c(prefix))
    return prefix + RECORD_LENGTH.pack(crc)


def decode_header(buffer: Buffer, position: int) -> ChunkHeader | None:
    """Decode the header at ``buffer[position:position + 36]``.

    Returns ``None`` when the bytes cannot be a header: too short, wrong magic, ``record_count == 0``,
    ``body_length`` smaller than ``4 * record_count`` or above :data:`CHUNK_BODY_BYTES_MAX`. The CRC is
    not checked here (see :func:`crc_matches`).
    """
    if position < 0 or position + HEADER_SIZE > buffer_size_bytes(buffer):
        return None
    magic, base_offset, record_count, body_length, append_time_ms, leader_epoch, crc = HEADER.unpack_from(
        buffer, position)
    if magic != MAGIC or record_count == 0:
        return None
    if body_length < RECORD_LENGTH_SIZE * record_count or body_length > CHUNK_BODY_BYTES_MAX:
        return None
    return ChunkHeader(base_offset, record_count, body_length, append_time_ms, leader_epoch, crc)


def crc_matches(buffer: Buffer, position: int, header: ChunkHeader) -> bool:
    """True when the CRC of the whole chunk starting at ``buffer[position]`` equals ``header.crc``.

    ``buffer`` must hold the complete chunk (``position + header.size_bytes`` bytes).
    """
    view = memoryview(buffer)
    end = position + header.size_bytes
    assert end <= view.nbytes
    crc = crc32c.crc32c(view[position:position + HEADER_CRC_COVERED_SIZE])
    crc = crc32c.crc32c(view[position + HEADER_SIZE:end], crc)
    return crc == header.crc


def records_walk_ok(body: Buffer, record_count: int) -> bool:
    """True when ``body`` holds exactly ``record_count`` length-prefixed records and nothing else.

    Records of one length (what a producer of fixed-size records writes) are checked column by column
    (:func:`uniform_stride`); any other body is walked record by record.
    """
    return bool(uniform_stride(body, record_count)) or _walk_ok(body, buffer_size_bytes(body), record_count)


def uniform_stride(body: Buffer, record_count: int) -> int:
    """The bytes per record (length prefix included) when ``body`` is exactly ``record_count`` (> 1)
    length-prefixed records all of one length, else 0. Four strided compares in C, no per-record loop."""
    end = buffer_size_bytes(body)
    if record_count < 2 or end % record_count or (stride := end // record_count) < RECORD_LENGTH_SIZE:
        return 0
    with memoryview(body) as raw:
        view = raw if raw.format == "B" and raw.ndim == 1 else raw.cast("B")
        prefix = RECORD_LENGTH.pack(stride - RECORD_LENGTH_SIZE)
        if all(view[k::stride] == prefix[k:k + 1] * record_count for k in range(RECORD_LENGTH_SIZE)):
            return stride
    return 0


def _walk_ok(body: Buffer, end: int, record_count: int) -> bool:
    position = 0
    unpack = RECORD_LENGTH.unpack_from
    for _ in range(record_count):
        if position + RECORD_LENGTH_SIZE > end:
            return False
        position += RECORD_LENGTH_SIZE + unpack(body, position)[0]
        if position > end:
            return False
    return position == end


def skip_records(body: Buffer, start: int, count: int) -> int:
    """Byte position in ``body`` after skipping ``count`` records that start at byte ``start``.

    The body was validated (CRC) before, so the walk stays in bounds; a violation is an assertion error.
    """
    unpack = RECORD_LENGTH.unpack_from
    position = start
    for _ in range(count):
        position += RECORD_LENGTH_SIZE + unpack(body, position)[0]
    assert position <= buffer_size_bytes(body)
    return position


def cut_records(body: Buffer, start: int, max_records: int, max_bytes: int, at_least_one: bool) -> tuple[int, int]:
    """Walk records from byte ``start`` and take as many as fit.

    Takes at most ``max_records`` records whose combined size (length prefixes included) is at most
    ``max_bytes``; with ``at_least_one`` the first record is taken even if it alone exceeds ``max_bytes``.

    Returns:
        ``(end, count)``: the byte position after the last record taken, and how many were taken.
    """
    unpack = RECORD_LENGTH.unpack_from
    end_limit = buffer_size_bytes(body)
    position = start
    count = 0
    while count < max_records and position < end_limit:
        record_end = position + RECORD_LENGTH_SIZE + unpack(body, position)[0]
        if record_end - start > max_bytes and not (at_least_one and count == 0):
            break
        position = record_end
        count += 1
    assert position <= end_limit
    return position, count
