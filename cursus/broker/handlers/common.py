"""Argument helpers shared by command handlers."""

from __future__ import annotations

from cursus.broker.core import Broker
from cursus.broker.replica import Replica
from cursus.broker.request import Request
from cursus.metadata.topics import TopicDefinition, validate_topic_name
from cursus.wire.errors import BrokerError

#: acks strings (facts decision 11) -> ack mode label: "none" suppresses the reply.
ACK_MODES = {"0": "none", "none": "none", "": "leader", "1": "leader", "all": "all", "-1": "all"}


def parse_acks(raw: str | None) -> str:
    """Map an acks value to ``none`` / ``leader`` / ``all``. Raises BrokerError ``invalid_acks``."""
    mode = ACK_MODES.get((raw if raw is not None else "1").strip().lower())
    if mode is None:
        raise BrokerError.of("invalid_acks", value=raw)
    return mode


def topic_arg(broker: Broker, req: Request) -> TopicDefinition:
    """The request's ``topic=`` resolved to a definition (missing_topic, invalid_topic_name, topic_not_found)."""
    name = validate_topic_name(req.get("topic"), command=req.command.name)
    return broker.topic(name)


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


def max_bytes_arg(broker: Broker, req: Request) -> int:
    """The reply byte limit of CONSUME/STREAM: ``max_bytes`` (default ``consume_default_max_bytes``), capped
    at ``consume_max_bytes_limit`` so every reply fits a frame and one connection's reply memory is bounded.
    """
    requested = req.int_field("max_bytes", broker.config.consume_default_max_bytes, minimum=1,
                              code="invalid_max_bytes")
    return min(requested, broker.config.consume_max_bytes_limit)
