"""The harness's own Raft cluster: N broker processes, mutual TLS, each in its own network namespace.

* :func:`make_cluster` builds a :class:`chaos.nodes.Cluster` whose nodes run under ``ip netns exec
  chaos-n<i>`` and bind ``10.77.<i+1>.2`` (see :mod:`chaos.netns`), on fixed ports (every node has its own
  address, so every node can use the same port numbers), with certificates made by
  :func:`cursus.cluster.certs.generate_cluster_certs` under ``<out>/certs``.
* :class:`LeaderTracker` polls ``CLUSTER_STATUS`` on every node, records each answer in the history
  (``f="cluster-status"``, process ``status-<i>``) and keeps the freshest view (highest metadata revision,
  :func:`chaos.checkers.status_freshness`) for routing: :meth:`LeaderTracker.leader_of` is the node index that leads a partition, or None.
* :func:`inspect_replicas` reads every replica's segment files directly after the final stop and returns
  per (topic, partition, replica) the chunks below the committed HWM, for the replica-divergence checker.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Any

from chaos import faults
from chaos.checkers import status_freshness as freshness
from chaos.history import INFO, OK, History
from chaos.netns import Network, node_address
from chaos.nodes import Cluster
from cursus.client.connection import Connection

#: Ports every node uses on its own address.
CLIENT_PORT, RAFT_PORT, INTERNAL_PORT = 9092, 9093, 9094
#: Timers for chaos clusters (ms): fast enough that failovers happen within a run, slow enough for two shared
#: cores. Pauses are drawn longer than the election timeout (see ``chaos.schedule``).
CLUSTER_TIMERS: dict[str, object] = {
    "raft_election_timeout_min_ms": 800, "raft_election_timeout_max_ms": 1600, "raft_heartbeat_ms": 100,
    "raft_poll_interval_ms": 20, "broker_heartbeat_interval_ms": 400, "broker_session_timeout_ms": 3000,
    "metadata_commit_timeout_ms": 4000, "replica_lag_time_max_ms": 2500, "replica_fetch_wait_max_ms": 200,
    "replica_fetch_backoff_ms": 50, "replica_ack_timeout_ms": 6000, "replica_isr_check_interval_ms": 300,
}
#: A cluster node's start waits for a Raft quorum; on two loaded cores that can take a while (s).
NODE_START_TIMEOUT_S = 60.0
#: How often each node's CLUSTER_STATUS is polled (s).
STATUS_POLL_S = 0.4
TOKEN = "chaos-internal-token"
OFFSETS_TOPIC = "__consumer_offsets"


def node_id(index: int) -> str:
    """Broker id of node ``index``."""
    return f"node-{index}"


def make_cluster(out: Path, nodes: int, network: Network, *, settings: dict[str, object],
                 env: dict[str, str]) -> Cluster:
    """A :class:`Cluster` of ``nodes`` Raft brokers in ``network``'s namespaces (certificates under ``out/certs``)."""
    from cursus.cluster.certs import generate_cluster_certs

    certs = out / "certs"
    generate_cluster_certs(certs, [node_id(i) for i in range(nodes)],
                           [node_address(i) for i in range(nodes)] + ["127.0.0.1", "localhost"])
    members = ",".join(f"{node_id(i)}@{node_address(i)}:{RAFT_PORT}" for i in range(nodes))
    cluster = Cluster(out, nodes, settings=settings, env=env)
    for node in cluster.nodes:
        i = node.index
        node.host = node_address(i)
        node.port = CLIENT_PORT
        node.prefix = network.exec_prefix(i)
        node.start_timeout_s = NODE_START_TIMEOUT_S
        node.settings = {**settings, **CLUSTER_TIMERS,
                         "enabled_distribution": "true", "broker_id": node_id(i), "raft_port": RAFT_PORT,
                         "internal_broker_port": INTERNAL_PORT, "static_cluster_members": members,
                         "bootstrap_cluster": "true", "internal_auth_token": TOKEN, "internal_use_tls": "true",
                         "internal_tls_cert_path": certs / f"{node_id(i)}.crt",
                         "internal_tls_key_path": certs / f"{node_id(i)}.key",
                         "internal_tls_ca_path": certs / "ca.crt"}
    cluster.concurrent_start = True
    return cluster


def parse_status(text: str) -> dict[str, Any]:
    """The compact result of a ``CLUSTER_STATUS`` reply: raft leader/term/applied index, the metadata
    ``revision`` of the view (None from a broker that does not report it), and per partition
    ``"topic/p": {leader, leader_epoch, committed_hwm, isr}``.

    Raises:
        ValueError: not an ``OK cluster=<json>`` reply.
    """
    if not text.startswith("OK cluster="):
        raise ValueError(f"not a CLUSTER_STATUS reply: {text[:80]!r}")
    doc = json.loads(text[len("OK cluster="):])
    parts = {f"{p['topic']}/{p['partition']}": {"leader": p.get("leader") or "", "leader_epoch": p.get("leader_epoch"),
                                                 "committed_hwm": p.get("committed_hwm"), "isr": p.get("isr")}
             for p in doc.get("partitions", [])}
    active = sorted(b["id"] for b in doc.get("brokers", []) if b.get("status") == "active")
    return {"raft_leader": doc.get("raft_leader") or "", "raft_term": doc.get("raft_term", 0),
            "applied": doc.get("raft_applied_index", 0), "revision": doc.get("metadata_revision"),
            "partitions": parts, "active": active}


class LeaderTracker(threading.Thread):
    """Polls every node's CLUSTER_STATUS, records it, and keeps the freshest view for routing.

    Args:
        cluster: the nodes.
        history: the run history (each poll is an operation ``cluster-status`` of process ``status-<i>``).
        stop: set to end the thread.
    """

    def __init__(self, cluster: Cluster, history: History, stop: threading.Event) -> None:
        super().__init__(name="leader-tracker", daemon=True)
        self.cluster = cluster
        self.history = history
        self.stop_event = stop
        self.lock = threading.Lock()
        self.view: dict[str, Any] = {"applied": -1, "partitions": {}, "raft_leader": ""}
        self.ids = {node_id(n.index): n.index for n in cluster.nodes}

    def run(self) -> None:
        """Poll until stopped."""
        while not self.stop_event.is_set():
            for node in self.cluster.nodes:
                if node.state == "up":
                    self.poll(node.index)
            self.stop_event.wait(STATUS_POLL_S)

    def poll(self, index: int, *, final: bool = False) -> dict[str, Any] | None:
        """One recorded CLUSTER_STATUS of node ``index``; returns the parsed result or None."""
        node = self.cluster.nodes[index]
        pending = self.history.invoke(f"status-{index}", "cluster-status", {"node": index, "final": final})
        try:
            with Connection(*node.address, timeout_s=2.0) as conn:
                text = conn.command("CLUSTER_STATUS").payload.decode("utf-8", "replace")
            result = parse_status(text)
        except (OSError, ValueError, Exception) as exc:  # noqa: BLE001 - any failure is an unknown outcome
            self.history.complete(pending, INFO, error=f"{type(exc).__name__}: {exc}")
            return None
        self.history.complete(pending, OK, result)
        with self.lock:
            if freshness(result) >= freshness(self.view):
                self.view = result
        return result

    def leader_of(self, topic: str, partition: int) -> int | None:
        """The node index leading ``topic/partition`` in the freshest view, or None."""
        with self.lock:
            entry = self.view["partitions"].get(f"{topic}/{partition}")
        if not entry or not entry["leader"]:
            return None
        return self.ids.get(entry["leader"])

    def coordinator_of(self, group: str) -> int | None:
        """The node index coordinating ``group`` in the freshest view (the ring owner over the active brokers,
        as the brokers compute it), or None."""
        from cursus.metadata.state import group_coordinator

        with self.lock:
            active = list(self.view.get("active", ()))
        owner = group_coordinator(active, group)
        return self.ids.get(owner) if owner else None

    def raft_leader(self) -> int | None:
        """The node index of the Raft leader in the freshest view, or None."""
        with self.lock:
            return self.ids.get(self.view.get("raft_leader") or "")

    def partitions(self) -> dict[str, Any]:
        """The freshest per-partition view."""
        with self.lock:
            return dict(self.view["partitions"])


def wait_settled(tracker: LeaderTracker, keys: list[tuple[str, int]], timeout_s: float) -> dict[str, Any]:
    """Poll every node until one answers with a leader for every partition in ``keys`` and its ISR full.

    Returns the last view (the caller checks it); records every poll with ``final: true``.
    """
    deadline = time.monotonic() + timeout_s
    view: dict[str, Any] = {}
    while time.monotonic() < deadline:
        for node in tracker.cluster.nodes:
            result = tracker.poll(node.index, final=True)
            if result is None:
                continue
            view = result
            parts = result["partitions"]
            if all(parts.get(f"{t}/{p}", {}).get("leader") and len(parts[f"{t}/{p}"].get("isr") or [])
                   == len(tracker.cluster) for t, p in keys):
                return result
        time.sleep(0.3)
    return view


def inspect_replicas(cluster: Cluster, status: dict[str, Any], history: History) -> None:
    """Read each replica's log files and record, per replica, the chunks below the committed HWM.

    Recorded as ``f="replica-log"`` ops of process ``inspect`` with value ``{topic, partition, replica,
    committed_hwm}`` and result ``{chunks: [[base_offset, record_count, sha256-of-chunk-bytes], ...],
    end}`` (the chunks starting below the committed HWM; ``end``: the offset after the last complete chunk
    on disk). Chunks are compared byte for byte
    by :func:`chaos.checkers.check_replica_divergence`. Call after the nodes are stopped.
    """
    for key, entry in sorted(status.get("partitions", {}).items()):
        topic, _, part = key.rpartition("/")
        hwm = entry.get("committed_hwm")
        if hwm is None:
            continue
        for node in cluster.nodes:
            pdir = faults.partition_dir(node.data_dir, topic, int(part))
            pending = history.invoke("inspect", "replica-log", {"topic": topic, "partition": int(part),
                                                                "replica": node.index, "committed_hwm": hwm})
            if not pdir.exists():
                history.complete(pending, INFO, error=f"no directory {pdir}")
                continue
            chunks: list[list[Any]] = []
            end = 0
            for segment in faults.segment_files(pdir):
                data = segment.read_bytes()
                found, _ = faults.walk_chunks(data)
                for chunk in found:
                    end = chunk.base_offset + chunk.record_count
                    if chunk.base_offset < hwm:  # a chunk starting below the committed HWM is committed data
                        raw = data[chunk.position:chunk.position + chunk.length]
                        chunks.append([chunk.base_offset, chunk.record_count, hashlib.sha256(raw).hexdigest()[:24]])
            history.complete(pending, OK, {"chunks": chunks, "end": end})
