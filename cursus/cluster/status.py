"""CLUSTER_STATUS: the cluster's health as one JSON document (facts B5 "CLUSTER_STATUS"), pure.

``healthy`` means: a Raft leader, every registered broker active, no leaderless and no under-replicated
partition. A broker adds ``replica_lag`` (follower -> records and seconds behind) to the partitions it
leads: only a leader knows its followers' progress (``cursusctl cluster-status`` asks every broker).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cursus.metadata.state import MetadataState


def partition_status(state: MetadataState, key: tuple[str, int], min_isr_default: int) -> dict[str, Any]:
    topic, partition = key
    a = state.assignments[key]
    defn = state.topics.get(topic)
    active = [b for b in a.replicas if b in state.brokers and state.brokers[b].status == "active"]
    inactive = [b for b in a.replicas if b not in active]
    min_isr = defn.effective_min_isr(min_isr_default) if defn is not None else min_isr_default
    expected = defn.replication_factor if defn is not None else len(a.replicas)
    leader_available = a.leader is not None and a.leader in active
    under = len(a.isr) < len(a.replicas)
    min_isr_unsatisfied = len(a.isr) < min(min_isr, len(a.replicas))
    reasons = [r for r, bad in (("leaderless", not leader_available), ("under_replicated", under),
                                ("inactive_replicas", bool(inactive)),
                                ("min_isr_unsatisfied", min_isr_unsatisfied)) if bad]
    doc: dict[str, Any] = {
        "key": f"{topic}-{partition}", "topic": topic, "partition": partition, "leader": a.leader or "",
        "leader_epoch": a.leader_epoch, "replicas": list(a.replicas), "isr": list(a.isr),
        "committed_hwm": a.committed_hwm, "expected_replicas": expected, "active_replicas": len(active),
        "inactive_replicas": len(inactive), "in_sync_replicas": len(a.isr), "min_in_sync_replicas": min_isr,
        "leader_available": leader_available, "assignment_complete": len(a.replicas) >= expected,
        "under_replicated": under, "min_isr_unsatisfied": min_isr_unsatisfied,
        "healthy": leader_available and not under,
    }
    if reasons:
        doc["reasons"] = reasons
    return doc


def cluster_status(state: MetadataState, raft: Mapping[str, Any], min_isr_default: int,
                   lag: Mapping[tuple[str, int], Mapping[str, tuple[int, float]]] | None = None) -> dict[str, Any]:
    """The CLUSTER_STATUS document. ``raft``: ``leader_id``, ``is_leader``, ``term``, ``commit_index``,
    ``applied_index``, ``rejected_connections`` (this node's refused Raft peers by reason; see
    :class:`cursus.cluster.raft.node.RaftStatus`). ``lag``: the follower lag of partitions led here
    (records, seconds).

    ``raft_applied_index`` is read live from the Raft tick thread, while everything derived from ``state``
    (brokers, partitions) is this node's event-loop view, which trails the applied index by the states still
    queued for the loop (more after a restart or under load). ``metadata_revision`` is that view's own
    version (:attr:`MetadataState.revision`): the same revision is the same state on every node, so it (not
    the applied index) orders partition observations across nodes."""
    partitions = [partition_status(state, key, min_isr_default) for key in sorted(state.assignments)]
    for row in partitions:
        rows = (lag or {}).get((row["topic"], row["partition"]))
        if rows is not None:
            row["replica_lag"] = {b: {"records": r, "seconds": round(sec, 3)} for b, (r, sec) in sorted(rows.items())}
    brokers = [state.brokers[b] for b in sorted(state.brokers)]
    active = [b for b in brokers if b.status == "active"]
    leaderless = sum(not p["leader_available"] for p in partitions)
    under = sum(p["under_replicated"] for p in partitions)
    has_leader = bool(raft.get("leader_id"))
    return {
        "raft_leader": raft.get("leader_id") or "",
        "raft_state": "leader" if raft.get("is_leader") else "follower" if has_leader else "unavailable",
        "raft_term": raft.get("term", 0),
        "raft_applied_index": raft.get("applied_index", 0),
        "raft_commit_index": raft.get("commit_index", 0),
        "metadata_revision": state.revision,
        "raft_rejected_connections": raft.get("rejected_connections", {}),
        "broker_count": len(brokers), "active_brokers": len(active), "inactive_brokers": len(brokers) - len(active),
        "partition_count": len(partitions), "leaderless_partitions": leaderless,
        "under_replicated_partitions": under,
        "assignment_deficient_partitions": sum(not p["assignment_complete"] for p in partitions),
        "inactive_replica_partitions": sum(p["inactive_replicas"] > 0 for p in partitions),
        "inactive_replicas": sum(p["inactive_replicas"] for p in partitions),
        "min_isr_unsatisfied_partitions": sum(p["min_isr_unsatisfied"] for p in partitions),
        "healthy": has_leader and len(active) == len(brokers) and not leaderless and not under,
        "brokers": [{"id": b.id, "status": b.status, "addr": b.internal_address, "client_addr": b.client_address,
                     "lifecycle_protocol": b.lifecycle_protocol}
                    for b in brokers],
        "partitions": partitions,
    }
