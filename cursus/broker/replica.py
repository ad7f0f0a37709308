"""A partition replica as the event loop sees it: offsets, HWM, leader epoch and waiters.

Every partition is a replica with a leader epoch, LEO and HWM from the start; standalone is a cluster of one,
so the ISR is this broker alone and the HWM is the minimum durable end offset over the ISR, which is simply
our own durable end offset. The cluster issues plug follower progress into :meth:`Replica.advance_hwm`
without a second code path.

Offsets (all half-open, Kafka style):

* ``log_start_offset`` <= ``hwm`` <= ``durable_end_offset`` <= ``leo``
* ``leo`` counts records handed to the writer thread (assigned, maybe not yet written);
* ``durable_end_offset`` counts records fsynced;
* ``hwm`` is the first offset consumers may not read yet.

Thread-safety: loop thread only. The writer thread reports back through the broker, which calls
:meth:`on_durable` / :meth:`on_failure` on the loop thread.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable

from cursus.storage import GroupCommitWriter, PartitionLog
from cursus.wire.errors import BrokerError


class Replica:
    """Loop-side state of one partition replica backed by a :class:`PartitionLog`."""

    def __init__(self, topic: str, partition: int, log: PartitionLog, writer: GroupCommitWriter,
                 *, broker_id: str = "standalone") -> None:
        self.topic = topic
        self.partition = partition
        self.log = log
        self.writer = writer
        self.broker_id = broker_id
        self.leo = log.log_end_offset
        self.durable_end_offset = log.durable_end_offset
        self.leader_epoch = log.leader_epoch
        #: The in-sync replica set; standalone: just this broker.
        self.isr: tuple[str, ...] = (broker_id,)
        self._replica_ends: dict[str, int] = {broker_id: self.durable_end_offset}
        self.hwm = self.durable_end_offset
        self.fenced: BaseException | None = log.failed
        self.deleted = False
        # A heap of (end_offset, seq, future) waiting for hwm >= end_offset.
        self._hwm_waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._waiter_seq = 0
        self._data_event = asyncio.Event()
        self.on_hwm_change: Callable[[Replica], None] | None = None

    # ------------------------------------------------------------------------------------ properties

    @property
    def log_start_offset(self) -> int:
        return self.log.log_start_offset

    def check_writable(self) -> None:
        """Raise ``storage_unavailable`` if a write or fsync error fenced this partition."""
        if self.deleted:
            raise BrokerError.of("topic_not_found", topic=self.topic)
        if self.fenced is not None:
            raise BrokerError.of(
                "storage_unavailable", topic=self.topic, partition=self.partition,
                reason="partition fenced after a storage error; restart the broker",
            )

    # --------------------------------------------------------------------------------------- append

    def append(self, body: bytearray | bytes | memoryview, record_count: int) -> int:
        """Hand one chunk (offsets already stamped at :attr:`leo`) to the writer thread.

        Returns the chunk's base offset. The caller awaits :meth:`wait_hwm` for acks=1/all.

        Raises:
            BrokerError: ``storage_unavailable`` when the partition is fenced.
        """
        self.check_writable()
        assert record_count > 0
        base_offset = self.leo
        self.leo += record_count
        self.writer.submit_append(self.log, base_offset, record_count, body, self)
        return base_offset

    def wait_hwm(self, end_offset: int) -> asyncio.Future[None]:
        """A future resolved once ``hwm >= end_offset`` (or failed if the partition gets fenced)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.hwm >= end_offset:
            fut.set_result(None)
        elif self.fenced is not None:
            fut.set_exception(self._fenced_error())
        else:
            self._waiter_seq += 1
            heapq.heappush(self._hwm_waiters, (end_offset, self._waiter_seq, fut))
        return fut

    # ------------------------------------------------------------------------- writer thread reports

    def on_durable(self, durable_end_offset: int) -> None:
        """The writer fsynced everything below ``durable_end_offset`` (loop thread)."""
        if durable_end_offset <= self.durable_end_offset:
            return
        self.durable_end_offset = durable_end_offset
        self.update_replica_end(self.broker_id, durable_end_offset)

    def update_replica_end(self, replica_id: str, end_offset: int) -> None:
        """Record a replica's durable end; the HWM is the minimum over the ISR."""
        self._replica_ends[replica_id] = end_offset
        self.advance_hwm(min(self._replica_ends.get(r, 0) for r in self.isr))

    def advance_hwm(self, hwm: int) -> None:
        """Move the HWM forward (never backward), resolve acks waiters and wake readers."""
        if hwm <= self.hwm:
            return
        assert hwm <= self.leo, (hwm, self.leo)
        self.hwm = hwm
        self.log.set_hwm(hwm)
        while self._hwm_waiters and self._hwm_waiters[0][0] <= hwm:
            _, _, fut = heapq.heappop(self._hwm_waiters)
            if not fut.done():
                fut.set_result(None)
        self._data_event.set()
        self._data_event = asyncio.Event()
        if self.on_hwm_change is not None:
            self.on_hwm_change(self)

    def on_failure(self, error: BaseException) -> None:
        """A write or fsync failed: fence the partition and fail every waiter. Never retried."""
        if self.fenced is None:
            self.fenced = error
        waiters, self._hwm_waiters = self._hwm_waiters, []
        for _, _, fut in waiters:
            if not fut.done():
                fut.set_exception(self._fenced_error())

    def on_deleted(self) -> None:
        """The topic was deleted: refuse appends, fail waiters, wake long polls."""
        self.deleted = True
        self.on_failure(BrokerError.of("topic_not_found", topic=self.topic))
        self._data_event.set()

    def _fenced_error(self) -> BrokerError:
        if self.deleted:
            return BrokerError.of("topic_not_found", topic=self.topic)
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
                await asyncio.wait_for(self._data_event.wait(), remaining)
            except TimeoutError:
                return
