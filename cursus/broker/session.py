"""One client connection: negotiation, then requests one at a time, in order (facts A1, B1.3, B1.4).

The session reads one frame header, reserves the payload's size from the broker-wide memory budget, reads
and decodes the payload, runs the handler, writes exactly one reply (or none for acks=0 PUBLISH) and only
then reads the next header. A malformed frame closes this connection only and is counted by reason; a
well-formed request with bad arguments gets a typed ERROR and the connection stays usable.
"""

from __future__ import annotations

import asyncio
import logging
import time

from cursus.broker.core import Broker
from cursus.broker.handlers import HANDLERS
from cursus.broker.request import NO_REPLY, Reply, Request, SessionInfo
from cursus.wire import (
    HEADER_SIZE,
    INTERNAL_COMMANDS,
    MAX_NEGOTIATION_PAYLOAD,
    Command,
    Compression,
    FrameHeader,
    Kind,
    ProtocolError,
    Status,
    decode_crq2,
    decode_header,
    decode_negotiation_request,
    decode_payload,
    encode_error,
    encode_frame,
    encode_negotiation_response,
    is_cbv2,
    is_crq2,
    select_compression,
)
from cursus.wire.errors import BrokerError, InvalidFrame, make_error

log = logging.getLogger("cursus.session")


class ByteBudget:
    """Broker-wide budget of request bytes being read or handled (encoded + decoded lengths).

    A request waits until its reservation fits, so many clients together cannot exhaust memory. A single
    reservation never exceeds the whole budget (it is clamped), so no request waits forever.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        self._changed = asyncio.Condition()

    async def acquire(self, size_bytes: int) -> int:
        size_bytes = min(size_bytes, self.limit_bytes)
        async with self._changed:
            await self._changed.wait_for(lambda: self.used_bytes + size_bytes <= self.limit_bytes)
            self.used_bytes += size_bytes
        return size_bytes

    async def release(self, size_bytes: int) -> None:
        async with self._changed:
            self.used_bytes -= size_bytes
            self._changed.notify_all()


class _CloseConnection(Exception):
    """Internal: stop serving this connection (after any reply already written)."""


class Session:
    """Serves one accepted connection until EOF, EXIT, a malformed frame or shutdown."""

    def __init__(self, broker: Broker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 budget: ByteBudget) -> None:
        self.broker = broker
        self.reader = reader
        self.writer = writer
        self.budget = budget
        peer = writer.get_extra_info("peername")
        self.info = SessionInfo(peer=f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer))
        self.compression: Compression | None = None
        #: True while a request is being handled (shutdown waits for these to finish).
        self.busy = False
        self.closing = False

    async def run(self) -> None:
        metrics = self.broker.metrics
        try:
            if await self._negotiate():
                await self._serve()
        except ProtocolError as exc:
            metrics.wire_failures_total.labels(exc.reason).inc()
            log.debug("closing %s: %s", self.info.peer, exc)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, _CloseConnection):
            pass
        finally:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except (ConnectionError, OSError):
                pass

    # -------------------------------------------------------------------------------------- handshake

    async def _read_header(self, timeout_s: float | None) -> FrameHeader:
        raw = await asyncio.wait_for(self.reader.readexactly(HEADER_SIZE), timeout_s)
        return decode_header(raw)

    async def _negotiate(self) -> bool:
        """Negotiation first (decision 4): any failure closes the connection without a reply."""
        timeout = self._idle_timeout_s() or 30.0
        header = await self._read_header(timeout)
        if (header.kind != Kind.NEGOTIATION_REQUEST or header.encoded_length > MAX_NEGOTIATION_PAYLOAD
                or header.decoded_length > MAX_NEGOTIATION_PAYLOAD):
            raise InvalidFrame("first frame is not a negotiation request")
        encoded = await asyncio.wait_for(self.reader.readexactly(header.encoded_length), timeout)
        request = decode_negotiation_request(decode_payload(header, encoded, negotiated=None))
        selected = select_compression(request)
        if selected is None:
            raise InvalidFrame("no common wire version or compression")
        self.writer.write(encode_frame(
            Kind.NEGOTIATION_RESPONSE, Command.NEGOTIATE, Status.OK, header.request_id,
            encode_negotiation_response(2, selected), compression=None,
        ))
        await self.writer.drain()
        self.compression = selected
        return True

    def _idle_timeout_s(self) -> float | None:
        ms = self.broker.config.client_idle_timeout_ms
        return ms / 1000.0 if ms > 0 else None

    # ---------------------------------------------------------------------------------------- requests

    async def _serve(self) -> None:
        idle = self._idle_timeout_s()
        while not self.closing:
            header = await self._read_header(idle)
            if header.kind != Kind.REQUEST or header.command == Command.NEGOTIATE:
                raise InvalidFrame(f"{header.kind.name} frame with command {header.command.name} is not a request")
            reserved = await self.budget.acquire(header.encoded_length + header.decoded_length)
            self.busy = True
            try:
                encoded = await self.reader.readexactly(header.encoded_length)
                payload = decode_payload(header, encoded, negotiated=self.compression)
                del encoded
                status, body, close = await self._dispatch(header, payload)
                if body is not None:
                    self.writer.write(encode_frame(Kind.RESPONSE, header.command, status, header.request_id,
                                                   body, compression=self.compression))
                    await self.writer.drain()
            finally:
                self.busy = False
                await self.budget.release(reserved)
            if close:
                raise _CloseConnection()

    async def _dispatch(self, header: FrameHeader, payload: bytes) -> tuple[Status, bytes | None, bool]:
        """Decode and run one request; returns (status, reply payload or None to suppress, close after)."""
        command = header.command
        metrics = self.broker.metrics
        started = time.perf_counter()
        if is_cbv2(payload):
            if command != Command.PUBLISH:
                raise InvalidFrame(f"CBV2 batch with command {command.name}")
            request = Request(command, header.request_id, {}, batch=payload, session=self.info)
        elif is_crq2(payload):
            decoded = decode_crq2(payload)
            request = Request(command, header.request_id, decoded.fields, decoded.positionals, session=self.info)
        else:
            err = make_error("malformed_input", reason="command_payload_required")
            return Status.ERROR, encode_error(err), True
        try:
            if command in INTERNAL_COMMANDS:
                raise BrokerError.of("internal_command_unauthorized", command=command.name)
            handler = HANDLERS.get(command)
            if handler is None:
                raise BrokerError.of("UNSUPPORTED_FEATURE", command=command.name)
            result = await handler(self.broker, request)
        except BrokerError as exc:
            metrics.commands_total.labels(command.name, "error").inc()
            metrics.command_errors_total.labels(command.name, exc.error.code).inc()
            return Status.ERROR, encode_error(exc.error), False
        except ProtocolError:
            raise
        except Exception as exc:  # a bug must not kill the connection's peers or the broker
            log.exception("command %s failed", command.name)
            metrics.commands_total.labels(command.name, "error").inc()
            return Status.ERROR, encode_error(make_error("broker_error", reason=type(exc).__name__)), False
        finally:
            metrics.command_duration.labels(command.name).observe(time.perf_counter() - started)
        metrics.commands_total.labels(command.name, "ok").inc()
        if result is NO_REPLY:
            return Status.OK, None, False
        if isinstance(result, Reply):
            return Status.OK, result.payload, result.close
        return Status.OK, result, False
