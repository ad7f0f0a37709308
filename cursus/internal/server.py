"""The internal listener: a ``grpc.aio`` server for broker-to-broker calls (``Replication.Fetch``, and
``Replication.ReplicateSnapshot`` for the event store, and ``Replication.AppendTxnRecord``: a transaction
coordinator writes a record to a partition this broker leads).

Every call is authenticated before the handler sees a single request (``docs/cluster.md, "The internal listener"``):

1. token: metadata ``x-cursus-internal-token`` must match (constant time) ``internal_auth_token`` or
   ``internal_auth_token_next`` -> else ``UNAUTHENTICATED`` (reasons ``missing_token`` / ``wrong_token``);
2. with TLS (mutual, client certificate required, TLS >= 1.2 which is gRPC's minimum): the verified
   client certificate's single ``raft://<broker-id>`` URI must name a member -> else
   ``PERMISSION_DENIED`` (``no_identity`` / ``not_member``);
3. Fetch: every request's ``follower_id`` must be a member, equal the certificate identity (TLS), and
   stay the same for the whole stream -> else ``PERMISSION_DENIED`` (``not_member`` /
   ``follower_mismatch``). Insecure mode (``tls=None``, tests only) keeps checks 1 and 3.

Refusals are counted by reason in :attr:`InternalServer.refusals` (export it as a metric, like Raft's
``raft_rejected_connections``). TLS handshake failures (plaintext peer, no client certificate, a
certificate from another CA, TLS < 1.2) are refused by gRPC's TLS layer before any Python code runs:
the peer sees ``UNAVAILABLE`` and they cannot be counted here.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from pathlib import Path
from typing import Any, Protocol

import grpc

from cursus.cluster.tls import TLSFiles
from cursus.internal.auth import TOKEN_METADATA_KEY, TokenCheck, identity_from_pem
from cursus.internal.v1 import replication_pb2 as pb
from cursus.internal.v1 import replication_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

#: Default bound of one gRPC message (bytes), both directions. It must exceed
#: ``replica_fetch_response_max_bytes`` (default 8 MiB) plus the first-chunk overshoot and framing.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
#: Metadata key a client may send with its broker id: informational only (logged), never trusted.
BROKER_ID_METADATA_KEY = "x-cursus-broker-id"

_WARN_INTERVAL_S = 10.0

#: Refusal reasons (keys of :attr:`InternalServer.refusals`).
REFUSAL_REASONS = ("missing_token", "wrong_token", "no_identity", "not_member", "follower_mismatch")


class ReplicationHandler(Protocol):
    """What the server streams to: the leader side of replication (``LeaderFetchService``)."""

    def serve(self, follower_id: str,
              requests: AsyncIterator[pb.FetchRequest]) -> AsyncIterator[pb.FetchResponse]:
        """Answer ``requests`` of the authenticated ``follower_id`` (one response per request, in order)."""
        ...


def _bind_target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _read_tls(files: TLSFiles) -> tuple[bytes, bytes, bytes]:
    return Path(files.key).read_bytes(), Path(files.cert).read_bytes(), Path(files.ca).read_bytes()


#: ``handler(coordinator_id, request) -> response``: the partition-leader side of AppendTxnRecord.
TxnRecordHandler = Callable[[str, pb.TxnRecordRequest], Awaitable[pb.TxnRecordResponse]]
#: Stores a replicated event-store snapshot on this broker (the broker's event store installs it).
SnapshotHandler = Callable[[pb.SnapshotRequest], Awaitable[pb.SnapshotResponse]]


class _Refused(Exception):
    """Raised inside the request stream when a request breaks the stream's identity rule."""


class _Servicer(pb_grpc.ReplicationServicer):
    def __init__(self, server: InternalServer) -> None:
        self._server = server

    async def Fetch(self, request_iterator: AsyncIterator[pb.FetchRequest],  # the generated method name
                    context: grpc.aio.ServicerContext) -> AsyncIterator[pb.FetchResponse]:
        server = self._server
        refusal = server.authenticate(context)
        if refusal is not None:
            await server.refuse(context, *refusal)
            return
        identity = server.identity_of(context)  # None in insecure mode
        requests = request_iterator.__aiter__()
        try:
            first = await requests.__anext__()
        except StopAsyncIteration:
            return
        follower_id = first.follower_id
        refusal = server.check_follower(follower_id, identity, context)
        if refusal is not None:
            await server.refuse(context, *refusal)
            return
        refused: list[tuple[grpc.StatusCode, str, str]] = []

        async def checked() -> AsyncIterator[pb.FetchRequest]:
            yield first
            async for request in requests:
                if request.follower_id != follower_id:
                    refused.append((grpc.StatusCode.PERMISSION_DENIED, "follower_mismatch",
                                    f"follower_id changed within the stream ({follower_id!r} -> "
                                    f"{request.follower_id!r})"))
                    raise _Refused
                yield request

        failed = False
        server.active_streams += 1
        server.streams_total += 1
        responses = server.handler.serve(follower_id, checked())
        try:
            async for response in responses:
                if refused:
                    break
                yield response
        except _Refused:
            pass
        except asyncio.CancelledError:
            raise
        except Exception:  # a handler bug must not leak details to the peer, nor crash the server
            log.exception("internal listener: fetch handler failed for follower %s", follower_id)
            failed = True
        finally:
            server.active_streams -= 1
            aclose = getattr(responses, "aclose", None)
            if aclose is not None:  # run the handler's cleanup now, not whenever it is collected
                try:
                    await aclose()
                except Exception:  # already ending the stream: log a cleanup failure, do not mask it
                    log.exception("internal listener: fetch handler cleanup failed for %s", follower_id)
        if refused:
            await server.refuse(context, *refused[0], identity=follower_id)
        elif failed:
            await context.abort(grpc.StatusCode.INTERNAL, "fetch handler failed (see the leader's log)")


    async def ReplicateSnapshot(self, request: pb.SnapshotRequest,  # the generated method name
                                context: grpc.aio.ServicerContext) -> pb.SnapshotResponse:
        """One event-store snapshot from a partition leader (authenticated like Fetch; ``leader_id`` is
        checked as Fetch checks ``follower_id``)."""
        server = self._server
        refusal = server.authenticate(context)
        if refusal is None:
            refusal = server.check_follower(request.leader_id, server.identity_of(context), context)
        if refusal is not None:
            await server.refuse(context, *refusal)
            return pb.SnapshotResponse()
        handler = server.snapshot_handler
        if handler is None:
            return pb.SnapshotResponse(error=pb.Error(code="UNSUPPORTED_FEATURE", message="no event store"))
        try:
            return await handler(request)
        except Exception:  # a handler bug must not leak details to the peer, nor crash the server
            log.exception("internal listener: snapshot handler failed for leader %s", request.leader_id)
            await context.abort(grpc.StatusCode.INTERNAL, "snapshot handler failed (see the follower's log)")
            raise

    async def AppendTxnRecord(self, request: pb.TxnRecordRequest,  # the generated method name
                              context: grpc.aio.ServicerContext) -> pb.TxnRecordResponse:
        server = self._server
        refusal = server.authenticate(context) or server.check_follower(
            request.coordinator_id, server.identity_of(context), context)
        if refusal is not None:
            await server.refuse(context, *refusal)
            return pb.TxnRecordResponse()
        handler = server.txn_handler
        if handler is None:
            return pb.TxnRecordResponse(error=pb.Error(code="transaction_manager_not_available",
                                                       message="no transaction participant here"))
        try:
            return await handler(request.coordinator_id, request)
        except asyncio.CancelledError:
            raise
        except Exception:  # a handler bug must not leak details to the peer, nor crash the server
            log.exception("internal listener: AppendTxnRecord failed for %s", request.coordinator_id)
            await context.abort(grpc.StatusCode.INTERNAL, "txn record handler failed (see the leader's log)")
            return pb.TxnRecordResponse()


class InternalServer:
    """The internal gRPC listener of one broker.

    Args:
        host, port: where to bind (port 0: an ephemeral port, see :meth:`start`).
        handler: a :class:`ReplicationHandler`; it sees only authenticated requests.
        tls: this broker's certificate/key and the internal CA (mutual TLS, client certificate
            required); None = insecure port (``allow_insecure_cluster_transport``, tests only).
        token: the accepted internal tokens.
        members: broker ids allowed to call (``static_cluster_members`` ids).
        max_message_bytes: bound of one message in either direction (bytes).
        keepalive_s / keepalive_timeout_s: the server pings an idle connection every ``keepalive_s``
            and closes it when no ack arrives within ``keepalive_timeout_s`` (dead peers, half-open TCP).
        min_peer_ping_interval_s: clients may ping this often without being told ``too_many_pings``
            (must not exceed the clients' keepalive period).
        handshake_timeout_s: a connection that has not completed its TLS / HTTP/2 handshake by then is
            dropped (silent or slow peers; gRPC's own default is 120 s).
    """

    def __init__(self, host: str, port: int, handler: ReplicationHandler, *, tls: TLSFiles | None,
                 token: TokenCheck, members: Collection[str],
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, keepalive_s: float = 10.0,
                 keepalive_timeout_s: float = 5.0, min_peer_ping_interval_s: float = 1.0,
                 handshake_timeout_s: float = 10.0) -> None:
        if max_message_bytes <= 0:
            raise ValueError("max_message_bytes must be positive")
        self.host, self.port = host, port
        self.handler = handler
        self.tls = tls
        self.token = token
        self.members = frozenset(members)
        self.max_message_bytes = max_message_bytes
        self.keepalive_s, self.keepalive_timeout_s = keepalive_s, keepalive_timeout_s
        self.min_peer_ping_interval_s = min_peer_ping_interval_s
        self.handshake_timeout_s = handshake_timeout_s
        #: Refused calls by reason (see :data:`REFUSAL_REASONS`).
        self.refusals: collections.Counter[str] = collections.Counter()
        self.streams_total = 0
        self.active_streams = 0
        self.bound_port = 0
        self._server: grpc.aio.Server | None = None
        #: The AppendTxnRecord handler (installed by the broker's transaction coordinator; None: refused
        #: with ``transaction_manager_not_available``). Called only for authenticated members.
        self.txn_handler: TxnRecordHandler | None = None
        self._warned: dict[str, float] = {}
        #: ``ReplicateSnapshot`` calls go here once the broker installs it (None: answered UNSUPPORTED_FEATURE).
        self.snapshot_handler: SnapshotHandler | None = None

    def stats(self) -> dict[str, Any]:
        """A snapshot for metrics/status: ``refusals`` (reason -> count, every reason present),
        ``streams_total`` (authenticated Fetch streams opened) and ``active_streams``."""
        return {"refusals": {reason: self.refusals.get(reason, 0) for reason in REFUSAL_REASONS},
                "streams_total": self.streams_total, "active_streams": self.active_streams}

    def options(self) -> list[tuple[str, Any]]:
        """The gRPC server channel arguments used (message bounds, keepalive, no SO_REUSEPORT)."""
        return [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.http2.ping_timeout_ms", int(self.keepalive_timeout_s * 1000)),  # see client.py
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", int(self.min_peer_ping_interval_s * 1000)),
            ("grpc.http2.min_ping_interval_without_data_ms", int(self.min_peer_ping_interval_s * 1000)),
            ("grpc.server_handshake_timeout_ms", int(self.handshake_timeout_s * 1000)),
            # gRPC sets SO_REUSEPORT by default: a second broker on the same port would bind silently.
            ("grpc.so_reuseport", 0),
        ]

    async def start(self) -> int:
        """Bind and start serving; returns the bound port.

        Raises:
            OSError: a TLS file cannot be read, or the address cannot be bound.
        """
        if self._server is not None:
            raise RuntimeError("InternalServer already started")
        server = grpc.aio.server(options=self.options())
        pb_grpc.add_ReplicationServicer_to_server(_Servicer(self), server)
        target = _bind_target(self.host, self.port)
        try:
            if self.tls is not None:
                key, cert, ca = await asyncio.to_thread(_read_tls, self.tls)
                credentials = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                                          require_client_auth=True)
                port = server.add_secure_port(target, credentials)
            else:
                port = server.add_insecure_port(target)
        except RuntimeError as exc:  # grpc raises RuntimeError("Failed to bind ...")
            raise OSError(f"internal listener cannot bind {target}: {exc}") from exc
        if not port:
            raise OSError(f"internal listener cannot bind {target}")
        await server.start()
        self._server, self.bound_port = server, port
        log.info("internal listener on %s (%s, %d members)", _bind_target(self.host, port),
                 "mutual TLS" if self.tls is not None else "INSECURE, token only", len(self.members))
        return port

    async def stop(self, grace_s: float | None = 1.0) -> None:
        """Stop accepting calls; running streams get ``grace_s`` seconds, then are cancelled."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace_s)

    # -- checks (called by the servicer) -----------------------------------------------------------

    def authenticate(self, context: grpc.aio.ServicerContext) -> tuple[grpc.StatusCode, str, str] | None:
        """Token then (TLS) certificate identity; None when the call may proceed, else the refusal."""
        presented = None
        for key, value in context.invocation_metadata() or ():
            if key == TOKEN_METADATA_KEY:
                presented = value
                break
        if not presented:
            return grpc.StatusCode.UNAUTHENTICATED, "missing_token", "internal token required"
        if not self.token.ok(presented):
            return grpc.StatusCode.UNAUTHENTICATED, "wrong_token", "internal token not accepted"
        if self.tls is None:
            return None
        identity = self.identity_of(context)
        if identity is None:
            return (grpc.StatusCode.PERMISSION_DENIED, "no_identity",
                    "client certificate has no single raft://<broker-id> identity")
        if identity not in self.members:
            return grpc.StatusCode.PERMISSION_DENIED, "not_member", f"{identity!r} is not a cluster member"
        return None

    def identity_of(self, context: grpc.aio.ServicerContext) -> str | None:
        """The broker id in the peer's verified certificate; None without TLS or without identity."""
        if self.tls is None:
            return None
        pems = (context.auth_context() or {}).get("x509_pem_cert") or []
        return identity_from_pem(pems[0]) if len(pems) == 1 else None

    def check_follower(self, follower_id: str, identity: str | None,
                       context: grpc.aio.ServicerContext) -> tuple[grpc.StatusCode, str, str] | None:
        """The first request's ``follower_id`` against the members and the certificate identity."""
        if follower_id not in self.members:
            return (grpc.StatusCode.PERMISSION_DENIED, "not_member",
                    f"follower_id {follower_id!r} is not a cluster member")
        if self.tls is not None and follower_id != identity:
            return (grpc.StatusCode.PERMISSION_DENIED, "follower_mismatch",
                    f"follower_id {follower_id!r} does not match the certificate identity {identity!r}")
        return None

    async def refuse(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, reason: str,
                     detail: str, *, identity: str | None = None) -> None:
        """Count, log (rate limited per reason, never a token) and abort the call with ``code``."""
        self.refusals[reason] += 1
        now = time.monotonic()
        level = logging.DEBUG
        if now - self._warned.get(reason, -_WARN_INTERVAL_S) >= _WARN_INTERVAL_S:
            self._warned[reason] = now
            level = logging.WARNING
        claimed = next((value for key, value in context.invocation_metadata() or ()
                        if key == BROKER_ID_METADATA_KEY), None)
        log.log(level, "internal listener: refusing call from %s (claims %s, identity %s): %s (%d so far): %s",
                context.peer(), claimed, identity or self.identity_of(context), reason,
                self.refusals[reason], detail)
        await context.abort(code, f"{reason}: {detail}")
