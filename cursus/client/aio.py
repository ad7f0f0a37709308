"""asyncio Wire v2 transport: :class:`AsyncConnection` and :class:`AsyncClient`.

The asyncio twins of :class:`cursus.client.connection.Connection` and :class:`~cursus.client.connection.Client`,
on the same sans-IO codec (:class:`cursus.wire.FrameDecoder`, :func:`cursus.wire.encode_frame`) and the same
retry decisions (:class:`cursus.client.connection.Attempts`). Semantics are identical: negotiation with a
preferred compression, optional TLS and AUTH, request ids from 1, one request in flight per connection,
timeouts, reconnect with bounded exponential backoff and jitter, ``NOT_LEADER``/``NOT_COORDINATOR``
redirects. A cancelled request closes its connection (its reply could otherwise be read as the next one's).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from cursus.client.connection import (
    DEFAULT_ADDRESS,
    READ_ONLY_COMMANDS,
    RECV_BYTES,
    Address,
    Attempts,
    ConnectionClosed,
    ConnectionOptions,
    auth_payload,
    check_auth_reply,
    check_correlation,
    compression_of,
    format_address,
    negotiated_compression,
    negotiation_request,
    options_from,
    parse_bootstrap,
    probe_tls,
    stream_frame_ends,
    tls_failure,
    tls_required_error,
)
from cursus.client.errors import BrokerUnavailableError, ClientClosedError, CursusError, error_from_frame
from cursus.wire import (
    Command,
    CommandPayload,
    Compression,
    Frame,
    FrameDecoder,
    Kind,
    ProtocolError,
    Status,
    encode_crq2,
    encode_frame,
    parse_command_text,
)

__all__ = ["AsyncClient", "AsyncConnection"]


class AsyncConnection:
    """One negotiated Wire v2 connection on asyncio streams. Create it with :meth:`open`.

    Raises (from ``open`` and methods): ``OSError``/``TimeoutError`` for transport failures,
    :class:`~cursus.client.connection.ConnectionClosed` on EOF or use after close,
    :class:`cursus.wire.ProtocolError` for malformed or uncorrelated frames, the broker's typed error when
    AUTH is refused. After any of these (or a cancellation mid-request) the connection is closed.
    """

    def __init__(self, host: str, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                 preferred: Compression, timeout_s: float) -> None:
        self.host = host
        self.port = port
        self.preferred = preferred
        self.timeout_s = timeout_s
        self.compression: Compression | None = None
        self.closed = False
        self._reader = reader
        self._writer = writer
        self._decoder = FrameDecoder()
        self._next_request_id = 1
        self._lock = asyncio.Lock()
        #: Requests written whose (last) reply has not been read yet.
        self._unanswered = 0

    @classmethod
    async def open(cls, host: str, port: int, *, compression: Compression | str = Compression.NONE,
                   timeout_s: float = 5.0, ssl_context: ssl.SSLContext | None = None,
                   server_hostname: str | None = None, principal: str | None = None,
                   token: str | None = None) -> AsyncConnection:
        """Connect, negotiate, and authenticate when ``principal`` is given (see ``Connection``).

        Args:
            host, port: broker address.
            compression: preferred compression (``none`` offered after it).
            timeout_s: connect timeout and per-read timeout in seconds.
            ssl_context, server_hostname: TLS settings.
            principal, token: ``AUTH principal= token=`` right after negotiation.
        """
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=ssl_context, server_hostname=(server_hostname or host) if ssl_context else None,
                    limit=RECV_BYTES)
        except (OSError, ssl.SSLError) as exc:
            mapped = tls_failure(exc, (host, port), ssl_context, before_reply=False)
            if mapped is not None:
                raise mapped from exc
            raise
        conn = cls(host, port, reader, writer, preferred=compression_of(compression), timeout_s=timeout_s)
        try:
            try:
                await conn._negotiate()
            except (OSError, ssl.SSLError) as exc:
                mapped = tls_failure(exc, (host, port), ssl_context, before_reply=True)
                if mapped is None and ssl_context is None and isinstance(exc, ConnectionClosed) \
                        and await asyncio.to_thread(probe_tls, (host, port), timeout_s):
                    mapped = tls_required_error((host, port))
                if mapped is not None:
                    raise mapped from exc
                raise
            if principal is not None:
                await conn._authenticate(principal, token or "")
        except BaseException:
            conn._fail()
            raise
        return conn

    @property
    def address(self) -> Address:
        """``(host, port)`` of the broker."""
        return self.host, self.port

    async def _negotiate(self) -> None:
        request, offers = negotiation_request(self.preferred)
        self._writer.write(request)
        self.compression = self._decoder.negotiated = negotiated_compression(
            await self._read_frame(self.timeout_s), offers)

    async def _authenticate(self, principal: str, token: str) -> None:
        check_auth_reply(await self._request(Command.AUTH, auth_payload(principal, token), self.timeout_s))

    def _fail(self) -> None:
        if not self.closed:
            self.closed = True
            self._writer.close()

    def stale(self) -> bool:
        """See :meth:`cursus.client.connection.Connection.stale`: closed, or idle with the broker's EOF already
        received (the stream reader sees it without a read pending); a stale connection is closed here."""
        if self.closed:
            return True
        if self._unanswered or self._lock.locked():
            return False
        if self._decoder.buffered_bytes or self._reader.at_eof() or self._reader.exception() is not None:
            self._fail()
            return True
        return False

    def _answered(self) -> None:
        if self._unanswered:
            self._unanswered -= 1

    async def _read_frame(self, timeout_s: float | None) -> Frame:
        async with asyncio.timeout(timeout_s):
            while True:
                frame = self._decoder.next_frame()
                if frame is not None:
                    return frame
                data = await self._reader.read(RECV_BYTES)
                if not data:
                    raise ConnectionClosed(f"{self.host}:{self.port} closed the connection")
                self._decoder.feed(data)

    async def _send(self, command: Command, payload: bytes) -> int:
        if self.closed:
            raise ConnectionClosed(f"connection to {self.host}:{self.port} is closed")
        assert self.compression is not None, "negotiation has not completed"
        request_id = self._next_request_id
        self._next_request_id += 1
        self._unanswered += 1
        self._writer.write(encode_frame(Kind.REQUEST, command, Status.NONE, request_id, payload,
                                        compression=self.compression))
        async with asyncio.timeout(self.timeout_s):
            await self._writer.drain()
        return request_id

    async def _request(self, command: Command, payload: bytes, timeout_s: float | None) -> Frame:
        request_id = await self._send(command, payload)
        frame = await self._read_frame(timeout_s if timeout_s is not None else self.timeout_s)
        check_correlation(frame, request_id, command)
        self._answered()
        return frame

    async def read_frame(self) -> Frame:
        """Wait for one whole frame (low level)."""
        async with self._lock:
            try:
                return await self._read_frame(self.timeout_s)
            except BaseException:
                self._fail()
                raise

    async def send(self, command: Command, payload: bytes) -> int:
        """Write one request without waiting for a reply (acks=0 PUBLISH); returns its request id."""
        async with self._lock:
            try:
                return await self._send(command, payload)
            except BaseException:
                self._fail()
                raise

    async def receive(self, request_id: int, command: Command, *, timeout_s: float | None = None) -> Frame:
        """See :meth:`cursus.client.connection.Connection.receive`."""
        async with self._lock:
            try:
                frame = await self._read_frame(self.timeout_s if timeout_s is None else timeout_s)
                check_correlation(frame, request_id, command)
                self._answered()
                return frame
            except BaseException:
                self._fail()
                raise

    async def request(self, command: Command, payload: bytes, *, timeout_s: float | None = None) -> Frame:
        """Send one request and return its reply frame (correlation checked); ``timeout_s`` overrides the
        read timeout for this reply."""
        async with self._lock:
            try:
                return await self._request(command, payload, timeout_s)
            except BaseException:
                self._fail()
                raise

    async def stream(self, command: Command, payload: bytes) -> AsyncIterator[Frame]:
        """Send one request and yield reply frames until STREAM_END or ERROR. Abandoning the iterator early
        closes the connection."""
        async with self._lock:
            finished = False
            try:
                request_id = await self._send(command, payload)
                while True:
                    frame = await self._read_frame(self.timeout_s)
                    finished = stream_frame_ends(frame, request_id, command)
                    if finished:
                        self._answered()
                    yield frame
                    if finished:
                        return
            finally:
                if not finished:
                    self._fail()

    async def command(self, text: str, *, timeout_s: float | None = None) -> Frame:
        """Send a text command as CRQ2 and return the reply frame."""
        command, payload = parse_command_text(text)
        return await self.request(command, encode_crq2(payload), timeout_s=timeout_s)

    async def call(self, command: Command, fields: Mapping[str, str] | None = None,
                   positionals: tuple[str, ...] = (), *, timeout_s: float | None = None) -> Frame:
        """Send a CRQ2 request built from ``fields`` and return the reply frame."""
        return await self.request(command, encode_crq2(CommandPayload(positionals, dict(fields or {}))),
                                  timeout_s=timeout_s)

    async def close(self) -> None:
        """Close the connection (idempotent)."""
        self._fail()
        try:
            async with asyncio.timeout(1.0):  # a TLS peer that never answers close_notify must not hang us
                await self._writer.wait_closed()
        except (OSError, ssl.SSLError, TimeoutError):
            pass

    async def __aenter__(self) -> AsyncConnection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def open_connection(options: ConnectionOptions, address: Address) -> AsyncConnection:
    """Open an :class:`AsyncConnection` to ``address`` with ``options``."""
    return await AsyncConnection.open(address[0], address[1], compression=options.compression,
                                      timeout_s=options.timeout_s, ssl_context=options.ssl_context,
                                      server_hostname=options.server_hostname, principal=options.principal,
                                      token=options.token)


class AsyncClient:
    """asyncio connections to Cursus brokers with reconnects, retries and redirects.

    Same arguments, behaviour and errors as :class:`cursus.client.connection.Client`; every request method
    is a coroutine. Use from one event loop.
    """

    def __init__(self, bootstrap: str | Sequence[str] = DEFAULT_ADDRESS,
                 options: ConnectionOptions | None = None, **overrides: Any) -> None:
        self.options = options_from(options, overrides)
        self.bootstrap: list[Address] = parse_bootstrap(bootstrap)
        self._connections: dict[Address, AsyncConnection] = {}
        self._opening: dict[Address, asyncio.Lock] = {}
        self._closed = False

    async def connection(self, address: Address | None = None) -> AsyncConnection:
        """The cached connection to ``address`` (default: first bootstrap broker), opened if needed."""
        address = address or self.bootstrap[0]
        if self._closed:
            raise ClientClosedError("client is closed")
        lock = self._opening.setdefault(address, asyncio.Lock())
        async with lock:
            conn = self._connections.get(address)
            if conn is not None and not conn.stale():
                return conn
            conn = await open_connection(self.options, address)
            if self._closed:
                await conn.close()
                raise ClientClosedError("client is closed")
            self._connections[address] = conn
            return conn

    async def drop(self, address: Address) -> None:
        """Close and forget the cached connection to ``address``."""
        conn = self._connections.pop(address, None)
        if conn is not None:
            await conn.close()

    async def request(self, command: Command, payload: bytes, *, address: Address | None = None,
                      retry_safe: bool | None = None, timeout_s: float | None = None,
                      follow_redirects: bool = True, failover: bool = False) -> Frame:
        """Send one request and return its OK reply frame; see ``Client.request`` for the rules (``failover``
        included)."""
        safe = command in READ_ONLY_COMMANDS if retry_safe is None else retry_safe
        attempts = Attempts(address or self.bootstrap[0], self.options, safe, command.name,
                            follow_redirects=follow_redirects, rotation=() if address else self.bootstrap)
        while True:
            try:
                conn = await self.connection(attempts.target)
            except (OSError, ProtocolError, CursusError) as exc:
                if isinstance(exc, ClientClosedError):
                    raise
                if failover and address is not None and not isinstance(exc, CursusError):
                    raise BrokerUnavailableError(
                        f"cannot connect to {format_address(address)} for {command.name}: {exc}") from exc
                await asyncio.sleep(attempts.after_connect_failure(exc))
                continue
            try:
                frame = await conn.request(command, payload, timeout_s=timeout_s)
            except (OSError, ProtocolError) as exc:
                await self.drop(attempts.target)
                await asyncio.sleep(attempts.after_transport_failure(exc))
                continue
            if frame.status != Status.ERROR:
                return frame
            retry_delay = attempts.after_error_reply(error_from_frame(frame))
            if retry_delay:
                await asyncio.sleep(retry_delay)

    async def call(self, command: Command, fields: Mapping[str, str] | None = None, *,
                   positionals: tuple[str, ...] = (), address: Address | None = None,
                   retry_safe: bool | None = None, timeout_s: float | None = None,
                   follow_redirects: bool = True, failover: bool = False) -> Frame:
        """``request`` with a CRQ2 payload built from ``fields`` and ``positionals``."""
        payload = encode_crq2(CommandPayload(tuple(positionals), dict(fields or {})))
        return await self.request(command, payload, address=address, retry_safe=retry_safe,
                                  timeout_s=timeout_s, follow_redirects=follow_redirects, failover=failover)

    async def command(self, text: str, *, address: Address | None = None, retry_safe: bool | None = None,
                      timeout_s: float | None = None) -> Frame:
        """``request`` for a text command ``NAME k=v ...``."""
        command, payload = parse_command_text(text)
        return await self.request(command, encode_crq2(payload), address=address, retry_safe=retry_safe,
                                  timeout_s=timeout_s)

    async def close(self) -> None:
        """Close every connection (idempotent)."""
        self._closed = True
        connections = list(self._connections.values())
        self._connections.clear()
        for conn in connections:
            await conn.close()

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
