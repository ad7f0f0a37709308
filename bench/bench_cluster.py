"""Metadata cluster benchmarks on three real broker processes (loopback, mutual TLS, durable journal).

- ``cluster_metadata_commit``: ALTER_TOPIC_CONFIG round trips (each a real metadata change committed
  through Raft, fsynced on a majority, applied, answered), from one caller on a follower and on the Raft
  leader, and from 8 concurrent callers: p50/p99 latency (ms) and commands/s.
- ``cluster_offset_commit``: COMMIT_OFFSET round trips on the group's coordinator (its owner on the ring;
  each commit is one GroupRecords command committed through Raft, fsynced on a majority, applied, answered):
  one caller, 8 callers on 8 groups (spread over the three owners), and 8 callers on one group (8
  partitions of one member: pipelined commands of one group): p50/p99 latency (ms) and commits/s.
  Target: p99 under 10 ms.
- ``cluster_failover``: kill -9 of the Raft leader until the first metadata command commits on a survivor
  (seconds), median and max over 5 runs, with the test timers (election timeout 400-800 ms).

Run: ``python -m bench cluster`` (``python -m bench.bench_cluster offsets`` runs only the offset-commit case).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from cursus.client.connection import Connection
from cursus.wire import Status
from tests.cluster.clustersupport import Cluster
from tests.cluster.raftsupport import make_test_pki
from tests.integration.helpers import ok_fields, publish_batch

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


def _coordinator_address(cluster: Cluster, group: str) -> tuple[str, int]:
    with Connection(*cluster.brokers[0].address, timeout_s=10) as conn:
        found = ok_fields(conn.command(f"FIND_COORDINATOR group={group}"))
    return found["host"], int(found["port"])


def _join(address: tuple[str, int], topic: str, group: str) -> tuple[str, str]:
    with Connection(*address, timeout_s=30) as conn:
        joined = ok_fields(conn.command(f"JOIN_GROUP topic={topic} group={group} member=bench"))
    return joined["member"], joined["generation"]


def _commit_loop(address: tuple[str, int], topic: str, partition: int, group: str, member: str, generation: str,
                 rounds: int, latencies: list[float]) -> None:
    with Connection(*address, timeout_s=30) as conn:
        for i in range(1, rounds + 1):
            started = time.perf_counter()
            frame = conn.command(f"COMMIT_OFFSET topic={topic} partition={partition} group={group} offset={i} "
                                 f"member={member} generation={generation}")
            latencies.append(time.perf_counter() - started)
            assert frame.status == Status.OK, frame.payload


def _threads(jobs: list[tuple]) -> float:
    threads = [threading.Thread(target=_commit_loop, args=job) for job in jobs]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started


def offset_commits(cluster: Cluster) -> list[dict]:
    """The ``cluster_offset_commit`` cases on a running cluster (see the module docstring)."""
    results = []
    topic = "bench-offsets"
    with Connection(*cluster.brokers[0].address, timeout_s=30) as conn:
        assert conn.command(f"CREATE topic={topic} partitions={CALLERS} replication_factor=3").status == Status.OK
    for p in range(CALLERS):  # records to commit against (a coordinator leading the partition checks its LEO)
        for broker in cluster.brokers:  # the partition's leader accepts it
            with Connection(*broker.address, timeout_s=30) as conn:
                if publish_batch(conn, topic, p, [b"x"] * (ROUNDS + 1), acks="all").status == Status.OK:
                    break
    group = "bench-single"
    address = _coordinator_address(cluster, group)
    member, generation = _join(address, topic, group)
    coordinator = next(b for b in cluster.brokers if b.address[1] == address[1])
    # the same broker's plain metadata commit, measured alongside (the machine's load moves both)
    latencies: list[float] = []
    started = time.perf_counter()
    _alter_loop(coordinator, topic, ROUNDS // 2, latencies)
    results.append(_summary("reference_alter_topic_config_same_broker", latencies, time.perf_counter() - started,
                            bench="cluster_offset_commit"))
    latencies = []
    elapsed = _threads([(address, topic, 0, group, member, generation, ROUNDS, latencies)])
    raft_leader = _cluster_status(cluster.brokers[0])["raft_leader"]
    results.append(_summary("single_caller", latencies, elapsed, bench="cluster_offset_commit",
                            coordinator_is_raft_leader=coordinator.log_dir.name == raft_leader))

    jobs = []
    for i in range(CALLERS):
        name = f"bench-g{i}"
        address = _coordinator_address(cluster, name)
        member, generation = _join(address, topic, name)
        jobs.append((address, topic, 0, name, member, generation, ROUNDS // 2, []))
    elapsed = _threads(jobs)
    owners = len({job[0] for job in jobs})
    results.append(_summary(f"{CALLERS}_callers_{CALLERS}_groups", [x for job in jobs for x in job[7]], elapsed,
                            bench="cluster_offset_commit", coordinators=owners))

    group = "bench-shared"
    address = _coordinator_address(cluster, group)
    member, generation = _join(address, topic, group)
    latencies = []
    elapsed = _threads([(address, topic, p, group, member, generation, ROUNDS // 2, latencies)
                        for p in range(CALLERS)])
    results.append(_summary(f"{CALLERS}_callers_one_group", latencies, elapsed, bench="cluster_offset_commit"))
    return results


def _summary(name: str, latencies: list[float], elapsed: float, *, bench: str = "cluster_metadata_commit",
             **extra: object) -> dict:
    ordered = sorted(latencies)
    return {"bench": bench, "case": name, "commands": len(ordered),
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
            results += offset_commits(cluster)

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


def run_offsets_only() -> list[dict]:
    """Only the ``cluster_offset_commit`` cases, on a fresh cluster."""
    with tempfile.TemporaryDirectory(prefix="bench-offsets-") as tmp:
        root = Path(tmp)
        (root / "nodes").mkdir()
        cluster = Cluster(root / "nodes", make_test_pki(root / "pki"))
        try:
            cluster.start()
            return offset_commits(cluster)
        finally:
            cluster.stop()


if __name__ == "__main__":
    for line in (run_offsets_only() if sys.argv[1:] == ["offsets"] else run()):
        print(json.dumps(line), flush=True)
