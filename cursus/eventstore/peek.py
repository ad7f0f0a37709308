"""The event fields of one stored record, read without decoding the rest (sans-IO; facts B3.2 layout).

The stream index scan (:func:`cursus.broker.eventstore._scan`) needs, per record, only its key,
``aggregate_version`` (bit 5), ``event_id`` / ``payload_digest`` (bits 15, 16) and whether it is a
transactional (bit 7) or control (bit 10) record. :func:`peek_event` walks the length prefixes to those
fields and skips everything else (payload included): several times faster than
:func:`cursus.wire.decode_record` on a rebuild. Stored records were validated when they were appended and
are checksummed per chunk on every read, so only bounds are checked here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

_HEAD = struct.Struct(">HQ")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_I32_U64 = struct.Struct(">iQ")
_EVENT_BITS = (1 << 2) | (1 << 5)  # key and aggregate_version
_V3_BITS = (1 << 15) | (1 << 16)
#: Sizes of the fixed optional groups by bit (strings and byte strings are length-prefixed).
_FIXED_SIZES = {0: 8, 4: 4, 5: 8, 11: 2, 12: 8}


@dataclass(frozen=True, slots=True)
class EventFields:
    """What the index needs of an event record."""

    offset: int
    key: str
    aggregate_version: int
    event_id: str | None
    payload_digest: str | None
    transactional: bool
    control: bool


def peek_event(buf: bytes | bytearray | memoryview, pos: int, end: int) -> EventFields | None:
    """The event fields of the record in ``buf[pos:end]`` (no length prefix), or None when it carries no
    key or no aggregate version (not an event).

    Raises:
        ValueError: the record is shorter than its fields say (``struct.error`` is a ValueError).
    """
    presence = _HEAD.unpack_from(buf, pos)[1]
    if presence & _EVENT_BITS != _EVENT_BITS:
        return None
    u32 = _U32.unpack_from
    pos += _HEAD.size
    pos += 4 + u32(buf, pos)[0]  # topic
    offset = _I32_U64.unpack_from(buf, pos)[1]
    pos += _I32_U64.size
    pos += 4 + u32(buf, pos)[0]  # payload
    if presence & 1:  # timestamp
        pos += 8
    if presence & 2:  # producer: id string, seq u64, epoch i64
        pos += 4 + u32(buf, pos)[0] + 16
    length = u32(buf, pos)[0]  # bit 2: key
    key = bytes(buf[pos + 4:pos + 4 + length]).decode("utf-8")
    pos += 4 + length
    if presence & 8:  # event_type
        pos += 4 + u32(buf, pos)[0]
    if presence & 16:  # schema_version
        pos += 4
    version = _U64.unpack_from(buf, pos)[0]  # bit 5
    pos += 8
    event_id = digest = None
    if presence & _V3_BITS:
        for bit in range(6, 17):
            if not presence & (1 << bit):
                continue
            if bit in _FIXED_SIZES:
                pos += _FIXED_SIZES[bit]
                continue
            length = u32(buf, pos)[0]
            start, pos = pos + 4, pos + 4 + length
            if bit == 15:
                event_id = bytes(buf[start:pos]).decode("utf-8")
            elif bit == 16:
                digest = bytes(buf[start:pos]).decode("utf-8")
    if pos > end:
        raise ValueError("record fields run past the record")
    return EventFields(offset, key, version, event_id, digest, bool(presence & 128), bool(presence & 1024))
