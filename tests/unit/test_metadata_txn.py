"""Transaction state in the cluster metadata: the TxnSync command (codec, apply rules: shard ownership and
epoch fencing), shard epochs bumped in the same command that moves an owner, and snapshot v3 (round trip;
v2 states are read with no transaction state)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from cursus.cluster.fsm import MetadataFSM, decode_result
from cursus.metadata.apply import apply
from cursus.metadata.commands import BrokerHeartbeat, Command, FenceBroker, TxnSync, decode, encode
from cursus.metadata.snapshot import decode_state, encode_state
from cursus.metadata.state import BrokerInfo, MetadataState, transaction_shard
from cursus.transactions.state import TxnEntry
from cursus.wire.errors import BrokerError

BROKERS = ("a", "b", "c")
SHARDS = 4


def _cluster(*brokers: str) -> MetadataState:
    state = MetadataState(cluster=True)
    for b in brokers:
        state, _ = apply(state, BrokerHeartbeat(f"hb-{b}", BrokerInfo(b, f"{b}:9000"), SHARDS))
    return state


def _sync(state: MetadataState, tid: str = "t1", *, origin: str | None = None, epoch: int | None = None,
          entry: TxnEntry | None = None, rid: str = "r", touched: tuple[tuple[str, int], ...] = ()) -> TxnSync:
    shard = transaction_shard(tid, SHARDS)
    owner = state.txn_shards[shard]
    entry = entry or TxnEntry(tid, str(SHARDS + shard), 1)
    return TxnSync(rid, origin or owner.owner or "", shard, owner.epoch if epoch is None else epoch, (entry,),
                   2, touched)


def _code(state: MetadataState, command: TxnSync) -> str:
    with pytest.raises(BrokerError) as info:
        apply(state, command)
    return info.value.error.code


def test_codec_round_trip_and_strict() -> None:
    state = _cluster(*BROKERS)
    command = _sync(state, touched=(("out", 1),))
    assert decode(encode(command)) == command
    doc = json.loads(encode(command))
    doc["entries"][0]["state"] = "bogus"
    with pytest.raises(ValueError):
        decode(json.dumps(doc).encode())
    doc = json.loads(encode(command))
    del doc["touched"]
    with pytest.raises(ValueError):
        decode(json.dumps(doc).encode())


def test_only_the_shard_owner_at_its_epoch_may_persist() -> None:
    state = _cluster(*BROKERS)
    shard = transaction_shard("t1", SHARDS)
    owner = state.txn_shards[shard].owner
    other = next(b for b in BROKERS if b != owner)
    assert _code(state, _sync(state, origin=other)) == "NOT_COORDINATOR"
    assert _code(state, _sync(state, epoch=state.txn_shards[shard].epoch + 1)) == "NOT_COORDINATOR"
    new, result = apply(state, _sync(state, touched=(("out", 0),)))
    assert result.changed and new.revision == state.revision + 1 and "r" not in new.applied
    assert new.txn_entry("t1") == TxnEntry("t1", str(SHARDS + shard), 1)
    assert new.txn[shard].next_producer_id == 2 and ("out", 0) in new.txn_touched
    assert _code(MetadataState(), _sync(state)) == "invalid_cluster_request"  # standalone


def test_an_owner_change_bumps_the_epoch_and_fences_the_previous_owner() -> None:
    state = _cluster(*BROKERS)
    shard = transaction_shard("t1", SHARDS)
    old = state.txn_shards[shard]
    stale = _sync(state)
    fenced, _ = apply(state, FenceBroker("f", old.owner or ""))
    now = fenced.txn_shards[shard]
    assert now.owner != old.owner and now.epoch == old.epoch + 1
    assert _code(fenced, stale) == "NOT_COORDINATOR"
    moved, _ = apply(fenced, _sync(fenced))
    assert moved.txn_entry("t1") is not None


def test_ids_of_another_shard_and_epochs_moving_back_are_refused() -> None:
    state = _cluster(*BROKERS)
    other = next(f"x{i}" for i in range(100) if transaction_shard(f"x{i}", SHARDS) != transaction_shard("t1", SHARDS))
    bad = _sync(state, entry=TxnEntry(other, "9", 1))
    assert _code(state, bad) == "invalid_cluster_request"
    state, _ = apply(state, _sync(state, entry=TxnEntry("t1", "7", 3)))
    assert _code(state, _sync(state, entry=TxnEntry("t1", "7", 2))) == "invalid_cluster_request"
    assert _code(state, _sync(state, entry=TxnEntry("t1", "8", 4))) == "invalid_cluster_request"


def test_snapshot_v3_round_trip_and_v2_has_no_transactions() -> None:
    state = _cluster(*BROKERS)
    state, _ = apply(state, _sync(state, touched=(("out", 0), ("out", 1))))
    raw = encode_state(state)
    doc = json.loads(raw)
    assert doc["v"] == 3
    restored = decode_state(raw)
    assert restored.txn == state.txn and restored.txn_touched == state.txn_touched and encode_state(restored) == raw
    fsm = MetadataFSM(MetadataState(cluster=True))
    fsm.restore(raw)
    assert fsm.state.txn_entry("t1") == state.txn_entry("t1")
    doc["v"] = 2  # written before cluster transactions existed: read with none
    del doc["txn"], doc["txn_touched"]
    old = decode_state(json.dumps(doc).encode())
    assert old.txn == {} and old.txn_touched == frozenset() and old.txn_shards == state.txn_shards
    doc["v"] = 3  # a v3 state must carry them
    with pytest.raises(ValueError):
        decode_state(json.dumps(doc).encode())
    doc = json.loads(raw)
    doc["txn"][0][3][0]["epoch"] = 0
    with pytest.raises(ValueError):
        decode_state(json.dumps(doc).encode())


TIDS = ("t1", "t2", "t3", "t4", "t5")
_step = hs.one_of(
    hs.tuples(hs.just("sync"), hs.sampled_from(TIDS), hs.sampled_from(BROKERS), hs.integers(-1, 1),
              hs.integers(1, 4)),
    hs.tuples(hs.just("fence"), hs.sampled_from(BROKERS)),
    hs.tuples(hs.just("beat"), hs.sampled_from(BROKERS)),
)


@settings(max_examples=150, deadline=None)
@given(hs.lists(_step, max_size=40))
def test_txn_sync_apply_rules(steps: list[tuple]) -> None:
    """Accepted exactly when the origin owns the shard at the shard's epoch; an owner change bumps the epoch;
    the stored entry per id is the last accepted one; counters only grow; FSM replay and snapshots agree."""
    state = _cluster(*BROKERS)
    commands: list[Command] = []
    last: dict[str, TxnEntry] = {}
    for n, s in enumerate(steps):
        if s[0] == "sync":
            _, tid, origin, epoch_delta, producer_epoch = s
            shard = transaction_shard(tid, SHARDS)
            current = state.txn_shards[shard]
            previous = state.txn_entry(tid)
            entry = TxnEntry(tid, str(SHARDS + shard), producer_epoch)
            command: Command = TxnSync(f"s{n}", origin, shard, max(current.epoch + epoch_delta, 0), (entry,),
                                       n + 1)
        elif s[0] == "fence":
            command = FenceBroker(f"f{n}", s[1])
        else:
            command = BrokerHeartbeat(f"h{n}", BrokerInfo(s[1], f"{s[1]}:9000"), SHARDS)
        commands.append(command)
        try:
            new, _ = apply(state, command)
        except BrokerError:
            new = None
        if isinstance(command, TxnSync):
            current = state.txn_shards[command.shard]
            fenced = current.owner != command.origin or current.epoch != command.shard_epoch
            backwards = previous is not None and command.entries[0].epoch < previous.epoch
            assert (new is None) == (fenced or backwards)
            if new is not None:
                last[command.entries[0].transactional_id] = command.entries[0]
                assert new.txn[command.shard].next_producer_id >= state.txn.get(command.shard, new.txn[
                    command.shard]).next_producer_id
        elif new is not None:
            for shard, owner in new.txn_shards.items():
                before = state.txn_shards[shard]
                assert owner.epoch == before.epoch + (owner.owner != before.owner)
        if new is not None:
            state = new
    assert {tid: state.txn_entry(tid) for tid in last} == last
    fsm = MetadataFSM(MetadataState(cluster=True))
    for b in BROKERS:
        decode_result(fsm.apply(encode(BrokerHeartbeat(f"hb-{b}", BrokerInfo(b, f"{b}:9000"), SHARDS))))
    for command in commands:
        fsm.apply(encode(command))
    assert encode_state(fsm.state) == encode_state(state)
    assert encode_state(decode_state(encode_state(state))) == encode_state(state)


def test_prepare_commit_checks_the_offsets_group_fence_in_raft_order() -> None:
    from tests.unit.test_metadata_groups import cmd, members, reg

    state = _cluster(*BROKERS)
    state, _ = apply(state, cmd(state, reg(), members()))  # group g: m-0001 owns t/0 and t/1 at generation 1
    shard = transaction_shard("t1", SHARDS)
    base = TxnEntry("t1", str(SHARDS + shard), 1, "open", partitions=(("out", 0),), group="g", member="m-0001",
                    generation=1, offsets=(("t", 0, 5),))
    state, _ = apply(state, _sync(state, entry=base, rid="open"))

    def prepare(**changes: object) -> TxnSync:
        import dataclasses
        return _sync(state, entry=dataclasses.replace(base, state="prepare_commit", **changes), rid="p")

    assert _code(state, prepare(generation=2)) == "GEN_MISMATCH"
    assert _code(state, prepare(member="m-0002")) == "member_not_found"
    assert _code(state, prepare(offsets=(("t", 0, 5), ("t", 2, 1)))) == "NOT_OWNER"
    assert _code(state, prepare(group="nope")) == "group_not_found"
    prepared, _ = apply(state, prepare())
    assert prepared.txn_entry("t1").state == "prepare_commit"
    # once prepared the decision stands: its retry and the final decision are not re-fenced
    moved, _ = apply(prepared, cmd(prepared, members(generation=2, revision=2)))
    again, _ = apply(moved, _sync(moved, entry=prepared.txn_entry("t1"), rid="p2"))
    assert again.txn_entry("t1").state == "prepare_commit"


def test_guarded_init_expect_is_checked_in_raft_order() -> None:
    """TxnSync.expect (INIT_PRODUCER_ID producerId= epoch=): applied only while the id still holds exactly
    that session; encoded only when set (older commands keep their bytes)."""
    import dataclasses

    state = _cluster(*BROKERS)
    shard = transaction_shard("t1", SHARDS)
    pid = str(SHARDS + shard)
    plain = _sync(state, entry=TxnEntry("t1", pid, 1, "committed"), rid="r1")
    assert "expect" not in json.loads(encode(plain))
    state, _ = apply(state, plain)
    guarded = dataclasses.replace(_sync(state, entry=TxnEntry("t1", pid, 2), rid="r2"), expect=(pid, 1))
    assert decode(encode(guarded)) == guarded
    # another instance bumped the id first (plain re-init to epoch 2, then its transaction)
    state, _ = apply(state, _sync(state, entry=TxnEntry("t1", pid, 2, "committed"), rid="r3"))
    assert _code(state, guarded) == "producer_fenced"
    assert _code(state, dataclasses.replace(guarded, expect=("other", 2))) == "producer_fenced"
    assert _code(state, dataclasses.replace(guarded, entries=(TxnEntry("t-new", pid, 1),), expect=(pid, 1))) \
        in ("producer_fenced", "invalid_cluster_request")
    ok = dataclasses.replace(guarded, entries=(TxnEntry("t1", pid, 3),), expect=(pid, 2))
    new, result = apply(state, ok)
    assert result.changed and new.txn[shard].entries["t1"].epoch == 3
    doc = json.loads(encode(ok))
    doc["expect"] = [pid]
    with pytest.raises(ValueError):
        decode(json.dumps(doc).encode())


def test_guarded_init_retry_is_admitted_by_the_fsm() -> None:
    """An owner whose view trails the log (its guarded bump's outcome unknown, applied meanwhile) retries
    the same bump: the FSM admits it (the same epoch again), but not once another instance re-initialized."""
    import dataclasses

    state = _cluster(*BROKERS)
    pid = str(SHARDS + transaction_shard("t1", SHARDS))
    state, _ = apply(state, _sync(state, entry=TxnEntry("t1", pid, 1, "committed"), rid="r1"))
    bump = dataclasses.replace(_sync(state, entry=TxnEntry("t1", pid, 2, reinit_from=1), rid="r2"), expect=(pid, 1))
    state, _ = apply(state, bump)
    retried, result = apply(state, dataclasses.replace(bump, request_id="r3"))
    assert result.changed and retried.txn_entry("t1") == TxnEntry("t1", pid, 2, reinit_from=1)
    state, _ = apply(state, _sync(state, entry=TxnEntry("t1", pid, 3), rid="r4"))  # plain re-init elsewhere
    assert _code(state, dataclasses.replace(bump, request_id="r5")) == "producer_fenced"
