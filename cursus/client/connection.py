"""Blocking Wire v2 transport: one connection, and a client that reconnects and follows redirects.

Two layers (facts A1-A3, spec sections 1-4 and 7):

* :class:`Connection` is one negotiated socket. It speaks only frames: negotiation (preferred compression,
  falling back to none), optional ``AUTH principal= token=``, request ids from 1, one request in flight
  (concurrent callers are serialised), a timeout on every read. Any transport or protocol failure closes it:
  a late or partial reply must never be mistaken for the next request's. It raises the raw exceptions
  (``OSError``/``TimeoutError``, :class:`ConnectionClosed`, :class:`cursus.wire.ProtocolError`) because
  tests and benchmarks drive it directly.
* :class:`Client` owns connections to any number of brokers (lazily opened, one cached per address), turns
  ERROR replies into typed :mod:`cursus.client.errors` exceptions, reconnects with exponential backoff and
  jitter (bounded), retries only requests that are safe to repeat, and follows ``NOT_LEADER leader=`` and
  ``NOT_COORDINATOR host= port=`` redirects. Producer, consumer, admin and ``cursusctl`` sit on it.

The retry decisions are plain functions shared with the asyncio flavour in :mod:`cursus.client.aio`.
"""

from __future__ import annotations

import errno
import json
import os
import random
import select
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cursus.client.errors import (
    AuthenticationError,
    BrokerUnavailableError,
    ClientClosedError,
    CursusError,
    DeliveryUnknownError,
    NotCoordinatorError,
    NotLeaderError,
    ProtocolViolationError,
    RequestTimeoutError,
    TlsError,
    error_from_frame,
)
from cursus.wire import (
    Command,
    CommandPayload,
    Compression,
    Frame,
    FrameDecoder,
    Kind,
    NegotiationRequest,
    ProtocolError,
    Status,
    decode_negotiation_response,
    encode_crq2,
    encode_frame,
    encode_negotiation_request,
    parse_command_text,
)

__all__ = [
    "DEFAULT_ADDRESS",
    "Backoff",
    "Client",
    "Connection",
    "ConnectionClosed",
    "ConnectionOptions",
    "Address",
    "compression_of",
    "format_address",
    "make_ssl_context",
    "negotiation_offers",
    "ok_fields",
    "ok_text_fields",
    "parse_address",
    "parse_bootstrap",
    "json_reply",
]

Address = tuple[str, int]
DEFAULT_PORT = 9000
DEFAULT_ADDRESS = "127.0.0.1:9000"
#: Receive size per recv() call; large enough that a 1 MiB CONSUME reply needs few calls.
RECV_BYTES = 1 << 20


class ConnectionClosed(ConnectionError):
    """The broker closed the connection (EOF) before a complete reply arrived, or the connection was
    already closed by an earlier failure."""


# ------------------------------------------------------------------------------------------ small helpers


def parse_address(text: str, default_port: int = DEFAULT_PORT) -> Address:
    """Parse ``host:port`` (split on the last colon, facts A1; ``[v6]:port`` accepted).

    A bare host gets ``default_port``. Raises ``ValueError`` for an empty host or a bad port.
    """
    raw = text.strip()
    if raw.startswith("["):
        host, _, rest = raw[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif ":" in raw:
        host, _, port_text = raw.rpartition(":")
    else:
        host, port_text = raw, ""
    if not host:
        raise ValueError(f"address {text!r} has no host")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"address {text!r} has an invalid port")
    return host, int(port_text)


def parse_bootstrap(bootstrap: str | Sequence[str]) -> list[Address]:
    """The bootstrap addresses of a client: one ``host:port`` or a sequence of them, in order (see
    :func:`parse_address`). Raises ``ValueError`` for an empty sequence or a bad address."""
    addresses = [bootstrap] if isinstance(bootstrap, str) else list(bootstrap)
    if not addresses:
        raise ValueError("at least one bootstrap address is needed")
    return [parse_address(a) for a in addresses]


def format_address(address: Address) -> str:
    """``host:port`` (IPv6 hosts in brackets)."""
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def compression_of(value: Compression | str | int | None) -> Compression:
    """A :class:`Compression` from an enum, a name (``"gzip"``) or an id; None means ``none``.

    Raises ``ValueError`` for an unknown name or id.
    """
    if value is None:
        return Compression.NONE
    if isinstance(value, Compression):
        return value
    if isinstance(value, str):
        try:
            return Compression[value.strip().upper()]
        except KeyError:
            raise ValueError(f"unknown compression {value!r} (none, gzip, snappy, lz4)") from None
    return Compression(value)


def negotiation_offers(preferred: Compression) -> tuple[Compression, ...]:
    """What a client offers: the preferred compression, then ``none`` unless it is ``none`` (facts A3)."""
    return (preferred,) if preferred == Compression.NONE else (preferred, Compression.NONE)


def make_ssl_context(ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None,
                     *, verify: bool = True) -> ssl.SSLContext:
    """A client TLS context (TLS 1.2+).

    Args:
        ca_file: PEM bundle to verify the broker against; None uses the system trust store.
        cert_file, key_file: client certificate and key (PEM) for mutual TLS; give both or neither.
        verify: False disables certificate and host name checks (testing only).

    Raises:
        ValueError: only one of ``cert_file``/``key_file`` given.
        OSError, ssl.SSLError: unreadable or invalid files.
    """
    if (cert_file is None) != (key_file is None):
        raise ValueError("a client certificate needs both cert_file and key_file")
    for what, path in (("CA file", ca_file), ("client certificate", cert_file), ("client key", key_file)):
        if path is not None and not os.path.isfile(path):
            raise FileNotFoundError(errno.ENOENT, f"TLS {what} not found", path)
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file is not None:
        context.load_cert_chain(cert_file, key_file)
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    _CLIENT_CERTIFICATE[context] = cert_file is not None
    return context


#: Whether a context made by :func:`make_ssl_context` carries a client certificate (contexts made elsewhere
#: are unknown and get the less specific messages).
_CLIENT_CERTIFICATE: weakref.WeakKeyDictionary[ssl.SSLContext, bool] = weakref.WeakKeyDictionary()

#: OpenSSL alert reasons a TLS client receives when the broker refuses its certificate (or its absence).
_CERT_REQUIRED_REASONS = frozenset({"TLSV13_ALERT_CERTIFICATE_REQUIRED"})
_CERT_REFUSED_REASONS = frozenset({"SSLV3_ALERT_BAD_CERTIFICATE", "TLSV1_ALERT_UNKNOWN_CA",
                                   "SSLV3_ALERT_CERTIFICATE_UNKNOWN", "SSLV3_ALERT_CERTIFICATE_EXPIRED",
                                   "SSLV3_ALERT_CERTIFICATE_REVOKED", "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE",
                                   "TLSV1_ALERT_ACCESS_DENIED", "SSLV3_ALERT_HANDSHAKE_FAILURE"})


def tls_failure(exc: BaseException, address: Address, ssl_context: ssl.SSLContext | None, *,
                before_reply: bool) -> TlsError | None:
    """The :class:`~cursus.client.errors.TlsError` an ``exc`` raised while opening a connection stands for, or
    None when it is an ordinary (retryable) transport failure. Pure: it only inspects ``exc``.

    Args:
        exc: from the TLS handshake or the negotiation read.
        address: the broker, for the message.
        ssl_context: the connection's context (None: plaintext).
        before_reply: the connection ended (EOF) before the negotiation reply arrived.
    """
    where = format_address(address)
    if isinstance(exc, ssl.SSLCertVerificationError):
        verify = str(exc.verify_message or exc.reason or "verification failed")
        return TlsError("tls_certificate_verify_failed",
                        f"the certificate of {where} failed verification ({verify}): give the CA that signed it "
                        "(--tls-ca FILE) or, for development only, --tls-insecure", fields={"reason": verify})
    reason = getattr(exc, "reason", None) if isinstance(exc, ssl.SSLError) else None
    has_cert = _CLIENT_CERTIFICATE.get(ssl_context) if ssl_context is not None else None
    if reason in _CERT_REQUIRED_REASONS or (reason in _CERT_REFUSED_REASONS and has_cert is False) or (
            ssl_context is not None and before_reply and has_cert is False and isinstance(exc, ConnectionClosed)):
        return TlsError("tls_client_certificate_required",
                        f"client certificate required: {where} uses mutual TLS; give a certificate its CA "
                        "signed (--tls-cert FILE --tls-key FILE, or make_ssl_context(ca, cert_file, key_file))")
    if reason is None and ssl_context is not None and before_reply and has_cert is True and isinstance(
            exc, ConnectionClosed | ConnectionResetError):
        # TLS 1.3: the client's handshake ends before the server checked its certificate; a refused one shows
        # as the connection closing (the alert lost with it) before the negotiation reply
        reason = "connection closed after the TLS handshake"
    if reason in _CERT_REFUSED_REASONS or reason == "connection closed after the TLS handshake":
        return TlsError("tls_client_certificate_refused",
                        f"{where} refused the client certificate ({reason}): it must be signed by a CA the "
                        "broker trusts (its tls_ca_path) and be valid now", fields={"reason": str(reason)})
    return None


def probe_tls(address: Address, timeout_s: float) -> bool:
    """Whether ``address`` answers a TLS ClientHello (certificates unchecked; only for an error message after
    a plaintext negotiation got no reply, so once per such failure). A broker requiring client certificates
    logs this probe as a handshake without one. Never raises."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection(address, timeout=timeout_s) as raw, \
                context.wrap_socket(raw, server_hostname=address[0]):
            return True
    except ssl.SSLError as exc:  # a TLS alert is still TLS; a plaintext peer gives EOF or a version error
        return not isinstance(exc, ssl.SSLEOFError) and exc.reason not in ("WRONG_VERSION_NUMBER",
                                                                         "UNEXPECTED_EOF_WHILE_READING")
    except OSError:
        return False


def tls_required_error(address: Address) -> TlsError:
    """``tls_required``: a plaintext client reached a TLS listener."""
    return TlsError("tls_required", f"the server requires TLS: {format_address(address)} speaks TLS on this port; "
                                    "connect with --tls (system trust store) or --tls-ca FILE, or "
                                    "ssl_context=make_ssl_context(...) in the SDK")


def ok_text_fields(text: str) -> dict[str, str]:
    """Fields of an ``OK k=v k=v`` reply text; surrounding double quotes on values are stripped (facts A6).

    Tokens without ``=`` are ignored. Raises ``ValueError`` if the text is not ``OK`` / ``OK ...``.
    """
    if text != "OK" and not text.startswith("OK "):
        raise ValueError(f"reply is not OK text: {text[:120]!r}")
    fields: dict[str, str] = {}
    for token in text.split()[1:]:
        key, sep, value = token.partition("=")
        if not sep or not key:
            continue
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]
        fields[key] = value
    return fields


def ok_fields(frame: Frame) -> dict[str, str]:
    """Fields of an OK text reply frame.

    Raises:
        CursusError: the frame is an ERROR reply (its typed exception).
        ProtocolViolationError: the payload is not ``OK`` text.
    """
    if frame.status == Status.ERROR:
        raise error_from_frame(frame)
    try:
        return ok_text_fields(frame.payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolViolationError(f"{frame.command.name} reply is not OK text: {exc}") from None


def json_reply(frame: Frame) -> dict[str, Any]:
    """The JSON object of a JSON reply frame (PUBLISH AckResponse, DESCRIBE).

    Raises:
        CursusError: the frame is an ERROR reply.
        ProtocolViolationError: the payload is not a JSON object.
    """
    if frame.status == Status.ERROR:
        raise error_from_frame(frame)
    try:
        doc = json.loads(frame.payload)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolViolationError(f"{frame.command.name} reply is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ProtocolViolationError(f"{frame.command.name} reply is not a JSON object")
    return doc


# ------------------------------------------------------------------------------------------ options


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with jitter, bounded in attempts.

    The n-th retry (n from 0) waits ``min(max_s, initial_s * multiplier**n)`` scaled by a random factor in
    ``[1 - jitter, 1]`` (so concurrent clients spread out). ``attempts_max`` bounds the retries of one
    request; producers bound retries of a batch by their delivery timeout instead.

    Args:
        initial_s: first delay in seconds.
        max_s: delay cap in seconds.
        multiplier: growth factor per attempt (>= 1).
        jitter: fraction of the delay that is randomised, 0-1.
        attempts_max: retries after the first attempt (0 disables retrying).
    """

    initial_s: float = 0.05
    max_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.5
    attempts_max: int = 8

    def __post_init__(self) -> None:
        if self.initial_s < 0 or self.max_s < self.initial_s or self.multiplier < 1:
            raise ValueError("backoff needs 0 <= initial_s <= max_s and multiplier >= 1")
        if not 0 <= self.jitter <= 1 or self.attempts_max < 0:
            raise ValueError("backoff jitter must be 0-1 and attempts_max >= 0")

    def delay_s(self, attempt: int, rng: random.Random | None = None) -> float:
        """The delay before retry number ``attempt`` (0-based), in seconds."""
        base = min(self.max_s, self.initial_s * (self.multiplier ** min(attempt, 64)))
        draw = (rng or random).random()
        return base * (1.0 - self.jitter * draw)


@dataclass(frozen=True, slots=True)
class ConnectionOptions:
    """How to open and use connections; shared by every SDK entry point and ``cursusctl``.

    Args:
        compression: preferred compression (``none`` is offered after it; the broker may choose either).
        timeout_s: connect timeout and per-request reply timeout in seconds (long polls add their wait).
        ssl_context: wrap sockets in TLS (see :func:`make_ssl_context`); negotiation happens inside TLS.
        server_hostname: TLS server name to verify; default: the host being connected to.
        principal, token: send ``AUTH principal= token=`` right after negotiation (when ``principal`` is set).
        backoff: reconnect/retry policy.
        redirects_max: how many ``NOT_LEADER``/``NOT_COORDINATOR`` redirects one request may follow.
    """

    compression: Compression = Compression.NONE
    timeout_s: float = 5.0
    ssl_context: ssl.SSLContext | None = None
    server_hostname: str | None = None
    principal: str | None = None
    token: str | None = field(default=None, repr=False)
    backoff: Backoff = field(default_factory=Backoff)
    redirects_max: int = 5

    def __post_init__(self) -> None:
        object.__setattr__(self, "compression", compression_of(self.compression))
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")

    def with_(self, **changes: Any) -> ConnectionOptions:
        """A copy with some options changed."""
        return replace(self, **changes)

    def connect(self, address: Address) -> Connection:
        """Open and negotiate one :class:`Connection` to ``address`` (raises like its constructor)."""
        return Connection(address[0], address[1], compression=self.compression, timeout_s=self.timeout_s,
                          ssl_context=self.ssl_context, server_hostname=self.server_hostname,
                          principal=self.principal, token=self.token)


def options_from(options: ConnectionOptions | None, overrides: Mapping[str, Any]) -> ConnectionOptions:
    """``options`` (or defaults) with keyword overrides applied; unknown keys raise ``TypeError``.

    Without ``options``, credentials come from the overrides (``principal``, ``token``,
    ``credentials_file``) or else the environment (:func:`cursus.client.credentials.resolve_credentials`:
    ``CURSUS_PRINCIPAL`` + ``CURSUS_TOKEN``, ``CURSUS_TOKEN_FILE``, ``CURSUS_CREDENTIALS_FILE``); raises
    :class:`~cursus.client.credentials.CredentialsError` when they are incomplete.
    """
    clean = {k: v for k, v in overrides.items() if v is not None}
    credentials_file = clean.pop("credentials_file", None)
    if options is None:
        from cursus.client.credentials import resolve_credentials

        creds = resolve_credentials(clean.get("principal"), clean.get("token"), credentials_file=credentials_file)
        if creds is not None:
            clean["principal"], clean["token"] = creds.principal, creds.token
    elif credentials_file is not None:
        raise TypeError("credentials_file= applies only without options= (give principal= and token= instead)")
    base = options or ConnectionOptions()
    return base.with_(**clean) if clean else base


# ------------------------------------------------------------------------------------------ connection


# --------------------------------------------------------------------------------- handshake (sans-IO)
#
# What both transports write and how they judge the replies; they only move the bytes.


def negotiation_request(preferred: Compression) -> tuple[bytes, tuple[Compression, ...]]:
    """The NEGOTIATE frame offering ``preferred`` (then none), and the offers (facts A3)."""
    offers = negotiation_offers(preferred)
    payload = encode_negotiation_request(NegotiationRequest(2, 2, offers))
    return encode_frame(Kind.NEGOTIATION_REQUEST, Command.NEGOTIATE, Status.NONE, 0, payload,
                        compression=None), offers


def negotiated_compression(frame: Frame, offers: tuple[Compression, ...]) -> Compression:
    """The compression a NEGOTIATE reply selects. Raises ``ProtocolError`` for a refusal, another
    version or a compression that was not offered."""
    if frame.kind != Kind.NEGOTIATION_RESPONSE or frame.status != Status.OK:
        raise ProtocolError(f"negotiation refused: kind={frame.kind.name} status={frame.status.name}")
    version, selected = decode_negotiation_response(frame.payload)
    if version != 2 or selected not in offers:
        raise ProtocolError(f"broker selected version {version} compression {selected}")
    return selected


def auth_payload(principal: str, token: str) -> bytes:
    """The CRQ2 payload of ``AUTH principal= token=``."""
    return encode_crq2(CommandPayload((), {"principal": principal, "token": token}))


def check_auth_reply(frame: Frame) -> None:
    """Raise the broker's typed error, or ``AuthenticationError`` for a reply that is not OK."""
    if frame.status == Status.ERROR:
        raise error_from_frame(frame)
    text = frame.payload.decode("utf-8", "replace")
    if text != "OK" and not text.startswith("OK "):
        raise AuthenticationError("authentication_failed", f"AUTH reply: {text[:120]}")


def check_correlation(frame: Frame, request_id: int, command: Command) -> None:
    """Raise ``ProtocolError`` unless ``frame`` answers request ``request_id`` of ``command`` (facts A2)."""
    if frame.request_id != request_id or frame.command != command:
        raise ProtocolError(
            f"correlation mismatch: got request {frame.request_id} {frame.command.name}, "
            f"expected {request_id} {command.name}"
        )
    if frame.kind not in (Kind.RESPONSE, Kind.STREAM):
        raise ProtocolError(f"reply to request {request_id} has kind {frame.kind.name}")


def stream_frame_ends(frame: Frame, request_id: int, command: Command) -> bool:
    """Check a frame of the stream answering ``request_id`` (:func:`check_correlation`); True when it is
    the stream's last (STREAM_END or ERROR)."""
    check_correlation(frame, request_id, command)
    return frame.status in (Status.STREAM_END, Status.ERROR)


class Connection:
    """One negotiated Wire v2 connection (blocking).

    Args:
        host, port: broker address.
        compression: preferred compression; ``none`` is offered after it (facts A3).
        timeout_s: connect timeout and the timeout of every read, in seconds.
        ssl_context: wrap the socket in TLS (negotiation happens inside TLS).
        server_hostname: TLS name to verify (default ``host``).
        principal, token: when ``principal`` is given, ``AUTH principal=P token=T`` is sent right after
            negotiation (request id 1); a non-OK reply closes the connection and raises.

    Thread safety: requests are serialised (one in flight); a stream holds the connection until it ends.

    Raises (constructor and methods): ``OSError``/``TimeoutError`` for transport failures,
    :class:`ConnectionClosed` on EOF or use after close, :class:`cursus.wire.ProtocolError` for malformed or
    uncorrelated frames, :class:`~cursus.client.errors.AuthenticationError` (or the broker's typed error)
    when AUTH is refused. After any of these the connection is closed.
    """

    def __init__(self, host: str, port: int, *, compression: Compression | str = Compression.NONE,
                 timeout_s: float = 5.0, ssl_context: ssl.SSLContext | None = None,
                 server_hostname: str | None = None, principal: str | None = None,
                 token: str | None = None) -> None:
        self.host = host
        self.port = port
        self.preferred = compression_of(compression)
        self.timeout_s = timeout_s
        self.compression: Compression | None = None
        self.closed = False
        self.principal = principal
        self._next_request_id = 1
        self._lock = threading.Lock()
        self._timeout_current: float | None = timeout_s
        #: Requests written whose (last) reply has not been read yet (pipelining, streams, acks=0 sends).
        self._unanswered = 0
        raw = socket.create_connection((host, port), timeout=timeout_s)
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock: socket.socket = (
                ssl_context.wrap_socket(raw, server_hostname=server_hostname or host) if ssl_context else raw
            )
        except BaseException as exc:
            raw.close()
            mapped = tls_failure(exc, (host, port), ssl_context, before_reply=False)
            if mapped is not None:
                raise mapped from exc
            if isinstance(exc, ssl.SSLEOFError):
                raise ConnectionClosed(f"{host}:{port} closed the connection during the TLS handshake: the server "
                                       "may not use TLS on this port") from exc
            raise
        self._decoder = FrameDecoder()
        try:
            try:
                self._negotiate()
            except (OSError, ssl.SSLError) as exc:
                mapped = tls_failure(exc, (host, port), ssl_context, before_reply=True)
                if mapped is None and ssl_context is None and isinstance(exc, ConnectionClosed) \
                        and probe_tls((host, port), timeout_s):
                    mapped = tls_required_error((host, port))
                if mapped is not None:
                    raise mapped from exc
                raise
            if principal is not None:
                self._authenticate(principal, token or "")
        except BaseException:
            self._fail()
            raise

    @property
    def address(self) -> Address:
        """``(host, port)`` of the broker."""
        return self.host, self.port

    @property
    def next_request_id(self) -> int:
        """The id the next request will carry (ids start at 1, +1 per request, AUTH included)."""
        return self._next_request_id

    # ----------------------------------------------------------------------------------------- basics

    def _negotiate(self) -> None:
        request, offers = negotiation_request(self.preferred)
        self.sock.sendall(request)
        self.compression = self._decoder.negotiated = negotiated_compression(self._read_frame(), offers)

    def _authenticate(self, principal: str, token: str) -> None:
        check_auth_reply(self._request(Command.AUTH, auth_payload(principal, token), None))

    def _fail(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass

    def stale(self) -> bool:
        """True when the connection is closed, or idle and the broker closed it meanwhile (e.g. after
        ``client_idle_timeout_ms``): nothing is in flight and the socket is readable (EOF or stray bytes), so a
        request written now would be lost with an unknown outcome. A stale connection is closed here; the
        caller opens a new one. Never blocks (a connection in use by another thread is not stale)."""
        if self.closed:
            return True
        if self._unanswered or not self._lock.acquire(blocking=False):
            return False
        try:
            if self._decoder.buffered_bytes or (isinstance(self.sock, ssl.SSLSocket) and self.sock.pending()):
                readable = True
            else:
                readable = bool(select.select([self.sock], [], [], 0)[0])
        except (OSError, ValueError):
            readable = True
        finally:
            self._lock.release()
        if readable:
            self._fail()
        return readable

    def _read_frame(self) -> Frame:
        while True:
            frame = self._decoder.next_frame()
            if frame is not None:
                return frame
            data = self.sock.recv(RECV_BYTES)
            if not data:
                raise ConnectionClosed(f"{self.host}:{self.port} closed the connection")
            self._decoder.feed(data)

    def _answered(self) -> None:
        if self._unanswered:
            self._unanswered -= 1

    def _send(self, command: Command, payload: bytes) -> int:
        if self.closed:
            raise ConnectionClosed(f"connection to {self.host}:{self.port} is closed")
        request_id = self._next_request_id
        self._next_request_id += 1
        assert self.compression is not None, "negotiation has not completed"
        self._unanswered += 1
        self.sock.sendall(encode_frame(Kind.REQUEST, command, Status.NONE, request_id, payload,
                                       compression=self.compression))
        return request_id

    def _set_timeout(self, timeout_s: float) -> None:
        # settimeout is a syscall that releases the GIL: skip it when nothing changes (hot producer path).
        if timeout_s != self._timeout_current:
            self.sock.settimeout(timeout_s)
            self._timeout_current = timeout_s

    def _request(self, command: Command, payload: bytes, timeout_s: float | None) -> Frame:
        self._set_timeout(self.timeout_s)
        request_id = self._send(command, payload)
        self._set_timeout(self.timeout_s if timeout_s is None else timeout_s)
        frame = self._read_frame()
        check_correlation(frame, request_id, command)
        self._answered()
        return frame

    def read_frame(self) -> Frame:
        """Block until one whole frame arrives (low level; closes the connection on failure)."""
        with self._lock:
            try:
                return self._read_frame()
            except BaseException:
                self._fail()
                raise

    def send(self, command: Command, payload: bytes) -> int:
        """Write one request frame without waiting for a reply; returns its request id.

        Use it for acks=0 PUBLISH (no reply ever comes) or with :meth:`read_frame`.
        """
        with self._lock:
            try:
                return self._send(command, payload)
            except BaseException:
                self._fail()
                raise

    def receive(self, request_id: int, command: Command, *, timeout_s: float | None = None) -> Frame:
        """Read the reply to a request written earlier with :meth:`send` (pipelining: replies come in
        request order), checking correlation; closes the connection on any failure."""
        with self._lock:
            try:
                self._set_timeout(self.timeout_s if timeout_s is None else timeout_s)
                frame = self._read_frame()
                check_correlation(frame, request_id, command)
                self._answered()
                return frame
            except BaseException:
                self._fail()
                raise

    def request(self, command: Command, payload: bytes, *, timeout_s: float | None = None) -> Frame:
        """Send one request and return its (single) reply frame, checking correlation (facts A2).

        ``timeout_s`` overrides the connection's read timeout for this reply (long polls).
        """
        with self._lock:
            try:
                return self._request(command, payload, timeout_s)
            except BaseException:
                self._fail()
                raise

    def stream(self, command: Command, payload: bytes) -> Iterator[Frame]:
        """Send one request and yield reply frames until STREAM_END or ERROR (STREAM, READ_STREAM).

        The connection is held for the whole stream; abandoning the iterator early closes the connection,
        since the rest of the stream would otherwise be read as later replies.
        """
        with self._lock:
            finished = False
            try:
                request_id = self._send(command, payload)
                while True:
                    frame = self._read_frame()
                    finished = stream_frame_ends(frame, request_id, command)
                    if finished:
                        self._answered()
                    yield frame
                    if finished:
                        return
            finally:
                if not finished:
                    self._fail()

    # ----------------------------------------------------------------------------------------- text

    def command(self, text: str, *, timeout_s: float | None = None) -> Frame:
        """Send a text command (``NAME k=v ... message=...``) as CRQ2 and return the reply frame.

        Raises ``cursus.wire.CommandTextError`` (a ``ValueError``) for text that cannot be encoded.
        """
        command, payload = parse_command_text(text)
        return self.request(command, encode_crq2(payload), timeout_s=timeout_s)

    def call(self, command: Command, fields: Mapping[str, str] | None = None,
             positionals: tuple[str, ...] = (), *, timeout_s: float | None = None) -> Frame:
        """Send a CRQ2 request built from ``fields`` (in order) and return the reply frame."""
        return self.request(command, encode_crq2(CommandPayload(positionals, dict(fields or {}))),
                            timeout_s=timeout_s)

    def close(self) -> None:
        """Close the socket (idempotent). Does not send EXIT."""
        self._fail()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------ retry decisions
#
# Shared by Client and aio.AsyncClient: the I/O loops differ, the decisions must not.

#: Commands whose repetition cannot change broker state differently than one execution.
READ_ONLY_COMMANDS = frozenset({
    Command.LIST, Command.HELP, Command.METADATA, Command.LIST_OFFSETS, Command.DESCRIBE, Command.CONSUME,
    Command.FIND_COORDINATOR, Command.FETCH_OFFSET, Command.GROUP_STATUS, Command.LIST_GROUPS,
    Command.TXN_STATUS, Command.STREAM_VERSION, Command.READ_SNAPSHOT, Command.CLUSTER_STATUS,
    Command.LIST_CLUSTER,
})


def redirect_target(err: CursusError) -> Address | None:
    """The address a routing error tells the client to go to, or None."""
    if isinstance(err, NotLeaderError):
        return err.leader
    if isinstance(err, NotCoordinatorError):
        return err.coordinator
    return None


@dataclass(slots=True)
class Attempts:
    """Book-keeping for one logical request across reconnects, retries and redirects.

    Args:
        target: where to send first.
        options: backoff and redirect limits.
        retry_safe: whether the request may be sent again after its outcome became unknown (connection
            lost after writing it) or after a retryable error reply.
        label: command name for messages.
        rotation: bootstrap addresses to rotate through on connect failures (empty: stay on ``target``).
    """

    target: Address
    options: ConnectionOptions
    retry_safe: bool
    label: str
    follow_redirects: bool = True
    rotation: Sequence[Address] = ()
    attempt: int = 0
    redirects: int = 0
    last_error: BaseException | None = None

    def after_connect_failure(self, exc: BaseException) -> float:
        """A connection could not be opened (nothing was sent: always safe to retry).

        Returns the delay before the next attempt, or raises ``BrokerUnavailableError`` (or the broker's
        typed error when AUTH was refused) when the budget is spent.
        """
        if isinstance(exc, CursusError):
            raise exc  # AUTH refused: retrying will not help
        delay = self._next_delay(exc, BrokerUnavailableError(
            f"cannot connect to {format_address(self.target)} for {self.label}: {exc}"))
        if len(self.rotation) > 1:  # the next bootstrap broker (from the first if we were redirected away)
            index = self.rotation.index(self.target) if self.target in self.rotation else -1
            self.target = self.rotation[(index + 1) % len(self.rotation)]
        return delay

    def after_transport_failure(self, exc: BaseException) -> float:
        """The connection failed (or no reply came in time) after the request was written: outcome unknown.
        A retry-safe request is retried (``RequestTimeoutError``/``BrokerUnavailableError`` once the budget is
        spent); any other raises ``DeliveryUnknownError`` (not retryable: it may have been applied)."""
        if isinstance(exc, TimeoutError) and not self.retry_safe:
            final: CursusError = DeliveryUnknownError(
                f"no reply to {self.label} from {format_address(self.target)} in time; it may or may not have "
                f"been applied", fields={"reason": "timeout"})
        elif isinstance(exc, TimeoutError):
            final = RequestTimeoutError(
                f"no reply to {self.label} from {format_address(self.target)} in time")
        elif isinstance(exc, ProtocolError):
            final = ProtocolViolationError(f"{self.label} reply from {format_address(self.target)}: {exc}")
        elif self.retry_safe:
            final = BrokerUnavailableError(f"connection to {format_address(self.target)} lost during "
                                           f"{self.label}: {exc}")
        else:
            final = DeliveryUnknownError(f"connection to {format_address(self.target)} lost after sending "
                                         f"{self.label}; it may or may not have been applied: {exc}")
        if not self.retry_safe or isinstance(exc, ProtocolError):
            raise final from exc
        return self._next_delay(exc, final)

    def after_error_reply(self, err: CursusError) -> float | None:
        """A typed ERROR reply. Returns None to resend now (``target`` was redirected), a delay to retry
        after, or raises ``err`` (``DeliveryUnknownError`` for a redirect with ``outcome=unknown`` of a
        request that is not retry-safe: never resent)."""
        target = redirect_target(err)
        if target is not None and not self.retry_safe and err.fields.get("outcome") == "unknown":
            # the old leader applied the request and lost the partition before it was acknowledged: the
            # new leader may hold it, so following the redirect could apply it twice
            raise DeliveryUnknownError(
                f"{self.label} to {format_address(self.target)} may or may not have been applied: {err}",
                fields={**err.fields, "reason": "leader changed before the acknowledgement"}) from err
        if target is not None and self.follow_redirects and self.redirects < self.options.redirects_max:
            self.redirects += 1
            self.target = target
            return None
        if err.retryable and self.retry_safe and target is None:
            return self._next_delay(err, err)
        raise err

    def _next_delay(self, cause: BaseException, final: CursusError) -> float:
        self.last_error = cause
        if self.attempt >= self.options.backoff.attempts_max:
            if final is cause:
                raise final
            raise final from cause
        delay = self.options.backoff.delay_s(self.attempt)
        self.attempt += 1
        return delay


# ------------------------------------------------------------------------------------------ client


class Client:
    """Connections to Cursus brokers with reconnects, retries and redirects (blocking, thread-safe).

    Args:
        bootstrap: ``host:port`` (or a list of them); requests without an explicit address go to the
            first reachable one.
        options: connection options; keyword arguments override single fields
            (``Client("h:9000", compression="gzip", timeout_s=10)``).

    One connection is cached per broker address and shared (requests on it are serialised). A failed
    connection is dropped and reopened on the next request.
    """

    def __init__(self, bootstrap: str | Sequence[str] = DEFAULT_ADDRESS,
                 options: ConnectionOptions | None = None, **overrides: Any) -> None:
        self.options = options_from(options, overrides)
        self.bootstrap: list[Address] = parse_bootstrap(bootstrap)
        self._connections: dict[Address, Connection] = {}
        self._lock = threading.Lock()
        self._closed = False

    # ----------------------------------------------------------------------------------------- connections

    def connection(self, address: Address | None = None) -> Connection:
        """The cached connection to ``address`` (default: the first bootstrap broker), opened if needed.

        Raises the connection's exceptions (no retry here).
        """
        address = address or self.bootstrap[0]
        with self._lock:
            if self._closed:
                raise ClientClosedError("client is closed")
            conn = self._connections.get(address)
            if conn is not None and not conn.stale():
                return conn
        conn = self.options.connect(address)
        with self._lock:
            if self._closed:
                conn.close()
                raise ClientClosedError("client is closed")
            old = self._connections.get(address)
            if old is not None and not old.closed:  # another thread won the race
                conn.close()
                return old
            self._connections[address] = conn
        return conn

    def drop(self, address: Address) -> None:
        """Close and forget the cached connection to ``address``."""
        with self._lock:
            conn = self._connections.pop(address, None)
        if conn is not None:
            conn.close()

    # ----------------------------------------------------------------------------------------- requests

    def request(self, command: Command, payload: bytes, *, address: Address | None = None,
                retry_safe: bool | None = None, timeout_s: float | None = None,
                follow_redirects: bool = True, failover: bool = False) -> Frame:
        """Send one request and return its OK reply frame.

        Args:
            command: the header command id.
            payload: encoded CRQ2 (or CBV2) payload.
            address: broker to send to (default: bootstrap, rotating through the list on connect failures).
            retry_safe: whether the request may be repeated when its outcome is unknown or the reply is a
                retryable error; default: True for read-only commands.
            timeout_s: reply timeout for this request (default ``options.timeout_s``).
            follow_redirects: resend to the address a ``NOT_LEADER``/``NOT_COORDINATOR`` reply names (up to
                ``options.redirects_max`` times); False raises the routing error instead, for callers that
                track leaders themselves.
            failover: with ``address``, raise ``BrokerUnavailableError`` at the first failed connect instead
                of retrying that one broker: a caller that tracks leaders re-reads metadata (the broker may
                be gone for good and its partitions led elsewhere).

        Returns:
            The reply frame, status OK (or STREAM_END).

        Raises:
            CursusError: the broker's typed error (after following redirects), or
                ``BrokerUnavailableError``/``RequestTimeoutError``/``DeliveryUnknownError``/
                ``ProtocolViolationError`` when the transport gave up; ``ClientClosedError`` after close().
        """
        safe = command in READ_ONLY_COMMANDS if retry_safe is None else retry_safe
        attempts = Attempts(address or self.bootstrap[0], self.options, safe, command.name,
                            follow_redirects=follow_redirects, rotation=() if address else self.bootstrap)
        while True:
            try:
                conn = self.connection(attempts.target)
            except (OSError, ProtocolError, CursusError) as exc:
                if isinstance(exc, ClientClosedError):
                    raise
                if failover and address is not None and not isinstance(exc, CursusError):
                    raise BrokerUnavailableError(
                        f"cannot connect to {format_address(address)} for {command.name}: {exc}") from exc
                time.sleep(attempts.after_connect_failure(exc))
                continue
            try:
                frame = conn.request(command, payload, timeout_s=timeout_s)
            except (OSError, ProtocolError) as exc:
                self.drop(attempts.target)
                time.sleep(attempts.after_transport_failure(exc))
                continue
            if frame.status != Status.ERROR:
                return frame
            redirect_delay = attempts.after_error_reply(error_from_frame(frame))
            if redirect_delay:
                time.sleep(redirect_delay)

    def call(self, command: Command, fields: Mapping[str, str] | None = None, *,
             positionals: tuple[str, ...] = (), address: Address | None = None,
             retry_safe: bool | None = None, timeout_s: float | None = None,
             follow_redirects: bool = True, failover: bool = False) -> Frame:
        """:meth:`request` with a CRQ2 payload built from ``fields`` (in order) and ``positionals``."""
        payload = encode_crq2(CommandPayload(tuple(positionals), dict(fields or {})))
        return self.request(command, payload, address=address, retry_safe=retry_safe, timeout_s=timeout_s,
                            follow_redirects=follow_redirects, failover=failover)

    def command(self, text: str, *, address: Address | None = None, retry_safe: bool | None = None,
                timeout_s: float | None = None) -> Frame:
        """:meth:`request` for a text command ``NAME k=v ... [message=...]``.

        Raises ``cursus.wire.CommandTextError`` (``ValueError``) for text that cannot be encoded.
        """
        command, payload = parse_command_text(text)
        return self.request(command, encode_crq2(payload), address=address, retry_safe=retry_safe,
                            timeout_s=timeout_s)

    def send_only(self, command: Command, payload: bytes, *, address: Address | None = None) -> int:
        """Write a request that gets no reply (acks=0 PUBLISH); returns its request id.

        Connect failures are retried with backoff; a failure while writing raises
        ``DeliveryUnknownError``.
        """
        attempts = Attempts(address or self.bootstrap[0], self.options, False, command.name)
        while True:
            try:
                conn = self.connection(attempts.target)
            except (OSError, ProtocolError) as exc:
                time.sleep(attempts.after_connect_failure(exc))
                continue
            try:
                return conn.send(command, payload)
            except (OSError, ProtocolError) as exc:
                self.drop(attempts.target)
                attempts.after_transport_failure(exc)

    def close(self) -> None:
        """Close every connection (idempotent); later requests raise ``ClientClosedError``."""
        with self._lock:
            self._closed = True
            connections = list(self._connections.values())
            self._connections.clear()
        for conn in connections:
            conn.close()

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
