"""OK text and JSON envelopes (facts A6, B3.3)."""

from __future__ import annotations

import json

import pytest

from cursus.wire import json_envelope, ok_text


def test_ok_text() -> None:
    assert ok_text() == b"OK"
    assert ok_text(("topic", "t"), None, ("deleted", True), count=3, skipped=None, flag=False) == (
        b"OK topic=t deleted=true count=3 flag=false"
    )
    assert ok_text(("acl", "")) == b"OK acl="
    assert ok_text(("name", "é")) == "OK name=é".encode()


@pytest.mark.parametrize("pair", [("k", "a b"), ("k", "a\tb"), ("", "x"), ("a b", "x"), ("a=b", "x")])
def test_ok_text_rejects_whitespace(pair: tuple[str, str]) -> None:
    with pytest.raises(AssertionError):
        ok_text(pair)


def test_json_envelope_is_compact_and_ordered() -> None:
    body = {"status": "OK", "last_offset": 5, "producer_id": "é", "leader": None}
    raw = json_envelope(body)
    assert raw == '{"status":"OK","last_offset":5,"producer_id":"é","leader":null}'.encode()
    assert json.loads(json_envelope(body, indent=2)) == body
    assert b"\n" in json_envelope(body, indent=2)
