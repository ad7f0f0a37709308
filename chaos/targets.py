"""Which replica a cluster ``corrupt`` fault may damage (finding G, docs/chaos.md).

Corrupting bytes below the committed HWM of a partition's *only* in-sync copy leaves the broker nothing to
repair from: it correctly fails closed (``storage_unavailable``), and the run then proves nothing about
repair. So a ``corrupt`` fault only damages a replica whose partition has at least one other in-sync
member that is up, and prefers a follower (the issue asks for "a minority replica").

:func:`choose_corrupt_target` is a pure function over one ``CLUSTER_STATUS`` view; the nemesis calls it
with a fresh view right before the kill (the ISR can still change after that; see docs/chaos.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class CorruptTarget:
    """A safe replica to corrupt: node index, partition, and the ISR / leader it was chosen from."""

    node: int
    topic: str
    partition: int
    isr: tuple[int, ...]
    leader: int | None

    @property
    def follower(self) -> bool:
        """True when the chosen node does not lead the partition in the view."""
        return self.leader != self.node


def choose_corrupt_target(partitions: dict[str, dict[str, Any]], ids: dict[str, int], up: set[int],
                          keys: list[tuple[str, int]], drawn_node: int, drawn_target: int,
                          nodes: int) -> CorruptTarget | None:
    """The replica a ``corrupt`` fault damages, or None when no replica is safe to damage.

    Args:
        partitions: ``{"topic/p": {"leader": broker id, "isr": [broker id, ...]}}`` (a parsed
            ``CLUSTER_STATUS``, :func:`chaos.cluster.parse_status`).
        ids: broker id -> node index.
        up: node indexes that are up (the harness started them and they have not exited).
        keys: the (topic, partition) pairs that may be damaged, in schedule order.
        drawn_node: the node the schedule drew.
        drawn_target: the schedule's target index into ``keys`` (taken modulo ``len(keys)``).
        nodes: the cluster size (for the deterministic node order).

    A replica (node ``n``, partition ``k``) is *safe* when ``n`` is up and the ISR of ``k`` holds at least
    one other node that is up (that node has every committed offset, so ``n`` can repair from it). Among the
    safe replicas the choice is deterministic: followers before leaders, then the node closest after
    ``drawn_node`` (``(n - drawn_node) % nodes``), then the partition closest after ``drawn_target`` in
    ``keys``. So the schedule's draw is kept whenever it is safe.
    """
    if not keys or nodes < 1:
        return None
    best: tuple[tuple[int, int, int], CorruptTarget] | None = None
    for k_index, (topic, partition) in enumerate(keys):
        entry = partitions.get(f"{topic}/{partition}") or {}
        isr = tuple(sorted(ids[b] for b in entry.get("isr") or [] if b in ids))
        leader = ids.get(entry.get("leader") or "")
        for node in sorted(up):
            if not any(other != node and other in up for other in isr):
                continue
            rank = (int(leader == node), (node - drawn_node) % nodes, (k_index - drawn_target) % len(keys))
            if best is None or rank < best[0]:
                best = (rank, CorruptTarget(node, topic, partition, isr, leader))
    return best[1] if best is not None else None
