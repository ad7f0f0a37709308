"""Wire v2 frames: the 32-byte header, payload checks and an incremental decoder.

Layout (facts A2, B1.1; spec section 2), all big-endian::

    0  u32 magic 0x43525332 "CRS2"     12 u64 request id
    4  u16 version (2)                 20 u32 encoded payload length
    6  u8  kind                        24 u32 decoded payload length
    7  u8  flags                       28 u32 CRC-32C of the encoded payload
    8  u16 command id
    10 u16 status

Sans-IO: ``FrameDecoder.feed`` buffers bytes, ``FrameDecoder.next_frame`` returns a
``Frame`` or None, ``encode_frame`` returns bytes. Nothing here touches a socket or a
clock.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from types import MappingProxyType

import crc32c

from cursus.limits import (
    FRAME_HEADER_SIZE_BYTES,
    FRAME_PAYLOAD_BYTES_MAX,
    RECEIVE_BUFFER_COMPACT_BYTES_MIN,
)
from cursus.wire.commands import Command, command_from_id
from cursus.wire.compression import Compression, compress, decompress
from cursus.wire.errors import (
    ChecksumMismatch,
    CompressionMismatch,
    FrameTooLarge,
    InvalidFrame,
    LocalProtocolError,
    ProtocolError,
)

HEADER_SIZE = FRAME_HEADER_SIZE_BYTES
MAGIC = 0x43525332
WIRE_VERSION = 2
MAX_PAYLOAD_BYTES = FRAME_PAYLOAD_BYTES_MAX

FLAG_COMPRESSION_EXPLICIT = 0x01
FLAG_COMPRESSION_MASK = 0x0E
FLAG_RESERVED_MASK = 0xF0

_HEADER = struct.Struct(">IHBBHHQIII")
assert _HEADER.size == HEADER_SIZE
_REQUEST_ID_MAX = (1 << 64) - 1


class Kind(IntEnum):
    """Frame kinds (facts A2, spec section 3)."""

    NEGOTIATION_REQUEST = 1
    NEGOTIATION_RESPONSE = 2
    REQUEST = 3
    RESPONSE = 4
    STREAM = 5


class Status(IntEnum):
    """Frame status values (facts A2)."""

    NONE = 0
    OK = 1
    ERROR = 2
    STREAM_END = 3


NEGOTIATION_KINDS = frozenset({Kind.NEGOTIATION_REQUEST, Kind.NEGOTIATION_RESPONSE})

# Allowed statuses per kind (facts B1.1 semantic checks).
_STATUSES_BY_KIND: Mapping[Kind, frozenset[Status]] = MappingProxyType(
    {
        Kind.NEGOTIATION_REQUEST: frozenset({Status.NONE}),
        Kind.NEGOTIATION_RESPONSE: frozenset({Status.OK, Status.ERROR}),
        Kind.REQUEST: frozenset({Status.NONE}),
        Kind.RESPONSE: frozenset({Status.OK, Status.ERROR}),
        Kind.STREAM: frozenset({Status.OK, Status.ERROR, Status.STREAM_END}),
    }
)
# Kinds whose request id must be non-zero. The negotiation frames are exempt: the Go
# client sends 0 and its test double answers 0 (facts A3, B1.1).
_NONZERO_REQUEST_ID_KINDS = frozenset({Kind.REQUEST, Kind.RESPONSE, Kind.STREAM})
# Decode lookups built once (an enum call or ``max(Enum)`` per frame costs more than the rest of the header).
_KIND_BY_ID: Mapping[int, Kind] = MappingProxyType({int(kind): kind for kind in Kind})
_STATUS_BY_ID: Mapping[int, Status] = MappingProxyType({int(status): status for status in Status})
_COMPRESSION_ID_MAX = max(Compression)
_COMPRESSION_BY_ID: Mapping[int, Compression] = MappingProxyType({int(c): c for c in Compression})


def flags_for(compression: Compression | None) -> int:
    """Flags byte for a compression: None -> 0 (negotiation frames), else 0x01 | id << 1."""
    if compression is None:
        return 0
    return FLAG_COMPRESSION_EXPLICIT | (int(compression) << 1)


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """A decoded, validated 32-byte header (facts B1.1).

    ``encoded_length``/``decoded_length`` are payload bytes on the wire / after
    decompression; ``crc`` is the CRC-32C of the encoded payload.
    """

    kind: Kind
    flags: int
    command: Command
    status: Status
    request_id: int
    encoded_length: int
    decoded_length: int
    crc: int

    @property
    def compression(self) -> Compression | None:
        """The frame's compression; None when flag bit 0 is clear (negotiation frames)."""
        if not self.flags & FLAG_COMPRESSION_EXPLICIT:
            return None
        compression_id = (self.flags & FLAG_COMPRESSION_MASK) >> 1
        found = _COMPRESSION_BY_ID.get(compression_id)
        return Compression(compression_id) if found is None else found  # an unknown id raises ValueError


@dataclass(frozen=True, slots=True)
class Frame:
    """A complete frame with its payload decompressed. ``compression`` as in the header."""

    kind: Kind
    command: Command
    status: Status
    request_id: int
    payload: bytes
    compression: Compression | None


def _check_semantics(kind: Kind, command: Command, status: Status, request_id: int, error: type[ProtocolError]) -> None:
    """The B1.1 semantic checks shared by encode and decode."""
    if status not in _STATUSES_BY_KIND[kind]:
        raise error(f"{kind.name} frame cannot carry status {status.name}")
    if request_id == 0 and kind in _NONZERO_REQUEST_ID_KINDS:
        raise error(f"{kind.name} frame needs a non-zero request id")
    if kind in NEGOTIATION_KINDS and command != Command.NEGOTIATE:
        raise error(f"{kind.name} frame must carry command NEGOTIATE, not {command.name}")


def _check_flags(kind: Kind, flags: int) -> None:
    if flags & FLAG_RESERVED_MASK:
        raise InvalidFrame(f"flags 0x{flags:02x} set reserved bits 4-7")
    if kind in NEGOTIATION_KINDS:
        if flags != 0:
            raise InvalidFrame(f"negotiation frame flags must be 0, got 0x{flags:02x}")
        return
    if not flags & FLAG_COMPRESSION_EXPLICIT:
        raise InvalidFrame("compression flag is not explicit")
    compression_id = (flags & FLAG_COMPRESSION_MASK) >> 1
    if compression_id > _COMPRESSION_ID_MAX:
        raise InvalidFrame(f"unknown compression id {compression_id}")


_MAGIC_BYTES = MAGIC.to_bytes(4, "big")
_VERSION_BYTES = WIRE_VERSION.to_bytes(2, "big")


def check_header_prefix(prefix: bytes | bytearray | memoryview) -> None:
    """Reject, as early as the bytes allow, a header that can never decode: the magic (bytes 0-3), the
    version (4-5) and the kind (6) are checked on however many bytes have arrived (facts B1.1 steps 1-3).
    A peer that is not speaking Wire v2 is then closed at its first wrong byte, not at a deadline.

    Raises:
        InvalidFrame: the prefix cannot start a Wire v2 frame header.
    """
    data = bytes(prefix[:7])
    n = len(data)
    if data[:4] != _MAGIC_BYTES[:min(n, 4)]:
        raise InvalidFrame(f"bad magic 0x{data[:4].hex()}")
    if n > 4 and data[4:6] != _VERSION_BYTES[:min(n, 6) - 4]:
        raise InvalidFrame(f"unsupported wire version bytes 0x{data[4:6].hex()}")
    if n > 6 and data[6] not in _KIND_BY_ID:
        raise InvalidFrame(f"unknown frame kind {data[6]}")


def decode_header(data: bytes | bytearray | memoryview, *, max_payload: int = MAX_PAYLOAD_BYTES) -> FrameHeader:
    """Decode and validate exactly 32 header bytes (facts B1.1, decode steps 1-6).

    Order: magic, version, kind, flags (bits 4-7 zero; negotiation kinds 0; other kinds
    bit 0 set and a known compression id), size limits (both lengths <= ``max_payload``
    bytes, else ``FrameTooLarge``), then the semantic checks: known status and command,
    status allowed for the kind, non-zero request id for request/response/stream, and
    NEGOTIATE on negotiation kinds. Everything else raises ``InvalidFrame``.
    """
    if len(data) != HEADER_SIZE:
        raise InvalidFrame(f"frame header must be {HEADER_SIZE} bytes, got {len(data)}")
    (magic, version, kind_id, flags, command_id, status_id, request_id, encoded_length, decoded_length, crc) = (
        _HEADER.unpack(data)
    )
    if magic != MAGIC:
        raise InvalidFrame(f"bad magic 0x{magic:08x}")
    if version != WIRE_VERSION:
        raise InvalidFrame(f"unsupported wire version {version}")
    kind = _KIND_BY_ID.get(kind_id)
    if kind is None:
        raise InvalidFrame(f"unknown frame kind {kind_id}")
    _check_flags(kind, flags)
    if encoded_length > max_payload or decoded_length > max_payload:
        raise FrameTooLarge(
            f"payload lengths {encoded_length}/{decoded_length} exceed the {max_payload}-byte limit"
        )
    status = _STATUS_BY_ID.get(status_id)
    if status is None:
        raise InvalidFrame(f"unknown status {status_id}")
    command = command_from_id(command_id)
    _check_semantics(kind, command, status, request_id, InvalidFrame)
    return FrameHeader(kind, flags, command, status, request_id, encoded_length, decoded_length, crc)


def check_compression(header: FrameHeader, negotiated: Compression | None) -> None:
    """Raise ``CompressionMismatch`` unless the header's compression is the negotiated one.

    ``negotiated`` None means no negotiation happened yet, so only flags 0 (a negotiation
    frame) is acceptable; after negotiation a flags-0 frame is a mismatch (facts B1.1).
    """
    if header.compression != negotiated:
        raise CompressionMismatch(
            f"frame compression {header.compression!r} differs from negotiated {negotiated!r}"
        )


def decode_payload(header: FrameHeader, encoded: bytes | memoryview, *, negotiated: Compression | None) -> bytes:
    """Check and decompress a frame payload (facts B1.1 decode steps 7-9, decision 3).

    Checks, in order: compression equals ``negotiated`` (``CompressionMismatch``),
    ``len(encoded) == header.encoded_length`` (``InvalidFrame``), CRC-32C
    (``ChecksumMismatch``), then bounded decompression to exactly
    ``header.decoded_length`` bytes (``DecompressionRejected``). Returns the payload.
    """
    check_compression(header, negotiated)
    if len(encoded) != header.encoded_length:
        raise InvalidFrame(f"payload is {len(encoded)} bytes, header says {header.encoded_length}")
    if crc32c.crc32c(encoded) != header.crc:
        raise ChecksumMismatch("payload CRC-32C does not match the header")
    codec = header.compression
    return decompress(Compression.NONE if codec is None else codec, encoded, header.decoded_length)


def encode_frame(
    kind: Kind,
    command: Command,
    status: Status,
    request_id: int,
    payload: bytes = b"",
    *,
    compression: Compression | None = Compression.NONE,
) -> bytes:
    """Encode one frame: header + (compressed) payload (facts A2, B1.1).

    ``compression`` None gives flags 0 and is only valid for the negotiation kinds; every
    other kind needs a ``Compression`` (flags 0x01/0x03/0x05/0x07). Applies the same
    semantic checks as ``decode_header`` and the 64 MiB limit on both lengths; violations
    raise ``LocalProtocolError`` (reason ``invalid_frame`` or ``frame_too_large``).
    """
    return b"".join(encode_frame_parts(kind, command, status, request_id, (payload,), compression=compression))


def encode_frame_parts(
    kind: Kind,
    command: Command,
    status: Status,
    request_id: int,
    parts: Sequence[bytes | memoryview],
    *,
    compression: Compression | None = Compression.NONE,
) -> list[bytes | memoryview]:
    """:func:`encode_frame` for a payload given as ``parts`` (byte buffers, back to back), returned as parts.

    The result is the 32-byte header followed by the encoded payload, ready for ``writelines``: an
    uncompressed payload is not copied (its CRC-32C is computed part by part); a compressed one is
    compressed as one buffer. Same checks and errors as :func:`encode_frame`.
    """
    try:  # plain ints are accepted and checked; members (the common case) skip the enum call
        kind = kind if type(kind) is Kind else Kind(kind)
        command = command if type(command) is Command else Command(command)
        status = status if type(status) is Status else Status(status)
        if compression is not None and type(compression) is not Compression:
            compression = Compression(compression)
    except ValueError as exc:
        raise LocalProtocolError(str(exc)) from exc
    if not 0 <= request_id <= _REQUEST_ID_MAX:
        raise LocalProtocolError(f"request id {request_id} does not fit in u64")
    if (kind in NEGOTIATION_KINDS) != (compression is None):
        raise LocalProtocolError(f"{kind.name} frame needs compression {'None' if kind in NEGOTIATION_KINDS else 'set'}")
    _check_semantics(kind, command, status, request_id, LocalProtocolError)
    decoded_length = sum(map(len, parts))
    if decoded_length > MAX_PAYLOAD_BYTES:
        raise LocalProtocolError(f"payload of {decoded_length} bytes exceeds the limit", reason="frame_too_large")
    encoded: list[bytes | memoryview]
    if compression in (None, Compression.NONE):
        encoded = [part for part in parts if len(part)]
    else:
        joined = parts[0] if len(parts) == 1 else b"".join(parts)
        encoded = [compress(compression, joined)]
    encoded_length = sum(map(len, encoded))
    if encoded_length > MAX_PAYLOAD_BYTES:
        raise LocalProtocolError(f"encoded payload of {encoded_length} bytes exceeds the limit",
                                 reason="frame_too_large")
    crc = 0
    for part in encoded:
        crc = crc32c.crc32c(part, crc)
    header = _HEADER.pack(
        MAGIC,
        WIRE_VERSION,
        kind,
        flags_for(compression),
        command,
        status,
        request_id,
        encoded_length,
        decoded_length,
        crc,
    )
    return [header, *encoded]


class FrameDecoder:
    """Incremental frame decoder (h11 style): ``feed`` bytes, pull frames with ``next_frame``.

    ``negotiated`` is the connection's compression; leave it None until the negotiation
    frame has been handled, then assign the selected ``Compression``. Bytes are kept in a
    bytearray with a read position and compacted only when the consumed prefix is large,
    so buffering is O(n) in the bytes fed. After a ``ProtocolError`` the decoder stays
    failed and re-raises the same error on every later call.
    """

    def __init__(self, *, negotiated: Compression | None = None, max_payload: int = MAX_PAYLOAD_BYTES) -> None:
        self.negotiated: Compression | None = negotiated
        self.max_payload = max_payload
        self._buffer = bytearray()
        self._position = 0
        self._header: FrameHeader | None = None
        self._error: ProtocolError | None = None

    @property
    def buffered_bytes(self) -> int:
        """Bytes received but not yet returned as part of a frame (non-zero at EOF = truncation)."""
        return len(self._buffer) - self._position

    def feed(self, data: bytes) -> None:
        """Append received bytes; never parses (so never raises on bad input).

        Once the decoder has failed, further bytes are dropped: the connection is about
        to be closed and there is no point holding them.
        """
        if self._error is None:
            self._buffer += data

    def next_frame(self) -> Frame | None:
        """Return the next complete frame, or None when more bytes are needed.

        Raises the ``ProtocolError`` subclass describing the first invalid frame, and
        keeps raising it afterwards.
        """
        if self._error is not None:
            raise self._error
        try:
            return self._next_frame()
        except ProtocolError as exc:
            self._error = exc
            raise

    def _next_frame(self) -> Frame | None:
        buffer = self._buffer
        start = self._position
        if self._header is None:
            if len(buffer) - start < HEADER_SIZE:
                return None
            header = decode_header(buffer[start : start + HEADER_SIZE], max_payload=self.max_payload)
            check_compression(header, self.negotiated)  # fail before buffering the payload
            self._header = header
        header = self._header
        payload_start = start + HEADER_SIZE
        payload_end = payload_start + header.encoded_length
        if len(buffer) < payload_end:
            return None
        with memoryview(buffer) as view:
            payload = decode_payload(header, view[payload_start:payload_end], negotiated=self.negotiated)
        self._header = None
        self._consume(payload_end)
        return Frame(header.kind, header.command, header.status, header.request_id, payload, header.compression)

    def _consume(self, end: int) -> None:
        self._position = end
        if end == len(self._buffer):
            self._buffer.clear()
            self._position = 0
        elif end >= RECEIVE_BUFFER_COMPACT_BYTES_MIN and end * 2 >= len(self._buffer):
            del self._buffer[:end]
            self._position = 0


_PLAIN_TAIL = struct.Struct(">QIII")
_PLAIN_FLAGS = FLAG_COMPRESSION_EXPLICIT | (int(Compression.NONE) << 1)
#: Header bytes 0-11 of a RESPONSE frame with compression NONE, per (command, status): built once.
_PLAIN_PREFIXES: Mapping[tuple[Command, Status], bytes] = MappingProxyType({
    (command, status): _HEADER.pack(MAGIC, WIRE_VERSION, Kind.RESPONSE, _PLAIN_FLAGS, command, status, 0, 0, 0, 0)[:12]
    for command in Command for status in (Status.OK, Status.ERROR)
})


def encode_plain_frame(command: Command, status: Status, request_id: int, payload: bytes) -> bytes:
    """A RESPONSE frame with compression NONE, as one ``bytes``: the common reply (a PUBLISH ack, an OK
    line), byte for byte what :func:`encode_frame` gives for the same arguments, but from a precomputed
    header prefix (no enum, semantic or compression checks beyond what a response needs).

    ``command`` is a :class:`Command`, ``status`` OK or ERROR, ``request_id`` in 1..2**64-1 and ``payload``
    at most :data:`MAX_PAYLOAD_BYTES`; anything else raises ``LocalProtocolError`` (like :func:`encode_frame`).
    """
    prefix = _PLAIN_PREFIXES.get((command, status))
    size = len(payload)
    if prefix is None or not 0 < request_id <= _REQUEST_ID_MAX or size > MAX_PAYLOAD_BYTES:
        raise LocalProtocolError(f"cannot encode a {status!r} response to {command!r} for request {request_id} "
                                 f"with {size} payload bytes")
    return b"".join((prefix, _PLAIN_TAIL.pack(request_id, size, size, crc32c.crc32c(payload)), payload))
