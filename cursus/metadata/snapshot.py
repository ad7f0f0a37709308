"""The whole :class:`~cursus.metadata.state.MetadataState` as bytes (the Raft FSM's snapshot payload).

Sorted-key compact JSON with ``v: 2``; partitions are rows of :data:`PARTITION_COLUMNS` (named once in
``partition_columns``). Every partition carries explicit committed-HWM provenance (its
``committed_hwm_version`` column is 1 and ``committed_hwm`` an integer); :func:`decode_state` refuses a partition
without it (:class:`MissingProvenance`), and the Raft layer turns that into ``unsupported recovery
protocol``. Recently applied results (``applied``) are kept, so a retried request id answers the same on
a node restored from a snapshot as on one that replayed the journal.

**Versions.** ``v: 2`` adds ``groups`` (consumer groups and committed offsets, :mod:`cursus.metadata.groups`:
one row per group, its payloads re-validated on decode). A ``v: 1`` state (written before groups moved into
the metadata log, when they lived in the replicated ``__consumer_offsets`` topic) is accepted with no groups
*only* when it has no ``__consumer_offsets`` topic, i.e. no group can have existed; otherwise it is refused
(:class:`UnsupportedGroupState`, so ``unsupported recovery protocol``): defaulting it would silently drop
every committed offset. ``v: 3`` adds ``txn`` (per coordinator shard: its producer-id counter and the latest
:class:`~cursus.transactions.state.TxnEntry` per transactional id, ``TxnSync``) and ``txn_touched``. A ``v: 2``
(or ``v: 1``) state is read with no transaction state: before v3 a cluster's shard owner answered
``UNSUPPORTED_FEATURE`` to every transaction command, so no cluster transaction can have existed. The Raft
snapshot container stays format 9.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from cursus.metadata.apply import ApplyResult
from cursus.metadata.groups import entry_from_row, entry_to_row
from cursus.metadata.state import (
    COMMITTED_HWM_VERSION,
    BrokerInfo,
    MetadataState,
    PartitionAssignment,
    ShardOwner,
    TxnShardState,
)
from cursus.metadata.topics import TopicDefinition
from cursus.transactions.state import TxnEntry

STATE_VERSION = 3
#: Older state versions :func:`decode_state` still reads (see the module docstring).
LEGACY_STATE_VERSIONS = (1, 2)
#: The topic whose presence in a v1 state means groups lived outside the metadata log.
LEGACY_OFFSETS_TOPIC = "__consumer_offsets"


class MissingProvenance(ValueError):
    """A snapshot partition has no (or another) ``committed_hwm_version``, or a non-integer HWM."""


class UnsupportedGroupState(ValueError):
    """A v1 state whose consumer groups lived in ``__consumer_offsets``: they cannot be carried over."""


def result_to_dict(result: ApplyResult) -> dict[str, Any]:
    """JSON-able form of ``result``; the CommitHwm fields appear only when non-empty (so results of other
    commands keep their bytes)."""
    doc: dict[str, Any] = {"topic": result.topic.to_manifest() if result.topic is not None else None,
                           "changed": result.changed, "added": [list(k) for k in result.added],
                           "removed": [list(k) for k in result.removed], "moved": [list(k) for k in result.moved],
                           "previous_leader": result.previous_leader}
    if result.hwm_accepted:
        doc["hwm_accepted"] = [list(k) for k in result.hwm_accepted]
    if result.hwm_rejected:
        doc["hwm_rejected"] = [list(r) for r in result.hwm_rejected]
    return doc


def _keys(items: Any) -> tuple[tuple[str, int], ...]:
    return tuple((str(t), int(p)) for t, p in items)


def result_from_dict(doc: Mapping[str, Any]) -> ApplyResult:
    """Inverse of :func:`result_to_dict`. Raises ValueError, KeyError, TypeError on bad input."""
    topic = TopicDefinition.from_manifest(doc["topic"]) if doc["topic"] is not None else None
    return ApplyResult(topic=topic, changed=bool(doc["changed"]), added=_keys(doc["added"]),
                       removed=_keys(doc["removed"]), moved=_keys(doc["moved"]),
                       previous_leader=doc["previous_leader"],
                       hwm_accepted=_keys(doc.get("hwm_accepted", ())),
                       hwm_rejected=tuple((str(t), int(p), str(r)) for t, p, r in doc.get("hwm_rejected", ())))


#: One partition row of the snapshot, in this order (rows keep 10,000 partitions fast to encode).
PARTITION_COLUMNS = ("topic", "partition", "replicas", "leader", "leader_epoch", "isr", "committed_hwm_version",
                     "committed_hwm", "lifecycle_epoch")


def _row(key: tuple[str, int], a: PartitionAssignment) -> list[Any]:
    return [key[0], key[1], list(a.replicas), a.leader, a.leader_epoch, list(a.isr), COMMITTED_HWM_VERSION,
            a.committed_hwm, a.lifecycle_epoch]


def _assignment(row: list[Any]) -> tuple[tuple[str, int], PartitionAssignment]:
    if len(row) != len(PARTITION_COLUMNS):
        raise MissingProvenance(f"partition row of {len(row)} columns, expected {len(PARTITION_COLUMNS)}")
    topic, partition, replicas, leader, epoch, isr, hwm_version, hwm, lifecycle = row
    if hwm_version != COMMITTED_HWM_VERSION or type(hwm) is not int:
        raise MissingProvenance(f"partition {topic}-{partition} without committed_hwm_version 1 and an "
                                "integer committed_hwm")
    return (str(topic), int(partition)), PartitionAssignment(
        replicas=tuple(replicas), leader=leader, leader_epoch=int(epoch), isr=tuple(isr), committed_hwm=hwm,
        lifecycle_epoch=int(lifecycle))


def encode_state(state: MetadataState) -> bytes:
    """Deterministic bytes of ``state`` (sorted keys; partitions ordered by topic and partition)."""
    doc = {
        "v": STATE_VERSION, "revision": state.revision, "cluster": state.cluster,
        "initial_leader_epoch": state.initial_leader_epoch, "coordinator_shards": state.coordinator_shards,
        "topics": [state.topics[name].to_manifest() for name in sorted(state.topics)],
        "partition_columns": list(PARTITION_COLUMNS),
        "partitions": [_row(key, state.assignments[key]) for key in sorted(state.assignments)],
        "brokers": [state.brokers[b].to_dict() for b in sorted(state.brokers)],
        "applied": [[rid, result_to_dict(r)] for rid, r in state.applied.items()],
        "groups": [entry_to_row(name, state.groups[name]) for name in sorted(state.groups)],
        "txn": [[shard, state.txn[shard].next_producer_id, state.txn[shard].last_request,
                 [state.txn[shard].entries[tid].to_json() for tid in sorted(state.txn[shard].entries)]]
                for shard in sorted(state.txn)],
        "txn_touched": sorted([t, p] for t, p in state.txn_touched),
    }
    if state.incarnations:  # absent in states without any (their bytes stay as they were)
        doc["incarnations"] = [[name, state.incarnations[name]] for name in sorted(state.incarnations)]
    if state.txn_shards:  # absent in states that never had a shard table (their bytes stay as they were)
        doc["txn_shards"] = [[shard, state.txn_shards[shard].owner, state.txn_shards[shard].epoch]
                             for shard in sorted(state.txn_shards)]
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def decode_state(data: bytes) -> MetadataState:
    """Parse :func:`encode_state` output.

    Raises:
        MissingProvenance: a partition lacks committed-HWM provenance.
        UnsupportedGroupState: a v1 state that had ``__consumer_offsets`` (its groups are not in it).
        ValueError: anything else malformed (bad JSON, version, fields, group rows).
    """
    try:
        doc = json.loads(data)
        version = doc.get("v") if isinstance(doc, dict) else None
        if version != STATE_VERSION and version not in LEGACY_STATE_VERSIONS:
            raise ValueError(f"bad metadata state version {version!r}")
        topics = {d["name"]: TopicDefinition.from_manifest(d) for d in doc["topics"]}
        if doc["partition_columns"] != list(PARTITION_COLUMNS):
            raise MissingProvenance(f"partition columns {doc['partition_columns']}")
        assignments = dict(_assignment(row) for row in doc["partitions"])
        brokers = {d["id"]: BrokerInfo.from_dict(d) for d in doc["brokers"]}
        applied = {str(rid): result_from_dict(r) for rid, r in doc["applied"]}
        shards = {int(shard): ShardOwner(None if owner is None else str(owner), int(epoch))
                  for shard, owner, epoch in doc.get("txn_shards", ())}
        txn: dict[int, TxnShardState] = {}
        touched: frozenset[tuple[str, int]] = frozenset()
        incarnations = {str(name): int(inc) for name, inc in doc.get("incarnations", ())}
        if not set(incarnations) <= set(topics):
            raise ValueError("an incarnation of an unknown topic")
        if version == STATE_VERSION:
            for shard, next_pid, last_request, entries in doc["txn"]:
                parsed = [TxnEntry.from_json(e) for e in entries]
                txn[int(shard)] = TxnShardState({e.transactional_id: e for e in parsed}, int(next_pid),
                                                str(last_request))
            touched = frozenset((str(t), int(p)) for t, p in doc["txn_touched"])
        if version in (2, STATE_VERSION):
            groups = dict(entry_from_row(row) for row in doc["groups"])
        elif LEGACY_OFFSETS_TOPIC in topics:
            raise UnsupportedGroupState(f"a v{version} metadata state keeps consumer groups in "
                                        f"{LEGACY_OFFSETS_TOPIC}; they cannot be carried into the metadata log")
        else:
            groups = {}
        return MetadataState(revision=int(doc["revision"]), topics=topics, assignments=assignments,
                             brokers=brokers, applied=applied, initial_leader_epoch=int(doc["initial_leader_epoch"]),
                             cluster=bool(doc["cluster"]), coordinator_shards=int(doc["coordinator_shards"]),
                             txn_shards=shards, groups=groups, txn=txn, txn_touched=touched,
                             incarnations=incarnations)
    except (MissingProvenance, UnsupportedGroupState):
        raise
    except (KeyError, TypeError, AttributeError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise ValueError(f"bad metadata state: {exc!r}") from None
