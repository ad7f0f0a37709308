"""ISR maintenance on a partition leader, sans-IO: which followers are in sync, by fetch progress and time.

A leader feeds every follower fetch in (:meth:`IsrTracker.on_fetch`) and periodically asks for a change
(:meth:`IsrTracker.decide`); the caller proposes the answer as a ``ChangeIsr`` metadata command. No
asyncio, no clock: every time is passed in milliseconds (a monotonic clock).

Kafka's rules (``Replica.updateFetchState`` and ``Partition.getOutOfSyncReplicas``):

* ``last_caught_up_ms`` of a follower is the last time one of its fetches reached the leader's LEO as it
  was at that time: a fetch at ``fetch_offset >= leader_leo`` is caught up *now*; a fetch that reaches the
  leader LEO of the follower's *previous* fetch was caught up *at the previous fetch* (under constant
  traffic a follower never sees the current LEO, but it does reach the one it was last shown).
* **shrink**: an ISR member other than the leader whose ``now - last_caught_up_ms`` exceeds
  ``lag_max_ms``. A follower that never fetches (dead, partitioned) is shrunk too: its clock starts when
  the leader's epoch starts (members get that much grace after an election).
* **shrink at once** a member whose last fetch in this epoch is *below the committed HWM*: it lost committed
  records (a replica repaired after corruption, cut to its last valid chunk) and must not stay electable
  until it has fetched them again (an ISR member never legitimately fetches below the committed HWM: the
  HWM is the minimum durable end over the ISR, and divergence never lies below it). Not Kafka's rule
  (Kafka's follower truncation never goes below the HWM); ours, for the repair of a corrupted replica.
* **expand**: a replica outside the ISR whose caught-up fetch is recent (within ``lag_max_ms``, in the
  current leader epoch), whose fetch offset is at least the committed HWM, and that is an *active* broker in
  the applied metadata (the FSM refuses to add an inactive one: a fenced broker may still fetch for a
  moment, and proposing it would only be refused, while it counted in the leader's maximal ISR).
* "the leader's LEO" is what a follower can reach: the leader service passes its *durable* end offset
  (only fsynced data is served), else a follower under constant traffic would never count as caught up;
* the leader is never removed; a new leader epoch resets everything (progress seen under another leader
  says nothing about this one).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import NamedTuple

PartitionKey = tuple[str, int]


class IsrChange(NamedTuple):
    """A proposed ISR for a partition (replica order), with the members it removes and adds."""

    isr: tuple[str, ...]
    shrunk: tuple[str, ...]
    expanded: tuple[str, ...]


@dataclass(slots=True)
class _Follower:
    #: The follower's last fetch offset (its durable LEO) in this leader epoch.
    fetch_offset: int
    #: When that fetch arrived, and the leader's LEO at that time.
    fetch_ms: int
    fetch_leader_leo: int
    #: The last time a fetch reached the leader's LEO (None: never in this epoch).
    caught_up_ms: int | None


@dataclass(slots=True)
class _Partition:
    leader_epoch: int
    started_ms: int
    followers: dict[str, _Follower] = field(default_factory=dict)


class IsrTracker:
    """Follower fetch progress of the partitions ``leader_id`` leads, and the ISR changes it implies.

    Args:
        leader_id: the local broker id (never removed from an ISR it leads).
    """

    def __init__(self, leader_id: str) -> None:
        self.leader_id = leader_id
        self._partitions: dict[PartitionKey, _Partition] = {}

    def _partition(self, key: PartitionKey, leader_epoch: int, now_ms: int) -> _Partition:
        state = self._partitions.get(key)
        if state is None or state.leader_epoch != leader_epoch:
            state = self._partitions[key] = _Partition(leader_epoch, now_ms)
        return state

    def on_fetch(self, key: PartitionKey, follower: str, fetch_offset: int, leader_leo: int, now_ms: int,
                 *, leader_epoch: int) -> None:
        """Record one fetch of ``follower`` at ``fetch_offset`` (records) while the leader's LEO is
        ``leader_leo``, at ``now_ms``, in ``leader_epoch`` (another epoch than the last one seen resets the
        partition). Fetches from the leader itself are ignored."""
        if follower == self.leader_id:
            return
        state = self._partition(key, leader_epoch, now_ms)
        previous = state.followers.get(follower)
        caught_up = previous.caught_up_ms if previous is not None else None
        if fetch_offset >= leader_leo:
            caught_up = now_ms
        elif previous is not None and fetch_offset >= previous.fetch_leader_leo:
            caught_up = max(caught_up or 0, previous.fetch_ms)
        state.followers[follower] = _Follower(fetch_offset, now_ms, leader_leo, caught_up)

    def last_caught_up_ms(self, key: PartitionKey, follower: str) -> int | None:
        """The follower's last caught-up time in the tracked epoch (None: never / unknown)."""
        state = self._partitions.get(key)
        entry = state.followers.get(follower) if state is not None else None
        return entry.caught_up_ms if entry is not None else None

    def fetch_offset(self, key: PartitionKey, follower: str) -> int | None:
        """The follower's last fetch offset in the tracked epoch (None: no fetch yet)."""
        state = self._partitions.get(key)
        entry = state.followers.get(follower) if state is not None else None
        return entry.fetch_offset if entry is not None else None

    def decide(self, key: PartitionKey, isr: tuple[str, ...], replicas: tuple[str, ...], committed_hwm: int,
               now_ms: int, lag_max_ms: int, *, leader_epoch: int,
               active: Collection[str] | None = None) -> IsrChange | None:
        """The ISR change for ``key`` now, or None when the ISR stays.

        Args:
            isr: the committed ISR (from metadata); replicas: the assignment's replicas (replica order).
            committed_hwm: the committed HWM (an expanded member must have fetched at least that far).
            lag_max_ms: ``replica_lag_time_max_ms``.
            leader_epoch: the leader epoch the ISR belongs to (another one resets the partition).
            active: the brokers active in the applied metadata (None: every replica); only they are expanded.

        The result holds the leader, only replicas, in replica order; it never removes the leader.
        """
        state = self._partition(key, leader_epoch, now_ms)
        members = set(isr)

        def lagging(member: str) -> bool:
            entry = state.followers.get(member)
            if entry is not None and entry.fetch_offset < committed_hwm:
                return True  # lost committed records (a repaired replica): out of the ISR now
            since = entry.caught_up_ms if entry is not None and entry.caught_up_ms is not None else state.started_ms
            return now_ms - since > lag_max_ms

        def caught_up(replica: str) -> bool:
            entry = state.followers.get(replica)
            return (entry is not None and entry.caught_up_ms is not None and (active is None or replica in active)
                    and now_ms - entry.caught_up_ms <= lag_max_ms and entry.fetch_offset >= committed_hwm)

        shrunk = tuple(m for m in replicas if m in members and m != self.leader_id and lagging(m))
        expanded = tuple(r for r in replicas if r not in members and r != self.leader_id and caught_up(r))
        wanted = (members | set(expanded) | {self.leader_id}) - set(shrunk)
        new_isr = tuple(r for r in replicas if r in wanted)
        if set(new_isr) == members:
            return None
        return IsrChange(new_isr, shrunk, expanded)

    def lag_ms(self, key: PartitionKey, follower: str, leader_end: int, now_ms: int) -> int:
        """How long ``follower`` has not been caught up (0 while its last fetch reached ``leader_end``, the
        leader's durable end): since its last caught-up fetch, else since the leader's epoch began here."""
        state = self._partitions.get(key)
        if state is None:
            return 0
        entry = state.followers.get(follower)
        if entry is not None and entry.fetch_offset >= leader_end:
            return 0
        since = entry.caught_up_ms if entry is not None and entry.caught_up_ms is not None else state.started_ms
        return max(0, now_ms - since)

    def forget(self, key: PartitionKey) -> None:
        """Drop the partition (no longer led here, or deleted)."""
        self._partitions.pop(key, None)

    def keys(self) -> list[PartitionKey]:
        """The partitions tracked."""
        return list(self._partitions)
