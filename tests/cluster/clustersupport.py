"""Three real broker processes forming a Raft metadata cluster on loopback, mutual TLS on."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.brokerproc import BrokerProcess
from tests.cluster.raftsupport import IDS, RaftPki, free_ports

#: Fast but load-tolerant timers (ms).
FAST_TIMERS = {
    "raft_election_timeout_min_ms": 400, "raft_election_timeout_max_ms": 800, "raft_heartbeat_ms": 50,
    "raft_poll_interval_ms": 20, "broker_heartbeat_interval_ms": 300, "broker_session_timeout_ms": 2000,
    "metadata_commit_timeout_ms": 3000,
    "replica_lag_time_max_ms": 1500, "replica_fetch_wait_max_ms": 200, "replica_fetch_backoff_ms": 50,
    "replica_ack_timeout_ms": 5000,
}


def cluster_settings(pki: RaftPki, node_id: str, members: str, **extra: Any) -> dict[str, object]:
    files = pki.files(node_id)
    return {"enabled_distribution": "true", "broker_id": node_id, "static_cluster_members": members,
            "internal_auth_token": "test-token", "internal_use_tls": "true",
            "internal_tls_cert_path": files.cert, "internal_tls_key_path": files.key,
            "internal_tls_ca_path": files.ca, "bootstrap_cluster": "true", **FAST_TIMERS, **extra}


class Cluster:
    """Three brokers ``node-1..3`` under ``root``; ``brokers[i]`` is a :class:`BrokerProcess`."""

    def __init__(self, root: Path, pki: RaftPki, **extra: Any) -> None:
        ports = free_ports(6)
        raft_ports, internal_ports = ports[:3], ports[3:]
        self.raft = {node_id: f"127.0.0.1:{port}" for node_id, port in zip(IDS, raft_ports, strict=True)}
        #: The internal (replication) listener of each node.
        self.internal = {node_id: f"127.0.0.1:{port}" for node_id, port in zip(IDS, internal_ports, strict=True)}
        members = ",".join(f"{node_id}@{address}" for node_id, address in self.raft.items())
        self.brokers = [BrokerProcess(root / node_id, settings=cluster_settings(
            pki, node_id, members, internal_broker_port=port, **extra))
            for node_id, port in zip(IDS, internal_ports, strict=True)]

    def start(self, brokers: list[BrokerProcess] | None = None, timeout_s: float = 60.0) -> None:
        """Start brokers concurrently (each waits for the Raft cluster before it reports ready)."""
        todo = brokers if brokers is not None else self.brokers
        with ThreadPoolExecutor(len(todo)) as pool:
            list(pool.map(lambda b: b.start(timeout_s=timeout_s), todo))

    def stop(self) -> None:
        for broker in self.brokers:
            broker.stop()

    def by_id(self, node_id: str) -> BrokerProcess:
        return self.brokers[IDS.index(node_id)]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            value = predicate()
        except Exception as exc:  # a broker restarting: keep polling until the deadline
            value, last = None, exc
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what} (last error: {last!r})")
        time.sleep(interval)


def wait_topic_ready(cluster: Cluster, topic: str, partitions: int, timeout: float = 15.0) -> None:
    """Wait until every broker has applied ``topic`` (METADATA answers) and each partition's leader serves
    it (LIST_OFFSETS answers): a CREATE answers once committed and open on the broker that took it; the
    others apply it a moment later."""
    from cursus.client.connection import Connection
    from cursus.wire import Status

    def everywhere() -> bool:
        for broker in cluster.brokers:
            with Connection(*broker.address, timeout_s=5) as conn:
                if conn.command(f"METADATA topic={topic}").status != Status.OK:
                    return False
                for p in range(partitions):
                    frame = conn.command(f"LIST_OFFSETS topic={topic} partition={p}")
                    if frame.status != Status.OK and b"NOT_LEADER" not in frame.payload:
                        return False
        return True

    wait_for(everywhere, timeout, f"{topic} ready on every broker")

