"""``report.json`` and the short human summary (``summary.txt``, also printed).

The report gives, per checker, the number of anomalies and the first few examples with their evidence,
the faults active at the time and the faults that came next (a lost write was destroyed by a later fault). A run is *valid* when no checker found anything and nothing went wrong
(a node that would not restart, a drain that could not finish, a harness exception).

Exit codes of ``python -m chaos``: 0 valid, 1 a violation (anomaly or broker failure), 2 a harness
error without any violation (the run proves nothing).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from chaos.checkers import Anomaly
from chaos.history import OK, Op

#: Examples kept per checker in the report.
EXAMPLES_MAX = 5
#: Seconds before an anomaly's window in which an ended fault is still listed (its effects linger).
FAULT_LOOKBACK_S = 5.0


def faults_active(faults: list[dict[str, Any]], start: float | None, end: float | None) -> list[dict[str, Any]]:
    """Faults overlapping ``[start - FAULT_LOOKBACK_S, end]`` (short form: id, kind, node, start, end)."""
    lo = (start if start is not None else 0.0) - FAULT_LOOKBACK_S
    hi = end if end is not None else float("inf")
    out = []
    for fault in faults:
        if fault["start"] <= hi and fault["end"] >= lo:
            out.append({"id": fault["id"], "fault": fault["fault"], "node": fault["node"],
                        "start": fault["start"], "end": fault["end"]})
    return out


def faults_after(faults: list[dict[str, Any]], end: float | None, limit: int = 3) -> list[dict[str, Any]]:
    """The first ``limit`` faults that started after ``end`` (what may have destroyed acknowledged data)."""
    if end is None:
        return []
    later = sorted((f for f in faults if f["start"] > end), key=lambda f: f["start"])
    return [{"id": f["id"], "fault": f["fault"], "node": f["node"], "start": f["start"], "end": f["end"]}
            for f in later[:limit]]


def op_counts(ops: list[Op]) -> dict[str, dict[str, int]]:
    """``{f: {ok: n, fail: n, info: n}}``."""
    counts: dict[str, Counter[str]] = {}
    for op in ops:
        counts.setdefault(op.f, Counter())[op.type] += 1
    return {f: dict(sorted(c.items())) for f, c in sorted(counts.items())}


def value_counts(ops: list[Op]) -> dict[str, int]:
    """How many values were written, acknowledged, and found by the final drain."""
    written = acked = 0
    drained: set[str] = set()
    for op in ops:
        if op.f == "send":
            written += len(op.value.get("values") or [])
            if op.type == OK:
                acked += len(op.value.get("values") or [])
        elif op.f == "read" and op.type == OK and op.process == "drain":
            drained.update(r[1] for r in op.result.get("records") or [])
    return {"written": written, "acked": acked, "drained": len(drained)}


def build(meta: dict[str, Any], ops: list[Op], anomalies: dict[str, list[Anomaly]], faults: list[dict[str, Any]],
          *, workloads: dict[str, str], errors: list[dict[str, Any]], harness_errors: list[str]) -> dict[str, Any]:
    """The report document.

    Args:
        meta: run parameters (seed, nodes, duration, faults enabled, command line, output dir).
        ops: the paired history.
        anomalies: checker results.
        faults: the fault records (``faults.jsonl``).
        workloads: per workload, ``ran`` or why it was skipped.
        errors: violations outside the checkers (a node that failed to restart, an incomplete drain).
        harness_errors: exceptions in the harness itself.
    """
    checkers = {}
    for name, found in anomalies.items():
        examples = []
        for anomaly in found[:EXAMPLES_MAX]:
            example = anomaly.to_json()
            example["faults_active"] = faults_active(faults, example["start"], example["end"])
            example["faults_after"] = faults_after(faults, example["end"])
            examples.append(example)
        checkers[name] = {"count": len(found), "examples": examples}
    from chaos.checkers import INFORMATIONAL

    violations = sum(len(found) for name, found in anomalies.items() if name not in INFORMATIONAL) + len(errors)
    for name in INFORMATIONAL & set(checkers):
        checkers[name]["informational"] = True
    fault_kinds = Counter(f["fault"] for f in faults)
    undone = faults_not_done(faults, int(meta.get("schedule_length") or 0))
    return {
        "valid": violations == 0 and not harness_errors and not undone,
        "violations": violations,
        **meta,
        "operations": {"total": len(ops), "by_kind": op_counts(ops)},
        "values": value_counts(ops),
        "faults": {"total": len(faults), "by_kind": dict(sorted(fault_kinds.items())),
                   "failed": [f for f in faults if f.get("error") and f.get("error") != "skipped"],
                   "not_done": undone, "not_applicable": faults_not_applicable(faults)},
        "drain_incomplete": drain_incomplete(ops),
        "workloads": workloads,
        "checkers": checkers,
        "errors": errors,
        "harness_errors": harness_errors[:50],
    }


def faults_not_done(faults: list[dict[str, Any]], planned: int) -> list[str]:
    """Why the run did not inject what its seed planned: every fault that was skipped, failed or verifiably
    had no effect (an ``error`` in its record, see :data:`chaos.faults.INEFFECTIVE`), and a schedule of
    ``planned`` faults of which none took effect. Empty when every executed fault did something.
    A run with such a fault is never valid (exit 2 without a violation): a fault that silently did nothing
    would otherwise make a clean run of a run that tested nothing.

    A fault recorded as ``not_applicable`` (deliberately not injected, with its reason logged: a cluster
    ``corrupt`` that found no replica but a partition's only in-sync copy) is not "not done": the harness
    chose not to inject it because the result would prove nothing. It is listed separately
    (:func:`faults_not_applicable`) and does not count as a fault that took effect."""
    out = [f"fault #{f['id']} {f['fault']} on node {f['node']}: {f['error']}" for f in faults if f.get("error")]
    scheduled = [f for f in faults if f["fault"] != "lose-unsynced"]
    if planned and not any(not f.get("error") and not f.get("not_applicable") for f in scheduled):
        out.append(f"none of the {planned} planned faults took effect")
    return out


def faults_not_applicable(faults: list[dict[str, Any]]) -> list[str]:
    """The faults deliberately not injected (``not_applicable`` in their record), one line each."""
    return [f"fault #{f['id']} {f['fault']} on node {f['node']}: {f['not_applicable']}"
            for f in faults if f.get("not_applicable")]


def drain_incomplete(ops: list[Op]) -> list[dict[str, Any]]:
    """The partitions the final drain could not read to their HWM (``drain-incomplete`` operations of
    :func:`chaos.workloads.drain`): ``[{topic, partition, position, hwm, reason}, ...]``."""
    return [dict(op.value) for op in ops if op.f == "drain-incomplete"]


def exit_code(report: dict[str, Any]) -> int:
    """0 valid, 1 any violation, 2 harness errors or faults not done (and no violation)."""
    if report["violations"]:
        return 1
    return 2 if report["harness_errors"] or report["faults"].get("not_done") else 0


def summary(report: dict[str, Any]) -> str:
    """A short human summary of a report."""
    lines = []
    status = "VALID" if report["valid"] else ("VIOLATIONS FOUND" if report["violations"] else (
        "HARNESS ERROR" if report["harness_errors"] else "FAULTS NOT DONE (the run proves nothing)"))
    lines.append(f"chaos run: {status}  seed={report.get('seed')} nodes={report.get('nodes')} "
                 f"duration={report.get('duration_s')}s faults={','.join(report.get('faults_enabled', []))}")
    ops = report["operations"]
    kinds = ", ".join(f"{f} " + "/".join(f"{v}{k[0]}" for k, v in c.items()) for f, c in ops["by_kind"].items())
    lines.append(f"operations: {ops['total']} ({kinds})")
    values = report["values"]
    lines.append(f"values: written {values['written']}, acknowledged {values['acked']}, "
                 f"in final drain {values['drained']}")
    faults = report["faults"]
    lines.append(f"faults: {faults['total']} " + (", ".join(f"{k}={v}" for k, v in faults["by_kind"].items())
                                                 or "(none)"))
    for name, state in report["workloads"].items():
        lines.append(f"workload {name}: {state}")
    for name, result in report["checkers"].items():
        mark = "ok" if result["count"] == 0 else f"{result['count']} FOUND"
        if result.get("informational") and result["count"]:
            mark = f"{result['count']} (allowed: informational)"
        lines.append(f"  {name:30s} {mark}")
        for example in result["examples"][:3]:
            active = ", ".join(f"{f['fault']}#{f['id']}" for f in example["faults_active"]) or "none"
            after = ", ".join(f"{f['fault']}#{f['id']}@{f['start']}" for f in example["faults_after"][:2]) or "none"
            lines.append(f"      - {example['message']} [t={example['start']}..{example['end']}; faults: {active}; "
                         f"next: {after}]")
    for error in report["errors"]:
        lines.append(f"  ERROR: {error.get('error')}")
    for error in report["harness_errors"][:5]:
        lines.append(f"  HARNESS ERROR: {error}")
    for problem in report["faults"].get("not_done", [])[:5]:
        lines.append(f"  FAULT NOT DONE: {problem}")
    for skipped in report["faults"].get("not_applicable", [])[:5]:
        lines.append(f"  FAULT NOT APPLICABLE: {skipped}")
    for part in report.get("drain_incomplete", []):
        lines.append(f"  DRAIN INCOMPLETE: {part.get('topic')}/{part.get('partition')} read to "
                     f"{part.get('position')} of hwm {part.get('hwm')} ({part.get('reason')})")
    if not report["valid"]:
        lines.append(f"reproduce: {report.get('reproduce', '')}")
    lines.append(f"details: {report.get('out', '')}/report.json")
    return "\n".join(lines)


def write(out_dir: Path, report: dict[str, Any]) -> str:
    """Write ``report.json`` and ``summary.txt``; return the summary text."""
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    text = summary(report)
    (out_dir / "summary.txt").write_text(text + "\n")
    return text
