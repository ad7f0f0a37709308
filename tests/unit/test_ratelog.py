"""RateLimitedLog: one line per key per interval, with the count of what it held back."""

from __future__ import annotations

import logging

from cursus.broker.ratelog import RateLimitedLog


def test_one_line_per_key_per_interval_then_the_suppressed_count(caplog) -> None:
    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("test.ratelog"), interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.ratelog"):
        assert limited.warning("bad_magic", "closing %s: %s", "peer-1", "bad_magic")
        assert not any(limited.warning("bad_magic", "closing %s: %s", "peer-2", "bad_magic") for _ in range(5))
        assert limited.warning("invalid_frame", "closing %s: %s", "peer-3", "invalid_frame")  # another key
        now[0] = 10.5
        assert limited.warning("bad_magic", "closing %s: %s", "peer-4", "bad_magic")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["closing peer-1: bad_magic", "closing peer-3: invalid_frame",
                     "closing peer-4: bad_magic (5 more since the last such line)"]
