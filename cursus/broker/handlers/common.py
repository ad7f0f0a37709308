"""Argument helpers shared by command handlers."""

from __future__ import annotations

from cursus.broker.core import Broker
from cursus.broker.replica import Replica
from cursus.metadata.topics import TopicDefinition
from cursus.wire.errors import BrokerError


def partition_of(broker: Broker, defn: TopicDefinition, raw: int) -> Replica:
    """The replica for partition ``raw`` of ``defn``; ``invalid_partition`` / ``partition_not_found``."""
    if raw < 0:
        raise BrokerError.of("invalid_partition", topic=defn.name, partition=raw)
    if raw >= defn.partitions:
        raise BrokerError.of("partition_not_found", topic=defn.name, partition=raw)
    return broker.replica(defn.name, raw)


def check_topic_access(defn: TopicDefinition, operation: str) -> None:
    """Enforce ``auth_policy=deny_write`` / ``deny_read`` (spec section 8)."""
    policy = defn.policy.auth_policy
    if (policy == "deny_write" and operation == "write") or (policy == "deny_read" and operation == "read"):
        raise BrokerError.of("NOT_AUTHORIZED_FOR_TOPIC", topic=defn.name, operation=operation)

