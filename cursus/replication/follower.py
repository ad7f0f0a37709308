"""The follower side of the follower-pull fetch protocol: one fetch session per leader broker.

:class:`ReplicaFetcherManager` keeps one :class:`FetchSession` (an asyncio task) per leader broker for the
local replicas in role FOLLOWER; :meth:`ReplicaFetcherManager.refresh` re-evaluates them from the replicas'
roles (the broker calls it from a metadata listener and after role changes).

A session sends one ``FetchRequest`` at a time (bytes in flight are bounded by that and by the request's
byte bounds), reads the one ``FetchResponse`` and applies it per partition:

* chunks: cut by their CCK2 headers, checked (CRC, record framing) through ``run_blocking`` (the offload
  threads for large responses), and appended as stored (``Replica.append_replicated``); then the
  session waits until they are durable (fsynced) before the next request, so the next ``fetch_offset``
  (the durable LEO) tells the leader what this follower holds safely;
* ``diverging_epoch``: ``Replica.truncate_to_epoch`` (KIP-279) with ``min(local HWM, the assignment's
  committed HWM)`` as the floor, then fetch again; a truncation below it or one that makes no progress is refused
  and the partition is quarantined (fail closed, reported like a refused append), never retried in a loop;
* the leader's HWM: ``Replica.advance_hwm``, clamped by the replica to the prefix known to match the leader
  (``Replica.leader_matches``: an answer without divergence to a fetch carrying our epoch lineage);
* an error: a stale view (``NOT_PARTITION_LEADER``, ``STALE_LEADER_EPOCH``, ``PARTITION_LEADER_FENCED``,
  ``partition_metadata_not_found``, ...) backs the partition off ``backoff_ms`` and schedules a refresh
  (our metadata will catch up); ``OFFSET_OUT_OF_RANGE`` with the leader's log start above our log end
  (retention deleted what we lack, e.g. our storage was lost) drops our log and starts it empty at the
  leader's log start (``Replica.restart_at``, Kafka's follower handling); any other ``OFFSET_OUT_OF_RANGE``
  stops the partition;
* gaps (:func:`gaps_allowed`): chunks of the leader's cleaned segments keep their offsets and leave gaps;
  in a reply that says the leader's log has them (``cleaned_gaps``, for the leader epoch we fetched with)
  they are appended as stored, gaps included (``append_replicated(allow_gap=True)``), and a reply with
  ``skip_to`` and no chunks (our fetch offset lies in a gap at the end of the leader's log) continues our
  log there (``Replica.skip_replicated_gap``), so an idle topic's follower still reaches the leader's LEO.
  The permission follows the leader's log, not the topic's current cleanup policy: a topic switched from
  compact to delete keeps its gaps. A gap in a reply without ``cleaned_gaps`` (a log never cleaned) is
  refused (``OFFSET_OUT_OF_RANGE``, quarantine) and its ``skip_to`` ignored;
* a refused append (``version_conflict``, ``corrupt_log_data``, ``OFFSET_OUT_OF_RANGE`` gap, ...) stops
  fetching that partition until its leader epoch changes (quarantine: the leader shrinks it out of the ISR
  by lag); it is logged and reported to the observer.

A broken stream (transport error, end of stream) is reopened with exponential backoff;
:meth:`ReplicaFetcherManager.peer_restarted` (the leader broker is a new process) ends the backoff at once.

The transport is injected: ``open_stream(address)`` returns (or resolves to) an object with
``async write(pb.FetchRequest)``, ``async read() -> pb.FetchResponse`` (anything else: the stream ended)
and ``cancel()`` -- what a ``grpc.aio`` bidi call offers. Loop thread only.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from cursus.broker.replica import Replica, TruncationRefused, check_replicated_chunk
from cursus.broker.replica_role import Role
from cursus.internal.v1 import replication_pb2 as pb
from cursus.metadata.state import PartitionAssignment
from cursus.replication.convert import epoch_end_from_pb, error_from_pb, split_chunks
from cursus.replication.leader import RunBlocking, run_inline
from cursus.storage.epochs import UNDEFINED
from cursus.wire.errors import BrokerError, TypedError

log = logging.getLogger(__name__)

PartitionKey = tuple[str, int]

#: Leader answers after which this follower stops fetching the partition (until its leader epoch changes).
STOP_CODES = frozenset({"OFFSET_OUT_OF_RANGE"})


@dataclass(frozen=True, slots=True)
class FetcherConfig:
    """Follower-side bounds and timers (milliseconds, bytes).

    Attributes:
        max_wait_ms: the long poll the leader may hold a request (``replica_fetch_wait_max_ms``).
        partition_max_bytes: chunk bytes per partition per response (``replica_fetch_max_bytes``).
        response_max_bytes: chunk bytes per response (``replica_fetch_response_max_bytes``).
        backoff_ms: pause of a partition after an error answer (``replica_fetch_backoff_ms``).
        reconnect_backoff_ms / reconnect_backoff_max_ms: first and largest pause before reopening a broken
            stream (doubling in between).
    """

    max_wait_ms: int = 500
    partition_max_bytes: int = 1 << 20
    response_max_bytes: int = 8 << 20
    backoff_ms: int = 1_000
    reconnect_backoff_ms: int = 100
    reconnect_backoff_max_ms: int = 5_000


class FetchStream(Protocol):
    """One bidi fetch stream (a ``grpc.aio`` stream-stream call)."""

    async def write(self, request: pb.FetchRequest) -> None: ...

    async def read(self) -> Any: ...

    def cancel(self) -> Any: ...


class FollowerObserver:
    """Metrics hooks of the fetcher (no-ops; the broker subclasses it)."""

    def chunk_bytes_in(self, leader_id: str, key: PartitionKey, size_bytes: int) -> None:
        """``size_bytes`` of chunks of ``key`` were appended from ``leader_id``."""

    def append_refused(self, key: PartitionKey, error: TypedError) -> None:
        """The partition stopped fetching: its append (or the leader's answer) was refused."""

    def stream_broken(self, leader_id: str, error: BaseException) -> None:
        """The stream to ``leader_id`` broke and will be reopened."""


async def wait_durable(replica: Replica, end_offset: int) -> None:
    """Wait until ``replica.durable_end_offset >= end_offset``, or the replica stops being a follower or is
    fenced (event driven: the replica's progress listeners)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def check(r: Replica) -> None:
        if not done.done() and (r.durable_end_offset >= end_offset or r.fenced is not None
                                or r.role is not Role.FOLLOWER):
            done.set_result(None)

    replica.add_progress_listener(check)
    try:
        check(replica)
        await done
    finally:
        replica.remove_progress_listener(check)


def last_fetched_epoch(replica: Replica, fetch_offset: int) -> int:
    """The leader epoch of the replica's last chunk below ``fetch_offset`` (-1: none), from the log's
    leader-epoch history."""
    epoch = UNDEFINED
    for entry_epoch, start in replica.log.leader_epochs:
        if start < fetch_offset:
            epoch = entry_epoch
    return epoch


def gaps_allowed(part: pb.PartitionFetch, reply: pb.PartitionData) -> bool:
    """Whether ``reply`` (the leader's answer to ``part``) may take our log over an offset gap: the leader
    says its log has cleaned segments (``cleaned_gaps``), in the leader epoch we fetched with. It follows
    the leader's log, not the topic's cleanup policy (a topic switched from compact to delete keeps the
    gaps its cleaner left); a gap in a log never cleaned stays a refusal."""
    return reply.cleaned_gaps and reply.leader_epoch == part.leader_epoch


class ReplicaFetcherManager:
    """One :class:`FetchSession` per leader broker of the local follower replicas.

    Args:
        local_broker_id: this broker's id (the requests' ``follower_id``).
        replicas_lookup: ``() -> {(topic, partition): Replica}``, the broker's local replicas.
        leader_address_of: ``broker id -> internal address`` (``host:port``) or None while unknown.
        open_stream: ``address -> FetchStream`` (or an awaitable of one).
        config: bounds and timers.
        clock: monotonic milliseconds (backoffs).
        assignment_lookup: ``(topic, partition) -> PartitionAssignment | None`` (the lifecycle epoch).
        observer: metrics hooks.
        run_blocking: ``async (size_bytes, fn) -> fn()``, e.g. ``broker.offload.run``: the CRC and record
            walk of fetched chunks run through it (off the loop for large responses, like client batches).
    """

    def __init__(self, local_broker_id: str, replicas_lookup: Callable[[], Mapping[PartitionKey, Replica]],
                 leader_address_of: Callable[[str], str | None], open_stream: Callable[[str], Any],
                 config: FetcherConfig, clock: Callable[[], int], *,
                 assignment_lookup: Callable[[str, int], PartitionAssignment | None],
                 observer: FollowerObserver | None = None, run_blocking: RunBlocking = run_inline) -> None:
        self.broker_id = local_broker_id
        self.run_blocking = run_blocking
        self.replicas = replicas_lookup
        self.leader_address_of = leader_address_of
        self.open_stream = open_stream
        self.config = config
        self.clock = clock
        self.assignment_lookup = assignment_lookup
        self.observer = observer or FollowerObserver()
        self.sessions: dict[str, FetchSession] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        self._closed = False
        self._refresh_scheduled = False

    def refresh(self) -> None:
        """Re-evaluate the sessions from the local replicas' roles: a session per leader broker with a known
        address, holding exactly the partitions this broker follows from it. Loop thread; idempotent."""
        self._refresh_scheduled = False
        if self._closed:
            return
        wanted: dict[str, set[PartitionKey]] = {}
        for key, replica in self.replicas().items():
            if replica.role is Role.FOLLOWER and replica.leader_id and replica.fenced is None:
                wanted.setdefault(replica.leader_id, set()).add(key)
        addresses = {leader: self.leader_address_of(leader) for leader in wanted}
        for leader, session in list(self.sessions.items()):
            if addresses.get(leader) != session.address:
                self._stop(self.sessions.pop(leader))
        for leader, keys in wanted.items():
            address = addresses[leader]
            if not address:
                continue
            existing = self.sessions.get(leader)
            if existing is None:
                existing = self.sessions[leader] = FetchSession(self, leader, address)
                existing.start()
            existing.set_partitions(keys)

    def peer_restarted(self, leader_id: str) -> bool:
        """``leader_id`` restarted (a new incarnation): the session fetching from it, if any, reopens its
        stream now instead of finishing a reconnect backoff grown while the old process was gone. True
        when there was such a session. Loop thread."""
        session = self.sessions.get(leader_id)
        if session is None:
            return False
        session.reset_backoff()
        return True

    def schedule_refresh(self) -> None:
        """Run :meth:`refresh` soon (from inside a session, which refresh may stop)."""
        if not self._refresh_scheduled and not self._closed:
            self._refresh_scheduled = True
            asyncio.get_running_loop().call_soon(self.refresh)

    def _stop(self, session: FetchSession) -> None:
        task = session.stop()
        if task is not None:
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)

    async def close(self) -> None:
        """Stop every session and wait for them to end."""
        self._closed = True
        for session in list(self.sessions.values()):
            self._stop(session)
        self.sessions.clear()
        if self._stopping:
            await asyncio.gather(*self._stopping, return_exceptions=True)


class FetchSession:
    """The fetch loop of this broker with one leader broker (see the module docstring)."""

    def __init__(self, manager: ReplicaFetcherManager, leader_id: str, address: str) -> None:
        self.manager = manager
        self.leader_id = leader_id
        self.address = address
        self.partitions: frozenset[PartitionKey] = frozenset()
        #: partition -> monotonic ms until which it is not fetched (after an error answer).
        self.backoff_until: dict[PartitionKey, int] = {}
        #: partition -> the leader epoch in which it stopped (quarantine until the epoch changes).
        self.stopped: dict[PartitionKey, int] = {}
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: Consecutive failed streams (0 after a response): the reconnect backoff's exponent.
        self.failures = 0
        #: Set to end a reconnect backoff early (:meth:`reset_backoff`).
        self._retry_now = asyncio.Event()
        #: Statistics: requests sent, responses applied, streams opened.
        self.requests = 0
        self.streams = 0

    def start(self) -> None:
        assert self._task is None
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"cursus-fetch-{self.leader_id}")

    def stop(self) -> asyncio.Task[None] | None:
        """Cancel the session's task (returned, to await its end)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        return task

    def set_partitions(self, keys: set[PartitionKey]) -> None:
        """Fetch exactly ``keys`` from now on (the next request)."""
        keys_frozen = frozenset(keys)
        if keys_frozen != self.partitions:
            self.partitions = keys_frozen
            self.backoff_until = {k: v for k, v in self.backoff_until.items() if k in keys_frozen}
            self.stopped = {k: v for k, v in self.stopped.items() if k in keys_frozen}
        self._changed.set()

    def reset_backoff(self) -> None:
        """Forget the failures so far and end a running reconnect backoff (the leader restarted)."""
        self.failures = 0
        self._retry_now.set()

    # -------------------------------------------------------------------------------------- the loop

    async def _run(self) -> None:
        config = self.manager.config
        while True:
            stream: Any = None
            try:
                opened = self.manager.open_stream(self.address)
                stream = await opened if inspect.isawaitable(opened) else opened
                self.streams += 1
                while True:
                    request = await self._next_request()
                    await stream.write(request)
                    self.requests += 1
                    response = await stream.read()
                    if not isinstance(response, pb.FetchResponse):
                        raise ConnectionError("the leader ended the fetch stream")
                    self.failures = 0
                    await self._apply(request, response)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failures += 1
                log.warning("fetch stream to %s (%s) broke: %r", self.leader_id, self.address, exc)
                self.manager.observer.stream_broken(self.leader_id, exc)
            finally:
                if stream is not None:
                    stream.cancel()
            delay_ms = min(config.reconnect_backoff_max_ms,
                           config.reconnect_backoff_ms * 2 ** min(self.failures - 1, 30))
            self._retry_now.clear()
            try:
                await asyncio.wait_for(self._retry_now.wait(), max(0, delay_ms) / 1000.0)
            except TimeoutError:
                pass

    async def _next_request(self) -> pb.FetchRequest:
        """The next request: every fetchable partition (waits while there is none)."""
        config = self.manager.config
        while True:
            self._changed.clear()
            now = self.manager.clock()
            wake_at: int | None = None
            parts: list[pb.PartitionFetch] = []
            replicas = self.manager.replicas()
            for key in sorted(self.partitions):
                replica = replicas.get(key)
                if (replica is None or replica.role is not Role.FOLLOWER or replica.leader_id != self.leader_id
                        or replica.fenced is not None):
                    continue
                if key in self.stopped:
                    if self.stopped[key] == replica.leader_epoch:
                        continue
                    del self.stopped[key]  # a new leader epoch: try again
                until = self.backoff_until.get(key)
                if until is not None:
                    if until > now:
                        wake_at = until if wake_at is None else min(wake_at, until)
                        continue
                    del self.backoff_until[key]
                assignment = self.manager.assignment_lookup(*key)
                if assignment is None:
                    continue
                if replica.leo > replica.durable_end_offset:
                    await wait_durable(replica, replica.leo)  # fetch from the durable LEO
                offset = replica.durable_end_offset
                parts.append(pb.PartitionFetch(
                    topic=key[0], partition=key[1], fetch_offset=offset,
                    last_fetched_epoch=last_fetched_epoch(replica, offset), leader_epoch=replica.leader_epoch,
                    lifecycle_epoch=assignment.lifecycle_epoch, max_bytes=config.partition_max_bytes))
            if parts:
                return pb.FetchRequest(follower_id=self.manager.broker_id, max_wait_ms=config.max_wait_ms,
                                       max_bytes=config.response_max_bytes, partitions=parts)
            timeout = None if wake_at is None else max(0, wake_at - now) / 1000.0
            try:
                await asyncio.wait_for(self._changed.wait(), timeout)
            except TimeoutError:
                pass

    # ------------------------------------------------------------------------------------- applying

    async def _apply(self, request: pb.FetchRequest, response: pb.FetchResponse) -> None:
        """Apply one response; returns once every appended chunk is durable."""
        sent = {(p.topic, p.partition): p for p in request.partitions}
        appended: list[Replica] = []
        replicas = self.manager.replicas()
        for data in response.partitions:
            key = (data.topic, data.partition)
            part = sent.pop(key, None)
            replica = replicas.get(key)
            if (part is None or replica is None or replica.role is not Role.FOLLOWER
                    or replica.leader_epoch != part.leader_epoch or replica.leader_id != self.leader_id):
                continue  # not asked for, or the role changed meanwhile: the next request decides
            error = error_from_pb(data.error) if data.HasField("error") else None
            if error is not None:
                if not await self._restart_at_log_start(key, replica, part, error):
                    self._on_error(key, replica, error)
            elif data.HasField("diverging_epoch"):
                await self._truncate(key, replica, data)
            else:
                if part.last_fetched_epoch >= 0 or part.fetch_offset == 0:
                    replica.leader_matches(part.fetch_offset)  # the leader checked our lineage up to there
                if data.chunks and await self._append(key, replica, part, data):
                    appended.append(replica)
                elif not data.chunks and data.skip_to and self._skip_gap(key, replica, part, data):
                    appended.append(replica)
                if (replica.role is Role.FOLLOWER and replica.leader_epoch == part.leader_epoch
                        and replica.leader_id == self.leader_id):  # the chunk check may have awaited
                    replica.advance_hwm(data.hwm)
        if appended:
            await asyncio.gather(*(wait_durable(r, r.leo) for r in appended))

    async def _append(self, key: PartitionKey, replica: Replica, part: pb.PartitionFetch,
                      reply: pb.PartitionData) -> bool:
        data = reply.chunks
        try:
            chunks = split_chunks(data)
        except ValueError as exc:
            self._quarantine(key, replica, BrokerError.of(
                "corrupt_log_data", topic=key[0], partition=key[1], reason=f"fetched chunks: {exc}").error)
            return False
        headers = await self.manager.run_blocking(len(data), lambda: [check_replicated_chunk(c) for c in chunks])
        if (replica.role is not Role.FOLLOWER or replica.leader_epoch != part.leader_epoch
                or replica.leader_id != self.leader_id):
            return False  # the role changed during the check: the next request decides
        allow_gap = gaps_allowed(part, reply)
        try:
            for chunk, header in zip(chunks, headers, strict=True):
                if header is None:
                    raise BrokerError.of("corrupt_log_data", topic=key[0], partition=key[1],
                                         reason="replicated bytes are not one valid chunk")
                replica.append_replicated(chunk, part.leader_epoch, checked=header, allow_gap=allow_gap)
        except BrokerError as exc:
            self._quarantine(key, replica, exc.error)
            return True  # what was appended before the refusal still becomes durable
        self.manager.observer.chunk_bytes_in(self.leader_id, key, len(data))
        return True

    def _skip_gap(self, key: PartitionKey, replica: Replica, part: pb.PartitionFetch,
                  reply: pb.PartitionData) -> bool:
        """The leader stores no chunk from our fetch offset up to ``reply.skip_to``, the end of its written
        log (a gap its cleaner left there): continue our log at ``skip_to`` (True: wait until it is
        durable). Ignored unless :func:`gaps_allowed` (a log never cleaned has no gaps) and for a stale
        fetch offset."""
        skip_to = reply.skip_to
        if not gaps_allowed(part, reply) or part.fetch_offset != replica.leo or skip_to <= replica.leo:
            return False
        try:
            replica.skip_replicated_gap(skip_to, part.leader_epoch)
        except BrokerError as exc:
            self._quarantine(key, replica, exc.error)
            return False
        return True

    async def _truncate(self, key: PartitionKey, replica: Replica, data: pb.PartitionData) -> None:
        answer = epoch_end_from_pb(data.diverging_epoch)
        assignment = self.manager.assignment_lookup(*key)
        committed = assignment.committed_hwm if assignment is not None else replica.hwm
        try:
            offset, complete = await replica.truncate_to_epoch(answer, committed)
        except TruncationRefused as exc:  # below the known committed offset, or no progress: fail closed
            self._quarantine(key, replica, exc.error)
            return
        except BrokerError as exc:
            log.warning("%s/%d: truncation after divergence %s failed: %s", key[0], key[1], tuple(answer), exc)
            self.backoff_until[key] = self.manager.clock() + self.manager.config.backoff_ms
            return
        log.info("%s/%d: diverged from leader %s at epoch %d: truncated to %d%s", key[0], key[1],
                 self.leader_id, answer.epoch, offset, "" if complete else " (asking again)")

    async def _restart_at_log_start(self, key: PartitionKey, replica: Replica, part: pb.PartitionFetch,
                                    error: TypedError) -> bool:
        """``OFFSET_OUT_OF_RANGE`` because the leader's log starts above our log end: start our log empty
        at the leader's log start (True: handled; the next request fetches from there)."""
        if error.code != "OFFSET_OUT_OF_RANGE":
            return False
        try:
            earliest = int(error.fields.get("earliest", ""))
        except ValueError:
            return False
        if not part.fetch_offset < earliest or replica.leo > earliest or part.fetch_offset != replica.leo:
            return False
        log.warning("%s/%d: the log of leader %s starts at %d, above our log end %d: restarting our log there",
                    key[0], key[1], self.leader_id, earliest, replica.leo)
        try:
            await replica.restart_at(earliest)
        except BrokerError as exc:
            log.warning("%s/%d: restarting the log at %d failed: %s", key[0], key[1], earliest, exc)
            self.backoff_until[key] = self.manager.clock() + self.manager.config.backoff_ms
        return True

    def _on_error(self, key: PartitionKey, replica: Replica, error: TypedError) -> None:
        if error.code in STOP_CODES:
            self._quarantine(key, replica, error)
            return
        log.info("%s/%d: leader %s answered %s; retrying in %d ms", key[0], key[1], self.leader_id,
                 error.render(), self.manager.config.backoff_ms)
        self.backoff_until[key] = self.manager.clock() + self.manager.config.backoff_ms
        self.manager.schedule_refresh()

    def _quarantine(self, key: PartitionKey, replica: Replica, error: TypedError) -> None:
        log.error("%s/%d: stopped replicating from %s in leader epoch %d: %s", key[0], key[1], self.leader_id,
                  replica.leader_epoch, error.render())
        self.stopped[key] = replica.leader_epoch
        self.manager.observer.append_refused(key, error)
