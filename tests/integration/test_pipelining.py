"""Pipelined requests on one connection (facts B1.4, ``max_in_flight_requests_per_connection``).

Requests are written back to back on one raw socket before any reply is read: the replies come in request
order with the right request ids, PUBLISH batches of one partition are appended in arrival order, any other
command answers after (and sees) the PUBLISH requests before it, a bad-argument request gets its typed error
in its place, and a malformed frame behind pipelined requests closes the connection only after their replies.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from cursus.client.connection import Connection, ConnectionClosed
from cursus.wire import (
    Batch,
    Command,
    Frame,
    Kind,
    Record,
    Status,
    decode_batch,
    decode_error,
    encode_batch,
    encode_crq2,
    encode_frame,
    parse_command_text,
)
from tests.integration.conftest import connect
from tests.integration.helpers import consume_all, create_topic

pytestmark = pytest.mark.timeout(60)


def _batch(topic: str, partition: int, payloads: list[bytes], acks: str = "1", *,
           producer: tuple[str, int, int] | None = None) -> bytes:
    records = []
    for i, payload in enumerate(payloads):
        rec = Record(topic=topic, partition=partition, payload=payload)
        if producer is not None:
            rec.producer_id, rec.producer_epoch, rec.seq_num = producer[0], producer[1], producer[2] + i
        records.append(rec)
    return encode_batch(Batch(topic=topic, partition=partition, acks=acks, records=records,
                              idempotent=producer is not None))


def _text(text: str) -> tuple[Command, bytes]:
    command, payload = parse_command_text(text)
    return command, encode_crq2(payload)


def _send_all(conn, requests: list[tuple[Command, bytes]], tail: bytes = b"") -> list[tuple[int, Command]]:
    """Write every request (and ``tail``) with one ``sendall``, reading nothing; returns (id, command)s."""
    ids = []
    frames = []
    first = conn.next_request_id
    for n, (command, payload) in enumerate(requests):
        frames.append(encode_frame(Kind.REQUEST, command, Status.NONE, first + n, payload,
                                   compression=conn.compression))
        ids.append((first + n, command))
    conn._next_request_id = first + len(requests)  # the raw frames used these ids
    conn.sock.sendall(b"".join(frames) + tail)
    return ids


def _ack(frame: Frame) -> dict:
    assert frame.kind == Kind.RESPONSE and frame.status == Status.OK, frame.payload[:300]
    return json.loads(frame.payload)


def _read(conn, timeout_s: float = 10.0) -> Frame:
    conn.sock.settimeout(timeout_s)
    return conn.read_frame()


def test_pipelined_mixed_requests_are_answered_in_request_order(shared_broker, topic_name):
    with connect(shared_broker) as admin, connect(shared_broker) as conn:
        create_topic(admin, topic_name, partitions=2)
        requests = [
            (Command.PUBLISH, _batch(topic_name, 0, [b"a0", b"a1"])),
            (Command.PUBLISH, _batch(topic_name, 0, [b"b0"])),
            (Command.PUBLISH, _batch(topic_name, 1, [b"c0", b"c1", b"c2"])),
            (Command.PUBLISH, _batch(topic_name, 0, [b"d0"], acks="all")),
            (Command.PUBLISH, _batch(topic_name, 0, [b"x"], acks="0")),  # no reply at all
            (Command.PUBLISH, _batch(topic_name, 5, [b"e0"])),  # no partition 5: a typed error in its place
            (Command.PUBLISH, _batch(topic_name, 0, [b"f0", b"f1"])),
            _text(f"CONSUME topic={topic_name} partition=0 offset=0"),  # sees every PUBLISH before it
            _text(f"PUBLISH topic={topic_name} partition=0"),  # bad arguments (no message=)
            _text(f"PUBLISH topic={topic_name} partition=1 producerId=p acks=1 message=g0"),
            _text(f"FETCH_OFFSET topic={topic_name} partition=0 group=nobody"),
        ] + [(Command.PUBLISH, _batch(topic_name, 1, [b"h%d" % i])) for i in range(8)] + [
            _text(f"STREAM topic={topic_name} partition=1 group=pg member=m1 batch=100"),
        ]
        sent = _send_all(conn, requests)
        expected = [entry for n, entry in enumerate(sent) if n != 4]  # the acks=0 PUBLISH answers nothing
        frames = []
        for request_id, command in expected[:-1]:
            frame = _read(conn)
            assert (frame.request_id, frame.command) == (request_id, command), (frame, request_id, command)
            frames.append(frame)
        assert _ack(frames[0])["last_offset"] == 1
        assert _ack(frames[1])["last_offset"] == 2
        assert _ack(frames[2])["last_offset"] == 2
        assert _ack(frames[3])["last_offset"] == 3
        assert frames[4].status == Status.ERROR and decode_error(frames[4].payload).code
        assert _ack(frames[5])["last_offset"] == 6  # after the acks=0 record (offset 4)
        consumed = decode_batch(frames[6].payload).records
        assert [r.payload for r in consumed] == [b"a0", b"a1", b"b0", b"d0", b"x", b"f0", b"f1"]
        assert [r.offset for r in consumed] == list(range(7))
        assert frames[7].status == Status.ERROR and decode_error(frames[7].payload).code.startswith("missing_")
        assert frames[8].status == Status.OK
        assert frames[9].status in (Status.OK, Status.ERROR)  # a barrier answered in its place
        assert [_ack(f)["last_offset"] for f in frames[10:]] == list(range(4, 12))
        # the STREAM (multi-frame, kind 5) starts only after every earlier reply
        stream_id = expected[-1][0]
        seen: list[bytes] = []
        deadline = time.monotonic() + 10
        while len(seen) < 12:
            assert time.monotonic() < deadline, seen
            frame = _read(conn)
            assert (frame.kind, frame.request_id, frame.command) == (Kind.STREAM, stream_id, Command.STREAM)
            if frame.payload:
                seen.extend(r.payload for r in decode_batch(frame.payload).records)
        assert seen == [b"c0", b"c1", b"c2", b"g0"] + [b"h%d" % i for i in range(8)]


def test_pipelined_batches_of_one_partition_keep_arrival_order(shared_broker, topic_name):
    """Many pipelined batches (more than the in-flight bound) to one partition: acks in request order with
    contiguous offsets, and the log holds them in arrival order."""
    count = 40
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name, partitions=1)
        sent = _send_all(conn, [(Command.PUBLISH, _batch(topic_name, 0, [b"%d-%d" % (n, i) for i in range(n % 3 + 1)]))
                                for n in range(count)])
        last = -1
        for n, (request_id, command) in enumerate(sent):
            frame = _read(conn)
            assert (frame.request_id, frame.command) == (request_id, command)
            offset = _ack(frame)["last_offset"]
            assert offset == last + n % 3 + 1
            last = offset
        records = consume_all(conn, topic_name, 0)
        assert [r.payload for r in records] == [b"%d-%d" % (n, i) for n in range(count) for i in range(n % 3 + 1)]


def test_pipelined_idempotent_batches_chain_their_sequences(shared_broker, topic_name):
    """An idempotent producer's pipelined batches are accepted in order; a pipelined retry of one of them
    is answered as a duplicate with its original offsets, and a gap is refused in its place."""
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name, partitions=1)
        pid = f"pipe-{topic_name}"[:60]
        batches = [_batch(topic_name, 0, [b"r%d" % (3 * n + i) for i in range(3)], acks="all",
                          producer=(pid, 0, 1 + 3 * n)) for n in range(6)]
        gap = _batch(topic_name, 0, [b"gap"], acks="all", producer=(pid, 0, 100))
        sent = _send_all(conn, [(Command.PUBLISH, b) for b in batches] + [(Command.PUBLISH, batches[2]),
                                                                         (Command.PUBLISH, gap)])
        frames = [_read(conn) for _ in sent]
        assert [f.request_id for f in frames] == [rid for rid, _ in sent]
        acks = [_ack(f) for f in frames[:7]]
        assert [a["last_offset"] for a in acks[:6]] == [2, 5, 8, 11, 14, 17]
        assert [(a["seq_start"], a["seq_end"]) for a in acks[:6]] == [(1 + 3 * n, 3 + 3 * n) for n in range(6)]
        assert acks[6]["last_offset"] == 8  # the duplicate: the original's offsets
        assert frames[7].status == Status.ERROR
        assert decode_error(frames[7].payload).code == "idempotency_gap"
        assert [r.payload for r in consume_all(conn, topic_name, 0)] == [b"r%d" % n for n in range(18)]


def test_malformed_frame_after_pipelined_requests_closes_after_their_replies(broker_factory):
    broker = broker_factory().start()
    with connect(broker) as conn:
        create_topic(conn, "mal", partitions=1)
        requests = [(Command.PUBLISH, _batch("mal", 0, [b"m%d" % n])) for n in range(6)]
        requests.insert(3, _text("LIST"))
        sent = _send_all(conn, requests, tail=b"XXXX" + b"\x00" * 28)  # a header with a bad magic
        for request_id, command in sent:
            frame = _read(conn)
            assert (frame.request_id, frame.command, frame.status) == (request_id, command, Status.OK)
        with pytest.raises((ConnectionClosed, ConnectionResetError)):
            _read(conn)
    with connect(broker) as conn:  # the broker serves others, and kept every acknowledged record
        assert [r.payload for r in consume_all(conn, "mal", 0)] == [b"m%d" % n for n in range(6)]


def test_one_in_flight_request_per_connection_still_serves_pipelined_clients(broker_factory):
    """``max_in_flight_requests_per_connection=1``: the broker reads one request at a time again, with
    the same replies."""
    broker = broker_factory(settings={"max_in_flight_requests_per_connection": 1}).start()
    with connect(broker) as conn:
        create_topic(conn, "one", partitions=1)
        sent = _send_all(conn, [(Command.PUBLISH, _batch("one", 0, [b"o%d" % n])) for n in range(10)])
        assert [_ack(_read(conn))["last_offset"] for _ in sent] == list(range(10))


def test_client_gone_with_replies_pending_leaves_the_broker_serving(broker_factory):
    """A client that writes pipelined PUBLISH requests and resets the connection at once: the appends
    still complete, and the broker serves the next client."""
    broker = broker_factory().start()
    with connect(broker) as conn:
        create_topic(conn, "gone", partitions=1)
    for _ in range(5):
        conn = connect(broker)
        _send_all(conn, [(Command.PUBLISH, _batch("gone", 0, [b"g"] * 50)) for _ in range(20)])
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        conn.sock.close()
    with connect(broker) as conn:
        assert conn.command("LIST").status == Status.OK
        # the records of requests the broker had read are appended whole (or not read at all): never torn
        assert len(consume_all(conn, "gone", 0)) % 50 == 0


FSYNC_DELAY_MS = 200


@pytest.mark.parametrize("in_flight", [5, 1])
def test_pipelined_publishes_share_fsyncs_up_to_the_in_flight_bound(broker_factory, in_flight):
    """With every fsync taking 200 ms, 10 pipelined acks=1 PUBLISH requests to one partition are durable in
    far fewer than 10 fsyncs when 5 may wait at once (each fsync covers what arrived meanwhile); with one at
    a time they take at least 10 fsyncs, as before pipelining."""
    broker = broker_factory(env={"CURSUS_STORAGE_FAULTS": f"fsync_delay_ms={FSYNC_DELAY_MS}"},
                            settings={"max_in_flight_requests_per_connection": in_flight}).start()
    count = 10
    with connect(broker, timeout_s=30) as conn:
        create_topic(conn, "slow", partitions=1)
        started = time.monotonic()
        sent = _send_all(conn, [(Command.PUBLISH, _batch("slow", 0, [b"s%d" % n])) for n in range(count)])
        assert [_ack(_read(conn, 30))["last_offset"] for _ in sent] == list(range(count))
        elapsed = time.monotonic() - started
    if in_flight == 1:
        assert elapsed >= count * FSYNC_DELAY_MS / 1000
    else:
        assert elapsed < count * FSYNC_DELAY_MS / 1000 * 0.75, elapsed  # ideal: about 3 fsyncs


def test_fsync_failure_behind_pipelined_requests_fails_every_later_one(broker_factory, tmp_path):
    """A failed fsync under pipelined PUBLISH requests: no false ack for any record it did not make durable,
    each request gets its typed error in its place, and the connection stays usable."""
    trigger = tmp_path / "fail-fsync"
    broker = broker_factory(env={"CURSUS_STORAGE_FAULTS": f"fsync_fail_file={trigger}"}).start()
    with connect(broker) as conn:
        create_topic(conn, "pfail", partitions=1)
        assert _ack(conn.request(Command.PUBLISH, _batch("pfail", 0, [b"durable"])))["last_offset"] == 0
        trigger.touch()
        sent = _send_all(conn, [(Command.PUBLISH, _batch("pfail", 0, [b"lost%d" % n])) for n in range(8)]
                         + [_text("LIST")])
        frames = [_read(conn) for _ in sent]
        assert [(f.request_id, f.command) for f in frames] == sent
        for frame in frames[:-1]:
            assert frame.status == Status.ERROR, frame.payload[:200]
            assert decode_error(frame.payload).code == "storage_unavailable"
        assert frames[-1].status == Status.OK
        trigger.unlink()
        assert [r.payload for r in consume_all(conn, "pfail", 0)] == [b"durable"]


def test_auth_is_a_barrier_between_pipelined_publishes(broker_factory):
    """With enable_sasl: PUBLISH before AUTH is refused, AUTH (a connection-state change) answers after the
    PUBLISH before it, and the PUBLISH after it runs as the signed-in principal, all written back to back."""
    broker = broker_factory(settings={"enable_sasl": "true", "auth_failure_delay_ms": 0},
                            env={"SASL_USERS": "root:tok-root-pipe:*,writer:tok-writer-pipe:topic.write"}).start()
    host, port = broker.address
    with Connection(host, port, principal="root", token="tok-root-pipe") as admin:
        create_topic(admin, "sasl", partitions=1)
    with connect(broker) as conn:
        sent = _send_all(conn, [
            (Command.PUBLISH, _batch("sasl", 0, [b"anonymous"])),
            _text("AUTH principal=writer token=tok-writer-pipe"),
            (Command.PUBLISH, _batch("sasl", 0, [b"w0"])),
            (Command.PUBLISH, _batch("sasl", 0, [b"w1"])),
        ])
        frames = [_read(conn) for _ in sent]
        assert [(f.request_id, f.command) for f in frames] == sent
        assert frames[0].status == Status.ERROR
        assert decode_error(frames[0].payload).code == "authentication_required"
        assert frames[1].status == Status.OK
        assert [_ack(f)["last_offset"] for f in frames[2:]] == [0, 1]
