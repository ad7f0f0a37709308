"""The session's fast path (``SessionProtocol``: small PUBLISH frames served from ``data_received``).

Real broker, raw sockets: a frame split across reads, many frames in one chunk (PUBLISH and other commands
mixed, beyond the in-flight window), a frame that is whole but followed by half of the next, a malformed
frame or an undecodable batch behind served ones (their replies first, then only that connection closes),
a client that does not read its acks (the broker pauses writing: replies stay complete and in order), the
idle deadline pushed back by fast-path requests, and acks=0 (no reply, records stored).
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from cursus.client.connection import ConnectionClosed
from cursus.wire import (
    Batch,
    Command,
    Frame,
    Kind,
    Record,
    Status,
    decode_error,
    encode_batch,
    encode_crq2,
    encode_frame,
    parse_command_text,
)
from tests.integration.conftest import connect
from tests.integration.helpers import consume_all, create_topic

pytestmark = pytest.mark.timeout(90)


def _batch(topic: str, payload: bytes, acks: str = "1") -> bytes:
    return encode_batch(Batch(topic=topic, partition=0, acks=acks,
                              records=[Record(topic=topic, partition=0, payload=payload)]))


def _frames(conn, requests: list[tuple[Command, bytes]]) -> tuple[list[bytes], list[int]]:
    """Encode ``requests`` on ``conn``'s next ids (used up); returns (frames, ids)."""
    first = conn.next_request_id
    frames = [encode_frame(Kind.REQUEST, command, Status.NONE, first + n, payload, compression=conn.compression)
              for n, (command, payload) in enumerate(requests)]
    conn._next_request_id = first + len(requests)
    return frames, [first + n for n in range(len(requests))]


def _text(text: str) -> tuple[Command, bytes]:
    command, payload = parse_command_text(text)
    return command, encode_crq2(payload)


def _read(conn, timeout_s: float = 20.0) -> Frame:
    conn.sock.settimeout(timeout_s)
    return conn.read_frame()


def _last_offset(frame: Frame) -> int:
    assert frame.kind == Kind.RESPONSE and frame.status == Status.OK, frame.payload[:300]
    return int(json.loads(frame.payload)["last_offset"])


def _assert_closed(conn, timeout_s: float = 20.0) -> None:
    conn.sock.settimeout(timeout_s)
    with pytest.raises((ConnectionClosed, ConnectionError)):
        conn.read_frame()


def test_a_frame_split_across_reads_and_a_frame_followed_by_half_of_the_next(shared_broker, topic_name):
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name)
        frames, ids = _frames(conn, [(Command.PUBLISH, _batch(topic_name, b"p%d" % n)) for n in range(4)])
        first = frames[0]
        for cut in (3, 20, 32, 40):  # inside the magic, the header, at its end, inside the payload
            conn.sock.sendall(first[:cut])
            first = first[cut:]
        conn.sock.sendall(first)
        assert _read(conn).request_id == ids[0]
        two = frames[1] + frames[2][:45]  # one whole frame (the fast path), then a partial one (the reader)
        conn.sock.sendall(two)
        conn.sock.sendall(frames[2][45:] + frames[3])
        replies = [_read(conn) for _ in ids[1:]]
        assert [f.request_id for f in replies] == ids[1:]
        assert [_last_offset(f) for f in replies] == [1, 2, 3]
        assert [r.payload for r in consume_all(conn, topic_name, 0)] == [b"p%d" % n for n in range(4)]


def test_many_frames_in_one_chunk_are_answered_in_order(shared_broker, topic_name):
    """More PUBLISH frames than the in-flight window (5), with other commands between them, in one send."""
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name)
        requests = []
        for n in range(60):
            requests.append((Command.PUBLISH, _batch(topic_name, b"m%d" % n)))
            if n % 17 == 16:
                requests.append(_text(f"LIST_OFFSETS topic={topic_name} partition=0"))
        frames, ids = _frames(conn, requests)
        conn.sock.sendall(b"".join(frames))
        replies = [_read(conn) for _ in ids]
        assert [(f.request_id, f.command) for f in replies] == [(i, c) for i, (c, _) in zip(ids, requests, strict=True)]
        offsets = [_last_offset(f) for f in replies if f.command == Command.PUBLISH]
        assert offsets == list(range(60))
        for frame in replies:
            assert frame.status == Status.OK, frame.payload[:300]
        assert [r.payload for r in consume_all(conn, topic_name, 0)] == [b"m%d" % n for n in range(60)]


def test_a_refused_publish_in_a_chunk_gets_its_error_in_its_place(shared_broker, topic_name):
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name)
        requests = [(Command.PUBLISH, _batch(topic_name, b"a")),
                    (Command.PUBLISH, _batch(topic_name + "-missing", b"x")),
                    (Command.PUBLISH, _batch(topic_name, b"b"))]
        frames, ids = _frames(conn, requests)
        conn.sock.sendall(b"".join(frames))
        replies = [_read(conn) for _ in ids]
        assert [f.request_id for f in replies] == ids
        assert _last_offset(replies[0]) == 0 and _last_offset(replies[2]) == 1
        assert replies[1].status == Status.ERROR
        assert decode_error(replies[1].payload).code == "topic_not_found"


@pytest.mark.parametrize("bad", ["crc", "batch"])
def test_a_malformed_frame_closes_only_its_connection_after_earlier_replies(shared_broker, topic_name, bad):
    with connect(shared_broker) as admin, connect(shared_broker) as conn, connect(shared_broker) as other:
        create_topic(admin, topic_name)
        good = _batch(topic_name, b"ok")
        broken = good[:24] if bad == "batch" else good  # CBV2 magic, then a truncated header
        frames, ids = _frames(conn, [(Command.PUBLISH, good), (Command.PUBLISH, good), (Command.PUBLISH, broken)])
        if bad == "crc":
            frames[2] = frames[2][:-1] + bytes([frames[2][-1] ^ 0xFF])
        conn.sock.sendall(b"".join(frames))
        assert [_last_offset(_read(conn)) for _ in ids[:2]] == [0, 1]
        _assert_closed(conn)
        other_frames, other_ids = _frames(other, [(Command.PUBLISH, good)])
        other.sock.sendall(other_frames[0])
        reply = _read(other)
        assert reply.request_id == other_ids[0] and _last_offset(reply) == 2
        assert len(consume_all(admin, topic_name, 0)) == 3


def test_a_client_slow_to_read_its_acks_gets_every_one_in_order(broker_factory):
    """A wide in-flight window and a tiny client receive buffer: the broker's write buffer fills (writing
    pauses, the fast path yields to the general path, which drains); every ack arrives, in order."""
    broker = broker_factory(settings={"max_in_flight_requests_per_connection": 5000}).start()
    topic = "slowreader"
    with connect(broker) as admin:
        create_topic(admin, topic)
    count = 3000
    with connect(broker) as conn:
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        frames, ids = _frames(conn, [(Command.PUBLISH, _batch(topic, b"s%d" % n)) for n in range(count)])
        for start in range(0, count, 500):
            conn.sock.sendall(b"".join(frames[start:start + 500]))
        replies = []
        for _ in ids:
            replies.append(_read(conn))
        assert [f.request_id for f in replies] == ids
        assert [_last_offset(f) for f in replies] == list(range(count))
    with connect(broker) as check:
        assert len(consume_all(check, topic, 0)) == count


def test_fast_path_requests_push_back_the_idle_deadline(broker_factory):
    broker = broker_factory(settings={"client_idle_timeout_ms": 800}).start()
    with connect(broker) as admin:
        create_topic(admin, "idle")
    with connect(broker) as conn:
        frames_sent = 0
        deadline = time.monotonic() + 2.5  # three idle periods of publishes, one at a time
        while time.monotonic() < deadline:
            frames, ids = _frames(conn, [(Command.PUBLISH, _batch("idle", b"i"))])
            conn.sock.sendall(frames[0])
            reply = _read(conn)
            assert reply.request_id == ids[0] and _last_offset(reply) == frames_sent
            frames_sent += 1
            time.sleep(0.05)  # paces the client (well below the idle limit); not a synchronisation
        _assert_closed(conn)  # now idle: closed by the deadline


def test_acks0_publishes_in_one_chunk_get_no_reply_and_are_stored(shared_broker, topic_name):
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name)
        requests = [(Command.PUBLISH, _batch(topic_name, b"z%d" % n, acks="0")) for n in range(10)]
        requests.append(_text(f"LIST_OFFSETS topic={topic_name} partition=0"))
        frames, ids = _frames(conn, requests)
        conn.sock.sendall(b"".join(frames))
        reply = _read(conn)
        assert reply.request_id == ids[-1] and reply.status == Status.OK
        deadline = time.monotonic() + 20
        while len(consume_all(conn, topic_name, 0)) < 10:  # acks=0: stored once written
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert [r.payload for r in consume_all(conn, topic_name, 0)] == [b"z%d" % n for n in range(10)]
