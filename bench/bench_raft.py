"""Raft metadata layer: snapshot serialization, durable commit latency and throughput, leader failover.

``run()`` returns one dict per measurement (about half a minute, temp dirs under ``$TMPDIR``):

* ``raft_snapshot_serialize`` - serialize a KeyValueFSM holding 10,000 partition-sized entries into a
  format-9 snapshot file (FSM encode + framing + CRC + write + fsync); median and max of 5, in ms, and
  the FSM's own (JSON) encode share.
* ``raft_commit_single`` - one caller, one command at a time, to the leader of three dev-node processes
  with mutual TLS and the durable (fsynced) journal: p50/p99 latency (ms) and commands/s.
* ``raft_commit_pipelined`` - the same with 64 commands in flight.
* ``raft_failover`` - kill -9 of the leader to the first command committed by the survivors; median and
  max of 5 runs, in ms, with the dev node's default timers (election timeout 0.4-0.8 s).

Latencies include the JSON control-socket hop of the dev node (about 0.1 ms).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from cursus.cluster.raft.kv import KeyValueFSM, kv_command
from cursus.cluster.raft.snapshot import Snapshot, write_snapshot

PARTITIONS = 10_000
SINGLE_COMMANDS = 400
PIPELINED_COMMANDS = 4_000
WINDOW = 64
FAILOVER_RUNS = 5


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def _snapshot_bench(root: Path) -> dict[str, object]:
    fsm = KeyValueFSM()
    for number in range(PARTITIONS):
        fsm.data[f"topic-{number // 10}/{number % 10}"] = {
            "replicas": ["node-1", "node-2", "node-3"], "leader": "node-1", "leader_epoch": 7,
            "isr": ["node-1", "node-2", "node-3"], "committed_hwm": 123_456_789 + number,
            "committed_hwm_version": 1, "lifecycle_epoch": 1}
    timings, encode_timings = [], []
    size = 0
    for attempt in range(5):
        started = time.perf_counter()
        state = fsm.snapshot()
        encoded = time.perf_counter()
        snapshot = Snapshot((b"\x00", 100 + attempt, 3), (b"\x00", 99 + attempt, 3),
                            ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"), b"\0\0\0\0", state)
        write_snapshot(root / "snapshot.v9", snapshot)
        timings.append((time.perf_counter() - started) * 1000)
        encode_timings.append((encoded - started) * 1000)
        size = (root / "snapshot.v9").stat().st_size
    return {"bench": "raft_snapshot_serialize", "partitions": PARTITIONS, "bytes": size,
            "median_ms": round(statistics.median(timings), 2), "max_ms": round(max(timings), 2),
            "fsm_encode_median_ms": round(statistics.median(encode_timings), 2)}


def _submit(value: object) -> dict:
    return {"op": "submit", "command": kv_command("append", "log", value).decode(), "rid": None,
            "timeout": 5.0}


def _leader(nodes: list) -> object:
    from tests.cluster.raftsupport import wait_for

    return wait_for(lambda: next((n for n in nodes if n.alive and n.status()["is_leader"]), None), 20,
                    "a leader")


def _commit_benches(nodes: list) -> list[dict[str, object]]:
    leader = _leader(nodes)
    for number in range(20):  # warm up connections and the page cache
        leader.request(_submit(number))
    latencies = []
    started = time.perf_counter()
    for number in range(SINGLE_COMMANDS):
        began = time.perf_counter()
        assert leader.request(_submit(number)).get("ok")
        latencies.append((time.perf_counter() - began) * 1000)
    elapsed = time.perf_counter() - started
    single = {"bench": "raft_commit_single", "commands": SINGLE_COMMANDS,
              "p50_ms": round(_percentile(latencies, 0.5), 2), "p99_ms": round(_percentile(latencies, 0.99), 2),
              "commands_per_s": round(SINGLE_COMMANDS / elapsed)}
    latencies = []
    started = time.perf_counter()
    for first in range(0, PIPELINED_COMMANDS, WINDOW):
        began = time.perf_counter()
        replies = leader.pipeline([_submit(n) for n in range(first, first + WINDOW)], timeout=30)
        assert all(reply.get("ok") for reply in replies)
        latencies += [(time.perf_counter() - began) * 1000] * len(replies)
    elapsed = time.perf_counter() - started
    pipelined = {"bench": "raft_commit_pipelined", "commands": PIPELINED_COMMANDS, "in_flight": WINDOW,
                 "p50_ms": round(_percentile(latencies, 0.5), 2),
                 "p99_ms": round(_percentile(latencies, 0.99), 2),
                 "commands_per_s": round(PIPELINED_COMMANDS / elapsed)}
    return [single, pipelined]


def _failover_bench(nodes: list) -> dict[str, object]:
    from tests.cluster.raftsupport import wait_for

    timings = []
    for run in range(FAILOVER_RUNS):
        leader = _leader(nodes)
        leader.kill9()
        killed_at = time.perf_counter()
        survivors = [n for n in nodes if n is not leader]
        committed = False
        while not committed:
            for node in survivors:
                reply = node.request({**_submit(f"failover-{run}"), "timeout": 0.5}, timeout=5)
                if reply.get("ok"):
                    committed = True
                    break
        timings.append((time.perf_counter() - killed_at) * 1000)
        leader.start()
        wait_for(lambda: all(len(set(node.status()["connected_peers"])) == 2 for node in nodes), 20,
                 "the restarted node to rejoin")
    return {"bench": "raft_failover", "runs": FAILOVER_RUNS,
            "median_ms": round(statistics.median(timings), 1), "max_ms": round(max(timings), 1),
            "runs_ms": [round(value, 1) for value in timings]}


def run() -> list[dict]:
    from tests.cluster.raftsupport import IDS, DevNode, free_ports, make_test_pki, members_on

    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        results.append(_snapshot_bench(root))
        pki = make_test_pki(root / "pki")
        ports = free_ports(6)
        members = members_on(ports[:3])
        nodes = [DevNode(node_id, members, root / node_id, pki, port, root / f"{node_id}.log")
                 for node_id, port in zip(IDS, ports[3:], strict=True)]
        try:
            for node in nodes:
                node.start()
            results += _commit_benches(nodes)
            results.append(_failover_bench(nodes))
        finally:
            for node in nodes:
                node.stop()
    return results


if __name__ == "__main__":
    for result in run():
        print(json.dumps(result))
