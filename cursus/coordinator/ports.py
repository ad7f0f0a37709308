"""What the group coordinator needs from its host, as narrow protocols and callables.

The coordinator (:mod:`cursus.coordinator.service`) never imports the broker: the broker builds these at
construction (standalone: :mod:`cursus.broker.group_log` over the ``__consumer_offsets`` replicas); a cluster
backs :class:`GroupLog` with its replicated log instead, and the state machine
(:mod:`cursus.coordinator.groups`) stays the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from cursus.coordinator.offsets import GroupRecord, Snapshot
from cursus.metadata.topics import TopicDefinition


class GroupLog(Protocol):
    """The durable, ordered log of group records (:mod:`cursus.coordinator.offsets` shapes).

    All records of one group are totally ordered: they commit in append order, and a failure to commit one
    fails every later one of that group too (a log that cannot write any more). Compaction, if the backend
    needs it, is its own business: it sees every append.
    """

    async def replay(self) -> Snapshot:
        """Read the whole retained log into the latest state (before the coordinator reports ready).

        Raises:
            ReplayError: a corrupt, unversioned or inconsistent record; ``str()`` is the not-ready reason.
        """
        ...

    def append(self, group: str, records: Sequence[GroupRecord]) -> asyncio.Future[None]:
        """Append ``records`` (all of ``group``, in order) now; the returned future resolves once they are
        durable (committed) and fails with a typed :class:`~cursus.wire.errors.BrokerError` (e.g.
        ``storage_unavailable``: outcome unknown) if they cannot be.

        Raises:
            BrokerError: the log cannot take the records now (nothing was appended).
        """
        ...

    async def close(self) -> None:
        """Finish background work (compaction); appended records are already queued."""
        ...


@dataclass(frozen=True, slots=True)
class PartitionOffsets:
    """A partition's offsets as the coordinator uses them: commit validation and GROUP_STATUS lag.

    Attributes:
        log_start_offset: the first retained offset.
        hwm: high watermark (first offset consumers may not read yet).
        leo: log end offset (next offset to assign).
    """

    log_start_offset: int
    hwm: int
    leo: int


class TimerHandle(Protocol):
    """A scheduled callback that can be cancelled (``asyncio.TimerHandle`` fits)."""

    def cancel(self) -> None:
        ...


#: ``topic(name)``: the definition of a topic, or None when it does not exist.
TopicLookup = Callable[[str], TopicDefinition | None]
#: ``topic_names()``: every defined topic (internal ones included; the coordinator skips them).
TopicNames = Callable[[], Iterable[str]]
#: ``partition_offsets(topic, partition)``: the offsets of a partition, or None when it has no local replica.
PartitionOffsetsLookup = Callable[[str, int], PartitionOffsets | None]
#: ``report(reason)``: the coordinator is not ready for ``reason`` (str), or ready (None).
ReadinessReport = Callable[[str | None], None]
#: ``call_later(delay_s, callback)``: run ``callback`` on the event loop after ``delay_s`` seconds.
CallLater = Callable[[float, Callable[[], None]], TimerHandle]
#: ``open_log()``: create the group log if needed and open it (startup; ``__consumer_offsets`` standalone).
OpenLog = Callable[[], Awaitable[GroupLog]]
#: A clock in integer milliseconds.
Clock = Callable[[], int]
