"""Log lines that a hostile or broken peer can trigger, at most once per key per interval.

A port scanner or a misconfigured client can fail thousands of handshakes a second; the log must still say
that it happens (and how often) without becoming the attack. Pure apart from the logger call: the clock is
injected.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class RateLimitedLog:
    """``warning(key, message, *args)`` logs at most once per ``key`` every ``interval_s`` seconds; the next
    line that gets through says how many were suppressed meanwhile. Never pass payload bytes or secrets."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger, self._interval, self._clock = logger, interval_s, clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, message: str, *args: object) -> bool:
        """Log (or count) one occurrence; returns whether a line was written."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        self._last[key] = now
        suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            message += " (%d more since the last such line)"
            args = (*args, suppressed)
        self._logger.warning(message, *args)
        return True
