"""CRQ2 payloads and the text command form (facts A5 5a, B2)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cursus.wire import (
    Command,
    CommandPayload,
    CommandTextError,
    InvalidFrame,
    LocalProtocolError,
    ProtocolError,
    decode_crq2,
    encode_crq2,
    is_crq2,
    is_field_name,
    parse_command_text,
    render_command_text,
)

field_names = st.from_regex(r"\A[a-z_][A-Za-z0-9_]{0,12}\Z")
positionals = st.text(min_size=1, max_size=10).filter(lambda s: not set(s) & set(" \t\r\n"))
payloads = st.builds(
    CommandPayload,
    st.lists(positionals, max_size=4).map(tuple),
    st.dictionaries(field_names, st.text(max_size=30), max_size=8),
)


def s(value: bytes) -> bytes:
    return struct.pack(">I", len(value)) + value


HEAD = b"CRQ2\x00\x02"


@given(payloads)
def test_roundtrip(payload: CommandPayload) -> None:
    raw = encode_crq2(payload)
    assert is_crq2(raw)
    decoded = decode_crq2(raw)
    assert decoded == payload and list(decoded.fields) == list(payload.fields)
    assert encode_crq2(decoded) == raw


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"CRQ2",
        b"CRQ2\x00\x01\x00\x00\x00\x00",  # version 1
        b"CRQX\x00\x02\x00\x00\x00\x00",
        HEAD,  # truncated counts
        HEAD + b"\x00\x00",  # no field count
        HEAD + b"\x00\x00\x00\x00\x00",  # trailing byte
        HEAD + b"\x04\x01",  # too many positionals
        HEAD + b"\x00\x00\x04\x01",  # too many fields
        HEAD + b"\x00\x01" + s(b"") + b"\x00\x00",  # empty positional
        HEAD + b"\x00\x01" + s(b"a b") + b"\x00\x00",  # whitespace positional
        HEAD + b"\x00\x00\x00\x01" + s(b"Topic") + s(b"x"),  # bad key
        HEAD + b"\x00\x00\x00\x01" + s(b"1x") + s(b"x"),
        HEAD + b"\x00\x00\x00\x01" + s(b"") + s(b"x"),
        HEAD + b"\x00\x00\x00\x01" + s(b"a\n") + s(b"x"),
        HEAD + b"\x00\x00\x00\x02" + s(b"a") + s(b"x") + s(b"a") + s(b"y"),  # duplicate
        HEAD + b"\x00\x00\x00\x01" + s(b"a") + s(b"\xff"),  # bad UTF-8
        HEAD + b"\x00\x00\x00\x01" + s(b"a") + b"\x00\x00\x00\x09x",  # length past end
    ],
)
def test_decode_rejects(raw: bytes) -> None:
    with pytest.raises(InvalidFrame):
        decode_crq2(raw)


def test_is_crq2() -> None:
    assert is_crq2(HEAD) and is_crq2(memoryview(HEAD + b"\x00"))
    assert not is_crq2(b"CRQ2\x00") and not is_crq2(b"CBV2\x00\x02")


def test_field_name_rule() -> None:
    for good in ("topic", "producerId", "seqNum", "_x", "a1", "isIdempotent", "autoOffsetReset"):
        assert is_field_name(good)
    for bad in ("", "Topic", "1x", "a-b", "a b", "é", "a\n"):
        assert not is_field_name(bad)


def test_encode_rejects() -> None:
    with pytest.raises(LocalProtocolError):
        encode_crq2(CommandPayload((), {"Topic": "x"}))
    with pytest.raises(LocalProtocolError):
        encode_crq2(CommandPayload(("a b",), {}))
    with pytest.raises(LocalProtocolError):
        encode_crq2(CommandPayload((), {"a": "\ud800"}))
    with pytest.raises(LocalProtocolError):
        encode_crq2(CommandPayload(tuple("a" for _ in range(1025)), {}))


def test_get() -> None:
    payload = CommandPayload((), {"topic": "t"})
    assert payload.get("topic") == "t" and payload.get("x") is None and payload.get("x", "d") == "d"


def test_parse_simple_and_positional() -> None:
    command, payload = parse_command_text("  batch_commit topic=t group=g P0:10,P1:21  ")
    assert command == Command.BATCH_COMMIT
    assert payload == CommandPayload(("P0:10,P1:21",), {"topic": "t", "group": "g"})
    assert parse_command_text("LIST") == (Command.LIST, CommandPayload())


def test_parse_message_captures_rest_and_trims() -> None:
    _, payload = parse_command_text("PUBLISH topic=t message=  hello  world k=v  \t")
    assert list(payload.fields.items()) == [("topic", "t"), ("message", "hello  world k=v")]


def test_parse_message_only_at_token_boundary() -> None:
    _, payload = parse_command_text("PUBLISH xmessage=1 message=a")
    assert dict(payload.fields) == {"xmessage": "1", "message": "a"}


def test_parse_metadata_before_message() -> None:
    _, payload = parse_command_text("APPEND_STREAM topic=t metadata={\"a\": 1} x=y message=m m")
    assert list(payload.fields.items()) == [("topic", "t"), ("metadata", '{"a": 1} x=y'), ("message", "m m")]


def test_parse_metadata_without_message_is_plain_token() -> None:
    _, payload = parse_command_text("APPEND_STREAM metadata=a b=c")
    assert list(payload.fields.items()) == [("metadata", "a"), ("b", "c")]


def test_parse_payload_captures_rest_without_message() -> None:
    _, payload = parse_command_text("INTERNAL_BATCH payload=abc def topic=x")
    assert dict(payload.fields) == {"payload": "abc def topic=x"}
    _, payload = parse_command_text("PUBLISH payload=x message=y z")
    assert list(payload.fields.items()) == [("payload", "x"), ("message", "y z")]


def test_parse_message_at_start_and_empty() -> None:
    _, payload = parse_command_text("PUBLISH message=")
    assert dict(payload.fields) == {"message": ""}


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "NOPE topic=x",
        "NEGOTIATE",
        "negotiate x=1",
        "PUBLISH Topic=x",
        "PUBLISH 1x=y",
        "PUBLISH =y",
        "PUBLISH topic=a topic=b",
        "PUBLISH message=a message=b extra",  # fine: the second message= is inside the value
        "PUBLISH " + " ".join(f"k{i}=v" for i in range(1025)),
        "PUBLISH " + " ".join("p" for _ in range(1025)),
    ],
)
def test_parse_rejects(text: str) -> None:
    if text == "PUBLISH message=a message=b extra":
        assert parse_command_text(text)[1].fields == {"message": "a message=b extra"}
        return
    with pytest.raises(CommandTextError) as info:
        parse_command_text(text)
    assert isinstance(info.value, ValueError) and not isinstance(info.value, ProtocolError)


@given(
    st.sampled_from([c for c in Command if c != Command.NEGOTIATE]),
    st.lists(st.from_regex(r"\A[A-Za-z0-9:,]{1,8}\Z"), max_size=3),
    st.dictionaries(field_names.filter(lambda k: k not in ("message", "metadata", "payload")),
                    st.from_regex(r"\A[A-Za-z0-9=:,{}\"]{0,10}\Z"), max_size=5),
    st.none() | st.text(alphabet="ab =\"{}", max_size=12).map(str.strip),
)
def test_render_then_parse(command: Command, pos: list[str], fields: dict[str, str], message: str | None) -> None:
    if message is not None:
        fields = {**fields, "message": message}
    payload = CommandPayload(tuple(pos), fields)
    assert parse_command_text(render_command_text(command, payload)) == (command, payload)
