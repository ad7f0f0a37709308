"""The cluster transaction store (RaftTxnStore): TxnSync commands from the shard owner, producer ids per
shard, and failures never reported as success (an unknown Raft outcome is ``transaction_sync_failed
outcome=unknown``)."""

from __future__ import annotations

import asyncio

import pytest

from cursus.metadata.apply import apply
from cursus.metadata.commands import BrokerHeartbeat, Command, TxnSync
from cursus.metadata.state import BrokerInfo, MetadataState, transaction_shard
from cursus.transactions.state import TxnEntry
from cursus.transactions.store import RaftTxnStore
from cursus.wire.errors import BrokerError

SHARDS = 4


def _state() -> MetadataState:
    state = MetadataState(cluster=True)
    for b in ("a", "b", "c"):
        state, _ = apply(state, BrokerHeartbeat(f"hb-{b}", BrokerInfo(b, f"host-{b}:900{'abc'.index(b)}"), SHARDS))
    return state


class Fsm:
    """Applies submitted commands to a state, or fails them as told."""

    def __init__(self) -> None:
        self.state = _state()
        self.fail: BrokerError | None = None
        self.submitted: list[Command] = []

    async def submit(self, command: Command):  # type: ignore[no-untyped-def]
        self.submitted.append(command)
        if self.fail is not None:
            raise self.fail
        self.state, result = apply(self.state, command)
        return result


def _store(fsm: Fsm, tid: str) -> RaftTxnStore:
    owner = fsm.state.txn_shards[transaction_shard(tid, SHARDS)].owner
    assert owner is not None
    return RaftTxnStore(owner, fsm.submit, lambda: fsm.state,
                        lambda b: fsm.state.brokers[b].client_address if b in fsm.state.brokers else "")


def test_persist_commits_one_txn_sync_and_producer_ids_stay_in_the_shard() -> None:
    fsm = Fsm()
    store = _store(fsm, "t1")
    shard = transaction_shard("t1", SHARDS)
    pid, counter = store.new_producer_id("t1")
    pid2, _ = store.new_producer_id("t1")  # reserved: concurrent inits never share an id
    assert int(pid) % SHARDS == shard and pid2 != pid
    asyncio.run(store.persist(TxnEntry("t1", pid, 1), touched=[("out", 0)], next_producer_id=counter))
    [command] = fsm.submitted
    assert isinstance(command, TxnSync) and command.origin == store.broker_id and command.touched == (("out", 0),)
    assert fsm.state.txn_entry("t1") == TxnEntry("t1", pid, 1) and store.pending == set()
    assert store.coordinator_epoch("t1") == fsm.state.txn_shards[shard].epoch >= 1


def test_an_unknown_outcome_is_never_success() -> None:
    fsm = Fsm()
    store = _store(fsm, "t1")
    fsm.fail = BrokerError.of("request_timeout", outcome="unknown", request_id="x")
    with pytest.raises(BrokerError) as info:
        asyncio.run(store.persist(TxnEntry("t1", "5", 1), touched=[], next_producer_id=None))
    assert info.value.error.code == "transaction_sync_failed" and info.value.error.fields["outcome"] == "unknown"
    fsm.fail = BrokerError.of("no_raft_leader", reason="election")
    with pytest.raises(BrokerError) as info:
        asyncio.run(store.persist(TxnEntry("t1", "5", 1), touched=[], next_producer_id=None))
    assert info.value.error.fields["outcome"] == "not_applied" and store.pending == set()


def test_a_non_owner_is_redirected_to_the_owner() -> None:
    fsm = Fsm()
    owner = _store(fsm, "t1").broker_id
    other = next(b for b in "abc" if b != owner)
    store = RaftTxnStore(other, fsm.submit, lambda: fsm.state, lambda b: fsm.state.brokers[b].client_address)
    with pytest.raises(BrokerError) as info:
        asyncio.run(store.persist(TxnEntry("t1", "5", 1), touched=[], next_producer_id=None))
    err = info.value.error
    assert err.code == "NOT_COORDINATOR" and err.fields["host"] == f"host-{owner}" and fsm.submitted == []


def test_a_transaction_too_large_for_one_txn_sync_is_refused_before_it_grows() -> None:
    """Item: a TxnSync is one Raft command (64 KiB). Growing a transaction (a new participant partition,
    staged offsets) is refused up front (``transaction_too_large``) when its largest later form would not
    fit, so prepare_commit, the decision and an abort of any accepted transaction always fit."""
    import dataclasses

    from cursus.cluster.raft.commands import MAX_COMMAND_BYTES
    from cursus.metadata.commands import encode
    from cursus.transactions import state as st

    fsm = Fsm()
    tid = "big-" + "x" * 240
    store = _store(fsm, tid)
    store.max_state_bytes = 10**9  # only the Raft limit applies
    pid, counter = store.new_producer_id(tid)
    entry = st.begin(TxnEntry(tid, pid, 1), tid, pid, 1, now_ms=1, timeout_ms=60000)
    topic = "t" * 249
    accepted = 0
    with pytest.raises(BrokerError) as refused:
        for p in range(10_000):
            grown = st.add_partition(entry, (topic, p))
            store.check_fits(grown, touched=[(topic, p)])
            entry = grown
            accepted += 1
    assert refused.value.error.code == "transaction_too_large" and 100 < accepted < 1000
    shard = transaction_shard(tid, SHARDS)
    owner = fsm.state.txn_shards[shard]
    # every later form of the accepted entry fits one command, with the largest counters and message counts
    entry = dataclasses.replace(entry, messages=10**12)
    for later in (st.end(entry, tid, pid, 1, "commit", now_ms=2), st.end(entry, tid, pid, 1, "abort", now_ms=2),
                  st.complete(st.end(entry, tid, pid, 1, "commit", now_ms=2), 3), st.expire(entry, 10**12)):
        assert later is not None
        command = TxnSync("f" * 32, store.broker_id, shard, owner.epoch, (later,), 2**62, ((topic, 9999),),
                          (pid, 2**31))
        assert len(encode(command)) <= MAX_COMMAND_BYTES
    # the configured limit applies first (both stores)
    store.max_state_bytes = 2048
    with pytest.raises(BrokerError) as small:
        store.check_fits(entry, touched=[])
    assert small.value.error.code == "transaction_too_large" and small.value.error.fields["limit"] == "2048"
