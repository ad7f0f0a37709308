"""The operation history: every client operation as an ``invoke`` event, then one completion.

Jepsen-style. A completion is ``ok`` (it happened, with its result), ``fail`` (it certainly did not
happen) or ``info`` (the outcome is unknown: a timeout or a connection lost after the request was sent).
An operation that never completes (the harness stopped first) is treated as ``info``.

Events are written to ``history.jsonl`` as they happen, one JSON object per line::

    {"index": 7, "op": 3, "type": "invoke", "process": "idem-0", "f": "send", "time": 1.234, "value": {...}}
    {"index": 9, "op": 3, "type": "ok", "process": "idem-0", "f": "send", "time": 1.240, "value": {...}}

``time`` is seconds since the start of the run on the monotonic clock shared with ``faults.jsonl``.
``value`` on the invoke is what was asked; on the completion it is the result. Failed and info
completions carry ``error``. The checkers work on :class:`Op` (an invoke paired with its completion).

Operation kinds (``f``) and their values are documented in ``docs/chaos.md``.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

INVOKE = "invoke"
OK = "ok"
FAIL = "fail"
INFO = "info"
COMPLETIONS = (OK, FAIL, INFO)


class Clock:
    """Seconds since the start of the run (monotonic), shared by the history and the fault log."""

    def __init__(self) -> None:
        self.origin = time.monotonic()
        self.wall_origin = time.time()

    def now(self) -> float:
        """Seconds since the clock was created."""
        return time.monotonic() - self.origin


@dataclass(slots=True)
class Op:
    """One operation: its invocation paired with its completion.

    Attributes:
        id: operation id (unique in a history).
        process: the logical client that ran it (``idem-0``, ``reader-1``, ``drain`` ...).
        f: the kind of operation (``send``, ``read``, ``list-offsets``, ``commit``, ``fetch-offset`` ...).
        type: ``ok``, ``fail`` or ``info``.
        value: what the operation asked for (the invoke value).
        result: what came back (the completion value; empty unless ``ok``).
        error: the error text of a ``fail`` or ``info`` completion.
        start: invoke time in seconds since the run started.
        end: completion time (``math.inf`` when it never completed).
    """

    id: int
    process: str
    f: str
    type: str
    value: dict[str, Any]
    result: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    start: float = 0.0
    end: float = math.inf

    @property
    def ok(self) -> bool:
        """True for an ``ok`` completion."""
        return self.type == OK


@dataclass(slots=True)
class Pending:
    """An invoked operation waiting for its completion (returned by :meth:`History.invoke`)."""

    id: int
    process: str
    f: str
    time: float
    value: dict[str, Any]


class History:
    """Thread-safe recorder of operation events, appended to a JSON-lines file as they happen.

    Args:
        path: the ``history.jsonl`` to write (truncated), or None to keep events in memory only.
        clock: the run clock (times are seconds since its origin).
        keep_events: also keep the events in memory (:attr:`events`). Long runs pass False and read the file
            back once at the end (:meth:`ops`), which halves the harness's memory.
    """

    def __init__(self, path: Path | None, clock: Clock, *, keep_events: bool = True) -> None:
        assert path is not None or keep_events, "a history without a file must keep its events"
        self.clock = clock
        self.path = path
        self.keep_events = keep_events
        self.events: list[dict[str, Any]] = []
        self.count = 0
        self._lock = threading.Lock()
        self._next_op = 1
        self._file: TextIO | None = open(path, "w", encoding="utf-8") if path is not None else None  # noqa: SIM115
        #: Called as ``listener(pending, kind, value)`` after each completion is recorded (under the lock).
        self.listeners: list[Callable[[Pending, str, dict[str, Any]], None]] = []

    def invoke(self, process: str, f: str, value: dict[str, Any]) -> Pending:
        """Record the invocation of an operation; complete it with :meth:`complete`."""
        with self._lock:
            op_id = self._next_op
            self._next_op += 1
            now = self.clock.now()
            self._append({"op": op_id, "type": INVOKE, "process": process, "f": f, "time": round(now, 6),
                          "value": value})
        return Pending(op_id, process, f, now, value)

    def complete(self, pending: Pending, kind: str, value: dict[str, Any] | None = None,
                 error: str | None = None) -> None:
        """Record the completion (``ok``, ``fail`` or ``info``) of ``pending``."""
        assert kind in COMPLETIONS, kind
        assert kind == OK or error is not None, "fail and info completions carry an error"
        event: dict[str, Any] = {"op": pending.id, "type": kind, "process": pending.process, "f": pending.f,
                                 "value": value or {}}
        if error is not None:
            event["error"] = error[:500]
        with self._lock:
            event["time"] = round(self.clock.now(), 6)
            self._append(event)
            for listener in self.listeners:
                listener(pending, kind, event["value"])

    def _append(self, event: dict[str, Any]) -> None:
        event["index"] = self.count
        self.count += 1
        if self.keep_events:
            self.events.append(event)
        if self._file is not None:
            self._file.write(json.dumps(event, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        """Flush the file (events are buffered)."""
        with self._lock:
            if self._file is not None:
                self._file.flush()

    def close(self) -> None:
        """Flush and close the file (idempotent); events stay available in memory."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def ops(self) -> list[Op]:
        """The operations recorded so far (see :func:`pair`), from memory or read back from the file."""
        if not self.keep_events:
            assert self.path is not None
            self.flush()
            return load(self.path)
        with self._lock:
            events = list(self.events)
        return pair(events)


def pair(events: Iterable[dict[str, Any]]) -> list[Op]:
    """Pair invoke events with their completions, in invocation order.

    An invoke without a completion becomes an ``info`` op ending at ``math.inf``. A completion without an
    invoke is a malformed history (``ValueError``).
    """
    ops: dict[int, Op] = {}
    strings: dict[str, str] = {}  # one copy of each value string: a value is written once, read many times
    for event in events:
        op_id = int(event["op"])
        if event["type"] == INVOKE:
            if op_id in ops:
                raise ValueError(f"operation {op_id} invoked twice")
            value = dict(event.get("value") or {})
            if isinstance(value.get("values"), list):
                value["values"] = [strings.setdefault(v, v) for v in value["values"]]
            ops[op_id] = Op(id=op_id, process=event["process"], f=event["f"], type=INFO, value=value,
                            error="never completed", start=float(event["time"]))
            continue
        op = ops.get(op_id)
        if op is None:
            raise ValueError(f"completion of operation {op_id} without an invoke")
        if event["type"] not in COMPLETIONS:
            raise ValueError(f"operation {op_id}: unknown event type {event['type']!r}")
        op.type = event["type"]
        op.result = dict(event.get("value") or {})
        records = op.result.get("records")
        if records:
            op.result["records"] = [tuple(strings.setdefault(x, x) if isinstance(x, str) else x for x in r)
                                    for r in records]
        op.error = event.get("error")
        op.end = float(event["time"])
    return sorted(ops.values(), key=lambda op: (op.start, op.id))


def read_events(path: Path) -> Iterator[dict[str, Any]]:
    """The events of a ``history.jsonl`` file (a torn last line, from a killed harness, is skipped)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except ValueError:
                continue


def load(path: Path) -> list[Op]:
    """The paired operations of a ``history.jsonl`` file."""
    return pair(read_events(path))
