"""An idempotent SDK producer that lives across a TRUNCATE or a DELETE + re-CREATE of its topic (issue 11)
on a real standalone broker: the broker forgot the producer's sequences, so the SDK moves the partition to
the next producer epoch at sequence 1 instead of stopping on ``idempotency_gap expected=1``. A batch that
was pending for the old generation fails with a typed error (never resent silently into the new one);
everything sent afterwards is delivered exactly once."""

from __future__ import annotations

import asyncio

import pytest

from cursus.client import Admin, AsyncProducer, CursusError, DeliveryFailedError, Producer
from cursus.client.errors import SequenceError, TopicNotFoundError
from tests.integration.helpers import read_values, sdk_address

pytestmark = pytest.mark.timeout(90)


def _produce_after_reset(producer: Producer, topic: str, value: bytes) -> None:
    """The first record after the reset may fail (it was refused: not appended); the next one succeeds."""
    try:
        producer.produce(topic, value, timeout_s=10)
        return
    except SequenceError as exc:
        assert exc.fields.get("expected") == "1", exc
    producer.produce(topic, value, timeout_s=10)


def test_idempotent_producer_keeps_working_after_truncate(shared_broker, topic_name):
    with Admin(sdk_address(shared_broker)) as admin:
        admin.create_topic(topic_name, 1)
        with Producer(sdk_address(shared_broker), idempotent=True, max_in_flight=5, batch_size=3, linger_ms=1) as producer:
            futures = [producer.send(topic_name, b"old%d" % i) for i in range(30)]
            producer.flush()
            assert [f.result().offset for f in futures] == list(range(30))
            admin.truncate_topic(topic_name)
            _produce_after_reset(producer, topic_name, b"first")
            futures = [producer.send(topic_name, b"new%d" % i) for i in range(20)]
            try:
                producer.flush()
            except DeliveryFailedError as exc:  # the refused first attempt of _produce_after_reset
                assert all(isinstance(e, SequenceError) for e in exc.errors), exc
            assert [f.result().offset for f in futures] == list(range(1, 21))
            assert futures[0].result().producer_epoch == producer.producer_epoch + 1
    assert read_values(shared_broker, topic_name, 21) == [b"first"] + [b"new%d" % i for i in range(20)]


def test_idempotent_producer_keeps_working_after_delete_and_recreate(shared_broker, topic_name):
    with Admin(sdk_address(shared_broker)) as admin:
        admin.create_topic(topic_name, 2)
        with Producer(sdk_address(shared_broker), idempotent=True, max_in_flight=5, batch_size=3, linger_ms=1) as producer:
            for p in (0, 1):
                producer.produce(topic_name, b"old", partition=p, timeout_s=10)
            admin.delete_topic(topic_name)
            with pytest.raises((TopicNotFoundError, SequenceError)):
                producer.produce(topic_name, b"lost", partition=0, timeout_s=10)
            admin.create_topic(topic_name, 2)
            for p in (0, 1):
                _produce_after_reset(producer, topic_name, b"new-%d" % p)
            try:
                producer.flush()
            except DeliveryFailedError:
                pass
    assert sorted(read_values(shared_broker, topic_name, 2)) == [b"new-0", b"new-1"]


def test_async_idempotent_producer_keeps_working_after_truncate(shared_broker, topic_name):
    async def scenario() -> None:
        with Admin(sdk_address(shared_broker)) as admin:
            admin.create_topic(topic_name, 1)
            async with AsyncProducer(sdk_address(shared_broker), idempotent=True, max_in_flight=5) as producer:
                assert (await producer.send_and_wait(topic_name, b"old")).offset == 0
                admin.truncate_topic(topic_name)
                try:
                    await producer.send_and_wait(topic_name, b"first")
                except SequenceError:
                    await producer.send_and_wait(topic_name, b"first")
                assert (await producer.send_and_wait(topic_name, b"second")).offset == 1
                try:
                    await producer.flush()
                except CursusError:
                    pass

    asyncio.run(scenario())
    assert read_values(shared_broker, topic_name, 2) == [b"first", b"second"]
