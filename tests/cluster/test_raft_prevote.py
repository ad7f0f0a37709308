"""Pre-vote (issue 14): a follower cut off by a real partition does not bump its term, and on rejoining it
does not depose the leader. Three dev-node processes in their own network namespaces, nftables drops
(:mod:`tests.cluster.prevote_scenario`); needs root, ``unshare``, ``ip`` and ``nft`` (skipped otherwise).

The control run without pre-vote shows what the fix prevents: the cut-off node keeps starting elections
(its peer connections stay up until the idle timeout), so its term runs ahead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from chaos.netns import ENV_MARK

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("unshare", "ip", "nft")),
    reason="needs root, unshare, ip and nft (network namespaces and nftables)")


def _scenario(out: Path, *extra: str) -> dict[str, Any]:
    env = {**os.environ, ENV_MARK: "1", "PYTHONPATH": str(ROOT)}
    cmd = ["unshare", "-n", "-m", "--propagation", "private", sys.executable, "-m", "tests.cluster.prevote_scenario",
           "--out", str(out), "--hold", "5", "--after", "3", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"scenario failed ({proc.returncode}): {proc.stdout[-2000:]} {proc.stderr[-3000:]}"
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_isolated_follower_neither_bumps_its_term_nor_deposes_the_leader(tmp_path: Path) -> None:
    result = _scenario(tmp_path)
    print(json.dumps(result))
    term, leader = result["term_before"], result["leader_before"]
    assert result["isolated_polls"] > 10, result
    assert result["isolated_max_term"] == term, f"the cut-off node bumped its term: {result}"
    assert result["majority_views"] == [[leader, term]], f"the majority changed leader or term: {result}"
    assert result["rejoined_leader"] == leader, result
    assert result["after_views"] == [[leader, term]], f"the heal disturbed the cluster: {result}"
    assert (result["final_leader"], result["final_term"]) == (leader, term), result


def test_without_pre_vote_the_isolated_follower_runs_its_term_ahead(tmp_path: Path) -> None:
    result = _scenario(tmp_path, "--no-pre-vote")
    print(json.dumps(result))
    assert result["isolated_max_term"] > result["term_before"], result
    assert result["final_term"] > result["term_before"], f"the rejoining node forced no election: {result}"
