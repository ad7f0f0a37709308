"""STREAM against real brokers: kind-5 data frames woken by appends, keepalive timing, every close reason,
resume from the committed offset after a reconnect, max_stream_connections, client EOF and misuse."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from cursus.client.connection import Connection, ConnectionClosed
from cursus.wire import Command, Frame, Kind, Status, decode_batch, encode_crq2, parse_command_text
from tests.integration.conftest import connect
from tests.integration.helpers import create_topic, error_of, ok_fields, publish_batch


def open_stream(conn: Connection, text: str) -> int:
    """Send a STREAM request without reading; returns its request id."""
    command, payload = parse_command_text(text)
    assert command == Command.STREAM
    return conn.send(command, encode_crq2(payload))


def next_frame(conn: Connection, request_id: int, timeout_s: float = 10.0) -> tuple[float, Frame]:
    """(arrival time, frame) of the next frame of the stream ``request_id``."""
    conn.sock.settimeout(timeout_s)
    frame = conn.read_frame()
    assert frame.request_id == request_id and frame.command == Command.STREAM
    return time.monotonic(), frame


def data_offsets(frame: Frame) -> list[int]:
    assert frame.kind == Kind.STREAM and frame.status == Status.OK and frame.payload
    return [r.offset for r in decode_batch(frame.payload).records]


def close_fields(frame: Frame) -> dict[str, str]:
    assert frame.kind == Kind.STREAM and frame.status == Status.STREAM_END, frame
    text = frame.payload.decode()
    assert text.startswith("STREAM_CONTROL type=CLOSE "), text
    return dict(tok.split("=", 1) for tok in text.split()[1:])


def frames_until_data(conn: Connection, rid: int, timeout_s: float = 10.0) -> Frame:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, frame = next_frame(conn, rid, timeout_s)
        if frame.payload:
            return frame
    raise AssertionError("no data frame")


def test_push_keepalive_timing_and_no_commit(shared_broker, topic_name):
    with connect(shared_broker) as admin, connect(shared_broker) as conn:
        create_topic(admin, topic_name, partitions=1)
        publish_batch(admin, topic_name, 0, [b"a", b"b", b"c"])
        opened = time.monotonic()
        rid = open_stream(conn, f"STREAM topic={topic_name} partition=0 group=sg member=m batch=2")
        _, first = next_frame(conn, rid)
        _, second = next_frame(conn, rid)
        assert data_offsets(first) == [0, 1] and data_offsets(second) == [2]
        # idle: an empty OK stream frame after the keepalive interval (3 s), never later
        at, keepalive = next_frame(conn, rid)
        assert keepalive.kind == Kind.STREAM and keepalive.status == Status.OK and keepalive.payload == b""
        assert 2.5 <= at - opened <= 3.6, at - opened
        # an append wakes the stream at once (plus at most the 100 ms batching delay)
        sent = time.monotonic()
        publish_batch(admin, topic_name, 0, [b"d"])
        at, frame = next_frame(conn, rid)
        assert data_offsets(frame) == [3] and at - sent < 1.0
        # delivery is not processing: the group's committed offset did not move
        assert error_of(admin.command(f"FETCH_OFFSET topic={topic_name} partition=0 group=sg")).code == \
            "group_not_found"


def test_resume_from_committed_offset_after_reconnect(shared_broker, topic_name):
    group = f"resume-{topic_name}"
    with connect(shared_broker) as admin:
        create_topic(admin, topic_name, partitions=1)
        publish_batch(admin, topic_name, 0, [f"r{i}".encode() for i in range(10)])
        member = ok_fields(admin.command(f"JOIN_GROUP topic={topic_name} group={group} member=s"))["member"]
        with connect(shared_broker) as conn:
            rid = open_stream(conn, f"STREAM topic={topic_name} partition=0 group={group} member={member}")
            assert data_offsets(next_frame(conn, rid)[1]) == list(range(10))  # nothing committed: from the start
        assert ok_fields(admin.command(f"FETCH_OFFSET topic={topic_name} partition=0 group={group}")) == \
            {"offset": "0"}  # STREAM never commits
        ok_fields(admin.command(f"COMMIT_OFFSET topic={topic_name} partition=0 group={group} offset=6 "
                                f"member={member} generation=1"))
        for text, first in ((f"STREAM topic={topic_name} partition=0 group={group} member={member}", 6),
                            (f"STREAM topic={topic_name} partition=0 group={group} offset=2", 6),
                            (f"STREAM topic={topic_name} partition=0 group={group} offset=8", 8),
                            (f"STREAM topic={topic_name} partition=0 offset=1", 1)):
            with connect(shared_broker) as conn:
                rid = open_stream(conn, text)
                assert data_offsets(next_frame(conn, rid)[1])[0] == first, text
        with connect(shared_broker) as conn:
            err = error_of(conn.command(f"STREAM topic={topic_name} partition=0 offset=99"))
            assert err.code == "OFFSET_OUT_OF_RANGE" and err.fields["latest"] == "10"
            assert error_of(conn.command("STREAM topic=no-such-topic partition=0")).code == "topic_not_found"
            assert ok_fields(conn.command("LIST"))  # the connection is still usable after an ERROR


def test_client_data_during_stream_closes_the_connection(shared_broker, topic_name):
    with connect(shared_broker) as admin, connect(shared_broker) as conn:
        create_topic(admin, topic_name, partitions=1)
        publish_batch(admin, topic_name, 0, [b"x"])
        rid = open_stream(conn, f"STREAM topic={topic_name} partition=0")
        assert data_offsets(next_frame(conn, rid)[1]) == [0]
        conn.send(Command.LIST, encode_crq2(parse_command_text("LIST")[1]))
        with pytest.raises((ConnectionClosed, ConnectionError)):
            while True:
                conn.read_frame()


@pytest.fixture
def limited(broker_factory) -> Iterator[object]:
    broker = broker_factory(settings={
        "stream_timeout_ms": 1500, "max_stream_connections": 2, "log_segment_bytes": 4096,
        "log_retention_check_interval_ms": 100,
    }).start()
    yield broker


def test_close_reasons_and_connection_limit(limited, topic_name):
    broker = limited
    with connect(broker) as admin:
        for suffix in ("idle", "gone", "old"):
            create_topic(admin, f"{topic_name}-{suffix}", partitions=1, **(
                {"retention_bytes": 4096} if suffix == "old" else {}))
        publish_batch(admin, f"{topic_name}-gone", 0, [b"g"])

        # timeout: no client activity for stream_timeout_ms
        with connect(broker) as conn:
            opened = time.monotonic()
            rid = open_stream(conn, f"STREAM topic={topic_name}-idle partition=0 group=x member=y")
            at, frame = next_frame(conn, rid)
            assert close_fields(frame) == {"type": "CLOSE", "reason": "timeout", "offset": "0"}
            assert 1.4 <= at - opened <= 3.0
            assert ok_fields(conn.command("LIST"))  # after STREAM_END the connection serves requests again

        # removed: the topic is deleted under the stream
        with connect(broker) as conn:
            rid = open_stream(conn, f"STREAM topic={topic_name}-gone partition=0")
            assert data_offsets(next_frame(conn, rid)[1]) == [0]
            assert ok_fields(admin.command(f"DELETE topic={topic_name}-gone"))["deleted"] == "true"
            assert close_fields(next_frame(conn, rid)[1]) == {"type": "CLOSE", "reason": "removed", "offset": "1"}

        # offset_out_of_range: retention deleted the segments below the requested offset
        old = f"{topic_name}-old"
        for _ in range(12):
            publish_batch(admin, old, 0, [b"z" * 400] * 4)

        def trimmed() -> int:
            text = ok_fields(admin.command(f"LIST_OFFSETS topic={old}"))["offsets"]
            return int(text.split(":")[1].split("=")[1])

        deadline = time.monotonic() + 10
        while trimmed() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        earliest = trimmed()
        assert earliest > 0
        with connect(broker) as conn:
            rid = open_stream(conn, f"STREAM topic={old} partition=0 offset=0")
            fields = close_fields(next_frame(conn, rid)[1])
            assert fields["reason"] == "offset_out_of_range" and fields["offset"] == "0"
            assert fields["requested"] == "0" and int(fields["earliest"]) == earliest and fields["latest"] == "48"

        # max_stream_connections: a third concurrent stream is refused; a closed client frees its slot
        first, second, third = connect(broker), connect(broker), connect(broker)
        try:
            open_stream(first, f"STREAM topic={old} partition=0")
            open_stream(second, f"STREAM topic={old} partition=0")
            for c in (first, second):
                c.sock.settimeout(5)
                c.read_frame()  # both streams are running
            err = error_of(third.command(f"STREAM topic={old} partition=0"))
            assert err.code == "too_many_connections" and err.retryable
            first.close()  # EOF: the broker notices and drops that stream
            deadline = time.monotonic() + 5
            while True:
                rid = open_stream(third, f"STREAM topic={old} partition=0")
                _, frame = next_frame(third, rid)
                if frame.status != Status.ERROR:
                    break
                assert time.monotonic() < deadline, "the closed stream's slot was never freed"
                time.sleep(0.05)
            assert frame.kind == Kind.STREAM

            # stopped: broker shutdown ends open streams with a STREAM_END frame
            assert broker.terminate() == 0
            for c in (second, third):
                c.sock.settimeout(5)
                while True:
                    frame = c.read_frame()
                    if frame.status == Status.STREAM_END:
                        break
                assert close_fields(frame)["reason"] == "stopped"
        finally:
            for c in (first, second, third):
                c.close()
