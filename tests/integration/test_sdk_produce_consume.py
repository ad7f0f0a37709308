"""SDK producer and consumer against a real broker: round trips, routing, acks, idempotence, offset resets."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from cursus.client import (
    Admin,
    AsyncConsumer,
    AsyncProducer,
    Consumer,
    DeliveryFailedError,
    NotFoundError,
    OffsetOutOfRangeError,
    Producer,
    ProducerFencedError,
    TopicNotFoundError,
    ValidationError,
)
from cursus.partitioning import partition_for_key
from cursus.wire import Command, Status
from tests.integration.conftest import connect
from tests.integration.helpers import ok_fields

pytestmark = pytest.mark.timeout(90)


def _addr(broker) -> str:
    host, port = broker.address
    return f"{host}:{port}"


def _create(broker, topic: str, partitions: int = 1, **settings) -> None:
    with Admin(_addr(broker)) as admin:
        admin.create_topic(topic, partitions, **settings)


@pytest.mark.parametrize("compression", ["none", "gzip", "snappy", "lz4"])
def test_round_trip_every_compression(shared_broker, topic_name, compression):
    _create(shared_broker, topic_name, 3)
    values = [b"", b"\x00\xffbinary\x00", "ünïcode ✓".encode(), b"x" * 70_000] + \
        [b"record-%05d" % i for i in range(1500)]
    keys = [None if i % 3 else f"key-{i % 17}" for i in range(len(values))]
    with Producer(_addr(shared_broker), compression=compression, linger_ms=2) as producer:
        futures = [producer.send(topic_name, v, key=k) for v, k in zip(values, keys, strict=True)]
        producer.flush()
    sent = {(f.result().partition, f.result().offset): (k, v) for f, k, v in zip(futures, keys, values, strict=True)}
    assert len(sent) == len(values)  # distinct offsets for every record
    with Consumer(topic_name, _addr(shared_broker), compression=compression) as consumer:
        got = {(r.partition, r.offset): (r.key, r.value) for r in consumer.records(until_end=True)}
    assert got == sent


def test_async_round_trip(shared_broker, topic_name):
    _create(shared_broker, topic_name, 2)

    async def main() -> tuple[list, list]:
        async with AsyncProducer(_addr(shared_broker), idempotent=True, compression="gzip") as producer:
            futures = [await producer.send(topic_name, b"a%d" % i, key=str(i)) for i in range(300)]
            single = await producer.send_and_wait(topic_name, b"last", partition=1)
            metas = [await f for f in futures] + [single]
        async with AsyncConsumer(topic_name, _addr(shared_broker), compression="lz4") as consumer:
            records = [r async for r in consumer.records(until_end=True)]
        return metas, records

    metas, records = asyncio.run(main())
    assert {(m.partition, m.offset) for m in metas} == {(r.partition, r.offset) for r in records}
    assert sorted(r.value for r in records) == sorted([b"a%d" % i for i in range(300)] + [b"last"])
    assert all(r.producer_id and r.producer_id.startswith("py-async-") for r in records)


def test_keyed_records_land_where_the_broker_puts_them(shared_broker, topic_name):
    _create(shared_broker, topic_name, 5)
    keys = [f"user-{i}" for i in range(60)] + ["ключ", "🔑", ""]
    with Producer(_addr(shared_broker)) as producer:
        futures = {k: producer.send(topic_name, k.encode(), key=k) for k in keys}
        producer.flush()
    for key, future in futures.items():
        assert future.result().partition == partition_for_key(key, 5), key
    # The broker's own choice for text PUBLISH without a partition agrees.
    with connect(shared_broker) as conn:
        for key in ("user-3", "ключ"):
            frame = conn.command(f"PUBLISH topic={topic_name} acks=1 producerId=text key={key} message=via-text")
            assert frame.status == Status.OK
    with Consumer(topic_name, _addr(shared_broker)) as consumer:
        for record in consumer.records(until_end=True):
            assert record.partition == partition_for_key(record.key, 5)


def test_acks_zero_and_explicit_partitions(shared_broker, topic_name):
    _create(shared_broker, topic_name, 2)
    with Producer(_addr(shared_broker), acks=0) as producer:
        futures = [producer.send(topic_name, b"fire-%d" % i, partition=1) for i in range(200)]
        producer.flush()
        with pytest.raises(NotFoundError):
            producer.send(topic_name, b"x", partition=2)
    assert all(f.result().offset is None for f in futures)
    deadline = time.monotonic() + 10
    with Consumer(topic_name, _addr(shared_broker), partitions=[1]) as consumer:
        seen: list[bytes] = []
        while len(seen) < 200 and time.monotonic() < deadline:
            seen += [r.value for r in consumer.poll(timeout_s=0.5)]
    assert seen == [b"fire-%d" % i for i in range(200)]


def test_idempotent_records_carry_contiguous_sequences(shared_broker, topic_name):
    _create(shared_broker, topic_name, 2, idempotent=True)
    with Producer(_addr(shared_broker), idempotent=True, batch_size=64) as producer:
        for i in range(500):
            producer.send(topic_name, b"%d" % i, partition=i % 2)
        producer.flush()
        producer_id, epoch = producer.producer_id, producer.producer_epoch
    with Consumer(topic_name, _addr(shared_broker)) as consumer:
        by_partition: dict[int, list] = {}
        for record in consumer.records(until_end=True):
            by_partition.setdefault(record.partition, []).append(record)
    for records in by_partition.values():
        assert [r.seq_num for r in records] == list(range(1, 251))
        assert {(r.producer_id, r.producer_epoch) for r in records} == {(producer_id, epoch)}


def test_rejected_batch_fails_loudly_and_the_producer_continues(shared_broker, topic_name):
    _create(shared_broker, topic_name, 1)
    with Producer(_addr(shared_broker), idempotent=True) as producer:
        too_big = producer.send(topic_name, b"x" * (2 << 20))
        with pytest.raises(DeliveryFailedError) as info:
            producer.flush()
        assert info.value.failed_count == 1 and info.value.errors[0].code == "message_too_large"
        assert isinstance(too_big.exception(), ValidationError)
        # Sequences were rewound: the next records are accepted (no idempotency gap).
        after = [producer.send(topic_name, b"ok-%d" % i) for i in range(3)]
        producer.flush()
    assert [f.result().offset for f in after] == [0, 1, 2]


def test_fenced_producer_stops(shared_broker, topic_name):
    _create(shared_broker, topic_name, 1, idempotent=True)
    old = Producer(_addr(shared_broker), idempotent=True, producer_id="py-fence-test", producer_epoch=1)
    try:
        old.produce(topic_name, b"old-1")
        with Producer(_addr(shared_broker), idempotent=True, producer_id="py-fence-test",
                      producer_epoch=2) as new:
            new.produce(topic_name, b"new-1")
        doomed = old.send(topic_name, b"old-2")
        with pytest.raises(DeliveryFailedError):
            old.flush()
        assert isinstance(doomed.exception(), ProducerFencedError)
        with pytest.raises(ProducerFencedError):
            old.send(topic_name, b"old-3")
    finally:
        try:
            old.close()
        except DeliveryFailedError:
            pass


def test_unknown_topic_raises_on_send(shared_broker):
    with Producer(_addr(shared_broker)) as producer, pytest.raises(TopicNotFoundError):
        producer.send("no-such-topic-sdk", b"x")


def test_auto_offset_reset(shared_broker, topic_name):
    _create(shared_broker, topic_name, 1)
    with Producer(_addr(shared_broker)) as producer:
        for i in range(5):
            producer.send(topic_name, b"%d" % i)
    addr = _addr(shared_broker)
    with Consumer(topic_name, addr, start=100, auto_offset_reset="earliest") as consumer:
        assert [r.offset for r in consumer.records(max_records=5)] == [0, 1, 2, 3, 4]
    with Consumer(topic_name, addr, start=100, auto_offset_reset="latest", wait_ms=50) as consumer:
        assert consumer.poll(timeout_s=0.2) == [] and consumer.position(0) == 5
    with Consumer(topic_name, addr, start=100, auto_offset_reset="error") as consumer:
        with pytest.raises(OffsetOutOfRangeError) as info:
            consumer.poll()
        assert (info.value.requested, info.value.earliest, info.value.latest) == (100, 0, 5)
    with Consumer(topic_name, addr, start="latest") as consumer:
        assert consumer.positions() == {0: 5}
        consumer.seek(0, 3)
        assert [r.value for r in consumer.poll()] == [b"3", b"4"]
    with Consumer(topic_name, addr, start=-2) as consumer:
        assert consumer.position(0) == 3


def test_long_poll_returns_when_data_arrives(shared_broker, topic_name):
    _create(shared_broker, topic_name, 1)
    addr = _addr(shared_broker)
    with Consumer(topic_name, addr, start="latest", wait_ms=5000) as consumer:
        consumer.positions()

        def produce_later() -> None:
            time.sleep(0.3)
            with Producer(addr) as producer:
                producer.send(topic_name, b"late")

        thread = threading.Thread(target=produce_later)
        started = time.monotonic()
        thread.start()
        records = consumer.poll(timeout_s=5)
        elapsed = time.monotonic() - started
        thread.join()
    assert [r.value for r in records] == [b"late"]
    assert 0.25 < elapsed < 4.5  # woken by the record, not by the 5 s long-poll timeout


def test_consumer_subset_and_isolation_field(shared_broker, topic_name):
    _create(shared_broker, topic_name, 3)
    with Producer(_addr(shared_broker)) as producer:
        for p in range(3):
            producer.send(topic_name, b"p%d" % p, partition=p)
    with Consumer(topic_name, _addr(shared_broker), partitions=[0, 2],
                  isolation_level="read_uncommitted") as consumer:
        assert consumer.assignment() == [0, 2]
        assert sorted(r.value for r in consumer.records(until_end=True)) == [b"p0", b"p2"]
    with Consumer(topic_name, _addr(shared_broker), partitions=[7]) as consumer, pytest.raises(NotFoundError):
        consumer.assignment()
    with connect(shared_broker) as conn:  # sanity: the raw connection API stays usable alongside the SDK
        assert ok_fields(conn.call(Command.LIST))["count"]


def test_single_partition_poll_without_wait_reads(shared_broker, topic_name):
    from cursus.client import Admin, Consumer, Producer

    addr = "{}:{}".format(*shared_broker.address)
    with Admin(addr) as admin:
        admin.create_topic(topic_name, partitions=1)
    with Producer(addr) as producer:
        for i in range(3):
            producer.send(topic_name, b"v%d" % i)
        producer.flush()
    with Consumer(topic_name, addr, start="earliest", wait_ms=0) as consumer:
        assert [r.value for r in consumer.poll()] == [b"v0", b"v1", b"v2"]


def test_produce_from_many_threads_interleaved_with_send_keeps_order_and_sequences(shared_broker, topic_name):
    """produce() may deliver from the calling thread; with senders busy on the same partition it must wait
    its turn: per-partition order, contiguous idempotent sequences, every record exactly once."""
    _create(shared_broker, topic_name, 2, idempotent=True)
    with Producer(_addr(shared_broker), idempotent=True, linger_ms=1, batch_size=50) as producer:
        futures = {}

        def worker(index: int) -> None:
            for i in range(60):
                value = b"%d-%d" % (index, i)
                if i % 3:
                    futures[value] = producer.send(topic_name, value, partition=i % 2)
                else:
                    meta = producer.produce(topic_name, value, partition=i % 2)
                    assert meta.offset is not None and meta.partition == i % 2
                    futures[value] = meta

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        producer.flush()
    metas = {v: (f if not hasattr(f, "result") else f.result()) for v, f in futures.items()}
    with Consumer(topic_name, _addr(shared_broker)) as consumer:
        records = list(consumer.records(until_end=True))
    assert sorted(r.value for r in records) == sorted(metas)  # each record once
    for partition in (0, 1):
        mine = [r for r in records if r.partition == partition]
        assert [r.seq_num for r in mine] == list(range(1, len(mine) + 1))
        assert {(r.offset, r.value) for r in mine} == {(m.offset, v) for v, m in metas.items()
                                                        if m.partition == partition}
        for n in range(4):  # each thread's records keep their order within a partition
            own = [int(r.value.split(b"-")[1]) for r in mine if r.value.startswith(b"%d-" % n)]
            assert own == sorted(own)


def test_prefetched_batches_are_contiguous_and_a_seek_discards_the_prefetch(shared_broker, topic_name):
    _create(shared_broker, topic_name, 1)
    with Producer(_addr(shared_broker)) as producer:
        for i in range(2500):
            producer.send(topic_name, b"%d" % i)
    with Consumer(topic_name, _addr(shared_broker), batch_size=1000, start="earliest") as consumer:
        first = consumer.poll()
        assert consumer._core.prefetched is not None  # the next CONSUME is already on its way
        second = consumer.poll()
        assert [r.offset for r in first + second] == list(range(2000))
        consumer.seek(0, 5)  # the outstanding prefetch (offset 2000) no longer answers the question
        after = consumer.poll()
        assert after[0].offset == 5 and after[0].value == b"5"
        it = consumer.records(until_end=True)
        assert next(it).offset == after[-1].offset + 1
        it.close()  # stopping early keeps the rest for the next iteration
        rest = list(consumer.records(until_end=True))
        assert [r.offset for r in rest] == list(range(after[-1].offset + 2, 2500))


def test_async_prefetch_matches_the_blocking_consumer(shared_broker, topic_name):
    _create(shared_broker, topic_name, 2)
    with Producer(_addr(shared_broker)) as producer:
        for i in range(3000):
            producer.send(topic_name, b"%d" % i, partition=i % 2)

    async def read() -> list[tuple[int, int]]:
        async with AsyncConsumer(topic_name, _addr(shared_broker), batch_size=400) as consumer:
            got = [(r.partition, r.offset) async for r in consumer.records(until_end=True)]
            await consumer.seek(1, 0)
            again = await consumer.poll()
            assert again[0].partition == 1 and again[0].offset == 0
            return got

    got = asyncio.run(read())
    assert sorted(got) == [(p, o) for p in (0, 1) for o in range(1500)]
    for p in (0, 1):
        assert [o for q, o in got if q == p] == list(range(1500))


def test_async_iteration_stopped_early_hands_the_rest_out_next(shared_broker, topic_name):
    _create(shared_broker, topic_name, 1)
    with Producer(_addr(shared_broker)) as producer:
        for i in range(700):
            producer.send(topic_name, b"%d" % i)

    async def read() -> None:
        async with AsyncConsumer(topic_name, _addr(shared_broker), batch_size=300) as consumer:
            first = [r.offset async for r in consumer.records(max_records=5)]
            assert first == list(range(5))
            async for record in consumer.records():
                if record.offset == 9:
                    break
            assert await consumer.positions() == {0: 10}
            assert (await consumer.poll())[0].offset == 10
            rest = [r.offset async for r in consumer.records(until_end=True)]
            assert rest[0] > 10 and rest[-1] == 699 and rest == list(range(rest[0], 700))

    asyncio.run(read())


def test_produce_with_a_timeout_gives_up_on_time_when_the_broker_stalls(broker_factory):
    """produce(timeout_s=) must not deliver from the calling thread (it would wait request_timeout_s)."""
    import os
    import signal

    broker = broker_factory("stall").start()
    _create(broker, "stall-topic")
    with Producer(_addr(broker), request_timeout_s=20, delivery_timeout_s=30) as producer:
        producer.produce("stall-topic", b"warm")  # metadata and connections
        os.kill(broker.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                producer.produce("stall-topic", b"late", timeout_s=0.5)
            assert time.monotonic() - started < 5
        finally:
            os.kill(broker.proc.pid, signal.SIGCONT)
        producer.flush(timeout_s=30)  # the late record is still delivered once the broker resumes
