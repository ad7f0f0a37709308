"""``RaftMetadata``: the cluster backend of the :class:`~cursus.metadata.backend.Metadata` seam.

``submit`` encodes the command (:func:`cursus.metadata.commands.encode`), replicates it through
:class:`~cursus.cluster.raft.node.RaftNode` and returns once it is committed and applied on this node.
Any member may submit: on a follower pysyncobj forwards the command to the Raft leader over the mutual-TLS
Raft transport and answers once the entry is applied locally, so there is no second forwarding path.
There is never a local fallback: without a Raft leader a submit fails closed with ``no_raft_leader``
(retryable, nothing applied); a commit timeout is ``request_timeout outcome=unknown`` and the same
request id can be retried (the metadata request id is the Raft request id; it applies once).

Applied states reach the event loop in commit order through ``loop.call_soon_threadsafe``; listeners (the
reconciler) see them there, before the submit that caused them returns. A ``GroupRecords`` command (it
changes only consumer groups) updates the state without calling listeners; observers see every command.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable

from cursus.cluster.controller import Controller
from cursus.cluster.fsm import MetadataFSM, decode_result
from cursus.cluster.raft.errors import CommandTooLarge, RaftUnavailable, UnknownOutcome
from cursus.cluster.raft.node import RaftConfig, RaftNode
from cursus.metadata.apply import ApplyResult
from cursus.metadata.backend import PublishedState
from cursus.metadata.commands import Command, GroupRecords, encode
from cursus.metadata.state import BrokerInfo, MetadataState
from cursus.wire.errors import BrokerError

log = logging.getLogger("cursus.metadata.raft")

#: Observers see every applied command on the loop (None after a snapshot restore).
Observer = Callable[[Command | None], None]


def raft_request_id(request_id: str) -> bytes:
    """The 16-byte Raft request id of a metadata request id (uuid hex as is, anything else hashed)."""
    try:
        raw = bytes.fromhex(request_id)
        if len(raw) == 16:
            return raw
    except ValueError:
        pass
    return hashlib.sha256(request_id.encode()).digest()[:16]


class RaftMetadata(PublishedState):
    """Cluster metadata replicated by Raft. ``await start()`` once, ``await stop()`` at shutdown.

    Args:
        raft: this node's Raft configuration (members, data directory, TLS, timers).
        local: this broker's registration (heartbeated by the controller).
        coordinator_shards: ``transaction_coordinator_shards`` (must match the cluster's).
        commit_timeout: seconds a submit waits for its commit before reporting an unknown outcome.
        heartbeat_interval, session_timeout: broker liveness (see :mod:`cursus.cluster.controller`).
    """

    def __init__(self, raft: RaftConfig, local: BrokerInfo, *, coordinator_shards: int, commit_timeout: float,
                 heartbeat_interval: float, session_timeout: float) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fsm = MetadataFSM(MetadataState(cluster=True), self._on_change)
        self.node = RaftNode(raft, self._fsm)
        super().__init__(self._fsm.state)
        self._observers: list[Observer] = []
        #: Set once this node applied everything it knew committed (readiness).
        self._caught_up = False
        #: Set by :meth:`start` once this node's first own command, committed through a Raft leader, is
        #: applied here: every entry committed before this node started is applied then (:attr:`replayed`).
        self._replayed = False
        self._commit_timeout = commit_timeout
        self.controller = Controller(self.submit, lambda: self._state, lambda: self.node.is_leader, local,
                                     coordinator_shards, heartbeat_interval, session_timeout)
        self._observers.append(self.controller.observe)
        #: Submit-to-commit latencies in seconds (for the metadata-commit histogram), or None.
        self.on_commit_latency: Callable[[float], None] | None = None

    # -------------------------------------------------------------------------------- lifecycle

    @property
    def replayed(self) -> bool:
        """True once this node's first heartbeat (submitted at :meth:`start`) is committed and applied here.
        The commit needs a Raft leader and a quorum, and its entry follows every entry committed before
        this node started, so a node that has only its own snapshot and journal (no leader heard yet, or a
        lagging commit index) cannot be ``replayed``. Until then published states are replay (the snapshot,
        then journal entries) and may be older than the local replicas' data."""
        return self._replayed

    async def start(self) -> None:
        """Start Raft, wait for a leader and for this node's first heartbeat to commit, start the controller.
        Listeners see the replayed states (snapshot, journal) meanwhile; :attr:`replayed` is True on return.

        Raises:
            UnsupportedRecoveryProtocol: the Raft directory cannot be recovered (marker, snapshot).
            BrokerError: ``cluster_join_failed`` (e.g. another ``transaction_coordinator_shards``).
            OSError, ssl.SSLError: the Raft port or certificates are unusable.
        """
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self.node.start)
        while True:  # the first heartbeat registers this broker; a refusal stops startup
            try:
                await self.submit(self.controller.heartbeat_command())
                break
            except BrokerError as exc:
                if not exc.error.retryable and exc.error.code != "request_timeout":
                    raise
                log.info("waiting for the Raft cluster: %s", exc.error.code)
                await asyncio.sleep(min(0.2, self.controller.interval))
        self._replayed = True  # the heartbeat's entry is applied: so is everything committed before it
        self.controller.start()

    async def stop(self) -> None:
        await self.controller.stop()
        await asyncio.to_thread(self.node.stop)

    #: A node is caught up when its applied index trails the commit index it knows by at most
    #: ``CAUGHT_UP_LAG`` entries (heartbeats and HWM commits arrive continuously, so "applied == committed"
    #: is only a moment), and stays ready afterwards while it trails by at most ``READY_APPLY_LAG``.
    CAUGHT_UP_LAG = 32
    READY_APPLY_LAG = 1000

    def readiness(self) -> dict[str, str]:
        """``/ready`` checks: a Raft leader is known, and this node has caught up with what it knows committed
        (see :attr:`CAUGHT_UP_LAG`) and does not trail by more than :attr:`READY_APPLY_LAG` since."""
        status = self.node.status()
        if not status.running:
            return {"raft": "not running"}
        if not status.has_leader:
            return {"raft": "no leader"}
        lag = status.commit_index - status.applied_index
        if lag <= self.CAUGHT_UP_LAG:
            self._caught_up = True
        if lag > (self.READY_APPLY_LAG if self._caught_up else self.CAUGHT_UP_LAG):
            return {"raft": f"applying {status.applied_index}/{status.commit_index}"}
        return {}

    def raft_status(self) -> dict[str, object] | None:
        status = self.node.status()
        return {"leader_id": status.leader_id, "is_leader": status.is_leader, "term": status.term,
                "commit_index": status.commit_index, "applied_index": status.applied_index,
                "rejected_connections": dict(status.rejected_connections)}

    # -------------------------------------------------------------------------------- Metadata seam

    def observe(self, observer: Observer) -> None:
        """Call ``observer(command)`` on the loop for every applied command."""
        self._observers.append(observer)

    async def submit(self, command: Command) -> ApplyResult:
        """Commit ``command`` through Raft and return its result (applied on this node before returning).

        Raises:
            BrokerError: the command's typed rejection; ``no_raft_leader`` (retryable, not applied);
                ``request_timeout outcome=unknown`` (retry with the same command: it applies once);
                ``message_too_large`` (over 64 KiB, not submitted).
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            raw = await self.node.submit(encode(command), self._commit_timeout, raft_request_id(command.request_id))
        except RaftUnavailable as exc:
            raise BrokerError.of("no_raft_leader", reason=str(exc)) from None
        except UnknownOutcome as exc:
            raise BrokerError.of("request_timeout", outcome="unknown", request_id=command.request_id,
                                 reason=str(exc)) from None
        except CommandTooLarge as exc:
            raise BrokerError.of("message_too_large", reason=str(exc)) from None
        if self.on_commit_latency is not None:
            self.on_commit_latency(loop.time() - started)
        return decode_result(raw)

    # -------------------------------------------------------------------------------- tick thread

    def _on_change(self, state: MetadataState, command: Command | None, result: ApplyResult | None) -> None:
        loop = self._loop
        if loop is None:
            self._state = state  # before start: nothing listens yet
            return
        try:
            loop.call_soon_threadsafe(self._publish, state, command)
        except RuntimeError:
            pass  # the loop is closed: shutting down

    def _publish(self, state: MetadataState, command: Command | None) -> None:
        if isinstance(command, GroupRecords):
            # Consumer-group records change only ``groups`` (and the revision): the listeners (reconciler,
            # replica roles, replication, topic follow-ups) have nothing to do, and offset commits are by far
            # the most frequent command. Observers (the cluster group log) see it below.
            self._state = state
        elif state is not self._state:
            self._publish_state(state)
        for observer in list(self._observers):
            try:
                observer(command)
            except Exception:
                log.exception("metadata observer failed")
