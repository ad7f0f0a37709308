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
