"""The Wire v2 handshake payloads (facts A3, B1.3; decision 4).

Request payload: u16 min version, u16 max version, u16 count, then ``count`` one-byte
compression ids in client preference order. Response payload: u16 version, u8
compression (exactly 3 bytes). Both travel in flags-0, command-NEGOTIATE frames of at
most ``MAX_NEGOTIATION_PAYLOAD`` bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

from cursus.limits import NEGOTIATION_COMPRESSIONS_COUNT_MAX, NEGOTIATION_PAYLOAD_BYTES_MAX
from cursus.wire.compression import Compression
from cursus.wire.errors import InvalidFrame, LocalProtocolError, ProtocolError

MAX_NEGOTIATION_PAYLOAD = NEGOTIATION_PAYLOAD_BYTES_MAX
SUPPORTED_VERSION = 2

_REQUEST_HEAD = struct.Struct(">HHH")
_RESPONSE = struct.Struct(">HB")


@dataclass(frozen=True, slots=True)
class NegotiationRequest:
    """A client's offer: version range and compressions in preference order (facts B1.3)."""

    min_version: int
    max_version: int
    compressions: tuple[Compression, ...]


def _validate(min_version: int, max_version: int, ids: Iterable[int], error: type[ProtocolError]) -> tuple[Compression, ...]:
    ids = tuple(ids)
    if not 1 <= len(ids) <= NEGOTIATION_COMPRESSIONS_COUNT_MAX:
        raise error(f"negotiation offers {len(ids)} compressions, must be 1-{NEGOTIATION_COMPRESSIONS_COUNT_MAX}")
    if len(set(ids)) != len(ids):
        raise error("negotiation offers a compression twice")
    if any(not 0 <= value <= max(Compression) for value in ids):
        raise error(f"negotiation offers an unknown compression id in {list(ids)}")
    if min_version == 0:
        raise error("negotiation min version is 0")
    if max_version < min_version:
        raise error(f"negotiation max version {max_version} < min version {min_version}")
    return tuple(Compression(value) for value in ids)


def decode_negotiation_request(payload: bytes | memoryview) -> NegotiationRequest:
    """Decode a negotiation request payload (facts A3, B1.3).

    Raises ``InvalidFrame`` when: shorter than the 6-byte head, count not 1-4, duplicate
    or unknown compression ids, min version 0, max < min, or trailing bytes.
    """
    data = bytes(payload)
    if len(data) < _REQUEST_HEAD.size:
        raise InvalidFrame(f"negotiation request is {len(data)} bytes, needs at least {_REQUEST_HEAD.size}")
    min_version, max_version, count = _REQUEST_HEAD.unpack_from(data)
    if len(data) != _REQUEST_HEAD.size + count:
        raise InvalidFrame(f"negotiation request declares {count} compressions but carries {len(data) - 6} bytes")
    compressions = _validate(min_version, max_version, data[_REQUEST_HEAD.size :], InvalidFrame)
    return NegotiationRequest(min_version, max_version, compressions)


def encode_negotiation_request(req: NegotiationRequest) -> bytes:
    """Encode a negotiation request payload; ``LocalProtocolError`` if it would not decode."""
    if not (0 <= req.min_version <= 0xFFFF and 0 <= req.max_version <= 0xFFFF):
        raise LocalProtocolError("negotiation versions must fit in u16")
    ids = tuple(int(value) for value in req.compressions)
    _validate(req.min_version, req.max_version, ids, LocalProtocolError)
    return _REQUEST_HEAD.pack(req.min_version, req.max_version, len(ids)) + bytes(ids)


def decode_negotiation_response(payload: bytes | memoryview) -> tuple[int, Compression]:
    """Decode the 3-byte response payload into (version, compression) (facts A3, B1.3).

    Raises ``InvalidFrame`` for any other length or an unknown compression id. The caller
    checks that the version is 2 and the compression is one it offered.
    """
    if len(payload) != _RESPONSE.size:
        raise InvalidFrame(f"negotiation response must be {_RESPONSE.size} bytes, got {len(payload)}")
    version, compression_id = _RESPONSE.unpack(bytes(payload))
    if compression_id > max(Compression):
        raise InvalidFrame(f"negotiation response selects unknown compression {compression_id}")
    return version, Compression(compression_id)


def encode_negotiation_response(version: int, compression: Compression) -> bytes:
    """Encode the response payload: u16 version + u8 compression (facts B1.3)."""
    if not 0 <= version <= 0xFFFF:
        raise LocalProtocolError(f"negotiation version {version} does not fit in u16")
    try:
        compression = Compression(compression)
    except ValueError as exc:
        raise LocalProtocolError(str(exc)) from exc
    return _RESPONSE.pack(version, compression)


def select_compression(
    req: NegotiationRequest, supported: Iterable[Compression] = tuple(Compression)
) -> Compression | None:
    """Pick the first *client* preference that we support (facts B1.3 step 2-3, decision 4).

    Returns None when version 2 is outside ``[min_version, max_version]`` or nothing the
    client offered is in ``supported``; the broker then closes without replying.
    """
    if not req.min_version <= SUPPORTED_VERSION <= req.max_version:
        return None
    allowed = frozenset(supported)
    for compression in req.compressions:
        if compression in allowed:
            return compression
    return None
