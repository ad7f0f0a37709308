"""Sessions that keep the event loop free: early magic check, acks=0 back-pressure, large replies."""

from __future__ import annotations

import re
import socket
import time

import pytest

from tests.integration.conftest import connect

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
