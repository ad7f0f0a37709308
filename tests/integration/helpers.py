"""Small helpers for reading broker replies in tests."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TypeVar

from cursus.client.connection import Connection
from cursus.client.consumer import Consumer
from cursus.wire import Batch, Frame, Record, Status, TypedError, decode_batch, decode_error, encode_batch

T = TypeVar("T")


def ok_fields(frame: Frame) -> dict[str, str]:
    """Parse an ``OK k=v ...`` reply; fails the test on ERROR."""
    assert frame.status == Status.OK, render(frame)
    text = frame.payload.decode("utf-8")
    assert text == "OK" or text.startswith("OK "), text
    fields = {}
    for token in text.split()[1:]:
        key, _, value = token.partition("=")
        fields[key] = value
    return fields


def error_of(frame: Frame) -> TypedError:
    assert frame.status == Status.ERROR, frame.payload[:200]
    return decode_error(frame.payload)


def render(frame: Frame) -> str:
    if frame.status == Status.ERROR:
        return decode_error(frame.payload).render()
    return frame.payload[:300].decode("utf-8", "replace")


def create_topic(conn: Connection, topic: str, partitions: int = 1, **fields: str) -> dict[str, str]:
    args = " ".join(f"{k}={v}" for k, v in fields.items())
    return ok_fields(conn.command(f"CREATE topic={topic} partitions={partitions} {args}".strip()))


def publish_batch(conn: Connection, topic: str, partition: int, payloads: list[bytes], *, acks: str = "1",
                  producer: tuple[str, int, int] | None = None, idempotent: bool = False,
                  keys: list[str] | None = None) -> Frame:
    """Publish one CBV2 batch; ``producer`` = (id, epoch, first seq)."""
    records = []
    for i, payload in enumerate(payloads):
        rec = Record(topic=topic, partition=partition, payload=payload)
        if producer is not None:
            rec.producer_id, rec.producer_epoch, rec.seq_num = producer[0], producer[1], producer[2] + i
        if keys is not None:
            rec.key = keys[i]
        records.append(rec)
    from cursus.wire import Command

    batch = Batch(topic=topic, partition=partition, acks=acks, records=records, idempotent=idempotent)
    if acks in ("0", "none"):
        conn.send(Command.PUBLISH, encode_batch(batch))
        return None  # type: ignore[return-value]
    return conn.request(Command.PUBLISH, encode_batch(batch))


def ack_of(frame: Frame) -> dict[str, object]:
    assert frame.status == Status.OK, render(frame)
    doc = json.loads(frame.payload)
    assert doc["status"] == "OK", doc
    return doc


def consume(conn: Connection, topic: str, partition: int, offset: int, **fields: object) -> list[Record]:
    extra = " ".join(f"{k}={v}" for k, v in fields.items())
    frame = conn.command(f"CONSUME topic={topic} partition={partition} offset={offset} {extra}".strip())
    assert frame.status == Status.OK, render(frame)
    if not frame.payload:
        return []
    return decode_batch(frame.payload).records


def consume_all(conn: Connection, topic: str, partition: int, start: int = 0) -> list[Record]:
    """Read a partition from ``start`` to its HWM."""
    out: list[Record] = []
    offset = start
    while True:
        records = consume(conn, topic, partition, offset)
        if not records:
            return out
        out.extend(records)
        offset = records[-1].offset + 1


def wait_for(predicate: Callable[[], T], timeout_s: float = 10.0, what: str = "condition", interval_s: float = 0.05) -> T:
    """Poll ``predicate`` every ``interval_s`` until it returns something truthy, and return that; raise
    ``AssertionError`` naming ``what`` after ``timeout_s`` seconds. Exceptions from ``predicate`` propagate."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval_s)


def sdk_address(broker) -> str:
    """``host:port`` of ``broker``: the SDK's bootstrap form."""
    host, port = broker.address
    return f"{host}:{port}"


def read_values(broker, topic: str, expected: int, timeout_s: float = 20.0) -> list[bytes]:
    """The values of ``topic`` from the earliest offset, read with the SDK :class:`Consumer`: polled until
    ``expected`` arrived or ``timeout_s`` passed, then once more, so that a duplicate would show."""
    got: list[bytes] = []
    with Consumer(topic, sdk_address(broker), wait_ms=50, start="earliest") as consumer:
        deadline = time.monotonic() + timeout_s
        while len(got) < expected and time.monotonic() < deadline:
            got.extend(r.value for r in consumer.poll(0.2))
        got.extend(r.value for r in consumer.poll(0.2))  # nothing more (no duplicate)
    return got
