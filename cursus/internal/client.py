"""Client side of the internal listener: cached ``grpc.aio`` channels to peer brokers, Fetch streams.

One channel per peer address (gRPC multiplexes every stream to that peer on one HTTP/2 connection and
reconnects by itself, with the short backoff configured here). A channel whose peer was down stays in
gRPC's reconnect backoff (up to ``reconnect_backoff_max_s``) and fails every new call at once with the
last connect error until that backoff ends, even when the peer is back: :meth:`InternalClient.reset`
replaces it when the broker learns that the peer restarted. With TLS the channel presents this
broker's certificate (mutual TLS) and verifies the peer against the internal CA and the HOST PART OF
THE DIALLED ADDRESS (a DNS name or an IP address in the peer certificate's SubjectAlternativeName;
``cursusctl certs`` issues node certificates for ``127.0.0.1`` and ``localhost`` by default, give it
the real host names in production). When certificates carry a fixed name instead, pass
``server_name_override`` (gRPC's ``grpc.ssl_target_name_override``): every peer is then verified
against that name. The peer's ``raft://`` identity is not checked on this side: any member is trusted
to lead, and a wrong or stale leader is fenced by leader epochs in the Fetch protocol.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc

from cursus.cluster.tls import TLSFiles
from cursus.internal.auth import TOKEN_METADATA_KEY
from cursus.internal.server import BROKER_ID_METADATA_KEY, DEFAULT_MAX_MESSAGE_BYTES
from cursus.internal.v1 import replication_pb2 as pb
from cursus.internal.v1 import replication_pb2_grpc as pb_grpc


class InternalRpcError(ConnectionError):
    """A Fetch stream ended or failed: ``code`` is the gRPC status, ``details`` its text.

    ``UNAUTHENTICATED`` / ``PERMISSION_DENIED``: this broker's token or certificate was refused
    (configuration; retrying will not help until it is fixed). ``UNAVAILABLE``: the peer is down or the
    TLS handshake failed. ``OK``: the peer closed the stream (for instance while shutting down).
    """

    def __init__(self, code: grpc.StatusCode, details: str | None) -> None:
        super().__init__(f"{code.name}: {details or ''}")
        self.code = code
        self.details = details or ""

    @classmethod
    def of(cls, exc: grpc.aio.AioRpcError) -> InternalRpcError:
        return cls(exc.code(), exc.details())


class FetchStream:
    """One open ``Replication.Fetch`` bidi call: ``await write(request)``, ``await read()``, ``cancel()``.

    One request outstanding at a time is the protocol (see the proto). Every failure, including the
    end of the stream, raises :class:`InternalRpcError`; ``call`` is the underlying grpc.aio call.
    """

    __slots__ = ("call",)

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self.call = call

    async def write(self, request: pb.FetchRequest) -> None:
        """Send one request. Raises InternalRpcError when the stream has ended."""
        try:
            await self.call.write(request)
        except grpc.aio.AioRpcError as exc:
            raise InternalRpcError.of(exc) from exc
        except asyncio.InvalidStateError as exc:  # the call already finished with OK (or was cancelled)
            raise InternalRpcError(grpc.StatusCode.CANCELLED if self.call.cancelled()
                                   else grpc.StatusCode.OK, str(exc)) from exc

    async def read(self) -> pb.FetchResponse:
        """The next response. Raises InternalRpcError when the stream ended or failed."""
        try:
            response = await self.call.read()
        except grpc.aio.AioRpcError as exc:
            raise InternalRpcError.of(exc) from exc
        if response is grpc.aio.EOF:
            raise InternalRpcError(await self.call.code(), await self.call.details())
        assert isinstance(response, pb.FetchResponse)
        return response

    async def done_writing(self) -> None:
        """Half-close: no more requests (the peer ends the stream after its last response)."""
        try:
            await self.call.done_writing()
        except grpc.aio.AioRpcError as exc:
            raise InternalRpcError.of(exc) from exc

    def cancel(self) -> bool:
        """Cancel the call (idempotent); True when this call was still running."""
        return bool(self.call.cancel())

    def done(self) -> bool:
        return bool(self.call.done())


class InternalClient:
    """Channels from broker ``local_id`` to its peers' internal listeners.

    Args:
        local_id: this broker's id (sent as informational metadata; authentication is the token and,
            with TLS, the certificate).
        tls: this broker's certificate/key and the internal CA; None = plaintext (tests only).
        token: the internal token sent on every call (``internal_auth_token``).
        max_message_bytes: bound of one message in either direction (bytes).
        keepalive_s / keepalive_timeout_s: ping an idle connection every ``keepalive_s``; a peer that
            does not answer within ``keepalive_timeout_s`` is considered dead (its streams fail with
            ``UNAVAILABLE``). The server must allow pings that often (``min_peer_ping_interval_s``).
        reconnect_backoff_min_s / reconnect_backoff_max_s: gRPC's reconnect backoff bounds.
        server_name_override: verify every peer certificate against this name instead of the dialled
            host (see the module docstring).

    Raises:
        OSError: a TLS file cannot be read (at construction, so a broker fails at startup).
    """

    def __init__(self, local_id: str, *, tls: TLSFiles | None, token: str,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, keepalive_s: float = 10.0,
                 keepalive_timeout_s: float = 5.0, reconnect_backoff_min_s: float = 0.1,
                 reconnect_backoff_max_s: float = 2.0, server_name_override: str | None = None) -> None:
        self.local_id = local_id
        self.max_message_bytes = max_message_bytes
        self.keepalive_s, self.keepalive_timeout_s = keepalive_s, keepalive_timeout_s
        self.reconnect_backoff_min_s = reconnect_backoff_min_s
        self.reconnect_backoff_max_s = reconnect_backoff_max_s
        self.server_name_override = server_name_override
        self._metadata = ((TOKEN_METADATA_KEY, token), (BROKER_ID_METADATA_KEY, local_id))
        self._credentials: grpc.ChannelCredentials | None = None
        if tls is not None:
            self._credentials = grpc.ssl_channel_credentials(
                root_certificates=Path(tls.ca).read_bytes(), private_key=Path(tls.key).read_bytes(),
                certificate_chain=Path(tls.cert).read_bytes())
        self._channels: dict[str, grpc.aio.Channel] = {}
        #: Replaced channels being closed in the background (see :meth:`reset`), by their closing task.
        self._retiring: dict[asyncio.Task[None], grpc.aio.Channel] = {}
        self._closed = False

    def __repr__(self) -> str:  # the token stays out of reprs and logs
        return (f"InternalClient({self.local_id!r}, tls={self._credentials is not None}, "
                f"peers={sorted(self._channels)})")

    def options(self) -> list[tuple[str, Any]]:
        """The gRPC channel arguments used (message bounds, keepalive, reconnect backoff, no retries)."""
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # Since gRPC core PR 34647 the ping ack wait is ping_timeout_ms (default 60 s), which
            # overrides keepalive_timeout_ms: without it a frozen peer is noticed only after a minute.
            ("grpc.http2.ping_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.initial_reconnect_backoff_ms", int(self.reconnect_backoff_min_s * 1000)),
            ("grpc.min_reconnect_backoff_ms", int(self.reconnect_backoff_min_s * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(self.reconnect_backoff_max_s * 1000)),
            # The fetcher owns retries (it must rebuild its request from durable state); one
            # connection per channel, not a process-wide shared subchannel.
            ("grpc.enable_retries", 0),
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if self.server_name_override:
            options.append(("grpc.ssl_target_name_override", self.server_name_override))
        return options

    def channel(self, address: str) -> grpc.aio.Channel:
        """The cached channel to ``address`` (``host:port``), created on first use."""
        if self._closed:
            raise RuntimeError("InternalClient is closed")
        channel = self._channels.get(address)
        if channel is None:
            if self._credentials is not None:
                channel = grpc.aio.secure_channel(address, self._credentials, options=self.options())
            else:
                channel = grpc.aio.insecure_channel(address, options=self.options())
            self._channels[address] = channel
        return channel

    def fetch_stream(self, address: str) -> FetchStream:
        """Open a ``Replication.Fetch`` stream to the internal listener at ``address``.

        Returns at once; a peer that is down or refuses surfaces as :class:`InternalRpcError` from the
        first ``write``/``read``.
        """
        stub = pb_grpc.ReplicationStub(self.channel(address))
        return FetchStream(stub.Fetch(metadata=self._metadata))

    async def replicate_snapshot(self, address: str, request: pb.SnapshotRequest,
                                 timeout_s: float) -> pb.SnapshotResponse:
        """One ``Replication.ReplicateSnapshot`` call to the internal listener at ``address``.

        Raises:
            InternalRpcError: the peer is down, refused the call or did not answer within ``timeout_s``.
        """
        stub = pb_grpc.ReplicationStub(self.channel(address))
        try:
            # wait_for_ready: a channel still connecting (or reconnecting) is waited for within the deadline
            response: pb.SnapshotResponse = await stub.ReplicateSnapshot(request, metadata=self._metadata,
                                                                         timeout=timeout_s, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            raise InternalRpcError.of(exc) from None
        return response

    async def append_txn_record(self, address: str, request: pb.TxnRecordRequest,
                                timeout_s: float) -> pb.TxnRecordResponse:
        """One ``Replication.AppendTxnRecord`` call to the internal listener at ``address`` (waits for the
        channel to (re)connect within ``timeout_s``: a peer that just restarted is reached).

        Raises:
            InternalRpcError: the peer is down, refused the call, or did not answer within ``timeout_s``.
        """
        stub = pb_grpc.ReplicationStub(self.channel(address))
        try:
            response: pb.TxnRecordResponse = await stub.AppendTxnRecord(
                request, metadata=self._metadata, timeout=timeout_s, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            raise InternalRpcError.of(exc) from None
        return response

    def reset(self, address: str, grace_s: float = 30.0) -> bool:
        """Start afresh with ``address`` (a peer that restarted): the next call dials it at once on a new
        channel instead of waiting out the old channel's reconnect backoff. Calls already on the old
        channel keep it for at most ``grace_s`` seconds (it is closed in the background). Loop thread;
        True when there was a channel to replace."""
        channel = self._channels.pop(address, None)
        if channel is None:
            return False
        task = asyncio.get_running_loop().create_task(channel.close(grace_s))
        self._retiring[task] = channel
        task.add_done_callback(lambda done: self._retiring.pop(done, None))
        return True

    async def forget(self, address: str) -> None:
        """Close and drop the channel to ``address`` (a peer that left the cluster)."""
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close(None)

    async def close(self) -> None:
        """Close every channel (running calls are cancelled)."""
        self._closed = True
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close(None)
        retiring, self._retiring = dict(self._retiring), {}
        for task, channel in retiring.items():
            task.cancel()
            await channel.close(None)
        await asyncio.gather(*retiring, return_exceptions=True)
