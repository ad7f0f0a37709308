"""A partition replica as the event loop sees it: role, leader epoch, offsets, HWM and waiters.

The role (:mod:`cursus.broker.replica_role`) comes from metadata: :meth:`Replica.become_leader` and
:meth:`Replica.become_follower` carry the leader epoch. Standalone is a cluster of one: the broker makes
every replica the leader of a one-member ISR, so the HWM is our own durable end offset.

* **Leader**: appends client batches stamped with its leader epoch. Its *candidate* HWM
  (:attr:`Replica.candidate_hwm`) is the min durable end over the *maximal ISR* (the committed ISR plus
  members whose expansion it proposed, :meth:`Replica.expand_isr_pending`); follower progress arrives through
  :meth:`Replica.update_replica_end`. The candidate goes to a committer (:attr:`Replica.on_candidate_hwm`,
  see :mod:`cursus.replication.hwm`); the *visible* HWM is what came back committed
  (:meth:`Replica.on_committed_hwm`). Without a committer hook (standalone) the candidate is committed at
  once. A cluster leader of a new epoch starts from the assignment's committed HWM and truncates its local
  tail above it on the writer thread before it accepts appends or shows its HWM to readers
  (``leader_not_available`` meanwhile, :meth:`Replica.check_readable`); a local LEO below the committed HWM
  fails closed (``storage_unavailable``).
* **Follower**: refuses client appends (``NOT_LEADER``); appends the leader's chunks as stored
  (:meth:`Replica.append_replicated`); learns the HWM from the leader (clamped to :attr:`Replica.matched_offset`,
  the prefix known to match the leader's log, never to a divergent local tail); truncates
  by leader-epoch lineage (:meth:`Replica.truncate_to_epoch`, KIP-279).

Offsets (all half-open, Kafka style):

* ``log_start_offset`` <= ``hwm`` <= ``leo`` and ``durable_end_offset`` <= ``leo``; on a leader also
  ``hwm`` <= ``durable_end_offset``;
* ``leo`` counts records handed to the writer thread (assigned, maybe not yet written);
* ``durable_end_offset`` counts records fsynced;
* ``hwm`` is the first offset consumers may not read yet. At open it is the log's checkpointed HWM (never
  the durable end, which would expose uncommitted records in a cluster); a leader then moves it to the min
  durable end over its ISR.

Acks: :meth:`Replica.wait_durable` (acks=1, acks=0 release) and :meth:`Replica.wait_committed` (acks=all:
committed HWM and every captured ISR member's durable end). Progress listeners
(:meth:`Replica.add_progress_listener`) hear every change of durable end, HWM, role or leader epoch.

Thread-safety: loop thread only. The writer thread reports back through the broker, which calls
:meth:`on_durable` / :meth:`on_failure` on the loop thread and resolves future tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import heapq
import logging
import os
import time
from collections.abc import Callable

from cursus.broker.producer_state import ProducerStateTable
from cursus.broker.replica_role import Event, Role, check_epoch, next_role
from cursus.storage import GroupCommitWriter, PartitionLog
from cursus.storage.chunk import HEADER_SIZE, ChunkHeader, crc_matches, decode_header, records_walk_ok
from cursus.storage.epochs import EpochEnd, end_offset_for_epoch, truncation_offset
from cursus.wire.errors import BrokerError, make_error

log = logging.getLogger("cursus.replica")

#: Test-only: ``CURSUS_LEADER_PREPARE_DELAY_MS=<ms>`` makes every new cluster leader's writer-thread
#: preparation (:meth:`Replica.become_leader`) sleep that long first, widening the window in which the leader
#: is not ready (regression tests pin what clients see meanwhile). Unset or 0 in production.
_PREPARE_DELAY_S = int(os.environ.get("CURSUS_LEADER_PREPARE_DELAY_MS", "0") or 0) / 1000.0

#: ``listener(replica)``: a change of durable end, HWM, role or leader epoch (loop thread, must not block).
ProgressListener = Callable[["Replica"], None]


def check_replicated_chunk(chunk: bytes) -> ChunkHeader | None:
    """The header of ``chunk`` when it is exactly one whole valid chunk (header, CRC, record framing), else
    None. Pure, any thread: a follower runs it on the offload threads for large fetch responses and hands
    the header to :meth:`Replica.append_replicated` (``checked=``)."""
    header = decode_header(chunk, 0)
    if (header is None or header.size_bytes != len(chunk) or not crc_matches(chunk, 0, header)
            or not records_walk_ok(memoryview(chunk)[HEADER_SIZE:], header.record_count)):
        return None
    return header


class TruncationRefused(BrokerError):
    """A follower truncation that would go below the committed HWM or make no progress
    (:meth:`Replica.truncate_to_epoch`): the partition fails closed instead of looping."""


class Replica:
    """Loop-side state of one partition replica backed by a :class:`PartitionLog`. It starts in role
    ``OPENED``: nothing is appended or served until a role transition."""

    def __init__(self, topic: str, partition: int, log: PartitionLog, writer: GroupCommitWriter,
                 *, broker_id: str = "standalone") -> None:
        self.topic = topic
        self.partition = partition
        self.log = log
        self.writer = writer
        self.broker_id = broker_id
        self.role = Role.OPENED
        #: The leader epoch of the current role; until the first transition, the log's latest epoch.
        self.leader_epoch = log.leader_epoch
        #: The current leader's broker id (``None`` while ``OPENED``).
        self.leader_id: str | None = None
        self.leo = log.log_end_offset
        self.durable_end_offset = log.durable_end_offset
        self.hwm = log.hwm
        #: The in-sync replica set (a leader's view); standalone: just this broker.
        self.isr: tuple[str, ...] = ()
        #: The topic lifecycle epoch of the partition's assignment (set by the broker; CommitHwm carries it).
        self.lifecycle_epoch = 0
        self._replica_ends: dict[str, int] = {}
        #: Follower: the last HWM the leader reported (the local HWM is that, clamped to :attr:`matched_offset`).
        self._leader_hwm = 0
        #: Follower: every record below it is known to match the current leader's log (the local HWM at
        #: the role change, a fetch the leader accepted at an offset, or chunks appended from it). Records
        #: above it may be a divergent tail of an old epoch: the committed HWM never covers them.
        self.matched_offset = self.hwm
        #: The broker's read lease (cluster: :meth:`cursus.cluster.controller.Controller.lease_valid`); a
        #: leader whose lease expired refuses reads. ``None`` (standalone): always valid.
        self.lease: Callable[[], bool] | None = None
        #: Leader: the offset of this epoch's first append (None until it appends). The log's epoch history
        #: learns the epoch only when the writer thread writes that chunk; until then
        #: :meth:`end_offset_for_epoch` must count the epoch from here, not from the LEO, which already
        #: covers appends in flight (Finding E).
        self._epoch_start: int | None = None
        #: Follower: replicated chunks handed to the writer and not yet durable: base -> (next offset, bytes).
        self._inflight: dict[int, tuple[int, bytes]] = {}
        #: Epoch of the last chunk handed to the writer (chunk epochs never decrease).
        self._last_chunk_epoch = log.leader_epoch if log.leader_epochs else -1
        self.fenced: BaseException | None = log.failed
        if log.failed is not None:
            self.role = Role.FENCED
        # A heap of (end_offset, seq, future) waiting for hwm >= end_offset.
        self._hwm_waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._waiter_seq = 0
        #: Set (and dropped) when the HWM moves; created only while a long poll waits for data.
        self._data_event: asyncio.Event | None = None
        self.on_hwm_change: Callable[[Replica], None] | None = None
        #: Members whose ISR expansion this leader proposed and has not seen applied.
        self._pending_isr: set[str] = set()
        #: The committer's hook: called when :attr:`candidate_hwm` moves (leader, writable). None: commit
        #: the candidate at once (a cluster of one, standalone) -- unless this replica ever led with a
        #: committed HWM from metadata (a cluster leader, :attr:`commits_locally` False).
        self.on_candidate_hwm: Callable[[Replica], None] | None = None
        #: False once this replica led with a committed HWM from metadata (a cluster): from then on its
        #: visible HWM is only ever a committed HWM applied from metadata, never its own candidate, even
        #: when no committer hook is attached (the committer closed at shutdown, or was detached). A local
        #: commit there would checkpoint an HWM above the committed one (issue 13 anomaly).
        self.commits_locally = True
        self._last_candidate = -1
        #: Called once a new cluster leader finished its writer-thread preparation, with the producer state
        #: rebuilt from its (truncated) log: the broker installs it as the partition's producer table.
        self.on_leader_ready: Callable[[Replica, ProducerStateTable], None] | None = None
        #: False while a new cluster leader prepares (truncation above the committed HWM, producer state).
        self._ready = True
        self._ready_future: asyncio.Future[None] | None = None
        self._prepare_token: object | None = None
        #: Set when this leader must not serve: its local log ends below the committed HWM.
        self.unavailable: BrokerError | None = None
        #: Set by :meth:`on_deleted` when the topic still exists under a new generation (TRUNCATE, a DELETE
        #: and re-CREATE applied in one step): the replica's requests answer a retryable error, not
        #: ``topic_not_found`` (:meth:`removed_error`).
        self._replaced = False
        #: The highest committed HWM learned while preparing (applied once ready).
        self._committed_pending = 0
        # (end_offset, seq, future) waiting for durable_end_offset >= end_offset.
        self._durable_waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        # (end_offset, seq, captured isr, future) waiting for hwm >= end_offset; then, if some captured member
        # has not reported end_offset yet, moved to _member_waiters.
        self._committed_waiters: list[tuple[int, int, tuple[tuple[str, ...], int], asyncio.Future[None]]] = []
        self._member_waiters: list[tuple[int, tuple[tuple[str, ...], int], asyncio.Future[None]]] = []
        self._progress_listeners: list[ProgressListener] = []

    # ------------------------------------------------------------------------------------ properties

    @property
    def log_start_offset(self) -> int:
        return self.log.log_start_offset

    @property
    def deleted(self) -> bool:
        """True once the topic was deleted."""
        return self.role is Role.DELETED

    def check_writable(self) -> None:
        """Raise unless this replica accepts client appends.

        Raises:
            BrokerError: ``topic_not_found`` (deleted) or ``leader_not_available`` (replaced by a new
                generation of the topic: :meth:`removed_error`), ``storage_unavailable`` (fenced),
                ``NOT_LEADER`` (a follower, or no role yet).
        """
        if self.deleted:
            raise self.removed_error()
        if self.fenced is not None:
            raise BrokerError.of(
                "storage_unavailable", topic=self.topic, partition=self.partition,
                reason="partition fenced after a storage error; restart the broker",
            )
        if self.role is not Role.LEADER:
            raise self._not_leader()
        if self.unavailable is not None:
            raise self.unavailable
        if not self._ready:
            raise BrokerError.of("leader_not_available", topic=self.topic, partition=self.partition,
                                 reason="new leader is truncating its uncommitted tail")

    def check_readable(self) -> None:
        """Raise unless this replica's HWM may be shown to clients (LIST_OFFSETS, CONSUME, STREAM, BROWSE,
        the event-store reads).

        A replica with no role yet (``OPENED``: the metadata is still replaying after a restart) or not
        leading (a follower the metadata already names leader) knows only its local HWM -- a lazily written
        checkpoint, or one fetch behind its leader -- which may be below the committed HWM clients already
        saw; a cluster leader still preparing (:meth:`become_leader`) has not applied the committed HWM
        yet. Those refuse, retryable, rather than show an HWM that went back or answer a committed offset
        with no records (issue 13). Fenced and deleted replicas are left to the read path's own errors.

        Raises:
            BrokerError: ``leader_not_available`` (retryable: not ready yet), or :attr:`unavailable`
                (``storage_unavailable``: the local log ends below the committed HWM).
        """
        if self.role is Role.LEADER:
            if self.unavailable is not None:
                raise self.unavailable
            if not self._ready:
                reason = "new leader is preparing; its HWM is not known yet"
            elif self.lease is not None and not self.lease():
                reason = "leader lease expired: waiting for this broker's heartbeat"
            else:
                return
        elif self.role in (Role.OPENED, Role.FOLLOWER):
            reason = ("replica has no role yet" if self.role is Role.OPENED
                      else "replica is not leading yet")
        else:
            return
        raise BrokerError.of("leader_not_available", topic=self.topic, partition=self.partition, reason=reason)

    @property
    def writable(self) -> bool:
        """True when :meth:`check_writable` would pass."""
        return (self.role is Role.LEADER and self.fenced is None and self.unavailable is None and self._ready)

    async def wait_writable(self) -> None:
        """Wait until a new leader finished preparing (returns at once when it is not preparing)."""
        if self._ready_future is not None and not self._ready_future.done():
            await asyncio.shield(self._ready_future)

    def _not_leader(self, *, outcome_unknown: bool = False) -> BrokerError:
        """``NOT_LEADER leader=``; with ``outcome_unknown`` (a waiter of records already appended here: they
        may be committed by the next leader, or lost) also ``outcome=unknown``, so no client takes the
        redirect for a refusal and resends them without idempotence (a duplicate)."""
        if outcome_unknown:
            return BrokerError.of("NOT_LEADER", topic=self.topic, partition=self.partition, leader=self.leader_id,
                                  outcome="unknown")
        return BrokerError.of("NOT_LEADER", topic=self.topic, partition=self.partition, leader=self.leader_id)

    # ---------------------------------------------------------------------------------------- roles

    def become_leader(self, leader_epoch: int, isr: tuple[str, ...] | None = None, *,
                      committed_hwm: int | None = None) -> None:
        """Lead the partition in ``leader_epoch`` with ``isr`` (default: this broker alone). Re-applying the
        current epoch updates the ISR (expansions it shows stop being pending) and the committed HWM.

        ``committed_hwm`` is the assignment's committed HWM (cluster); None (standalone) commits locally.
        A cluster leader of a new epoch first runs a preparation on the writer thread, in order after every
        append queued before: it truncates the local tail above the committed HWM (never below the local
        HWM) and rebuilds the producer state from the log (:attr:`on_leader_ready`); appends and reads are
        refused with ``leader_not_available`` until then (:meth:`wait_writable`, :meth:`check_readable`). A local LEO below the committed
        HWM fails closed: ``storage_unavailable`` until another role arrives. Waiters of an older epoch
        fail with ``NOT_LEADER`` (outcome unknown).

        Raises:
            TransitionRefused: fenced or deleted, or ``leader_epoch`` is below the current epoch.
        """
        members = isr if isr is not None else (self.broker_id,)
        assert self.broker_id in members, (self.broker_id, members)
        new_epoch = check_epoch(self.role, Event.BECOME_LEADER, self.leader_epoch, leader_epoch)
        if new_epoch:
            was_leader = self.role is Role.LEADER
            self.role = next_role(self.role, Event.BECOME_LEADER)
            self.leader_epoch = leader_epoch
            self.leader_id = self.broker_id
            self._epoch_start = None
            self._inflight.clear()
            self._replica_ends = {self.broker_id: self.durable_end_offset}
            self._pending_isr.clear()
            self._last_candidate = -1
            self.unavailable = None
            self._ready = True
            self._prepare_token = None
            self._fail_committed_waiters(self._not_leader(), committed_hwm=committed_hwm)
            if was_leader:
                self._fail_waiters(self._not_leader(), durable=False, committed_hwm=committed_hwm)
        self.isr = tuple(members)
        self._pending_isr -= set(members)
        self._member_progress()  # a member the applied ISR dropped is no longer waited for
        if committed_hwm is not None:
            self.commits_locally = False
        if new_epoch and committed_hwm is not None:
            self._prepare_leader(committed_hwm)
        elif committed_hwm is not None:
            self.on_committed_hwm(leader_epoch, committed_hwm)
        if new_epoch:
            self._notify_progress()
        self._candidate_changed()

    def _prepare_leader(self, committed_hwm: int) -> None:
        """Start the writer-thread preparation of a new cluster leader (see :meth:`become_leader`)."""
        if committed_hwm > self.leo:
            # transient (retryable): this broker hands leadership over or catches up from the ISR
            self.unavailable = BrokerError(dataclasses.replace(make_error(
                "storage_unavailable", topic=self.topic, partition=self.partition,
                reason=f"local log ends at {self.leo}, below the committed HWM {committed_hwm}"), retryable=True))
            log.error("%s/%d: %s; not serving", self.topic, self.partition, self.unavailable.error.fields["reason"])
            return
        if self.leo == 0:  # an empty log (a new partition): nothing to truncate, no producer state to rebuild
            return
        target = max(committed_hwm, self.hwm)
        self._ready = False
        self._committed_pending = committed_hwm
        token = self._prepare_token = object()
        loop = asyncio.get_running_loop()
        ready = self._ready_future = loop.create_future()
        fut: asyncio.Future[object] = loop.create_future()
        plog = self.log
        truncate = target < self.leo
        if truncate:
            log.warning("%s/%d: new leader of epoch %d truncates its uncommitted tail from %d to %d (committed HWM "
                        "%d)", self.topic, self.partition, self.leader_epoch, self.leo, target, committed_hwm)

        def prepare() -> ProducerStateTable:  # writer thread
            if _PREPARE_DELAY_S > 0:
                time.sleep(_PREPARE_DELAY_S)  # test-only (CURSUS_LEADER_PREPARE_DELAY_MS)
            if truncate:
                plog.truncate_to(target)
            return ProducerStateTable.copy_of(plog.producer_state)

        self.writer.submit_call(prepare, fut, log=self.log)
        if truncate:
            self.leo = target
            self.durable_end_offset = min(self.durable_end_offset, target)
            self._replica_ends[self.broker_id] = self.durable_end_offset
            self._fail_durable_above(target)
        fut.add_done_callback(lambda done: self._leader_prepared(token, ready, done))

    def _leader_prepared(self, token: object, ready: asyncio.Future[None], done: asyncio.Future[object]) -> None:
        try:
            if token is self._prepare_token:
                self._finish_prepare(done)
        finally:
            if not ready.done():
                ready.set_result(None)

    def _finish_prepare(self, done: asyncio.Future[object]) -> None:
        self._prepare_token = None
        error = done.exception() if not done.cancelled() else asyncio.CancelledError()
        if error is not None:
            self.on_failure(error)
        else:
            self._ready = True
            self._last_chunk_epoch = self.log.leader_epoch if self.log.leader_epochs else -1
            table = done.result()
            assert isinstance(table, ProducerStateTable)
            if self.on_leader_ready is not None:
                self.on_leader_ready(self, table)
            self.on_committed_hwm(self.leader_epoch, self._committed_pending)
            self._notify_progress()
            self._candidate_changed()

    def become_follower(self, leader_epoch: int, leader_id: str, *, committed_hwm: int | None = None) -> None:
        """Follow ``leader_id`` in ``leader_epoch``. Client appends are refused from now on; acks still
        waiting on this replica fail with ``NOT_LEADER``: plain for records above ``committed_hwm`` (the
        assignment's committed HWM: the new leader truncates them, they are gone), ``outcome=unknown`` for
        records at or below it (committed, only not confirmed yet) or when ``committed_hwm`` is None.

        Raises:
            TransitionRefused: fenced or deleted, ``leader_epoch`` below the current one, or a leader
                becoming a follower without a new epoch.
        """
        assert leader_id != self.broker_id
        if not check_epoch(self.role, Event.BECOME_FOLLOWER, self.leader_epoch, leader_epoch):
            return
        self.role = next_role(self.role, Event.BECOME_FOLLOWER)
        self.leader_epoch = leader_epoch
        self.leader_id = leader_id
        self._epoch_start = None
        self.isr = ()
        self._replica_ends = {}
        self._pending_isr.clear()
        self._leader_hwm = self.hwm
        self.matched_offset = self.hwm
        self.unavailable = None
        self._ready = True
        self._prepare_token = None
        self._fail_waiters(self._not_leader(), committed_hwm=committed_hwm)
        self._notify_progress()

    # ------------------------------------------------------------------------------- ISR and HWM

    @property
    def maximal_isr(self) -> tuple[str, ...]:
        """The committed ISR plus members whose expansion is pending (Kafka's maximal ISR), ISR order first."""
        if not self._pending_isr:
            return self.isr
        return self.isr + tuple(sorted(self._pending_isr - set(self.isr)))

    def expand_isr_pending(self, member: str) -> None:
        """This leader proposed adding ``member`` to the ISR: count it in the candidate HWM from now on,
        until the applied ISR shows it, :meth:`clear_isr_pending` withdraws it, or the role changes."""
        if self.role is Role.LEADER and member not in self.isr and member not in self._pending_isr:
            self._pending_isr.add(member)
            self._candidate_changed()

    def clear_isr_pending(self, member: str) -> None:
        """The expansion of ``member`` was refused (or given up): stop counting it."""
        if member in self._pending_isr:
            self._pending_isr.discard(member)
            self._member_progress()
            self._candidate_changed()

    @property
    def candidate_hwm(self) -> int:
        """Leader: min durable end over :attr:`maximal_isr` (a member that has not reported counts 0),
        never below the visible HWM. Other roles: the visible HWM."""
        if self.role is not Role.LEADER:
            return self.hwm
        ends, low = self._replica_ends, None
        for member in self.maximal_isr:  # a loop, not min(genexpr): this runs on every fsync and fetch
            end = ends.get(member, 0)
            if low is None or end < low:
                low = end
        return self.hwm if low is None or low < self.hwm else low

    def on_committed_hwm(self, leader_epoch: int, hwm: int) -> None:
        """The committed HWM ``hwm`` (records) applied from metadata for ``leader_epoch`` reaches this
        replica: a leader of that epoch makes it visible (never backward; ignored for another epoch or
        role, remembered while preparing)."""
        if self.role is not Role.LEADER or leader_epoch != self.leader_epoch or self.unavailable is not None:
            return
        if not self._ready:
            self._committed_pending = max(self._committed_pending, hwm)
            return
        self.advance_hwm(min(hwm, self.leo))

    def _candidate_changed(self) -> None:
        """Tell the committer the candidate HWM moved (or commit it at once without one)."""
        if not self.writable:
            return
        candidate = self.candidate_hwm
        if candidate == self._last_candidate:
            return
        self._last_candidate = candidate
        if candidate <= self.hwm:
            return
        if self.on_candidate_hwm is not None:
            self.on_candidate_hwm(self)
        elif self.commits_locally:
            self.advance_hwm(candidate)
        # else: a cluster leader without a committer (shutting down): nothing becomes visible

    # ----------------------------------------------------------------------------- progress listeners

    def add_progress_listener(self, fn: ProgressListener) -> None:
        """Call ``fn(replica)`` on the loop whenever durable end, HWM, role or leader epoch changes."""
        self._progress_listeners.append(fn)

    def remove_progress_listener(self, fn: ProgressListener) -> None:
        """Stop calling ``fn`` (no error when it is not registered)."""
        with contextlib.suppress(ValueError):
            self._progress_listeners.remove(fn)

    def _notify_progress(self) -> None:
        for fn in list(self._progress_listeners):
            try:
                fn(self)
            except Exception:
                log.exception("replica progress listener failed")

    # --------------------------------------------------------------------------------------- append

    def append(self, body: bytearray | bytes | memoryview, record_count: int) -> int:
        """Hand one client chunk (offsets already stamped at :attr:`leo`) to the writer thread, stamped
        with this leader's epoch. Leader only.

        Returns the chunk's base offset. The caller awaits :meth:`wait_durable` (acks=1) or
        :meth:`wait_committed` (acks=all).

        Raises:
            BrokerError: see :meth:`check_writable`.
        """
        self.check_writable()
        assert record_count > 0
        base_offset = self.leo
        if self._epoch_start is None:
            self._epoch_start = base_offset
        self.leo += record_count
        self._last_chunk_epoch = self.leader_epoch
        self.writer.submit_append(self.log, base_offset, record_count, body, self, leader_epoch=self.leader_epoch)
        return base_offset

    def append_replicated(self, chunk: bytes, leader_epoch: int, *, checked: ChunkHeader | None = None,
                          allow_gap: bool = False) -> int:
        """Append one chunk fetched from the leader of ``leader_epoch``, as the leader stored it (header
        included: its base offset, leader epoch and append time are kept, so the stored bytes are
        identical). Follower only. Returns the offset after the chunk.

        A chunk at the LEO is appended. With ``allow_gap`` (the leader says its log has cleaned segments,
        which leave offset gaps: the fetch reply's ``cleaned_gaps``, whatever the topic's current cleanup
        policy) a chunk *above* the LEO is appended too, after an offset gap
        (:meth:`PartitionLog.skip_gap`), exactly as the leader stores it. A chunk identical to one already
        appended (or in flight) at its offset is a no-op (a retried fetch). Anything else is refused,
        nothing is appended. ``checked`` is :func:`check_replicated_chunk` of exactly these bytes, run by
        the caller (off the loop); without it the check runs here.

        Raises:
            BrokerError: ``PARTITION_LEADER_FENCED`` (not a follower), ``STALE_LEADER_EPOCH`` (a fetch
                from another leader epoch), ``corrupt_log_data`` (not one whole valid chunk, or its epoch
                breaks the lineage), ``OFFSET_OUT_OF_RANGE`` (a gap after the LEO), ``version_conflict``
                (other bytes at an existing offset: truncate by epoch first), ``storage_unavailable``.
        """
        self._check_replicating(leader_epoch)
        header = checked if checked is not None else check_replicated_chunk(chunk)
        if header is None:
            raise BrokerError.of("corrupt_log_data", topic=self.topic, partition=self.partition,
                                 reason="replicated bytes are not one valid chunk")
        if header.base_offset < self.leo:
            if self._stored_chunk(header.base_offset) == chunk:
                return header.next_offset
            raise BrokerError.of("version_conflict", topic=self.topic, partition=self.partition,
                                 offset=header.base_offset,
                                 reason="other bytes are stored at this offset; truncate by leader epoch first")
        if header.base_offset > self.leo and not allow_gap:
            raise BrokerError.of("OFFSET_OUT_OF_RANGE", requested=header.base_offset,
                                 earliest=self.log_start_offset, latest=self.leo)
        if not self._last_chunk_epoch <= header.leader_epoch <= leader_epoch:
            raise BrokerError.of("corrupt_log_data", topic=self.topic, partition=self.partition,
                                 offset=header.base_offset,
                                 reason=f"chunk leader epoch {header.leader_epoch} outside "
                                        f"[{self._last_chunk_epoch}, {leader_epoch}]")
        if header.base_offset > self.leo:  # the leader's cleaner left a gap: the log continues after it
            done: asyncio.Future[object] = asyncio.get_running_loop().create_future()
            done.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failure fences the append
            self.writer.submit_call(functools.partial(self.log.skip_gap, header.base_offset), done, log=self.log)
            if self.matched_offset >= self.leo:  # the gap is the leader's, right after a matching prefix
                self.matched_offset = header.base_offset
            self.leo = header.base_offset
        self.leo = header.next_offset
        self._last_chunk_epoch = header.leader_epoch
        if self.matched_offset >= header.base_offset:  # appended right after a prefix matching the leader
            self.matched_offset = header.next_offset
        self._inflight[header.base_offset] = (header.next_offset, chunk)
        self.writer.submit_append(self.log, header.base_offset, header.record_count, chunk[HEADER_SIZE:], self,
                                  leader_epoch=header.leader_epoch, append_time_ms=header.append_time_ms)
        self.advance_hwm(self._leader_hwm)
        return header.next_offset

    def skip_replicated_gap(self, offset: int, leader_epoch: int) -> None:
        """Follower of a log with cleaned segments: the leader of ``leader_epoch`` stores no chunk from this LEO up to
        ``offset``, the end of its written log (a gap its cleaner left at the end of its log: the fetch
        reply's ``skip_to``). Continue the log at ``offset`` without records (:meth:`PartitionLog.skip_gap`,
        fsynced at once: the next fetch starts at the durable end). A no-op at or below the LEO.

        Raises:
            BrokerError: ``PARTITION_LEADER_FENCED`` (not a follower), ``STALE_LEADER_EPOCH`` (another
                leader epoch), ``storage_unavailable``.
        """
        self._check_replicating(leader_epoch)
        if offset <= self.leo:
            return
        plog = self.log

        def skip() -> int:  # writer thread
            plog.skip_gap(offset)
            plog.flush()
            return plog.durable_end_offset

        done: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        done.add_done_callback(self._gap_skipped)
        self.writer.submit_call(skip, done, log=plog)
        if self.matched_offset >= self.leo:  # the gap is the leader's, right after a matching prefix
            self.matched_offset = offset
        self.leo = offset
        self.advance_hwm(self._leader_hwm)

    def _check_replicating(self, leader_epoch: int) -> None:
        """Refuse a replicated write unless this is a follower in ``leader_epoch`` and not fenced (the
        errors of :meth:`append_replicated`)."""
        self._check_follower()
        if leader_epoch != self.leader_epoch:
            raise BrokerError.of("STALE_LEADER_EPOCH", current=self.leader_epoch, requested=leader_epoch)

    def _gap_skipped(self, done: asyncio.Future[object]) -> None:
        if done.cancelled():
            return
        error = done.exception()
        if error is not None:
            self.on_failure(error)
            return
        durable = done.result()
        assert isinstance(durable, int)
        self.on_durable(durable)

    def _stored_chunk(self, base_offset: int) -> bytes | None:
        """The chunk appended at exactly ``base_offset`` (in flight or durable), or ``None``."""
        if base_offset in self._inflight:
            return self._inflight[base_offset][1]
        if not self.log.log_start_offset <= base_offset < self.log.durable_end_offset:
            return None
        with contextlib.closing(self.log.iter_stored_chunks(base_offset)) as chunks:
            header, stored = next(chunks)
            return bytes(stored) if header.base_offset == base_offset else None

    def wait_hwm(self, end_offset: int) -> asyncio.Future[None]:
        """A future resolved once ``hwm >= end_offset`` (or failed if the partition gets fenced, deleted, or
        this leader becomes a follower or changes epoch)."""
        return self._wait(self._hwm_waiters, self.hwm, end_offset)

    def wait_durable(self, end_offset: int) -> asyncio.Future[None]:
        """A future resolved once this replica's ``durable_end_offset >= end_offset`` (acks=1; the acks=0
        byte budget release). Fails with ``storage_unavailable`` (fenced), ``topic_not_found`` (deleted)
        or ``NOT_LEADER`` (the leader became a follower: ``outcome=unknown``; or truncated the offsets as a new
        leader: plain, they are gone)."""
        return self._wait(self._durable_waiters, self.durable_end_offset, end_offset)

    def _wait(self, waiters: list[tuple[int, int, asyncio.Future[None]]], reached: int,
              end_offset: int) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if reached >= end_offset:
            fut.set_result(None)
        elif self.fenced is not None:
            fut.set_exception(self._fenced_error())
        elif self.role is not Role.LEADER:
            fut.set_exception(self._not_leader(outcome_unknown=True))
        else:
            self._waiter_seq += 1
            heapq.heappush(waiters, (end_offset, self._waiter_seq, fut))
        return fut

    def wait_committed(self, end_offset: int, isr: tuple[str, ...], min_isr: int = 1) -> asyncio.Future[None]:
        """acks=all: a future resolved once the visible (committed) HWM ``>= end_offset`` and every member
        of ``isr`` (the ISR captured at append) that is still in the ISR reported a durable end ``>=
        end_offset``, while the ISR holds at least ``min_isr`` members, all in the current leader epoch.

        A member the committed ISR dropped (a dead or lagging follower) is no longer waited for: it can
        never be elected, and the committed HWM already covers every remaining member (Kafka's rule). An
        ISR below ``min_isr`` keeps the request waiting (the caller's timeout answers outcome unknown).
        Fails with ``NOT_LEADER outcome=unknown`` (role or epoch change), ``storage_unavailable`` (fenced)
        or ``topic_not_found`` (deleted). No timeout: the caller bounds it."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        need = (tuple(isr), min_isr)
        if self.fenced is not None:
            fut.set_exception(self._fenced_error())
        elif self.role is not Role.LEADER:
            fut.set_exception(self._not_leader(outcome_unknown=True))
        elif self.hwm >= end_offset:
            self._check_members(end_offset, need, fut)
        else:
            self._waiter_seq += 1
            heapq.heappush(self._committed_waiters, (end_offset, self._waiter_seq, need, fut))
        return fut

    def _members_have(self, end_offset: int, need: tuple[tuple[str, ...], int]) -> bool:
        captured, min_isr = need
        if len(self.isr) < min_isr:
            return False
        ends, current = self._replica_ends, self.maximal_isr
        return all(ends.get(m, 0) >= end_offset for m in captured if m in current)

    def _check_members(self, end_offset: int, need: tuple[tuple[str, ...], int], fut: asyncio.Future[None]) -> None:
        if fut.done():
            return
        if self._members_have(end_offset, need):
            fut.set_result(None)
        else:
            self._member_waiters.append((end_offset, need, fut))

    # ------------------------------------------------------------------------------------ truncation

    def end_offset_for_epoch(self, epoch: int) -> EpochEnd:
        """OffsetsForLeaderEpoch as this replica answers it (Kafka semantics, see
        :func:`cursus.storage.epochs.end_offset_for_epoch`). A leader whose epoch has no chunk yet counts
        its epoch as starting at its first append of the epoch, or at the LEO before any.

        The log's history learns a new epoch only when the writer thread writes the epoch's first chunk;
        until then the loop's LEO already covers appends in flight, so counting the epoch from the LEO
        would answer that the previous epoch ends *after* this leader's own new records: a deposed
        leader's divergent record at the same offsets would look matching (Finding E: the follower's HWM
        passed its divergent record and the leader counted the follower's end in the candidate HWM)."""
        history = self.log.leader_epochs
        if self.role is Role.LEADER and (not history or history[-1][0] < self.leader_epoch):
            history.append((self.leader_epoch, self.leo if self._epoch_start is None else self._epoch_start))
        return end_offset_for_epoch(history, epoch, self.leo)

    def _check_follower(self) -> None:
        """Raise unless this replica is a follower that may change its log (replicated appends, truncation,
        restart): ``PARTITION_LEADER_FENCED`` (another role), ``storage_unavailable`` (fenced)."""
        if self.role is not Role.FOLLOWER:
            raise BrokerError.of("PARTITION_LEADER_FENCED", topic=self.topic, partition=self.partition,
                                 role=self.role.value)
        if self.fenced is not None:
            self.check_writable()

    def _submit_log_call(self, fn: Callable[[], object]) -> asyncio.Future[object]:
        """Run ``fn`` (a rewrite of the log) on the writer thread, after every append queued before it."""
        fut: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self.writer.submit_call(fn, fut, log=self.log)
        return fut

    async def _await_log_call(self, fut: asyncio.Future[object]) -> None:
        """Await a :meth:`_submit_log_call`; a failure fences the partition (``storage_unavailable``). Then
        the lineage check of replicated chunks resumes from the log's latest epoch."""
        try:
            await fut
        except Exception as error:
            self.on_failure(error)
            raise self._fenced_error() from error
        self._last_chunk_epoch = self.log.leader_epoch if self.log.leader_epochs else -1

    async def truncate_to(self, offset: int) -> None:
        """Drop every record at or above ``offset`` (a follower diverging from its leader). Follower only.
        The HWM drops to ``offset`` if it was above. Runs on the writer thread, after every append queued
        before it.

        Raises:
            BrokerError: ``PARTITION_LEADER_FENCED`` (not a follower), ``storage_unavailable``.
        """
        self._check_follower()
        if offset >= self.leo:
            return
        fut = self._submit_log_call(functools.partial(self.log.truncate_to, offset))
        self.leo = offset
        self.durable_end_offset = min(self.durable_end_offset, offset)
        self.hwm = min(self.hwm, offset)
        self.matched_offset = min(self.matched_offset, offset)
        self._inflight = {base: chunk for base, chunk in self._inflight.items() if base < offset}
        self._last_chunk_epoch = -1
        await self._await_log_call(fut)
        self._notify_progress()

    async def restart_at(self, offset: int) -> None:
        """Follower: the leader's log starts at ``offset``, above this log's end (retention deleted what this
        replica lacks, e.g. after its storage was lost): drop the local log and start it empty at
        ``offset`` (Kafka's follower handling of OFFSET_OUT_OF_RANGE). Every record below the leader's log
        start is committed and gone on the leader, so the HWM moves to ``offset`` too. Runs on the writer
        thread, after every append queued before it.

        Raises:
            BrokerError: ``PARTITION_LEADER_FENCED`` (not a follower), ``storage_unavailable``.
        """
        self._check_follower()
        if offset <= self.leo:
            return
        fut = self._submit_log_call(functools.partial(self.log.reset, offset))
        self.leo = self.durable_end_offset = self.hwm = self.matched_offset = offset
        self._inflight.clear()
        await self._await_log_call(fut)
        self.advance_hwm(self._leader_hwm)
        self._notify_progress()

    async def truncate_to_epoch(self, leader_answer: EpochEnd, committed_hwm: int | None = None
                                ) -> tuple[int, bool]:
        """Truncate after the leader answered OffsetsForLeaderEpoch for this replica's latest epoch
        (KIP-279, :func:`cursus.storage.epochs.truncation_offset`). Call it with no replicated append in
        flight. Returns ``(offset truncated to, complete)``; when not complete, ask the leader again with
        the latest local epoch.

        ``committed_hwm`` (cluster: the assignment's committed HWM from metadata) bounds it. The floor is
        ``min(local HWM, committed_hwm)``: every record below it is known committed (the local HWM only
        ever comes from an applied committed HWM; where metadata shows a lower committed HWM, the local one
        is provably too high -- a checkpoint from before the fix of the issue 13 anomaly -- and drops).
        The committed HWM alone is no floor: it may be far above this follower's LEO, and the records
        above the floor that differ from the leader's were never committed (a leader elected from the
        ISR holds every committed record). An undefined answer truncates to the floor (Kafka truncates to
        its HWM). A truncation below the floor (the leader would lack committed records), or one that
        would not shorten the log (asking again would get the same answer: a hot loop), is refused:
        nothing is truncated and the caller fails closed.

        Raises:
            TruncationRefused: ``storage_unavailable`` (below the floor, or no progress: the partition must
                stop replicating and be reported); nothing was truncated.
            BrokerError: see :meth:`truncate_to`.
        """
        floor = self.hwm if committed_hwm is None else min(self.hwm, committed_hwm)
        offset, complete = truncation_offset(self.log.leader_epochs, self.leo, leader_answer, floor)
        if committed_hwm is not None and (offset < floor or offset >= self.leo):
            why = (f"below the known committed offset {floor} (local HWM {self.hwm}, committed HWM "
                   f"{committed_hwm})" if offset < floor else "the truncation would not shorten the log")
            raise TruncationRefused.of("storage_unavailable", topic=self.topic, partition=self.partition,
                                       reason=f"refusing to truncate to {offset} (LEO {self.leo}, leader answer "
                                              f"epoch {leader_answer.epoch} end {leader_answer.end_offset}): {why}")
        if offset < self.hwm:
            log.warning("%s/%d: truncating to %d below the local HWM %d (committed HWM %s)", self.topic,
                        self.partition, offset, self.hwm, committed_hwm)
        await self.truncate_to(offset)
        return offset, complete

    # ------------------------------------------------------------------------- writer thread reports

    def on_durable(self, durable_end_offset: int) -> None:
        """The writer fsynced everything below ``durable_end_offset`` (loop thread). Clamped to the LEO: a
        report from before a truncation that the loop already applied must not resurrect dropped offsets."""
        durable_end_offset = min(durable_end_offset, self.leo)
        if durable_end_offset <= self.durable_end_offset:
            return
        self.durable_end_offset = durable_end_offset
        if self._inflight:
            self._inflight = {base: entry for base, entry in self._inflight.items() if entry[0] > durable_end_offset}
        waiters = self._durable_waiters
        while waiters and waiters[0][0] <= durable_end_offset:
            _, _, fut = heapq.heappop(waiters)
            if not fut.done():
                fut.set_result(None)
        if self.role is Role.LEADER:
            self._replica_ends[self.broker_id] = durable_end_offset
            self._member_progress()
            self._candidate_changed()
        self._notify_progress()

    @property
    def wants_written(self) -> bool:
        """Whether :meth:`on_written` would do anything (a leader with progress listeners). Read by the
        writer thread to skip waking the loop for nobody; a listener added meanwhile still hears the fsync."""
        return self.role is Role.LEADER and bool(self._progress_listeners)

    def on_written(self) -> None:
        """The writer wrote (not yet fsynced) appends of this replica (loop thread): a leader wakes the
        followers' long polls, which may serve written chunks before they are durable here."""
        if self.role is Role.LEADER:
            self._notify_progress()

    def update_replica_end(self, replica_id: str, end_offset: int) -> None:
        """Record a replica's durable end (leader only; a follower's fetch offset). The candidate HWM is the
        minimum over the maximal ISR."""
        if self.role is not Role.LEADER:
            return
        if self._replica_ends.get(replica_id) == end_offset:
            return
        self._replica_ends[replica_id] = end_offset
        self._member_progress()
        self._candidate_changed()

    def _member_progress(self) -> None:
        if not self._member_waiters:
            return
        waiting = []
        for end, need, fut in self._member_waiters:
            if fut.done():
                continue
            if self._members_have(end, need):
                fut.set_result(None)
            else:
                waiting.append((end, need, fut))
        self._member_waiters = waiting

    def leader_matches(self, offset: int) -> None:
        """Follower: the leader accepted a fetch at ``offset`` with this log's epoch lineage (no divergence),
        so every local record below ``offset`` is the leader's: the committed HWM may cover them now."""
        if self.role is Role.FOLLOWER and offset > self.matched_offset:
            self.matched_offset = min(offset, self.leo)
            self.advance_hwm(self._leader_hwm)

    def advance_hwm(self, hwm: int) -> None:
        """Move the visible HWM forward (never backward), resolve acks waiters and wake readers.

        A leader's HWM never passes its LEO (an assertion). A follower learns the HWM from its leader (or
        from the applied metadata), which may be ahead of the local log: it is remembered and the local
        HWM is clamped to :attr:`matched_offset`, never to the bare LEO: a deposed leader's local tail
        above the point where its log diverges from the new leader's is not committed, whatever the
        committed HWM says (issue 13 anomaly: such an HWM, checkpointed, survived a restart above the HWM
        the new leader was elected with).
        """
        if self.role is Role.FOLLOWER:
            self._leader_hwm = max(self._leader_hwm, hwm)
            hwm = min(hwm, self.matched_offset)
        if hwm <= self.hwm:
            return
        assert hwm <= self.leo, (hwm, self.leo)
        self.hwm = hwm
        self.log.set_hwm(hwm)
        while self._hwm_waiters and self._hwm_waiters[0][0] <= hwm:
            _, _, fut = heapq.heappop(self._hwm_waiters)
            if not fut.done():
                fut.set_result(None)
        while self._committed_waiters and self._committed_waiters[0][0] <= hwm:
            end, _, need, cfut = heapq.heappop(self._committed_waiters)
            self._check_members(end, need, cfut)
        self._wake_readers()
        if self.on_hwm_change is not None:
            self.on_hwm_change(self)
        self._notify_progress()

    def on_failure(self, error: BaseException) -> None:
        """A write or fsync failed: fence the partition and fail every waiter. Never retried."""
        if self.deleted:
            return
        self.role = next_role(self.role, Event.FENCE)
        if self.fenced is None:
            self.fenced = error
        self._fail_waiters(self._fenced_error())
        self._notify_progress()

    def on_deleted(self, *, replaced: bool = False) -> None:
        """The topic was deleted, or this replica is *replaced* (``replaced``: the topic still exists under a
        new generation, a TRUNCATE or a DELETE and re-CREATE applied at once): refuse appends, fail
        waiters, wake long polls. Waiters and requests then answer :meth:`removed_error`."""
        self._replaced = replaced
        self.role = next_role(self.role, Event.DELETE)
        if self.fenced is None:
            self.fenced = self.removed_error()
        self._fail_waiters(self._fenced_error())
        self._wake_readers()
        self._notify_progress()

    def _wake_readers(self) -> None:
        event, self._data_event = self._data_event, None
        if event is not None:
            event.set()

    def _fail_waiters(self, error: BrokerError, *, durable: bool = True, committed_hwm: int | None = None) -> None:
        """Fail HWM and acks=all waiters, and durable waiters unless ``durable`` is False, on a role or epoch
        change: see :meth:`_lost_error` (``committed_hwm``)."""
        waiters, self._hwm_waiters = self._hwm_waiters, []
        if durable:
            waiters += self._durable_waiters
            self._durable_waiters = []
        for end, _, fut in waiters:
            if not fut.done():
                fut.set_exception(self._lost_error(error, end, committed_hwm))
        self._fail_committed_waiters(error, committed_hwm=committed_hwm)

    def _fail_committed_waiters(self, error: BrokerError, *, committed_hwm: int | None = None) -> None:
        committed, self._committed_waiters = self._committed_waiters, []
        members, self._member_waiters = self._member_waiters, []
        for end, fut in [(w[0], w[3]) for w in committed] + [(w[0], w[2]) for w in members]:
            if not fut.done():
                fut.set_exception(self._lost_error(error, end, committed_hwm))

    def _lost_error(self, error: BrokerError, end: int, committed_hwm: int | None) -> BrokerError:
        """The answer of a waiter for records below ``end`` (appended here) when the partition moves:
        ``error`` (a definite refusal) when ``end`` is above ``committed_hwm``, the committed HWM of the
        assignment that moved it (the next leader truncates everything above it: the records are gone);
        else, or without ``committed_hwm``, ``error`` with ``outcome=unknown`` (the records may be committed:
        a client that resent them without idempotence would duplicate them). Only ``NOT_LEADER`` is
        qualified; other errors pass unchanged."""
        if error.error.code != "NOT_LEADER":
            return error
        if committed_hwm is not None and end > max(committed_hwm, self.hwm):
            return error
        return self._not_leader(outcome_unknown=True)

    def _fail_durable_above(self, offset: int) -> None:
        """A new leader truncated at ``offset``: durable waiters beyond it can never complete here."""
        keep = []
        for entry in self._durable_waiters:
            if entry[0] > offset:
                if not entry[2].done():
                    entry[2].set_exception(self._not_leader())
            else:
                keep.append(entry)
        heapq.heapify(keep)
        self._durable_waiters = keep

    def removed_error(self, *, outcome_unknown: bool = False) -> BrokerError:
        """The answer of a request for this replica after :meth:`on_deleted`: ``topic_not_found`` when the
        topic is gone; when it was replaced by a new generation (TRUNCATE, a DELETE and re-CREATE),
        ``leader_not_available`` (retryable: the new generation's replica serves a retry), with
        ``outcome=unknown`` for a write waiting for its acknowledgement (``outcome_unknown``): its records
        may have been appended, even committed, before the reset removed them, so neither success nor a
        definite failure can be reported."""
        if not self._replaced:
            return BrokerError.of("topic_not_found", topic=self.topic)
        fields: dict[str, object] = {"topic": self.topic, "partition": self.partition,
                                     "reason": "the topic was reset to a new lifecycle epoch"}
        if outcome_unknown:
            fields["outcome"] = "unknown"
            fields["reason"] = ("the topic was reset to a new lifecycle epoch; records appended before the "
                                "reset are not in it")
        return BrokerError.of("leader_not_available", **fields)

    def _fenced_error(self) -> BrokerError:
        if self.deleted:
            return self.removed_error(outcome_unknown=True)
        return BrokerError.of(
            "storage_unavailable", topic=self.topic, partition=self.partition,
            reason="write or fsync failed; outcome of unacknowledged records is unknown",
        )

    # ---------------------------------------------------------------------------------------- reads

    async def wait_for_data(self, offset: int, timeout_s: float) -> None:
        """Wait until ``hwm > offset`` or ``timeout_s`` passes (long poll). Event driven, no polling."""
        if self.hwm > offset or timeout_s <= 0:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.hwm <= offset and self.fenced is None and not self.deleted:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            try:
                if self._data_event is None:
                    self._data_event = asyncio.Event()
                await asyncio.wait_for(self._data_event.wait(), remaining)
            except TimeoutError:
                return
