"""Transport behaviour with a test double that speaks the codec over real loopback sockets.

The double (``FakeBroker``) negotiates, decodes every request and answers with whatever a test's handler
returns, optionally forwarding to a real broker. It exercises what a standalone broker never does:
``NOT_LEADER``/``NOT_COORDINATOR`` redirects, refused AUTH, silent brokers, dropped replies, TLS.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import ipaddress
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cursus.client import (
    Admin,
    AsyncProducer,
    AuthenticationError,
    Backoff,
    Client,
    Connection,
    Consumer,
    DeliveryFailedError,
    DeliveryUnknownError,
    NotLeaderError,
    Producer,
    TlsError,
    make_ssl_context,
)
from cursus.wire import (
    Command,
    CommandPayload,
    Compression,
    Frame,
    FrameDecoder,
    Kind,
    Status,
    decode_batch,
    decode_crq2,
    decode_negotiation_request,
    encode_error,
    encode_frame,
    encode_negotiation_response,
    is_crq2,
    make_error,
    select_compression,
)

pytestmark = pytest.mark.timeout(60)

Reply = tuple[Status, bytes] | str | None  # (status, payload) | "close" | None (no reply)
Handler = Callable[["FakeBroker", Frame, CommandPayload | None], Reply]


def ok(text: str) -> tuple[Status, bytes]:
    return Status.OK, text.encode()


def err(code: str, **fields: object) -> tuple[Status, bytes]:
    return Status.ERROR, encode_error(make_error(code, **fields))


class FakeBroker:
    """A one-handler Wire v2 server on 127.0.0.1 (one thread per connection)."""

    def __init__(self, handler: Handler, *, compressions: tuple[Compression, ...] = (Compression.NONE,),
                 ssl_context: ssl.SSLContext | None = None, port: int = 0, upstream: tuple[str, int] | None = None):
        self.handler = handler
        self.compressions = compressions
        self.ssl_context = ssl_context
        self.upstream = upstream
        self.requests: list[tuple[int, Command, CommandPayload | None]] = []
        self.offers: list[tuple[Compression, ...]] = []
        self.state: dict[str, Any] = collections.defaultdict(int)
        #: When set, connections accepted from then on (from the ``hold_from``-th, counting from 0) wait for
        #: this event before their handshake.
        self.hold: threading.Event | None = None
        self.hold_from = 0
        self._accepted = 0
        self._listener = socket.create_server(("127.0.0.1", port), reuse_port=False)
        self.address = self._listener.getsockname()[:2]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def addr(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    def commands(self) -> list[Command]:
        return [command for _, command, _ in self.requests]

    def forward(self, frame: Frame) -> tuple[Status, bytes]:
        """Send the request to the real broker and return its reply."""
        assert self.upstream is not None
        with Connection(*self.upstream) as conn:
            reply = conn.request(frame.command, frame.payload)
        return reply.status, reply.payload

    def forward_metadata_as_leader(self, frame: Frame) -> tuple[Status, bytes]:
        """METADATA from the real broker, with every leader replaced by this double's address."""
        status, payload = self.forward(frame)
        tokens = payload.decode().split()
        count = next(int(t.split("=")[1]) for t in tokens if t.startswith("partitions="))
        tokens = [f"leaders={','.join([self.addr] * count)}" if t.startswith("leaders=") else t for t in tokens]
        return status, " ".join(tokens).encode()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            index, self._accepted = self._accepted, self._accepted + 1
            threading.Thread(target=self._serve, args=(sock, index), daemon=True).start()

    def _serve(self, sock: socket.socket, index: int) -> None:
        hold = self.hold
        if hold is not None and index >= self.hold_from:
            hold.wait(30)
        try:
            if self.ssl_context is not None:
                sock = self.ssl_context.wrap_socket(sock, server_side=True)
            decoder = FrameDecoder()

            def read() -> Frame | None:
                while True:
                    frame = decoder.next_frame()
                    if frame is not None:
                        return frame
                    data = sock.recv(65536)
                    if not data:
                        return None
                    decoder.feed(data)

            hello = read()
            if hello is None:
                return
            request = decode_negotiation_request(hello.payload)
            self.offers.append(request.compressions)
            selected = select_compression(request, self.compressions)
            assert selected is not None
            sock.sendall(encode_frame(Kind.NEGOTIATION_RESPONSE, Command.NEGOTIATE, Status.OK, 0,
                                      encode_negotiation_response(2, selected), compression=None))
            decoder.negotiated = selected
            while True:
                frame = read()
                if frame is None:
                    return
                fields = decode_crq2(frame.payload) if is_crq2(frame.payload) else None
                self.requests.append((frame.request_id, frame.command, fields))
                reply = self.handler(self, frame, fields)
                if reply == "close":
                    return
                if reply is None:
                    continue
                status, payload = reply
                sock.sendall(encode_frame(Kind.RESPONSE, frame.command, status, frame.request_id, payload,
                                          compression=selected))
        except (OSError, ssl.SSLError):
            return
        finally:
            sock.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()


@pytest.fixture
def fakes():
    started: list[FakeBroker] = []

    def make(handler: Handler, **kwargs: Any) -> FakeBroker:
        fake = FakeBroker(handler, **kwargs)
        started.append(fake)
        return fake

    yield make
    for fake in started:
        fake.close()


def _real(broker) -> str:
    host, port = broker.address
    return f"{host}:{port}"


def _list_handler(fake: FakeBroker, frame: Frame, fields: CommandPayload | None) -> Reply:
    if frame.command == Command.AUTH:
        return ok(f"OK principal={fields.get('principal')} authenticated=false")
    return ok("OK count=0 topics=")


# ----------------------------------------------------------------------------------- connection basics


def test_request_ids_auth_and_compression_fallback(fakes):
    fake = fakes(_list_handler)
    with Connection(*fake.address, compression="gzip", principal="alice", token="s3cret") as conn:
        assert conn.compression == Compression.NONE  # broker offered only none: fall back
        for _ in range(2):
            assert conn.call(Command.LIST).status == Status.OK
    assert fake.offers == [(Compression.GZIP, Compression.NONE)]
    assert [(rid, cmd) for rid, cmd, _ in fake.requests] == [(1, Command.AUTH), (2, Command.LIST), (3, Command.LIST)]
    assert dict(fake.requests[0][2].fields) == {"principal": "alice", "token": "s3cret"}
    gzip_fake = fakes(_list_handler, compressions=(Compression.GZIP, Compression.NONE))
    with Connection(*gzip_fake.address, compression=Compression.GZIP) as conn:
        assert conn.compression == Compression.GZIP and conn.call(Command.LIST).status == Status.OK


def test_refused_auth_raises_and_closes(fakes):
    fake = fakes(lambda f, frame, fields: err("authentication_failed", principal="mallory"))
    with pytest.raises(AuthenticationError) as info:
        Connection(*fake.address, principal="mallory", token="nope")
    assert info.value.fields == {"principal": "mallory"}


def test_silent_broker_times_out_and_the_connection_is_closed(fakes):
    fake = fakes(lambda f, frame, fields: None)
    conn = Connection(*fake.address, timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        conn.call(Command.LIST)
    assert conn.closed and time.monotonic() - started < 3
    with Client(fake.addr, timeout_s=0.3) as client, pytest.raises(DeliveryUnknownError):
        client.call(Command.DELETE, {"topic": "t"})  # not retry-safe: one attempt, outcome unknown


def test_client_reconnects_with_backoff_until_the_broker_appears(fakes):
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens on port now: connects are refused
    result: dict[str, Any] = {}

    def call() -> None:
        with Client(f"127.0.0.1:{port}", backoff=Backoff(initial_s=0.05, max_s=0.2, attempts_max=40)) as client:
            started = time.monotonic()
            result["frame"] = client.call(Command.LIST)
            result["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.4)
    fakes(_list_handler, port=port)
    thread.join(timeout=10)
    assert result["frame"].status == Status.OK and result["seconds"] >= 0.35


def test_tls_with_ca_file_and_cursusctl_tls_flags(fakes, tmp_path):
    cert_path, key_path = _self_signed(tmp_path)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert_path, key_path)
    fake = fakes(_list_handler, ssl_context=server)
    context = make_ssl_context(ca_file=str(cert_path))
    with Connection(*fake.address, ssl_context=context, principal="bob", token="t") as conn:
        assert conn.call(Command.LIST).payload == b"OK count=0 topics="
    with pytest.raises(TlsError, match="tls_certificate_verify_failed"):  # the system trust store lacks our CA
        Connection(*fake.address, ssl_context=make_ssl_context())
    env = {**os.environ, "CTL_TOKEN": "from-env"}
    out = subprocess.run([sys.executable, "-m", "cursus.cli.ctl", "--broker", fake.addr, "--tls-ca", str(cert_path),
                          "--principal", "carol", "--auth-token-env", "CTL_TOKEN", "raw", "LIST"],
                         capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "OK count=0 topics="
    auth = [fields for _, cmd, fields in fake.requests if cmd == Command.AUTH]
    assert dict(auth[-1].fields) == {"principal": "carol", "token": "from-env"}
    insecure = subprocess.run([sys.executable, "-m", "cursus.cli.ctl", "--broker", fake.addr, "--tls-insecure",
                               "raw", "LIST"], capture_output=True, text=True, timeout=30)
    assert insecure.returncode == 0 and insecure.stdout.strip() == "OK count=0 topics=", insecure.stderr
    system = subprocess.run([sys.executable, "-m", "cursus.cli.ctl", "--broker", fake.addr, "--tls", "--timeout",
                             "2s", "raw", "LIST"], capture_output=True, text=True, timeout=30)
    assert system.returncode == 1  # the system trust store does not know our CA


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cursus-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


# ----------------------------------------------------------------------------------- redirects


def test_admin_follows_not_leader_and_not_coordinator(fakes, shared_broker, topic_name):
    host, port = shared_broker.address
    leader_fake = fakes(lambda f, frame, fields: err("NOT_LEADER", leader=f"{host}:{port}"))
    with Admin(leader_fake.addr) as admin:
        assert admin.create_topic(topic_name, 2).partitions == 2
        assert admin.metadata(topic_name).partitions == 2
    assert leader_fake.commands() == [Command.CREATE, Command.METADATA]
    coordinator_fake = fakes(lambda f, frame, fields: err("NOT_COORDINATOR", host=host, port=port))
    with Client(coordinator_fake.addr) as client:
        assert client.call(Command.LIST).payload.startswith(b"OK count=")
    # A redirect loop is bounded.
    loop_fake = fakes(lambda f, frame, fields: err("NOT_LEADER", leader=f.addr))
    with Client(loop_fake.addr) as client, pytest.raises(Exception) as info:
        client.call(Command.LIST)
    assert getattr(info.value, "code", "") == "NOT_LEADER" and len(loop_fake.requests) == 6


def _redirecting_to(real: str, refused: list[tuple[int, int]]) -> Handler:
    """A double claiming to lead every partition that answers each PUBLISH ``NOT_LEADER leader=real``,
    noting the (partition, seq_start) of each batch it refused."""

    def handler(fake: FakeBroker, frame: Frame, fields: CommandPayload | None) -> Reply:
        if frame.command == Command.METADATA:
            return fake.forward_metadata_as_leader(frame)
        batch = decode_batch(frame.payload)
        refused.append((batch.partition, batch.seq_start))
        return err("NOT_LEADER", leader=real)

    return handler


def _check_redirected_once_in_order(refused: list[tuple[int, int]], sent: dict[int, list[bytes]], topic: str,
                                    real: str) -> None:
    per_partition = collections.Counter(partition for partition, _ in refused)
    assert len(set(refused)) == len(refused)  # each batch was refused once, then went to the real leader
    assert max(per_partition.values()) >= 2  # a window of several batches was refused
    assert all(count <= 5 for count in per_partition.values())  # only what was in flight before the reply
    with Consumer(topic, real) as consumer:
        got: dict[int, list[bytes]] = collections.defaultdict(list)
        for record in consumer.records(until_end=True):
            got[record.partition].append(record.value)
    assert got == sent  # every record once, each partition in send order


def test_producer_follows_not_leader_to_the_real_leader(fakes, shared_broker, topic_name):
    """Every batch of a pipelined window refused with NOT_LEADER is resent, in order, to the real leader
    (issue 11: without idempotence all but the last batch of the window failed, as if resending them
    would reorder the partition; nothing of it had been written)."""
    real = _real(shared_broker)
    with Admin(real) as admin:
        admin.create_topic(topic_name, 2)
    refused: list[tuple[int, int]] = []
    fake = fakes(_redirecting_to(real, refused), upstream=shared_broker.address)
    sent: dict[int, list[bytes]] = collections.defaultdict(list)
    with Producer(fake.addr, linger_ms=1, batch_size=10, max_in_flight=5, timeout_s=30) as producer:
        assert producer.partitions_for(topic_name) == 2  # METADATA before the hold
        # The senders' connections wait until every record is queued: their windows then fill with full
        # batches (pipelined) before the first NOT_LEADER is read, whatever the machine's load.
        fake.hold = threading.Event()
        futures = [producer.send(topic_name, b"r%d" % i, key=str(i)) for i in range(200)]
        fake.hold.set()
        producer.flush()
        for i, future in enumerate(futures):
            sent[future.result().partition].append(b"r%d" % i)
    _check_redirected_once_in_order(refused, sent, topic_name, real)


def test_async_producer_follows_not_leader_to_the_real_leader(fakes, shared_broker, topic_name):
    """The same with :class:`AsyncProducer` (its sender tasks drive the same core)."""
    real = _real(shared_broker)
    with Admin(real) as admin:
        admin.create_topic(topic_name, 2)
    refused: list[tuple[int, int]] = []
    fake = fakes(_redirecting_to(real, refused), upstream=shared_broker.address)
    fake.hold, fake.hold_from = threading.Event(), 1  # the first connection (METADATA) is not held

    async def produce() -> list[Any]:
        async with AsyncProducer(fake.addr, linger_ms=1, batch_size=10, max_in_flight=5, timeout_s=30) as producer:
            futures = [await producer.send(topic_name, b"r%d" % i, key=str(i)) for i in range(200)]
            assert fake.hold is not None
            fake.hold.set()
            await producer.flush()
            return [future.result() for future in futures]

    sent: dict[int, list[bytes]] = collections.defaultdict(list)
    for i, metadata in enumerate(asyncio.run(produce())):
        sent[metadata.partition].append(b"r%d" % i)
    _check_redirected_once_in_order(refused, sent, topic_name, real)


def test_consumer_follows_not_leader(fakes, shared_broker, topic_name):
    real = _real(shared_broker)
    with Admin(real) as admin:
        admin.create_topic(topic_name, 1)
    with Producer(real) as producer:
        for i in range(20):
            producer.send(topic_name, b"%d" % i)

    def handler(fake: FakeBroker, frame: Frame, fields: CommandPayload | None) -> Reply:
        if frame.command == Command.METADATA:
            return fake.forward_metadata_as_leader(frame)
        if frame.command == Command.LIST_OFFSETS:
            return fake.forward(frame)
        return err("NOT_LEADER", leader=real)

    fake = fakes(handler, upstream=shared_broker.address)
    with Consumer(topic_name, fake.addr) as consumer:
        assert [r.value for r in consumer.records(until_end=True)] == [b"%d" % i for i in range(20)]
    assert fake.commands().count(Command.CONSUME) == 1


# ----------------------------------------------------------------------------------- lost replies


def _lossy(drops: int) -> Handler:
    """Forward everything to the real broker, but close the connection instead of answering the first
    ``drops`` PUBLISH requests (after the broker appended them)."""

    def handler(fake: FakeBroker, frame: Frame, fields: CommandPayload | None) -> Reply:
        if frame.command == Command.METADATA:
            return fake.forward_metadata_as_leader(frame)
        reply = fake.forward(frame)
        if frame.command == Command.PUBLISH and fake.state["dropped"] < drops:
            fake.state["dropped"] += 1
            return "close"
        return reply

    return handler


def test_idempotent_retry_after_lost_ack_writes_once(fakes, shared_broker, topic_name):
    real = _real(shared_broker)
    with Admin(real) as admin:
        admin.create_topic(topic_name, 1, idempotent=True)
    fake = fakes(_lossy(drops=2), upstream=shared_broker.address)
    with Producer(fake.addr, idempotent=True, backoff=Backoff(initial_s=0.01, max_s=0.05)) as producer:
        futures = [producer.send(topic_name, b"once-%d" % i) for i in range(50)]
        producer.flush()
    assert [f.result().offset for f in futures] == list(range(50))
    assert fake.commands().count(Command.PUBLISH) >= 3  # the dropped ones were resent
    with Consumer(topic_name, real) as consumer:
        assert [r.value for r in consumer.records(until_end=True)] == [b"once-%d" % i for i in range(50)]


def test_non_idempotent_lost_ack_fails_without_retry(fakes, shared_broker, topic_name):
    real = _real(shared_broker)
    with Admin(real) as admin:
        admin.create_topic(topic_name, 1)
    fake = fakes(_lossy(drops=1), upstream=shared_broker.address)
    with Producer(fake.addr, linger_ms=60_000) as producer:  # one batch: it leaves at flush()
        futures = [producer.send(topic_name, b"maybe-%d" % i) for i in range(5)]
        with pytest.raises(DeliveryFailedError):
            producer.flush()
        assert all(isinstance(f.exception(), DeliveryUnknownError) for f in futures)
        later = producer.send(topic_name, b"later")
        producer.flush()
    assert later.result().offset == 5
    with Consumer(topic_name, real) as consumer:  # written exactly once, never resent
        assert [r.value for r in consumer.records(until_end=True)] == [b"maybe-%d" % i for i in range(5)] + [b"later"]


def test_async_transport_tls_auth_redirect_and_timeout(fakes, shared_broker, tmp_path):
    import asyncio

    from cursus.client import AsyncClient, AsyncConnection

    cert_path, key_path = _self_signed(tmp_path)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert_path, key_path)
    tls_fake = fakes(_list_handler, ssl_context=server, compressions=(Compression.LZ4, Compression.NONE))
    host, port = shared_broker.address
    redirecting = fakes(lambda f, frame, fields: err("NOT_LEADER", leader=f"{host}:{port}"))
    silent = fakes(lambda f, frame, fields: None)

    async def main() -> None:
        conn = await AsyncConnection.open(*tls_fake.address, compression="lz4",
                                          ssl_context=make_ssl_context(ca_file=str(cert_path)),
                                          principal="dora", token="t0k")
        async with conn:
            assert conn.compression == Compression.LZ4
            assert (await conn.call(Command.LIST)).payload == b"OK count=0 topics="
        assert [(rid, cmd) for rid, cmd, _ in tls_fake.requests] == [(1, Command.AUTH), (2, Command.LIST)]
        async with AsyncClient(redirecting.addr) as client:
            assert (await client.call(Command.LIST)).payload.startswith(b"OK count=")
        quiet = await AsyncConnection.open(*silent.address, timeout_s=0.3)
        with pytest.raises(TimeoutError):
            await quiet.call(Command.LIST)
        assert quiet.closed

    asyncio.run(main())


def test_unreachable_leader_buffer_full_and_close_timeout(fakes):
    from cursus.client import BufferFullError, ClientClosedError

    probe = socket.create_server(("127.0.0.1", 0))
    dead = probe.getsockname()
    probe.close()  # the advertised leader refuses connections

    def handler(fake: FakeBroker, frame: Frame, fields: CommandPayload | None) -> Reply:
        return ok(f"OK topic=t partitions=1 leaders={dead[0]}:{dead[1]} epochs=0 partitioner=hash_key")

    fake = fakes(handler)
    producer = Producer(fake.addr, buffer_records=10, max_block_s=0.2,
                        backoff=Backoff(initial_s=0.05, max_s=0.1))
    futures = [producer.send("t", b"%d" % i) for i in range(10)]
    started = time.monotonic()
    with pytest.raises(BufferFullError):
        producer.send("t", b"one too many")
    assert 0.15 < time.monotonic() - started < 2
    with pytest.raises(DeliveryFailedError) as info:
        producer.close(timeout_s=0.3)
    assert info.value.failed_count == 10
    assert all(isinstance(f.exception(), ClientClosedError) for f in futures)
    with pytest.raises(ClientClosedError):
        producer.send("t", b"after close")


def test_event_store_rides_out_a_leader_change_past_the_redirect_budget(fakes):
    """EventStore retries NOT_LEADER with backoff within failover_timeout_s (a failover takes longer than the
    client's 5 redirects); an append retried after NOT_LEADER that then conflicts is an unknown outcome."""
    from cursus.client.events import EventStore

    state = {"not_leader": 8, "append": "ok"}

    def handler(fake: FakeBroker, frame: Frame, fields: CommandPayload | None) -> Reply:
        if state["not_leader"] > 0:
            state["not_leader"] -= 1
            return err("NOT_LEADER", topic="t", partition=0, leader=f"{fake.address[0]}:{fake.address[1]}")
        if frame.command == Command.STREAM_VERSION:
            return ok("OK version=3")
        if state["append"] == "conflict":
            return err("version_conflict", current=4, expected=4)
        return ok("OK version=4 offset=9 partition=0")

    fake = fakes(handler)
    with EventStore(fake.addr, "t", failover_timeout_s=10) as store:
        assert store.version("k") == 3
        state["not_leader"] = 8
        assert store.append("k", "e", expected_version=4).offset == 9
        state["not_leader"], state["append"] = 8, "conflict"
        with pytest.raises(DeliveryUnknownError):
            store.append("k", "e", expected_version=4)
    with EventStore(fake.addr, "t", failover_timeout_s=0.2) as store:
        state["not_leader"] = 1000
        with pytest.raises(NotLeaderError):  # the deadline bounds the wait
            store.version("k")
