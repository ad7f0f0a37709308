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
from cursus.transactions.state import TxnEntry

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
        incarnation: a random id of the broker *process* (new at every start, like Kafka's broker epoch): a
            registration with another incarnation is a restart, and the partitions it leads move to a new
            leader epoch (a restarted leader never resumes its old epoch with a different tail).
        lifecycle_protocol: the topic lifecycle protocol version the broker implements (spec TRUNCATE:
            version 1 = guarded TRUNCATE; 0 = none, e.g. a registration from an older broker), see
            :mod:`cursus.metadata.lifecycle`.
    """

    id: str
    client_address: str
    internal_address: str = ""
    status: str = "active"
    incarnation: str = ""
    lifecycle_protocol: int = 0

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"id": self.id, "client_address": self.client_address,
                               "internal_address": self.internal_address, "status": self.status,
                               "incarnation": self.incarnation}
        if self.lifecycle_protocol:  # absent for 0, so older registrations keep their bytes
            doc["lifecycle_protocol"] = self.lifecycle_protocol
        return doc

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> BrokerInfo:
        """Strict parse; raises ValueError on unknown/missing fields or a bad status (``incarnation`` and
        ``lifecycle_protocol`` may be absent: an older command or snapshot)."""
        if not {"id", "client_address", "internal_address", "status"} <= set(doc) <= {
                "id", "client_address", "internal_address", "status", "incarnation", "lifecycle_protocol"}:
            raise ValueError(f"bad broker fields {sorted(doc)}")
        protocol = doc.get("lifecycle_protocol", 0)
        if type(protocol) is not int or protocol < 0:
            raise ValueError("bad broker lifecycle_protocol")
        if (not all(isinstance(doc[k], str) for k in doc if k != "lifecycle_protocol")
                or doc["status"] not in BROKER_STATUSES or not doc["id"]):
            raise ValueError("bad broker values")
        return cls(doc["id"], doc["client_address"], doc["internal_address"], doc["status"],
                   doc.get("incarnation", ""), protocol)


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
class ShardOwner:
    """The owner of one transaction-coordinator shard and its coordinator epoch (bumped per owner change)."""

    owner: str | None
    epoch: int


@dataclass(frozen=True, slots=True)
class TxnShardState:
    """Cluster only: the transaction-coordinator state of one shard, as its owner's ``TxnSync`` commands
    left it (the same per-transactional-id snapshots the standalone journal persists).

    Attributes:
        entries: transactional id -> its latest :class:`~cursus.transactions.state.TxnEntry`.
        next_producer_id: the shard's producer-id counter ``n`` (ids are ``n * shards + shard``, so the
            shards never collide); only grows.
        last_request: request id of the last applied ``TxnSync`` (observers tell theirs apart).
    """

    entries: Mapping[str, TxnEntry] = field(default_factory=dict)
    next_producer_id: int = 1
    last_request: str = ""


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
        txn_shards: per transaction-coordinator shard its owner (None: no active broker) and its
            coordinator epoch (facts B7): derived by ``apply`` whenever the active brokers change, the epoch
            bumped on every change of owner; the epoch goes into the shard's transaction markers.
        groups: cluster only: consumer group name -> its compacted records (registration or tombstone,
            membership, offset snapshots), see :mod:`cursus.metadata.groups`. Standalone keeps groups in
            ``__consumer_offsets`` and this stays empty.
        txn: cluster only: transaction-coordinator shard -> its entries (``TxnSync``); standalone keeps
            them in ``__transaction_state.journal`` and this stays empty.
        txn_touched: cluster only: every partition that ever took a transactional record (a new leader of
            one rebuilds its transaction index from its log).
        incarnations: cluster only: topic name -> the state revision that created it (unique and growing
            over the cluster's history, so a topic deleted and created again under the same name is told
            apart by every replica's storage marker, :mod:`cursus.broker.topic_storage`). Standalone keeps
            it empty (incarnation 0: its manifest is the only authority and removal is synchronous).
    """

    revision: int = 0
    topics: Mapping[str, TopicDefinition] = field(default_factory=dict)
    assignments: Mapping[PartitionKey, PartitionAssignment] = field(default_factory=dict)
    brokers: Mapping[str, BrokerInfo] = field(default_factory=dict)
    applied: Mapping[str, Any] = field(default_factory=dict)
    initial_leader_epoch: int = FIRST_LEADER_EPOCH
    cluster: bool = False
    coordinator_shards: int = 0
    txn_shards: Mapping[int, ShardOwner] = field(default_factory=dict)
    groups: Mapping[str, GroupEntry] = field(default_factory=dict)
    incarnations: Mapping[str, int] = field(default_factory=dict)
    txn: Mapping[int, TxnShardState] = field(default_factory=dict)
    txn_touched: frozenset[tuple[str, int]] = frozenset()

    def txn_entry(self, transactional_id: str) -> TxnEntry | None:
        """The applied coordinator entry of ``transactional_id`` (cluster), or None."""
        if not self.coordinator_shards:
            return None
        shard = self.txn.get(transaction_shard(transactional_id, self.coordinator_shards))
        return shard.entries.get(transactional_id) if shard is not None else None

    def topic(self, name: str) -> TopicDefinition | None:
        return self.topics.get(name)

    def names(self) -> list[str]:
        return sorted(self.topics)

    def incarnation(self, name: str) -> int:
        """The incarnation of topic ``name`` (0: standalone, or created before incarnations were kept)."""
        return self.incarnations.get(name, 0)

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


def shard_ring_owner(active: list[str], shard: int) -> str | None:
    """The ring owner of ``shard``: ``__transaction_coordinator-<shard>`` over the active brokers (facts B7)."""
    owners = ring_replicas(active, f"__transaction_coordinator-{shard}", 1)
    return owners[0] if owners else None


def derive_txn_shards(state: MetadataState) -> Mapping[int, ShardOwner]:
    """Shard owners for ``state``'s active brokers, keeping each shard's epoch while its owner stays and
    bumping it when the owner changes (a shard seen for the first time starts at epoch 1)."""
    if not state.coordinator_shards:
        return state.txn_shards
    active = state.active_brokers()
    out: dict[int, ShardOwner] = {}
    for shard in range(state.coordinator_shards):
        owner = shard_ring_owner(active, shard)
        previous = state.txn_shards.get(shard)
        if previous is None:
            out[shard] = ShardOwner(owner, 1)
        elif previous.owner != owner:
            out[shard] = ShardOwner(owner, previous.epoch + 1)
        else:
            out[shard] = previous
    return out


def transaction_coordinator(state: MetadataState, transactional_id: str) -> str | None:
    """The owner of ``transactional_id``'s shard (the FSM's shard table; the active ring when the table is
    empty, e.g. restored from an older snapshot); None when no shard count is fixed yet or no broker is
    active."""
    if not state.coordinator_shards:
        return None
    shard = transaction_shard(transactional_id, state.coordinator_shards)
    found = state.txn_shards.get(shard)
    if found is not None:
        return found.owner
    return shard_ring_owner(state.active_brokers(), shard)


def transaction_coordinator_epoch(state: MetadataState, transactional_id: str) -> int:
    """The coordinator epoch of ``transactional_id``'s shard (0 standalone or before the table exists)."""
    if not state.coordinator_shards:
        return 0
    found = state.txn_shards.get(transaction_shard(transactional_id, state.coordinator_shards))
    return found.epoch if found is not None else 0


def place(topic: TopicDefinition, partition: int, active: list[str], leader_epoch: int,
          leaders: Mapping[str, int] | None = None) -> PartitionAssignment:
    """A fresh assignment for a new partition: RF capped by the active brokers, ISR = replicas (every
    replica is empty, so all are in sync), committed HWM 0.

    The replica *set* is the consistent-hash ring's (facts B7). The leader (replicas[0], the preferred
    leader) is the member of that set leading the fewest of the topic's partitions so far (``leaders``:
    broker -> count; ties keep ring order), and the set is rotated to start with it: neighbouring keys
    often hash to one arc of the ring, which would otherwise put most leaders of a topic on one broker.
    """
    replicas = ring_replicas(active, f"{topic.name}-{partition}", min(topic.replication_factor, len(active)))
    if replicas and leaders:
        first = min(range(len(replicas)), key=lambda i: (leaders.get(replicas[i], 0), i))
        replicas = replicas[first:] + replicas[:first]
    return PartitionAssignment(replicas=replicas, leader=replicas[0] if replicas else None,
                               leader_epoch=leader_epoch, isr=replicas, committed_hwm=0,
                               lifecycle_epoch=topic.lifecycle_epoch)
