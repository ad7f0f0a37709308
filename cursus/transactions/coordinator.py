"""The standalone transaction coordinator: runs the pure state machine against the journal and the
broker's replicas (asyncio; the journal's blocking I/O runs on a worker thread).

Commit order (spec "Transaction Coordinator", END_TXN result=commit):

1. validate the session and the staged offsets' group fence (member, generation, ownership, monotonic)
   while the transaction is open;
2. the staged offsets travel in the coordinator's own durable record (they were journaled by
   SEND_OFFSETS_TO_TXN), not as ``transactional_offset_snapshot`` records in ``__consumer_offsets``;
3. journal ``prepare_commit`` (fsynced): from here the commit is decided and abort is refused;
4. revalidate the group fence; if it no longer holds the coordinator aborts the transaction itself and
   answers the fencing error (a prepared commit whose offsets can never be stored must not block the id);
5. append commit markers to every output partition and wait until they are committed (HWM);
6. journal ``committed`` (fsynced) and resolve the partitions' indexes: output becomes visible;
7. materialize the staged offsets as ordinary offset commits (monotonic, no membership check).

Abort and timeout: journal ``prepare_abort``, append abort markers, journal ``aborted``. Recovery (before
``/ready``): replay the journal, rebuild the index of every partition that ever held transactional records,
finish every prepared transaction (a marker already in a log is not written again), abort markers for
records no live transaction owns, and re-materialize the offsets of committed transactions.

Every command for one transactional id runs under that id's lock, so transitions of one id are serial.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from cursus.transactions import state as st
from cursus.transactions.index import PartitionTxnIndex
from cursus.transactions.journal import JournalState, TxnJournal
from cursus.transactions.markers import data_record, marker_record, txn_info
from cursus.transactions.state import TopicPartition, TxnEntry
from cursus.wire import iter_record_slices, record_offset_field_position, stamp_offsets
from cursus.wire.errors import BrokerError

if TYPE_CHECKING:
    from cursus.broker.core import Broker
    from cursus.broker.replica import Replica

log = logging.getLogger("cursus.transactions")
STANDALONE_COORDINATOR_EPOCH = 0
#: Test-only crash points (``CURSUS_TXN_CRASH_AT=<point>``): the process exits at once, like kill -9.
CRASH_POINTS = ("after_prepare_commit", "after_first_marker", "after_markers", "after_commit_decision",
                "after_prepare_abort")
_CRASH_AT = os.environ.get("CURSUS_TXN_CRASH_AT", "")
_U32_LEN = 4


def _crash_point(name: str) -> None:
    if _CRASH_AT == name:
        log.error("CURSUS_TXN_CRASH_AT=%s: exiting now", name)
        os._exit(137)


class TransactionCoordinator:
    """INIT_PRODUCER_ID .. END_TXN for one standalone broker. Create, then :meth:`open` before ready."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.journal: TxnJournal | None = None
        self.entries: dict[str, TxnEntry] = {}
        self.indexes: dict[TopicPartition, PartitionTxnIndex] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._journal_lock = asyncio.Lock()
        self._pending_writes: list[tuple[list[dict[str, Any]], asyncio.Future[None]]] = []
        self._flusher: asyncio.Future[None] | None = None
        #: (transactional id, epoch) -> {(topic, seqNum): (partition, offset)}: TXN_PUBLISH retries
        self._published: dict[str, dict[tuple[str, int], tuple[int, int]]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._resolved_events: dict[TopicPartition, asyncio.Event] = {}
        self._closed = False
        self.ready = False
        self.expired_total = 0
        self.coordinator_epoch = STANDALONE_COORDINATOR_EPOCH

    # ------------------------------------------------------------------------------------ lifecycle

    @property
    def _timeout_ms(self) -> int:
        return int(self.broker.config.transaction_timeout_ms)

    @property
    def _expiration_ms(self) -> int:
        return int(self.broker.config.transactional_id_expiration_ms)

    def _now(self) -> int:
        return int(self.broker.clock.wall_ms())

    async def open(self) -> None:
        """Replay the journal, rebuild indexes, finish prepared work. Raises JournalCorruptError / OSError
        (startup must stop)."""
        broker = self.broker
        started = time.monotonic()
        self.journal = await broker.run_blocking(lambda: TxnJournal.open(
            broker.log_dir.path, compact_min_superseded=broker.config.transaction_journal_compact_records))
        jstate: JournalState = self.journal.state
        if jstate.truncated_bytes:
            log.warning("transaction journal: truncated a torn tail of %d bytes", jstate.truncated_bytes)
        self.entries = dict(jstate.entries)
        for tp in sorted(jstate.touched):
            await self._rebuild_index(tp)
        await self._recover()
        self.ready = True
        self._arm_timer()
        log.info("transactions recovered: %d ids, %d partitions indexed in %.0f ms", len(self.entries),
                 len(self.indexes), (time.monotonic() - started) * 1000)

    async def _rebuild_index(self, tp: TopicPartition) -> None:
        replica = self.broker.replicas.get(tp)
        if replica is None:
            return
        index = self.indexes[tp] = self._new_index(tp)
        plog = replica.log

        def scan() -> None:
            offset = plog.log_start_offset
            end = plog.log_end_offset
            while offset < end:
                result = plog.read(offset, max_offset=end, max_records=4096, max_bytes=8 * 1024 * 1024)
                if result.record_count == 0:
                    break
                for body in iter_record_slices(result.records, result.record_count):
                    info = txn_info(body)
                    if info is None:
                        continue
                    if info.marker is None:
                        index.on_data(info.producer_id, info.offset, transactional_id=info.transactional_id,
                                      producer_epoch=info.producer_epoch)
                        seen.append((info.transactional_id, info.producer_epoch, info.seq_num, info.offset))
                    else:
                        index.on_marker(info.producer_id, info.offset, commit=info.marker == "commit", final=True)
                offset = result.next_offset

        seen: list[tuple[str, int, int, int]] = []
        await self.broker.run_blocking(scan)
        # TXN_PUBLISH retries after the restart: the open transactions' (topic, seqNum) from the log
        for tid, epoch, seq, offset in seen:
            entry = self.entries.get(tid)
            txn = index.unresolved(entry.producer_id) if entry is not None else None
            if entry is not None and entry.state == st.OPEN and entry.epoch == epoch and txn is not None \
                    and offset >= txn.first_offset:
                self._published.setdefault(tid, {})[(tp[0], seq)] = (tp[1], offset + 1)

    async def _recover(self) -> None:
        for tid, entry in sorted(self.entries.items()):
            if entry.state == st.PREPARE_COMMIT:
                log.info("transactions: resuming the prepared commit of %s epoch %d", tid, entry.epoch)
                await self._finish(entry)
            elif entry.state == st.PREPARE_ABORT:
                await self._finish(entry)
        # records no live transaction owns (a crash between append and journal, a fenced epoch): abort them
        for tp, index in self.indexes.items():
            for pid, txn in list(index.open.items()):
                owner = self.entries.get(txn.transactional_id)
                live = (owner is not None and owner.producer_id == pid and owner.epoch == txn.producer_epoch
                        and owner.state == st.OPEN and tp in owner.partitions)
                if not live:
                    log.info("transactions: aborting unowned records of %s on %s/%d", txn.transactional_id, *tp)
                    await self._write_markers([tp], txn.transactional_id, pid, txn.producer_epoch, commit=False)
                    index.finalize(pid)
        for entry in self.entries.values():
            if entry.state == st.COMMITTED and entry.offsets:
                await self._materialize(entry)

    async def close(self) -> None:
        """Stop the timeout timer and close the journal (waits for a journal write in flight)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        async with self._journal_lock:
            if self.journal is not None:
                journal, self.journal = self.journal, None
                await self.broker.run_blocking(journal.close)

    def check_ready(self) -> None:
        """Raises ``transaction_manager_not_available`` (retryable) before recovery finished / after close."""
        if not self.ready or self._closed or self.journal is None:
            raise BrokerError.of("transaction_manager_not_available", reason="transaction recovery in progress")

    def _lock(self, tid: str) -> asyncio.Lock:
        lock = self._locks.get(tid)
        if lock is None:
            lock = self._locks[tid] = asyncio.Lock()
        return lock

    # ---------------------------------------------------------------------------------- journal glue

    async def _persist(self, entry: TxnEntry, *, touched: list[TopicPartition] | None = None,
                       next_producer_id: int | None = None) -> None:
        """Journal ``entry`` (fsynced) then publish it. Transitions of different ids submitted meanwhile share
        one write and one fsync (group commit). Raises ``transaction_sync_failed`` (retryable; nothing of
        that write is published) or ``transaction_manager_not_available`` (closed)."""
        journal = self.journal
        if journal is None:
            raise BrokerError.of("transaction_manager_not_available", reason="coordinator closed")
        if next_producer_id is not None:
            journal.state.next_producer_id = max(journal.state.next_producer_id, next_producer_id)
        records: list[dict[str, Any]] = []
        new = [tp for tp in (touched or []) if tp not in journal.state.touched]
        if new:
            records.append({"kind": "touched", "partitions": [list(tp) for tp in new]})
        records.append({"kind": "entry", "entry": entry.to_json()})
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending_writes.append((records, done))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush())
        try:
            await done
        except OSError as exc:
            log.error("transaction journal write failed: %s", exc)
            raise BrokerError.of("transaction_sync_failed", transactional_id=entry.transactional_id,
                                 reason=str(exc)) from None
        self.entries[entry.transactional_id] = entry

    async def _flush(self) -> None:
        """Write everything queued, one append (one fsync) per round, until the queue is empty."""
        async with self._journal_lock:
            while self._pending_writes:
                batch, self._pending_writes = self._pending_writes, []
                journal = self.journal
                records = [r for recs, _ in batch for r in recs]
                error: BaseException | None = None
                if journal is None:
                    error = BrokerError.of("transaction_manager_not_available", reason="coordinator closed")
                else:
                    try:
                        await self.broker.run_blocking(functools.partial(journal.append, records))
                    except Exception as exc:
                        error = exc
                for _, done in batch:
                    if done.done():
                        continue
                    if error is None:
                        done.set_result(None)
                    else:
                        done.set_exception(error)

    # ------------------------------------------------------------------------------------- commands

    async def init_producer(self, tid: str) -> TxnEntry:
        """INIT_PRODUCER_ID: a new (producerId, epoch 1) or the same producerId with epoch + 1; aborts an open
        transaction of the id first. Raises the errors of :func:`state.init_producer`."""
        self.check_ready()
        async with self._lock(tid):
            entry = self.entries.get(tid)
            if entry is not None and st.needs_abort_before_init(entry):
                entry = st.abort_for_reinit(entry, self._now())
                await self._persist(entry)
                entry = await self._finish(entry)
            assert self.journal is not None
            next_pid = self.journal.state.next_producer_id
            new = st.init_producer(entry, tid, new_producer_id=str(next_pid), now_ms=self._now())
            await self._persist(new, next_producer_id=next_pid + 1 if entry is None else None)
            self._published.pop(tid, None)
            return new

    async def begin(self, tid: str, producer_id: str, epoch: int) -> TxnEntry:
        """BEGIN_TXN. Raises the errors of :func:`state.begin`."""
        self.check_ready()
        async with self._lock(tid):
            entry = self.entries.get(tid)
            new = st.begin(entry, tid, producer_id, epoch, now_ms=self._now(), timeout_ms=self._timeout_ms)
            if new is not entry:
                await self._persist(new)
                self._published[tid] = {}
                self._arm_timer()
            return new

    async def publish(self, tid: str, producer_id: str, epoch: int, replica: Replica, *, seq_num: int,
                      key: str | None, payload: bytes) -> tuple[TxnEntry, int, int]:
        """TXN_PUBLISH: register the partition (journaled once per partition), append one record with
        ``transaction_state=open``; returns (entry, partition, end offset to wait for). A retry of the same
        (topic, seqNum) in this epoch returns the first append's partition and end offset without appending.

        Raises the errors of :func:`state.check_publish`; ``message_too_large``; the replica's write errors.
        """
        self.check_ready()
        tp = (replica.topic, replica.partition)
        async with self._lock(tid):
            entry = st.check_publish(self.entries.get(tid), tid, producer_id, epoch)
            seen = self._published.setdefault(tid, {})
            dup = seen.get((replica.topic, seq_num))
            if dup is not None:
                return entry, dup[0], dup[1]
            if tp not in entry.partitions:
                await self._persist(st.add_partition(entry, tp), touched=[tp])
            entry = st.check_publish(self.entries.get(tid), tid, producer_id, epoch)
            record = data_record(replica.topic, replica.partition, transactional_id=tid, producer_id=producer_id,
                                 producer_epoch=epoch, seq_num=seq_num, key=key, payload=payload,
                                 timestamp_ms=self._now())
            if len(record) > self.broker.config.max_message_bytes:
                raise BrokerError.of("message_too_large", size=len(record),
                                     limit=self.broker.config.max_message_bytes)
            offset = self._append(replica, record)
            self.index_for(tp).on_data(producer_id, offset, transactional_id=tid, producer_epoch=epoch)
            entry = st.count_messages(entry, 1)
            self.entries[tid] = entry  # message count is bookkeeping; journaled with the next transition
            seen[(replica.topic, seq_num)] = (replica.partition, offset + 1)
            return entry, replica.partition, offset + 1

    async def stage_offsets(self, tid: str, producer_id: str, epoch: int, *, group: str, member: str,
                            generation: int, topic: str, offsets: dict[int, int]) -> TxnEntry:
        """SEND_OFFSETS_TO_TXN: validate the group fence now, stage (journaled). Raises the errors of
        :func:`state.stage_offsets` and of :meth:`GroupCoordinator.validate_commit`."""
        self.check_ready()
        async with self._lock(tid):
            entry = self.entries.get(tid)
            new = st.stage_offsets(entry, tid, producer_id, epoch, group=group, member=member,
                                   generation=generation, topic=topic, offsets=offsets, now_ms=self._now())
            await self.broker.coordinator.validate_commit(group, topic, member, generation, offsets)
            await self._persist(new)
            return new

    async def end(self, tid: str, producer_id: str, epoch: int, result: str) -> TxnEntry:
        """END_TXN result=commit|abort, in the commit order of the module docstring; a retry resumes or
        answers the final state. Raises the errors of :func:`state.end`, the group fence errors (the
        transaction is then aborted), ``transaction_commit_failed`` / ``transaction_abort_marker_failed``
        (retryable: the prepared decision stays and a retry finishes it)."""
        self.check_ready()
        async with self._lock(tid):
            entry = self.entries.get(tid)
            new = st.end(entry, tid, producer_id, epoch, result, now_ms=self._now())
            if new.state in st.TERMINAL:
                return new
            if new is not entry:  # open -> prepared (a retry of a prepared one goes straight to its finish)
                assert entry is not None
                if new.state == st.PREPARE_COMMIT:
                    await self._check_offsets_fence(entry)  # step 1
                await self._persist(new)  # step 3 (or prepare_abort)
                _crash_point("after_prepare_commit" if new.state == st.PREPARE_COMMIT else "after_prepare_abort")
                if new.state == st.PREPARE_COMMIT:
                    await self._revalidate(new)  # step 4
            return await self._finish(new)

    async def _revalidate(self, entry: TxnEntry) -> None:
        """Step 4: the group fence still holds after prepare_commit, else the coordinator aborts the
        transaction itself (its offsets could never be stored) and raises the fencing error. Availability
        errors propagate with the commit still prepared (a retry finishes it without revalidating)."""
        try:
            await self._check_offsets_fence(entry)
        except BrokerError as exc:
            if exc.error.code in ("transaction_manager_not_available", "coordinator_not_available",
                                  "offset_manager_not_available", "storage_unavailable"):
                raise
            log.warning("transactions: %s lost its group fence after prepare_commit (%s): aborting",
                        entry.transactional_id, exc.error.code)
            aborted = st.abandon_prepared_commit(entry, self._now())
            await self._persist(aborted)
            await self._finish(aborted)
            raise

    async def _check_offsets_fence(self, entry: TxnEntry) -> None:
        if entry.group is None or entry.member is None or entry.generation is None:
            return
        for topic, offsets in entry.staged_offsets_by_topic().items():
            await self.broker.coordinator.validate_commit(entry.group, topic, entry.member, entry.generation, offsets)

    async def _finish(self, entry: TxnEntry) -> TxnEntry:
        """Steps 5-7 for a prepared entry (markers, final decision, offsets); idempotent."""
        commit = entry.state == st.PREPARE_COMMIT
        pending = [tp for tp in st.marker_partitions(entry)
                   if self.index_for(tp).needs_marker(entry.producer_id)]
        try:
            await self._write_markers(pending, entry.transactional_id, entry.producer_id, entry.epoch,
                                      commit=commit)
        except BrokerError as exc:
            code = "transaction_commit_failed" if commit else "transaction_abort_marker_failed"
            raise BrokerError.of(code, transactional_id=entry.transactional_id, epoch=entry.epoch,
                                 reason=exc.error.code, outcome="unknown") from None
        _crash_point("after_markers")
        final = st.complete(entry, self._now())
        await self._persist(final)
        for tp in st.marker_partitions(entry):
            self.index_for(tp).finalize(entry.producer_id)
        if commit:
            _crash_point("after_commit_decision")
            await self._materialize(final)
        self._published.pop(entry.transactional_id, None)
        self._arm_timer()  # its tombstone is due after transactional_id_expiration_ms
        return final

    async def _write_markers(self, partitions: list[TopicPartition], tid: str, producer_id: str, epoch: int, *,
                             commit: bool) -> None:
        from cursus.broker.handlers.produce import wait_ack  # the shared acks=all wait

        appended: list[tuple[Replica, int]] = []
        for tp in partitions:
            replica = self.broker.replica(*tp)
            record = marker_record(tp[0], tp[1], transactional_id=tid, producer_id=producer_id,
                                   producer_epoch=epoch, commit=commit, coordinator_epoch=self.coordinator_epoch,
                                   timestamp_ms=self._now())
            offset = self._append(replica, record)
            self.index_for(tp).on_marker(producer_id, offset, commit=commit, final=False)
            appended.append((replica, offset + 1))
            if _CRASH_AT == "after_first_marker" and len(partitions) > 1:
                await wait_ack(self.broker, replica, "all", offset + 1, replica.isr)
                _crash_point("after_first_marker")
        for replica, end in appended:
            await wait_ack(self.broker, replica, "all", end, replica.isr)

    async def _materialize(self, entry: TxnEntry) -> None:
        if entry.group is None:
            return
        for topic, offsets in entry.staged_offsets_by_topic().items():
            try:
                await self.broker.coordinator.materialize(entry.group, topic, offsets)
            except BrokerError as exc:
                raise BrokerError.of("transaction_offset_materialization_failed",
                                     transactional_id=entry.transactional_id, reason=exc.error.code) from None

    def status(self, tid: str) -> TxnEntry:
        """TXN_STATUS. Raises ``transaction_not_found``."""
        self.check_ready()
        entry = self.entries.get(tid)
        if entry is None:
            raise BrokerError.of("transaction_not_found", transactional_id=tid)
        return entry

    # ------------------------------------------------------------------------------- partitions

    def index_for(self, tp: TopicPartition) -> PartitionTxnIndex:
        """The index of ``tp``, created empty (the partition takes transactional records from now on)."""
        index = self.indexes.get(tp)
        if index is None:
            index = self.indexes[tp] = self._new_index(tp)
        return index

    def _new_index(self, tp: TopicPartition) -> PartitionTxnIndex:
        index = PartitionTxnIndex()
        index.on_resolved = lambda: self._wake(tp)
        return index

    def _wake(self, tp: TopicPartition) -> None:
        event = self._resolved_events.pop(tp, None)
        if event is not None:
            event.set()

    def readable_end(self, replica: Replica, isolation: str) -> int:
        """Where a read of ``replica`` stops: the LSO for read_committed on a transactional partition, else
        the HWM."""
        if isolation != "read_committed":
            return replica.hwm
        index = self.indexes.get((replica.topic, replica.partition))
        return replica.hwm if index is None else index.lso(replica.hwm)

    async def wait_readable(self, replica: Replica, offset: int, timeout_s: float, isolation: str) -> None:
        """Wait until :meth:`readable_end` passes ``offset`` or ``timeout_s`` passes: on the HWM
        (:meth:`Replica.wait_for_data`) or, while an unresolved transaction pins the LSO, on its resolution."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.readable_end(replica, isolation) <= offset and not replica.deleted and replica.fenced is None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            if replica.hwm <= offset:
                await replica.wait_for_data(offset, remaining)
                continue
            tp = (replica.topic, replica.partition)
            event = self._resolved_events.get(tp)
            if event is None:
                event = self._resolved_events[tp] = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), remaining)

    def read_index(self, topic: str, partition: int) -> PartitionTxnIndex | None:
        """The index of a partition that holds transactional records, None for a plain one (fast path)."""
        return self.indexes.get((topic, partition))

    @staticmethod
    def _append(replica: Replica, record: bytes) -> int:
        """Append one encoded record at the replica's LEO (offset stamped); returns its offset."""
        buf = bytearray(len(record).to_bytes(4, "big") + record)
        topic_len = len(replica.topic.encode("utf-8"))
        offset = replica.leo
        stamp_offsets(buf, [_U32_LEN + record_offset_field_position(topic_len)], offset)
        replica.append(buf, 1)
        return offset

    async def on_topic_deleted(self, topic: str) -> None:
        """Forget the indexes of a deleted topic and remove its operations from terminal transactions (spec
        DELETE), so a recreated topic of the same name inherits nothing. Raises ``transaction_sync_failed``."""
        for tp in [tp for tp in self.indexes if tp[0] == topic]:
            del self.indexes[tp]
        for tid, entry in sorted(self.entries.items()):
            if entry.state in st.TERMINAL and (any(t == topic for t, _ in entry.partitions)
                                               or any(t == topic for t, _, _ in entry.offsets)):
                async with self._lock(tid):
                    current = self.entries.get(tid)
                    if current is not None and current.state in st.TERMINAL:
                        await self._persist(st.forget_topic(current, topic))

    def check_topic_deletable(self, topic: str) -> None:
        """Raises ``topic_delete_blocked`` while an open or committing transaction references ``topic``."""
        for entry in self.entries.values():
            if entry.state in (st.OPEN, *st.PREPARED) and any(t == topic for t, _ in entry.partitions):
                raise BrokerError.of("topic_delete_blocked", topic=topic, transactional_id=entry.transactional_id,
                                     reason="an open or committing transaction references the topic")

    # ---------------------------------------------------------------------------------- timeouts

    def _arm_timer(self) -> None:
        if self._closed:
            return
        deadline = st.oldest_open(self.entries.values())
        tombstone_at = st.next_tombstone_ms(self.entries.values(), self._expiration_ms)
        if tombstone_at is not None:
            deadline = tombstone_at if deadline is None else min(deadline, tombstone_at)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if deadline is None:
            return
        delay = max(0.0, (deadline - self._now()) / 1000.0)
        self._timer = self.broker.loop.call_later(delay + 0.001, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        task = asyncio.ensure_future(self._expire())
        task.add_done_callback(_log_failure)

    async def _expire(self) -> None:
        now = self._now()
        for tid, entry in list(self.entries.items()):
            if st.expire(entry, now) is None:
                continue
            async with self._lock(tid):
                current = self.entries.get(tid)
                expired = st.expire(current, self._now()) if current is not None else None
                if expired is None:
                    continue
                log.info("transactions: %s epoch %d timed out: aborting", tid, expired.epoch)
                await self._persist(expired)
                await self._finish(expired)
                self.expired_total += 1
        for tid, entry in list(self.entries.items()):
            if st.tombstone(entry, now, self._expiration_ms) is None:
                continue
            async with self._lock(tid):
                current = self.entries.get(tid)
                compact = st.tombstone(current, self._now(), self._expiration_ms) if current is not None else None
                if compact is not None:
                    await self._persist(compact)
        self._arm_timer()

    # ----------------------------------------------------------------------------------- metrics

    def metrics_snapshot(self) -> dict[str, Any]:
        """The values of :class:`cursus.broker.metrics.TransactionCollector` (loop thread)."""
        lag = {}
        for tp, index in self.indexes.items():
            replica = self.broker.replicas.get(tp)
            if replica is not None:
                lag[tp] = replica.hwm - index.lso(replica.hwm)
        return {"ready": self.ready, "states": self.counts(), "expired": self.expired_total,
                "oldest_active_seconds": self.oldest_active_seconds(), "lso_lag": lag}

    def counts(self) -> dict[str, int]:
        """Transactions per state (``cursus_transactions{state}``)."""
        out = {s: 0 for s in st.STATES}
        for entry in self.entries.values():
            out[entry.state] += 1
        return out

    def oldest_active_seconds(self) -> float:
        """Age of the oldest open transaction in seconds (0 when none)."""
        now = self._now()
        ages = [now - (e.deadline_ms - self._timeout_ms) for e in self.entries.values() if e.state == st.OPEN]
        return max(0.0, max(ages) / 1000.0) if ages else 0.0


def _log_failure(task: asyncio.Future[None]) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        exc = task.exception()
        if exc is not None:
            log.error("transaction timeout handling failed: %s", exc)

