"""Chaos harness honesty: a fault that verifiably did nothing (no packet dropped, a process that never stopped,
a flip that never reached the file, a skipped fault) makes the run "faults not done" (never valid, exit 2),
and the proofs the nemesis records (nft drop counters, ``/proc`` states, the read-back flip) are right."""

from __future__ import annotations

import signal
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import crc32c

from chaos import checkers, report
from chaos.faults import (
    CHUNK_HEADER,
    CHUNK_MAGIC,
    INEFFECTIVE,
    FaultLog,
    Nemesis,
    flip_tail,
    wait_process_state,
)
from chaos.history import Clock
from chaos.netns import node_address, parse_counters
from chaos.schedule import FaultSpec
from tests.unit.test_chaos_checkers import clean


def _doc(faults: list[dict[str, Any]], planned: int) -> dict[str, Any]:
    ops = clean().ops()
    return report.build({"seed": 1, "schedule_length": planned}, ops, checkers.run_all(ops), faults, workloads={},
                        errors=[], harness_errors=[])


def _fault(fault_id: int, kind: str, error: str | None = None) -> dict[str, Any]:
    record: dict[str, Any] = {"id": fault_id, "fault": kind, "node": 0, "start": 1.0, "end": 2.0, "details": {}}
    if error is not None:
        record["error"] = error
    return record


def test_a_run_whose_faults_all_took_effect_is_valid() -> None:
    doc = _doc([_fault(1, "lose-unsynced"), _fault(2, "kill"), _fault(3, "partition")], planned=2)
    assert doc["valid"] and report.exit_code(doc) == 0 and doc["faults"]["not_done"] == []


def test_an_ineffective_or_skipped_fault_makes_the_run_prove_nothing() -> None:
    for error in (INEFFECTIVE + "no packet was dropped", "skipped"):
        doc = _doc([_fault(1, "kill"), _fault(2, "partition", error)], planned=2)
        assert not doc["valid"] and report.exit_code(doc) == 2, error
        assert doc["faults"]["not_done"] == [f"fault #2 partition on node 0: {error}"]
        assert "FAULTS NOT DONE" in report.summary(doc)


def test_a_schedule_with_no_fault_taking_effect_is_not_valid() -> None:
    doc = _doc([_fault(1, "lose-unsynced")], planned=3)  # the mode alone is no fault
    assert not doc["valid"] and report.exit_code(doc) == 2
    assert "none of the 3 planned faults took effect" in doc["faults"]["not_done"]
    assert _doc([], planned=0)["valid"]  # nothing planned (--faults none): nothing missing


def test_a_violation_still_exits_1_when_a_fault_was_not_done() -> None:
    h = clean()
    h.read("drain", 0, 3, [(3, "idem-0:1")], session="drain/0", final=True)  # a duplicate
    ops = h.ops()
    doc = report.build({"seed": 1, "schedule_length": 1}, ops, checkers.run_all(ops),
                       [_fault(1, "pause", INEFFECTIVE + "never stopped")], workloads={}, errors=[], harness_errors=[])
    assert not doc["valid"] and report.exit_code(doc) == 1


def test_drop_counters_are_read_by_directed_pair() -> None:
    def rule(src: int, dst: int, packets: int) -> dict[str, Any]:
        return {"rule": {"expr": [
            {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": node_address(src)}},
            {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "daddr"}}, "right": node_address(dst)}},
            {"counter": {"packets": packets, "bytes": 60 * packets}}, {"drop": None}]}}
    listing = {"nftables": [{"metainfo": {}}, {"chain": {"name": "cuts"}}, rule(0, 1, 7), rule(1, 0, 0),
                            {"rule": {"expr": [{"drop": None}]}}]}  # a rule without addresses: ignored
    assert parse_counters(listing, 3) == {(0, 1): 7, (1, 0): 0}


class _Network:
    """Stands in for :class:`chaos.netns.Network` (nft needs a namespace): counts what the test says."""

    def __init__(self, packets_per_cut: int) -> None:
        self.packets_per_cut = packets_per_cut
        self.counts: dict[tuple[int, int], int] = {}
        self.cuts: set[tuple[int, int]] = set()

    def set_cuts(self, pairs: Any) -> None:
        self.cuts = set(pairs)
        for pair in self.cuts:
            self.counts[pair] = self.counts.get(pair, 0) + self.packets_per_cut

    def heal(self) -> None:
        self.cuts = set()

    def dropped(self) -> dict[tuple[int, int], int]:
        return dict(self.counts)


class _Nodes:
    def __len__(self) -> int:
        return 3


def _partition(packets_per_cut: int) -> dict[str, Any]:
    clock = Clock()
    log = FaultLog(None, clock)
    nemesis = Nemesis([], _Nodes(), log, clock, 0.0, {}, lambda t, p: 0, lambda t: True,  # type: ignore[arg-type]
                      network=_Network(packets_per_cut))
    nemesis.execute(FaultSpec(0, 0.0, "partition", 0, 0.01, None, None, {"mode": "one-way", "side": [0, 1]}))
    [record] = log.records
    return record


def test_a_partition_that_dropped_no_packet_is_ineffective() -> None:
    record = _partition(0)
    assert record["error"].startswith(INEFFECTIVE) and record["details"]["packets_dropped"] == {"0->1": 0}
    record = _partition(5)
    assert "error" not in record and record["details"]["packets_dropped"] == {"0->1": 5}


def test_a_stopped_process_is_seen_stopped() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not wait_process_state(proc.pid, "T", 0.05)
        proc.send_signal(signal.SIGSTOP)
        assert wait_process_state(proc.pid, "T", 5.0)
    finally:
        proc.kill()
        proc.wait()
    assert not wait_process_state(proc.pid, "T", 0.05)  # gone


def test_flip_tail_damages_the_file_or_says_it_did_nothing(tmp_path: Path) -> None:
    assert "skipped" in flip_tail(tmp_path, 1)
    body = struct.pack(">I", 4) + b"abcd"
    header = CHUNK_HEADER.pack(CHUNK_MAGIC, 0, 1, len(body), 0, 0, 0)
    crc = crc32c.crc32c(header[:32] + body)
    chunk = CHUNK_HEADER.pack(CHUNK_MAGIC, 0, 1, len(body), 0, 0, crc) + body
    segment = tmp_path / "00000000000000000000.log"
    segment.write_bytes(chunk)
    done = flip_tail(tmp_path, 3)
    assert done["file"] == str(segment)
    damaged = segment.read_bytes()
    assert damaged != chunk and sum(a != b for a, b in zip(damaged, chunk, strict=True)) == 1


def test_the_lose_unsynced_mode_is_proven_from_the_process_environment() -> None:
    import os
    from types import SimpleNamespace

    from chaos.__main__ import _mode_env_error

    with_env = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                                env={**os.environ, "CURSUS_STORAGE_FAULTS": "lose_unsynced=1"})
    without = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                               env={k: v for k, v in os.environ.items() if k != "CURSUS_STORAGE_FAULTS"})
    try:
        cluster = SimpleNamespace(nodes=[SimpleNamespace(name="node-0", pid=with_env.pid),
                                         SimpleNamespace(name="node-1", pid=without.pid)])
        assert _mode_env_error(cluster, [0]) is None
        error = _mode_env_error(cluster, [0, 1])
        assert error is not None and error.startswith(INEFFECTIVE) and "node-1" in error and "node-0" not in error
    finally:
        for proc in (with_env, without):
            proc.kill()
            proc.wait()
