"""The broker's event store: stream indexes and snapshot stores of event-sourcing partitions (I/O glue).

One :class:`PartitionEvents` per event-sourcing partition this broker has touched, opened lazily. Its
:class:`~cursus.eventstore.StreamIndex` is a derived view of the partition's *committed* log:
:meth:`EventStore.catch_up` scans the log from the index's ``indexed_offset`` up to the replica's HWM
(on the offload threads) before any event command reads or checks versions, so leader, new leader and
restart share one code path, and an event above the committed HWM is never visible. The index checkpoint
(``eventstore.index`` in the partition directory, atomic replace) lets a restart resume the scan there; a
torn or corrupt checkpoint, or one ahead of the recovered log, is discarded or cut back and the log is
rescanned (the log is the authority).

Appends in flight (appended on this leader, not yet indexed) are tracked per key in
:attr:`PartitionEvents.pending`, so the optimistic version check counts them: two concurrent appends with
the same expected version get one success and one ``version_conflict``. The check and the append run
without an ``await`` in between (see :mod:`cursus.broker.handlers.events`). Pending appends are dropped
once indexed, or when the replica's leader epoch changes (a new leader starts from its committed log).

Transactional appends (TXN_APPEND_STREAM, docs/event-sourcing.md "Transactional appends"): the index
scan stops at the partition's LSO (every transaction below it is decided: a transactional event counts
unless aborted) and, without a transaction index here (a follower), at the first transactional record. A
staged event is a pending append tagged with its (producer id, epoch): it counts for its own transaction's
next version, holds the key against every other writer while undecided, and is dropped once aborted. A new
leader epoch whose index is held back by undecided transactions takes the events above the LSO as pending
(:meth:`EventStore._recover_pending`).

Snapshots (``eventstore.snapshots``, append-only, checksummed records; fsynced before SAVE_SNAPSHOT
answers OK) keep the latest snapshot per key; a torn final record is cut off at open.

Thread-safety: loop thread; file work runs on the offload threads, one at a time per partition (locks).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import logging
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cursus.eventstore import (
    IndexCheckpointError,
    Snapshot,
    SnapshotStore,
    StreamEntry,
    StreamIndex,
    decode_snapshot_log,
    encode_snapshot_record,
)
from cursus.eventstore.peek import EventFields, peek_event
from cursus.internal.client import InternalRpcError
from cursus.internal.v1 import replication_pb2 as pb
from cursus.storage import CorruptLogError, OffsetOutOfRange, PartitionLog
from cursus.storage.atomic import atomic_write, fsync_dir
from cursus.transactions.markers import txn_info
from cursus.wire.errors import BrokerError

if TYPE_CHECKING:
    from cursus.broker.core import Broker
    from cursus.broker.replica import Replica

log = logging.getLogger("cursus.eventstore")

INDEX_FILE = "eventstore.index"
SNAPSHOT_FILE = "eventstore.snapshots"
#: Records read per scan step while the index catches up.
SCAN_RECORDS = 4096
SCAN_BYTES = 4 * 1024 * 1024
_U32 = struct.Struct(">I")


@dataclass(slots=True)
class PendingAppend:
    """An event appended on this leader that the index has not seen yet (``offset`` is its log offset)."""

    version: int
    offset: int
    event_id: str | None = None
    digest: str | None = None
    #: (producer id, producer epoch) of the transaction that staged it (TXN_APPEND_STREAM), None otherwise
    producer: tuple[str, int] | None = None


@dataclass(slots=True)
class PartitionEvents:
    """Event-sourcing state of one partition (see the module docstring)."""

    topic: str
    partition: int
    directory: Path
    index: StreamIndex
    snapshots: SnapshotStore
    #: key -> appends in flight, in offset order.
    pending: dict[str, list[PendingAppend]] = field(default_factory=dict)
    #: The replica's leader epoch when the pending appends were made.
    pending_epoch: int = -1
    #: The LEO when this leader epoch's first append was checked: every event below it is in the log
    #: from earlier epochs, so the index must cover it before a version check.
    epoch_base: int = 0
    checkpointed_events: int = 0
    scan_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    snapshot_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: bool = False
    #: The replica this state belongs to (a deleted and recreated topic has a new one: reopened).
    replica: Replica | None = None

    def current_version(self, key: str) -> int:
        """Committed version plus this leader's appends in flight (what the next append must exceed)."""
        pending = self.pending.get(key)
        return pending[-1].version if pending else self.index.version(key)

    def find(self, key: str, version: int) -> StreamEntry | PendingAppend | None:
        """The event of ``key`` at ``version``, indexed or in flight."""
        for p in self.pending.get(key, ()):
            if p.version == version:
                return p
        return self.index.find(key, version)

    def start_epoch(self, leader_epoch: int, leo: int) -> None:
        """This leader's first version check in ``leader_epoch``: earlier epochs' pending appends are moot
        (committed ones are indexed, the rest were truncated), and the index covers the log below ``leo``."""
        self.pending.clear()
        self.pending_epoch = leader_epoch
        self.epoch_base = leo

    def reserve(self, key: str, append: PendingAppend) -> None:
        """Count ``append`` (just handed to the log) in later version checks."""
        self.pending.setdefault(key, []).append(append)

    def check_version(self, key: str, version: int, producer: tuple[str, int] | None,
                      undecided: Callable[[PendingAppend], bool]) -> int:
        """The optimistic version check of an append by ``producer`` (a transaction's (producer id, epoch);
        None for APPEND_STREAM); returns the current version. ``version`` must be current + 1, where current
        counts the index, the appends in flight and every staged transactional append. While ``key`` has a
        staged append of another, still undecided transaction, every append to it conflicts (it would
        build on an event that may yet vanish): the transaction holds the key until it commits or aborts.

        Raises:
            BrokerError: ``version_conflict topic= key= current= expected=`` (``reason=transaction_in_progress``
                when another transaction holds the key).
        """
        current = self.current_version(key)
        for p in self.pending.get(key, ()):
            if p.producer is not None and p.producer != producer and undecided(p):
                raise BrokerError.of("version_conflict", topic=self.topic, key=key, current=current,
                                     expected=version, reason="transaction_in_progress")
        if version != current + 1:
            raise BrokerError.of("version_conflict", topic=self.topic, key=key, current=current, expected=version)
        return current

    def prune_pending(self, aborted: Callable[[int], bool] = lambda offset: False) -> None:
        """Forget appends the index now covers, and staged transactional appends that were aborted
        (``aborted(offset)``): their versions are free again."""
        indexed = self.index.indexed_offset
        for key in list(self.pending):
            kept = [p for p in self.pending[key]
                    if p.offset >= indexed and not (p.producer is not None and aborted(p.offset))]
            if kept:
                self.pending[key] = kept
            else:
                del self.pending[key]


def _load(directory: Path) -> tuple[StreamIndex, SnapshotStore]:
    """Blocking: the index checkpoint (empty when absent or torn) and the snapshots (torn tail cut off)."""
    index = StreamIndex()
    try:
        index = StreamIndex.decode((directory / INDEX_FILE).read_bytes())
    except FileNotFoundError:
        pass
    except IndexCheckpointError as exc:
        log.warning("%s: stream index checkpoint discarded (%s); rebuilding from the log", directory, exc)
    path = directory / SNAPSHOT_FILE
    snapshots: list[Snapshot] = []
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        data = b""
    if data:
        snapshots, valid = decode_snapshot_log(data)
        if valid < len(data):
            log.warning("%s: snapshot file has a torn tail of %d bytes; discarded", directory, len(data) - valid)
            with open(path, "r+b") as fh:
                fh.truncate(valid)
                fh.flush()
                os.fsync(fh.fileno())
    return index, SnapshotStore(snapshots)


class _EventWalk:
    """Blocking: the event records of ``plog`` in ``[start, end)``, read ``SCAN_RECORDS`` / ``SCAN_BYTES`` at
    a time. Iterating yields (fields, stored record without its length prefix) for each record that is an
    event (:func:`peek_event`); control records and records that are not events are left out. ``reached`` is
    the offset the walk has read past: ``start`` at first, then each read's next offset once all of its
    records were yielded (a caller that stops early knows its own stop offset)."""

    __slots__ = ("plog", "end", "reached")

    def __init__(self, plog: PartitionLog, start: int, end: int) -> None:
        self.plog = plog
        self.end = end
        self.reached = start

    def __iter__(self) -> Iterator[tuple[EventFields, memoryview]]:
        while self.reached < self.end:
            result = self.plog.read(self.reached, max_offset=self.end, max_records=SCAN_RECORDS,
                                    max_bytes=SCAN_BYTES)
            if result.record_count == 0:
                return
            records = result.records
            view = memoryview(records)
            pos = 0
            for _ in range(result.record_count):
                length = _U32.unpack_from(records, pos)[0]
                fields = peek_event(records, pos + 4, pos + 4 + length)
                if fields is not None and not fields.control:
                    yield fields, view[pos + 4:pos + 4 + length]
                pos += 4 + length
            self.reached = result.next_offset


def _scan(plog: PartitionLog, start: int, end: int,
          visible: Callable[[int], bool | None]) -> tuple[list[tuple[str, StreamEntry]], int]:
    """Blocking: the event records of ``plog`` in ``[start, end)`` as (key, entry), and the offset the
    scan reached. An event record carries a key and an aggregate version (:func:`peek_event`); control
    records are skipped; a transactional (TXN_APPEND_STREAM) record counts when ``visible(offset)`` is
    True (committed), is skipped when False (aborted), and stops the scan at its offset when None (not
    decided yet, or unknown here: the scan resumes there later)."""
    found: list[tuple[str, StreamEntry]] = []
    walk = _EventWalk(plog, start, end)
    for fields, _record in walk:
        if fields.transactional:
            decided = visible(fields.offset)
            if decided is None:
                return found, fields.offset
            if not decided:
                continue
        found.append((fields.key, StreamEntry(fields.aggregate_version, fields.offset, fields.event_id,
                                              fields.payload_digest)))
    return found, walk.reached


def _append_snapshot(directory: Path, data: bytes) -> None:
    """Blocking: append one snapshot record and fsync it (and the directory when the file is new)."""
    path = directory / SNAPSHOT_FILE
    new = not path.exists()
    with open(path, "ab") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    if new:
        fsync_dir(directory)


def read_records(plog: PartitionLog, offsets: list[int], max_bytes: int) -> tuple[bytes, int]:
    """Blocking: the stored record bytes (records section form) at ``offsets`` (increasing), in order, up
    to ``max_bytes`` (at least one); returns (records section, records taken). Runs of consecutive offsets
    are read with one log read each. Offsets no longer retained are skipped."""
    if len(offsets) > 1 and offsets[-1] - offsets[0] + 1 <= DENSE_FACTOR * len(offsets):
        dense = _read_dense(plog, offsets, max_bytes)
        if dense is not None:
            return dense
    parts: list[bytes] = []
    size = taken = 0
    i = 0
    while i < len(offsets):
        j = i + 1
        while j < len(offsets) and offsets[j] == offsets[j - 1] + 1:
            j += 1
        first, count = offsets[i], j - i
        i = j
        try:
            result = plog.read(first, max_offset=first + count, max_records=count,
                               max_bytes=max(1, max_bytes - size))
        except OffsetOutOfRange:
            continue
        if result.record_count == 0 or (parts and size + len(result.records) > max_bytes):
            if parts:
                break
            continue
        parts.append(result.records)
        size += len(result.records)
        taken += result.record_count
        if result.record_count < count:
            break  # the byte limit cut this run
    return b"".join(parts), taken


#: READ_STREAM reads the whole offset span of an aggregate's events at once (and keeps its records) when the
#: span holds at most this many records per event.
DENSE_FACTOR = 4


def _read_dense(plog: PartitionLog, offsets: list[int], max_bytes: int) -> tuple[bytes, int] | None:
    """:func:`read_records` for offsets that fill much of their span: one read of the span, filtered.
    None when the span is no longer wholly retained or does not fit the byte budget (read per run)."""
    first, last = offsets[0], offsets[-1]
    span = last - first + 1
    try:
        result = plog.read(first, max_offset=last + 1, max_records=span, max_bytes=max_bytes * DENSE_FACTOR)
    except OffsetOutOfRange:
        return None
    if result.first_offset != first or result.record_count != span:
        return None
    wanted = set(offsets)
    parts: list[bytes] = []
    size = 0
    view = memoryview(result.records)
    pos = 0
    for index in range(span):
        length = int.from_bytes(view[pos:pos + 4], "big")
        end = pos + 4 + length
        if first + index in wanted:
            if parts and size + end - pos > max_bytes:
                break
            parts.append(bytes(view[pos:end]))
            size += end - pos
        pos = end
    return b"".join(parts), len(parts)


def _unknown(offset: int) -> None:
    return None


def _scan_tail(plog: PartitionLog, start: int, end: int) -> list[tuple[str, int, int, tuple[str, int] | None]]:
    """Blocking: every event record of ``plog`` in ``[start, end)`` as (key, version, offset, the
    (producer id, epoch) of a transactional one); control records are left out."""
    found: list[tuple[str, int, int, tuple[str, int] | None]] = []
    for fields, record in _EventWalk(plog, start, end):
        producer = None
        if fields.transactional:
            info = txn_info(record)
            if info is None or info.marker is not None:
                continue
            producer = (info.producer_id, info.producer_epoch)
        found.append((fields.key, fields.aggregate_version, fields.offset, producer))
    return found


@dataclass(slots=True)
class TxnEventGate:
    """One TXN_APPEND_STREAM record's version check and reservation on its partition leader."""

    store: EventStore
    replica: Replica
    events: PartitionEvents
    key: str
    version: int

    def check(self, producer: tuple[str, int]) -> None:
        """The version check (:meth:`PartitionEvents.check_version`). Raises ``version_conflict``."""
        self.events.check_version(self.key, self.version, producer, self.store._undecided(self.replica))

    def reserve(self, producer: tuple[str, int], offset: int) -> None:
        """The record was appended at ``offset``: later checks count it (staged by ``producer``)."""
        self.events.reserve(self.key, PendingAppend(self.version, offset, producer=producer))


class EventStore:
    """Every event-sourcing partition's index and snapshots on this broker (``broker.events``)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self._partitions: dict[tuple[str, int], PartitionEvents] = {}
        self._opening: dict[tuple[str, int], asyncio.Future[PartitionEvents]] = {}
        self._indexer: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the background indexer (every ``eventstore_index_interval_ms``; 0: on demand only)."""
        interval_ms = self.broker.config.eventstore_index_interval_ms
        if interval_ms > 0 and self._indexer is None:
            self._indexer = asyncio.get_running_loop().create_task(self._index_forever(interval_ms / 1000.0))

    async def _index_forever(self, interval_s: float) -> None:
        """Followers index replicated events once committed, leaders keep up between commands: one code
        path (:meth:`catch_up`) for every role. A failing partition is logged and retried next round."""
        while True:
            await asyncio.sleep(interval_s)
            for key, state in list(self._partitions.items()):  # a deleted topic's state goes with it
                if state.replica is not None and state.replica.deleted:
                    state.closed = True
                    del self._partitions[key]
            for (topic, _), replica in list(self.broker.replicas.items()):
                defn = self.broker.metadata.get(topic)
                if defn is None or not defn.event_sourcing or replica.deleted or replica.fenced is not None:
                    continue
                key = (topic, replica.partition)
                known = self._partitions.get(key)
                if known is None and replica.hwm == 0:
                    continue
                if known is not None and known.replica is replica and known.index.indexed_offset == replica.hwm:
                    continue
                try:
                    await self.partition(replica)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # never kill the indexer; commands report their own errors
                    log.warning("%s/%d: background indexing failed: %s", topic, replica.partition, exc)

    async def partition(self, replica: Replica) -> PartitionEvents:
        """The partition's state, opened (checkpoint and snapshots loaded off the loop) on first use, and
        caught up with the committed log."""
        events = await self._open(replica)
        await self.catch_up(replica, events)
        return events

    async def _open(self, replica: Replica) -> PartitionEvents:
        key = (replica.topic, replica.partition)
        events = self._partitions.get(key)
        if events is not None and not events.closed and events.replica is replica:
            return events
        opening = self._opening.get(key)
        if opening is not None:
            return await asyncio.shield(opening)
        fut: asyncio.Future[PartitionEvents] = asyncio.get_running_loop().create_future()
        self._opening[key] = fut
        try:
            directory = replica.log.directory
            index, snapshots = await self.broker.offload.run(1 << 30, functools.partial(_load, directory))
            events = PartitionEvents(replica.topic, replica.partition, directory, index, snapshots,
                                     checkpointed_events=index.event_count, replica=replica)
            self._partitions[key] = events
            fut.set_result(events)
            return events
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()
            raise
        finally:
            del self._opening[key]

    async def catch_up(self, replica: Replica, events: PartitionEvents) -> None:
        """Index the committed log up to the replica's HWM (see the module docstring).

        Raises:
            OSError, CorruptLogError: the log could not be read (the caller answers ``stream_index_failed``).
        """
        if events.index.indexed_offset == replica.hwm and not events.pending:
            return
        async with events.scan_lock:
            index = events.index
            hwm = replica.hwm
            if index.indexed_offset > hwm:  # a checkpoint ahead of the recovered committed log
                log.warning("%s/%d: stream index at %d is ahead of the committed HWM %d; cut back",
                            replica.topic, replica.partition, index.indexed_offset, hwm)
                index.truncate(hwm)
            if index.indexed_offset < replica.log_start_offset:
                index.advance(replica.log_start_offset)  # retention removed what was never scanned
            end, visible = self._stable_view(replica, index.indexed_offset, hwm)
            if index.indexed_offset < end:
                found, reached = await self.broker.offload.run(
                    1 << 30, functools.partial(_scan, replica.log, index.indexed_offset, end, visible))
                if events.closed:
                    return
                for key, entry in found:
                    if entry.offset >= index.indexed_offset:
                        index.apply(key, entry)
                index.advance(reached)
            if replica.leader_epoch != events.pending_epoch:
                events.pending.clear()
            events.prune_pending(self._aborted(replica))
            if index.event_count - events.checkpointed_events >= self.broker.config.eventstore_checkpoint_interval_events:
                await self._checkpoint(events)

    # ------------------------------------------------------------------ transactional appends

    def _stable_view(self, replica: Replica, start: int, hwm: int) -> tuple[int, Callable[[int], bool | None]]:
        """Where the index scan from ``start`` may go and which transactional records in it count: below the
        partition's LSO (:mod:`cursus.transactions.index`) every transaction is decided, so a transactional
        event there counts unless it is hidden (aborted). A partition without a transaction index here (a
        follower, or a leader before its rebuild) stops at its first transactional record; while the
        index is being rebuilt the scan does not move. Loop thread (the hidden ranges are a snapshot)."""
        txns = self.broker.transactions
        if txns.rebuilding((replica.topic, replica.partition)):
            return start, _unknown
        index = txns.read_index(replica.topic, replica.partition)
        if index is None:
            return hwm, _unknown
        end = index.lso(hwm)
        hidden = index.hidden_slice(start, end)
        starts = [s for s, _ in hidden]

        def visible(offset: int) -> bool:
            i = bisect.bisect_right(starts, offset)
            return not (i > 0 and hidden[i - 1][1] > offset)
        return end, visible

    def _aborted(self, replica: Replica) -> Callable[[int], bool]:
        """offset -> is that transactional record aborted (hidden by the partition's transaction index)."""
        index = self.broker.transactions.read_index(replica.topic, replica.partition)
        if index is None:
            return lambda offset: False
        return index.is_hidden

    def _undecided(self, replica: Replica) -> Callable[[PendingAppend], bool]:
        """staged append -> is its transaction still undecided on this partition (unknown counts as yes)."""
        index = self.broker.transactions.read_index(replica.topic, replica.partition)

        def undecided(p: PendingAppend) -> bool:
            if p.producer is None:
                return False
            if index is None:
                return True
            txn = index.unresolved(p.producer[0])
            return txn is not None and txn.producer_epoch == p.producer[1]
        return undecided

    async def ready_to_check(self, replica: Replica, events: PartitionEvents) -> None:
        """Return once a version check sees every event below the LEO, with no ``await`` after the last check
        (the caller checks and appends synchronously): the index covers the log below this leader epoch's
        first append, and the appends since are pending. A new leader first waits until its earlier epochs'
        records are committed (the HWM reaches them) and indexes them; what undecided transactions hold
        back from the index (above the LSO) it takes as pending appends (:meth:`_recover_pending`).

        Raises:
            BrokerError: ``NOT_LEADER``, ``leader_not_available`` (still preparing, or the earlier records not
                committed within ``replica_ack_timeout_ms``: nothing written, retry), ``storage_unavailable``.
        """
        broker = self.broker
        loop = asyncio.get_running_loop()
        deadline = loop.time() + broker.config.replica_ack_timeout_ms / 1000.0
        while True:
            await replica.wait_writable()
            replica.check_writable()
            if replica.leader_epoch == events.pending_epoch:
                target = events.epoch_base
                if events.index.indexed_offset >= target:
                    return
            else:
                target = replica.leo
                if events.index.indexed_offset >= target:
                    events.start_epoch(replica.leader_epoch, target)
                    return
                if replica.hwm >= target and await self._recover_pending(replica, events, target):
                    continue
            remaining = deadline - loop.time()
            try:
                if remaining <= 0:
                    raise TimeoutError
                if replica.hwm < target:
                    await asyncio.wait_for(asyncio.shield(replica.wait_hwm(target)), remaining)
            except TimeoutError:
                raise BrokerError.of("leader_not_available", topic=replica.topic, partition=replica.partition,
                                     reason="earlier records are not committed and indexed yet") from None
            await self.catch_up(replica, events)

    async def _recover_pending(self, replica: Replica, events: PartitionEvents, target: int) -> bool:
        """A new leader epoch (or a restart) whose index is caught up to the LSO but not to the LEO
        ``target`` (all committed): undecided transactions hold the rest back. Read the events in between
        and start the epoch with them as pending appends (staged ones with their transaction), so version
        checks count them. Returns whether the epoch started (False: not applicable or raced; the caller
        waits and retries)."""
        txns = self.broker.transactions
        tp = (replica.topic, replica.partition)
        if txns.rebuilding(tp) or txns.read_index(*tp) is None:
            return False
        async with events.scan_lock:
            start = events.index.indexed_offset
            end, _ = self._stable_view(replica, start, replica.hwm)
            if start < end or start >= target:
                return False  # the index can still move (catch_up), or already covers the LEO
            found = await self.broker.offload.run(
                1 << 30, functools.partial(_scan_tail, replica.log, start, target))
            if events.closed or replica.leader_epoch == events.pending_epoch or replica.leo != target \
                    or events.index.indexed_offset != start:
                return False
            aborted = self._aborted(replica)
            events.start_epoch(replica.leader_epoch, start)
            for key, version, offset, producer in found:
                if producer is None or not aborted(offset):
                    events.reserve(key, PendingAppend(version, offset, producer=producer))
            return True

    async def txn_gate(self, replica: Replica, record: bytes) -> TxnEventGate | None:
        """The partition-leader side of TXN_APPEND_STREAM, before its record is appended: None for a record
        that is not an event (TXN_PUBLISH) or a topic that is not event-sourcing; else the gate whose
        :meth:`TxnEventGate.check` (then the append, then :meth:`TxnEventGate.reserve`) must run with no
        ``await`` in between.

        Raises:
            BrokerError: the errors of :meth:`ready_to_check`; ``stream_index_failed`` / ``topic_not_found``.
        """
        defn = self.broker.metadata.get(replica.topic)
        if defn is None or not defn.event_sourcing:
            return None
        fields = peek_event(record, 0, len(record))
        if fields is None:
            return None
        try:
            events = await self.partition(replica)
        except (OSError, CorruptLogError) as exc:
            if replica.deleted:
                raise replica.removed_error() from None
            log.error("stream index of %s/%d failed: %s", replica.topic, replica.partition, exc)
            raise BrokerError.of("stream_index_failed", topic=replica.topic, partition=replica.partition,
                                 reason=type(exc).__name__) from None
        await self.ready_to_check(replica, events)
        return TxnEventGate(self, replica, events, fields.key, fields.aggregate_version)

    async def _checkpoint(self, events: PartitionEvents) -> None:
        """Write the index checkpoint (call with ``scan_lock`` held: nothing mutates the index meanwhile, so
        it is encoded off the loop)."""
        index, path = events.index, events.directory / INDEX_FILE
        try:
            await self.broker.offload.run(1 << 30, lambda: atomic_write(path, index.encode()))
            events.checkpointed_events = events.index.event_count
        except OSError as exc:  # a shortcut only: the next restart rescans more of the log
            log.warning("%s/%d: stream index checkpoint not written: %s", events.topic, events.partition, exc)

    async def save_snapshot(self, events: PartitionEvents, snapshot: Snapshot) -> None:
        """Append ``snapshot`` durably (fsynced) and make it the key's latest. Raises OSError."""
        data = encode_snapshot_record(snapshot)
        async with events.snapshot_lock:
            await self.broker.offload.run(1 << 30, functools.partial(_append_snapshot, events.directory, data))
            events.snapshots.put(snapshot)

    async def replicate_snapshot(self, replica: Replica, snapshot: Snapshot) -> None:
        """Cluster: store ``snapshot`` on every other member of the replica's ISR (``ReplicateSnapshot``
        on their internal listeners, concurrently, within ``replica_ack_timeout_ms``). Standalone: nothing.

        Raises:
            BrokerError: ``snapshot_replicate_failed reason= broker=`` when a member refused, failed or did
                not answer in time (the snapshot is stored here; on that member the outcome is unknown).
        """
        node = self.broker.replication
        if node is None:
            return
        request = pb.SnapshotRequest(leader_id=self.broker.broker_id, topic=replica.topic,
                                     partition=replica.partition, leader_epoch=replica.leader_epoch,
                                     key=snapshot.key, version=snapshot.version, payload=snapshot.payload)
        timeout_s = self.broker.config.replica_ack_timeout_ms / 1000.0
        members = [m for m in replica.isr if m != self.broker.broker_id]

        async def one(member: str) -> str | None:
            info = self.broker.metadata.state.brokers.get(member)
            if info is None or not info.internal_address:
                return f"{member}: no internal address"
            try:
                response = await node.client.replicate_snapshot(info.internal_address, request, timeout_s)
            except InternalRpcError as exc:
                return f"{member}: {exc.code.name}"
            return f"{member}: {response.error.code}" if response.error.code else None

        failures = [f for f in await asyncio.gather(*(one(m) for m in members)) if f is not None]
        if failures:
            log.warning("%s/%d: snapshot of %s not replicated: %s", replica.topic, replica.partition, snapshot.key,
                        "; ".join(failures))
            raise BrokerError.of("snapshot_replicate_failed", topic=replica.topic, partition=replica.partition,
                                 reason="; ".join(failures)[:300], outcome="unknown")

    async def on_replicated_snapshot(self, request: pb.SnapshotRequest) -> pb.SnapshotResponse:
        """The follower side of ``ReplicateSnapshot``: store it durably in the local partition's snapshots
        (refused for an unknown partition or an older leader epoch than this replica knows)."""
        replica = self.broker.replicas.get((request.topic, request.partition))
        if replica is None or replica.deleted:
            return pb.SnapshotResponse(error=pb.Error(code="partition_not_found", message="no local replica"))
        if request.leader_epoch < replica.leader_epoch:
            return pb.SnapshotResponse(error=pb.Error(
                code="STALE_LEADER_EPOCH", message=f"leader epoch {request.leader_epoch} < {replica.leader_epoch}"))
        try:
            events = await self._open(replica)
            await self.save_snapshot(events, Snapshot(request.key, request.version, request.payload))
        except OSError as exc:
            log.error("%s/%d: replicated snapshot not stored: %s", request.topic, request.partition, exc)
            return pb.SnapshotResponse(error=pb.Error(code="snapshot_store_failed", message=type(exc).__name__))
        return pb.SnapshotResponse()

    def visible_snapshot(self, events: PartitionEvents, key: str) -> Snapshot | None:
        """The key's latest snapshot, unless it claims a version above the committed stream."""
        snap = events.snapshots.get(key)
        if snap is None or snap.version > events.index.version(key):
            return None
        return snap

    async def close(self) -> None:
        """Stop the background indexer and write every index checkpoint (shutdown)."""
        if self._indexer is not None:
            self._indexer.cancel()
            await asyncio.gather(self._indexer, return_exceptions=True)
            self._indexer = None
        for events in list(self._partitions.values()):
            if not events.closed and events.index.event_count != events.checkpointed_events:
                async with events.scan_lock:
                    await self._checkpoint(events)

    def drop_topic(self, topic: str, *, remove_files: bool = False) -> None:
        """Close (and with ``remove_files`` delete) the indexes and snapshots of ``topic``: call it when the
        topic is deleted or truncated, before its storage is removed or reset, so a recreated name starts
        empty. Files inside a removed partition directory go with it; ``remove_files`` is for a truncate,
        which keeps the directory."""
        for key in [k for k in self._partitions if k[0] == topic]:
            events = self._partitions.pop(key)
            events.closed = True
            if remove_files:
                for name in (INDEX_FILE, SNAPSHOT_FILE):
                    with contextlib.suppress(FileNotFoundError):
                        (events.directory / name).unlink()
