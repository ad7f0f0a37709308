"""A partition replica as the event loop sees it: role, leader epoch, offsets, HWM and waiters.

The role (:mod:`cursus.broker.replica_role`) comes from metadata: :meth:`Replica.become_leader` and
:meth:`Replica.become_follower` carry the leader epoch. Standalone is a cluster of one: the broker makes
every replica the leader of a one-member ISR, so the HWM is our own durable end offset.

* **Leader**: appends client batches stamped with its leader epoch; HWM = min durable end over the ISR
  (follower progress arrives through :meth:`Replica.update_replica_end`).
* **Follower**: refuses client appends (``NOT_LEADER``); appends the leader's chunks as stored
  (:meth:`Replica.append_replicated`); learns the HWM from the leader (clamped to the local LEO); truncates
  by leader-epoch lineage (:meth:`Replica.truncate_to_epoch`, KIP-279).

Offsets (all half-open, Kafka style):

* ``log_start_offset`` <= ``hwm`` <= ``leo`` and ``durable_end_offset`` <= ``leo``; on a leader also
  ``hwm`` <= ``durable_end_offset``;
* ``leo`` counts records handed to the writer thread (assigned, maybe not yet written);
* ``durable_end_offset`` counts records fsynced;
* ``hwm`` is the first offset consumers may not read yet. At open it is the log's checkpointed HWM (never
  the durable end, which would expose uncommitted records in a cluster); a leader then moves it to the min
  durable end over its ISR.

Thread-safety: loop thread only. The writer thread reports back through the broker, which calls
:meth:`on_durable` / :meth:`on_failure` on the loop thread and resolves future tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
from collections.abc import Callable

from cursus.broker.replica_role import Event, Role, check_epoch, next_role
from cursus.storage import GroupCommitWriter, PartitionLog
from cursus.storage.chunk import HEADER_SIZE, crc_matches, decode_header, records_walk_ok
from cursus.storage.epochs import EpochEnd, end_offset_for_epoch, truncation_offset
from cursus.wire.errors import BrokerError


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
        self._replica_ends: dict[str, int] = {}
        #: Follower: the last HWM the leader reported (the local HWM is that, clamped to the LEO).
        self._leader_hwm = 0
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
        self._progress_listeners: list[Callable[[Replica], None]] = []

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
            BrokerError: ``topic_not_found`` (deleted), ``storage_unavailable`` (fenced), ``NOT_LEADER``
                (a follower, or no role yet).
        """
        if self.deleted:
            raise BrokerError.of("topic_not_found", topic=self.topic)
        if self.fenced is not None:
            raise BrokerError.of(
                "storage_unavailable", topic=self.topic, partition=self.partition,
                reason="partition fenced after a storage error; restart the broker",
            )
        if self.role is not Role.LEADER:
            raise self._not_leader()

    def _not_leader(self) -> BrokerError:
        return BrokerError.of("NOT_LEADER", topic=self.topic, partition=self.partition, leader=self.leader_id)

    # ---------------------------------------------------------------------------------------- roles

    def become_leader(self, leader_epoch: int, isr: tuple[str, ...] | None = None) -> None:
        """Lead the partition in ``leader_epoch`` with ``isr`` (default: this broker alone). Re-applying the
        current epoch only updates the ISR. The HWM moves to the min durable end over the ISR.

        Raises:
            TransitionRefused: fenced or deleted, or ``leader_epoch`` is below the current epoch.
        """
        members = isr if isr is not None else (self.broker_id,)
        assert self.broker_id in members, (self.broker_id, members)
        if check_epoch(self.role, Event.BECOME_LEADER, self.leader_epoch, leader_epoch):
            self.role = next_role(self.role, Event.BECOME_LEADER)
            self.leader_epoch = leader_epoch
            self.leader_id = self.broker_id
            self._inflight.clear()
            self._replica_ends = {self.broker_id: self.durable_end_offset}
        self.isr = tuple(members)
        self._advance_to_isr_min()
        self._notify_progress()

    def become_follower(self, leader_epoch: int, leader_id: str) -> None:
        """Follow ``leader_id`` in ``leader_epoch``. Client appends are refused from now on; acks still
        waiting on this replica fail with ``NOT_LEADER`` (their outcome is unknown: the new leader decides).

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
        self.isr = ()
        self._replica_ends = {}
        self._leader_hwm = self.hwm
        self._fail_waiters(self._not_leader())
        self._notify_progress()

    # --------------------------------------------------------------------------------------- append

    def append(self, body: bytearray | bytes | memoryview, record_count: int) -> int:
        """Hand one client chunk (offsets already stamped at :attr:`leo`) to the writer thread, stamped
        with this leader's epoch. Leader only.

        Returns the chunk's base offset. The caller awaits :meth:`wait_hwm` for acks=1/all.

        Raises:
            BrokerError: see :meth:`check_writable`.
        """
        self.check_writable()
        assert record_count > 0
        base_offset = self.leo
        self.leo += record_count
        self._last_chunk_epoch = self.leader_epoch
        self.writer.submit_append(self.log, base_offset, record_count, body, self, leader_epoch=self.leader_epoch)
        return base_offset

    def append_replicated(self, chunk: bytes, leader_epoch: int) -> int:
        """Append one chunk fetched from the leader of ``leader_epoch``, as the leader stored it (header
        included: its base offset, leader epoch and append time are kept, so the stored bytes are
        identical). Follower only. Returns the offset after the chunk.

        A chunk at the LEO is appended. A chunk identical to one already appended (or in flight) at its
        offset is a no-op (a retried fetch). Anything else is refused, nothing is appended.

        Raises:
            BrokerError: ``PARTITION_LEADER_FENCED`` (not a follower), ``STALE_LEADER_EPOCH`` (a fetch
                from another leader epoch), ``corrupt_log_data`` (not one whole valid chunk, or its epoch
                breaks the lineage), ``OFFSET_OUT_OF_RANGE`` (a gap after the LEO), ``version_conflict``
                (other bytes at an existing offset: truncate by epoch first), ``storage_unavailable``.
        """
        if self.role is not Role.FOLLOWER:
            raise BrokerError.of("PARTITION_LEADER_FENCED", topic=self.topic, partition=self.partition,
                                 role=self.role.value)
        if leader_epoch != self.leader_epoch:
            raise BrokerError.of("STALE_LEADER_EPOCH", current=self.leader_epoch, requested=leader_epoch)
        if self.fenced is not None:
            self.check_writable()
        header = decode_header(chunk, 0)
        if (header is None or header.size_bytes != len(chunk) or not crc_matches(chunk, 0, header)
                or not records_walk_ok(memoryview(chunk)[HEADER_SIZE:], header.record_count)):
            raise BrokerError.of("corrupt_log_data", topic=self.topic, partition=self.partition,
                                 reason="replicated bytes are not one valid chunk")
        if header.base_offset < self.leo:
            if self._stored_chunk(header.base_offset) == chunk:
                return header.next_offset
            raise BrokerError.of("version_conflict", topic=self.topic, partition=self.partition,
                                 offset=header.base_offset,
                                 reason="other bytes are stored at this offset; truncate by leader epoch first")
        if header.base_offset > self.leo:
            raise BrokerError.of("OFFSET_OUT_OF_RANGE", requested=header.base_offset,
                                 earliest=self.log_start_offset, latest=self.leo)
        if not self._last_chunk_epoch <= header.leader_epoch <= leader_epoch:
            raise BrokerError.of("corrupt_log_data", topic=self.topic, partition=self.partition,
                                 offset=header.base_offset,
                                 reason=f"chunk leader epoch {header.leader_epoch} outside "
                                        f"[{self._last_chunk_epoch}, {leader_epoch}]")
        self.leo = header.next_offset
        self._last_chunk_epoch = header.leader_epoch
        self._inflight[header.base_offset] = (header.next_offset, chunk)
        self.writer.submit_append(self.log, header.base_offset, header.record_count, chunk[HEADER_SIZE:], self,
                                  leader_epoch=header.leader_epoch, append_time_ms=header.append_time_ms)
        self.advance_hwm(self._leader_hwm)
        return header.next_offset

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
        this leader becomes a follower)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.hwm >= end_offset:
            fut.set_result(None)
        elif self.fenced is not None:
            fut.set_exception(self._fenced_error())
        elif self.role is not Role.LEADER:
            fut.set_exception(self._not_leader())
        else:
            self._waiter_seq += 1
            heapq.heappush(self._hwm_waiters, (end_offset, self._waiter_seq, fut))
        return fut

    # ------------------------------------------------------------------------------------ truncation

    def end_offset_for_epoch(self, epoch: int) -> EpochEnd:
        """OffsetsForLeaderEpoch as this replica answers it (Kafka semantics, see
        :func:`cursus.storage.epochs.end_offset_for_epoch`). A leader whose epoch has no chunk yet counts
        its epoch as starting at the LEO."""
        history = self.log.leader_epochs
        if self.role is Role.LEADER and (not history or history[-1][0] < self.leader_epoch):
            history.append((self.leader_epoch, self.leo))
        return end_offset_for_epoch(history, epoch, self.leo)

    async def truncate_to(self, offset: int) -> None:
        """Drop every record at or above ``offset`` (a follower diverging from its leader). Follower only.
        The HWM drops to ``offset`` if it was above. Runs on the writer thread, after every append queued
        before it.

        Raises:
            BrokerError: ``PARTITION_LEADER_FENCED`` (not a follower), ``storage_unavailable``.
        """
        if self.role is not Role.FOLLOWER:
            raise BrokerError.of("PARTITION_LEADER_FENCED", topic=self.topic, partition=self.partition,
                                 role=self.role.value)
        if self.fenced is not None:
            self.check_writable()
        if offset >= self.leo:
            return
        fut: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self.writer.submit_call(lambda: self.log.truncate_to(offset), fut, log=self.log)
        self.leo = offset
        self.durable_end_offset = min(self.durable_end_offset, offset)
        self.hwm = min(self.hwm, offset)
        self._inflight = {base: chunk for base, chunk in self._inflight.items() if base < offset}
        self._last_chunk_epoch = -1
        try:
            await fut
        except Exception as error:
            self.on_failure(error)
            raise self._fenced_error() from error
        self._last_chunk_epoch = self.log.leader_epoch if self.log.leader_epochs else -1

    async def truncate_to_epoch(self, leader_answer: EpochEnd) -> tuple[int, bool]:
        """Truncate after the leader answered OffsetsForLeaderEpoch for this replica's latest epoch
        (KIP-279, :func:`cursus.storage.epochs.truncation_offset`). Call it with no replicated append in
        flight. Returns ``(offset truncated to, complete)``; when not complete, ask the leader again with
        the latest local epoch.

        Raises:
            BrokerError: see :meth:`truncate_to`.
        """
        offset, complete = truncation_offset(self.log.leader_epochs, self.leo, leader_answer, self.hwm)
        await self.truncate_to(offset)
        return offset, complete

    # ------------------------------------------------------------------------- writer thread reports

    def on_durable(self, durable_end_offset: int) -> None:
        """The writer fsynced everything below ``durable_end_offset`` (loop thread)."""
        if durable_end_offset <= self.durable_end_offset:
            return
        self.durable_end_offset = durable_end_offset
        if self._inflight:
            self._inflight = {base: entry for base, entry in self._inflight.items() if entry[0] > durable_end_offset}
        if self.role is Role.LEADER:
            self.update_replica_end(self.broker_id, durable_end_offset)
        self._notify_progress()

    def update_replica_end(self, replica_id: str, end_offset: int) -> None:
        """Record a replica's durable end (leader only); the HWM is the minimum over the ISR."""
        if self.role is not Role.LEADER:
            return
        self._replica_ends[replica_id] = end_offset
        self._advance_to_isr_min()

    def _advance_to_isr_min(self) -> None:
        if self.role is Role.LEADER:
            self.advance_hwm(min(self._replica_ends.get(r, 0) for r in self.isr))

    def advance_hwm(self, hwm: int) -> None:
        """Move the HWM forward (never backward), resolve acks waiters and wake readers.

        A leader's HWM never passes its LEO (an assertion: it is the min durable end over the ISR). A
        follower learns the HWM from its leader, which may be ahead of the local log: it is remembered and
        the local HWM is clamped to the local LEO.
        """
        if self.role is Role.FOLLOWER:
            self._leader_hwm = max(self._leader_hwm, hwm)
            hwm = min(hwm, self.leo)
        if hwm <= self.hwm:
            return
        assert hwm <= self.leo, (hwm, self.leo)
        self.hwm = hwm
        self.log.set_hwm(hwm)
        while self._hwm_waiters and self._hwm_waiters[0][0] <= hwm:
            _, _, fut = heapq.heappop(self._hwm_waiters)
            if not fut.done():
                fut.set_result(None)
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

    def on_deleted(self) -> None:
        """The topic was deleted: refuse appends, fail waiters, wake long polls."""
        self.role = next_role(self.role, Event.DELETE)
        if self.fenced is None:
            self.fenced = BrokerError.of("topic_not_found", topic=self.topic)
        self._fail_waiters(self._fenced_error())
        self._wake_readers()
        self._notify_progress()

    def _wake_readers(self) -> None:
        event, self._data_event = self._data_event, None
        if event is not None:
            event.set()

    def _fail_waiters(self, error: BrokerError) -> None:
        waiters, self._hwm_waiters = self._hwm_waiters, []
        for _, _, fut in waiters:
            if not fut.done():
                fut.set_exception(error)

    def _fenced_error(self) -> BrokerError:
        if self.deleted:
            return BrokerError.of("topic_not_found", topic=self.topic)
        return BrokerError.of(
            "storage_unavailable", topic=self.topic, partition=self.partition,
            reason="write or fsync failed; outcome of unacknowledged records is unknown",
        )

    # --------------------------------------------------------------------------- progress listeners

    def add_progress_listener(self, fn: Callable[[Replica], None]) -> None:
        """Call ``fn(self)`` on the loop thread whenever the durable end offset, the HWM, the role or the
        leader epoch changes (a leader's replication long poll, a follower waiting for its fsync). ``fn``
        must be quick and must not raise."""
        self._progress_listeners.append(fn)

    def remove_progress_listener(self, fn: Callable[[Replica], None]) -> None:
        """Stop calling ``fn`` (no-op when it is not registered)."""
        with contextlib.suppress(ValueError):
            self._progress_listeners.remove(fn)

    def _notify_progress(self) -> None:
        for fn in tuple(self._progress_listeners):
            fn(self)

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
