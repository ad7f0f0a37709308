"""CRQ2 command payloads and their text form (facts A5 5a, B2; decision 8).

Binary layout (strings are u32 big-endian length + UTF-8)::

    u32 magic 0x43525132 "CRQ2" | u16 version 2
    u16 positional count (<= 1024) | positional strings
    u16 field count (<= 1024)      | (key string, value string) pairs, in wire order

The text form ``NAME k=v ... metadata=... message=...`` is what cursusctl and the SDKs
type; ``parse_command_text`` converts it with the capture rules of B2.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import overload

from cursus.limits import CRQ2_FIELDS_COUNT_MAX, CRQ2_POSITIONALS_COUNT_MAX
from cursus.wire.commands import COMMAND_BY_NAME, Command
from cursus.wire.errors import InvalidFrame, LocalProtocolError, ProtocolError

CRQ2_MAGIC = 0x43525132
CRQ2_VERSION = 2

_HEAD = struct.Struct(">IH")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_MAGIC_PREFIX = _HEAD.pack(CRQ2_MAGIC, CRQ2_VERSION)

FIELD_NAME_PATTERN = re.compile(r"[a-z_][A-Za-z0-9_]*")
"""Field-name rule (facts B2): first char a-z or _, then letters, digits or _."""
_POSITIONAL_FORBIDDEN = frozenset(" \t\r\n")


class CommandTextError(ValueError):
    """A text command cannot be converted (bad name, key, duplicate, too many items).

    This is a local usage error (cursusctl exits 2), not a ``ProtocolError``.
    """


@dataclass(frozen=True, slots=True)
class CommandPayload:
    """A decoded CRQ2 payload: positionals and fields in wire order (facts B2).

    ``fields`` is a dict kept in insertion (wire) order; treat it as read-only.
    """

    positionals: tuple[str, ...] = ()
    fields: Mapping[str, str] = field(default_factory=dict)

    @overload
    def get(self, key: str) -> str | None: ...
    @overload
    def get(self, key: str, default: str) -> str: ...
    @overload
    def get(self, key: str, default: None) -> str | None: ...

    def get(self, key: str, default: str | None = None) -> str | None:
        """The value of field ``key``, or ``default`` when absent."""
        return self.fields.get(key, default)


def is_field_name(key: str) -> bool:
    """True when ``key`` satisfies the CRQ2 field-name rule (facts B2)."""
    return FIELD_NAME_PATTERN.fullmatch(key) is not None


def is_crq2(payload: bytes | bytearray | memoryview) -> bool:
    """True when ``payload`` has at least 6 bytes starting with magic CRQ2 and version 2."""
    return len(payload) >= _HEAD.size and bytes(payload[: _HEAD.size]) == _MAGIC_PREFIX


def _check_positional(value: str, error: type[ProtocolError]) -> None:
    if not value:
        raise error("CRQ2 positional is empty")
    if not _POSITIONAL_FORBIDDEN.isdisjoint(value):
        raise error(f"CRQ2 positional {value!r} contains whitespace")


class _Reader:
    """Bounds-checked cursor over a CRQ2 payload; every failure is ``InvalidFrame``."""

    __slots__ = ("data", "position", "bad_utf8")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.position = _HEAD.size
        #: The first string that was not valid UTF-8 (the walk goes on so the structure is fully checked).
        self.bad_utf8: str | None = None

    def u16(self, what: str) -> int:
        if self.position + 2 > len(self.data):
            raise InvalidFrame(f"CRQ2 truncated before {what}")
        (value,) = _U16.unpack_from(self.data, self.position)
        self.position += 2
        return value

    def string(self, what: str) -> str:
        if self.position + 4 > len(self.data):
            raise InvalidFrame(f"CRQ2 truncated before {what} length")
        (length,) = _U32.unpack_from(self.data, self.position)
        start = self.position + 4
        end = start + length
        if end > len(self.data):
            raise InvalidFrame(f"CRQ2 {what} length {length} exceeds payload")
        self.position = end
        try:
            return self.data[start:end].decode("utf-8")
        except UnicodeDecodeError:
            if self.bad_utf8 is None:
                self.bad_utf8 = what
            return self.data[start:end].decode("utf-8", "replace")


def decode_crq2(payload: bytes | bytearray | memoryview) -> CommandPayload:
    """Decode a CRQ2 payload strictly (facts B2).

    Raises ``InvalidFrame`` for: wrong magic/version, more than 1024 positionals or
    fields, empty or whitespace-containing positionals, keys breaking the field-name
    rule, duplicate keys, truncation, trailing bytes; ``InvalidUtf8`` (a subclass) when the structure is
    valid but a string is not UTF-8.
    """
    data = bytes(payload)
    if not is_crq2(data):
        raise InvalidFrame("payload is not CRQ2 (magic/version)")
    reader = _Reader(data)
    positional_count = reader.u16("positional count")
    if positional_count > CRQ2_POSITIONALS_COUNT_MAX:
        raise InvalidFrame(f"CRQ2 has {positional_count} positionals (max {CRQ2_POSITIONALS_COUNT_MAX})")
    positionals = []
    for _ in range(positional_count):
        value = reader.string("positional")
        _check_positional(value, InvalidFrame)
        positionals.append(value)
    field_count = reader.u16("field count")
    if field_count > CRQ2_FIELDS_COUNT_MAX:
        raise InvalidFrame(f"CRQ2 has {field_count} fields (max {CRQ2_FIELDS_COUNT_MAX})")
    fields: dict[str, str] = {}
    for _ in range(field_count):
        key = reader.string("field key")
        value = reader.string("field value")
        if not is_field_name(key):
            raise InvalidFrame(f"CRQ2 field key {key!r} breaks the field-name rule")
        if key in fields:
            raise InvalidFrame(f"CRQ2 field {key!r} repeated")
        fields[key] = value
    if reader.position != len(data):
        raise InvalidFrame(f"CRQ2 has {len(data) - reader.position} trailing bytes")
    if reader.bad_utf8 is not None:
        raise InvalidUtf8(f"CRQ2 {reader.bad_utf8} is not valid UTF-8")
    return CommandPayload(tuple(positionals), fields)


class InvalidUtf8(InvalidFrame):
    """A structurally valid CRQ2 payload holding a string that is not UTF-8 (decision 8).

    The frame itself is well formed, so a broker answers ``invalid_payload`` and keeps the connection.
    """


def _encode_string(value: str) -> bytes:
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise LocalProtocolError(f"{value!r} is not encodable as UTF-8") from exc
    return _U32.pack(len(raw)) + raw


def encode_crq2(payload: CommandPayload) -> bytes:
    """Encode a CRQ2 payload, fields in the mapping's order (facts B2).

    Raises ``LocalProtocolError`` for anything ``decode_crq2`` would reject.
    """
    if len(payload.positionals) > CRQ2_POSITIONALS_COUNT_MAX or len(payload.fields) > CRQ2_FIELDS_COUNT_MAX:
        raise LocalProtocolError("CRQ2 payload has too many positionals or fields")
    parts = [_MAGIC_PREFIX, _U16.pack(len(payload.positionals))]
    for value in payload.positionals:
        _check_positional(value, LocalProtocolError)
        parts.append(_encode_string(value))
    parts.append(_U16.pack(len(payload.fields)))
    for key, value in payload.fields.items():
        if not is_field_name(key):
            raise LocalProtocolError(f"CRQ2 field key {key!r} breaks the field-name rule")
        parts.append(_encode_string(key))
        parts.append(_encode_string(value))
    return b"".join(parts)


def _find_capture(text: str, key: str) -> re.Match[str] | None:
    """First ``key=`` at the start of ``text`` or right after whitespace."""
    return re.search(rf"(?:^|(?<=\s)){key}=", text)


def _split_captures(arguments: str) -> tuple[str, list[tuple[str, str]]]:
    """Apply the B2 capture rules; return (remaining text, trailing fields in order)."""
    message = _find_capture(arguments, "message")
    if message is not None:
        before = arguments[: message.start()]
        trailing = [("message", arguments[message.end() :].strip())]
        metadata = _find_capture(before, "metadata")
        if metadata is not None:
            trailing.insert(0, ("metadata", before[metadata.end() :].strip()))
            before = before[: metadata.start()]
        return before, trailing
    payload = _find_capture(arguments, "payload")
    if payload is not None:
        return arguments[: payload.start()], [("payload", arguments[payload.end() :].strip())]
    return arguments, []


def parse_command_text(text: str) -> tuple[Command, CommandPayload]:
    """Convert ``NAME k=v ... [metadata=...] [message=...]`` into (command, payload) (facts A5 5a, B2).

    The name is trimmed and upper-cased and must name a command other than NEGOTIATE.
    ``message=`` at the start of the arguments or after whitespace captures the rest of
    the line (trimmed); a ``metadata=`` before it captures up to ``message=``; without
    ``message=``, ``payload=`` captures the rest. The remaining text splits on
    whitespace: ``k=v`` tokens are fields (split at the first ``=``), other tokens are
    positionals. Captured fields come last, metadata before message. Raises
    ``CommandTextError`` for an empty text, an unknown name, a bad or duplicate key, or
    more than 1024 positionals or fields.
    """
    stripped = text.strip()
    if not stripped:
        raise CommandTextError("empty command text")
    name, *rest = stripped.split(None, 1)
    arguments = rest[0] if rest else ""
    command = COMMAND_BY_NAME.get(name.upper())
    if command is None or command == Command.NEGOTIATE:
        raise CommandTextError(f"unknown command {name!r}")
    remaining, trailing = _split_captures(arguments)
    positionals: list[str] = []
    fields: dict[str, str] = {}
    for token in remaining.split():
        key, sep, value = token.partition("=")
        if not sep:
            positionals.append(token)
        else:
            _add_field(fields, key, value)
    for key, value in trailing:
        _add_field(fields, key, value)
    if len(positionals) > CRQ2_POSITIONALS_COUNT_MAX or len(fields) > CRQ2_FIELDS_COUNT_MAX:
        raise CommandTextError("command text has more than 1024 positionals or fields")
    return command, CommandPayload(tuple(positionals), fields)


def _add_field(fields: dict[str, str], key: str, value: str) -> None:
    if not is_field_name(key):
        raise CommandTextError(f"invalid field name {key!r}")
    if key in fields:
        raise CommandTextError(f"duplicate field {key!r}")
    fields[key] = value


def render_command_text(command: Command, payload: CommandPayload) -> str:
    """Render ``NAME pos ... k=v ...`` in payload order, for display and logs (facts B2).

    The inverse of ``parse_command_text`` when only a trailing message/metadata/payload
    value contains whitespace.
    """
    parts = [Command(command).name, *payload.positionals]
    parts.extend(f"{key}={value}" for key, value in payload.fields.items())
    return " ".join(parts)
