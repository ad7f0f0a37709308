"""The authoritative metadata state: topic definitions, partition assignment and the broker registry.

Everything here is a frozen value; :func:`cursus.metadata.apply.apply` builds a new state per command and
never mutates an old one (the mappings are copied on write and must be treated as read-only).

Placement (facts B7 "Partition placement at creation"): replicas are chosen over the *active* registered
brokers on a consistent-hash ring (CRC-32 IEEE, 150 virtual nodes per broker keyed ``"<broker>:<i>"``,
``GetN("<topic>-<p>", RF)``); leader = replicas[0]; ISR = replicas; leader epoch = 1. Existing partitions
keep their assignment. Standalone is a cluster of one, so every partition lands on the local broker (with
leader epoch 0, as the reference's standalone mode reports).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cursus.metadata.groups import GroupEntry
from cursus.metadata.topics import TopicDefinition

#: Virtual nodes per broker on the placement ring (facts B7).
RING_VIRTUAL_NODES = 150
#: Version of the ``committed_hwm`` field of a partition assignment (facts B6 FSM snapshot).
COMMITTED_HWM_VERSION = 1
#: The first leader epoch of a newly placed partition in a cluster (facts B7); standalone reports 0
#: (facts B5 METADATA "Standalone epochs are all 0"), see :attr:`MetadataState.initial_leader_epoch`.
FIRST_LEADER_EPOCH = 1
BROKER_STATUSES = ("active", "inactive")


@dataclass(frozen=True, slots=True)
class BrokerInfo:
    """One registered broker.

    Attributes:
        id: ``<advertised_host>-<broker_port>`` by default (facts B7 "Broker identity").
        client_address: ``host:port`` clients connect to.
        internal_address: ``host:port`` for broker-to-broker traffic; empty while there is none.
        status: ``active`` (eligible for placement) or ``inactive``.
    """

    id: str
    client_address: str
    internal_address: str = ""
    status: str = "active"

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "client_address": self.client_address, "internal_address": self.internal_address,
                "status": self.status}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> BrokerInfo:
        """Strict parse; raises ValueError on unknown/missing fields or a bad status."""
        if set(doc) != {"id", "client_address", "internal_address", "status"}:
            raise ValueError(f"bad broker fields {sorted(doc)}")
        if not all(isinstance(doc[k], str) for k in doc) or doc["status"] not in BROKER_STATUSES or not doc["id"]:
            raise ValueError("bad broker values")
        return cls(doc["id"], doc["client_address"], doc["internal_address"], doc["status"])


@dataclass(frozen=True, slots=True)
class PartitionAssignment:
    """Where one partition lives and who leads it.

    Attributes:
        replicas: broker ids, preferred leader first.
        leader: broker id of the leader, or None when leaderless.
        leader_epoch: bumped on every leader change (starts at the state's ``initial_leader_epoch``).
        isr: the in-sync replica set (a subset of ``replicas``).
        committed_hwm: the committed high watermark the metadata log knows (records); standalone keeps it 0
            and the local replica is the source of the live HWM.
        lifecycle_epoch: the topic lifecycle epoch the assignment belongs to.
    """

    replicas: tuple[str, ...]
    leader: str | None
    leader_epoch: int = FIRST_LEADER_EPOCH
    isr: tuple[str, ...] = ()
    committed_hwm: int = 0
    lifecycle_epoch: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"replicas": list(self.replicas), "leader": self.leader, "leader_epoch": self.leader_epoch,
                "isr": list(self.isr), "committed_hwm_version": COMMITTED_HWM_VERSION,
                "committed_hwm": self.committed_hwm, "lifecycle_epoch": self.lifecycle_epoch}


PartitionKey = tuple[str, int]


@dataclass(frozen=True, slots=True)
class MetadataState:
    """One immutable version of all authoritative metadata.

    Attributes:
        revision: bumped by every command that changes something (monotonic, starts at 0).
        topics: name -> definition.
        assignments: (topic, partition) -> assignment, for every partition of every topic.
        brokers: broker id -> registration.
        applied: request id -> result of recently applied commands (a retried command applies once);
            bounded to :data:`APPLIED_REQUESTS_KEPT` entries, oldest dropped first.
        initial_leader_epoch: the leader epoch of a newly placed partition: 1 in a cluster (facts B7),
            0 standalone (facts B5: standalone METADATA reports epochs 0).
        cluster: True for the Raft cluster's state. A cluster refuses a replication factor above the
            registered brokers (``invalid_replication_factor``) instead of capping it; only a cluster
            accepts ``CommitHwm`` (standalone commits its HWM locally and keeps ``committed_hwm`` 0).
        coordinator_shards: the cluster's ``transaction_coordinator_shards`` (0 until the first broker
            heartbeat fixes it; immutable after).
        groups: cluster only: consumer group name -> its compacted records (registration or tombstone,
            membership, offset snapshots), see :mod:`cursus.metadata.groups`. Standalone keeps groups in
            ``__consumer_offsets`` and this stays empty.
    """

    revision: int = 0
    topics: Mapping[str, TopicDefinition] = field(default_factory=dict)
    assignments: Mapping[PartitionKey, PartitionAssignment] = field(default_factory=dict)
    brokers: Mapping[str, BrokerInfo] = field(default_factory=dict)
    applied: Mapping[str, Any] = field(default_factory=dict)
    initial_leader_epoch: int = FIRST_LEADER_EPOCH
    cluster: bool = False
    coordinator_shards: int = 0
    groups: Mapping[str, GroupEntry] = field(default_factory=dict)

    def topic(self, name: str) -> TopicDefinition | None:
        return self.topics.get(name)

    def names(self) -> list[str]:
        return sorted(self.topics)

    def assignment(self, topic: str, partition: int) -> PartitionAssignment | None:
        return self.assignments.get((topic, partition))

    def partitions_on(self, broker_id: str) -> set[PartitionKey]:
        """Every (topic, partition) with ``broker_id`` among its replicas."""
        return {key for key, a in self.assignments.items() if broker_id in a.replicas}

    def active_brokers(self) -> list[str]:
        return sorted(b.id for b in self.brokers.values() if b.status == "active")

    def group_coordinator(self, group: str) -> str | None:
        """The broker that coordinates ``group`` in this state: ``ring.Get(group)`` over the active brokers
        (facts B7), None when no broker is active."""
        return group_coordinator(self.active_brokers(), group)


APPLIED_REQUESTS_KEPT = 1024


@functools.lru_cache(maxsize=16)
def _ring(brokers: tuple[str, ...]) -> list[tuple[int, str]]:
    return sorted((zlib.crc32(f"{b}:{i}".encode()), b) for b in brokers for i in range(RING_VIRTUAL_NODES))


def ring_replicas(brokers: Iterable[str], key: str, count: int) -> tuple[str, ...]:
    """``count`` distinct brokers for ``key`` on the consistent-hash ring (facts B7), ring order."""
    points = _ring(tuple(sorted(set(brokers))))
    if not points or count <= 0:
        return ()
    start = bisect.bisect_left(points, (zlib.crc32(key.encode()), ""))
    chosen: list[str] = []
    for i in range(len(points)):
        broker = points[(start + i) % len(points)][1]
        if broker not in chosen:
            chosen.append(broker)
            if len(chosen) == count:
                break
    return tuple(chosen)


def group_coordinator(active_brokers: Iterable[str], group: str) -> str | None:
    """The broker owning ``group``: ``ring.Get(group)`` over the active brokers (facts B7), or None."""
    owners = ring_replicas(active_brokers, group, 1)
    return owners[0] if owners else None


def transaction_shard(transactional_id: str, shards: int) -> int:
    """The coordinator shard of ``transactional_id`` (facts B7): the first 8 bytes of its SHA-256 as a
    big-endian integer, modulo ``shards``."""
    return int.from_bytes(hashlib.sha256(transactional_id.encode()).digest()[:8], "big") % shards


def transaction_coordinator(state: MetadataState, transactional_id: str) -> str | None:
    """The owner of ``transactional_id``'s shard: ``__transaction_coordinator-<shard>`` on the ring of
    active brokers (facts B7); None when no shard count is fixed yet or no broker is active."""
    if not state.coordinator_shards:
        return None
    shard = transaction_shard(transactional_id, state.coordinator_shards)
    owners = ring_replicas(state.active_brokers(), f"__transaction_coordinator-{shard}", 1)
    return owners[0] if owners else None


def place(topic: TopicDefinition, partition: int, active: list[str], leader_epoch: int) -> PartitionAssignment:
    """A fresh assignment for a new partition: RF capped by the active brokers, leader = replicas[0],
    ISR = replicas (every replica is empty, so all are in sync), committed HWM 0."""
    replicas = ring_replicas(active, f"{topic.name}-{partition}", min(topic.replication_factor, len(active)))
    return PartitionAssignment(replicas=replicas, leader=replicas[0] if replicas else None,
                               leader_epoch=leader_epoch, isr=replicas, committed_hwm=0,
                               lifecycle_epoch=topic.lifecycle_epoch)
