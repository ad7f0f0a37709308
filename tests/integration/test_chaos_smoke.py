"""The bounded chaos smoke for CI: a fixed seed, about a minute, kill -9 + SIGSTOP pauses + power-cut kills
(lose-unsynced). Fails on any violation; the run directory (history, faults, broker logs, report) stays in
pytest's tmp dir for inspection. Longer runs: ``make chaos`` and ``make chaos-long`` (docs/chaos.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
#: The schedule of this seed (``python -m chaos schedule --seed 7 --duration 50 --faults kill,pause,lose-unsynced``)
#: has both kills and pauses.
SEED = 7
DURATION_S = 50

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _chaos(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run ``python -m chaos``; on timeout kill its whole process group (the harness and its brokers)."""
    proc = subprocess.Popen([sys.executable, "-m", "chaos", *args], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"chaos {' '.join(args)} timed out after {timeout_s}s:\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def test_chaos_smoke_kill_pause_lose_unsynced(tmp_path: Path) -> None:
    out = tmp_path / "chaos"
    proc = _chaos("run", "--nodes", "1", "--duration", str(DURATION_S), "--faults", "kill,pause,lose-unsynced",
                  "--seed", str(SEED), "--out", str(out), timeout_s=170)
    assert proc.returncode == 0, f"chaos smoke failed (seed {SEED}, output in {out}):\n{proc.stdout}\n{proc.stderr}"
    report = json.loads((out / "report.json").read_text())
    assert report["valid"] and report["violations"] == 0
    assert report["seed"] == SEED
    kinds = report["faults"]["by_kind"]
    assert kinds.get("kill", 0) >= 1 and kinds.get("pause", 0) >= 1 and kinds.get("lose-unsynced") == 1, kinds
    assert not report["faults"]["failed"]
    assert report["values"]["acked"] > 1000, report["values"]
    assert report["operations"]["by_kind"]["read"].get("ok", 0) > 100
    for name in ("history.jsonl", "faults.jsonl", "schedule.json", "summary.txt", "node-0/broker.log"):
        assert (out / name).exists(), name
    for line in (out / "faults.jsonl").read_text().splitlines():
        fault = json.loads(line)
        assert fault["start"] <= fault["end"], fault


def test_chaos_corruption_of_acknowledged_data_is_detected(tmp_path: Path) -> None:
    out = tmp_path / "corrupt"
    proc = _chaos("corrupt", "--seed", str(SEED), "--out", str(out), timeout_s=120)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    report = json.loads((out / "report.json").read_text())
    assert [case["case"] for case in report["cases"]] == ["body-flip", "header-flip", "truncate-acked",
                                                          "old-segment-flip"]
    assert all(case["passed"] for case in report["cases"])
