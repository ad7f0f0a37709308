"""The SDK's transactional producers (sync and asyncio) and ``cursusctl txn status`` against a real broker:
consume-transform-produce with the offsets in the transaction, abort, fencing, automatic re-init."""

from __future__ import annotations

import asyncio
import json

import pytest

from cursus.client import (
    Admin,
    AsyncTransactionalProducer,
    GroupConsumer,
    Producer,
    ProducerFencedError,
    TransactionalProducer,
    ValidationError,
)
from tests.integration.test_cursusctl import ctl
from tests.integration.txnsupport import committed_values

pytestmark = pytest.mark.timeout(120)


def test_consume_transform_produce_exactly_once(shared_broker, topic_name):
    address = shared_broker.bootstrap
    source, sink, group = f"{topic_name}-in", f"{topic_name}-out", f"{topic_name}-g"
    with Admin(address) as admin:
        admin.create_topic(source, partitions=1)
        admin.create_topic(sink, partitions=2)
    with Producer(address) as producer:
        for i in range(6):
            producer.send(source, f"v{i}".encode(), partition=0)
    with GroupConsumer(source, group, address, auto_commit=False, wait_ms=100) as consumer, \
            TransactionalProducer(address, f"{topic_name}-tx") as txn:
        seen = 0
        while seen < 6:
            records = consumer.poll(timeout_s=5)
            if not records:
                continue
            txn.begin()
            for record in records:
                txn.send(sink, record.value.upper(), key=record.value.decode())
            assert txn.send_consumer_offsets(consumer) == 1
            assert txn.commit() == "committed"
            seen += len(records)
        status = txn.status()
        assert status["state"] == "committed" and int(status["epoch"]) >= 1
        assert consumer.generation >= 1
    with Admin(address) as admin:
        offsets = {o.partition: o.committed for o in admin.group_offsets(group) if o.topic == source}
    assert offsets == {0: 6}
    assert sorted(committed_values(address, sink)) == [f"V{i}".encode() for i in range(6)]


def test_abort_fencing_and_reinit(shared_broker, topic_name):
    address = shared_broker.bootstrap
    with Admin(address) as admin:
        admin.create_topic(topic_name, partitions=1)
    with TransactionalProducer(address, f"{topic_name}-tx") as first, \
            TransactionalProducer(address, f"{topic_name}-tx") as second:
        first.begin()
        first.send(topic_name, b"aborted")
        assert first.abort() == "aborted"
        with pytest.raises(ValidationError):
            first.send(topic_name, b"no transaction")
        first.begin()  # re-initializes: the epoch ran its transaction
        epoch = first.session.epoch
        first.send(topic_name, b"zombie")
        second.begin()  # a new instance: fences the first, aborts its open transaction
        assert second.session.epoch == epoch + 1
        second.send(topic_name, b"kept")
        second.commit()
        with pytest.raises(ProducerFencedError):
            first.commit()
        with pytest.raises(ProducerFencedError):
            first.begin()
    assert committed_values(address, topic_name) == [b"kept"]
    shown = ctl(shared_broker, "--json", "txn", "status", f"{topic_name}-tx")
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    assert doc["state"] == "committed" and doc["messages"] == "1"
    missing = ctl(shared_broker, "txn", "status", f"{topic_name}-none")
    assert missing.returncode == 1 and "transaction_not_found" in missing.stderr


def test_async_transactional_producer(shared_broker, topic_name):
    address = shared_broker.bootstrap
    with Admin(address) as admin:
        admin.create_topic(topic_name, partitions=2)

    async def run() -> None:
        async with AsyncTransactionalProducer(address, f"{topic_name}-tx") as txn:
            await txn.begin()
            assert await txn.send(topic_name, b"a", partition=0) == 0
            await txn.send(topic_name, b"b", partition=1)
            assert await txn.commit() == "committed"
            await txn.begin()
            await txn.send(topic_name, b"c", partition=0)
            assert await txn.abort() == "aborted"
            assert (await txn.status())["state"] == "aborted"

    asyncio.run(run())
    assert sorted(committed_values(address, topic_name)) == [b"a", b"b"]
