"""Sessions that keep the event loop free: early magic check, acks=0 back-pressure, large replies."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from pathlib import Path

import pytest

from cursus.wire import Batch, Command, Compression, Kind, Record, Status, encode_batch, encode_frame
from tests.integration.conftest import connect
from tests.integration.helpers import create_topic, ok_fields

pytestmark = pytest.mark.timeout(60)


def _metric(broker, name: str, labels: str = "") -> float:
    _, body = broker.http_get("/metrics", port=broker.metrics_port)
    pattern = rf"^{re.escape(name)}{re.escape(labels)} (\S+)$"
    match = re.search(pattern, body.decode(), re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@pytest.mark.parametrize("opening", [b"XXXX", b"CRS1\x00\x01", b"GET / HTTP/1.0\r\n\r\n"])
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
