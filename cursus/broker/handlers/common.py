"""Argument helpers shared by command handlers."""

from __future__ import annotations

from cursus.broker.auth import topic_allows
from cursus.broker.core import Broker
from cursus.broker.replica import Replica
from cursus.broker.request import SessionInfo
from cursus.metadata.topics import TopicDefinition
from cursus.wire.errors import BrokerError


def partition_of(broker: Broker, defn: TopicDefinition, raw: int) -> Replica:
    """The replica for partition ``raw`` of ``defn``; ``invalid_partition`` / ``partition_not_found``."""
    if raw < 0:
        raise BrokerError.of("invalid_partition", topic=defn.name, partition=raw)
    if raw >= defn.partitions:
        raise BrokerError.of("partition_not_found", topic=defn.name, partition=raw)
    return broker.replica(defn.name, raw)


def check_topic_access(defn: TopicDefinition, operation: str, session: SessionInfo | None = None) -> None:
    """Enforce the topic's ``auth_policy`` for ``operation`` (``read`` | ``write``) by the connection's
    authenticated principal (spec section 8): ``deny_write`` / ``deny_read`` refuse everybody, ``acl``
    admits only principals in ``read_acl`` / ``write_acl`` (``*``: any authenticated one). Without a
    ``session`` (or unauthenticated) an ``acl`` topic refuses: fail closed.

    Raises:
        BrokerError: ``NOT_AUTHORIZED_FOR_TOPIC topic= operation=``.
    """
    pol = defn.policy
    principal = session.authenticated_principal if session is not None else None
    if not topic_allows(pol.auth_policy, pol.read_acl, pol.write_acl, operation, principal):
        raise BrokerError.of("NOT_AUTHORIZED_FOR_TOPIC", topic=defn.name, operation=operation)

