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
    power cut that loses bytes not yet fsynced. Recorded as one fault spanning the run. In a cluster only a
    minority runs in this mode (node 0 of 3): losing unsynced bytes on a majority can lose acknowledged
    writes by design (acks=all means "fsynced on the ISR", not "on a majority of disks forever").

Cluster kinds (``--nodes`` > 1; a cluster also changes ``kill`` and ``pause``):

``kill`` (cluster)
    ``target`` says whom: ``random`` (the drawn ``node``), ``raft-leader`` (the Raft leader when the fault
    starts) or ``partition-leader`` (the leader of tear target ``tear.target``).
``pause`` (cluster)
    held longer than the election timeout (:data:`CLUSTER_PAUSE_S_MIN`..:data:`CLUSTER_PAUSE_S_MAX`).
``partition``
    network faults between brokers (nftables drops in the harness namespace); ``cut`` is
    ``{"mode", "side": [nodes], "flaps"}``: ``isolate`` (``side`` cut off both ways), ``split`` (``side`` is
    the minority, cut off both ways from the majority), ``one-way`` (packets from ``side[0]`` to ``side[1]``
    dropped, the other direction flows), ``flap`` (``isolate`` switched on and off ``flaps`` times within
    ``hold_s``). Healed at the end of the fault.
``corrupt``
    ``kill -9`` one node (a minority), damage the tail of one of its replicas' last segment (acknowledged
    bytes included: ``tear`` as for torn tails, mode ``flip-tail``), restart it. The broker must repair the
    replica from the leader or refuse to start (then the harness, as an operator would, removes that
    replica's directory and starts the node again); it must never serve the bad bytes.

Faults run one at a time. ``at_s`` is the planned start (seconds after the workloads start); the nemesis
starts a fault at ``at_s`` or when the previous one ends, whichever is later.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

#: Every fault kind the runner knows.
FAULT_KINDS = ("kill", "pause", "restart", "lose-unsynced", "torn-tail", "partition", "corrupt")
#: Kinds placed on the timeline (``lose-unsynced`` is a mode for the whole run).
SCHEDULED_KINDS = ("kill", "pause", "restart", "torn-tail", "partition", "corrupt")
#: Kinds that need a cluster (more than one node).
CLUSTER_KINDS = ("partition", "corrupt")
#: Whom a cluster kill targets.
KILL_TARGETS = ("random", "raft-leader", "partition-leader")
#: Network fault modes.
CUT_MODES = ("isolate", "split", "one-way", "flap")
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
#: Cluster pauses: longer than the chaos cluster's election timeout (``chaos.cluster.CLUSTER_TIMERS``: at
#: most 1.6 s), so a paused leader is replaced while it sleeps.
CLUSTER_PAUSE_S_MIN, CLUSTER_PAUSE_S_MAX = 2.0, 6.0
#: Network faults last this long.
CUT_S_MIN, CUT_S_MAX = 2.0, 8.0
#: A cluster restart costs more (the node waits for the Raft cluster before it is ready).
CLUSTER_RESTART_ESTIMATE_S = 3.0


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """One planned fault.

    Attributes:
        index: position in the schedule (from 0).
        at_s: planned start, seconds after the workloads start.
        kind: one of :data:`SCHEDULED_KINDS`.
        node: index of the target node.
        hold_s: pause length, or downtime after a kill; 0 for a clean restart.
        tear: for ``torn-tail`` and ``corrupt``: ``{"target": i, "mode": m, "seed": s}`` where ``target``
            indexes the node's tear targets (topic, partition) list; for a ``partition-leader`` kill, which
            partition.
        target: cluster ``kill``: ``random``, ``raft-leader`` or ``partition-leader``.
        cut: ``partition``: ``{"mode", "side", "flaps"}`` (see the module docstring).
    """

    index: int
    at_s: float
    kind: str
    node: int
    hold_s: float
    tear: dict[str, Any] | None = field(default=None)
    target: str | None = field(default=None)
    cut: dict[str, Any] | None = field(default=None)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def parse_kinds(text: str, nodes: int = 1) -> tuple[str, ...]:
    """Parse ``kill,pause,...`` into a tuple of known kinds, in :data:`FAULT_KINDS` order.

    Raises:
        ValueError: an unknown kind (a typo must not silently disable a fault), or a cluster kind
            (:data:`CLUSTER_KINDS`) with ``nodes`` < 2.
    """
    kinds = {part.strip() for part in text.split(",") if part.strip()}
    unknown = kinds - set(FAULT_KINDS)
    if unknown:
        raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(FAULT_KINDS)}")
    needs_cluster = kinds & set(CLUSTER_KINDS)
    if needs_cluster and nodes < 2:
        raise ValueError(f"fault kinds {sorted(needs_cluster)} need a cluster (--nodes 3)")
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
    if nodes > 1:
        return _cluster_schedule(rng, duration_s, scheduled, nodes, tear_targets)
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


def _cluster_schedule(rng: random.Random, duration_s: float, scheduled: list[str], nodes: int,
                      tear_targets: int) -> list[FaultSpec]:
    """The cluster timeline (same rules as :func:`build_schedule`, cluster parameters)."""
    out: list[FaultSpec] = []
    t = WARMUP_S + 2.0 + rng.uniform(0.0, 1.0)
    end_s = duration_s - QUIET_TAIL_S - 2.0
    minority = (nodes - 1) // 2 or 1
    while scheduled and t < end_s and len(out) < 10_000:
        kind = rng.choice(scheduled)
        node = rng.randrange(nodes)
        tear: dict[str, Any] | None = None
        target: str | None = None
        cut: dict[str, Any] | None = None
        if kind == "pause":
            hold = rng.uniform(CLUSTER_PAUSE_S_MIN, CLUSTER_PAUSE_S_MAX)
            cost = hold
        elif kind == "restart":
            hold, cost = 0.0, CLUSTER_RESTART_ESTIMATE_S
        elif kind == "partition":
            hold = rng.uniform(CUT_S_MIN, CUT_S_MAX)
            mode = rng.choice(CUT_MODES)
            if mode == "split":
                side = sorted(rng.sample(range(nodes), minority))
            elif mode == "one-way":
                side = rng.sample(range(nodes), 2)
            else:
                side = [node]
            cut = {"mode": mode, "side": side, "flaps": rng.randint(2, 5) if mode == "flap" else 0}
            cost = hold
        else:  # kill, torn-tail, corrupt
            hold = rng.uniform(KILL_DOWN_S_MIN, KILL_DOWN_S_MAX)
            cost = hold + CLUSTER_RESTART_ESTIMATE_S
            if kind == "kill":
                target = rng.choice(KILL_TARGETS)
                tear = {"target": rng.randrange(tear_targets)} if target == "partition-leader" else None
            else:
                tear = {"target": rng.randrange(tear_targets),
                        "mode": rng.choice(TEAR_MODES) if kind == "torn-tail" else "flip-tail",
                        "seed": rng.randrange(1 << 32)}
        out.append(FaultSpec(index=len(out), at_s=round(t, 3), kind=kind, node=node, hold_s=round(hold, 3),
                             tear=tear, target=target, cut=cut))
        t += cost + rng.uniform(GAP_S_MIN + 1.0, GAP_S_MAX + 2.0)
    return out
