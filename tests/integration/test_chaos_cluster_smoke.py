"""The bounded cluster chaos smoke for CI: three brokers (mutual TLS, Raft), each in its own network
namespace, a fixed seed, about 70 s of kill -9 (random broker, Raft leader, partition leader), SIGSTOP pauses
longer than the election timeout and network partitions (isolate, split, one-way, flapping). Needs root
(``unshare -n``, ``ip netns``, ``nft``); skipped otherwise. The run directory stays in pytest's tmp dir.
Longer runs: ``make chaos`` / ``make chaos-long`` (docs/chaos.md).

A run that finds violations raises :class:`ChaosViolation` and fails the test: the broker anomalies the
harness found (findings A to K in docs/chaos.md) are fixed, each with a deterministic regression test.
Anything else (the harness crashing, a fault that did not take
effect, no faults injected, too little traffic) fails the test too.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.integration.test_chaos_smoke import _chaos

#: ``python -m chaos schedule --seed 11 --duration 70 --nodes 3 --faults kill,pause,partition`` has kills
#: (partition leader, random), pauses and partitions (isolate, split).
SEED = 11
DURATION_S = 70


class ChaosViolation(AssertionError):
    """The run completed and its checkers found violations."""


pytestmark = [pytest.mark.slow, pytest.mark.timeout(240),
              pytest.mark.skipif(os.geteuid() != 0 or not all(shutil.which(t) for t in ("unshare", "ip", "nft")),
                                 reason="the cluster harness needs root, unshare, ip and nft")]


def test_cluster_chaos_smoke_kill_pause_partition(tmp_path: Path) -> None:
    out = tmp_path / "chaos-cluster"
    proc = _chaos("run", "--nodes", "3", "--duration", str(DURATION_S), "--faults", "kill,pause,partition",
                  "--seed", str(SEED), "--settle", "3", "--settle-timeout", "20", "--out", str(out), timeout_s=230)
    assert proc.returncode in (0, 1), f"cluster chaos harness error (seed {SEED}):\n{proc.stdout}\n{proc.stderr}"
    report = json.loads((out / "report.json").read_text())
    assert report["nodes"] == 3 and report["seed"] == SEED
    kinds = report["faults"]["by_kind"]
    assert kinds.get("kill", 0) >= 1 and kinds.get("pause", 0) >= 1 and kinds.get("partition", 0) >= 1, kinds
    assert not report["harness_errors"], report["harness_errors"]
    assert report["values"]["acked"] > 500, report["values"]
    assert report["operations"]["by_kind"].get("cluster-status", {}).get("ok", 0) > 10
    for name in ("history.jsonl", "faults.jsonl", "schedule.json", "summary.txt", "node-2/broker.log"):
        assert (out / name).exists(), name
    if proc.returncode != 0 or not report["valid"]:
        raise ChaosViolation(f"cluster chaos smoke found violations (seed {SEED}, output in {out}):\n{proc.stdout}")
