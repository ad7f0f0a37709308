"""The seeded fault schedule: a pure function of (seed, duration, fault kinds, nodes, tear targets).

Same inputs, same schedule: :func:`build_schedule` draws only from its own ``random.Random`` seeded with
the run seed, never from the clock or the environment. The schedule is written to ``schedule.json`` before
the run starts; ``python -m chaos schedule`` prints it without running anything.

Fault kinds (stage 1, one broker; the cluster issues add network partitions and leader kills):

``kill``
    ``kill -9`` a node, keep it down for ``hold_s``, restart it.
``pause``
    ``SIGSTOP`` a node for ``hold_s`` seconds, then ``SIGCONT``.
``restart``
    a clean restart (``SIGTERM``, wait for exit, start).
``torn-tail``
    a ``kill -9``, then tear the tail of one partition's last segment past its last fsynced position
    (``tear``: topic, partition, mode, garbage seed), then restart.
``lose-unsynced``
    not scheduled: a mode. Brokers run with ``CURSUS_STORAGE_FAULTS=lose_unsynced=1`` so every kill is a
    power cut that loses bytes not yet fsynced. Recorded as one fault spanning the run.

Faults run one at a time. ``at_s`` is the planned start (seconds after the workloads start); the nemesis
starts a fault at ``at_s`` or when the previous one ends, whichever is later.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

#: Every fault kind the runner knows.
FAULT_KINDS = ("kill", "pause", "restart", "lose-unsynced", "torn-tail")
#: Kinds placed on the timeline (``lose-unsynced`` is a mode for the whole run).
SCHEDULED_KINDS = ("kill", "pause", "restart", "torn-tail")
#: How a torn tail damages the bytes past the last fsynced position (see ``chaos.faults.tear_tail``).
TEAR_MODES = ("cut-chunk", "garble-chunk", "zero-fill", "append-garbage")

#: No fault starts in the first seconds of a run (workloads warm up) ...
WARMUP_S = 2.0
#: ... or in the last seconds (the system heals and settles before the final drain).
QUIET_TAIL_S = 4.0
#: Quiet time between one fault's planned end and the next fault's start.
GAP_S_MIN = 1.0
GAP_S_MAX = 4.0
#: kill: downtime before the restart; pause: time stopped.
KILL_DOWN_S_MIN, KILL_DOWN_S_MAX = 0.1, 1.5
PAUSE_S_MIN, PAUSE_S_MAX = 0.5, 4.0
#: What a restart is assumed to cost when spacing faults (the real cost is measured, not assumed).
RESTART_ESTIMATE_S = 1.0


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """One planned fault.

    Attributes:
        index: position in the schedule (from 0).
        at_s: planned start, seconds after the workloads start.
        kind: one of :data:`SCHEDULED_KINDS`.
        node: index of the target node.
        hold_s: pause length, or downtime after a kill; 0 for a clean restart.
        tear: for ``torn-tail``: ``{"target": i, "mode": m, "seed": s}`` where ``target`` indexes the
            node's tear targets (topic, partition) list.
    """

    index: int
    at_s: float
    kind: str
    node: int
    hold_s: float
    tear: dict[str, Any] | None = field(default=None)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def parse_kinds(text: str) -> tuple[str, ...]:
    """Parse ``kill,pause,...`` into a tuple of known kinds, in :data:`FAULT_KINDS` order.

    Raises:
        ValueError: an unknown kind (a typo must not silently disable a fault).
    """
    kinds = {part.strip() for part in text.split(",") if part.strip()}
    unknown = kinds - set(FAULT_KINDS)
    if unknown:
        raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(FAULT_KINDS)}")
    return tuple(kind for kind in FAULT_KINDS if kind in kinds)


def build_schedule(seed: int, duration_s: float, kinds: tuple[str, ...], nodes: int,
                   tear_targets: int = 1) -> list[FaultSpec]:
    """The fault timeline for one run.

    Args:
        seed: the run seed.
        duration_s: how long the workloads run; faults fit in ``[WARMUP_S, duration_s - QUIET_TAIL_S)``.
        kinds: fault kinds enabled (see :func:`parse_kinds`); kinds not in :data:`SCHEDULED_KINDS` are modes.
        nodes: number of broker nodes (targets are drawn from ``range(nodes)``).
        tear_targets: number of (topic, partition) targets per node a torn tail may pick from.

    Returns:
        The faults in start order; empty when no scheduled kind is enabled.
    """
    assert nodes >= 1, nodes
    assert tear_targets >= 1, tear_targets
    rng = random.Random(f"cursus-chaos-schedule:{seed}")
    scheduled = [kind for kind in SCHEDULED_KINDS if kind in kinds]
    out: list[FaultSpec] = []
    t = WARMUP_S + rng.uniform(0.0, 1.0)
    end_s = duration_s - QUIET_TAIL_S
    bound = 10_000  # a loop bound, far above any real schedule
    while scheduled and t < end_s and len(out) < bound:
        kind = rng.choice(scheduled)
        node = rng.randrange(nodes)
        tear = None
        if kind == "pause":
            hold = rng.uniform(PAUSE_S_MIN, PAUSE_S_MAX)
            cost = hold
        elif kind == "restart":
            hold = 0.0
            cost = RESTART_ESTIMATE_S
        else:  # kill, torn-tail
            hold = rng.uniform(KILL_DOWN_S_MIN, KILL_DOWN_S_MAX)
            cost = hold + RESTART_ESTIMATE_S
            if kind == "torn-tail":
                tear = {"target": rng.randrange(tear_targets), "mode": rng.choice(TEAR_MODES),
                        "seed": rng.randrange(1 << 32)}
        out.append(FaultSpec(index=len(out), at_s=round(t, 3), kind=kind, node=node, hold_s=round(hold, 3),
                             tear=tear))
        t += cost + rng.uniform(GAP_S_MIN, GAP_S_MAX)
    return out
