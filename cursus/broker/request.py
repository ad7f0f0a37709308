"""Request and reply values passed between the session and the command handlers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from cursus.parsing import I64_MAX, I64_MIN, parse_int
from cursus.wire import Command, Status
from cursus.wire.errors import BrokerError

if TYPE_CHECKING:
    from cursus.broker.core import Broker


@dataclass(slots=True)
class SessionInfo:
    """Per-connection facts a handler may need, including its authentication state (``enable_sasl``):
    ``principal`` and ``permissions`` are set by a successful AUTH or inline credentials and cleared by a
    failed one (fail closed)."""

    peer: str
    principal: str | None = None
    authenticated: bool = False
    permissions: frozenset[str] = frozenset()

    def sign_in(self, principal: str, permissions: frozenset[str]) -> None:
        """The connection is now authenticated as ``principal`` with ``permissions``."""
        self.principal, self.permissions, self.authenticated = principal, permissions, True

    def sign_out(self) -> None:
        """Back to anonymous (after a failed authentication)."""
        self.principal, self.permissions, self.authenticated = None, frozenset(), False

    @property
    def authenticated_principal(self) -> str | None:
        """The principal when authenticated, else None (what topic ACLs see)."""
        return self.principal if self.authenticated else None


@dataclass(frozen=True, slots=True)
class Request:
    """One decoded application request.

    ``fields``/``positionals`` come from the CRQ2 payload (empty for a CBV2 PUBLISH); ``batch`` holds the raw
    CBV2 payload of a batch PUBLISH (else None).
    """

    command: Command
    request_id: int
    fields: Mapping[str, str]
    positionals: tuple[str, ...] = ()
    batch: bytes | None = None
    session: SessionInfo = field(default_factory=lambda: SessionInfo(peer="?"))

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.fields.get(key, default)

    def require(self, key: str, *, code: str | None = None) -> str:
        """The field value; raises ``missing_<key>`` (or ``code``) when absent or empty."""
        value = self.fields.get(key)
        if value is None or value == "":
            raise BrokerError.of(code or f"missing_{key}", command=self.command.name)
        return value

    def int_field(self, key: str, default: int | None = None, *, minimum: int = I64_MIN,
                  maximum: int = I64_MAX, code: str | None = None) -> int:
        """Parse a plain ASCII integer field within ``[minimum, maximum]`` (default: the i64 range).

        Raises:
            BrokerError: ``missing_<key>`` when absent without a default; ``invalid_<key>`` (or ``code``)
                when malformed or out of range.
        """
        raw = self.fields.get(key)
        if raw is None or raw == "":
            if default is None:
                raise BrokerError.of(f"missing_{key}", command=self.command.name)
            return default
        value = parse_int(raw, minimum=minimum, maximum=maximum)
        if value is None:
            raise BrokerError.of(code or f"invalid_{key}", command=self.command.name, value=raw)
        return value


@dataclass(frozen=True, slots=True)
class Reply:
    """A handler's answer: OK payload bytes; ``close`` asks the session to close after sending it."""

    payload: bytes
    close: bool = False


@dataclass(frozen=True, slots=True)
class NoReply:
    """A handler's answer that suppresses the reply frame (acks=0 PUBLISH).

    ``written``, when set, resolves (or fails) once the bytes the request queued for the disk are written;
    the session keeps the request's bytes charged to the byte budget until then, so a flood of acks=0
    batches waits on the budget instead of growing the writer's queue.
    """

    written: asyncio.Future[None] | None = None


#: A suppressed reply with nothing queued (an acks=0 PUBLISH that failed).
NO_REPLY = NoReply()


@dataclass(frozen=True, slots=True)
class Pending:
    """A handler's answer whose reply waits for something after the handler's ordered part (a PUBLISH
    after its append: the fsync for acks=1, the captured ISR for acks=all).

    The session does not wait for it before reading the next request (pipelining, at most
    ``max_in_flight_requests_per_connection`` per connection); once ``done`` resolves it calls ``reply()``
    for the OK payload and writes the replies in request order. ``done`` failing, or ``reply()`` raising,
    with a :class:`BrokerError` answers that typed error. Everything that must happen in arrival order (the
    append, the producer state) has happened before the handler returns this.
    """

    done: asyncio.Future[Any]
    reply: Callable[[], bytes]


#: A payload given as buffers written back to back (large CONSUME/STREAM replies are never concatenated).
Parts = list[bytes | memoryview]


class StreamSink(Protocol):
    """Where a :class:`StreamReply` writes its kind-5 Stream frames (same request id and command)."""

    async def send(self, status: Status, payload: bytes | Parts) -> None:
        """Write one Stream frame and wait until the socket buffer drains (backpressure)."""

    def send_now(self, status: Status, payload: bytes) -> None:
        """Write the final Stream frame without waiting (ends a stream during shutdown); a :meth:`send` still
        in progress then writes nothing."""


class StreamReply:
    """A handler's answer that keeps the request open (STREAM, spec "STREAM (continuous push)").

    The session stops reading requests, calls :meth:`run` with a :class:`StreamSink`, and watches the
    socket for EOF meanwhile (which cancels :meth:`run`). :meth:`run` returns after it sent its final
    ``STREAM_END`` frame; the session then serves the next request. :meth:`stop` ends the stream from
    outside (broker shutdown: ``reason=stopped``) and must write the final frame synchronously.
    """

    async def run(self, sink: StreamSink) -> None:
        """Push frames until the stream ends (subclasses implement)."""
        raise NotImplementedError

    def stop(self, reason: str) -> None:
        """End the stream now with ``reason`` (subclasses implement; idempotent)."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Frames:
    """A handler's answer of several frames on the request's id, written in order as Stream frames
    (kind 5), status OK, before the next request is read (READ_STREAM and BROWSE_MESSAGES: a JSON envelope,
    then a CBV2 batch; facts decision 6)."""

    payloads: tuple[bytes | Parts, ...]


#: What a handler answers (see :mod:`cursus.broker.session` for how each is written).
Answer = Reply | NoReply | Pending | bytes | Parts | StreamReply | Frames
Handler = Callable[["Broker", Request], Awaitable[Answer]]
