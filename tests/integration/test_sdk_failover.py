"""The SDK across broker crashes: kill -9 and restart mid-stream on the same port."""

from __future__ import annotations

import asyncio
import collections
import time

import pytest

from cursus.client import Admin, AsyncProducer, Backoff, Consumer, Producer

pytestmark = pytest.mark.timeout(120)


def _addr(broker) -> str:
    host, port = broker.address
    return f"{host}:{port}"


def test_idempotent_producer_retries_across_kill9_without_duplicates(broker_factory):
    broker = broker_factory().start()
    addr = _addr(broker)
    with Admin(addr) as admin:
        admin.create_topic("failover", 2, idempotent=True)
    producer = Producer(addr, idempotent=True, batch_size=40, linger_ms=1, delivery_timeout_s=60,
                        request_timeout_s=5, backoff=Backoff(initial_s=0.05, max_s=0.4, attempts_max=50))
    values = [b"value-%05d" % i for i in range(6000)]
    futures = [producer.send("failover", v) for v in values[:3000]]
    deadline = time.monotonic() + 20
    while not any(f.done() for f in futures) and time.monotonic() < deadline:
        time.sleep(0.001)
    broker.kill()  # batches are in flight: some acks are lost, some appends are not durable
    futures += [producer.send("failover", v) for v in values[3000:]]  # queued while the broker is down
    time.sleep(0.3)
    broker.start()
    producer.flush(timeout_s=60)
    producer.close()
    assert all(f.exception() is None for f in futures)

    with Consumer("failover", addr) as consumer:
        counts = collections.Counter(r.value for r in consumer.records(until_end=True))
    assert set(counts) == set(values)
    assert [v for v, n in counts.items() if n != 1] == []
    # Offsets reported to the producer are where the records really are.
    with Consumer("failover", addr) as consumer:
        where = {(r.partition, r.offset): r.value for r in consumer.records(until_end=True)}
    for value, future in zip(values, futures, strict=True):
        meta = future.result()
        assert where[(meta.partition, meta.offset)] == value


def _kill_mid_stream(broker, futures) -> None:
    deadline = time.monotonic() + 20
    while not any(f.done() for f in futures) and time.monotonic() < deadline:
        time.sleep(0.001)
    broker.kill()  # several pipelined batches are in flight: acks lost, appends not durable


def _check_exactly_once_in_order(addr: str, topic: str, values: list[bytes], metas: list) -> None:
    with Consumer(topic, addr) as consumer:
        records = list(consumer.records(until_end=True))
    assert [r.value for r in records] == values  # one partition: no duplicate, no gap, producer order
    assert [(m.partition, m.offset) for m in metas] == [(r.partition, r.offset) for r in records]


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_pipelined_idempotent_producer_survives_kill9_exactly_once_in_order(broker_factory, flavour):
    """max_in_flight=5 on one partition with small batches: a kill -9 fails a whole window (outcome
    unknown), the producer resends those batches in sequence order after the restart, and the broker
    answers the ones it kept as duplicates: every record once, in order, at the offset reported."""
    broker = broker_factory().start()
    addr = _addr(broker)
    topic = f"pipefail-{flavour}"
    with Admin(addr) as admin:
        admin.create_topic(topic, 1, idempotent=True)
    values = [b"value-%05d" % i for i in range(4000)]
    settings = dict(idempotent=True, batch_size=25, linger_ms=0, max_in_flight=5, delivery_timeout_s=60,
                    request_timeout_s=5, backoff=Backoff(initial_s=0.05, max_s=0.4, attempts_max=50))
    if flavour == "sync":
        producer = Producer(addr, **settings)
        futures = [producer.send(topic, v) for v in values[:2000]]
        _kill_mid_stream(broker, futures)
        futures += [producer.send(topic, v) for v in values[2000:]]  # queued while the broker is down
        time.sleep(0.3)
        broker.start()
        producer.flush(timeout_s=60)
        producer.close()
        metas = [f.result() for f in futures]
    else:
        async def run() -> list:
            async with AsyncProducer(addr, **settings) as producer:
                futures = [await producer.send(topic, v) for v in values[:2000]]
                await asyncio.to_thread(_kill_mid_stream, broker, futures)
                futures += [await producer.send(topic, v) for v in values[2000:]]
                await asyncio.sleep(0.3)
                await asyncio.to_thread(broker.start)
                await producer.flush(timeout_s=60)
            return [f.result() for f in futures]
        metas = asyncio.run(run())
    _check_exactly_once_in_order(addr, topic, values, metas)


def test_consumer_reconnects_after_restart(broker_factory):
    broker = broker_factory().start()
    addr = _addr(broker)
    with Admin(addr) as admin:
        admin.create_topic("resume", 1)
    with Producer(addr) as producer:
        for i in range(10):
            producer.send("resume", b"%d" % i)
    with Consumer("resume", addr, wait_ms=100, backoff=Backoff(initial_s=0.05, max_s=0.5, attempts_max=30)) \
            as consumer:
        first = [r.value for r in consumer.records(max_records=5)]
        broker.kill()
        broker.start()
        rest = [r.value for r in consumer.records(until_end=True)]
    assert first + rest == [b"%d" % i for i in range(10)]
