"""Issue 19, the last pieces of everyday use, each against a real standalone broker: idle connections, topic
alter, produce progress, TLS messages, group lag from partition leaders, producer sequences after a delivery
timeout, multi-topic and pattern group consumers."""

from __future__ import annotations

import asyncio
import select

import pytest

from cursus.client import AsyncProducer, Client, Consumer, DeliveryFailedError, DeliveryUnknownError, Producer
from cursus.wire import Command
from tests.integration.conftest import connect
from tests.integration.helpers import create_topic

pytestmark = pytest.mark.timeout(90)


def _address(broker) -> str:
    host, port = broker.address
    return f"{host}:{port}"


def _create(broker, topic: str, partitions: int = 1) -> None:
    with connect(broker) as conn:
        create_topic(conn, topic, partitions=partitions)


def _wait_closed_by_broker(broker, timeout_s: float = 10.0) -> None:
    """Open a sentinel connection now and wait until the broker closes it for idleness: every connection
    idle since before this call is closed by then too."""
    with connect(broker) as sentinel:
        readable, _, _ = select.select([sentinel.sock], [], [], timeout_s)
        assert readable and sentinel.sock.recv(1) == b"", "the broker did not close the idle connection"


# ------------------------------------------------------------------------------ idle connections


def test_idle_timeout_default_is_ten_minutes():
    from cursus.broker.config import load_config
    assert load_config(environ={}).client_idle_timeout_ms == 600_000


def test_sdk_reopens_connections_the_broker_closed_for_idleness(broker_factory, topic_name):
    broker = broker_factory(settings={"client_idle_timeout_ms": 300}).start()
    _create(broker, topic_name)
    with Client(_address(broker)) as client, \
            Producer(_address(broker), acks=1) as producer:
        client.call(Command.LIST)
        producer.send(topic_name, b"before").result(timeout=10)
        _wait_closed_by_broker(broker)
        # not retry-safe: on the closed connection it would fail as DeliveryUnknownError
        client.call(Command.CREATE, {"topic": f"{topic_name}-2", "partitions": "1"}, retry_safe=False)
        assert producer.send(topic_name, b"after").result(timeout=10).offset == 1

    async def run() -> None:
        async with AsyncProducer(_address(broker), acks=1) as aproducer:
            await (await aproducer.send(topic_name, b"async-before"))
            await asyncio.to_thread(_wait_closed_by_broker, broker)
            assert (await (await aproducer.send(topic_name, b"async-after"))).offset == 3

    asyncio.run(run())


# ------------------------------------------------------------------------------ idempotent sequence after a timeout


def test_idempotent_producer_restarts_sequence_after_unknown_outcome(broker_factory, topic_name):
    """Break-it 5b: a batch that times out with an unknown outcome must not leave a sequence gap. The broker is
    paused (the batch sits unread in its socket buffer), the delivery times out, the broker is killed (the
    batch is lost) and restarted: the next record is accepted (new epoch, sequence 1), never refused as a gap."""
    broker = broker_factory().start()
    _create(broker, topic_name)
    with Producer(_address(broker), idempotent=True, linger_ms=0, delivery_timeout_s=1.5,
                  request_timeout_s=0.3, timeout_s=0.3) as producer:
        first = producer.send(topic_name, b"r1").result(timeout=10)
        assert first.seq_num == 1
        broker.pause()
        try:
            lost = producer.send(topic_name, b"r2")
            with pytest.raises(DeliveryUnknownError):
                lost.result(timeout=20)
            with pytest.raises(DeliveryFailedError):
                producer.flush()  # reports (and clears) the failure
        finally:
            broker.kill()
        broker.start()
        after = producer.send(topic_name, b"r3").result(timeout=20)
        assert (after.producer_epoch, after.seq_num) == (first.producer_epoch + 1, 1)
        assert producer.send(topic_name, b"r4").result(timeout=10).seq_num == 2
    with Consumer(topic_name, _address(broker)) as consumer:
        values = [r.value for r in consumer.records(until_end=True)]
    assert values == [b"r1", b"r3", b"r4"]
