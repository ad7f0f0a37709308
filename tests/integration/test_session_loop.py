"""Sessions that keep the event loop free: early magic check, acks=0 back-pressure, large replies."""

from __future__ import annotations

import os
import re
import socket
import ssl
import threading
import time
from pathlib import Path

import pytest

from cursus.wire import (
    Batch,
    Command,
    CommandPayload,
    Compression,
    Kind,
    NegotiationRequest,
    Record,
    Status,
    decode_batch,
    encode_batch,
    encode_crq2,
    encode_frame,
    encode_negotiation_request,
    parse_command_text,
)
from tests.certs import make_pki
from tests.integration.conftest import connect
from tests.integration.helpers import ack_of, consume, create_topic, error_of, ok_fields, publish_batch

pytestmark = pytest.mark.timeout(60)


def _metric(broker, name: str, labels: str = "") -> float:
    _, body = broker.http_get("/metrics", port=broker.metrics_port)
    pattern = rf"^{re.escape(name)}{re.escape(labels)} (\S+)$"
    match = re.search(pattern, body.decode(), re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@pytest.mark.parametrize("opening", [b"XXXX", b"CRS1\x00\x01", b"GET / HTTP/1.0\r\n\r\n", b"X", b"\x00",
                                     b"CRS2\x00\x03", b"CRS2\x00\x02\x09"])
def test_short_non_wire_v2_opening_is_closed_at_once(broker_factory, opening):
    broker = broker_factory(settings={"exporter_port": 0}).start()
    before = _metric(broker, "cursus_wire_protocol_failures_total", '{reason="invalid_frame"}')
    with socket.create_connection(broker.address, timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(opening)
        assert sock.recv(1) == b""  # EOF: the broker closed without waiting for 32 bytes (or 30 s)
        assert time.monotonic() - started < 2
    deadline = time.monotonic() + 5
    while _metric(broker, "cursus_wire_protocol_failures_total", '{reason="invalid_frame"}') <= before:
        assert time.monotonic() < deadline, "the bad opening was not counted as a protocol failure"
        time.sleep(0.02)
    with connect(broker) as conn:  # the broker serves others as before
        assert conn.command("LIST").status.name == "OK"


def test_a_partial_header_after_negotiation_is_timed_out(broker_factory):
    """A header whose first bytes arrived must be complete within client_request_timeout_ms (a stalled
    partial header never pins a connection slot), even though the broker waits for the next request
    indefinitely by default."""
    broker = broker_factory(settings={"client_request_timeout_ms": 800}).start()
    offer = NegotiationRequest(2, 2, (Compression.NONE,))
    with socket.create_connection(broker.address, timeout=10) as sock:
        sock.sendall(encode_frame(Kind.NEGOTIATION_REQUEST, Command.NEGOTIATE, Status.NONE, 0,
                                  encode_negotiation_request(offer), compression=None))
        assert len(sock.recv(64)) >= 32  # the negotiation response
        time.sleep(1.2)  # longer than the request timeout with nothing sent: an idle client stays
        started = time.monotonic()
        sock.sendall(b"CRS2\x00\x02\x03")  # 7 of 32 header bytes, then silence
        assert sock.recv(1) == b""
        assert 0.5 < time.monotonic() - started < 5


FLOOD_BUDGET_BYTES = 128 * 1024 * 1024  # the smallest max_inflight_request_bytes
FLOOD_CONNECTIONS = 8
FLOOD_BATCHES = int(os.environ.get("CURSUS_TEST_FLOOD_BATCHES", "40"))  # per connection, 1 MiB each
FLOOD_RECORDS = 16
#: RSS the broker may add on top of its queued bytes (budget) during the flood: in-flight copies of the
#: requests being decoded and handled, allocator slack.
FLOOD_ALLOWANCE_BYTES = 80 * 1024 * 1024


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_acks0_flood_is_bounded_by_the_byte_budget(broker_factory):
    # A slow disk (every fsync takes 250 ms): without back-pressure the writer queue grows without bound.
    broker = broker_factory(settings={"max_inflight_request_bytes": FLOOD_BUDGET_BYTES, "exporter_port": 0},
                            env={"CURSUS_STORAGE_FAULTS": "fsync_delay_ms=250"}).start()
    assert broker.proc is not None
    with connect(broker) as conn:
        create_topic(conn, "flood", partitions=2)
    records = [os.urandom(64 * 1024 - 64) for _ in range(FLOOD_RECORDS)]
    frames = {p: encode_frame(Kind.REQUEST, Command.PUBLISH, Status.NONE, 1,
                              encode_batch(Batch(topic="flood", partition=p, acks="0",
                                                 records=[Record(topic="flood", partition=p, payload=r)
                                                          for r in records])),
                              compression=Compression.NONE) for p in (0, 1)}
    baseline = _rss_bytes(broker.proc.pid)
    flooders = [connect(broker, timeout_s=60) for _ in range(FLOOD_CONNECTIONS)]
    errors: list[BaseException] = []

    def flood(conn, partition: int) -> None:
        try:
            for _ in range(FLOOD_BATCHES):
                conn.sock.sendall(frames[partition])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=flood, args=(c, i % 2)) for i, c in enumerate(flooders)]
    for t in threads:
        t.start()
    peak = baseline
    while any(t.is_alive() for t in threads):
        peak = max(peak, _rss_bytes(broker.proc.pid))
        time.sleep(0.01)  # sampling interval, not synchronisation
    assert not errors, errors
    expected = FLOOD_CONNECTIONS * FLOOD_BATCHES * FLOOD_RECORDS // 2
    with connect(broker, timeout_s=60) as conn:  # once the flood drains, every record is stored once
        deadline = time.monotonic() + 30
        while True:
            peak = max(peak, _rss_bytes(broker.proc.pid))
            offsets = ok_fields(conn.command("LIST_OFFSETS topic=flood"))["offsets"]
            ends = [int(m) for m in re.findall(r":hwm=(\d+)", offsets)]
            if ends == [expected, expected]:
                break
            assert time.monotonic() < deadline, offsets
            time.sleep(0.05)
        assert re.findall(r":leo=(\d+)", offsets) == [str(expected)] * 2
    for c in flooders:
        c.close()
    growth = peak - baseline
    assert growth < FLOOD_BUDGET_BYTES + FLOOD_ALLOWANCE_BYTES, f"broker RSS grew by {growth >> 20} MiB"


def _consume(conn, topic: str, offset: int, max_bytes: int) -> list[bytes]:
    return [r.payload for r in consume(conn, topic, 0, offset, batch=100000, max_bytes=max_bytes)]


@pytest.mark.parametrize("compression", ["gzip", "snappy", "lz4"])
def test_large_compressed_frames_round_trip_through_the_offload_threads(shared_broker, topic_name, compression):
    records = [os.urandom(300_000) for _ in range(3)] + [b"c" * 500_000]  # 1.4 MB: above the 256 KiB threshold
    with connect(shared_broker, compression=compression, timeout_s=30) as conn:
        assert conn.compression == Compression[compression.upper()]
        create_topic(conn, topic_name)
        ack_of(publish_batch(conn, topic_name, 0, records))  # decompressed off the loop
        ack_of(publish_batch(conn, topic_name, 0, [b"small"]))  # inline
        assert _consume(conn, topic_name, 0, 4 << 20) == [*records, b"small"]  # read, compressed off the loop
        assert _consume(conn, topic_name, 4, 1000) == [b"small"]  # inline
        command, payload = parse_command_text(f"STREAM topic={topic_name} partition=0 offset=0 batch=100000")
        received: list[bytes] = []
        for frame in conn.stream(command, encode_crq2(payload)):
            if frame.payload:
                received += [r.payload for r in decode_batch(frame.payload).records]
            if len(received) >= len(records) + 1:
                break
        assert received == [*records, b"small"]


def test_small_requests_are_served_while_a_large_gzip_reply_is_compressed(broker_factory):
    # gzip of 32 MB of random bytes takes about a second of CPU: on the loop, every other client waits for
    # nearly the whole CONSUME. Off the loop, a small request waits a small fraction of it (the bound is
    # relative, so a loaded machine slows both sides alike).
    broker = broker_factory(settings={"consume_max_bytes_limit": 32 << 20}).start()
    with connect(broker, timeout_s=30) as conn:
        create_topic(conn, "big")
        for _ in range(32):
            ack_of(publish_batch(conn, "big", 0, [os.urandom(250_000) for _ in range(4)]))
    done = threading.Event()
    results: list[tuple[int, float]] = []

    def consume() -> None:
        try:
            with connect(broker, compression="gzip", timeout_s=60) as reader:
                started = time.monotonic()
                count = len(_consume(reader, "big", 0, 32 << 20))
                results.append((count, time.monotonic() - started))
        finally:
            done.set()

    with connect(broker, timeout_s=30) as probe:
        probe.command("LIST")
        worker = threading.Thread(target=consume)
        worker.start()
        worst = 0.0
        while not done.is_set():
            started = time.monotonic()
            assert probe.command("LIST_OFFSETS topic=big partition=0").status == Status.OK
            worst = max(worst, time.monotonic() - started)
        worker.join(30)
    [(count, consume_s)] = results
    assert count == 128
    assert worst < consume_s / 3, f"a small request waited {worst:.3f} s during a {consume_s:.3f} s gzip CONSUME"


def test_large_replies_written_as_parts_arrive_whole_over_tls(broker_factory, tmp_path):
    pki = make_pki(tmp_path / "pki")
    broker = broker_factory(settings={"use_tls": "true", "tls_cert_path": pki.server_cert,
                                      "tls_key_path": pki.server_key}).start()
    context = ssl.create_default_context(cafile=str(pki.ca))
    records = [os.urandom(700_000) for _ in range(3)]
    for compression in ("none", "lz4"):
        with connect(broker, ssl_context=context, compression=compression, timeout_s=30) as conn:
            if compression == "none":
                create_topic(conn, "tls-big")
                ack_of(publish_batch(conn, "tls-big", 0, records))
            assert _consume(conn, "tls-big", 0, 4 << 20) == records


def test_large_command_payloads_are_decoded_off_the_loop(shared_broker, topic_name):
    message = "m\u00e9" * 200_000  # 600 KB of CRQ2 text: above the offload threshold
    with connect(shared_broker, timeout_s=30) as conn:
        create_topic(conn, topic_name)
        payload = CommandPayload((), {"topic": topic_name, "producerId": "p", "message": message})
        ack_of(conn.request(Command.PUBLISH, encode_crq2(payload)))
        assert _consume(conn, topic_name, 0, 1 << 20) == [message.encode()]
        raw = bytearray(encode_crq2(CommandPayload((), {"topic": topic_name, "message": message})))
        raw[-1] = 0xFF  # invalid UTF-8 in a large payload: still a typed error, the connection stays usable
        assert error_of(conn.request(Command.PUBLISH, bytes(raw))).code == "invalid_payload"
        assert ok_fields(conn.command("LIST"))["count"]
