"""Placement at CREATE: replica sets from the consistent-hash ring (facts B7), leaders spread per topic."""

from __future__ import annotations

import collections
import uuid

from hypothesis import given, settings
from hypothesis import strategies as st

from cursus.metadata.apply import apply
from cursus.metadata.commands import BrokerHeartbeat, CreateTopic
from cursus.metadata.state import BrokerInfo, MetadataState, ring_replicas
from cursus.metadata.topics import TopicSpec

BROKERS = ("node-1", "node-2", "node-3", "node-4")


def _cluster(brokers: tuple[str, ...]) -> MetadataState:
    state = MetadataState(cluster=True)
    for broker in brokers:
        state, _ = apply(state, BrokerHeartbeat(uuid.uuid4().hex, BrokerInfo(broker, "h:1", "h:2"), 50))
    return state


@settings(max_examples=60, deadline=None)
@given(name=st.from_regex(r"[a-z][a-z0-9.-]{0,20}", fullmatch=True), partitions=st.integers(1, 40),
       brokers=st.integers(1, 4), rf=st.integers(1, 3), grow=st.integers(0, 10))
def test_leaders_are_spread_and_replica_sets_come_from_the_ring(name: str, partitions: int, brokers: int,
                                                                rf: int, grow: int) -> None:
    members = BROKERS[:brokers]
    rf = min(rf, brokers)
    state = _cluster(members)
    for count in (partitions, partitions + grow):  # growing the topic keeps old partitions, spreads new ones
        state, _ = apply(state, CreateTopic(uuid.uuid4().hex, TopicSpec(topic=name, partitions=count,
                                                                        replication_factor=rf)))
    rows = [state.assignments[(name, p)] for p in range(partitions + grow)]
    for p, a in enumerate(rows):
        assert set(a.replicas) == set(ring_replicas(members, f"{name}-{p}", rf)) and a.leader == a.replicas[0]
        assert a.isr == a.replicas
    counts = collections.Counter(a.leader for a in rows)
    eligible = {b for a in rows for b in a.replicas}
    # every leader is the least-loaded member of its own replica set at its turn: with full replica sets
    # (rf == brokers) that is a perfect spread
    if rf == brokers:
        assert max(counts.values()) - min(counts.get(b, 0) for b in eligible) <= 1, counts


def test_a_restarted_leader_moves_its_partitions_to_a_new_leader_epoch() -> None:
    """A registration with a new incarnation is a restart (even within the session timeout): the partitions
    the broker leads get leader epoch + 1 with the same leader; others and a plain heartbeat change nothing."""
    state = MetadataState(cluster=True)
    for broker in BROKERS[:3]:
        state, _ = apply(state, BrokerHeartbeat(uuid.uuid4().hex, BrokerInfo(broker, "h:1", "h:2", incarnation="a"), 50))
    state, _ = apply(state, CreateTopic(uuid.uuid4().hex, TopicSpec(topic="t", partitions=6, replication_factor=3)))
    before = dict(state.assignments)
    same, _ = apply(state, BrokerHeartbeat(uuid.uuid4().hex, BrokerInfo("node-1", "h:1", "h:2", incarnation="a"), 50))
    assert same.assignments == before
    after, result = apply(state, BrokerHeartbeat(uuid.uuid4().hex, BrokerInfo("node-1", "h:1", "h:2", incarnation="b"),
                                                 50))
    led = {k for k, a in before.items() if a.leader == "node-1"}
    assert led and set(result.moved) == led
    for key, a in after.assignments.items():
        expected = before[key].leader_epoch + (key in led)
        assert (a.leader, a.leader_epoch, a.isr) == (before[key].leader, expected, before[key].isr)
