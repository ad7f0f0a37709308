"""Work kept off the event loop: the offload pool, the stall probe, frames as parts, reads beside close."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Gauge, Histogram

from cursus.broker.offload import Offload, StallProbe
from cursus.broker.session import _StreamSink
from cursus.storage import PartitionLog
from cursus.storage.segment import Segment
from cursus.wire import Command, Compression, FrameDecoder, Kind, Status, encode_frame, encode_frame_parts
from cursus.wire.errors import LocalProtocolError
from tests.unit.test_storage_support import append_records, small_config, split_section


async def test_offload_runs_small_work_inline_and_large_work_on_its_threads():
    offload = Offload(threshold_bytes=1000, threads=1)
    try:
        here = threading.get_ident()
        assert await offload.run(999, threading.get_ident) == here
        assert await offload.run(1000, threading.get_ident) != here

        def fail() -> None:
            raise ValueError("boom")

        with pytest.raises(ValueError, match="boom"):
            await offload.run(5000, fail)
    finally:
        offload.close()


async def test_stall_probe_records_how_late_the_loop_woke():
    registry = CollectorRegistry()
    gauge = Gauge("stall_max", "", registry=registry)
    histogram = Histogram("stall", "", registry=registry, buckets=(0.05, 1))
    probe = StallProbe(0.001, gauge, histogram)
    probe.start()
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while registry.get_sample_value("stall_count") in (None, 0.0):  # the probe is running
            assert loop.time() < deadline
            await asyncio.sleep(0.001)
        blocked = threading.Event()
        blocked.wait(0.15)  # block the loop itself for 150 ms, as a slow callback would
        while probe.max_stall_s < 0.1:
            assert loop.time() < deadline, probe.max_stall_s
            await asyncio.sleep(0.001)
    finally:
        await probe.stop()
    assert registry.get_sample_value("stall_max") == probe.max_stall_s
    assert registry.get_sample_value("stall_bucket", {"le": "0.05"}) < registry.get_sample_value("stall_count")


_parts = st.lists(st.binary(max_size=300), max_size=6).map(
    lambda items: [memoryview(item) if i % 2 else item for i, item in enumerate(items)])


@given(parts=_parts, compression=st.sampled_from(list(Compression)), request_id=st.integers(1, 2**64 - 1))
def test_frame_parts_equal_the_joined_frame_and_decode(parts, compression, request_id):
    joined = b"".join(parts)
    frame = encode_frame_parts(Kind.RESPONSE, Command.CONSUME, Status.OK, request_id, parts,
                               compression=compression)
    assert b"".join(frame) == encode_frame(Kind.RESPONSE, Command.CONSUME, Status.OK, request_id, joined,
                                           compression=compression)
    decoder = FrameDecoder(negotiated=compression)
    for part in frame:
        decoder.feed(bytes(part))
    decoded = decoder.next_frame()
    assert decoded is not None and decoded.payload == joined and decoded.request_id == request_id


def test_uncompressed_frame_parts_are_not_copied():
    body = bytes(100_000)
    view = memoryview(body)[10:]
    frame = encode_frame_parts(Kind.STREAM, Command.STREAM, Status.OK, 7, [b"head", view],
                               compression=Compression.NONE)
    assert frame[1] == b"head" and frame[2] is view


def test_frame_parts_refuse_more_than_the_frame_limit():
    big = memoryview(bytes(33 * 1024 * 1024))
    with pytest.raises(LocalProtocolError) as error:
        encode_frame_parts(Kind.RESPONSE, Command.CONSUME, Status.OK, 1, [big, big], compression=Compression.NONE)
    assert error.value.reason == "frame_too_large"


def test_a_read_pinned_on_another_thread_survives_the_log_closing(tmp_path: Path, monkeypatch):
    """A large CONSUME reads on an offload thread; the writer thread may close the log meanwhile (DELETE,
    shutdown). The segment's descriptor must stay open until the reader leaves it (no read of a closed or
    reused descriptor)."""
    log = PartitionLog.open(tmp_path / "p", small_config())
    records = append_records(log, [5, 5])
    log.flush()
    inside, proceed = threading.Event(), threading.Event()
    real_read = Segment.read

    def slow_read(segment: Segment, position: int, length: int) -> bytes:
        if threading.current_thread().name == "reader":
            inside.set()
            assert proceed.wait(10)
        return real_read(segment, position, length)

    monkeypatch.setattr(Segment, "read", slow_read)
    result: list[object] = []
    reader = threading.Thread(name="reader", target=lambda: result.append(
        log.read(0, max_offset=10, max_records=100, max_bytes=1 << 20)))
    reader.start()
    assert inside.wait(10)
    segment = log._segments[0]
    log.close()
    assert segment.fd >= 0, "the log closed a segment a reader had pinned"
    proceed.set()
    reader.join(10)
    assert split_section(result[0].records) == records  # type: ignore[attr-defined]
    assert segment.fd == -1, "the last reader leaving closes the segment"


class _Writer:
    """Records what a STREAM sink writes (stands in for the connection's asyncio StreamWriter)."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.frames.append(bytes(data))

    def writelines(self, parts: list[bytes | memoryview]) -> None:
        self.frames.append(b"".join(parts))

    def is_closing(self) -> bool:
        return False

    async def drain(self) -> None:
        return None


async def test_a_stream_stopped_while_a_large_frame_is_encoded_sends_nothing_after_its_end():
    offload = Offload(threshold_bytes=0, threads=1)
    writer = _Writer()
    session = SimpleNamespace(writer=writer, broker=SimpleNamespace(offload=offload), compression=Compression.GZIP)
    sink = _StreamSink(session, Command.STREAM, 9)  # type: ignore[arg-type]
    try:
        sending = asyncio.ensure_future(sink.send(Status.OK, bytes(1 << 20)))
        await asyncio.sleep(0)  # the data frame is being compressed on the offload thread
        sink.send_now(Status.STREAM_END, b"STREAM_CONTROL type=CLOSE reason=stopped offset=0")
        await sending
    finally:
        offload.close()
    decoder = FrameDecoder(negotiated=Compression.GZIP)
    for frame in writer.frames:
        decoder.feed(frame)
    statuses = []
    while (decoded := decoder.next_frame()) is not None:
        statuses.append(decoded.status)
    assert statuses == [Status.STREAM_END]
