"""Cluster commands: CLUSTER_STATUS, LIST_CLUSTER and ELECT_LEADER (spec "Cluster Management")."""

from __future__ import annotations

import datetime
import json
import time
import uuid

from cursus.broker.args import ElectLeaderArgs, NoArgs
from cursus.broker.core import Broker
from cursus.broker.request import Request
from cursus.cluster.status import cluster_status
from cursus.metadata.commands import ElectLeader
from cursus.wire.errors import BrokerError
from cursus.wire.responses import ok_text


def _raft(broker: Broker, command: str) -> dict[str, object]:
    raft = broker.metadata.raft_status()
    if raft is None:
        raise BrokerError.of("distribution_required", command=command)
    return raft


async def handle_cluster_status(broker: Broker, req: Request, args: NoArgs) -> bytes:
    """CLUSTER_STATUS -> ``OK cluster=<compact JSON>`` (facts B5 keys); ``distribution_required`` standalone."""
    raft = _raft(broker, "CLUSTER_STATUS")
    lag = broker.replication.replica_lag() if broker.replication is not None else None
    doc = cluster_status(broker.metadata.state, raft, broker.config.min_insync_replicas, lag)
    if broker.replication is not None:  # refused calls on this node's internal listener, by reason
        doc["internal_rejected_calls"] = broker.replication.refusals()
    return b"OK cluster=" + json.dumps(doc, separators=(",", ":")).encode()


async def handle_list_cluster(broker: Broker, req: Request, args: NoArgs) -> bytes:
    """LIST_CLUSTER -> ``OK brokers=<JSON array of {id, addr, client_addr, status, last_seen,
    lifecycle_protocol}>`` (facts B5): the registered brokers in id order; ``addr`` is the internal address,
    ``last_seen`` the UTC time this node last applied the broker's heartbeat (empty: not seen since this node
    started), ``lifecycle_protocol`` the topic lifecycle protocol version it advertises.
    ``distribution_required`` standalone."""
    _raft(broker, "LIST_CLUSTER")
    controller = getattr(broker.metadata, "controller", None)
    seen: dict[str, float] = dict(getattr(controller, "last_seen", {}))
    now_mono, now_wall = time.monotonic(), time.time()
    rows = []
    for info in sorted(broker.metadata.state.brokers.values(), key=lambda b: b.id):
        at = seen.get(info.id)
        last_seen = "" if at is None else datetime.datetime.fromtimestamp(
            now_wall - (now_mono - at), datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        rows.append({"id": info.id, "addr": info.internal_address, "client_addr": info.client_address,
                     "status": info.status, "last_seen": last_seen, "lifecycle_protocol": info.lifecycle_protocol})
    return b"OK brokers=" + json.dumps(rows, separators=(",", ":")).encode()


async def handle_elect_leader(broker: Broker, req: Request, args: ElectLeaderArgs) -> bytes:
    """ELECT_LEADER topic= partition= broker= ->
    ``OK topic= partition= previous_leader= leader= leader_epoch= changed=``.

    The command carries the leader epoch this broker sees as ``expected_leader_epoch``: if it moved
    meanwhile the FSM refuses (``leader_election_rejected``). A commit timeout is
    ``leader_election_result_unavailable`` (retryable: electing the current leader is a no-op).
    """
    _raft(broker, "ELECT_LEADER")
    assignment = broker.metadata.state.assignment(args.topic, args.partition)
    if assignment is None:
        broker.topic(args.topic)
        raise BrokerError.of("partition_not_found", topic=args.topic, partition=args.partition)
    command = ElectLeader(uuid.uuid4().hex, args.topic, args.partition, args.broker, assignment.leader_epoch)
    try:
        result = await broker.metadata.submit(command)
    except BrokerError as exc:
        if exc.error.code in ("request_timeout", "no_raft_leader"):
            raise BrokerError.of("leader_election_result_unavailable", topic=args.topic,
                                 partition=args.partition, reason=exc.error.code) from None
        raise
    now = broker.metadata.state.assignment(args.topic, args.partition)
    assert now is not None
    return ok_text(("topic", args.topic), ("partition", args.partition),
                   ("previous_leader", result.previous_leader or ""), ("leader", now.leader or ""),
                   ("leader_epoch", now.leader_epoch), ("changed", result.changed))
