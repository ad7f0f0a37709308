"""Cursus Python SDK: producers, consumers and admin over Cursus Wire v2, blocking and asyncio.

Quick start (against ``make run`` on 127.0.0.1:9000)::

    from cursus.client import Admin, Consumer, Producer

    with Admin("127.0.0.1:9000") as admin:
        admin.create_topic("orders", partitions=3)
    with Producer("127.0.0.1:9000", idempotent=True) as producer:
        producer.send("orders", b"hello", key="customer-1")
    with Consumer("orders", "127.0.0.1:9000", start="earliest") as consumer:
        for record in consumer.records(until_end=True):
            print(record.partition, record.offset, record.key, record.value)

Consumer groups (committed offsets, rebalancing, at-least-once delivery)::

    from cursus.client import GroupConsumer

    with GroupConsumer("orders", "billing", "127.0.0.1:9000") as consumer:   # auto-commit, leave on exit
        for record in consumer.records(idle_timeout_s=5):
            print(record.partition, record.offset, record.value)

See ``docs/sdk.md`` for the full guide and ``docs/groups.md`` for groups. Layers: :mod:`.connection` /
:mod:`.aio` (transport, retries, redirects), :mod:`.producer`, :mod:`.consumer`, :mod:`.group`,
:mod:`.admin`, :mod:`.transactions` (transactional producers), :mod:`.records`, :mod:`.errors`.
"""

from __future__ import annotations

from cursus.client.admin import (
    Admin,
    AsyncAdmin,
    DeleteResult,
    GroupOffset,
    PartitionDescription,
    PartitionOffsets,
    TopicConfig,
    TopicDescription,
    TopicMetadata,
)
from cursus.client.aio import AsyncClient, AsyncConnection
from cursus.client.connection import (
    DEFAULT_ADDRESS,
    Backoff,
    Client,
    Connection,
    ConnectionClosed,
    ConnectionOptions,
    make_ssl_context,
    parse_address,
)
from cursus.client.consumer import AsyncConsumer, Consumer
from cursus.client.errors import (
    AuthenticationError,
    AuthorizationError,
    AvailabilityError,
    BrokerUnavailableError,
    BufferFullError,
    ClientClosedError,
    ConflictError,
    CursusError,
    DeliveryFailedError,
    DeliveryTimeoutError,
    DeliveryUnknownError,
    FencingError,
    InternalError,
    NotCoordinatorError,
    NotFoundError,
    NotLeaderError,
    OffsetOutOfRangeError,
    ProducerFencedError,
    ProtocolViolationError,
    RequestTimeoutError,
    RoutingError,
    SequenceError,
    TlsError,
    TopicNotFoundError,
    UnsupportedFeatureError,
    ValidationError,
    VersionConflictError,
    error_from_frame,
)
from cursus.client.events import AsyncEventStore, EventStore
from cursus.client.group import AsyncGroupConsumer, GroupConsumer, GroupMembership
from cursus.client.producer import AsyncProducer, Producer
from cursus.client.records import ConsumerRecord, RecordMetadata
from cursus.client.transactions import AsyncTransactionalProducer, TransactionalProducer
from cursus.wire import Compression

__all__ = [
    "DEFAULT_ADDRESS",
    "Admin",
    "AsyncAdmin",
    "AsyncClient",
    "AsyncConnection",
    "AsyncConsumer",
    "AsyncEventStore",
    "AsyncGroupConsumer",
    "AsyncProducer",
    "AsyncTransactionalProducer",
    "AuthenticationError",
    "AuthorizationError",
    "AvailabilityError",
    "Backoff",
    "EventStore",
    "BrokerUnavailableError",
    "BufferFullError",
    "Client",
    "ClientClosedError",
    "Compression",
    "ConflictError",
    "Connection",
    "ConnectionClosed",
    "ConnectionOptions",
    "Consumer",
    "ConsumerRecord",
    "CursusError",
    "DeleteResult",
    "DeliveryFailedError",
    "DeliveryTimeoutError",
    "DeliveryUnknownError",
    "FencingError",
    "GroupOffset",
    "GroupConsumer",
    "GroupMembership",
    "InternalError",
    "NotCoordinatorError",
    "NotFoundError",
    "NotLeaderError",
    "OffsetOutOfRangeError",
    "PartitionDescription",
    "PartitionOffsets",
    "Producer",
    "ProducerFencedError",
    "ProtocolViolationError",
    "RecordMetadata",
    "RequestTimeoutError",
    "RoutingError",
    "SequenceError",
    "TlsError",
    "TopicConfig",
    "TopicDescription",
    "TopicMetadata",
    "TopicNotFoundError",
    "TransactionalProducer",
    "UnsupportedFeatureError",
    "ValidationError",
    "VersionConflictError",
    "error_from_frame",
    "make_ssl_context",
    "parse_address",
]
