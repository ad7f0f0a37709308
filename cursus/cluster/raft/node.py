"""``RaftNode``: one member of the Raft metadata cluster, with an asyncio ``submit`` API.

The SyncObj lives on its own long-lived thread (the *tick thread*), created there and driven by a loop
of ``doTick`` + ``finish_round`` (see :mod:`.compat`). The FSM is given by the caller and sees only
bytes::

    class StateMachine(Protocol):
        def apply(self, command: bytes) -> bytes      # deterministic, fast, no I/O, never blocks
        def snapshot(self) -> bytes                    # deterministic encoding of the whole state
        def restore(self, data: bytes) -> None         # may raise UnsupportedRecoveryProtocol

``apply`` runs on the tick thread; results reach the submitting event loop through
``loop.call_soon_threadsafe`` (the tick thread never waits for asyncio). Each command travels in an
envelope with a 16-byte request id; a request id is applied once (:class:`~.commands.DedupTable`, kept in
snapshots), so retrying after :class:`~.errors.UnknownOutcome` with the same id is safe.

Startup order (:meth:`RaftNode.start`): format marker check (:mod:`.marker`), snapshot read and FSM
restore (an FSM refusal fails startup), journal reconciliation, then pysyncobj. Any fsync/write error,
snapshot load failure or safety violation stops the node (fail-stop); pending submits then fail with
:class:`~.errors.UnknownOutcome`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pysyncobj import SyncObjConf
from pysyncobj.node import TCPNode

from cursus.cluster.raft import compat
from cursus.cluster.raft.commands import (
    DEFAULT_DEDUP_CAPACITY,
    MAX_ENTRY_BYTES,
    DedupTable,
    decode_command,
    encode_command,
)
from cursus.cluster.raft.errors import RaftFatal, RaftUnavailable, UnknownOutcome
from cursus.cluster.raft.journal import DurableJournal
from cursus.cluster.raft.marker import ensure_format_marker
from cursus.cluster.raft.snapshot import Snapshot, read_snapshot, write_snapshot
from cursus.cluster.tls import TLSFiles, client_context, server_context
from cursus.storage.atomic import fsync_dir

logger = logging.getLogger(__name__)

SNAPSHOT_NAME = "snapshot.v9"


class StateMachine(Protocol):
    """The replicated state: deterministic bytes in, bytes out."""

    def apply(self, command: bytes) -> bytes: ...

    def snapshot(self) -> bytes: ...

    def restore(self, data: bytes) -> None: ...


@dataclass(frozen=True)
class RaftConfig:
    """One node's Raft settings. Times are seconds.

    ``members`` maps every node id (this one included) to its internal Raft address ``host:port``; the
    node binds exactly its own address. ``tls`` is this node's certificate, key and the internal CA.
    """

    node_id: str
    members: Mapping[str, str]
    data_dir: Path
    tls: TLSFiles
    election_timeout_min: float = 0.4
    election_timeout_max: float = 1.0
    heartbeat_period: float = 0.1
    #: A leader that hears from no majority for this long steps down (pysyncobj's default is 30 s).
    leader_fallback_timeout: float = 1.0
    #: Idle peer connections are closed after this long (must be >= election_timeout_max).
    connection_timeout: float = 3.5
    reconnect_period: float = 0.25
    handshake_timeout: float = 3.0
    #: Poll wait of an idle tick (a submit wakes the tick thread at once).
    poll_interval: float = 0.05
    snapshot_min_entries: int = 5000
    snapshot_min_interval: float = 300.0
    dedup_capacity: int = DEFAULT_DEDUP_CAPACITY
    queue_size: int = 10_000
    #: Pre-vote before an election (see :mod:`.compat`): a node that a partition cut off does not bump its
    #: term and depose a healthy leader when it rejoins. Off only to demonstrate the problem.
    pre_vote: bool = True
    #: May a missing or empty ``data_dir`` be initialised as a new member? False when the broker already
    #: holds data: a member whose Raft state was lost must not rejoin with its vote forgotten.
    allow_new: bool = True

    def validate(self) -> None:
        """Raise ValueError for an inconsistent configuration."""
        if self.node_id not in self.members:
            raise ValueError(f"node id {self.node_id!r} is not among the members {sorted(self.members)}")
        if len(set(self.members.values())) != len(self.members):
            raise ValueError("two members share a Raft address")
        if not self.election_timeout_min > 3 * self.heartbeat_period:
            raise ValueError("election_timeout_min must exceed 3 x heartbeat_period")
        if not self.election_timeout_max > self.election_timeout_min:
            raise ValueError("election_timeout_max must exceed election_timeout_min")
        if not self.leader_fallback_timeout > self.heartbeat_period:
            raise ValueError("leader_fallback_timeout must exceed heartbeat_period")
        if not self.connection_timeout >= self.election_timeout_max:
            raise ValueError("connection_timeout must be >= election_timeout_max")
        if not 0 < self.handshake_timeout < self.connection_timeout:
            raise ValueError("handshake_timeout must be positive and below connection_timeout")
        if self.poll_interval <= 0 or self.reconnect_period < 0:
            raise ValueError("poll_interval must be positive, reconnect_period non-negative")


@dataclass(frozen=True)
class RaftStatus:
    """A point-in-time view for metrics and status commands (read without locks; may be a tick old)."""

    node_id: str
    term: int
    commit_index: int
    applied_index: int
    leader_id: str | None
    is_leader: bool
    connected_peers: tuple[str, ...]
    rejected_connections: Mapping[str, int]
    running: bool

    @property
    def has_leader(self) -> bool:
        return self.leader_id is not None


def _settle(future: asyncio.Future, result: bytes | None, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class RaftNode:
    """One Raft member running ``fsm``. Call :meth:`start` once, then ``await submit(...)``."""

    def __init__(self, config: RaftConfig, fsm: StateMachine) -> None:
        config.validate()
        self._config = config
        self._fsm = fsm
        self._dedup = DedupTable(config.dedup_capacity)
        self._addresses = dict(config.members)
        self._ids = {address: node_id for node_id, address in self._addresses.items()}
        self._syncobj: compat.CursusSyncObj | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._stopped = threading.Event()
        self._stopping = False
        self._work = threading.Event()
        self._wake_r = self._wake_w = -1  # the tick thread's wake-up pipe, open while it runs
        self._start_error: BaseException | None = None
        self.fatal: BaseException | None = None
        self._preloaded: Snapshot | None = None
        self._lock = threading.Lock()
        self._inflight: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future, bytes]] = {}
        self._next_token = 0

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> None:
        """Check the directory, restore the snapshot, bind the Raft port and start the tick thread.

        Blocks (disk reads, bind); from async code use ``await asyncio.to_thread(node.start)``.

        Raises:
            UnsupportedRecoveryProtocol: marker/snapshot/FSM refuses the directory's state.
            OSError, ssl.SSLError: directory, certificates or the Raft port unusable.
            RuntimeError: already started, or the tick thread did not come up within ``timeout``.
        """
        if self._thread is not None:
            raise RuntimeError("RaftNode.start called twice")
        data_dir = self._config.data_dir
        ensure_format_marker(data_dir, allow_new=self._config.allow_new)
        journal = DurableJournal(data_dir)
        try:
            snapshot_path = data_dir / SNAPSHOT_NAME
            if snapshot_path.exists():
                snapshot = read_snapshot(snapshot_path)
                self._restore(snapshot)
                journal.compact_to(snapshot.prev, snapshot.last)
                self._preloaded = snapshot
            server_ctx, client_ctx = server_context(self._config.tls), client_context(self._config.tls)
        except BaseException:
            journal._destroy()
            raise
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, args=(journal, server_ctx, client_ctx),
                                        name=f"raft-{self._config.node_id}", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError("raft tick thread did not start")
        if self._start_error is not None:
            raise self._start_error

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the tick thread, close sockets and files; pending submits fail as unknown outcome."""
        self._stopping = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)

    def _conf(self) -> SyncObjConf:
        c = self._config
        return SyncObjConf(
            autoTick=False, appendEntriesUseBatch=True, commandsWaitLeader=False,
            dynamicMembershipChange=False, bindAddress=self._addresses[c.node_id], maxBindRetries=1,
            raftMinTimeout=c.election_timeout_min, raftMaxTimeout=c.election_timeout_max,
            appendEntriesPeriod=c.heartbeat_period, leaderFallbackTimeout=c.leader_fallback_timeout,
            connectionTimeout=c.connection_timeout, connectionRetryTime=c.reconnect_period,
            appendEntriesBatchSizeBytes=4 * MAX_ENTRY_BYTES, commandsQueueSize=c.queue_size,
            logCompactionMinEntries=c.snapshot_min_entries, logCompactionMinTime=c.snapshot_min_interval,
            fullDumpFile=str(c.data_dir / SNAPSHOT_NAME), serializer=self._serialize,
            deserializer=self._deserialize,
        )

    def _build(self, journal: DurableJournal, server_ctx: Any, client_ctx: Any) -> compat.CursusSyncObj:
        c = self._config
        transport_factory = functools.partial(
            compat.MTLSTransport, server_context=server_ctx, client_context=client_ctx,
            identities=self._ids, handshake_timeout=c.handshake_timeout)
        partners = [address for node_id, address in self._addresses.items() if node_id != c.node_id]
        syncobj = compat.CursusSyncObj(self._addresses[c.node_id], partners, self._conf(), journal,
                                       self._apply, transport_factory, pre_vote=c.pre_vote)
        syncobj.watch_readable(self._wake_r, self._drain_wake)
        return syncobj

    def _run(self, journal: DurableJournal, server_ctx: Any, client_ctx: Any) -> None:
        try:
            syncobj = self._syncobj = self._build(journal, server_ctx, client_ctx)
        except BaseException as exc:
            journal._destroy()
            self._close_wake_pipe()
            self._start_error = exc
            self._started.set()
            self._stopped.set()
            return
        self._started.set()
        poll = self._config.poll_interval
        seen = -1
        try:
            while not self._stopping:
                # Tick again at once while there is work: a submit, or messages in the last round.
                busy = self._work.is_set() or syncobj.activity != seen
                seen = syncobj.activity
                self._work.clear()
                syncobj.doTick(0.0 if busy else poll)
                syncobj.finish_round()
        except BaseException as exc:
            logger.critical("raft node %s stopping: %s", self._config.node_id, exc, exc_info=True)
            self.fatal = exc
        finally:
            self._stopped.set()
            try:
                syncobj.close()
            except Exception:
                logger.exception("raft node %s: error while closing", self._config.node_id)
            self._close_wake_pipe()
            self._fail_inflight()

    def _close_wake_pipe(self) -> None:
        with self._lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    def _wake(self) -> None:
        self._work.set()
        with self._lock:  # never write to a closed (and possibly reused) descriptor
            if self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"\0")
                except BlockingIOError:
                    pass  # a full pipe already wakes the poller

    def _drain_wake(self, descr: int, event: int) -> None:
        try:
            while os.read(descr, 4096):
                pass
        except BlockingIOError:
            pass

    # -- FSM plumbing (tick thread) -----------------------------------------------------------------

    def _apply(self, payload: bytes) -> bytes:
        request_id, body = decode_command(payload)
        cached = self._dedup.get(request_id)
        if cached is not None:
            return cached
        result = self._fsm.apply(body)
        self._dedup.put(request_id, result)
        return result

    def _restore(self, snapshot: Snapshot) -> None:
        self._fsm.restore(snapshot.fsm)
        self._dedup.restore(snapshot.dedup)

    def _serialize(self, filename: str, data: tuple) -> None:
        last, prev, cluster = data
        snapshot = Snapshot(tuple(last), tuple(prev), tuple(sorted(node.id for node in cluster)),
                            self._dedup.encode(), self._fsm.snapshot())
        write_snapshot(filename, snapshot)

    def _deserialize(self, filename: str) -> tuple:
        try:
            snapshot = read_snapshot(filename)
            fsync_dir(Path(filename).parent)
            if snapshot != self._preloaded:
                self._restore(snapshot)
            self._preloaded = None
            return snapshot.last, snapshot.prev, {TCPNode(member) for member in snapshot.members}
        except BaseException as exc:
            # pysyncobj swallows deserializer errors and would go on without the state: stop instead.
            if self._syncobj is not None:
                self._syncobj.fatal = exc
            raise

    # -- submitting -----------------------------------------------------------------------------

    async def submit(self, command: bytes, timeout: float, request_id: bytes | None = None) -> bytes:
        """Replicate ``command`` and return the FSM's result once it is applied on this node.

        ``request_id`` (16 bytes, random when None) identifies the command: resubmitting the same id
        after an unknown outcome applies it at most once and returns the first result.

        Raises:
            CommandTooLarge: ``command`` exceeds MAX_COMMAND_BYTES (nothing submitted).
            RaftUnavailable: definitely not applied (no leader, queue full, stopped); retry later.
            UnknownOutcome: ``timeout`` seconds passed or the leader changed; it may be applied.
        """
        request_id = os.urandom(16) if request_id is None else request_id
        payload = encode_command(request_id, command)
        syncobj = self._syncobj
        if syncobj is None or self._stopped.is_set():
            raise RaftUnavailable("raft node is not running")
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        with self._lock:
            token = self._next_token = self._next_token + 1
            self._inflight[token] = (loop, future, request_id)
        syncobj.submit(payload, functools.partial(self._on_result, token))
        self._wake()
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            raise UnknownOutcome(f"no result within {timeout}s", request_id) from None
        finally:
            with self._lock:
                self._inflight.pop(token, None)

    def _on_result(self, token: int, result: Any, error: int) -> None:
        # pysyncobj's callback: tick thread (or the submitting thread for QUEUE_FULL).
        with self._lock:
            entry = self._inflight.pop(token, None)
        if entry is None:
            return
        loop, future, request_id = entry
        exc: BaseException | None = None
        if error == compat.SUCCESS:
            pass
        elif error in compat.FAIL_REASON_DEFINITE:
            exc = RaftUnavailable(f"not applied (pysyncobj reason {error})")
        else:
            exc = UnknownOutcome(f"outcome unknown (pysyncobj reason {error})", request_id)
        try:
            loop.call_soon_threadsafe(_settle, future, result, exc)
        except RuntimeError:
            pass  # the submitting loop is closed

    def _fail_inflight(self) -> None:
        with self._lock:
            entries, self._inflight = list(self._inflight.values()), {}
        for loop, future, request_id in entries:
            exc = UnknownOutcome(f"raft node stopped ({self.fatal or 'stop'})", request_id)
            try:
                loop.call_soon_threadsafe(_settle, future, None, exc)
            except RuntimeError:
                pass

    # -- status ---------------------------------------------------------------------------------

    def status(self) -> RaftStatus:
        """Term, commit/applied index, leader, connected peers and refused connections."""
        syncobj = self._syncobj
        if syncobj is None:
            return RaftStatus(self._config.node_id, 0, 0, 0, None, False, (), {}, False)
        running = not self._stopped.is_set()
        leader = syncobj.leader_address()
        return RaftStatus(
            node_id=self._config.node_id, term=syncobj.raftCurrentTerm,
            commit_index=syncobj.raftCommitIndex, applied_index=syncobj.raftLastApplied,
            leader_id=self._ids.get(leader) if leader is not None else None,
            is_leader=running and syncobj.is_leader(),
            connected_peers=tuple(sorted(self._ids[address] for address in syncobj.connected_addresses())),
            rejected_connections=syncobj.rejections(), running=running)

    @property
    def is_leader(self) -> bool:
        """This node believes it leads. Never use it to fence: a deposed leader may still believe it
        for ``leader_fallback_timeout``; fencing decisions are made by applying commands."""
        return self.status().is_leader

    @property
    def leader_id(self) -> str | None:
        return self.status().leader_id

    @property
    def has_leader(self) -> bool:
        return self.status().has_leader

    @property
    def term(self) -> int:
        return self.status().term

    @property
    def commit_index(self) -> int:
        return self.status().commit_index

    @property
    def applied_index(self) -> int:
        return self.status().applied_index

    @property
    def running(self) -> bool:
        return self.status().running


__all__ = ["RaftConfig", "RaftFatal", "RaftNode", "RaftStatus", "StateMachine"]
