"""Admin client against a real broker: every method returns dataclasses and raises typed errors."""

from __future__ import annotations

import asyncio
from typing import TypeVar

import pytest

from cursus.client import (
    Admin,
    AsyncAdmin,
    CursusError,
    Producer,
    TopicNotFoundError,
    ValidationError,
)

pytestmark = pytest.mark.timeout(60)
T = TypeVar("T")


def _addr(broker) -> str:
    host, port = broker.address
    return f"{host}:{port}"


def test_create_metadata_offsets_list(shared_broker, topic_name):
    with Admin(_addr(shared_broker)) as admin:
        config = admin.create_topic(topic_name, 3, retention_hours=5, partitioner="round_robin")
        assert (config.topic, config.partitions, config.revision) == (topic_name, 3, 1)
        assert config.retention_hours == 5 and config.partitioner == "round_robin"
        assert config.min_in_sync_replicas is None and config.effective_min_in_sync_replicas == 1
        assert admin.create_topic(topic_name, 3).revision == 1  # restating is a no-op
        assert admin.create_topic(topic_name, 4).partitions == 4
        with pytest.raises(ValidationError) as info:
            admin.create_topic(topic_name, 2)
        assert info.value.code == "invalid_partitions"
        with pytest.raises(ValidationError):
            admin.create_topic("bad name!")
        assert topic_name in admin.list_topics()
        metadata = admin.metadata(topic_name)
        assert metadata.partitions == 4 and metadata.leader_address(0) == shared_broker.address
        assert metadata.partitioner == "round_robin" and len(metadata.epochs) == 4
        with Producer(_addr(shared_broker)) as producer:
            for _ in range(3):
                producer.send(topic_name, b"x", partition=2)
        offsets = admin.list_offsets(topic_name)
        assert [(o.partition, o.earliest, o.latest) for o in offsets] == [(0, 0, 0), (1, 0, 0), (2, 0, 3), (3, 0, 0)]
        assert [o.leo for o in admin.list_offsets(topic_name, 2)] == [3]
        with pytest.raises(TopicNotFoundError):
            admin.metadata("missing-topic-admin")
        assert "METADATA" in admin.help()


def test_describe(shared_broker, topic_name):
    with Admin(_addr(shared_broker)) as admin:
        admin.create_topic(topic_name, 2)
        description = admin.describe_topic(topic_name)
        assert description.topic == topic_name and description.partitions == 2
        assert [p.id for p in description.partition_states] == [0, 1]
        assert description.policy["partitioner"] == "hash_key"
        assert description.to_dict()["status"] == "OK"
        with pytest.raises(TopicNotFoundError):
            admin.describe_topic("missing-topic-describe")


def test_alter_topic_config(shared_broker, topic_name):
    with Admin(_addr(shared_broker)) as admin:
        with pytest.raises(ValidationError):  # min ISR above the stored replication factor (1 standalone)
            admin.create_topic(topic_name, 1, replication_factor=3, min_in_sync_replicas=2)
        admin.create_topic(topic_name, 1, replication_factor=3, min_in_sync_replicas=1)
        with Producer(_addr(shared_broker), acks="all") as producer:
            producer.send(topic_name, b"x")
            producer.flush()
        config = admin.alter_topic_config(topic_name, min_in_sync_replicas="default")
        assert config.min_in_sync_replicas is None and config.effective_min_in_sync_replicas == 1
        with pytest.raises(ValidationError):
            admin.alter_topic_config(topic_name, min_in_sync_replicas=9)


def test_delete(shared_broker, topic_name):
    with Admin(_addr(shared_broker)) as admin:
        admin.create_topic(topic_name, 1)
        result = admin.delete_topic(topic_name)
        assert result.deleted and result.topic == topic_name
        assert topic_name not in admin.list_topics()
        with pytest.raises(TopicNotFoundError):
            admin.delete_topic(topic_name)
        assert not admin.delete_topic(topic_name, if_exists=True).deleted


def test_truncate(shared_broker, topic_name):
    with Admin(_addr(shared_broker)) as admin, Producer(_addr(shared_broker)) as producer:
        admin.create_topic(topic_name, 2)
        for i in range(4):
            producer.send(topic_name, f"m{i}".encode(), partition=i % 2)
        producer.flush()
        assert [o.latest for o in admin.list_offsets(topic_name)] == [2, 2]
        result = admin.truncate_topic(topic_name)
        assert result.to_dict() == {"topic": topic_name, "revision": 2, "lifecycle_epoch": 1, "leo": 0, "hwm": 0,
                                    "cleanup_pending": False}
        assert [o.latest for o in admin.list_offsets(topic_name)] == [0, 0]
        assert admin.describe_topic(topic_name).lifecycle_epoch == 1
        with pytest.raises(CursusError) as err:
            admin.truncate_topic(topic_name, expected_revision=1)
        assert err.value.code == "version_conflict"
        with pytest.raises(TopicNotFoundError):
            admin.truncate_topic("missing-topic-truncate", expected_revision=1)

    async def main() -> None:
        async with AsyncAdmin(_addr(shared_broker)) as aio:
            again = await aio.truncate_topic(topic_name, expected_revision=2)
            assert (again.revision, again.lifecycle_epoch) == (3, 2)

    asyncio.run(main())


def test_async_admin(shared_broker, topic_name):
    async def main() -> None:
        async with AsyncAdmin(_addr(shared_broker)) as admin:
            config = await admin.create_topic(topic_name, 2, idempotent=True)
            assert config.idempotent and config.partitions == 2
            assert topic_name in await admin.list_topics()
            assert (await admin.metadata(topic_name)).partitions == 2
            assert [o.latest for o in await admin.list_offsets(topic_name)] == [0, 0]
            with pytest.raises(TopicNotFoundError):
                await admin.metadata("missing-topic-async")

    asyncio.run(main())
