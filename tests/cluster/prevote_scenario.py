"""Partition scenario for pre-vote, run by ``test_raft_prevote.py`` inside ``unshare -n -m`` (root only).

Three dev-node processes (:mod:`cursus.cluster.raft.devnode`), each in its own network namespace
(:class:`chaos.netns.Network`); a follower is cut off from both peers by nftables drop rules for
``--hold`` seconds (many election timeouts), then the partition heals. Prints one JSON line: the leader and
term before, the isolated node's highest term while cut off, and every node's leader/term after the heal.

    CURSUS_CHAOS_NETNS=1 unshare -n -m --propagation private python -m tests.cluster.prevote_scenario \\
        --out DIR [--hold 5] [--no-pre-vote]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from chaos.netns import Network, isolate, node_address
from cursus.cluster.certs import generate_cluster_certs

RAFT_PORT = 7000
CONTROL_PORT = 7100
IDS = ("node-0", "node-1", "node-2")
#: Test timers (seconds): elections in 0.4-0.8 s, idle peer connections closed after 3.5 s (devnode default).
ELECTION = ("0.4", "0.8")
HEARTBEAT = "0.05"


def _status(index: int, timeout: float = 1.0) -> dict[str, Any] | None:
    """One ``status`` request on a fresh control connection; None when the node does not answer."""
    try:
        with socket.create_connection((node_address(index), CONTROL_PORT), timeout=timeout) as sock:
            sock.sendall(json.dumps({"op": "status", "id": 1}).encode() + b"\n")
            buffer = b""
            while b"\n" not in buffer:
                chunk = sock.recv(65536)
                if not chunk:
                    return None
                buffer += chunk
        return dict(json.loads(buffer.split(b"\n", 1)[0])["status"])
    except (OSError, ValueError, KeyError):
        return None


def _wait(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise SystemExit(f"timed out after {timeout} s waiting for {what}")


def _agreed() -> tuple[str, int] | None:
    """(leader id, term) when all three nodes name the same leader in the same term."""
    statuses = [_status(i) for i in range(len(IDS))]
    if any(s is None or not s.get("leader_id") for s in statuses):
        return None
    views = {(s["leader_id"], s["term"]) for s in statuses if s is not None}
    return next(iter(views)) if len(views) == 1 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--hold", type=float, default=5.0)
    parser.add_argument("--after", type=float, default=3.0)
    parser.add_argument("--no-pre-vote", action="store_true")
    args = parser.parse_args(argv)
    network = Network(len(IDS))
    network.setup()
    certs = args.out / "certs"
    generate_cluster_certs(certs, list(IDS), [node_address(i) for i in range(len(IDS))], days=2)
    members = ",".join(f"{node_id}={node_address(i)}:{RAFT_PORT}" for i, node_id in enumerate(IDS))
    procs = []
    try:
        for i, node_id in enumerate(IDS):
            cmd = [*network.exec_prefix(i), sys.executable, "-m", "cursus.cluster.raft.devnode", "--id", node_id,
                   "--members", members, "--data", str(args.out / node_id), "--certs", str(certs),
                   "--control-host", node_address(i), "--control-port", str(CONTROL_PORT),
                   "--election-min", ELECTION[0], "--election-max", ELECTION[1], "--heartbeat", HEARTBEAT]
            if args.no_pre_vote:
                cmd.append("--no-pre-vote")
            log = open(args.out / f"{node_id}.log", "ab")  # noqa: SIM115 - closed with the process
            procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
        leader, term = _wait(_agreed, 30, "a leader all nodes agree on")
        time.sleep(1.0)  # a few heartbeats more, so that the cluster is steady
        leader, term = _wait(_agreed, 10, "a steady leader")
        isolated = next(i for i, node_id in enumerate(IDS) if node_id != leader)
        network.set_cuts(isolate(isolated, len(IDS)))
        isolated_terms, majority_views = [], set()
        end = time.monotonic() + args.hold
        while time.monotonic() < end:
            status = _status(isolated)
            if status is not None:
                isolated_terms.append(int(status["term"]))
            for i in range(len(IDS)):
                if i != isolated and (s := _status(i)) is not None:
                    majority_views.add((s.get("leader_id") or "", int(s["term"])))
            time.sleep(0.1)
        network.heal()
        rejoined = _wait(lambda: (s := _status(isolated)) is not None and s.get("leader_id") and s, 15,
                         "the isolated node to know a leader again")
        after_views = set()
        end = time.monotonic() + args.after
        while time.monotonic() < end:
            for i in range(len(IDS)):
                if (s := _status(i)) is not None:
                    after_views.add((s.get("leader_id") or "", int(s["term"])))
            time.sleep(0.05)
        final = _wait(_agreed, 15, "agreement after the heal")
        print(json.dumps({"pre_vote": not args.no_pre_vote, "leader_before": leader, "term_before": term,
                          "isolated": IDS[isolated], "isolated_max_term": max(isolated_terms, default=term),
                          "isolated_polls": len(isolated_terms), "majority_views": sorted(map(list, majority_views)),
                          "rejoined_leader": rejoined.get("leader_id"), "after_views": sorted(map(list, after_views)),
                          "final_leader": final[0], "final_term": final[1]}))
        return 0
    finally:
        for proc, _log in procs:
            proc.terminate()
        for proc, log in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


if __name__ == "__main__":
    raise SystemExit(main())
