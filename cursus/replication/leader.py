"""The leader side of the follower-pull fetch protocol: answer FetchRequests from local leader replicas.

One :class:`LeaderFetchService` per broker serves every follower's fetch stream
(``Replication.Fetch``, see ``proto/cursus/internal/v1/replication.proto``). Per partition of a request:

1. **fencing** (design-13 "Fencing"): unknown partition -> ``partition_metadata_not_found``; not the
   leader here -> ``NOT_PARTITION_LEADER leader= requested_leader=``; the follower's leader epoch below
   ours -> ``STALE_LEADER_EPOCH current= requested=``; above ours (we have not applied our deposition) or
   another lifecycle epoch -> ``PARTITION_LEADER_FENCED``. A follower that is not a replica of the partition
   -> ``internal_command_unauthorized``.
2. **divergence** (KIP-320): ``end_offset_for_epoch(last_fetched_epoch)``; when the leader does not have
   that epoch, or it ended below ``fetch_offset``, the answer is ``diverging_epoch`` (no chunks).
3. **progress**: the fetch offset is the follower's durable LEO: ``Replica.update_replica_end`` (the
   HWM) and the :class:`IsrTracker` (ISR shrink/expand) learn it.
4. **read**: whole stored chunks (header included, byte for byte) from ``fetch_offset`` below the leader's
   written end (``PartitionLog.replicable_end_offset``: not yet fsynced chunks too, so a follower's fetch
   overlaps the leader's fsync; the HWM still needs the leader's own durable end), at most ``partition_max_bytes`` per partition and ``response_max_bytes`` per
   response (the first chunk of a partition may exceed the bound, so progress is always possible). The
   start partition rotates between responses so a catching-up partition cannot starve the others. Reads
   run through ``run_blocking`` (the broker's offload pool for large reads).
5. **gaps**: every answer with chunks or none says whether this log has cleaned segments
   (``cleaned_gaps``, ``PartitionLog.has_compacted_segments`` sampled after the read: once a read served
   a chunk after a gap it stays true, short of a reset). The follower accepts a gap only then: the
   permission follows the log, not the topic's current cleanup policy (a topic switched from compact to
   delete keeps its gaps). A fetch offset in a gap the cleaner left at the end of the log (no chunk up to
   the written end) is answered with ``skip_to`` = that end, so the follower reaches the leader's LEO
   without waiting for the next append (:func:`trailing_gap_end`).
6. **long poll**: when no partition has chunks, an error, a divergence or a new HWM for this follower,
   the request waits (progress listeners of the replicas + an ``asyncio.Event``) up to ``max_wait_ms``.

:meth:`LeaderFetchService.maintain` turns the tracker's decisions into ``ChangeIsr`` metadata commands.
Loop thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cursus.broker.replica import Replica
from cursus.broker.replica_role import Role
from cursus.internal.v1 import replication_pb2 as pb
from cursus.metadata.commands import ChangeIsr
from cursus.metadata.state import PartitionAssignment
from cursus.replication.convert import epoch_end_to_pb, error_to_pb
from cursus.replication.isr import IsrChange, IsrTracker
from cursus.storage import PartitionLog
from cursus.storage.chunk import ChunkHeader
from cursus.storage.epochs import EpochEnd
from cursus.storage.errors import CorruptLogError, OffsetOutOfRange
from cursus.wire.errors import BrokerError

log = logging.getLogger(__name__)

PartitionKey = tuple[str, int]
#: ``run_blocking(size_bytes, fn) -> fn()``: the shape of :meth:`cursus.broker.offload.Offload.run`.
RunBlocking = Callable[[int, Callable[[], Any]], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class LeaderFetchConfig:
    """Leader-side bounds and timers.

    Attributes:
        partition_max_bytes: chunk bytes per partition per response (``replica_fetch_max_bytes``); a
            request's smaller ``max_bytes`` wins.
        response_max_bytes: chunk bytes per response (``replica_fetch_response_max_bytes``); a request's
            smaller ``max_bytes`` wins.
        max_wait_ms: cap of a request's long poll (milliseconds).
        lag_time_max_ms: ``replica_lag_time_max_ms``: an ISR member not caught up for longer is shrunk.
        isr_check_interval_ms: period of :meth:`LeaderFetchService.maintain_forever`.
    """

    partition_max_bytes: int = 1 << 20
    response_max_bytes: int = 8 << 20
    max_wait_ms: int = 500
    lag_time_max_ms: int = 10_000
    isr_check_interval_ms: int = 1_000


class LeaderObserver:
    """Metrics hooks of the leader service (no-ops; the broker subclasses it)."""

    def chunk_bytes_out(self, follower_id: str, key: PartitionKey, size_bytes: int) -> None:
        """``size_bytes`` of chunks of ``key`` were put in a response to ``follower_id``."""

    def isr_change_proposed(self, key: PartitionKey, change: IsrChange) -> None:
        """A ``ChangeIsr`` for ``key`` is being submitted."""


async def run_inline(size_bytes: int, fn: Callable[[], Any]) -> Any:
    """A :data:`RunBlocking` that runs ``fn`` on the loop (tests, tiny reads)."""
    return fn()


def read_stored_chunks(partition_log: PartitionLog, offset: int, end_offset: int, max_bytes: int
                       ) -> tuple[bytes, ChunkHeader | None]:
    """Whole stored chunks from the one holding ``offset`` up to ``end_offset`` (a written chunk boundary,
    fsynced or not),
    at most ``max_bytes`` unless the first chunk alone is larger. Returns ``(chunk bytes, first header)``;
    when the first chunk does not start at ``offset`` no bytes are returned (the caller answers a
    divergence) -- unless ``offset`` lies in a gap of a cleaned segment (the chunks after it are served). Any thread (``iter_stored_chunks`` pins the segments it reads).

    Raises:
        OffsetOutOfRange: ``offset`` is no longer (or not yet) in the durable log.
        CorruptLogError: a stored chunk failed its checksum.
        OSError: the segment files went away (deletion) or the disk failed.
    """
    out = bytearray()
    first: ChunkHeader | None = None
    with contextlib.closing(partition_log.iter_stored_chunks(offset, written=True)) as chunks:
        for header, chunk in chunks:
            if header.next_offset > end_offset:
                break
            if first is None:
                first = header
                # inside a chunk (not a boundary of this log): the caller answers a divergence; a chunk
                # after ``offset`` in a log with cleaned segments is the next one after a gap: served as is
                if header.base_offset < offset or (header.base_offset > offset
                                                   and not partition_log.has_compacted_segments()):
                    return b"", first
            elif len(out) + header.size_bytes > max_bytes:
                break
            out += chunk
            if len(out) >= max_bytes:
                break
    return bytes(out), first


def trailing_gap_end(partition_log: PartitionLog, offset: int, end_offset: int) -> int | None:
    """``end_offset`` when ``offset < end_offset`` lies in a gap the cleaner left at the end of the log: the log
    has cleaned segments and stores no chunk in ``[offset, end_offset)``; else None. Any thread.

    Raises:
        OffsetOutOfRange, CorruptLogError, OSError: as :func:`read_stored_chunks`.
    """
    if not offset < end_offset or not partition_log.has_compacted_segments():
        return None
    with contextlib.closing(partition_log.iter_stored_chunks(offset, written=True)) as chunks:
        for header, _ in chunks:
            return None if header.base_offset < end_offset else end_offset
    return end_offset


@dataclass(slots=True)
class _Slot:
    """One partition of one request: its answer so far."""

    part: pb.PartitionFetch
    key: PartitionKey
    #: An answer that needs no read (an error or a divergence) and ends the long poll.
    final: pb.PartitionData | None = None


class LeaderFetchService:
    """Answers follower fetches from the local leader replicas, and proposes ISR changes.

    Args:
        replicas_lookup: ``() -> {(topic, partition): Replica}``, the broker's local replicas.
        assignment_lookup: ``(topic, partition) -> PartitionAssignment | None`` from applied metadata
            (replicas, ISR, leader epoch, lifecycle epoch, committed HWM).
        tracker: the ISR tracker (its ``leader_id`` is this broker's id).
        config: bounds and timers.
        clock: monotonic milliseconds (ISR lag).
        submit_isr_change: ``async (ChangeIsr) -> result``: propose the command through metadata (raises
            on refusal; the next :meth:`maintain` decides again).
        run_blocking: ``async (size_bytes, fn) -> fn()``, e.g. ``broker.offload.run``.
        observer: metrics hooks.
    """

    def __init__(self, replicas_lookup: Callable[[], Mapping[PartitionKey, Replica]],
                 assignment_lookup: Callable[[str, int], PartitionAssignment | None],
                 tracker: IsrTracker, config: LeaderFetchConfig, clock: Callable[[], int],
                 submit_isr_change: Callable[[ChangeIsr], Awaitable[object]], *,
                 run_blocking: RunBlocking = run_inline, observer: LeaderObserver | None = None,
                 is_active: Callable[[str], bool] = lambda broker_id: True) -> None:
        self._replicas = replicas_lookup
        self._assignment = assignment_lookup
        self.tracker = tracker
        self.broker_id = tracker.leader_id
        self.config = config
        self._clock = clock
        self._submit = submit_isr_change
        self._run_blocking = run_blocking
        self._observer = observer or LeaderObserver()
        #: Is a broker active in the applied metadata? Only active brokers may be added to an ISR (the FSM
        #: refuses others), so an expansion is never proposed for a fenced one.
        self._is_active = is_active
        #: follower id -> partition -> the HWM last sent to it (a new HWM ends a long poll).
        self._sent_hwm: dict[str, dict[PartitionKey, int]] = {}
        #: follower id -> responses sent (rotates the partition order).
        self._rotation: dict[str, int] = {}
        #: Partitions with a ChangeIsr in flight (one at a time per partition).
        self._isr_inflight: set[PartitionKey] = set()

    # ------------------------------------------------------------------------------------ the stream

    async def serve(self, follower_id: str, requests: AsyncIterator[pb.FetchRequest]
                    ) -> AsyncIterator[pb.FetchResponse]:
        """The gRPC bidi adapter: one response per request, in order. ``follower_id`` is the peer's
        authenticated identity."""
        try:
            async for request in requests:
                yield await self.fetch(follower_id, request)
        finally:
            self._sent_hwm.pop(follower_id, None)
            self._rotation.pop(follower_id, None)

    async def fetch(self, follower_id: str, request: pb.FetchRequest) -> pb.FetchResponse:
        """Answer one FetchRequest of ``follower_id`` (the authenticated peer), after a long poll of at most
        ``min(request.max_wait_ms, config.max_wait_ms)`` when nothing is new. Every partition of the request
        gets one ``PartitionData``, in request order. Never raises for bad input: errors are per partition.
        """
        slots = self._register(follower_id, request)
        budget = min(request.max_bytes or self.config.response_max_bytes, self.config.response_max_bytes)
        live = [s for s in slots if s.final is None]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(request.max_wait_ms, self.config.max_wait_ms) / 1000.0
        while True:
            event = asyncio.Event()

            def wake(_: Replica, event: asyncio.Event = event) -> None:
                event.set()

            watched = [r for r in (self._replicas().get(s.key) for s in live) if r is not None]
            for replica in watched:  # before reading: no wake-up can be lost
                replica.add_progress_listener(wake)
            try:
                answers, news = await self._answer(follower_id, slots, budget)
                remaining = deadline - loop.time()
                if news or not live or remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(event.wait(), remaining)
                except TimeoutError:
                    break
            finally:
                for replica in watched:
                    replica.remove_progress_listener(wake)
        sent = self._sent_hwm.setdefault(follower_id, {})
        for slot, data in zip(slots, answers, strict=True):
            if slot.final is None and not data.HasField("error"):
                sent[slot.key] = data.hwm
        self._rotation[follower_id] = self._rotation.get(follower_id, 0) + 1
        return pb.FetchResponse(partitions=answers)

    # ------------------------------------------------------------------------------- registration

    def _register(self, follower_id: str, request: pb.FetchRequest) -> list[_Slot]:
        """Fencing, divergence and progress of every partition, once per request."""
        slots: list[_Slot] = []
        seen: set[PartitionKey] = set()
        for part in request.partitions:
            slot = _Slot(part, (part.topic, part.partition))
            slots.append(slot)
            if request.follower_id != follower_id:
                slot.final = _error(part, BrokerError.of(
                    "internal_command_unauthorized", follower_id=request.follower_id,
                    reason="the request's follower_id is not the authenticated peer"))
            elif slot.key in seen:
                slot.final = _error(part, BrokerError.of("duplicate_partition", topic=part.topic,
                                                         partition=part.partition))
            else:
                seen.add(slot.key)
                slot.final = self._register_one(follower_id, slot)
        return slots

    def _register_one(self, follower_id: str, slot: _Slot) -> pb.PartitionData | None:
        part = slot.part
        checked = self._check(follower_id, part)
        if isinstance(checked, pb.PartitionData):
            return checked
        replica, _ = checked
        if part.last_fetched_epoch >= 0:
            answer = replica.end_offset_for_epoch(part.last_fetched_epoch)
            if answer.epoch < part.last_fetched_epoch or answer.end_offset < part.fetch_offset:
                return self._diverging(replica, part, answer)
        if not replica.log_start_offset <= part.fetch_offset <= replica.leo:
            return _error(part, BrokerError.of("OFFSET_OUT_OF_RANGE", topic=part.topic, partition=part.partition,
                                               requested=part.fetch_offset, earliest=replica.log_start_offset,
                                               latest=replica.leo))
        replica.update_replica_end(follower_id, part.fetch_offset)
        # Only fsynced data is served, so "the leader's LEO" a follower can reach is its durable end.
        self.tracker.on_fetch(slot.key, follower_id, part.fetch_offset, replica.durable_end_offset, self._clock(),
                              leader_epoch=replica.leader_epoch)
        return None

    def _check(self, follower_id: str, part: pb.PartitionFetch
               ) -> pb.PartitionData | tuple[Replica, PartitionAssignment]:
        """The fencing of design-13: an error answer, or the leader replica and its assignment."""
        key = (part.topic, part.partition)
        assignment = self._assignment(part.topic, part.partition)
        replica = self._replicas().get(key)
        if assignment is None or (replica is not None and replica.deleted):
            return _error(part, BrokerError.of("partition_metadata_not_found", topic=part.topic,
                                               partition=part.partition))
        if replica is not None and replica.fenced is not None:
            return _error(part, BrokerError.of("storage_unavailable", topic=part.topic, partition=part.partition,
                                               reason="the leader's replica is fenced after a storage error"))
        if replica is not None and replica.role is Role.LEADER and (replica.unavailable is not None
                                                                    or not replica.writable):
            # A leader that fails closed (its log ends below the committed HWM) or is still truncating its
            # tail must not answer with its log: a follower would truncate committed records to match it.
            return _error(part, BrokerError.of("leader_not_available", topic=part.topic, partition=part.partition,
                                               reason="the leader is not serving this partition yet"))
        if replica is None or replica.role is not Role.LEADER:
            leader = replica.leader_id if replica is not None and replica.leader_id else assignment.leader
            return _error(part, BrokerError.of("NOT_PARTITION_LEADER", topic=part.topic, partition=part.partition,
                                               leader=leader if leader is not None else "none",
                                               requested_leader=self.broker_id))
        if follower_id not in assignment.replicas or follower_id == self.broker_id:
            return _error(part, BrokerError.of("internal_command_unauthorized", topic=part.topic,
                                               partition=part.partition, follower_id=follower_id,
                                               reason="not a follower replica of the partition"))
        if part.leader_epoch < replica.leader_epoch:
            return _error(part, BrokerError.of("STALE_LEADER_EPOCH", topic=part.topic, partition=part.partition,
                                               current=replica.leader_epoch, requested=part.leader_epoch))
        if part.leader_epoch > replica.leader_epoch:
            return _error(part, BrokerError.of("PARTITION_LEADER_FENCED", topic=part.topic,
                                               partition=part.partition, current=replica.leader_epoch,
                                               requested=part.leader_epoch,
                                               reason="this leader has not applied a newer leader epoch"))
        if part.lifecycle_epoch != assignment.lifecycle_epoch:
            return _error(part, BrokerError.of("PARTITION_LEADER_FENCED", topic=part.topic,
                                               partition=part.partition,
                                               lifecycle_epoch=assignment.lifecycle_epoch,
                                               requested_lifecycle_epoch=part.lifecycle_epoch,
                                               reason="lifecycle epoch mismatch"))
        return replica, assignment

    @staticmethod
    def _diverging(replica: Replica, part: pb.PartitionFetch, answer: EpochEnd) -> pb.PartitionData:
        return pb.PartitionData(topic=part.topic, partition=part.partition, leader_epoch=replica.leader_epoch,
                                hwm=replica.hwm, log_start_offset=replica.log_start_offset, leo=replica.leo,
                                diverging_epoch=epoch_end_to_pb(answer))

    # ------------------------------------------------------------------------------------- reading

    async def _answer(self, follower_id: str, slots: list[_Slot], budget: int
                      ) -> tuple[list[pb.PartitionData], bool]:
        """Every partition's answer now, and whether any is news (chunks, error, divergence, new HWM)."""
        answers: list[pb.PartitionData | None] = [s.final for s in slots]
        news = any(a is not None for a in answers)
        sent = self._sent_hwm.get(follower_id, {})
        order = [i for i, s in enumerate(slots) if s.final is None]
        if order:
            shift = self._rotation.get(follower_id, 0) % len(order)
            order = order[shift:] + order[:shift]
        for index in order:
            slot = slots[index]
            data, size = await self._read_one(follower_id, slot, budget)
            budget -= size
            answers[index] = data
            if (size or data.skip_to or data.HasField("error") or data.HasField("diverging_epoch")
                    or sent.get(slot.key) != data.hwm):
                news = True
        return [a for a in answers if a is not None], news

    async def _read_one(self, follower_id: str, slot: _Slot, budget: int) -> tuple[pb.PartitionData, int]:
        part = slot.part
        checked = self._check(follower_id, part)
        if isinstance(checked, pb.PartitionData):
            return checked, 0
        replica, _ = checked
        # Written chunks, fsynced or not: the follower fetches while the leader fsyncs (Kafka serves the page
        # cache). The committed HWM still counts the leader's own *durable* end, so nothing becomes visible
        # or acknowledged before the leader has fsynced it too.
        end = min(replica.log.replicable_end_offset, replica.leo)
        chunks = b""
        first: ChunkHeader | None = None
        skip_to: int | None = None
        if part.fetch_offset < end and budget > 0:
            limit = min(budget, self.config.partition_max_bytes, part.max_bytes or self.config.partition_max_bytes)
            read = functools.partial(read_stored_chunks, replica.log, part.fetch_offset, end, limit)
            try:
                chunks, first = await self._run_blocking(_expected_bytes(replica, part.fetch_offset, end, limit),
                                                         read)
                if not chunks and first is None:  # nothing stored up to the end, or a chunk crossing it
                    skip_to = await self._run_blocking(0, functools.partial(
                        trailing_gap_end, replica.log, part.fetch_offset, end))
            except OffsetOutOfRange:
                return _error(part, BrokerError.of("OFFSET_OUT_OF_RANGE", topic=part.topic,
                                                   partition=part.partition, requested=part.fetch_offset,
                                                   earliest=replica.log_start_offset, latest=replica.leo)), 0
            except CorruptLogError as exc:
                log.error("refusing to replicate %s/%d from offset %d: %s", part.topic, part.partition,
                          part.fetch_offset, exc)
                return _error(part, BrokerError.of("corrupt_log_data", topic=part.topic, partition=part.partition,
                                                   offset=part.fetch_offset)), 0
            except OSError as exc:
                log.warning("replication read of %s/%d failed: %s", part.topic, part.partition, exc)
                return _error(part, BrokerError.of("storage_unavailable", topic=part.topic,
                                                   partition=part.partition, reason="read failed")), 0
            again = self._check(follower_id, part)  # the role may have changed during the read
            if isinstance(again, pb.PartitionData):
                return again, 0
            if first is not None and not chunks and first.base_offset != part.fetch_offset:
                # fetch_offset is inside a stored chunk: not a boundary of our log, so the follower's log
                # differs below it; make it truncate to the chunk's start and fetch whole chunks again.
                return self._diverging(replica, part, EpochEnd(first.leader_epoch, first.base_offset)), 0
        if chunks:
            self._observer.chunk_bytes_out(follower_id, slot.key, len(chunks))
        # after the read: a chunk served after a gap was read while the log had cleaned segments already
        gaps = replica.log.has_compacted_segments()
        return pb.PartitionData(topic=part.topic, partition=part.partition, leader_epoch=replica.leader_epoch,
                                hwm=replica.hwm, log_start_offset=replica.log_start_offset, leo=replica.leo,
                                chunks=chunks, skip_to=skip_to or 0, cleaned_gaps=gaps), len(chunks)

    # ----------------------------------------------------------------------------- ISR maintenance

    async def maintain(self) -> list[ChangeIsr]:
        """One ISR maintenance step: for every local leader replica whose applied assignment agrees with
        it (same leader, same leader epoch), ask the tracker and submit the ``ChangeIsr`` it implies (at
        most one in flight per partition). An expansion is announced first to the replica
        (``expand_isr_pending``, when the replica has it: the maximal-ISR rule). Returns the commands
        submitted (after they completed or failed; failures are logged and decided again next step)."""
        now = self._clock()
        commands: list[ChangeIsr] = []
        #: request id -> the replica and the members whose expansion it proposes (withdrawn if refused).
        expansions: dict[str, tuple[Replica, tuple[str, ...]]] = {}
        led: set[PartitionKey] = set()
        for key, replica in list(self._replicas().items()):
            if replica.role is not Role.LEADER or replica.fenced is not None:
                continue
            assignment = self._assignment(*key)
            if (assignment is None or assignment.leader != self.broker_id
                    or assignment.leader_epoch != replica.leader_epoch):
                continue
            led.add(key)
            if key in self._isr_inflight:
                continue
            active = frozenset(r for r in assignment.replicas if self._is_active(r))
            change = self.tracker.decide(key, assignment.isr, assignment.replicas, assignment.committed_hwm,
                                         now, self.config.lag_time_max_ms, leader_epoch=assignment.leader_epoch,
                                         active=active)
            if change is None:
                continue
            pending = getattr(replica, "expand_isr_pending", None)
            if pending is not None:
                for member in change.expanded:
                    pending(member)
            self._observer.isr_change_proposed(key, change)
            log.info("%s/%d: proposing ISR %s (shrunk %s, expanded %s) in leader epoch %d", key[0], key[1],
                     list(change.isr), list(change.shrunk), list(change.expanded), assignment.leader_epoch)
            commands.append(ChangeIsr(request_id=uuid.uuid4().hex, topic=key[0], partition=key[1],
                                      leader_epoch=assignment.leader_epoch, isr=change.isr))
            expansions[commands[-1].request_id] = (replica, change.expanded)
        for key in self.tracker.keys():
            if key not in led:
                self.tracker.forget(key)
        await asyncio.gather(*(self._submit_one(command, *expansions[command.request_id]) for command in commands))
        return commands

    async def _submit_one(self, command: ChangeIsr, replica: Replica, expanded: tuple[str, ...]) -> None:
        key = (command.topic, command.partition)
        self._isr_inflight.add(key)
        try:
            await self._submit(command)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a stale epoch, no Raft leader...: decided again next step
            log.warning("%s/%d: ChangeIsr %s not applied: %s", key[0], key[1], list(command.isr), exc)
            # A definite refusal withdraws the expansion (it no longer holds the HWM back). An unknown outcome
            # keeps it: the expansion may have committed, and the maximal-ISR rule must hold until we know.
            definite = (isinstance(exc, BrokerError) and exc.error.code != "request_timeout"
                        and exc.error.fields.get("outcome") != "unknown")
            clear = getattr(replica, "clear_isr_pending", None)
            if definite and clear is not None:
                for member in expanded:
                    clear(member)
        finally:
            self._isr_inflight.discard(key)

    async def maintain_forever(self) -> None:
        """Run :meth:`maintain` every ``isr_check_interval_ms`` until cancelled."""
        while True:
            try:
                await self.maintain()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("ISR maintenance step failed")
            await asyncio.sleep(self.config.isr_check_interval_ms / 1000.0)


def _error(part: pb.PartitionFetch, error: BrokerError) -> pb.PartitionData:
    return pb.PartitionData(topic=part.topic, partition=part.partition, error=error_to_pb(error))


def _expected_bytes(replica: Replica, offset: int, end_offset: int, limit: int) -> int:
    """Bytes a read from ``offset`` will likely return: records available times the average record size,
    at most ``limit``."""
    stored = replica.log.log_end_offset - replica.log.log_start_offset
    if stored <= 0:
        return 0
    return int(min(limit, (end_offset - offset) * replica.log.size_bytes() / stored))
