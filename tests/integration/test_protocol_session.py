"""Connection-level behaviour against a real broker: negotiation, malformed frames, limits."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from cursus.wire import (
    Command,
    Compression,
    Kind,
    NegotiationRequest,
    Status,
    encode_frame,
    encode_negotiation_request,
)
from tests.integration.conftest import connect
from tests.integration.helpers import create_topic, error_of, ok_fields

pytestmark = pytest.mark.timeout(60)


def _raw(broker) -> socket.socket:
    sock = socket.create_connection(broker.address, timeout=5)
    return sock


def _recv_eof(sock: socket.socket) -> bytes:
    """Read until the broker closes; returns what arrived before EOF."""
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


@pytest.mark.parametrize("compression", list(Compression))
def test_negotiation_and_round_trip_each_compression(shared_broker, topic_name, compression):
    with connect(shared_broker, compression=compression) as conn:
        assert conn.compression == compression
        fields = create_topic(conn, topic_name, partitions=2)
        assert fields["partitions"] == "2"
        listed = ok_fields(conn.command("LIST"))
        assert topic_name in listed["topics"].split(",")


def test_first_frame_not_negotiation_is_closed_without_reply(shared_broker):
    sock = _raw(shared_broker)
    sock.sendall(encode_frame(Kind.REQUEST, Command.LIST, Status.NONE, 1, b"", compression=Compression.NONE))
    assert _recv_eof(sock) == b""
    sock.close()


def test_negotiation_without_common_version_closed(shared_broker):
    sock = _raw(shared_broker)
    payload = encode_negotiation_request(NegotiationRequest(3, 4, (Compression.NONE,)))
    sock.sendall(encode_frame(Kind.NEGOTIATION_REQUEST, Command.NEGOTIATE, Status.NONE, 0, payload,
                              compression=None))
    assert _recv_eof(sock) == b""
    sock.close()


def test_garbage_frame_closes_only_that_connection(shared_broker, topic_name):
    good = connect(shared_broker)
    bad = connect(shared_broker)
    create_topic(good, topic_name)
    bad.sock.sendall(b"\x00" * 32 + b"garbage")
    assert _recv_eof(bad.sock) == b""
    # Unknown command id (99) in an otherwise valid header: also closes only that connection.
    bad2 = connect(shared_broker)
    header = bytearray(encode_frame(Kind.REQUEST, Command.LIST, Status.NONE, 1, b"", compression=Compression.NONE))
    struct.pack_into(">H", header, 8, 99)
    bad2.sock.sendall(bytes(header))
    assert _recv_eof(bad2.sock) == b""
    # Bad CRC.
    bad3 = connect(shared_broker)
    frame = bytearray(encode_frame(Kind.REQUEST, Command.LIST, Status.NONE, 1, b"CRQ2xx",
                                   compression=Compression.NONE))
    frame[28] ^= 0xFF
    bad3.sock.sendall(bytes(frame))
    assert _recv_eof(bad3.sock) == b""
    assert topic_name in ok_fields(good.command("LIST"))["topics"]
    for c in (good, bad, bad2, bad3):
        c.close()


def test_bad_arguments_get_typed_errors_and_connection_stays_usable(shared_broker, topic_name):
    with connect(shared_broker) as conn:
        err = error_of(conn.command("CREATE topic=bad/name"))
        assert err.code == "invalid_topic_name"
        assert err.error_class.label == "validation"
        err = error_of(conn.command(f"CREATE topic={topic_name} partitions=zero"))
        assert err.code == "invalid_partitions"
        err = error_of(conn.command(f"CREATE topic={topic_name} partitoins=2"))
        assert err.code == "invalid_field"
        err = error_of(conn.command("METADATA topic=does-not-exist"))
        assert err.code == "topic_not_found"
        assert err.error_class.label == "not_found"
        err = error_of(conn.command("TXN_APPEND_STREAM transactional_id=tx"))
        assert err.code == "missing_topic"
        err = error_of(conn.call(Command.REPLICATE_MESSAGE, {"payload": "x"}))
        assert err.code == "internal_command_unauthorized"
        assert ok_fields(conn.command("LIST"))["count"]


def test_non_command_payload_gets_malformed_input_then_close(shared_broker):
    with connect(shared_broker) as conn:
        frame = conn.request(Command.LIST, b"LIST")
        assert error_of(frame).code == "malformed_input"
        assert _recv_eof(conn.sock) == b""


def test_exit_replies_ok_then_closes(shared_broker):
    with connect(shared_broker) as conn:
        assert conn.command("EXIT").payload == b"OK"
        assert _recv_eof(conn.sock) == b""


def test_auth_without_sasl_stays_anonymous(shared_broker):
    with connect(shared_broker) as conn:
        fields = ok_fields(conn.command("AUTH principal=alice token=secret"))
        assert fields == {"principal": "alice", "authenticated": "false"}


def test_two_hundred_concurrent_connections(shared_broker, topic_name):
    with connect(shared_broker) as admin:
        create_topic(admin, topic_name)
    errors: list[BaseException] = []
    barrier = threading.Barrier(200)

    def worker() -> None:
        try:
            with connect(shared_broker, timeout_s=30) as conn:
                barrier.wait(timeout=30)
                for _ in range(3):
                    ok_fields(conn.command(f"LIST_OFFSETS topic={topic_name}"))
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors[:3]


def test_idle_connections_close_only_when_configured(broker_factory):
    broker = broker_factory(settings={"client_idle_timeout_ms": 300}).start()
    with connect(broker) as conn:
        ok_fields(conn.command("LIST"))
        conn.sock.settimeout(10)
        assert _recv_eof(conn.sock) == b""  # closed by the broker after ~300 ms of idleness
