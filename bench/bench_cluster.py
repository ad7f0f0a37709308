"""Metadata cluster benchmarks on three real broker processes (loopback, mutual TLS, durable journal).

- ``cluster_metadata_commit``: ALTER_TOPIC_CONFIG round trips (each a real metadata change committed
  through Raft, fsynced on a majority, applied, answered), from one caller on a follower and on the Raft
  leader, and from 8 concurrent callers: p50/p99 latency (ms) and commands/s.
- ``cluster_failover``: kill -9 of the Raft leader until the first metadata command commits on a survivor
  (seconds), median and max over 5 runs, with the test timers (election timeout 400-800 ms).

Run: ``python -m bench cluster``.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path

from cursus.client.connection import Connection
from cursus.wire import Status
from tests.cluster.clustersupport import Cluster
from tests.cluster.raftsupport import make_test_pki

ROUNDS = 300
CALLERS = 8
FAILOVERS = 5


def _cluster_status(broker) -> dict:
    import json

    with Connection(*broker.address, timeout_s=10) as conn:
        return json.loads(conn.command("CLUSTER_STATUS").payload.decode()[len("OK cluster="):])


def _alter_loop(broker, topic: str, rounds: int, latencies: list[float]) -> None:
    with Connection(*broker.address, timeout_s=30) as conn:
        for i in range(rounds):
            started = time.perf_counter()
            frame = conn.command(f"ALTER_TOPIC_CONFIG topic={topic} min_in_sync_replicas={1 + i % 2}")
            latencies.append(time.perf_counter() - started)
            assert frame.status == Status.OK, frame.payload


def _summary(name: str, latencies: list[float], elapsed: float, **extra: object) -> dict:
    ordered = sorted(latencies)
    return {"bench": "cluster_metadata_commit", "case": name, "commands": len(ordered),
            "p50_ms": round(ordered[len(ordered) // 2] * 1000, 2),
            "p99_ms": round(ordered[int(len(ordered) * 0.99) - 1] * 1000, 2),
            "commands_per_s": round(len(ordered) / elapsed, 1), **extra}


def run() -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        root = Path(tmp)
        (root / "nodes").mkdir()
        cluster = Cluster(root / "nodes", make_test_pki(root / "pki"))
        try:
            cluster.start()
            with Connection(*cluster.brokers[0].address, timeout_s=30) as conn:
                for i in range(CALLERS):
                    assert conn.command(f"CREATE topic=bench-{i} partitions=1 replication_factor=3").status == Status.OK
            leader = cluster.by_id(_cluster_status(cluster.brokers[0])["raft_leader"])
            follower = next(b for b in cluster.brokers if b is not leader)
            for name, broker in (("single_caller_follower", follower), ("single_caller_leader", leader)):
                latencies: list[float] = []
                started = time.perf_counter()
                _alter_loop(broker, "bench-0", ROUNDS, latencies)
                results.append(_summary(name, latencies, time.perf_counter() - started))
            latencies = []
            threads = [threading.Thread(target=_alter_loop,
                                        args=(cluster.brokers[i % 3], f"bench-{i}", ROUNDS // 2, latencies))
                       for i in range(CALLERS)]
            started = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            results.append(_summary(f"{CALLERS}_callers_all_brokers", latencies, time.perf_counter() - started))

            failovers = []
            for run_index in range(FAILOVERS):
                leader = cluster.by_id(_cluster_status(cluster.brokers[0])["raft_leader"])
                survivor = next(b for b in cluster.brokers if b is not leader)
                with Connection(*survivor.address, timeout_s=30) as conn:
                    killed = time.perf_counter()
                    leader.kill()
                    while True:
                        frame = conn.command(f"CREATE topic=failover-{run_index} partitions=1")
                        if frame.status == Status.OK:
                            break
                        time.sleep(0.005)
                    failovers.append(time.perf_counter() - killed)
                leader.start(timeout_s=60)
                deadline = time.monotonic() + 30
                while _cluster_status(survivor)["inactive_brokers"] and time.monotonic() < deadline:
                    time.sleep(0.05)
            results.append({"bench": "cluster_failover", "runs": FAILOVERS,
                            "median_s": round(statistics.median(failovers), 3),
                            "max_s": round(max(failovers), 3), "all_s": [round(f, 3) for f in failovers],
                            "election_timeout_ms": "400-800"})
        finally:
            cluster.stop()
    return results
