"""Strict parsing of numeric command fields.

Python's ``int()`` accepts whitespace, underscores and non-ASCII digits (``"1_0"``, ``"٣"``); the Go
reference accepts only ASCII digits with an optional sign, and values must fit the wire types the SDKs
decode (i64/u64). Every numeric field goes through :func:`parse_int`.
"""

from __future__ import annotations

import re

I64_MIN = -(1 << 63)
I64_MAX = (1 << 63) - 1
U64_MAX = (1 << 64) - 1
I32_MAX = (1 << 31) - 1
_INTEGER = re.compile(r"[+-]?[0-9]{1,20}")


def parse_int(raw: str, *, minimum: int = I64_MIN, maximum: int = I64_MAX) -> int | None:
    """``raw`` as an integer in ``[minimum, maximum]``, or None when it is not a plain ASCII integer in range."""
    if not _INTEGER.fullmatch(raw) or (minimum >= 0 and raw[:1] in "+-"):
        return None  # an unsigned field takes digits only (as Go's ParseUint: "+2" is not a version)
    value = int(raw, 10)
    if value < minimum or value > maximum:
        return None
    return value
