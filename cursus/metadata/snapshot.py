"""The whole :class:`~cursus.metadata.state.MetadataState` as bytes (the Raft FSM's snapshot payload).

Sorted-key compact JSON with ``v: 1``; partitions are rows of :data:`PARTITION_COLUMNS` (named once in
``partition_columns``). Every partition carries explicit committed-HWM provenance (its
``committed_hwm_version`` column is 1 and ``committed_hwm`` an integer); :func:`decode_state` refuses a partition
without it (:class:`MissingProvenance`), and the Raft layer turns that into ``unsupported recovery
protocol``. Recently applied results (``applied``) are kept, so a retried request id answers the same on
a node restored from a snapshot as on one that replayed the journal.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from cursus.metadata.apply import ApplyResult
from cursus.metadata.state import (
    COMMITTED_HWM_VERSION,
    BrokerInfo,
    MetadataState,
    PartitionAssignment,
    ShardOwner,
)
from cursus.metadata.topics import TopicDefinition

STATE_VERSION = 1


class MissingProvenance(ValueError):
    """A snapshot partition has no (or another) ``committed_hwm_version``, or a non-integer HWM."""


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
    }
    if state.txn_shards:  # absent in states that never had a shard table (their bytes stay as they were)
        doc["txn_shards"] = [[shard, state.txn_shards[shard].owner, state.txn_shards[shard].epoch]
                             for shard in sorted(state.txn_shards)]
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def decode_state(data: bytes) -> MetadataState:
    """Parse :func:`encode_state` output.

    Raises:
        MissingProvenance: a partition lacks committed-HWM provenance.
        ValueError: anything else malformed (bad JSON, version, fields).
    """
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("v") != STATE_VERSION:
            raise ValueError("bad metadata state version")
        topics = {d["name"]: TopicDefinition.from_manifest(d) for d in doc["topics"]}
        if doc["partition_columns"] != list(PARTITION_COLUMNS):
            raise MissingProvenance(f"partition columns {doc['partition_columns']}")
        assignments = dict(_assignment(row) for row in doc["partitions"])
        brokers = {d["id"]: BrokerInfo.from_dict(d) for d in doc["brokers"]}
        applied = {str(rid): result_from_dict(r) for rid, r in doc["applied"]}
        shards = {int(shard): ShardOwner(None if owner is None else str(owner), int(epoch))
                  for shard, owner, epoch in doc.get("txn_shards", ())}
        return MetadataState(revision=int(doc["revision"]), topics=topics, assignments=assignments,
                             brokers=brokers, applied=applied, initial_leader_epoch=int(doc["initial_leader_epoch"]),
                             cluster=bool(doc["cluster"]), coordinator_shards=int(doc["coordinator_shards"]),
                             txn_shards=shards)
    except MissingProvenance:
        raise
    except (KeyError, TypeError, AttributeError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise ValueError(f"bad metadata state: {exc!r}") from None
