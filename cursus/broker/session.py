"""One client connection: negotiation, then requests in order, PUBLISH pipelined (facts A1, B1.3, B1.4).

The session reads one frame header, reads and decodes the payload (charging it to the broker-wide memory
budget as it arrives, within the request deadline) and runs the handler. Most commands are answered before
the next header is read. A PUBLISH whose handler answers :class:`Pending` (appended, now waiting for its
fsync or its ISR) is queued instead, and the session reads on: up to ``max_in_flight_requests_per_connection``
PUBLISH requests of one connection wait together (so they share the fsync), and their replies are written
in request order as they complete (:meth:`Session._flush`). Every handler's ordered part (for PUBLISH the
dedup check, the append and the producer state) still runs one request after the other, in arrival order.
Any other command is a barrier: it is dispatched only once every earlier reply was written, so a CONSUME
after a PUBLISH sees it, and AUTH, STREAM, long polls and multi-frame replies keep the connection to
themselves. acks=0 PUBLISH writes no reply at all. A malformed frame closes this connection only (after the
replies of the requests before it were written) and is counted by reason; a well-formed request with bad
arguments gets a typed ERROR and the connection stays usable.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from typing import Any

from crc32c import crc32c

from cursus.broker.core import Broker
from cursus.broker.handlers import HANDLERS
from cursus.broker.handlers.produce import publish_batch_now
from cursus.broker.offload import Offload
from cursus.broker.ratelog import RateLimitedLog
from cursus.broker.request import Frames, NoReply, Parts, Pending, Reply, Request, SessionInfo, StreamReply
from cursus.wire import (
    HEADER_SIZE,
    INTERNAL_COMMANDS,
    MAX_NEGOTIATION_PAYLOAD,
    Command,
    Compression,
    FrameHeader,
    InvalidUtf8,
    Kind,
    ProtocolError,
    Status,
    check_header_prefix,
    decode_crq2,
    decode_header,
    decode_negotiation_request,
    decode_payload,
    encode_error,
    encode_frame,
    encode_frame_parts,
    encode_negotiation_response,
    encode_plain_frame,
    flags_for,
    is_cbv2,
    is_crq2,
    select_compression,
)
from cursus.wire.errors import BrokerError, InvalidFrame, LocalProtocolError, make_error

log = logging.getLogger("cursus.session")
#: Malformed frames close their connection; the log says so at most once per reason every 10 s (no payloads).
PROTOCOL_LOG = RateLimitedLog(log)


class ByteBudget:
    """Broker-wide budget of request bytes being read, handled or queued for the disk (encoded + decoded).

    A request waits until its reservation fits, so many clients together cannot exhaust memory. Released
    bytes go to the waiters that fit, in arrival order (a waiter that does not fit never holds back a smaller
    one behind it: that one may be what completes a request and frees bytes). A single reservation never
    exceeds the whole budget (it is clamped), so no request waits forever.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def acquire(self, size_bytes: int) -> int:
        """Reserve ``size_bytes`` (clamped to the limit), waiting until they fit; returns what was reserved."""
        size_bytes = min(size_bytes, self.limit_bytes)
        if self.used_bytes + size_bytes <= self.limit_bytes:
            self.used_bytes += size_bytes
            return size_bytes
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((size_bytes, granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.release(size_bytes)  # granted just as we were cancelled: give it back
            raise
        return size_bytes

    def take(self, size_bytes: int) -> bool:
        """Reserve ``size_bytes`` now if they fit without waiting (True), else reserve nothing (False)."""
        if self.used_bytes + size_bytes > self.limit_bytes:
            return False
        self.used_bytes += size_bytes
        return True

    def fits(self, size_bytes: int) -> bool:
        """Whether :meth:`acquire` of ``size_bytes`` would be granted without waiting."""
        return self.used_bytes + size_bytes <= self.limit_bytes

    def release(self, size_bytes: int) -> None:
        """Return a reservation and wake the waiters that now fit (in order)."""
        self.used_bytes -= size_bytes
        self._grant()

    def _grant(self) -> None:
        waiting: deque[tuple[int, asyncio.Future[None]]] = deque()
        for size_bytes, granted in self._waiters:
            if granted.done():  # cancelled
                continue
            if self.used_bytes + size_bytes <= self.limit_bytes:
                self.used_bytes += size_bytes
                granted.set_result(None)
            else:
                waiting.append((size_bytes, granted))
        self._waiters = waiting


#: Request payloads are read (and budgeted) in steps of this size.
READ_STEP_BYTES = 1 << 20
#: Replies up to this size are not charged to the byte budget (the common case: OK lines and acks).
SMALL_REPLY_BYTES = 64 * 1024
#: The first bytes of every Wire v2 frame ("CRS2").
#: Header compression values of a payload sent as is.
_PLAIN = (None, Compression.NONE)
#: Commands that may wait long for data (long polls): their sessions watch the socket for EOF meanwhile.
WATCHED_COMMANDS = frozenset({Command.CONSUME})


class _Payload:
    """A request payload and the budget reserved for it (released once the handler finished, or once the
    bytes it queued for the disk are written)."""

    def __init__(self, budget: ByteBudget) -> None:
        self.budget = budget
        self.reserved = 0
        self.data = b""

    async def reserve(self, size_bytes: int) -> None:
        self.reserved += await self.budget.acquire(size_bytes)

    def release(self, after: asyncio.Future[None] | None = None) -> None:
        """Release the reservation now, or once ``after`` is done (whatever its outcome)."""
        self.data = b""
        if after is not None:
            after.add_done_callback(self._release_written)
            return
        reserved, self.reserved = self.reserved, 0
        if reserved:
            self.budget.release(reserved)

    def _release_written(self, written: asyncio.Future[None]) -> None:
        if not written.cancelled():
            written.exception()  # retrieved here: a failed write fences the partition, which reports it
        self.release()


def _buffered(reader: asyncio.StreamReader) -> int:
    """Bytes ``reader`` holds unread (asyncio's StreamReader keeps them in ``_buffer``; 0 if that ever
    changes, which only turns the untimed fast path of :meth:`Session._read_payload` off)."""
    return len(getattr(reader, "_buffer", b""))


def _decode(header: FrameHeader, parts: list[bytes], negotiated: Compression | None) -> bytes:
    """Join a payload's read steps, check its CRC and decompress it (:func:`decode_payload`; any thread)."""
    return decode_payload(header, parts[0] if len(parts) == 1 else b"".join(parts), negotiated=negotiated)


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
        config = broker.config
        #: ``client_request_timeout_ms`` and ``client_idle_timeout_ms`` (None: no idle limit) in seconds.
        self._request_timeout_s = config.client_request_timeout_ms / 1000.0
        self._idle_timeout_s = config.client_idle_timeout_ms / 1000.0 if config.client_idle_timeout_ms > 0 else None
        #: True while a request is being handled (see :attr:`busy`).
        self._handling = False
        #: Pipelined PUBLISH requests waiting for their reply, oldest first: (command, request id, the
        #: handler's :class:`Pending`, the dispatch start for ``command_duration``).
        self._in_flight: deque[tuple[Command, int, Pending, float]] = deque()
        self._max_in_flight = config.max_in_flight_requests_per_connection
        #: Resolved (and dropped) whenever :meth:`_flush` wrote a reply: what :meth:`_wait_in_flight` waits on.
        self._progress: asyncio.Future[None] | None = None
        self._closing = False
        self._stream: StreamReply | None = None
        #: Bytes read while watching a STREAM's or long poll's socket that belong to the next request.
        self._pending = b""
        self._long_poll: asyncio.Future[tuple[Status, bytes | Parts | StreamReply | NoReply | Pending | Frames | None, bool]] | None = None
        #: True while :meth:`_serve_requests` waits for the first byte of the next request header with
        #: nothing buffered: then :meth:`fast_requests` may serve whole small PUBLISH frames straight from
        #: ``data_received`` (:class:`SessionProtocol`) while this coroutine keeps waiting.
        self._awaiting_request = False
        #: Loop time of the last request the fast path served during that wait (the idle deadline then
        #: counts from it: see :meth:`_read_header`), else None.
        self._fast_served_at: float | None = None
        self._offload_threshold = broker.offload.threshold_bytes
        self._loop_time = asyncio.get_running_loop().time
        #: The fast path skips :func:`authorize`, so it is off with ``enable_sasl`` (every PUBLISH is checked).
        self._fast_path = not config.enable_sasl

    @property
    def busy(self) -> bool:
        """True while a request is being handled or a pipelined reply is still due (shutdown waits for
        these to finish; an open STREAM does not count: shutdown ends it with ``reason=stopped`` instead)."""
        return self._handling or bool(self._in_flight)

    @property
    def closing(self) -> bool:
        """True once the server asked this session to stop (shutdown)."""
        return self._closing

    @closing.setter
    def closing(self, value: bool) -> None:
        self._closing = value
        if value and self._stream is not None:
            self._stream.stop("stopped")  # writes STREAM_END now, before the server closes the socket

    async def run(self) -> None:
        metrics = self.broker.metrics
        graceful = False  # close (flush what is buffered) only after an orderly end; otherwise abort
        try:
            if await self._negotiate():
                await self._serve()
            graceful = True
        except ProtocolError as exc:
            metrics.wire_failures_total.labels(exc.reason).inc()
            PROTOCOL_LOG.warning(exc.reason, "closing %s: protocol error %s", self.info.peer, exc.reason)
            graceful = True  # nothing is pending to write: a plain close
        except (asyncio.IncompleteReadError, _CloseConnection):
            graceful = True  # EOF, EXIT, or a reply that was written before closing
        except (ConnectionError, TimeoutError):
            pass  # includes a client that did not read its reply within the request deadline
        except RuntimeError as exc:  # uvloop: a transport closed under us (client vanished mid-handshake)
            log.debug("closing %s: %s", self.info.peer, exc)
        finally:
            if graceful:
                self.writer.close()
            else:
                self.writer.transport.abort()  # drop unsent bytes: a stuck peer must not pin the session
            try:
                async with asyncio.timeout(self._request_timeout_s):
                    await self.writer.wait_closed()
            except (ConnectionError, OSError, TimeoutError):
                self.writer.transport.abort()

    # -------------------------------------------------------------------------------------- handshake

    async def _read_header(self, timeout_s: float | None, *, between_requests: bool = False) -> FrameHeader:
        """Read and decode one 32-byte header; its first byte may take ``timeout_s`` (None: no deadline,
        the default between requests), the rest must follow within ``client_request_timeout_ms``.

        Every prefix is checked as it arrives (:func:`check_header_prefix`: magic, version, kind), so a
        peer that is not speaking Wire v2 (a Wire v1 client, a port scanner, one stray byte) is closed at
        once, and a stalled partial header cannot hold a connection slot forever.
        """
        pending, self._pending = self._pending, b""
        if not pending:
            self._awaiting_request = between_requests
            full_s = timeout_s
            try:
                while True:
                    if timeout_s is None or full_s is None:
                        pending = await self.reader.read(HEADER_SIZE)
                        break
                    self._fast_served_at = None
                    try:
                        async with asyncio.timeout(timeout_s):
                            pending = await self.reader.read(HEADER_SIZE)
                        break
                    except TimeoutError:
                        # The fast path served requests meanwhile: the idle time counts from the last one.
                        served_at = self._fast_served_at
                        if served_at is None:
                            raise
                        timeout_s = served_at + full_s - self._loop_time()
                        if timeout_s <= 0:
                            raise
            finally:
                self._awaiting_request = False
            if not pending:
                raise asyncio.IncompleteReadError(b"", HEADER_SIZE)
        if len(pending) < HEADER_SIZE:  # a whole header is checked by decode_header alone (the hot path)
            check_header_prefix(pending)
            async with asyncio.timeout(self._request_timeout_s):
                while len(pending) < HEADER_SIZE:
                    chunk = await self.reader.read(HEADER_SIZE - len(pending))
                    if not chunk:
                        raise asyncio.IncompleteReadError(pending, HEADER_SIZE)
                    pending += chunk
                    check_header_prefix(pending)
        return decode_header(pending)

    async def _negotiate(self) -> bool:
        """Negotiation first (decision 4): any failure closes the connection without a reply."""
        timeout = self._idle_timeout_s or 30.0
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

    # ---------------------------------------------------------------------------------------- requests

    async def _serve(self) -> None:
        try:
            await self._serve_requests()
        except (asyncio.IncompleteReadError, _CloseConnection, ProtocolError, TimeoutError):
            # EOF, EXIT, a malformed frame, the idle limit: the replies of the requests before it go first
            # (within the request deadline; a client that does not read them is then dropped).
            if self._in_flight:
                async with asyncio.timeout(self._request_timeout_s):
                    await self._wait_in_flight(0)
            raise

    async def _serve_requests(self) -> None:
        idle = self._idle_timeout_s
        transport = self.writer.transport
        while not self.closing:
            header = await self._read_header(idle, between_requests=True)
            if header.kind != Kind.REQUEST or header.command == Command.NEGOTIATE:
                raise InvalidFrame(f"{header.kind.name} frame with command {header.command.name} is not a request")
            # Checked once the next header is here (its payload stays unread meanwhile): the fast path may
            # have filled the in-flight window while this coroutine waited for the header.
            if self._in_flight:
                if len(self._in_flight) >= self._max_in_flight:
                    await self._wait_in_flight(self._max_in_flight - 1)
                if transport.get_write_buffer_size() > SMALL_REPLY_BYTES:  # a client slow to read its acks
                    async with asyncio.timeout(self._request_timeout_s):
                        await self.writer.drain()
            if self._in_flight and header.command != Command.PUBLISH:
                await self._wait_in_flight(0)  # a barrier: it sees (and answers after) every earlier PUBLISH
            self._handling = True
            stream = None
            try:
                payload = await self._read_payload(header)
                written = None
                try:
                    status, body, close = await self._dispatch_watching(header, payload.data)
                    if isinstance(body, NoReply):
                        written, body = body.written, None
                    elif isinstance(body, Pending):
                        written = body.done
                finally:
                    # acks=0 and pipelined PUBLISH: the bytes stay charged until the writer wrote them
                    # (back-pressure).
                    payload.release(after=written)
                if isinstance(body, Pending):
                    self._in_flight.append((header.command, header.request_id, body, time.perf_counter()))
                    body.done.add_done_callback(self._flush)
                    continue
                if isinstance(body, StreamReply):
                    stream, body = body, None
                if isinstance(body, Frames):
                    for part in body.payloads:
                        await self._write_reply(await _encode_off_loop(
                            self.broker.offload, Kind.STREAM, header.command, status, header.request_id, part,
                            self.compression))
                    body = None
                if body is not None:
                    if self._in_flight:  # a refused PUBLISH behind pipelined ones: answered after them
                        await self._wait_in_flight(0)
                    await self._write_reply(await _encode_off_loop(
                        self.broker.offload, Kind.RESPONSE, header.command, status, header.request_id, body,
                        self.compression))
            finally:
                self._handling = False
            if stream is not None:
                await self._stream_reply(header, stream)
            if close:
                raise _CloseConnection()

    # ------------------------------------------------------------------------------------- fast path

    def fast_path_open(self) -> bool:
        """Whether :meth:`fast_requests` may serve the bytes that just arrived: this coroutine waits for the
        next request header with nothing buffered, the connection is negotiated and neither closing nor
        streaming."""
        return (self._awaiting_request and self._fast_path and not self._closing and self._stream is None and not self._pending
                and self.compression is not None and _buffered(self.reader) == 0)

    def fast_requests(self, data: bytes) -> int:
        """Serve the whole small PUBLISH frames at the start of ``data`` synchronously (no task, no reader
        wake-up); returns how many bytes were consumed (0..len(data)). The rest goes to the reader for
        :meth:`_serve_requests` (the general path).

        Served here, in arrival order, with exactly the general path's semantics: a REQUEST frame of command
        PUBLISH, compression NONE as negotiated, a CBV2 payload below the offload threshold, budget free now
        and room in the in-flight window. Anything else (another command, a partial frame, a malformed or
        compressed one, an undecodable batch) stops here untouched, so the general path answers or rejects
        it (after the replies of the frames served here, which are queued in :attr:`_in_flight`).
        """
        if self.compression is not Compression.NONE:
            return 0
        in_flight = self._in_flight
        broker = self.broker
        budget = self.budget
        size_limit = self._offload_threshold
        total = len(data)
        position = 0
        view = memoryview(data)
        served = False
        try:
            while total - position >= HEADER_SIZE and len(in_flight) < self._max_in_flight:
                try:
                    header = decode_header(view[position:position + HEADER_SIZE])
                except ProtocolError:
                    break
                size = header.encoded_length
                end = position + HEADER_SIZE + size
                if (header.command is not Command.PUBLISH or header.kind is not Kind.REQUEST or end > total
                        or size != header.decoded_length or size >= size_limit
                        or header.flags != _PLAIN_FLAGS or not budget.take(size)):
                    break
                payload = data[position + HEADER_SIZE:end]
                if crc32c(payload) != header.crc or not is_cbv2(payload):
                    budget.release(size)
                    break
                started = time.perf_counter()
                request = Request(Command.PUBLISH, header.request_id, _NO_FIELDS, batch=payload, session=self.info)
                try:
                    result = publish_batch_now(broker, request)
                except ProtocolError:  # undecodable batch (nothing appended): the general path closes
                    budget.release(size)
                    break
                except Exception as exc:  # noqa: BLE001 - answered by _finish, as the general path does
                    result = Pending(_done_future(), functools.partial(_raise, exc))
                position = end
                served = True
                if isinstance(result, Pending):
                    _release_after(budget, size, result.done)
                    in_flight.append((Command.PUBLISH, header.request_id, result, started))
                    result.done.add_done_callback(self._flush)
                else:  # acks=0: no reply; counted as the general path does
                    if result.written is not None:
                        _release_after(budget, size, result.written)
                    else:
                        budget.release(size)
                    metrics = broker.metrics
                    metrics.child(metrics.commands_total, "PUBLISH", "ok").inc()
                    metrics.child(metrics.command_duration, "PUBLISH").observe(time.perf_counter() - started)
        finally:
            view.release()
        if served:
            self._fast_served_at = self._loop_time()
        return position

    async def _wait_in_flight(self, at_most: int) -> None:
        """Wait until at most ``at_most`` pipelined replies are still due."""
        while len(self._in_flight) > at_most:
            if self._progress is None or self._progress.done():  # (done: cancelled with an earlier waiter)
                self._progress = asyncio.get_running_loop().create_future()
            await self._progress

    def _flush(self, _done: object = None) -> None:
        """Write the replies of the oldest pipelined requests whose wait is over, in request order (a done
        callback of every :class:`Pending`; a reply behind an unfinished one waits for it)."""
        in_flight = self._in_flight
        writer = self.writer
        while in_flight and in_flight[0][2].done.done():
            command, request_id, pending, started = in_flight.popleft()
            status, body = self._finish(command, pending, started)
            if body is None:  # the wait was cancelled: the outcome is unknown, so is every later one
                in_flight.clear()
                writer.close()  # after the replies already written
                break
            if not writer.is_closing():
                if self.compression is Compression.NONE:
                    writer.write(encode_plain_frame(command, status, request_id, body))
                else:
                    writer.writelines(encode_frame_parts(Kind.RESPONSE, command, status, request_id, [body],
                                                         compression=self.compression))
        progress, self._progress = self._progress, None
        if progress is not None and not progress.done():
            progress.set_result(None)

    def _finish(self, command: Command, pending: Pending, started: float) -> tuple[Status, bytes | None]:
        """The reply of a pipelined request whose wait is over: (status, payload), or (ERROR, None) when the
        wait was cancelled (shutdown)."""
        metrics = self.broker.metrics
        name = _COMMAND_NAMES[command]
        try:
            if pending.done.cancelled():
                return Status.ERROR, None
            exc = pending.done.exception()
            if exc is not None:
                raise exc
            body = pending.reply()
        except BrokerError as exc:
            metrics.child(metrics.commands_total, name, "error").inc()
            metrics.child(metrics.command_errors_total, name, exc.error.code).inc()
            return Status.ERROR, encode_error(exc.error)
        except Exception as exc:  # a bug must not kill the connection's peers or the broker
            log.error("command %s failed", name, exc_info=exc)
            metrics.child(metrics.commands_total, name, "error").inc()
            return Status.ERROR, encode_error(make_error("broker_error", reason=type(exc).__name__))
        finally:
            metrics.child(metrics.command_duration, name).observe(time.perf_counter() - started)
        metrics.child(metrics.commands_total, name, "ok").inc()
        return Status.OK, body

    async def _read_payload(self, header: FrameHeader) -> _Payload:
        """Read and decode one request payload within the request deadline.

        Budget is reserved as bytes actually arrive (at most :data:`READ_STEP_BYTES` ahead of them), so a
        client that declares a large payload and stalls holds only what it sent, and only until the
        deadline (``client_request_timeout_ms``) closes its connection. The decoded length of a compressed
        payload is reserved before it is inflated. A large payload is joined, checksummed and decompressed on
        the offload threads.
        """
        payload = _Payload(self.budget)
        size = header.encoded_length
        if (size == header.decoded_length and size <= READ_STEP_BYTES and header.compression in _PLAIN
                and _buffered(self.reader) >= size and self.budget.fits(size)):
            # The hot path: a small plain payload that already arrived whole (usually with its header), and
            # budget that is free now: nothing can wait, so no deadline is needed (an asyncio.timeout costs
            # more than the rest of this read).
            payload.reserved = await self.budget.acquire(size)
            data = await self.reader.readexactly(size) if size else b""
            try:
                payload.data = _decode(header, [data], self.compression)
            except BaseException:
                payload.release()
                raise
            return payload
        try:
            async with asyncio.timeout(self._request_timeout_s):
                parts = []
                remaining = header.encoded_length
                while remaining > 0:
                    step = min(remaining, READ_STEP_BYTES)
                    await payload.reserve(step)
                    parts.append(await self.reader.readexactly(step))
                    remaining -= step
                if header.decoded_length != header.encoded_length or header.compression not in (
                        None, Compression.NONE):
                    await payload.reserve(header.decoded_length)
            decode = functools.partial(_decode, header, parts, self.compression)
            del parts
            payload.data = await self.broker.offload.run(max(header.encoded_length, header.decoded_length), decode)
            return payload
        except BaseException:
            payload.release()
            raise

    async def _write_reply(self, frame: Parts) -> None:
        """Write one reply frame (``writelines``: its parts are not joined); large replies hold budget until
        written. A client that does not read its reply within ``client_request_timeout_ms`` is
        disconnected (TimeoutError closes the session)."""
        size_bytes = sum(map(len, frame))
        reserved = await self.budget.acquire(size_bytes) if size_bytes > SMALL_REPLY_BYTES else 0
        try:
            self.writer.writelines(frame)
            del frame
            if self.writer.transport.get_write_buffer_size() == 0:
                return  # the socket took it all (a small reply, a reading client): nothing to drain
            async with asyncio.timeout(self._request_timeout_s):
                await self.writer.drain()
        finally:
            if reserved:
                self.budget.release(reserved)

    async def _dispatch_watching(self, header: FrameHeader,
                                 payload: bytes) -> tuple[Status, bytes | Parts | StreamReply | NoReply | Pending | Frames | None, bool]:
        """Run :meth:`_dispatch`; for long polls also watch the socket so a client that disconnects
        mid-poll frees its session at once (the poll is read-only, so cancelling it is safe)."""
        if header.command not in WATCHED_COMMANDS:
            return await self._dispatch(header, payload)
        handler = asyncio.ensure_future(self._dispatch(header, payload))
        self._long_poll = handler
        # Reading one frame header ahead is allowed (facts B1.4); readexactly consumes nothing until all 32
        # bytes are there, so cancelling it loses no data.
        peek = asyncio.ensure_future(self.reader.readexactly(HEADER_SIZE))
        try:
            await asyncio.wait((handler, peek), return_when=asyncio.FIRST_COMPLETED)
            if not handler.done():
                if peek.exception() is not None:  # EOF or reset: nobody will read the reply
                    handler.cancel()
                    await asyncio.gather(handler, return_exceptions=True)
                    raise _CloseConnection()
                self._pending = peek.result()  # the client pipelined: keep the header for the next loop
            try:
                result = await handler
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # this session is being cancelled
                raise _CloseConnection() from None  # abort_long_poll (shutdown) ended the poll
            if peek.done() and not peek.cancelled() and peek.exception() is None and not self._pending:
                self._pending = peek.result()
            return result
        except asyncio.CancelledError:
            if not handler.done():
                handler.cancel()
            raise
        finally:
            self._long_poll = None
            if not peek.done():
                peek.cancel()
                # The reader allows one waiter at a time: let the cancelled read finish before the next one.
                await asyncio.gather(peek, return_exceptions=True)
            elif not peek.cancelled():
                peek.exception()  # retrieved: EOF after the reply is noticed by the next header read

    def abort_long_poll(self) -> None:
        """Shutdown: end an in-flight long poll now instead of waiting for its ``wait_ms``."""
        if self._long_poll is not None and not self._long_poll.done():
            self._long_poll.cancel()

    async def _stream_reply(self, header: FrameHeader, stream: StreamReply) -> None:
        """Drive a STREAM reply: kind-5 frames until it ends, while watching the socket.

        Requests are not read meanwhile. EOF from the client cancels the stream and closes the connection;
        any bytes from the client before the stream ended are a protocol violation (closes the connection).
        """
        sink = _StreamSink(self, header.command, header.request_id)
        self._stream = stream
        pump = asyncio.ensure_future(stream.run(sink))
        watch = asyncio.ensure_future(self.reader.read(1))
        try:
            if self._closing:
                stream.stop("stopped")
            await asyncio.wait((pump, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._stream = None
            for task in (pump, watch):
                if not task.done():
                    task.cancel()
            await asyncio.gather(pump, watch, return_exceptions=True)
        if watch.done() and not watch.cancelled():
            try:
                data = watch.result()
            except (ConnectionError, OSError):
                data = b""
            if not data:
                raise _CloseConnection()
            if not pump.done() or pump.cancelled():
                raise InvalidFrame("client sent data while a STREAM was open")
            self._pending = data  # the stream ended first: this byte starts the next request
        if pump.cancelled():
            raise _CloseConnection()
        exc = pump.exception()
        if exc is not None:
            if not isinstance(exc, (ConnectionError, OSError, TimeoutError)):
                log.error("STREAM on %s failed", self.info.peer, exc_info=exc)
            raise _CloseConnection()

    async def _dispatch(self, header: FrameHeader,
                        payload: bytes) -> tuple[Status, bytes | Parts | StreamReply | NoReply | Pending | Frames | None, bool]:
        """Decode and run one request; returns (status, reply payload (bytes or parts), a StreamReply, a
        NoReply to suppress, or a Pending to answer later, close after)."""
        command = header.command
        metrics = self.broker.metrics
        name = command.name
        started = time.perf_counter()
        if is_cbv2(payload):
            if command != Command.PUBLISH:
                raise InvalidFrame(f"CBV2 batch with command {command.name}")
            request = Request(command, header.request_id, {}, batch=payload, session=self.info)
        elif is_crq2(payload):
            try:
                decoded = await self.broker.offload.run(len(payload), functools.partial(decode_crq2, payload))
            except InvalidUtf8 as exc:  # well formed, bad text: a typed error, the connection stays (decision 8)
                metrics.child(metrics.commands_total, name, "error").inc()
                return Status.ERROR, encode_error(make_error("invalid_payload", reason=str(exc))), False
            request = Request(command, header.request_id, decoded.fields, decoded.positionals, session=self.info)
        else:  # the reference answers this, then closes (facts B2); counted as a malformed frame
            metrics.wire_failures_total.labels("invalid_frame").inc()
            err = make_error("malformed_input", reason="command_payload_required")
            return Status.ERROR, encode_error(err), True
        result: object = None
        try:
            if command in INTERNAL_COMMANDS:
                raise BrokerError.of("internal_command_unauthorized", command=command.name)
            handler = HANDLERS.get(command)
            if handler is None:
                raise BrokerError.of("UNSUPPORTED_FEATURE", command=command.name)
            result = await handler(self.broker, request)
            if isinstance(result, Pending):  # counted and timed by _finish, once its wait is over
                return Status.OK, result, False
        except BrokerError as exc:
            metrics.child(metrics.commands_total, name, "error").inc()
            metrics.child(metrics.command_errors_total, name, exc.error.code).inc()
            return Status.ERROR, encode_error(exc.error), False
        except LocalProtocolError as exc:  # we failed to encode something: a bug or an unchecked value
            log.exception("command %s could not encode its result", command.name)
            metrics.child(metrics.commands_total, name, "error").inc()
            return Status.ERROR, encode_error(make_error("broker_error", reason=str(exc)[:200])), False
        except ProtocolError:
            raise  # the request itself is undecodable (e.g. a CBV2 batch): close the connection
        except Exception as exc:  # a bug must not kill the connection's peers or the broker
            log.exception("command %s failed", command.name)
            metrics.child(metrics.commands_total, name, "error").inc()
            return Status.ERROR, encode_error(make_error("broker_error", reason=type(exc).__name__)), False
        finally:
            if not isinstance(result, Pending):
                metrics.child(metrics.command_duration, name).observe(time.perf_counter() - started)
        metrics.child(metrics.commands_total, name, "ok").inc()
        if isinstance(result, NoReply):
            return Status.OK, result, False
        if isinstance(result, Reply):
            return Status.OK, result.payload, result.close
        return Status.OK, result, False


_NO_FIELDS: dict[str, str] = {}
#: ``command.name`` without the enum property's cost (metrics labels on the reply path).
_COMMAND_NAMES = {command: command.name for command in Command}
#: The flags byte of a frame with compression NONE.
_PLAIN_FLAGS = flags_for(Compression.NONE)


def _done_future() -> asyncio.Future[None]:
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    done.set_result(None)
    return done


def _raise(exc: Exception) -> bytes:
    raise exc


def _release_after(budget: ByteBudget, size_bytes: int, written: asyncio.Future[Any]) -> None:
    """Return ``size_bytes`` to ``budget`` once ``written`` is done, whatever its outcome (retrieved here: a
    failed write fences the partition, which reports it)."""
    def release(done: asyncio.Future[Any]) -> None:
        if not done.cancelled():
            done.exception()
        budget.release(size_bytes)

    written.add_done_callback(release)


class SessionProtocol(asyncio.StreamReaderProtocol):
    """The client listener's protocol: a :class:`asyncio.StreamReaderProtocol` (so :class:`Session` reads
    and writes through a StreamReader/StreamWriter as before, over TCP or TLS) whose ``data_received`` first
    offers the bytes to :meth:`Session.fast_requests` when the session is idle between requests.

    A single-record PUBLISH then costs no reader wake-up, no coroutine step and no task: the frame is
    decoded, appended and its ack queued from the callback itself, and the ack is written by
    :meth:`Session._flush` once the fsync is done. Bytes the fast path does not take go to the StreamReader
    unchanged (in order: the fast path only consumes a prefix, and only while nothing is buffered), so every
    other request, and every check and deadline, stays with the general path. Flow control is the
    StreamReader's (pause_reading above its limit) and the writer's (no fast path while writing is paused).
    """

    def __init__(self, reader: asyncio.StreamReader, client_connected_cb: Any, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(reader, client_connected_cb, loop=loop)
        self._reader = reader
        #: Set by the server once the connection's :class:`Session` exists.
        self.session: Session | None = None
        self._transport_ref: asyncio.BaseTransport | None = None
        #: True between ``pause_writing`` and ``resume_writing`` (a client slow to read its replies).
        self._writing_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport_ref = transport
        super().connection_made(transport)

    def pause_writing(self) -> None:
        self._writing_paused = True
        super().pause_writing()

    def resume_writing(self) -> None:
        self._writing_paused = False
        super().resume_writing()

    def data_received(self, data: bytes) -> None:
        session = self.session
        if session is not None and not self._writing_paused and session.fast_path_open():
            try:
                used = session.fast_requests(data)
            except Exception:  # a bug: this connection cannot be kept in a known state
                log.exception("fast path failed on %s", session.info.peer)
                if isinstance(self._transport_ref, asyncio.Transport):
                    self._transport_ref.abort()
                return
            if used:
                if used == len(data):
                    return
                data = data[used:]
        super().data_received(data)


class _StreamSink:
    """Writes a STREAM's kind-5 frames on its session's connection (see :class:`StreamSink`)."""

    def __init__(self, session: Session, command: Command, request_id: int) -> None:
        self._writer = session.writer
        self._offload = session.broker.offload
        self._command = command
        self._request_id = request_id
        self._compression = session.compression
        #: Set once :meth:`send_now` wrote the final frame: nothing may follow it.
        self._ended = False

    async def send(self, status: Status, payload: bytes | Parts) -> None:
        frame = await _encode_off_loop(self._offload, Kind.STREAM, self._command, status, self._request_id,
                                            payload, self._compression)
        if self._ended:  # stopped (shutdown) while a large frame was encoded: it ended the stream already
            return
        if self._writer.is_closing():
            raise ConnectionResetError("the STREAM's connection is closed")
        self._writer.writelines(frame)
        del frame
        await self._writer.drain()

    def send_now(self, status: Status, payload: bytes) -> None:
        self._ended = True
        if not self._writer.is_closing():
            self._writer.write(encode_frame(Kind.STREAM, self._command, status, self._request_id, payload,
                                            compression=self._compression))


async def _encode_off_loop(offload: Offload, kind: Kind, command: Command, status: Status, request_id: int,
                                payload: bytes | Parts, compression: Compression | None) -> Parts:
    """:func:`encode_frame_parts` of ``payload``, on the offload threads when it is large."""
    parts = [payload] if isinstance(payload, bytes) else payload
    encode = functools.partial(encode_frame_parts, kind, command, status, request_id, parts, compression=compression)
    return await offload.run(sum(map(len, parts)), encode)
