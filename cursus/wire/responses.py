"""Success reply payloads: ``OK k=v`` text and compact JSON envelopes (facts A6, B5).

Typed ERROR payloads live in ``errors.py``; CBV2 replies in ``batch.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _check_pair(key: str, value: str) -> None:
    # Programmer errors, not input errors: clients split OK replies on whitespace, so a
    # value with whitespace would corrupt every later field. Raised explicitly so the
    # check survives ``python -O``.
    if not key or "=" in key or any(ch.isspace() for ch in key):
        raise AssertionError(f"bad OK field key {key!r}")
    if any(ch.isspace() for ch in value):
        raise AssertionError(f"OK field {key}= value {value!r} contains whitespace")


def ok_text(*pairs: tuple[str, object] | None, **fields: object) -> bytes:
    """Build an ``OK`` / ``OK k=v k=v`` reply as UTF-8 bytes (facts A6).

    Positional ``(key, value)`` pairs come first, in order (``None`` entries are skipped,
    handy for optional fields), then keyword fields in call order. Values: bools render
    ``true``/``false``, ``None`` values are skipped, others use ``str()``. A key or value
    containing whitespace raises ``AssertionError`` (a caller bug).
    """
    parts = ["OK"]
    items = [pair for pair in pairs if pair is not None]
    items.extend(fields.items())
    for key, value in items:
        if value is None:
            continue
        rendered = _text(value)
        _check_pair(key, rendered)
        parts.append(f"{key}={rendered}")
    return " ".join(parts).encode("utf-8")


def json_envelope(obj: Mapping[str, object], *, indent: int | None = None) -> bytes:
    """Serialise a JSON reply envelope (AckResponse, READ_STREAM, DESCRIBE...) as UTF-8.

    Compact separators (``,`` and ``:``) unless ``indent`` is given; key order is the
    mapping's order (AckResponse key order matters, facts B3.3); non-ASCII is kept as
    UTF-8. Raises ``TypeError`` for values JSON cannot represent.
    """
    separators = (",", ":") if indent is None else (",", ": ")
    return json.dumps(obj, separators=separators, indent=indent, ensure_ascii=False).encode("utf-8")
