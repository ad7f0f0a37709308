"""Chaos harness for Cursus-py: seeded fault schedules, Jepsen-style histories and checkers.

Run ``python -m chaos run --nodes 1 --duration 60 --faults kill,pause,restart,lose-unsynced,torn-tail
--seed N --out DIR``; see ``docs/chaos.md``. Modules, one job each:

* :mod:`chaos.schedule`: the seeded fault schedule (a pure function of seed and options);
* :mod:`chaos.nodes`: broker processes with their own data dirs and ports (N nodes);
* :mod:`chaos.faults`: executes the schedule (kill, pause, restart, torn tail) and records every fault;
* :mod:`chaos.workloads`: producers, readers, group consumers and the final drain, recording operations;
* :mod:`chaos.history`: the operation history (invoke, then ok / fail / info) and its JSON-lines file;
* :mod:`chaos.checkers`: pure checks over a history, one per anomaly;
* :mod:`chaos.report`: ``report.json`` and the human summary.
"""

from __future__ import annotations

__all__ = ["checkers", "faults", "history", "nodes", "report", "schedule", "workloads"]
