"""Compaction policy rules (CREATE patch semantics) and the cluster cleaning gate (pure functions)."""

from __future__ import annotations

import pytest

from cursus.broker.cleaning import cluster_gate
from cursus.metadata.state import BrokerInfo, MetadataState, PartitionAssignment
from cursus.metadata.topics import TopicSpec, apply_create, is_compacted_policy
from cursus.wire.errors import BrokerError


def _create(current, **fields):
    return apply_create(current, TopicSpec(topic="t", **fields), default_partitions=1, default_cleanup_policy="delete")


def test_compacted_policies_are_accepted_for_plain_topics() -> None:
    assert _create(None, cleanup_policy="compact").policy.cleanup_policy == "compact"
    topic = _create(None)
    assert _create(topic, cleanup_policy="delete,compact").policy.cleanup_policy == "delete,compact"
    assert is_compacted_policy("delete,compact") and not is_compacted_policy("delete")


@pytest.mark.parametrize("restated", [None, False])
def test_event_sourcing_topics_refuse_compaction(restated) -> None:
    with pytest.raises(BrokerError) as new:
        _create(None, event_sourcing=True, cleanup_policy="compact")
    assert new.value.error.code == "invalid_topic_policy"
    es = _create(None, event_sourcing=True)
    with pytest.raises(BrokerError) as patched:
        _create(es, event_sourcing=restated, cleanup_policy="delete,compact")
    assert patched.value.error.code in ("invalid_topic_policy", "invalid_event_sourcing")


def _state(statuses: dict[str, str]) -> MetadataState:
    return MetadataState(brokers={b: BrokerInfo(b, f"{b}:1", status=s) for b, s in statuses.items()}, cluster=True)


def test_cluster_gate_needs_a_full_isr_active_brokers_and_agreeing_epochs() -> None:
    active = _state({"a": "active", "b": "active", "c": "active"})
    full = PartitionAssignment(("a", "b", "c"), "a", 3, ("a", "b", "c"), committed_hwm=100, lifecycle_epoch=2)
    assert cluster_gate(active, full, lifecycle_epoch=2, leo=120, hwm=110) == 100
    assert cluster_gate(active, full, lifecycle_epoch=2, leo=120, hwm=90) == 90  # capped by the local HWM
    shrunk = PartitionAssignment(("a", "b", "c"), "a", 3, ("a", "b"), committed_hwm=100, lifecycle_epoch=2)
    assert cluster_gate(active, shrunk, lifecycle_epoch=2, leo=120, hwm=110) is None
    assert cluster_gate(active, full, lifecycle_epoch=1, leo=120, hwm=110) is None  # lifecycle epochs differ
    assert cluster_gate(active, full, lifecycle_epoch=2, leo=99, hwm=99) is None  # local log lacks the commit
    inactive = _state({"a": "active", "b": "inactive", "c": "active"})
    assert cluster_gate(inactive, full, lifecycle_epoch=2, leo=120, hwm=110) is None
    assert cluster_gate(active, None, lifecycle_epoch=2, leo=120, hwm=110) is None
