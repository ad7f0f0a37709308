"""The transaction coordinator: runs the pure state machine against its store and the partitions' leaders
(asyncio). One code path for both modes; only the seams differ:

* persistence (:mod:`cursus.transactions.store`): standalone the fsynced journal, in a cluster one
  ``TxnSync`` metadata command per transition (committed through Raft and applied before the reply);
* participants: a transactional record (data or marker) for a partition this broker leads is appended
  here; for a partition another broker leads it travels over the internal listener
  (``Replication.AppendTxnRecord``), and that leader appends it through its normal replicated path. Either
  way the call returns once the record is committed (below the HWM; acks=all). The leader refuses a record
  whose coordinator is not the shard's owner at the shard's epoch (``NOT_COORDINATOR``), so a previous
  shard owner can neither write markers nor persist (the FSM fences its ``TxnSync`` the same way).

In a cluster each broker holds the entries of the shards it owns (loaded from the applied metadata when
it gains a shard: prepared transactions are finished, open ones expire by their deadline), and every
broker keeps the transaction index of the transactional partitions it leads (rebuilt from the log when it
becomes leader). A partition's index resolves a marked transaction when the final decision is applied:
standalone right after the journal write, in a cluster when the ``TxnSync`` carrying it is applied here.

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
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cursus.metadata.state import transaction_shard
from cursus.transactions import state as st
from cursus.transactions.index import PartitionTxnIndex
from cursus.transactions.markers import EventSpec, data_record, marker_record, txn_info
from cursus.transactions.state import TopicPartition, TxnEntry
from cursus.transactions.store import JournalStore, RaftTxnStore, TxnStore
from cursus.wire import iter_record_slices, record_offset_field_position, stamp_offsets
from cursus.wire.errors import BrokerError

if TYPE_CHECKING:
    from cursus.broker.core import Broker
    from cursus.broker.replica import Replica
    from cursus.internal.v1 import replication_pb2 as pb
    from cursus.metadata.commands import Command
    from cursus.metadata.state import MetadataState

log = logging.getLogger("cursus.transactions")
STANDALONE_COORDINATOR_EPOCH = 0
#: Test-only crash points (``CURSUS_TXN_CRASH_AT=<point>[@<id prefix>],...``: only for transactional ids
#: starting with the prefix when one is given): the process exits at once, like kill -9.
#: ``leader_after_marker`` is on the partition leader's side: its marker is committed, its answer to the
#: coordinator never sent.
CRASH_POINTS = ("after_prepare_commit", "after_first_marker", "after_markers", "after_commit_decision",
                "after_prepare_abort", "leader_after_marker")
_CRASH_AT = {point: prefix for point, _, prefix in (item.partition("@") for item in
                                                     os.environ.get("CURSUS_TXN_CRASH_AT", "").split(",") if item)}
_U32_LEN = 4
#: Test-only (``CURSUS_TXN_INDEX_SCAN_DELAY_MS=<ms>@<topic prefix>``): an index rebuild of a partition of such a
#: topic sleeps that long after each marker it scans, widening the window in which the index is not back
#: yet (regression tests pin what read_committed sees meanwhile). Unset in production.
_SCAN_DELAY_MS, _, _SCAN_DELAY_PREFIX = os.environ.get("CURSUS_TXN_INDEX_SCAN_DELAY_MS", "").partition("@")


def _crash_point(name: str, tid: str = "") -> None:
    prefix = _CRASH_AT.get(name)
    if prefix is not None and tid.startswith(prefix):
        log.error("CURSUS_TXN_CRASH_AT=%s: exiting now", name)
        os._exit(137)


class TransactionCoordinator:
    """INIT_PRODUCER_ID .. END_TXN for one broker (standalone or cluster). Create, then :meth:`open`."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.store: TxnStore | None = None
        self.entries: dict[str, TxnEntry] = {}
        self.indexes: dict[TopicPartition, PartitionTxnIndex] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        #: cluster: shard -> the shard epoch this broker took it at (its entries are in :attr:`entries`)
        self._owned: dict[int, int] = {}
        #: cluster: partitions whose index is being rebuilt from the log (read_committed waits)
        #: (the token of the rebuild running: a rebuild finishing late, for an older epoch, changes nothing)
        self._rebuilding: dict[TopicPartition, object] = {}
        #: cluster: partitions led here whose index is complete (rebuilt after this broker became leader):
        #: only these take transactional records
        self._txn_ready: set[TopicPartition] = set()
        self._tasks: set[asyncio.Future[Any]] = set()
        #: (transactional id, epoch) -> {(topic, seqNum): (partition, offset)}: TXN_PUBLISH retries
        self._published: dict[str, dict[tuple[str, int], tuple[int, int]]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._resolved_events: dict[TopicPartition, asyncio.Event] = {}
        self._closed = False
        self.ready = False
        self.expired_total = 0
        self.coordinator_epoch = STANDALONE_COORDINATOR_EPOCH
        #: wall ms before which the timeout timer does not fire again (set when a timeout abort failed)
        self._expire_retry_ms = 0

    # ------------------------------------------------------------------------------------ lifecycle

    @property
    def _timeout_ms(self) -> int:
        return int(self.broker.config.transaction_timeout_ms)

    @property
    def _expiration_ms(self) -> int:
        return int(self.broker.config.transactional_id_expiration_ms)

    def _now(self) -> int:
        return int(self.broker.clock.wall_ms())

    @property
    def cluster(self) -> bool:
        return bool(self.broker.config.enabled_distribution)

    async def open(self) -> None:
        """Standalone: replay the journal, rebuild indexes, finish prepared work (before ``/ready``).
        Cluster: install the Raft store and take the shards this broker owns (their prepared work finishes
        in the background; commands for one of their ids wait for it). Raises JournalCorruptError / OSError
        (startup must stop)."""
        broker = self.broker
        started = time.monotonic()
        if self.cluster:
            self.store = RaftTxnStore(broker.broker_id, broker.metadata.submit, lambda: broker.metadata.state,
                                      broker.broker_address,
                                      max_state_bytes=int(broker.config.transaction_state_max_bytes))
            self.ready = True
            state = broker.metadata.state
            self.on_metadata(state, state)
            # committed offsets a crash may have left unmaterialized: from the latest applied entry of each
            # id only (the replayed TxnSync commands that it supersedes are never acted on; see observe)
            for entry in self._applied_entries().values():
                if entry.state == st.COMMITTED and entry.group is not None and broker._owns_group(entry.group):
                    self._spawn(self._materialize_eventually(entry))
            return
        store = await JournalStore.open(broker.log_dir.path, broker.run_blocking,
                                        compact_min_superseded=broker.config.transaction_journal_compact_records,
                                        max_state_bytes=int(broker.config.transaction_state_max_bytes))
        self.store = store
        assert store.journal is not None
        jstate = store.journal.state
        if jstate.truncated_bytes:
            log.warning("transaction journal: truncated a torn tail of %d bytes", jstate.truncated_bytes)
        self.entries = dict(jstate.entries)
        for tp in sorted(jstate.touched):
            index = await self._scan_index(tp)
            if index is not None:
                self.indexes[tp] = index
        await self._recover()
        self.ready = True
        self._arm_timer()
        log.info("transactions recovered: %d ids, %d partitions indexed in %.0f ms", len(self.entries),
                 len(self.indexes), (time.monotonic() - started) * 1000)

    async def _scan_index(self, tp: TopicPartition) -> PartitionTxnIndex | None:
        """The transaction index of ``tp`` rebuilt from its whole log (None: no local replica). The caller
        installs it: it is filled on a blocking thread and is never visible to readers half-built (a
        read_committed read taking a partial index would not hide the aborted records it has not reached)."""
        replica = self.broker.replicas.get(tp)
        if replica is None:
            return None
        index = self._new_index(tp)
        plog = replica.log
        finals: dict[tuple[str, str, int], bool] = {}
        delay_s = int(_SCAN_DELAY_MS) / 1000.0 if _SCAN_DELAY_MS and tp[0].startswith(_SCAN_DELAY_PREFIX) else 0.0

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
                                      producer_epoch=info.producer_epoch, seq_num=info.seq_num)
                        seen.append((info.transactional_id, info.producer_epoch, info.seq_num, info.offset))
                    else:
                        key = (info.transactional_id, info.producer_id, info.producer_epoch)
                        index.on_marker(info.producer_id, info.offset, commit=info.marker == "commit",
                                        final=finals.get(key, True))
                        if delay_s:
                            time.sleep(delay_s)  # test-only (CURSUS_TXN_INDEX_SCAN_DELAY_MS)
                offset = result.next_offset

        seen: list[tuple[str, int, int, int]] = []
        if self.cluster:  # decided on the loop (the applied state), used by the scan thread
            for tid, applied in self._applied_entries().items():
                if applied.state in st.PREPARED:
                    finals[(tid, applied.producer_id, applied.epoch)] = False
        await self.broker.run_blocking(scan)
        # TXN_PUBLISH retries after the restart: the open transactions' (topic, seqNum) from the log
        for tid, epoch, seq, offset in seen:
            entry = self.entries.get(tid)
            txn = index.unresolved(entry.producer_id) if entry is not None else None
            if entry is not None and entry.state == st.OPEN and entry.epoch == epoch and txn is not None \
                    and offset >= txn.first_offset:
                self._published.setdefault(tid, {})[(tp[0], seq)] = (tp[1], offset + 1)
        if self.cluster:  # decisions applied while the scan ran (observe only saw the installed indexes)
            self._finalize_decided(index)
        return index

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
        """Stop the timeout timer and close the store (waits for a journal write in flight)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        if self.store is not None:
            await self.store.close()

    def check_ready(self, tid: str | None = None) -> None:
        """Raises ``transaction_manager_not_available`` (retryable) before recovery finished / after close;
        in a cluster ``NOT_COORDINATOR`` / ``coordinator_not_available`` when ``tid``'s shard is not (yet)
        taken here."""
        if not self.ready or self._closed or self.store is None:
            raise BrokerError.of("transaction_manager_not_available", reason="transaction recovery in progress")
        if self.cluster and tid is not None:
            state = self.broker.metadata.state
            shard = transaction_shard(tid, state.coordinator_shards) if state.coordinator_shards else -1
            owner = state.txn_shards.get(shard)
            if owner is None or owner.owner != self.broker.broker_id or self._owned.get(shard) != owner.epoch:
                assert isinstance(self.store, RaftTxnStore)
                raise self.store._not_coordinator(owner.owner if owner is not None else None)

    def _lock(self, tid: str) -> asyncio.Lock:
        lock = self._locks.get(tid)
        if lock is None:
            lock = self._locks[tid] = asyncio.Lock()
        return lock

    # ---------------------------------------------------------------------------------- journal glue

    async def _persist(self, entry: TxnEntry, *, touched: list[TopicPartition] | None = None,
                       next_producer_id: int | None = None, expect: tuple[str, int] | None = None) -> None:
        """Persist ``entry`` through the store (fsynced journal / applied TxnSync), then publish it.
        ``expect``: the (producerId, epoch) the stored entry must still have (guarded INIT_PRODUCER_ID).
        Raises ``transaction_sync_failed`` (retryable; nothing of that write is published; ``outcome=
        unknown`` when it may have been stored), ``transaction_manager_not_available`` (closed),
        ``NOT_COORDINATOR`` (cluster: the shard moved), ``producer_fenced`` (cluster: ``expect`` no longer
        holds in Raft order)."""
        store = self.store
        if store is None:
            raise BrokerError.of("transaction_manager_not_available", reason="coordinator closed")
        await store.persist(entry, touched=touched or [], next_producer_id=next_producer_id, expect=expect)
        self.entries[entry.transactional_id] = entry

    # ------------------------------------------------------------------------------------- commands

    async def init_producer(self, tid: str, expect: tuple[str, int] | None = None) -> TxnEntry:
        """INIT_PRODUCER_ID: a new (producerId, epoch 1) or the same producerId with epoch + 1; aborts an open
        transaction of the id first.

        ``expect`` = (producerId, epoch), the caller's last session (INIT_PRODUCER_ID ``producerId= epoch=``):
        the id is re-initialized only when that is its current session (the caller is its latest owner), so
        a zombie that re-initializes after its transaction cannot fence the instance that replaced it. The
        guard is checked here under the id's lock against the persisted entry and, in a cluster, again by
        the metadata FSM in Raft order on every TxnSync of this call (``TxnSync.expect``).

        Raises the errors of :func:`state.check_guarded_init` (nothing bumped, nothing aborted) and of
        :func:`state.init_producer`."""
        self.check_ready(tid)
        async with self._lock(tid):
            self.check_ready(tid)
            entry = self.entries.get(tid)
            if expect is not None:
                if entry is not None and st.guarded_retry(entry, *expect):
                    return entry  # the same init retried (its reply was lost): its bump, not another one
                st.check_guarded_init(entry, tid, *expect)
            if entry is not None and st.needs_abort_before_init(entry):
                entry = st.abort_for_reinit(entry, self._now())
                await self._persist(entry, expect=expect)
                entry = await self._finish(entry)
            assert self.store is not None
            next_pid, counter = self.store.new_producer_id(tid) if entry is None else ("", 0)
            new = st.init_producer(entry, tid, new_producer_id=next_pid, now_ms=self._now(),
                                   reinit_from=expect[1] if expect is not None else 0)
            await self._persist(new, next_producer_id=counter if entry is None else None, expect=expect)
            self._published.pop(tid, None)
            return new

    async def begin(self, tid: str, producer_id: str, epoch: int) -> TxnEntry:
        """BEGIN_TXN. Raises the errors of :func:`state.begin`."""
        self.check_ready(tid)
        async with self._lock(tid):
            self.check_ready(tid)
            entry = self.entries.get(tid)
            new = st.begin(entry, tid, producer_id, epoch, now_ms=self._now(), timeout_ms=self._timeout_ms)
            if new is not entry:
                await self._persist(new)
                self._published[tid] = {}
                self._arm_timer()
            return new

    async def publish(self, tid: str, producer_id: str, epoch: int, tp: TopicPartition, *, seq_num: int,
                      key: str | None, payload: bytes, event: EventSpec | None = None) -> tuple[TxnEntry, int]:
        """TXN_PUBLISH (and TXN_APPEND_STREAM with ``event``): register the partition (persisted once per
        partition), append one record with ``transaction_state=open`` on the partition's leader; returns
        (entry, partition) once the record is committed (acks=all). A retry of the same (topic, seqNum) in
        this epoch returns the first append's partition without appending (after waiting for it to be
        committed). An event's version check runs on the partition leader right before the append
        (:meth:`cursus.broker.eventstore.EventStore.txn_gate`).

        Raises the errors of :func:`state.check_publish`; ``message_too_large``; ``version_conflict``
        (nothing appended); the leader's write errors (``NOT_LEADER``, ``replication_unavailable
        outcome=unknown``, ...).
        """
        self.check_ready(tid)
        async with self._lock(tid):
            self.check_ready(tid)
            entry = st.check_publish(self.entries.get(tid), tid, producer_id, epoch)
            seen = self._published.setdefault(tid, {})
            dup = seen.get((tp[0], seq_num))
            if dup is not None:
                assignment = self.broker.metadata.state.assignment(tp[0], dup[0]) if self.cluster else None
                led_here = assignment is None or assignment.leader == self.broker.broker_id
                # a record appended elsewhere was committed before its leader answered
                committed = self._committed_waiter((tp[0], dup[0]), dup[1]) if led_here else _done()
            else:
                if tp not in entry.partitions:
                    grown = st.add_partition(entry, tp)
                    assert self.store is not None
                    self.store.check_fits(grown, touched=[tp])  # transaction_too_large: nothing changed
                    await self._persist(grown, touched=[tp])
                entry = st.check_publish(self.entries.get(tid), tid, producer_id, epoch)
                record = data_record(tp[0], tp[1], transactional_id=tid, producer_id=producer_id,
                                     producer_epoch=epoch, seq_num=seq_num, key=key, payload=payload,
                                     timestamp_ms=self._now(), event=event)
                if len(record) > self.broker.config.max_message_bytes:
                    raise BrokerError.of("message_too_large", size=len(record),
                                         limit=self.broker.config.max_message_bytes)
                end, committed, appended = await self._send(tp, record, kind="data", tid=tid,
                                                            producer_id=producer_id, epoch=epoch, seq_num=seq_num)
                if appended:  # a retry through a new coordinator found its first copy: not counted twice
                    entry = st.count_messages(entry, 1)
                self.entries[tid] = entry  # message count is bookkeeping; persisted with the next transition
                seen[(tp[0], seq_num)] = (tp[1], end)
                dup = (tp[1], end)
        await committed
        return entry, dup[0]

    async def stage_offsets(self, tid: str, producer_id: str, epoch: int, *, group: str, member: str,
                            generation: int, topic: str, offsets: dict[int, int]) -> TxnEntry:
        """SEND_OFFSETS_TO_TXN: validate the group fence now, stage (journaled). Raises the errors of
        :func:`state.stage_offsets` and of :meth:`GroupCoordinator.validate_commit`."""
        self.check_ready(tid)
        async with self._lock(tid):
            self.check_ready(tid)
            entry = self.entries.get(tid)
            new = st.stage_offsets(entry, tid, producer_id, epoch, group=group, member=member,
                                   generation=generation, topic=topic, offsets=offsets, now_ms=self._now())
            assert self.store is not None
            self.store.check_fits(new, touched=[])  # transaction_too_large: nothing staged
            await self.broker.coordinator.validate_commit(group, topic, member, generation, offsets)
            await self._persist(new)
            return new

    async def end(self, tid: str, producer_id: str, epoch: int, result: str) -> TxnEntry:
        """END_TXN result=commit|abort, in the commit order of the module docstring; a retry resumes or
        answers the final state. Raises the errors of :func:`state.end`, the group fence errors (the
        transaction is then aborted), ``transaction_commit_failed`` / ``transaction_abort_marker_failed``
        (retryable: the prepared decision stays and a retry finishes it)."""
        self.check_ready(tid)
        async with self._lock(tid):
            self.check_ready(tid)
            entry = self.entries.get(tid)
            new = st.end(entry, tid, producer_id, epoch, result, now_ms=self._now())
            if new.state in st.TERMINAL:
                return new
            if new is not entry:  # open -> prepared (a retry of a prepared one goes straight to its finish)
                assert entry is not None
                if new.state == st.PREPARE_COMMIT:
                    await self._check_offsets_fence(entry)  # step 1
                await self._persist(new)  # step 3 (or prepare_abort)
                _crash_point("after_prepare_commit" if new.state == st.PREPARE_COMMIT else "after_prepare_abort", tid)
                if new.state == st.PREPARE_COMMIT:
                    await self._revalidate(new)  # step 4
            try:
                return await self._finish(new)
            except BrokerError as exc:
                if exc.error.code in ("transaction_commit_failed", "transaction_abort_marker_failed",
                                      "transaction_sync_failed"):
                    self._resume_later(tid)  # the client may retry too; whoever comes first finishes it
                raise

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
        # standalone skips a marker already in the log; in a cluster each partition's leader decides
        pending = [tp for tp in st.marker_partitions(entry)
                   if self.cluster or self.index_for(tp).needs_marker(entry.producer_id)]
        try:
            remote = await self._write_markers(pending, entry.transactional_id, entry.producer_id, entry.epoch,
                                               commit=commit)
        except BrokerError as exc:
            code = "transaction_commit_failed" if commit else "transaction_abort_marker_failed"
            raise BrokerError.of(code, transactional_id=entry.transactional_id, epoch=entry.epoch,
                                 reason=exc.error.code, outcome="unknown") from None
        _crash_point("after_markers", entry.transactional_id)
        # the message count from the partitions' logs (remote leaders answer it with their marker), so
        # records published through a previous coordinator count too; the persisted count is a floor
        logged = sum(remote[tp] if tp in remote else self._session_records(tp, entry.producer_id, entry.epoch)
                     for tp in st.marker_partitions(entry))
        final = st.complete(st.count_messages(entry, max(0, logged - entry.messages)), self._now())
        await self._persist(final)
        self._resolve(final)
        if commit:
            _crash_point("after_commit_decision", entry.transactional_id)
            await self._materialize(final)
        self._published.pop(entry.transactional_id, None)
        self._arm_timer()  # its tombstone is due after transactional_id_expiration_ms
        return final

    def _resolve(self, entry: TxnEntry) -> None:
        """``entry``'s final decision is durable: resolve its marked transaction in the indexes of the
        partitions led here (only the same producer epoch: a later transaction of the id stays open)."""
        for tp in st.marker_partitions(entry):
            index = self.indexes.get(tp)
            txn = index.unresolved(entry.producer_id) if index is not None else None
            if index is not None and txn is not None and txn.producer_epoch == entry.epoch:
                index.finalize(entry.producer_id)

    def _session_records(self, tp: TopicPartition, producer_id: str, epoch: int) -> int:
        """How many data records of the session ``(producer_id, epoch)`` the index of ``tp`` (led here)
        holds unresolved (0 without an index or an unresolved transaction of that session)."""
        index = self.indexes.get(tp)
        txn = index.unresolved(producer_id) if index is not None else None
        if txn is None or txn.producer_epoch != epoch:
            return 0
        return sum(end - start for start, end in txn.ranges)

    async def _write_markers(self, partitions: list[TopicPartition], tid: str, producer_id: str, epoch: int, *,
                             commit: bool) -> dict[TopicPartition, int]:
        """Append the markers (in parallel) and wait until each is committed. Returns, for the partitions
        led by other brokers, how many data records of the session each leader holds (its answer)."""
        coordinator_epoch = self.store.coordinator_epoch(tid) if self.store is not None else 0
        waits = []
        for tp in partitions:
            record = marker_record(tp[0], tp[1], transactional_id=tid, producer_id=producer_id,
                                   producer_epoch=epoch, commit=commit, coordinator_epoch=coordinator_epoch,
                                   timestamp_ms=self._now())
            _, committed, _ = await self._send(tp, record, kind="commit" if commit else "abort", tid=tid,
                                               producer_id=producer_id, epoch=epoch, wait=False)
            waits.append(committed)
            if "after_first_marker" in _CRASH_AT and len(partitions) > 1:
                await committed
                _crash_point("after_first_marker", tid)
        results = await asyncio.gather(*waits, return_exceptions=True)
        remote: dict[TopicPartition, int] = {}
        for tp, result in zip(partitions, results, strict=True):
            if isinstance(result, BaseException):
                raise result
            if isinstance(result, _RemoteAppend):
                remote[tp] = result.records
        return remote

    # ---------------------------------------------------------------------------- participants

    async def _send(self, tp: TopicPartition, record: bytes, *, kind: str, tid: str, producer_id: str, epoch: int,
                    wait: bool = True, seq_num: int = 0) -> tuple[int, Any, bool]:
        """Append one transactional record on ``tp``'s leader: here when this broker leads it, else over the
        internal listener. Returns (end offset or 0, an awaitable that completes once it is committed,
        whether it was appended now: False for a record the leader already held). With ``wait`` a remote
        call completes before returning (without, the end is 0 and appended True). Raises the leader's
        errors."""
        state = self.broker.metadata.state
        assignment = state.assignment(*tp) if self.cluster else None
        coordinator_epoch = self.store.coordinator_epoch(tid) if self.store is not None else 0
        if assignment is None or assignment.leader is None or assignment.leader == self.broker.broker_id:
            end, appended = await self.append_local(self.broker.broker_id, tp, record, kind=kind, tid=tid,
                                                    producer_id=producer_id, epoch=epoch,
                                                    coordinator_epoch=coordinator_epoch, seq_num=seq_num)
            return end, self._committed_waiter(tp, end), appended
        call = asyncio.ensure_future(self._send_remote(assignment.leader, tp, record, kind=kind, tid=tid,
                                                       producer_id=producer_id, epoch=epoch,
                                                       coordinator_epoch=coordinator_epoch))
        if not wait:
            return 0, call, True
        done = await call
        return done.end, _done(), done.appended

    def _committed_waiter(self, tp: TopicPartition, end: int) -> Any:
        """An awaitable that completes once ``tp``'s records below ``end``, appended here as its leader, are
        committed (acks=all), a no-op for ``end`` 0. It fails (``NOT_LEADER`` and the like, outcome
        unknown) when this broker stopped leading ``tp`` meanwhile: a record is never taken as committed
        because its leader moved."""
        from cursus.broker.handlers.produce import wait_ack  # the shared acks=all wait

        if end <= 0:
            return _done()
        replica = self.broker.replicas.get(tp)
        if replica is None:
            return _fail(BrokerError.of("leader_not_available", topic=tp[0], partition=tp[1], outcome="unknown",
                                        reason="the partition is no longer served here"))
        return wait_ack(self.broker, replica, "all", end, replica.isr)

    async def append_local(self, coordinator_id: str, tp: TopicPartition, record: bytes, *, kind: str, tid: str,
                           producer_id: str, epoch: int, coordinator_epoch: int, seq_num: int = 0
                           ) -> tuple[int, bool]:
        """The partition-leader side: append one transactional record of ``coordinator_id``'s transaction
        to ``tp`` (led here) and index it; returns (the end offset to wait for, whether it was appended now;
        end 0: a marker nobody needs). A
        data record whose ``seq_num`` the open transaction already holds here is not appended again (a
        TXN_PUBLISH retried through a new coordinator): the first copy's end offset is returned.

        A new leader of a partition that ever took transactional records first rebuilds its index from the
        log (waited for here), so a marker is never skipped for records the index has not seen.

        Raises:
            BrokerError: ``NOT_COORDINATOR`` (cluster: ``coordinator_id`` is not the shard's owner at
                ``coordinator_epoch``: a previous owner is fenced), ``leader_not_available`` (the index
                could not be rebuilt in time), ``NOT_LEADER`` and the replica's write errors.
        """
        if self.cluster:
            await self._index_ready(tp)
        replica = self.broker.replica(*tp)
        if self.cluster:
            state = self.broker.metadata.state
            owner = state.txn_shards.get(transaction_shard(tid, state.coordinator_shards)) \
                if state.coordinator_shards else None
            if owner is None or owner.owner != coordinator_id or owner.epoch != coordinator_epoch:
                raise BrokerError.of("NOT_COORDINATOR", transactional_id=tid, coordinator=coordinator_id,
                                     coordinator_epoch=coordinator_epoch,
                                     current_epoch=owner.epoch if owner is not None else 0,
                                     reason="the coordinator does not own the shard at this epoch")
            if not self._index_complete(tp):
                raise BrokerError.of("leader_not_available", topic=tp[0], partition=tp[1],
                                     reason="transaction index not rebuilt yet")
        # TXN_APPEND_STREAM: the version check (staged appends count) sees every event below the LEO
        gate = await self.broker.events.txn_gate(replica, record) if kind == "data" else None
        # ---- from here to the append: no await ----
        index = self.index_for(tp)
        if kind == "data":
            earlier = index.published(producer_id, epoch, seq_num) if seq_num > 0 else None
            if earlier is not None:
                return earlier + 1, False
            self._refuse_late(index, tid, producer_id, epoch)
            if gate is not None:
                gate.check((producer_id, epoch))
            offset = self._append(replica, record)
            index.on_data(producer_id, offset, transactional_id=tid, producer_epoch=epoch, seq_num=seq_num)
            if gate is not None:
                gate.reserve((producer_id, epoch), offset)
            return offset + 1, True
        txn = index.unresolved(producer_id)
        if txn is None or txn.producer_epoch != epoch:
            return 0, False  # nothing of that session is open here
        if txn.marker_offset is not None:  # written before (a retried finish): wait for that one
            return txn.marker_offset + 1, False
        offset = self._append(replica, record)
        index.on_marker(producer_id, offset, commit=kind == "commit", final=False)
        return offset + 1, True

    def _refuse_late(self, index: PartitionTxnIndex, tid: str, producer_id: str, epoch: int) -> None:
        """A data record that arrives after its session was decided (a delayed call of a coordinator that
        gave up on it) would stay unresolved forever behind the marker and pin the LSO: refuse it.

        Raises:
            BrokerError: ``transaction_not_open`` (the marker of that session is already here, or the applied
                decision is past it).
        """
        txn = index.unresolved(producer_id)
        late = txn is not None and txn.producer_epoch == epoch and txn.marker_offset is not None
        if not late and self.cluster:
            entry = self.broker.metadata.state.txn_entry(tid)
            late = entry is not None and entry.producer_id == producer_id and (
                entry.epoch > epoch or (entry.epoch == epoch and entry.state not in (st.EMPTY, st.OPEN)))
        if late:
            raise BrokerError.of("transaction_not_open", transactional_id=tid, epoch=epoch,
                                 reason="the transaction was decided before this record arrived")

    def _index_complete(self, tp: TopicPartition) -> bool:
        return tp not in self._rebuilding and (tp in self._txn_ready or tp in self.indexes
                                               or tp not in self.broker.metadata.state.txn_touched)

    async def _index_ready(self, tp: TopicPartition) -> None:
        """Wait (bounded) until the index of ``tp``, led here, covers its whole log: start its rebuild when
        none is running (a leader whose preparation did not report)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.broker.config.replica_ack_timeout_ms / 1000.0
        while not self._index_complete(tp) and loop.time() < deadline:
            replica = self.broker.replica(*tp)
            replica.check_writable()
            if tp not in self._rebuilding:
                self.on_leader_ready(replica)
            event = self._resolved_events.get(tp)
            if event is None:
                event = self._resolved_events[tp] = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), max(0.0, deadline - loop.time()))

    async def _send_remote(self, leader: str, tp: TopicPartition, record: bytes, *, kind: str, tid: str,
                           producer_id: str, epoch: int, coordinator_epoch: int) -> _RemoteAppend:
        from cursus.internal.client import InternalRpcError
        from cursus.internal.v1 import replication_pb2 as pb

        node = self.broker.replication
        info = self.broker.metadata.state.brokers.get(leader)
        if node is None or info is None or not info.internal_address:
            raise BrokerError.of("leader_not_available", topic=tp[0], partition=tp[1],
                                 reason="the partition leader has no internal address")
        timeout_s = self.broker.config.replica_ack_timeout_ms / 1000.0 + 1.0
        request = pb.TxnRecordRequest(coordinator_id=self.broker.broker_id, topic=tp[0], partition=tp[1],
                                      record=record, coordinator_epoch=coordinator_epoch, transactional_id=tid,
                                      producer_id=producer_id, producer_epoch=epoch, kind=kind,
                                      timeout_ms=int(timeout_s * 1000))
        try:
            response = await node.client.append_txn_record(info.internal_address, request, timeout_s)
        except InternalRpcError as exc:
            raise BrokerError.of("replication_unavailable", topic=tp[0], partition=tp[1], outcome="unknown",
                                 reason=f"transaction record to {leader}: {exc.code.name}") from None
        if response.HasField("error") and response.error.code:
            fields = dict(response.error.fields)
            raise BrokerError.of(response.error.code, response.error.message, **fields)
        return _RemoteAppend(int(response.end_offset), not response.duplicate, int(response.records))

    async def serve_txn_record(self, coordinator_id: str, request: pb.TxnRecordRequest) -> pb.TxnRecordResponse:
        """``Replication.AppendTxnRecord`` on the partition leader: :meth:`append_local`, then wait until
        it is committed. Every failure is answered as a typed error."""
        from cursus.internal.v1 import replication_pb2 as pb

        tp = (request.topic, int(request.partition))
        try:
            if request.kind not in ("data", "commit", "abort"):
                raise BrokerError.of("invalid_cluster_request", reason="bad transaction record kind")
            info = txn_info(request.record)
            if info is None or info.transactional_id != request.transactional_id \
                    or info.producer_id != request.producer_id or info.producer_epoch != request.producer_epoch \
                    or (info.marker or "data") != request.kind:
                raise BrokerError.of("invalid_cluster_request", reason="the record does not match the request")
            end, appended = await self.append_local(coordinator_id, tp, request.record, kind=request.kind,
                                          tid=request.transactional_id, producer_id=request.producer_id,
                                          epoch=request.producer_epoch, coordinator_epoch=request.coordinator_epoch,
                                          seq_num=info.seq_num if info.marker is None else 0)
            records = 0 if request.kind == "data" else self._session_records(tp, request.producer_id,
                                                                             request.producer_epoch)
            await self._committed_waiter(tp, end)
            if request.kind != "data" and end:
                _crash_point("leader_after_marker", request.transactional_id)
        except BrokerError as exc:
            return pb.TxnRecordResponse(error=pb.Error(code=exc.error.code, message=exc.error.message or "",
                                                       fields={k: str(v) for k, v in exc.error.fields.items()}))
        except Exception as exc:  # a malformed record
            return pb.TxnRecordResponse(error=pb.Error(code="invalid_cluster_request", message=type(exc).__name__))
        return pb.TxnRecordResponse(end_offset=end, duplicate=not appended, records=records)

    async def _materialize(self, entry: TxnEntry) -> None:
        if entry.group is None:
            return
        if self.cluster and not self.broker._owns_group(entry.group):
            return  # the group's owner materializes it when the committed TxnSync applies there
        for topic, offsets in entry.staged_offsets_by_topic().items():
            try:
                await self.broker.coordinator.materialize(entry.group, topic, offsets)
            except BrokerError as exc:
                raise BrokerError.of("transaction_offset_materialization_failed",
                                     transactional_id=entry.transactional_id, reason=exc.error.code) from None

    def status(self, tid: str) -> TxnEntry:
        """TXN_STATUS. Raises ``transaction_not_found``."""
        self.check_ready(tid)
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
        the HWM. A cluster leader of a partition that ever took transactional records serves nothing to
        read_committed (its log start) until its index is rebuilt from the log and installed whole."""
        if isolation != "read_committed":
            return replica.hwm
        tp = (replica.topic, replica.partition)
        if not self._index_complete(tp):
            # a cluster leader of a partition that ever took transactional records, whose index is not back
            # from the log yet: nothing is stable (start the rebuild when none runs, e.g. an empty log's)
            if self.cluster and tp not in self._rebuilding and replica.writable:
                self.on_leader_ready(replica)
            return min(replica.hwm, replica.log.log_start_offset)
        index = self.indexes.get(tp)
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

    def rebuilding(self, tp: TopicPartition) -> bool:
        """Is the transaction index of ``tp`` being rebuilt from the log (its transactions unknown)?"""
        return tp in self._rebuilding

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
        """Raises ``topic_delete_blocked`` while an open or committing transaction references ``topic`` (in a
        cluster: any shard's, from the applied state)."""
        entries = self._applied_entries() if self.cluster else self.entries
        for entry in entries.values():
            if entry.state in (st.OPEN, *st.PREPARED) and any(t == topic for t, _ in entry.partitions):
                raise BrokerError.of("topic_delete_blocked", topic=topic, transactional_id=entry.transactional_id,
                                     reason="an open or committing transaction references the topic")

    # ------------------------------------------------------------------------- cluster: ownership

    def _applied_entries(self) -> dict[str, TxnEntry]:
        state = self.broker.metadata.state
        return {tid: e for shard in state.txn.values() for tid, e in shard.entries.items()}

    def on_metadata(self, old: MetadataState, new: MetadataState) -> None:
        """Metadata listener (cluster): take the shards this broker came to own (load their entries from
        the applied state, finish their prepared transactions, time their open ones) and drop those it
        lost (the metadata log refuses anything it still submits for them); forget the indexes of
        partitions it no longer leads."""
        if not self.cluster or self.store is None or self._closed:
            return
        me = self.broker.broker_id
        owned = {shard: o.epoch for shard, o in new.txn_shards.items() if o.owner == me}
        for shard in [s for s, epoch in self._owned.items() if owned.get(s) != epoch]:
            del self._owned[shard]
            shards = new.coordinator_shards
            for tid in [t for t in self.entries if transaction_shard(t, shards) == shard]:
                del self.entries[tid]
                self._published.pop(tid, None)
            log.info("transactions: shard %d moved away", shard)
        gained = [s for s, epoch in owned.items() if self._owned.get(s) != epoch]
        for shard in gained:
            self._owned[shard] = owned[shard]
            shard_state = new.txn.get(shard)
            entries = dict(shard_state.entries) if shard_state is not None else {}
            self.entries.update(entries)
            prepared = [e for e in entries.values() if e.state in st.PREPARED]
            log.info("transactions: took shard %d at epoch %d (%d ids, %d prepared)", shard, owned[shard],
                     len(entries), len(prepared))
            for entry in prepared:
                self._spawn(self._resume(entry.transactional_id, shard, owned[shard]))
        if gained:
            self._arm_timer()
        if old is not new and old.active_brokers() != new.active_brokers():
            # groups that moved here: store the offsets of committed transactions their previous owner
            # may not have materialized (monotonic: a repeat changes nothing)
            for entry in self._applied_entries().values():
                if entry.state == st.COMMITTED and entry.group is not None \
                        and new.group_coordinator(entry.group) == me and old.group_coordinator(entry.group) != me:
                    self._spawn(self._materialize_eventually(entry))
        for topic in sorted(set(old.topics) - set(new.topics)):  # deleted: every owner forgets it
            self._spawn(self.on_topic_deleted(topic))
        for tp in [tp for tp in {*self.indexes, *self._txn_ready}
                   if (a := new.assignment(*tp)) is None or a.leader != me]:
            self.indexes.pop(tp, None)
            self._rebuilding.pop(tp, None)
            self._txn_ready.discard(tp)

    def _resume_later(self, tid: str) -> None:
        """A prepared transaction's finish failed (a leader or the metadata log unavailable): keep retrying
        it in the background, so it never stays prepared (pinning the LSO) waiting for a client retry.
        Cluster only: standalone, a failed journal write is not retried behind the client's back (the
        client's retry or the recovery at the next start finishes it)."""
        if not self.cluster:
            return
        state = self.broker.metadata.state
        shard = transaction_shard(tid, state.coordinator_shards)
        epoch = self._owned.get(shard)
        if epoch is not None:
            self._spawn(self._resume(tid, shard, epoch))

    async def _resume(self, tid: str, shard: int | None, epoch: int | None) -> None:
        """Finish a prepared transaction (of a shard taken over, or whose finish failed), retrying until it
        is done or the shard moves on (some markers may be written already: each leader skips those it
        has). ``shard`` None: standalone."""
        delay = self.broker.config.replica_fetch_backoff_ms / 1000.0
        while not self._closed and (shard is None or self._owned.get(shard) == epoch):
            async with self._lock(tid):
                entry = self.entries.get(tid)
                if entry is None or entry.state not in st.PREPARED or (shard is not None
                                                                        and self._owned.get(shard) != epoch):
                    return
                try:
                    await self._finish(entry)
                    log.info("transactions: finished the prepared %s of %s epoch %d", entry.state, tid, entry.epoch)
                    return
                except BrokerError as exc:
                    log.warning("transactions: resuming %s: %s (retrying)", tid, exc.error.code)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def _materialize_eventually(self, entry: TxnEntry) -> None:
        """Cluster, on the group's owner: materialize a committed transaction's offsets, retrying while the
        group coordinator is unavailable (just restarted, replaying) and this broker still owns the group."""
        delay = self.broker.config.replica_fetch_backoff_ms / 1000.0
        while not self._closed and entry.group is not None and self.broker._owns_group(entry.group):
            try:
                await self._materialize(entry)
                return
            except BrokerError as exc:
                log.debug("transactions: materializing the offsets of %s: %s (retrying)", entry.transactional_id,
                          exc.error.code)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_failure)

    def observe(self, command: Command | None) -> None:
        """Metadata observer (cluster, commit order; the state is the one after ``command``): an applied
        ``TxnSync`` resolves the marked transactions of its final entries in the indexes of partitions led
        here, hands committed offsets to this broker's group coordinator when it owns the group, and (for
        a command this broker is not waiting for: an unknown outcome that did commit) becomes the entry
        this coordinator works from. After a snapshot restore (None) every marked transaction whose applied
        decision is final resolves."""
        from cursus.metadata.commands import TxnSync

        state = self.broker.metadata.state
        if command is None:
            for index in self.indexes.values():
                self._finalize_decided(index)
            return
        if not isinstance(command, TxnSync):
            return
        if self.store is None or self._closed:
            # startup replay (snapshot, Raft journal) runs before open(): a replayed TxnSync may be
            # superseded by a later one (the id re-initialized, its group deleted and re-created), so nothing
            # is done for it here; open() works from the latest applied entries
            return
        shard_state = state.txn.get(command.shard)
        if shard_state is None or shard_state.last_request != command.request_id:
            return  # refused
        store = self.store
        ours = isinstance(store, RaftTxnStore) and command.request_id in store.pending
        for entry in command.entries:
            if entry.state in st.TERMINAL:
                self._resolve(entry)
            if entry.state == st.COMMITTED and entry.group is not None and not ours \
                    and self.broker._owns_group(entry.group):
                self._spawn(self._materialize_eventually(entry))
            if not ours and self._owned.get(command.shard) == command.shard_epoch:
                current = self.entries.get(entry.transactional_id)
                if current is None or _substance(current) != _substance(entry):  # not just our own, seen late
                    self.entries[entry.transactional_id] = entry

    def _finalize_decided(self, index: PartitionTxnIndex) -> None:
        """Resolve every marked transaction of ``index`` whose applied decision is final (cluster)."""
        state = self.broker.metadata.state
        for pid, txn in list(index.open.items()):
            entry = state.txn_entry(txn.transactional_id)
            if entry is not None and entry.state in st.TERMINAL and entry.producer_id == pid \
                    and entry.epoch == txn.producer_epoch and txn.marker_offset is not None:
                index.finalize(pid)

    def on_leader_ready(self, replica: Replica) -> None:
        """A cluster replica became its partition's leader: rebuild its transaction index from the log when
        the partition ever took transactional records (read_committed waits until it is back)."""
        tp = (replica.topic, replica.partition)
        self.indexes.pop(tp, None)
        self._txn_ready.discard(tp)
        self._rebuilding.pop(tp, None)  # an older epoch's rebuild installs nothing now
        if not self.cluster:
            return
        if tp not in self.broker.metadata.state.txn_touched:
            self._txn_ready.add(tp)
            return
        token = self._rebuilding[tp] = object()
        epoch = replica.leader_epoch

        async def rebuild() -> None:
            try:
                index = await self._scan_index(tp)
                if index is not None and self._rebuilding.get(tp) is token and replica.leader_epoch == epoch \
                        and self.broker.replicas.get(tp) is replica and replica.writable:
                    self.indexes[tp] = index
                    self._txn_ready.add(tp)
            finally:
                if self._rebuilding.get(tp) is token:
                    del self._rebuilding[tp]
                self._wake(tp)
        self._spawn(rebuild())

    # ---------------------------------------------------------------------------------- timeouts

    def _arm_timer(self) -> None:
        if self._closed:
            return
        deadline = st.oldest_open(self.entries.values())
        tombstone_at = st.next_tombstone_ms(self.entries.values(), self._expiration_ms)
        if tombstone_at is not None:
            deadline = tombstone_at if deadline is None else min(deadline, tombstone_at)
        if deadline is not None:  # after a failed timeout abort: retry later, not in a tight loop
            deadline = max(deadline, self._expire_retry_ms)
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
                try:
                    await self._persist(expired)
                    self.expired_total += 1
                    await self._finish(expired)
                except BrokerError as exc:
                    log.warning("transactions: aborting %s after its timeout: %s (retrying)", tid, exc.error.code)
                    self._expire_retry_ms = self._now() + max(1, int(self.broker.config.replica_fetch_backoff_ms))
                    if self.entries.get(tid) is expired:
                        self._resume_later(tid)
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


@dataclass(frozen=True, slots=True)
class _RemoteAppend:
    """A partition leader's answer to ``AppendTxnRecord``: the end offset (0: no marker needed), whether it
    appended now, and for a marker the session's data records it holds."""

    end: int
    appended: bool
    records: int = 0


def _log_failure(task: asyncio.Future[None]) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        exc = task.exception()
        if exc is not None:
            log.error("transaction timeout handling failed: %s", exc)



def _substance(entry: TxnEntry) -> tuple[Any, ...]:
    """What a transition changes (the message count is bookkeeping between transitions)."""
    return (entry.producer_id, entry.epoch, entry.state, entry.partitions, entry.group, entry.member,
            entry.generation, entry.offsets, entry.deadline_ms, entry.reinit_from)


async def _noop() -> None:
    return None


def _done() -> Any:
    return _noop()


async def _fail(error: BaseException) -> None:
    raise error
