"""The topic lifecycle protocol version and the rule that gates distributed lifecycle operations.

Every broker advertises the lifecycle protocol version it implements in its registration
(:attr:`cursus.metadata.state.BrokerInfo.lifecycle_protocol`; shown by CLUSTER_STATUS). Spec "TRUNCATE":
every *active* broker must advertise version 1 before a distributed TRUNCATE is accepted; spec
"ALTER_TOPIC_CONFIG": version 2 before a compaction policy is (:meth:`cursus.broker.core.Broker.create_topic`).
Mixed-version attempts are refused with ``unsupported_topic_policy``. A standalone broker (a cluster of one
that is always this code) is never refused.
"""

from __future__ import annotations

from cursus.metadata.state import MetadataState
from cursus.wire.errors import BrokerError

#: Guarded TRUNCATE (lifecycle epochs fence replication and partition commits) - the spec's version 1.
LIFECYCLE_TRUNCATE = 1
#: Distributed compaction (facts B7 "Broker protocol versions": topic lifecycle 1, compaction 2).
LIFECYCLE_COMPACTION = 2
#: What this broker implements and advertises in its registration (TRUNCATE and distributed compaction).
LIFECYCLE_PROTOCOL_VERSION = LIFECYCLE_COMPACTION


def require_lifecycle_protocol(state: MetadataState, what: str, version: int = LIFECYCLE_TRUNCATE) -> None:
    """Refuse ``what`` (a short operation name for the error, e.g. ``truncate``) unless every active broker
    of a cluster state advertises lifecycle protocol ``version`` or newer. Pure; a standalone state passes.

    Raises:
        BrokerError: ``unsupported_topic_policy operation=<what> required_lifecycle_protocol=<version>
            brokers=<ids below it>`` (validation, not retryable).
    """
    if not state.cluster:
        return
    behind = sorted(b.id for b in state.brokers.values()
                    if b.status == "active" and b.lifecycle_protocol < version)
    if behind:
        raise BrokerError.of("unsupported_topic_policy", operation=what, required_lifecycle_protocol=version,
                             brokers=",".join(behind),
                             reason="an active broker does not advertise the required lifecycle protocol")
