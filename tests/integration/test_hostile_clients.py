"""Regression tests for hostile or careless clients (found by a break-it pass)."""

from __future__ import annotations

import socket
import struct
import time

import pytest

from cursus.wire import Command, Compression, Kind, Status, encode_crq2, encode_frame, parse_command_text
from tests.integration.conftest import connect
from tests.integration.helpers import ack_of, create_topic, error_of, ok_fields, publish_batch

pytestmark = pytest.mark.timeout(60)


def _stalled_upload(broker, declared: int) -> socket.socket:
    """A negotiated connection that sends a request header declaring ``declared`` bytes, then nothing."""
    conn = connect(broker)
    header = bytearray(encode_frame(Kind.REQUEST, Command.LIST, Status.NONE, 1, b"",
                                    compression=Compression.NONE))
    struct.pack_into(">II", header, 20, declared, declared)
    conn.sock.sendall(bytes(header))
    return conn.sock


def test_stalled_uploads_do_not_block_others_and_are_dropped(broker_factory):
    broker = broker_factory(settings={"client_request_timeout_ms": 1500}).start()
    stalled = [_stalled_upload(broker, 64 * 1024 * 1024) for _ in range(3)]
    with connect(broker, timeout_s=5) as conn:
        started = time.monotonic()
        create_topic(conn, "busy")
        ack_of(publish_batch(conn, "busy", 0, [b"x" * 1000] * 100))
        assert time.monotonic() - started < 3
    for sock in stalled:  # each is closed once its payload deadline passes
        sock.settimeout(10)
        assert sock.recv(1) == b""
        sock.close()


def test_consume_reply_is_capped(broker_factory):
    broker = broker_factory(settings={"consume_max_bytes_limit": 65536}).start()
    with connect(broker) as conn:
        create_topic(conn, "capped")
        for _ in range(4):
            ack_of(publish_batch(conn, "capped", 0, [b"y" * 1000] * 100))
        frame = conn.command("CONSUME topic=capped partition=0 offset=0 batch=100000 max_bytes=1000000000")
        assert frame.status == Status.OK
        assert 60_000 < len(frame.payload) < 70_000


def test_out_of_range_numbers_get_typed_errors(shared_broker, topic_name):
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name)
        cases = {
            f"PUBLISH topic={topic_name} producerId=p seqNum=18446744073709551616 message=x": "invalid_seq_num",
            f"PUBLISH topic={topic_name} producerId=p epoch=9223372036854775808 message=x": "invalid_epoch",
            f"PUBLISH topic={topic_name} producerId=p partition=1_0 message=x": "invalid_partition",
            f"CONSUME topic={topic_name} partition=0 offset=\u0663": "invalid_offset",
            f"CREATE topic={topic_name} partitions=\uff13": "invalid_partitions",
            f"CREATE topic={topic_name} retention_bytes=100000000000000000000": "invalid_retention_bytes",
        }
        for text, code in cases.items():
            command, payload = parse_command_text(text)
            assert error_of(conn.request(command, encode_crq2(payload))).code == code, text
        assert ok_fields(conn.command("LIST"))["count"]


def test_abandoned_long_polls_free_their_connection_slots(broker_factory):
    broker = broker_factory(settings={"max_client_connections": 3, "shutdown_grace_ms": 20000}).start()
    with connect(broker) as conn:
        create_topic(conn, "polled")
    for _ in range(3):
        conn = connect(broker)
        command, payload = parse_command_text("CONSUME topic=polled partition=0 offset=0 wait_ms=60000")
        conn.send(command, encode_crq2(payload))
        conn.sock.close()
    with connect(broker, timeout_s=10) as conn:  # would wait for a slot if the polls were still parked
        assert ok_fields(conn.command("LIST"))["topics"] == "polled"
    # A live long poll does not hold up shutdown either.
    poller = connect(broker)
    command, payload = parse_command_text("CONSUME topic=polled partition=0 offset=0 wait_ms=60000")
    poller.send(command, encode_crq2(payload))
    started = time.monotonic()
    assert broker.terminate() == 0
    assert time.monotonic() - started < 10
    assert "Traceback" not in broker.output()
    poller.close()


def test_invalid_utf8_field_is_a_typed_error(shared_broker):
    from cursus.wire import CommandPayload

    with connect(shared_broker) as conn:
        raw = bytearray(encode_crq2(CommandPayload((), {"topic": "abc\u00e9"})))
        raw[-1] = 0xFF  # the last byte of "é" becomes an invalid UTF-8 continuation
        err = error_of(conn.request(Command.METADATA, bytes(raw)))
        assert err.code == "invalid_payload"
        assert ok_fields(conn.command("LIST"))["count"]  # the connection stays usable


def test_client_that_never_reads_its_reply_is_disconnected(broker_factory):
    broker = broker_factory(settings={"client_request_timeout_ms": 1000, "exporter_port": 0}).start()
    with connect(broker) as conn:
        create_topic(conn, "unread")
        for _ in range(40):
            ack_of(publish_batch(conn, "unread", 0, [b"z" * 10_000] * 50))  # 20 MB stored
    reader = connect(broker)
    reader.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    command, payload = parse_command_text("CONSUME topic=unread partition=0 offset=0 batch=100000 max_bytes=16000000")
    reader.send(command, encode_crq2(payload))  # and never read the ~16 MB reply
    deadline = time.monotonic() + 20
    active = None
    while time.monotonic() < deadline:
        _, body = broker.http_get("/metrics", port=broker.metrics_port)
        for line in body.decode().splitlines():
            if line.startswith("cursus_broker_client_connections_active "):
                active = float(line.split()[1])
        if active == 0:
            break
        time.sleep(0.1)
    assert active == 0, "the broker kept a connection whose client never read its reply"
    reader.close()
