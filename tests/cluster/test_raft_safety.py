"""The Raft log-matching fixes (cursus.cluster.raft.safety) and their wiring into pysyncobj."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pysyncobj import SyncObj, SyncObjConf
from pysyncobj.node import TCPNode

from cursus.cluster.raft.compat import CursusSyncObj, MTLSTransport
from cursus.cluster.raft.journal import DurableJournal
from cursus.cluster.raft.safety import SafetyViolation, decide_append, next_after_reply
from cursus.cluster.tls import client_context, server_context
from tests.cluster.raftsupport import RaftPki, free_ports, members_on


def _log(terms: list[int], first: int = 1) -> tuple:
    """A follower log with entries first.. having ``terms``; returns (term_at, first, last)."""
    def term_at(index: int) -> int | None:
        return terms[index - first] if first <= index < first + len(terms) else None
    return term_at, first, first + len(terms) - 1


def _entries(start: int, terms: list[int]) -> list[tuple[bytes, int, int]]:
    return [(b"c%d" % (start + k), start + k, term) for k, term in enumerate(terms)]


def test_stale_batch_keeps_matching_entries_beyond_it() -> None:
    term_at, first, last = _log([0] + [1] * 9)  # entries 1..10
    decision = decide_append(term_at, first, last, 5, 1, _entries(6, [1, 1]), leader_commit=7, commit_index=3)
    assert decision.success and decision.truncate_from is None and decision.append == ()
    assert decision.reply_next_index == 8  # only what this message verified
    assert decision.commit_index == 7


def test_conflicting_term_truncates_from_the_conflict() -> None:
    term_at, first, last = _log([0, 1, 1, 2, 2])  # entries 1..5, 4 and 5 from a deposed leader
    decision = decide_append(term_at, first, last, 3, 1, _entries(4, [3, 3, 3]), leader_commit=9, commit_index=3)
    assert decision.truncate_from == 4
    assert [entry[1] for entry in decision.append] == [4, 5, 6]
    assert decision.reply_next_index == 7
    assert decision.commit_index == 6  # min(leader commit, last new entry)


def test_commit_is_bounded_by_last_new_entry_not_log_end() -> None:
    term_at, first, last = _log([0, 1, 1, 1, 1, 1])  # 1..6
    decision = decide_append(term_at, first, last, 2, 1, [], leader_commit=6, commit_index=1)
    assert decision.commit_index == 2


def test_commit_never_decreases() -> None:
    term_at, first, last = _log([0, 1, 1, 1])
    decision = decide_append(term_at, first, last, 2, 1, [], leader_commit=1, commit_index=4)
    assert decision.commit_index == 4


def test_mismatch_replies() -> None:
    term_at, first, last = _log([0, 1, 1])
    assert decide_append(term_at, first, last, 7, 1, [], 0, 1).reply_next_index == 4  # beyond the end
    missing = decide_append(term_at, first, last, 3, 2, [], 0, 1)
    assert not missing.success and missing.reply_next_index == 3  # term mismatch: step back


def test_conflict_with_committed_entry_is_a_safety_violation() -> None:
    term_at, first, last = _log([0, 1, 1, 1])
    with pytest.raises(SafetyViolation):
        decide_append(term_at, first, last, 2, 1, _entries(3, [5]), leader_commit=4, commit_index=3)


def test_leader_next_index_never_moves_back_on_success() -> None:
    assert next_after_reply(20, 5, True, False, 8) == (20, 7)
    assert next_after_reply(8, 7, True, False, 21) == (21, 20)
    assert next_after_reply(20, 9, True, False, 8) == (20, 9)  # a late ack never lowers matchIndex
    assert next_after_reply(20, 9, False, True, 12) == (12, 9)  # a real mismatch moves it back


@given(st.lists(st.integers(1, 3), min_size=1, max_size=12).map(sorted),
       st.integers(0, 12), st.integers(0, 6), st.integers(1, 3))
def test_follower_keeps_every_matching_entry(terms: list[int], prev: int, count: int, term: int) -> None:
    """Whatever the message, no entry that matches the leader is deleted, and entries before a conflict
    stay; the follower's log after the decision is a prefix-extension consistent with the message."""
    log = [0] + terms  # index 1 is pysyncobj's initial no-op of term 0
    term_at, first, last = _log(log)
    if not (first <= prev <= last):
        return
    leader_terms = [log[i - 1] if i <= last else term for i in range(prev + 1, prev + 1 + count)]
    decision = decide_append(term_at, first, last, prev, log[prev - 1], _entries(prev + 1, leader_terms), 0, 1)
    assert decision.success and decision.truncate_from is None  # every entry matched the log


# -- wiring: the same scenario through pysyncobj's message handler, stock vs ours -------------------


def _syncobj(pki: RaftPki, tmp: Path, stock: bool) -> SyncObj:
    ports = free_ports(3)
    members = members_on(ports)
    conf = SyncObjConf(autoTick=False, appendEntriesUseBatch=True, bindAddress=members["node-1"],
                       maxBindRetries=1, commandsWaitLeader=False)
    partners = [members["node-2"], members["node-3"]]
    if stock:
        return SyncObj(members["node-1"], partners, conf=conf)
    transport = lambda *a: MTLSTransport(*a, server_context=server_context(pki.files("node-1")),  # noqa: E731
                                         client_context=client_context(pki.files("node-1")),
                                         identities={v: k for k, v in members.items()}, handshake_timeout=2)
    return CursusSyncObj(members["node-1"], partners, conf, DurableJournal(tmp), lambda payload: b"",
                         transport)


def _append(obj: SyncObj, leader: TCPNode, prev: int, entries: list, commit: int = 0) -> None:
    obj._SyncObj__onMessageReceived(leader, {
        "type": "append_entries", "term": 1, "commit_index": commit, "prevLogIdx": prev, "prevLogTerm": 1 if prev > 1 else 0,
        "entries": entries})


@pytest.mark.parametrize("stock", [True, False], ids=["stock-pysyncobj", "cursus"])
def test_stale_append_entries_message(pki: RaftPki, tmp_path: Path, stock: bool) -> None:
    """Entries 2..10 arrive, then a late batch for 6..7 (what a backwards nextIndex resends). Stock
    pysyncobj truncates 8..10 - entries it already acknowledged; ours keeps them."""
    obj = _syncobj(pki, tmp_path, stock)
    try:
        leader = TCPNode(next(iter(obj.otherNodes)).id)
        _append(obj, leader, 1, _entries(2, [1] * 9))
        _append(obj, leader, 5, _entries(6, [1, 1]))
        indexes = [entry[1] for entry in obj._SyncObj__raftLog[:]]
        if stock:
            assert indexes == list(range(1, 8)), "pysyncobj changed: re-verify the compat layer"
        else:
            assert indexes == list(range(1, 11))
            replies = [message["next_node_idx"] for _node, message in obj._held_replies]
            assert replies == [11, 8]  # held until the journal sync, each names what it verified
    finally:
        obj._doDestroy()


def test_leader_ignores_late_success_reply(pki: RaftPki, tmp_path: Path) -> None:
    obj = _syncobj(pki, tmp_path, stock=False)
    try:
        follower = next(iter(obj.otherNodes))
        obj._SyncObj__raftNextIndex[follower], obj._SyncObj__raftMatchIndex[follower] = 20, 5
        obj._on_append_reply(follower, {"type": "next_node_idx", "next_node_idx": 8, "success": True,
                                        "reset": False})
        assert (obj._SyncObj__raftNextIndex[follower], obj._SyncObj__raftMatchIndex[follower]) == (20, 7)
    finally:
        obj._doDestroy()


def test_replies_leave_only_after_the_journal_sync(pki: RaftPki, tmp_path: Path) -> None:
    obj = _syncobj(pki, tmp_path, stock=False)
    try:
        leader = TCPNode(next(iter(obj.otherNodes)).id)
        events: list[str] = []
        journal, transport = obj._cursus_journal, obj._SyncObj__transport
        real_sync = journal.sync
        journal.sync = lambda: (events.append("sync"), real_sync())  # type: ignore[method-assign]
        transport.send = lambda node, message: events.append(message["type"]) or True  # type: ignore[method-assign]
        _append(obj, leader, 1, _entries(2, [1, 1, 1]))
        assert events == [] and journal.needs_sync
        obj.finish_round()
        assert events == ["sync", "next_node_idx"] and not journal.needs_sync

        def broken_sync() -> None:
            events.append("sync")
            raise OSError(5, "EIO")
        journal.sync = broken_sync  # type: ignore[method-assign]
        _append(obj, leader, 4, _entries(5, [1]))
        events.clear()
        with pytest.raises(OSError):
            obj.finish_round()
        assert events == ["sync"]  # the reply acknowledging entry 5 never leaves
    finally:
        obj._doDestroy()


@given(st.lists(st.integers(1, 4), min_size=1, max_size=25).map(sorted),
       st.lists(st.tuples(st.integers(0, 30), st.integers(0, 6)), max_size=40))
def test_acknowledged_prefix_survives_any_order_of_leader_batches(terms: list[int],
                                                                 messages: list[tuple[int, int]]) -> None:
    """One leader's batches, delivered late, repeated or out of order, never remove an entry the
    follower already acknowledged (stock pysyncobj's truncate-after-prevLogIdx fails this)."""
    leader = [(b"noop", 1, 0)] + [(b"c%d" % i, i, term) for i, term in enumerate(terms, start=2)]
    follower = [leader[0]]
    acknowledged = 1
    for prev, count in messages:
        if not 1 <= prev <= len(leader):
            continue
        batch = leader[prev:prev + count]
        term_at = _log([entry[2] for entry in follower])[0]
        decision = decide_append(term_at, 1, len(follower), prev, leader[prev - 1][2], batch, 0, 1)
        if decision.truncate_from is not None:
            del follower[decision.truncate_from - 1:]
        follower += decision.append
        if decision.success:
            acknowledged = max(acknowledged, decision.reply_next_index - 1)
        assert follower[:acknowledged] == leader[:acknowledged]
