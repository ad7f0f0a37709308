"""Typed errors, the registry and protocol error reasons (facts A7, B4; spec section 7)."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cursus.wire import (
    PROTOCOL_FAILURE_REASONS,
    REGISTRY,
    BrokerError,
    ChecksumMismatch,
    CompressionMismatch,
    DecompressionRejected,
    ErrorClass,
    FrameTooLarge,
    InvalidFrame,
    LocalProtocolError,
    ProtocolError,
    TypedError,
    classify,
    decode_error,
    encode_error,
    make_error,
    parse_error_text,
)
from tests.conftest import REPO_ROOT

keys = st.text(min_size=1, max_size=12)
typed_errors = st.builds(
    TypedError,
    st.text(min_size=1, max_size=30),
    st.sampled_from(list(ErrorClass)),
    st.booleans(),
    st.text(max_size=40),
    st.dictionaries(keys, st.text(max_size=20), max_size=6),
)


@given(typed_errors)
def test_binary_roundtrip(error: TypedError) -> None:
    raw = encode_error(error)
    decoded = decode_error(raw)
    assert decoded == TypedError(error.code, error.error_class, error.retryable, error.message,
                                 dict(sorted(error.fields.items())))
    assert encode_error(decoded) == raw


token = st.from_regex(r"\A[A-Za-z0-9_.:,/-]{1,10}\Z")
field_key = st.from_regex(r"\A[a-z][a-z0-9_]{0,8}\Z").filter(lambda k: k not in ("class", "retryable"))


@given(
    st.from_regex(r"\A[A-Za-z][A-Za-z_]{0,20}\Z"),
    st.sampled_from(list(ErrorClass)),
    st.booleans(),
    st.lists(token, max_size=4).map(" ".join),
    st.dictionaries(field_key, st.text(max_size=15) | token, max_size=4),
)
def test_render_then_parse_text(code: str, cls: ErrorClass, retryable: bool, message: str,
                                fields: dict[str, str]) -> None:
    error = TypedError(code, cls, retryable, message, fields)
    parsed = parse_error_text(error.render())
    assert parsed.code == code and parsed.error_class == cls and parsed.retryable == retryable
    assert parsed.message == message
    assert parsed.fields == fields


def error_payload(code: bytes = b"c", cls: int = 1, retryable: int = 0, message: bytes = b"",
                  fields: list[tuple[bytes, bytes]] | None = None, count: int | None = None) -> bytes:
    fields = fields or []
    out = struct.pack(">I", len(code)) + code + bytes((cls, retryable)) + struct.pack(">I", len(message)) + message
    out += struct.pack(">H", len(fields) if count is None else count)
    for key, value in fields:
        out += struct.pack(">I", len(key)) + key + struct.pack(">I", len(value)) + value
    return out


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        error_payload(code=b""),
        error_payload(cls=0),
        error_payload(cls=9),
        error_payload(retryable=2),
        error_payload(fields=[(b"", b"x")]),
        error_payload(fields=[(b"a", b"x"), (b"a", b"y")]),
        error_payload(count=257),
        error_payload(count=1),
        error_payload() + b"\x00",
        error_payload(code=b"\xff"),
        error_payload()[:-1],
    ],
)
def test_decode_rejects(raw: bytes) -> None:
    with pytest.raises(InvalidFrame):
        decode_error(raw)


def test_encode_rejects() -> None:
    with pytest.raises(LocalProtocolError):
        encode_error(TypedError("", ErrorClass.INTERNAL, False))
    with pytest.raises(LocalProtocolError):
        encode_error(TypedError("x", ErrorClass.INTERNAL, False, fields={"": "v"}))
    with pytest.raises(LocalProtocolError):
        encode_error(TypedError("x", ErrorClass.INTERNAL, False, fields={f"k{i}": "v" for i in range(257)}))


def test_encode_sorts_fields() -> None:
    error = TypedError("x", ErrorClass.CONFLICT, False, "", {"b": "2", "a": "1"})
    assert list(decode_error(encode_error(error)).fields) == ["a", "b"]


def test_render_quotes_and_order() -> None:
    error = make_error("OFFSET_OUT_OF_RANGE", "see docs", requested=5, earliest=0, latest=3, note='a "b"')
    assert error.render() == (
        'ERROR: OFFSET_OUT_OF_RANGE class=conflict retryable=false earliest=0 latest=3 '
        'note="a \\"b\\"" requested=5 see docs'
    )


def test_parse_error_text_rules() -> None:
    parsed = parse_error_text('ERROR: NOT_LEADER leader=h:1 reason="x y" some detail')
    assert (parsed.code, parsed.error_class, parsed.retryable) == ("NOT_LEADER", ErrorClass.ROUTING, True)
    assert parsed.fields == {"leader": "h:1", "reason": "x y"} and parsed.message == "some detail"
    overridden = parse_error_text("ERROR: topic_not_found class=availability retryable=true topic=t")
    assert overridden.error_class == ErrorClass.AVAILABILITY and overridden.retryable
    assert overridden.fields == {"topic": "t"}
    bad_override = parse_error_text("ERROR topic_not_found class=bogus retryable=maybe")
    assert bad_override.error_class == ErrorClass.NOT_FOUND and not bad_override.retryable
    assert bad_override.fields == {"class": "bogus", "retryable": "maybe"}
    assert parse_error_text("ERROR:").code == "broker_error"
    assert parse_error_text('ERROR: x k="unterminated').fields == {"k": '"unterminated'}


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("NOT_LEADER", (ErrorClass.ROUTING, True)),
        ("no_raft_leader", (ErrorClass.AVAILABILITY, True)),
        ("producer_fenced", (ErrorClass.FENCING, False)),
        ("version_conflict", (ErrorClass.CONFLICT, False)),
        ("NOT_AUTHORIZED_FOR_TOPIC", (ErrorClass.AUTHORIZATION, False)),
        ("topic_not_found", (ErrorClass.NOT_FOUND, False)),
        ("invalid_acks", (ErrorClass.VALIDATION, False)),
        ("raft_apply_failed", (ErrorClass.INTERNAL, False)),
        ("replication_unavailable", (ErrorClass.AVAILABILITY, True)),
        ("partition_fenced", (ErrorClass.AVAILABILITY, False)),
        ("storage_unavailable", (ErrorClass.AVAILABILITY, False)),
        ("idempotency_gap", (ErrorClass.CONFLICT, False)),
        ("resource_exhausted", (ErrorClass.AVAILABILITY, True)),
        ("message_too_large", (ErrorClass.VALIDATION, False)),
        # fallback rules (B4.3), always non-retryable
        ("not_authorized_x", (ErrorClass.AUTHORIZATION, False)),
        ("Authorization_thing", (ErrorClass.AUTHORIZATION, False)),
        ("widget_not_found", (ErrorClass.NOT_FOUND, False)),
        ("widget_missing", (ErrorClass.NOT_FOUND, False)),
        ("missing_widget", (ErrorClass.VALIDATION, False)),
        ("INVALID_WIDGET", (ErrorClass.VALIDATION, False)),
        ("empty_x", (ErrorClass.VALIDATION, False)),
        ("malformed_x", (ErrorClass.VALIDATION, False)),
        ("decode_x", (ErrorClass.VALIDATION, False)),
        ("unmarshal_x", (ErrorClass.VALIDATION, False)),
        ("something_else", (ErrorClass.INTERNAL, False)),
    ],
)
def test_classify(code: str, expected: tuple[ErrorClass, bool]) -> None:
    assert classify(code) == expected


def test_registry_covers_facts_and_spec_lists() -> None:
    required = [
        "NOT_COORDINATOR", "NOT_PARTITION_LEADER", "insufficient_in_sync_replicas",
        "transaction_offset_prepare_failed", "STALE_LEADER_EPOCH", "transaction_record_not_staged",
        "internal_txn_publish_forbidden", "transaction_not_found", "consumer_group_subscriptions_feature_required",
        "invalid_min_in_sync_replicas", "UNSUPPORTED_FEATURE", "UNSUPPORTED_PROTOCOL_VERSION",
        "alter_topic_config_failed", "transaction_publish_failed", "invalid_cluster_request", "cluster_unauthorized",
        "unsupported_cluster_command", "cluster_join_failed", "invalid_if_exists", "topic_delete_blocked",
        "internal_topic_delete_forbidden", "topic_truncate_blocked", "request_timeout", "invalid_idempotent",
        "invalid_event_sourcing", "PARTITION_LEADER_FENCED", "invalid_topic_name", "PARTITION_NOT_FOUND",
        "TOPIC_NOT_FOUND", "unsupported_topic_policy", "invalid_isolation", "invalid_batch", "invalid_wait_ms",
        "invalid_max_bytes", "sequence_out_of_order", "transaction_metadata_forbidden", "too_many_connections",
    ]
    assert [code for code in required if code not in REGISTRY] == []
    assert len(REGISTRY) > 200
    with pytest.raises(TypeError):
        REGISTRY["x"] = (ErrorClass.INTERNAL, False)  # type: ignore[index]


def test_error_class_labels() -> None:
    assert [c.label for c in ErrorClass] == [
        "validation", "authorization", "routing", "availability", "conflict", "fencing", "not_found", "internal",
    ]
    assert ErrorClass.from_label("NOT_FOUND") is ErrorClass.NOT_FOUND and ErrorClass.from_label("x") is None


def test_make_error_and_broker_error() -> None:
    error = make_error("topic_not_found", topic="t", flag=True, skipped=None, count=3)
    assert error == TypedError("topic_not_found", ErrorClass.NOT_FOUND, False, "",
                               {"topic": "t", "flag": "true", "count": "3"})
    with pytest.raises(LocalProtocolError):
        make_error("")
    exc = BrokerError.of("NOT_LEADER", leader="h:9000")
    assert exc.error.code == "NOT_LEADER" and exc.error.retryable and str(exc).startswith("ERROR: NOT_LEADER")
    assert BrokerError("invalid_acks", value="x").error == make_error("invalid_acks", value="x")
    assert BrokerError(error).error is error
    with pytest.raises(TypeError):
        BrokerError(error, "message")


def test_protocol_error_reasons() -> None:
    cases = {
        InvalidFrame: "invalid_frame",
        FrameTooLarge: "frame_too_large",
        ChecksumMismatch: "checksum_mismatch",
        CompressionMismatch: "compression_mismatch",
        DecompressionRejected: "decompression_rejected",
        ProtocolError: "unknown",
        LocalProtocolError: "invalid_frame",
    }
    for cls, reason in cases.items():
        error = cls("x")
        assert error.reason == reason and reason in PROTOCOL_FAILURE_REASONS and isinstance(error, ProtocolError)
    assert LocalProtocolError("x", reason="frame_too_large").reason == "frame_too_large"
    with pytest.raises(AssertionError):
        ProtocolError("x", reason="nope")


# Handler authors: every error a broker module emits must be built with one of these
# constructors, with the code as a string literal first argument, e.g.
#     raise BrokerError.of("topic_not_found", topic=name)
#     make_error("invalid_acks", value=raw)
# The scan below finds `make_error(`, `BrokerError.of(`, `BrokerError(` and `TypedError(`
# followed by a quoted string, in every .py file under cursus/, and requires that string
# to be a registered code (cursus/wire/errors.py, _REGISTRY_TABLE).
ERROR_CONSTRUCTOR = re.compile(r"""\b(?:make_error|BrokerError\.of|BrokerError|TypedError)\(\s*(['"])([^'"\n]+)\1""")


def emitted_codes() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted((REPO_ROOT / "cursus").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for match in ERROR_CONSTRUCTOR.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.setdefault(match.group(2), []).append(f"{path.relative_to(REPO_ROOT)}:{line}")
    return found


def test_scan_regex_matches_the_documented_forms() -> None:
    sample = """raise BrokerError.of("a_code", x=1)\nmake_error('b_code')\nBrokerError( "c_code")\nTypedError("d")"""
    assert [m.group(2) for m in ERROR_CONSTRUCTOR.finditer(sample)] == ["a_code", "b_code", "c_code", "d"]


def test_every_emitted_error_code_is_registered() -> None:
    found = emitted_codes()
    assert found, "the scan found no error constructors at all; is the regex broken?"
    unregistered = {code: where for code, where in found.items() if code not in REGISTRY}
    assert unregistered == {}, f"register these codes in cursus/wire/errors.py: {unregistered}"


def test_scan_covers_files_outside_wire() -> None:
    assert Path(REPO_ROOT / "cursus" / "wire" / "errors.py").exists()
