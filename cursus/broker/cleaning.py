"""The broker's log cleaner: compacts partitions of ``cleanup_policy=compact`` / ``delete,compact`` topics.

Every ``log_cleanup_interval`` seconds :meth:`LogCleanerService.run_once` looks at each local replica of a
compacted application topic (never an event-sourcing one) and of ``__consumer_offsets`` (the only
broker-owned topic cleaned, with the group-aware
:class:`~cursus.coordinator.offsets_compaction.OffsetsPlanner`: a group tombstone supersedes the group's
other keys; only once the coordinator replayed it), computes its
*cleanable end* and *dirty ratio*, and when the ratio reaches ``log_min_cleanable_dirty_ratio`` runs one
pass (:func:`cursus.storage.cleaner.clean_pass`) on the cleaner's own thread, then swaps each cleaned
segment on the writer thread (:meth:`PartitionLog.replace_with_cleaned`). The event loop only schedules.

Cleanable end = min(the replica's HWM, the LSO of its transaction index, the active segment's base); in a
cluster also the committed HWM, and a pass only runs while :func:`cluster_gate` holds (spec
"ALTER_TOPIC_CONFIG": every configured replica active and in the ISR, committed HWM authoritative, local and
FSM lifecycle epoch, LEO and HWM agree). Each replica cleans only its own log. A partition that ever took
transactional records is cleaned only by a leader whose transaction index is complete: a follower keeps no
index, so it cleans once it leads.

Dirty ratio = bytes of cleanable segments neither rewritten by the cleaner (``.compacted``) nor below the
offset the last pass covered, over all cleanable bytes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from cursus.coordinator.offsets import OFFSETS_TOPIC
from cursus.coordinator.offsets_compaction import OffsetsPlanner
from cursus.metadata.state import MetadataState, PartitionAssignment
from cursus.metadata.topics import is_compacted_policy, is_internal_topic
from cursus.storage import OffsetOutOfRange, PartitionLog, StorageError
from cursus.storage import faults as storage_faults
from cursus.storage.cleaner import PassAborted, PassStats, Throttle, clean_pass, cleanable_segments
from cursus.storage.compaction import dirty_ratio

if TYPE_CHECKING:
    from cursus.broker.core import Broker
    from cursus.broker.replica import Replica

log = logging.getLogger("cursus.broker.cleaner")


def cluster_gate(state: MetadataState, assignment: PartitionAssignment | None, *, lifecycle_epoch: int,
                 leo: int, hwm: int) -> int | None:
    """In a cluster: the committed HWM a replica may clean below, or ``None`` while cleaning is gated.

    Gated unless every configured replica is an active broker and in the ISR, the local lifecycle epoch is
    the FSM's, and the local log holds the committed HWM (``leo >= committed_hwm``, ``hwm >= committed_hwm``
    is not required: the result is capped by both). Pure.
    """
    if assignment is None or not assignment.replicas:
        return None
    if set(assignment.isr) != set(assignment.replicas):
        return None
    for broker_id in assignment.replicas:
        info = state.brokers.get(broker_id)
        if info is None or info.status != "active":
            return None
    if lifecycle_epoch != assignment.lifecycle_epoch or leo < assignment.committed_hwm:
        return None
    return min(assignment.committed_hwm, hwm)


class LogCleanerService:
    """Schedules cleaner passes for the broker's compacted partitions (see the module docstring).

    Thread-safety: :meth:`run_once` runs on the event loop; passes on the single cleaner thread; swaps on the
    writer thread.
    """

    def __init__(self, broker: Broker) -> None:
        self._broker = broker
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cursus-cleaner")
        #: Per partition log: the cleanable end the last pass covered (Kafka's cleaner checkpoint, in memory;
        #: keyed by the log object, so a deleted and recreated topic starts afresh).
        self._cleaned_through: weakref.WeakKeyDictionary[PartitionLog, int] = weakref.WeakKeyDictionary()
        self._running = False
        self._closed = False
        #: Set at close: a running (maybe throttled) pass stops at its next chunk.
        self._stop = threading.Event()

    @property
    def interval_s(self) -> float:
        """Seconds between checks (``log_cleanup_interval``, at least 10 ms)."""
        return max(0.01, float(self._broker.config.log_cleanup_interval))

    def cleanable_end(self, replica: Replica) -> int | None:
        """The offset below which ``replica``'s log may be cleaned now, or ``None`` while gated."""
        broker = self._broker
        end = min(replica.hwm, replica.log.durable_end_offset)
        index = broker.transactions.read_index(replica.topic, replica.partition)
        state = broker.metadata.state
        if index is not None:
            end = index.lso(end)
        elif (replica.topic, replica.partition) in state.txn_touched:
            # Its transaction state is unknown here: a follower keeps no index, and a new leader's is not
            # back from the log yet. Without the LSO and the aborted ranges an open or aborted record would
            # supersede the committed record of its key.
            return None
        if state.cluster:
            committed = cluster_gate(state, state.assignment(replica.topic, replica.partition),
                                     lifecycle_epoch=replica.lifecycle_epoch, leo=replica.leo, hwm=replica.hwm)
            if committed is None:
                return None
            end = min(end, committed)
        return end

    def dirty(self, replica: Replica, end: int) -> tuple[int, int]:
        """``(dirty bytes, cleanable bytes)`` of ``replica``'s log below ``end``."""
        through = self._cleaned_through.get(replica.log, -1)
        if through > replica.log.log_end_offset:  # the log was reset (TRUNCATE) since
            through = -1
        segments = cleanable_segments(replica.log.segments_info(), end)
        total = sum(s.size_bytes for s in segments)
        dirty_bytes = sum(s.size_bytes for s in segments if not s.is_compacted and s.next_offset > through)
        return dirty_bytes, total

    async def run_once(self) -> int:
        """One check of every compacted partition; returns how many segments were rewritten."""
        if self._running or self._closed:
            return 0
        self._running = True
        try:
            rewritten = 0
            for (topic, partition), replica in list(self._broker.replicas.items()):
                if self._closed:
                    break
                rewritten += await self._check(topic, partition, replica)
            return rewritten
        finally:
            self._running = False

    async def _check(self, topic: str, partition: int, replica: Replica) -> int:
        broker = self._broker
        defn = broker.metadata.get(topic)
        if (defn is None or defn.event_sourcing or (is_internal_topic(topic) and topic != OFFSETS_TOPIC)
                or replica.fenced is not None
                or replica.deleted or not is_compacted_policy(defn.policy.cleanup_policy)):
            return 0
        if topic == OFFSETS_TOPIC and not broker.coordinator.ready:
            return 0  # replay has not run or refused the log: leave the evidence as it is
        end = self.cleanable_end(replica)
        metrics = broker.metrics
        if end is None:
            metrics.cleaner_gated_total.inc()
            return 0
        dirty_bytes, total = self.dirty(replica, end)
        ratio = dirty_ratio(dirty_bytes, total)
        metrics.child(metrics.cleaner_dirty_ratio, topic, str(partition)).set(ratio)
        if dirty_bytes == 0 or ratio < float(broker.config.log_min_cleanable_dirty_ratio):
            return 0
        return await self.clean(replica, end, reason="dirty_ratio")

    async def clean(self, replica: Replica, end: int, *, reason: str) -> int:
        """Run one pass on ``replica`` below ``end`` and swap its copies; returns segments rewritten."""
        broker = self._broker
        metrics = broker.metrics
        config = broker.config
        index = broker.transactions.read_index(replica.topic, replica.partition)
        aborted = index.hidden_slice(replica.log_start_offset, end) if index is not None else ()
        active = storage_faults.ACTIVE
        hook = active.cleaner_point if active is not None and active.cleaner_crash_at else None
        plog = replica.log
        # A pass covers only closed segments wholly below ``end``: a segment still active now (its records
        # below ``end``) is dirty once it closes, so the pass counts as clean only through the last one it reads.
        covered = cleanable_segments(plog.segments_info(), end)
        started = time.monotonic()
        now_ms = broker.clock.wall_ms()
        retention_ms = config.log_cleaner_delete_retention_ms
        planner = (OffsetsPlanner(now_ms=now_ms, delete_retention_ms=retention_ms, aborted=aborted)
                   if replica.topic == OFFSETS_TOPIC else None)
        run = functools.partial(clean_pass, plog, end, now_ms=now_ms, delete_retention_ms=retention_ms,
                                aborted=aborted, planner=planner,
                                throttle=Throttle(config.log_cleaner_io_max_bytes_per_second, sleep=self._stop.wait,
                                                  stopped=self._stop.is_set), crash_hook=hook)
        try:
            stats: PassStats = await asyncio.get_running_loop().run_in_executor(self._executor, run)
            swapped = 0
            for copy in stats.copies:
                done = await broker.run_blocking(functools.partial(
                    plog.replace_with_cleaned, copy.base_offset, copy.old_size_bytes, copy.next_offset,
                    copy.size_bytes, copy.index_entries, hook))
                swapped += int(bool(done))
        except PassAborted:
            return 0
        except (OffsetOutOfRange, StorageError, OSError, AssertionError) as exc:
            if isinstance(exc, AssertionError) and not (plog.is_closed or replica.deleted):
                raise  # a programmer error, not a topic deleted under the pass
            metrics.child(metrics.cleaner_runs_total, "error", reason).inc()
            log.warning("cleaner pass on %s/%d failed: %r", replica.topic, replica.partition, exc)
            return 0
        duration = time.monotonic() - started
        if covered:
            self._cleaned_through[plog] = covered[-1].next_offset
        metrics.child(metrics.cleaner_runs_total, "success", reason).inc()
        metrics.cleaner_bytes_read_total.inc(stats.bytes_read)
        metrics.cleaner_bytes_cleaned_total.inc(max(0, stats.bytes_before - stats.bytes_after))
        metrics.cleaner_last_run_seconds.set(duration)
        metrics.child(metrics.cleaner_dirty_ratio, replica.topic, str(replica.partition)).set(0.0)
        if swapped:
            log.info("cleaned %s/%d below offset %d: %d segment(s) rewritten, %d records removed, %d -> %d bytes "
                     "in %.0f ms", replica.topic, replica.partition, end, swapped, stats.records_removed,
                     stats.bytes_before, stats.bytes_after, duration * 1000)
        return swapped

    def close(self) -> None:
        """Stop scheduling and wait for a running pass (blocking: call it off the loop)."""
        self._closed = True
        self._stop.set()
        self._executor.shutdown(wait=True, cancel_futures=True)
