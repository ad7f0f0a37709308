"""The internal gRPC listener over mutual TLS: real grpc.aio servers and clients on 127.0.0.1.

The handler is an echo-like stand-in for the leader's fetch service: it answers each request with one
response naming the follower and the requested offsets, so the tests see exactly what reached it.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from cursus.cluster.certs import Authority, issue_node_cert, write_pem
from cursus.cluster.tls import TLSFiles
from cursus.internal.auth import TOKEN_METADATA_KEY, TokenCheck
from cursus.internal.client import FetchStream, InternalClient, InternalRpcError
from cursus.internal.server import InternalServer
from cursus.internal.v1 import replication_pb2 as pb
from cursus.internal.v1 import replication_pb2_grpc as pb_grpc
from tests.cluster.raftsupport import IDS, RaftPki, closed_by_peer

pytestmark = pytest.mark.timeout(60)

TOKEN = "internal-secret"
STEP_S = 10.0  # bound of every await on the network (a loaded 2-core machine)


class Echo:
    """Answers every request with one response per partition: ``leo`` = its fetch_offset."""

    def __init__(self, fail_after: int | None = None, payload: bytes = b"") -> None:
        self.calls: list[tuple[str, int]] = []  # (follower_id the server passed, fetch_offset)
        self.streams = 0
        self.cleaned_up = 0  # streams whose handler generator ran its finally (progress listeners etc.)
        self.fail_after = fail_after
        self.payload = payload

    async def serve(self, follower_id: str,
                    requests: AsyncIterator[pb.FetchRequest]) -> AsyncIterator[pb.FetchResponse]:
        self.streams += 1
        try:
            async for request in requests:
                if self.fail_after is not None and len(self.calls) >= self.fail_after:
                    raise RuntimeError("handler bug with a secret detail")
                parts = []
                for part in request.partitions:
                    self.calls.append((follower_id, part.fetch_offset))
                    parts.append(pb.PartitionData(topic=part.topic, partition=part.partition,
                                                  leo=part.fetch_offset, chunks=self.payload))
                yield pb.FetchResponse(partitions=parts)
        finally:
            self.cleaned_up += 1


def request(follower: str, offset: int) -> pb.FetchRequest:
    return pb.FetchRequest(follower_id=follower, max_wait_ms=0, max_bytes=1 << 20, partitions=[
        pb.PartitionFetch(topic="orders", partition=0, fetch_offset=offset, last_fetched_epoch=-1,
                          leader_epoch=1, lifecycle_epoch=1, max_bytes=1 << 20)])


async def exchange(stream: FetchStream, follower: str, offset: int) -> pb.FetchResponse:
    await asyncio.wait_for(stream.write(request(follower, offset)), STEP_S)
    return await asyncio.wait_for(stream.read(), STEP_S)


async def refused(stream: FetchStream, follower: str = "node-2") -> InternalRpcError:
    """Write one request and read: the stream must fail; returns the error."""
    with pytest.raises(InternalRpcError) as info:
        await exchange(stream, follower, 0)
    stream.cancel()
    return info.value


ServerFactory = Callable[..., Awaitable[InternalServer]]


@pytest.fixture
async def make_server() -> AsyncIterator[ServerFactory]:
    started: list[InternalServer] = []

    async def make(handler: Echo, *, tls: TLSFiles | None, token: TokenCheck | None = None,
                   members: tuple[str, ...] = IDS, port: int = 0, **kwargs: object) -> InternalServer:
        server = InternalServer("127.0.0.1", port, handler, tls=tls, token=token or TokenCheck(TOKEN),
                                members=members, **kwargs)  # type: ignore[arg-type]
        await server.start()
        started.append(server)
        return server

    yield make
    for server in started:
        await server.stop(0)


@pytest.fixture
async def clients() -> AsyncIterator[list[InternalClient]]:
    made: list[InternalClient] = []
    yield made
    for client in made:
        await client.close()


def client_for(made: list[InternalClient], local_id: str, tls: TLSFiles | None, token: str = TOKEN,
               **kwargs: object) -> InternalClient:
    client = InternalClient(local_id, tls=tls, token=token, **kwargs)  # type: ignore[arg-type]
    made.append(client)
    return client


def address(server: InternalServer, host: str = "127.0.0.1") -> str:
    return f"{host}:{server.bound_port}"


def authority_of(pki: RaftPki) -> Authority:
    cert = x509.load_pem_x509_certificate((pki.directory / "ca.crt").read_bytes())
    key = serialization.load_pem_private_key((pki.directory / "ca.key").read_bytes(), password=None)
    return Authority(cert, key)  # type: ignore[arg-type]


def extra_cert(pki: RaftPki, directory: Path, name: str, *, identity: str | None = None) -> TLSFiles:
    """A certificate from the cluster CA for ``name`` (``identity`` as in issue_node_cert)."""
    cert, key = issue_node_cert(authority_of(pki), name, ["127.0.0.1", "localhost"], days=1,
                                identity=identity)
    files = TLSFiles(directory / f"{name}.crt", directory / f"{name}.key", pki.directory / "ca.crt")
    write_pem(cert, key, files.cert, files.key)
    return files


# -- the good path -----------------------------------------------------------------------------------


async def test_member_streams_requests_and_responses_over_mutual_tls(make_server, clients, pki) -> None:
    echo = Echo()
    server = await make_server(echo, tls=pki.files("node-1"))
    client = client_for(clients, "node-2", pki.files("node-2"))
    for host in ("127.0.0.1", "localhost"):  # host verification works for either SAN entry
        stream = client.fetch_stream(address(server, host))
        for offset in range(5):
            response = await exchange(stream, "node-2", offset)
            assert [(p.topic, p.partition, p.leo) for p in response.partitions] == [("orders", 0, offset)]
        await stream.done_writing()
        with pytest.raises(InternalRpcError) as end:
            await asyncio.wait_for(stream.read(), STEP_S)
        assert end.value.code == grpc.StatusCode.OK
    assert echo.calls == [("node-2", offset) for offset in range(5)] * 2
    assert echo.streams == 2 and server.streams_total == 2 and server.active_streams == 0
    assert sum(server.refusals.values()) == 0
    assert client.channel(address(server)) is client.channel(address(server))  # one cached channel


async def test_rotation_accepts_the_next_token(make_server, clients, pki) -> None:
    server = await make_server(Echo(), tls=pki.files("node-1"), token=TokenCheck(TOKEN, "next-secret"))
    for token in (TOKEN, "next-secret"):
        stream = client_for(clients, "node-2", pki.files("node-2"), token=token).fetch_stream(address(server))
        assert (await exchange(stream, "node-2", 7)).partitions[0].leo == 7
        stream.cancel()
    # After the rotation: the new token alone is configured, the old one is refused.
    rotated = await make_server(Echo(), tls=pki.files("node-1"), token=TokenCheck("next-secret"))
    stream = client_for(clients, "node-2", pki.files("node-2")).fetch_stream(address(rotated))
    assert (await refused(stream)).code == grpc.StatusCode.UNAUTHENTICATED
    assert rotated.refusals["wrong_token"] == 1


async def test_response_of_a_full_fetch_fits_the_default_message_bound(make_server, clients, pki) -> None:
    payload = b"c" * (9 * 1024 * 1024)  # replica_fetch_response_max_bytes (8 MiB) plus a big first chunk
    server = await make_server(Echo(payload=payload), tls=pki.files("node-1"))
    stream = client_for(clients, "node-2", pki.files("node-2")).fetch_stream(address(server))
    assert (await exchange(stream, "node-2", 0)).partitions[0].chunks == payload
    stream.cancel()


async def test_message_above_the_bound_is_refused_not_buffered(make_server, clients, pki) -> None:
    server = await make_server(Echo(payload=b"c" * 2048), tls=pki.files("node-1"), max_message_bytes=1024)
    stream = client_for(clients, "node-2", pki.files("node-2")).fetch_stream(address(server))
    assert (await refused(stream)).code == grpc.StatusCode.RESOURCE_EXHAUSTED


# -- refusals at the token and identity checks ------------------------------------------------------


async def raw_fetch(channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...]) -> FetchStream:
    return FetchStream(pb_grpc.ReplicationStub(channel).Fetch(metadata=metadata))


def member_credentials(pki: RaftPki, node_id: str) -> grpc.ChannelCredentials:
    files = pki.files(node_id)
    return grpc.ssl_channel_credentials(files.ca.read_bytes(), files.key.read_bytes(), files.cert.read_bytes())


async def test_missing_and_wrong_token_are_unauthenticated(make_server, clients, pki) -> None:
    echo = Echo()
    server = await make_server(echo, tls=pki.files("node-1"))
    async with grpc.aio.secure_channel(address(server), member_credentials(pki, "node-2")) as channel:
        for metadata in ((), ((TOKEN_METADATA_KEY, ""),)):
            error = await refused(await raw_fetch(channel, metadata))
            assert error.code == grpc.StatusCode.UNAUTHENTICATED and "missing_token" in error.details
    wrong = client_for(clients, "node-2", pki.files("node-2"), token="guess").fetch_stream(address(server))
    error = await refused(wrong)
    assert error.code == grpc.StatusCode.UNAUTHENTICATED and "wrong_token" in error.details
    assert "guess" not in error.details and TOKEN not in error.details
    assert server.refusals == {"missing_token": 2, "wrong_token": 1}
    assert echo.streams == 0


async def test_member_certificate_claiming_another_follower_is_denied(make_server, clients, pki) -> None:
    echo = Echo()
    server = await make_server(echo, tls=pki.files("node-1"))
    client = client_for(clients, "node-2", pki.files("node-2"))
    error = await refused(client.fetch_stream(address(server)), follower="node-3")
    assert error.code == grpc.StatusCode.PERMISSION_DENIED and "follower_mismatch" in error.details
    # Switching follower_id within a stream: the first exchange is served, the switch is refused.
    stream = client.fetch_stream(address(server))
    assert (await exchange(stream, "node-2", 1)).partitions[0].leo == 1
    error = await refused(stream, follower="node-3")
    assert error.code == grpc.StatusCode.PERMISSION_DENIED and "follower_mismatch" in error.details
    assert server.refusals == {"follower_mismatch": 2}
    assert echo.calls == [("node-2", 1)]
    assert echo.streams == echo.cleaned_up == 1 and server.active_streams == 0


async def test_cancelled_stream_runs_the_handler_cleanup(make_server, clients, pki) -> None:
    echo = Echo()
    server = await make_server(echo, tls=pki.files("node-1"))
    stream = client_for(clients, "node-2", pki.files("node-2")).fetch_stream(address(server))
    assert (await exchange(stream, "node-2", 0)).partitions[0].leo == 0
    stream.cancel()
    deadline = time.monotonic() + STEP_S
    while (server.active_streams or not echo.cleaned_up) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert echo.cleaned_up == 1 and server.active_streams == 0


async def test_non_member_certificate_and_follower_are_denied(make_server, clients, pki, tmp_path) -> None:
    echo = Echo()
    server = await make_server(echo, tls=pki.files("node-1"), members=("node-1", "node-3"))
    error = await refused(client_for(clients, "node-2", pki.files("node-2")).fetch_stream(address(server)))
    assert error.code == grpc.StatusCode.PERMISSION_DENIED and "not_member" in error.details
    # A certificate from the cluster CA without a raft:// identity.
    anonymous = extra_cert(pki, tmp_path, "node-2", identity="")
    error = await refused(client_for(clients, "node-2", anonymous).fetch_stream(address(server)))
    assert error.code == grpc.StatusCode.PERMISSION_DENIED and "no_identity" in error.details
    assert server.refusals == {"not_member": 1, "no_identity": 1}
    assert echo.streams == 0


# -- refusals in the TLS handshake (gRPC's TLS layer; the peer sees UNAVAILABLE) ---------------------


async def test_tls_handshake_refusals(make_server, clients, pki) -> None:
    echo = Echo()
    server = await make_server(echo, tls=pki.files("node-1"))
    ca = pki.files("node-1").ca.read_bytes()
    foreign = pki.foreign  # node-2's identity, issued by another CA
    foreign_creds = grpc.ssl_channel_credentials(ca, foreign.key.read_bytes(), foreign.cert.read_bytes())
    cases = {
        "foreign CA": grpc.aio.secure_channel(address(server), foreign_creds),
        "no client certificate": grpc.aio.secure_channel(address(server), grpc.ssl_channel_credentials(ca)),
        "plaintext": grpc.aio.insecure_channel(address(server)),
    }
    for what, channel in cases.items():
        async with channel:
            error = await refused(await raw_fetch(channel, ((TOKEN_METADATA_KEY, TOKEN),)))
            assert error.code == grpc.StatusCode.UNAVAILABLE, what
    # The server itself, when its certificate is not from the CA the client trusts, is refused too.
    doubtful = client_for(clients, "node-2", TLSFiles(pki.files("node-2").cert, pki.files("node-2").key,
                                                      foreign.ca))
    assert (await refused(doubtful.fetch_stream(address(server)))).code == grpc.StatusCode.UNAVAILABLE
    assert echo.streams == 0 and sum(server.refusals.values()) == 0  # never reached Python code
    # The server still serves members afterwards.
    good = client_for(clients, "node-3", pki.files("node-3")).fetch_stream(address(server))
    assert (await exchange(good, "node-3", 3)).partitions[0].leo == 3
    good.cancel()


def _handshake(port: int, files: TLSFiles, version: ssl.TLSVersion) -> str:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.load_verify_locations(cafile=str(files.ca))
    context.load_cert_chain(str(files.cert), str(files.key))
    context.set_ciphers("DEFAULT:@SECLEVEL=0")  # let this OpenSSL offer TLS 1.1 at all
    with warnings.catch_warnings():  # TLSv1_1 is deprecated: that is the point
        warnings.simplefilter("ignore", DeprecationWarning)
        context.minimum_version = context.maximum_version = version
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=STEP_S) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        return str(tls.version())


async def test_tls_below_1_2_is_refused(make_server, pki) -> None:
    server = await make_server(Echo(), tls=pki.files("node-1"))
    files = pki.files("node-2")
    assert await asyncio.to_thread(_handshake, server.bound_port, files, ssl.TLSVersion.TLSv1_2) == "TLSv1.2"
    # The same client context does negotiate TLS 1.1 with a server that allows it (checked by hand with an
    # ssl-module server); gRPC's TLS layer (minimum TLS 1.2) logs UNSUPPORTED_PROTOCOL and closes.
    with pytest.raises((ssl.SSLError, ConnectionError)):
        await asyncio.to_thread(_handshake, server.bound_port, files, ssl.TLSVersion.TLSv1_1)


async def test_silent_peer_is_dropped_after_the_handshake_timeout(make_server, pki) -> None:
    server = await make_server(Echo(), tls=pki.files("node-1"), handshake_timeout_s=0.3)
    with socket.create_connection(("127.0.0.1", server.bound_port), timeout=STEP_S) as silent:
        started = time.monotonic()
        assert await asyncio.to_thread(closed_by_peer, silent, STEP_S)
        assert time.monotonic() - started < STEP_S / 2


# -- insecure mode, failures, lifecycle ------------------------------------------------------------------


async def test_insecure_mode_still_requires_the_token_and_a_member(make_server, clients) -> None:
    echo = Echo()
    server = await make_server(echo, tls=None)
    good = client_for(clients, "node-2", None).fetch_stream(address(server))
    assert (await exchange(good, "node-2", 4)).partitions[0].leo == 4
    good.cancel()
    error = await refused(client_for(clients, "node-2", None, token="").fetch_stream(address(server)))
    assert error.code == grpc.StatusCode.UNAUTHENTICATED
    error = await refused(client_for(clients, "node-2", None, token="guess").fetch_stream(address(server)))
    assert error.code == grpc.StatusCode.UNAUTHENTICATED
    error = await refused(client_for(clients, "node-9", None).fetch_stream(address(server)), follower="node-9")
    assert error.code == grpc.StatusCode.PERMISSION_DENIED and "not_member" in error.details
    assert server.refusals == {"missing_token": 1, "wrong_token": 1, "not_member": 1}
    assert echo.calls == [("node-2", 4)]
    assert server.stats() == {"refusals": {"missing_token": 1, "wrong_token": 1, "no_identity": 0,
                                           "not_member": 1, "follower_mismatch": 0},
                              "streams_total": 1, "active_streams": 0}


async def test_server_with_an_empty_token_accepts_nobody(make_server, clients) -> None:
    server = await make_server(Echo(), tls=None, token=TokenCheck(""))
    for token in ("", "anything"):
        error = await refused(client_for(clients, "node-2", None, token=token).fetch_stream(address(server)))
        assert error.code == grpc.StatusCode.UNAUTHENTICATED


async def test_handler_failure_is_internal_without_details_and_the_server_keeps_serving(
        make_server, clients, pki) -> None:
    server = await make_server(Echo(fail_after=1), tls=pki.files("node-1"))
    client = client_for(clients, "node-2", pki.files("node-2"))
    stream = client.fetch_stream(address(server))
    assert (await exchange(stream, "node-2", 0)).partitions[0].leo == 0
    error = await refused(stream)
    assert error.code == grpc.StatusCode.INTERNAL and "secret" not in error.details
    assert server.active_streams == 0
    server.handler.fail_after = None  # type: ignore[attr-defined]
    again = client.fetch_stream(address(server))
    assert (await exchange(again, "node-2", 1)).partitions[0].leo == 1
    again.cancel()


async def test_stop_ends_open_streams_and_the_port_is_not_shared(make_server, clients, pki) -> None:
    server = await make_server(Echo(), tls=pki.files("node-1"))
    with pytest.raises(OSError):  # no SO_REUSEPORT: a second listener on the same port fails loudly
        await make_server(Echo(), tls=pki.files("node-1"), port=server.bound_port)
    client = client_for(clients, "node-2", pki.files("node-2"))
    stream = client.fetch_stream(address(server))
    assert (await exchange(stream, "node-2", 0)).partitions[0].leo == 0
    pending = asyncio.ensure_future(stream.read())  # nothing requested: would wait forever
    await server.stop(0)
    with pytest.raises(InternalRpcError):
        await asyncio.wait_for(pending, STEP_S)
    with pytest.raises(InternalRpcError) as info:  # the peer is gone: UNAVAILABLE, fast
        await exchange(client.fetch_stream(address(server)), "node-2", 0)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


class FreezableProxy:
    """A TCP relay that can stop forwarding while keeping both connections open (a paused peer)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.frozen = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.port = 0
        self.relays: set[asyncio.Task[None]] = set()

    async def start(self) -> FreezableProxy:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            if self.frozen.is_set():
                await asyncio.Event().wait()  # swallow everything from now on (until cancelled)
            writer.write(data)
            await writer.drain()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.relays.add(task)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            up_writer.close()
            self.relays.discard(task)

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for task in list(self.relays):
            task.cancel()
        await asyncio.gather(*self.relays, return_exceptions=True)
        await self.server.wait_closed()


async def test_keepalive_detects_a_frozen_peer_and_idle_streams_survive_pings(make_server, clients, pki) -> None:
    server = await make_server(Echo(), tls=pki.files("node-1"), min_peer_ping_interval_s=0.1)
    proxy = await FreezableProxy(server.bound_port).start()
    try:
        client = client_for(clients, "node-2", pki.files("node-2"), keepalive_s=0.2, keepalive_timeout_s=0.5)
        stream = client.fetch_stream(f"127.0.0.1:{proxy.port}")
        assert (await exchange(stream, "node-2", 0)).partitions[0].leo == 0
        # Idle for several keepalive periods: pings are allowed (no GOAWAY too_many_pings), the stream lives.
        idle = asyncio.ensure_future(stream.read())
        done, _ = await asyncio.wait([idle], timeout=1.5)
        assert not done, idle.exception() if done else None
        # The peer stops answering (SIGSTOP-like): the pending read fails within a few keepalive periods.
        proxy.frozen.set()
        started = time.monotonic()
        with pytest.raises(InternalRpcError) as info:
            await asyncio.wait_for(idle, STEP_S)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 5.0
    finally:
        await proxy.stop()


async def test_server_keepalive_ends_the_stream_of_a_frozen_follower(make_server, clients, pki) -> None:
    server = await make_server(Echo(), tls=pki.files("node-1"), keepalive_s=0.2, keepalive_timeout_s=0.5)
    proxy = await FreezableProxy(server.bound_port).start()
    try:
        stream = client_for(clients, "node-2", pki.files("node-2")).fetch_stream(f"127.0.0.1:{proxy.port}")
        assert (await exchange(stream, "node-2", 0)).partitions[0].leo == 0
        assert server.active_streams == 1
        proxy.frozen.set()
        deadline = time.monotonic() + STEP_S
        while server.active_streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert server.active_streams == 0, "the leader kept the stream of a frozen follower"
    finally:
        await proxy.stop()


async def test_closed_client_refuses_new_streams(clients) -> None:
    client = client_for(clients, "node-2", None)
    client.channel("127.0.0.1:1")
    await client.close()
    with pytest.raises(RuntimeError):
        client.fetch_stream("127.0.0.1:1")
    assert "internal-secret" not in repr(client)


# -- AppendTxnRecord (a transaction coordinator writing to another broker's partition) ----------------------


async def test_append_txn_record_is_authenticated_and_bound_to_the_caller_identity(make_server, clients,
                                                                                   pki) -> None:
    server = await make_server(Echo(), tls=pki.files("node-1"))
    seen: list[tuple[str, str]] = []

    async def handler(coordinator_id: str, request: pb.TxnRecordRequest) -> pb.TxnRecordResponse:
        seen.append((coordinator_id, request.topic))
        return pb.TxnRecordResponse(end_offset=7)

    request = pb.TxnRecordRequest(coordinator_id="node-2", topic="t", partition=0, kind="data")
    client = client_for(clients, "node-2", pki.files("node-2"))
    # no handler installed yet: a typed, retryable refusal
    response = await client.append_txn_record(address(server), request, STEP_S)
    assert response.error.code == "transaction_manager_not_available"
    server.txn_handler = handler
    assert (await client.append_txn_record(address(server), request, STEP_S)).end_offset == 7
    assert seen == [("node-2", "t")]
    with pytest.raises(InternalRpcError) as info:  # a member claiming another coordinator
        await client.append_txn_record(address(server), pb.TxnRecordRequest(coordinator_id="node-3"), STEP_S)
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    wrong = client_for(clients, "node-2", pki.files("node-2"), token="guess")
    with pytest.raises(InternalRpcError) as info:
        await wrong.append_txn_record(address(server), request, STEP_S)
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert seen == [("node-2", "t")]
    assert server.refusals == {"follower_mismatch": 1, "wrong_token": 1}


async def test_reset_reaches_a_restarted_peer_at_once_and_lets_old_calls_finish(make_server, clients,
                                                                                pki) -> None:
    """A channel whose peer was down for seconds sits in gRPC's reconnect backoff and refuses new calls at
    once with the stale connect error, even after the peer is back (issue 13); ``reset`` gives the next
    call a fresh channel that dials now, while a call already waiting on the old channel still completes."""
    server = await make_server(Echo(), tls=pki.files("node-1"))
    port = server.bound_port
    client = client_for(clients, "node-2", pki.files("node-2"))
    target = address(server)
    stream = client.fetch_stream(target)
    assert (await exchange(stream, "node-2", 0)).partitions[0].leo == 0
    stream.cancel()
    await server.stop(0)
    down_until = time.monotonic() + 3.0  # down for seconds: the channel's backoff grows towards 2 s
    while time.monotonic() < down_until:
        with pytest.raises(InternalRpcError):
            await exchange(client.fetch_stream(target), "node-2", 0)
        await asyncio.sleep(0.05)
    old = client.channel(target)
    back = await make_server(Echo(), tls=pki.files("node-1"), port=port)

    async def txn_handler(coordinator_id: str, request: pb.TxnRecordRequest) -> pb.TxnRecordResponse:
        return pb.TxnRecordResponse(end_offset=3)

    back.txn_handler = txn_handler
    # a call with wait_for_ready on the old channel: it waits out that channel's backoff
    waiting = asyncio.ensure_future(client.append_txn_record(
        target, pb.TxnRecordRequest(coordinator_id="node-2", topic="t", partition=0, kind="data"), STEP_S))
    await asyncio.sleep(0)
    assert client.reset(target) and not client.reset("127.0.0.1:1")
    assert client.channel(target) is not old
    started = time.monotonic()
    fresh = client.fetch_stream(target)
    assert (await exchange(fresh, "node-2", 5)).partitions[0].leo == 5  # the first attempt, no backoff
    assert time.monotonic() - started < 1.0
    fresh.cancel()
    assert (await asyncio.wait_for(waiting, STEP_S)).end_offset == 3  # the old channel's call was not cut
