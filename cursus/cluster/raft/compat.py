"""Every reliance on pysyncobj internals, pinned to pysyncobj 0.3.17 (refuses any other version).

pysyncobj supplies elections, log replication, snapshot transfer and its poller; this module changes
what it gets wrong for us:

- **Durability.** :class:`CursusSyncObj` swaps pysyncobj's journal (mmap, never fsynced) for
  :class:`~cursus.cluster.raft.journal.DurableJournal`, holds every AppendEntries reply
  (``next_node_idx``) until :meth:`CursusSyncObj.finish_round` has fsynced the journal (one fsync per
  poll round). A leader sends new entries in the same round, just before its own fsync (followers write
  in parallel), and counts itself towards a majority only at the start of the next tick - after that
  fsync - so its own vote is always for entries on its disk. Term/vote writes are
  synchronous and fsynced; snapshots are written by our serializer with fsync, and the directory is
  fsynced before the journal entries they cover are compacted away.
- **Safety.** AppendEntries and their replies go through :mod:`.safety`: nextIndex never moves back on
  success, followers truncate only on a real term conflict, commit = min(leaderCommit, last new entry).
- **Pre-vote** (Raft thesis section 9.6). Before a follower or candidate bumps its term for an election
  it asks its peers whether they would vote for it (``cursus_pre_vote``: its last log index and term). A
  peer grants unless it leads, or heard AppendEntries from a current leader within ``raftMinTimeout``, or
  the candidate's log is behind its own; a peer changes no state for it. Only with a majority of grants
  (itself included) does the real election (term + 1, RequestVote) start. So a node cut off by a partition
  keeps its term, and on rejoining does not depose a healthy leader.
  A leadership transfer (``timeout_now``) skips it. Pre-vote only delays elections: votes, terms and
  commitment are stock Raft, so safety is unchanged.
- **Commands.** Regular entries are handed, as bytes, to one apply function - never ``@replicated``
  methods (pysyncobj numbers those by sorted name) and never pickle.
- **Transport.** :class:`MTLSTransport` wraps every peer socket in mutual TLS 1.2+ on the same file
  descriptor, drives the handshake itself, and only then lets pysyncobj use the connection: the peer's
  certificate identity (``raft://<node-id>``) must be the node it claims (outgoing: the node we dialled;
  incoming: the address it announces). Unauthenticated connections are dropped after
  ``handshake_timeout`` seconds. pysyncobj's wire messages are pickles, so nothing is unpickled before
  the peer proved it holds a CA-signed node key.

:func:`missing_internals` lists what this module uses; a test asserts it is empty.
"""

from __future__ import annotations

import collections
import errno
import functools
import logging
import math
import ssl
from collections.abc import Callable, Mapping
from typing import Any

from pysyncobj import SyncObj, SyncObjConf
from pysyncobj.config import FAIL_REASON
from pysyncobj.monotonic import monotonic
from pysyncobj.poller import POLL_EVENT_TYPE
from pysyncobj.syncobj import _COMMAND_TYPE, SyncObjException
from pysyncobj.tcp_connection import CONNECTION_STATE, TcpConnection
from pysyncobj.transport import TCPTransport
from pysyncobj.version import VERSION

from cursus.cluster.raft.errors import PysyncobjVersionError, RaftFatal
from cursus.cluster.raft.journal import DurableJournal
from cursus.cluster.raft.safety import decide_append, next_after_reply
from cursus.cluster.tls import peer_identity

logger = logging.getLogger(__name__)

PINNED_VERSION = "0.3.17"
REGULAR = bytes((_COMMAND_TYPE.REGULAR,))
NO_OP = bytes((_COMMAND_TYPE.NO_OP,))
SUCCESS = FAIL_REASON.SUCCESS
#: Our pre-vote messages (ignored by stock pysyncobj, which has no handler for these types).
PRE_VOTE = "cursus_pre_vote"
PRE_VOTE_REPLY = "cursus_pre_vote_reply"
#: pysyncobj failure reasons after which the command was certainly not applied (anything else that is
#: not SUCCESS - LEADER_CHANGED, UNKNOWN_OUTCOME - leaves the outcome unknown).
FAIL_REASON_DEFINITE = frozenset({FAIL_REASON.QUEUE_FULL, FAIL_REASON.MISSING_LEADER, FAIL_REASON.DISCARDED,
                                  FAIL_REASON.NOT_LEADER, FAIL_REASON.REQUEST_DENIED})

#: Class attributes (methods) of pysyncobj this module overrides or calls.
CLASS_INTERNALS: Mapping[type, tuple[str, ...]] = {
    SyncObj: ("_SyncObj__onMessageReceived", "_SyncObj__doApplyCommand", "_SyncObj__sendNextNodeIdx",
              "_SyncObj__sendAppendEntries", "_SyncObj__generateRaftTimeout", "_applyCommand", "doTick",
              "_doDestroy", "_isLeader", "_getLeader", "isNodeConnected", "raftCurrentTerm", "raftCommitIndex", "raftLastApplied"),
    TCPTransport: ("_onNewIncomingConnection", "_onIncomingMessageReceived", "_onOutgoingConnected",
                   "_onDisconnected", "_onTick", "_connToNode", "_shouldConnect", "send"),
    TcpConnection: ("_TcpConnection__processConnection", "disconnect", "fileno", "state"),
}
#: Instance attributes of a constructed SyncObj / transport / connection this module reads or writes.
INSTANCE_INTERNALS: Mapping[str, tuple[str, ...]] = {
    "SyncObj": ("_SyncObj__raftLog", "_SyncObj__raftCurrentTerm", "_SyncObj__votedForNodeId",
                "_SyncObj__raftCommitIndex", "_SyncObj__raftLastApplied", "_SyncObj__raftNextIndex",
                "_SyncObj__raftMatchIndex", "_SyncObj__lastResponseTime", "_SyncObj__leaderCommitIndex",
                "_SyncObj__transport", "_poller", "_SyncObj__raftElectionDeadline",
                "_SyncObj__transferInProgress", "_SyncObj__otherNodes", "_SyncObj__selfNode"),
    "TCPTransport": ("_nodeAddrToNode", "_unknownConnections", "_connections", "_nodes", "_syncObj"),
    "TcpConnection": ("_TcpConnection__socket",),
}


def check_version() -> None:
    """Raise :class:`PysyncobjVersionError` unless pysyncobj is exactly :data:`PINNED_VERSION`."""
    if VERSION != PINNED_VERSION:
        raise PysyncobjVersionError(
            f"pysyncobj {VERSION} is installed; cursus.cluster.raft.compat was verified against "
            f"{PINNED_VERSION} only (pin pysyncobj=={PINNED_VERSION} or re-verify the compat layer)")


check_version()


def missing_internals(syncobj: CursusSyncObj | None = None) -> list[str]:
    """Names from :data:`CLASS_INTERNALS` (and, given a live ``syncobj``, :data:`INSTANCE_INTERNALS`)
    that the installed pysyncobj lacks; empty when the layer's assumptions hold."""
    missing = [f"{cls.__name__}.{name}" for cls, names in CLASS_INTERNALS.items()
               for name in names if not hasattr(cls, name)]
    if syncobj is not None:
        transport = syncobj._SyncObj__transport
        objects: dict[str, list[Any]] = {"SyncObj": [syncobj], "TCPTransport": [transport],
                                         "TcpConnection": list(transport._connections.values())}
        for kind, names in INSTANCE_INTERNALS.items():
            for obj in objects[kind]:
                missing += [f"{kind}.{name} (instance)" for name in names if not hasattr(obj, name)]
    return sorted(set(missing))


# ------------------------------------------------------------------------------------------------
# SyncObj: durable journal, held replies, safe AppendEntries, bytes commands


class CursusSyncObj(SyncObj):
    """A SyncObj with the durability and safety fixes; driven by :meth:`doTick` + :meth:`finish_round`.

    Constructing it binds the Raft address (OSError when that fails).

    ``apply(payload)`` receives each committed regular entry's bytes (without the type byte) on the
    tick thread and returns the result handed to the submitter's callback.
    """

    _SyncObj__raftElectionDeadline: float  # pysyncobj's (monotonic seconds); read and moved by pre-vote

    def __init__(self, self_address: str, partner_addresses: list[str], conf: SyncObjConf,
                 journal: DurableJournal, apply: Callable[[bytes], bytes],
                 transport_factory: Callable[..., TCPTransport], *, pre_vote: bool = True) -> None:
        if not conf.appendEntriesUseBatch or conf.autoTick or conf.dynamicMembershipChange:
            raise ValueError("CursusSyncObj needs appendEntriesUseBatch, no autoTick, static membership")
        self._cursus_apply = apply
        self._cursus_journal = journal
        self._held_replies: list[tuple[Any, dict]] = []
        self._sent_index = 0
        self._sent_commit = 0
        #: Messages handled so far; the driver ticks again without waiting while this moves.
        self.activity = 0
        #: Set (by the deserializer) to an exception that must stop the node before the next reply.
        self.fatal: BaseException | None = None
        self._pre_vote = pre_vote
        self._leader_lease = float(conf.raftMinTimeout)
        self._leader_contact = -math.inf  # monotonic time of the last AppendEntries from a current leader
        self._pre_vote_round = 0
        self._pre_vote_term = -1
        self._pre_vote_grants: set[Any] = set()
        self._pre_vote_passed: int | None = None  # the term whose pre-vote round won (consumed next tick)
        #: Pre-vote rounds started and won so far (for tests and status).
        self.pre_vote_rounds = 0
        self.pre_vote_wins = 0
        try:
            super().__init__(self_address, partner_addresses, conf=conf, transportClass=transport_factory)
        except SyncObjException as exc:
            raise OSError(f"cannot bind the Raft address {conf.bindAddress}: {exc}") from None
        self._install_journal(journal)

    def _install_journal(self, journal: DurableJournal) -> None:
        # Mirrors SyncObj.__init__'s journal bootstrap, on our journal instead of the in-memory one.
        if len(journal) == 0:
            journal.add(NO_OP, 1, 0)
            journal.sync()
        self._SyncObj__raftLog = journal
        self._SyncObj__raftCurrentTerm = max(journal.getCurrentTerm(), journal[-1][2])
        self._SyncObj__votedForNodeId = journal.getVotedForNodeId()
        self._SyncObj__raftCommitIndex = journal.getRaftCommitIndex()

    # -- pysyncobj overrides (name-mangled privates) ------------------------------------------------

    def _SyncObj__doApplyCommand(self, command: bytes) -> Any:  # noqa: N802
        if command[:1] == REGULAR:
            return self._cursus_apply(bytes(command[1:]))
        return SyncObj._SyncObj__doApplyCommand(self, command)

    def _SyncObj__sendNextNodeIdx(self, node: Any, reset: bool = False,  # noqa: N802
                                  nextNodeIdx: int | None = None, success: bool = False) -> None:  # noqa: N803
        if nextNodeIdx is None:
            nextNodeIdx = self._cursus_journal[-1][1] + 1
        self._held_replies.append((node, {"type": "next_node_idx", "next_node_idx": nextNodeIdx,
                                          "reset": reset, "success": success}))

    def _SyncObj__onMessageReceived(self, node: Any, message: Any) -> None:  # noqa: N802
        self.activity += 1
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == PRE_VOTE:
            self._on_pre_vote(node, message)
            return
        if kind == PRE_VOTE_REPLY:
            self._on_pre_vote_reply(node, message)
            return
        if kind == "append_entries" and message.get("term", -1) >= self._SyncObj__raftCurrentTerm:
            self._leader_contact = monotonic()
        if kind == "append_entries":
            if "transmission" in message:
                # Our entries are below appendEntriesBatchSizeBytes, so no member sends split entries.
                logger.error("raft: dropping a split (transmission) AppendEntries from %s", node)
                return
            if "prevLogIdx" in message and message["term"] >= self._SyncObj__raftCurrentTerm:
                self._on_append_entries(node, message)
                return
        elif kind == "next_node_idx" and self._isLeader():
            self._on_append_reply(node, message)
            return
        SyncObj._SyncObj__onMessageReceived(self, node, message)

    # -- the fixed handlers -------------------------------------------------------------------------

    def _on_append_entries(self, node: Any, message: dict) -> None:
        log = self._cursus_journal
        first, last = log[0][1], log[-1][1]

        def term_at(index: int) -> int | None:
            return int(log[index - first][2]) if first <= index <= last else None

        commit = max(self._SyncObj__raftCommitIndex, self._SyncObj__raftLastApplied)
        decision = decide_append(term_at, first, last, message["prevLogIdx"], message["prevLogTerm"],
                                 [tuple(entry) for entry in message.get("entries", ())],
                                 message["commit_index"], commit)
        if decision.truncate_from is not None:
            log.deleteEntriesFrom(decision.truncate_from - first)
        for entry in decision.append:
            log.add(*entry)
        # Stock handles the rest of AppendEntries (term, leader, election timer, state) for a message
        # without entries; given our safe commit index its commit update is exactly ours.
        SyncObj._SyncObj__onMessageReceived(self, node, {
            "type": "append_entries", "term": message["term"],
            "commit_index": decision.commit_index if decision.success else self._SyncObj__raftCommitIndex,
        })
        self._SyncObj__leaderCommitIndex = message["commit_index"]
        self._SyncObj__sendNextNodeIdx(node, reset=not decision.success,
                                       nextNodeIdx=decision.reply_next_index, success=decision.success)

    def _on_append_reply(self, node: Any, message: dict) -> None:
        next_index = self._SyncObj__raftNextIndex.get(node, message["next_node_idx"])
        match_index = self._SyncObj__raftMatchIndex.get(node, 0)
        next_index, match_index = next_after_reply(next_index, match_index, message["success"],
                                                   message["reset"], message["next_node_idx"])
        self._SyncObj__raftNextIndex[node] = next_index
        self._SyncObj__raftMatchIndex[node] = match_index
        self._SyncObj__lastResponseTime[node] = monotonic()

    # -- pre-vote -------------------------------------------------------------------------------

    def doTick(self, timeToWait: float = 0.0) -> None:  # noqa: N802, N803 - pysyncobj's interface
        """One pysyncobj tick, with an election only after a won pre-vote round (see the module doc)."""
        self._pre_vote_gate()
        SyncObj.doTick(self, timeToWait)

    def _majority(self, votes: int) -> bool:
        return votes > (len(self._SyncObj__otherNodes) + 1) / 2

    def _pre_vote_gate(self) -> None:
        passed, self._pre_vote_passed = self._pre_vote_passed, None
        if not self._pre_vote or self._SyncObj__selfNode is None or self._isLeader():
            return
        if self._SyncObj__transferInProgress:
            return  # the leader asked us to take over (TimeoutNow): elect at once
        now = monotonic()
        if self._SyncObj__raftElectionDeadline >= now:
            return
        if passed == self._SyncObj__raftCurrentTerm or self._majority(1):
            return  # a won round (or a one-node cluster): stock starts the election in this tick
        # Election due: ask first. Stock waits for a new timeout meanwhile; replies may end it early.
        self._SyncObj__raftElectionDeadline = now + self._SyncObj__generateRaftTimeout()
        self._pre_vote_round += 1
        self._pre_vote_term = self._SyncObj__raftCurrentTerm
        self._pre_vote_grants = set()
        self.pre_vote_rounds += 1
        _, last_index, last_term = self._cursus_journal[-1]
        request = {"type": PRE_VOTE, "round": self._pre_vote_round, "term": self._pre_vote_term + 1,
                   "last_log_index": last_index, "last_log_term": last_term}
        transport = self._SyncObj__transport
        for peer in self._SyncObj__otherNodes:
            transport.send(peer, request)

    def _on_pre_vote(self, node: Any, message: dict) -> None:
        _, last_index, last_term = self._cursus_journal[-1]
        try:
            candidate = (int(message["last_log_term"]), int(message["last_log_index"]))
        except (KeyError, TypeError, ValueError):
            candidate = (-1, -1)  # malformed: never granted
        leader_alive = self._isLeader() or monotonic() - self._leader_contact < self._leader_lease
        granted = not leader_alive and candidate >= (last_term, last_index)
        self._SyncObj__transport.send(node, {"type": PRE_VOTE_REPLY, "round": message.get("round"),
                                             "granted": granted})

    def _on_pre_vote_reply(self, node: Any, message: dict) -> None:
        if (not message.get("granted") or message.get("round") != self._pre_vote_round
                or self._pre_vote_term != self._SyncObj__raftCurrentTerm or self._isLeader()):
            return
        self._pre_vote_grants.add(node)
        if self._majority(len(self._pre_vote_grants) + 1):
            self._pre_vote_round += 1  # later replies of this round count for nothing
            self._pre_vote_passed = self._SyncObj__raftCurrentTerm
            self._SyncObj__raftElectionDeadline = 0.0
            self.pre_vote_wins += 1

    # -- driving --------------------------------------------------------------------------------

    def finish_round(self) -> None:
        """After each ``doTick``: send new entries/commit index, fsync the journal, release held replies.

        Raises:
            RaftFatal: :attr:`fatal` was set (e.g. a snapshot failed to load).
            OSError: the journal write/fsync failed. Either way the caller must stop the node.
        """
        if self.fatal is not None:
            raise RaftFatal(f"raft node stopped: {self.fatal}") from self.fatal
        last, commit = self._cursus_journal[-1][1], self._SyncObj__raftCommitIndex
        if self._isLeader() and (last > self._sent_index or commit > self._sent_commit):
            # New entries or a new commit index: tell followers now rather than at the next heartbeat.
            # They write in parallel with our own fsync below; we count ourselves towards a majority
            # only at the start of the next tick, after that fsync (Raft allows the overlap).
            self._SyncObj__sendAppendEntries()
        self._sent_index, self._sent_commit = last, commit
        self._cursus_journal.sync()
        replies, self._held_replies = self._held_replies, []
        transport = self._SyncObj__transport
        for node, reply in replies:
            transport.send(node, reply)

    # -- what RaftNode needs, so that it touches no pysyncobj internals itself (methods, not
    # properties: SyncObj.__init__ calls getattr on every attribute before the object is complete)

    def submit(self, payload: bytes, callback: Callable[[Any, int], None]) -> None:
        """Queue a regular entry (thread-safe). ``callback(result, fail_reason)`` runs on the tick
        thread once the entry is applied or has failed (on the caller's thread for QUEUE_FULL)."""
        self._applyCommand(payload, callback, _COMMAND_TYPE.REGULAR)

    def watch_readable(self, fd: int, callback: Callable[[int, int], None]) -> None:
        """Have the tick thread's poller call ``callback(fd, event)`` when ``fd`` is readable."""
        self._poller.subscribe(fd, callback, POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR)

    def leader_address(self) -> str | None:
        """The Raft address of the last known leader (possibly stale), or None."""
        leader = self._getLeader()
        return None if leader is None else str(leader.id)

    def is_leader(self) -> bool:
        """This node is in the leader state (a deposed leader may still be, see docs/cluster.md)."""
        return bool(self._isLeader())

    def connected_addresses(self) -> list[str]:
        """Raft addresses of the peers currently connected and authenticated."""
        transport = self._SyncObj__transport
        return [node.id for node in list(transport._nodes) if self.isNodeConnected(node)]

    def rejections(self) -> dict[str, int]:
        """Refused peer connections by reason (see :class:`MTLSTransport`)."""
        return dict(self._SyncObj__transport.rejections)

    def close(self) -> None:
        """Close sockets and the journal (tick thread, after the last round)."""
        self._doDestroy()


# ------------------------------------------------------------------------------------------------
# Transport: mutual TLS on the same fd, identity check, authentication deadline

_SEND_CHUNK = 64 * 1024
_WARN_INTERVAL = 10.0


class _TLSSocket:
    """The socket TcpConnection sees: TLS want-read/want-write become EAGAIN for its poller loop."""

    __slots__ = ("tls",)

    def __init__(self, tls: ssl.SSLSocket) -> None:
        self.tls = tls

    def send(self, data: bytes) -> int:
        try:
            # A retry after want-write passes the same leading bytes, as OpenSSL requires.
            return self.tls.send(data[:_SEND_CHUNK])
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise BlockingIOError(errno.EAGAIN, "TLS wants I/O") from None

    def recv(self, size: int) -> bytes:
        try:
            return self.tls.recv(size)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise BlockingIOError(errno.EAGAIN, "TLS wants I/O") from None

    def getsockopt(self, *args: Any) -> Any:
        return self.tls.getsockopt(*args)

    def setsockopt(self, *args: Any) -> None:
        self.tls.setsockopt(*args)

    def fileno(self) -> int:
        return self.tls.fileno()

    def close(self) -> None:
        self.tls.close()


class MTLSTransport(TCPTransport):
    """pysyncobj's TCPTransport with mutual TLS and certificate-identity checks.

    ``identities`` maps each member's Raft address (pysyncobj node id) to its node id (the certificate
    identity). ``rejections`` counts refused connections by reason (for tests and metrics).
    """

    def __init__(self, syncObj: SyncObj, selfNode: Any, otherNodes: Any, *,  # noqa: N803
                 server_context: ssl.SSLContext, client_context: ssl.SSLContext,
                 identities: Mapping[str, str], handshake_timeout: float) -> None:
        self._server_ctx, self._client_ctx = server_context, client_context
        self._identities = dict(identities)
        self._handshake_timeout = handshake_timeout
        self._handshaking: dict[TcpConnection, Callable[[str], None]] = {}
        self._deadlines: dict[TcpConnection, float] = {}
        self._peer_ids: dict[TcpConnection, str] = {}
        self.rejections: collections.Counter[str] = collections.Counter()
        self._warned: dict[str, float] = {}
        super().__init__(syncObj, selfNode, otherNodes)

    # -- TLS setup ----------------------------------------------------------------------------------

    def _reject(self, conn: TcpConnection, reason: str, detail: object = "") -> None:
        self.rejections[reason] += 1
        now = monotonic()
        # A misconfigured peer retries every reconnect period: warn once per reason per 10 s.
        level = logging.WARNING if now - self._warned.get(reason, -_WARN_INTERVAL) >= _WARN_INTERVAL \
            else logging.DEBUG
        if level == logging.WARNING:
            self._warned[reason] = now
        logger.log(level, "raft transport: refusing peer connection (%s, %d so far) %s", reason,
                   self.rejections[reason], detail)
        self._forget(conn)
        self._unknownConnections.discard(conn)
        conn.disconnect()

    def _forget(self, conn: TcpConnection) -> None:
        self._handshaking.pop(conn, None)
        self._deadlines.pop(conn, None)
        self._peer_ids.pop(conn, None)

    def _start_tls(self, conn: TcpConnection, server_side: bool, on_ready: Callable[[str], None]) -> None:
        raw = conn._TcpConnection__socket
        context = self._server_ctx if server_side else self._client_ctx
        try:
            # wrap_socket detaches ``raw`` and keeps its file descriptor: the poller subscription stays.
            tls = context.wrap_socket(raw, server_side=server_side, do_handshake_on_connect=False)
        except (OSError, ValueError) as exc:
            self._reject(conn, "tls_setup", exc)
            return
        conn._TcpConnection__socket = _TLSSocket(tls)
        self._handshaking[conn] = on_ready
        self._deadlines[conn] = monotonic() + self._handshake_timeout
        self._drive(conn, conn.fileno(), 0)

    def _drive(self, conn: TcpConnection, descr: int, event: int) -> None:
        on_ready = self._handshaking.get(conn)
        if on_ready is None or conn.state == CONNECTION_STATE.DISCONNECTED:
            return
        poller = self._syncObj._poller
        tls = conn._TcpConnection__socket.tls
        callback = functools.partial(self._drive, conn)
        if event & POLL_EVENT_TYPE.ERROR:
            self._reject(conn, "handshake_failed", "socket error")
            return
        try:
            tls.do_handshake()
        except ssl.SSLWantReadError:
            poller.subscribe(descr, callback, POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR)
            return
        except ssl.SSLWantWriteError:
            poller.subscribe(descr, callback, POLL_EVENT_TYPE.WRITE | POLL_EVENT_TYPE.ERROR)
            return
        except (OSError, ValueError) as exc:
            self._reject(conn, "handshake_failed", exc)
            return
        identity = peer_identity(tls)
        if identity is None:
            self._reject(conn, "no_identity", tls.getpeercert())
            return
        del self._handshaking[conn]
        self._peer_ids[conn] = identity
        poller.subscribe(descr, conn._TcpConnection__processConnection,
                         POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.WRITE | POLL_EVENT_TYPE.ERROR)
        on_ready(identity)

    # -- TCPTransport overrides -----------------------------------------------------------------

    def _onNewIncomingConnection(self, conn: TcpConnection) -> None:  # noqa: N802
        super()._onNewIncomingConnection(conn)
        self._start_tls(conn, True, lambda identity: None)

    def _onIncomingMessageReceived(self, conn: TcpConnection, message: Any) -> None:  # noqa: N802
        identity = self._peer_ids.get(conn)
        node = self._nodeAddrToNode.get(message) if isinstance(message, str) else None
        if identity is None or node is None or self._identities.get(node.address) != identity:
            self._reject(conn, "identity_mismatch", f"certificate {identity!r} announced {message!r}")
            return
        if self._shouldConnect(node):
            # We dial this peer ourselves; pysyncobj would adopt this connection object and later
            # redial on it without TLS.
            self._reject(conn, "wrong_direction", f"{identity!r} dialled us")
            return
        self._deadlines.pop(conn, None)
        super()._onIncomingMessageReceived(conn, message)

    def _onOutgoingConnected(self, conn: TcpConnection) -> None:  # noqa: N802
        self._start_tls(conn, False, functools.partial(self._outgoing_authenticated, conn))

    def _outgoing_authenticated(self, conn: TcpConnection, identity: str) -> None:
        node = self._connToNode(conn)
        expected = self._identities.get(node.address) if node is not None else None
        if identity != expected:
            self._reject(conn, "identity_mismatch", f"dialled {expected!r}, certificate {identity!r}")
            return
        self._deadlines.pop(conn, None)
        super()._onOutgoingConnected(conn)

    def _onDisconnected(self, conn: TcpConnection) -> None:  # noqa: N802
        self._forget(conn)
        super()._onDisconnected(conn)

    def _onTick(self) -> None:  # noqa: N802
        super()._onTick()
        now = monotonic()
        for conn, deadline in list(self._deadlines.items()):
            if now > deadline:
                self._reject(conn, "authentication_timeout")

    def send(self, node: Any, message: Any) -> bool:
        conn = self._connections.get(node)
        if conn is not None and (conn in self._handshaking or conn in self._deadlines):
            return False  # not authenticated yet: nothing leaves before the identity check
        return bool(super().send(node, message))
