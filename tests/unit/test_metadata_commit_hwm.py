"""CommitHwm: encoding, the per-entry apply rules, and the properties that matter (a committed HWM never
decreases; a stale commit never changes state) under arbitrary cluster command sequences."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cursus.cluster.fsm import MetadataFSM, decode_result
from cursus.metadata.apply import apply
from cursus.metadata.commands import (
    BrokerHeartbeat,
    ChangeIsr,
    Command,
    CommitHwm,
    CreateTopic,
    ElectLeader,
    FenceBroker,
    HwmEntry,
    RegisterBroker,
    decode,
    encode,
)
from cursus.metadata.snapshot import decode_state, encode_state
from cursus.metadata.state import BrokerInfo, MetadataState
from cursus.metadata.topics import TopicSpec
from cursus.params import parse_args
from cursus.wire.errors import BrokerError


def _spec(name: str, **fields: str) -> TopicSpec:
    return parse_args(TopicSpec, {"topic": name, **fields}, "CREATE")


def _cluster(*brokers: str) -> MetadataState:
    state = MetadataState(cluster=True)
    for b in brokers:
        state, _ = apply(state, BrokerHeartbeat(f"hb-{b}", BrokerInfo(b, f"{b}:9000"), 50))
    return state


def _with_topic(state: MetadataState, rf: int = 3, partitions: int = 2) -> MetadataState:
    state, _ = apply(state, CreateTopic("c", _spec("t", partitions=str(partitions), replication_factor=str(rf))))
    return state


def test_encoding_is_canonical_and_strict() -> None:
    command = CommitHwm("r1", "a", (HwmEntry("t", 0, 1, 0, 10), HwmEntry("u", 3, 2, 1, 7)))
    raw = encode(command)
    assert raw == (b'{"broker_id":"a","entries":[["t",0,1,0,10],["u",3,2,1,7]],"request_id":"r1",'
                   b'"type":"commit_hwm","v":1}')
    assert decode(raw) == command
    for bad in (b'{"broker_id":"a","entries":[["t",0,1,0]],"request_id":"r","type":"commit_hwm","v":1}',
                b'{"broker_id":"a","entries":[["t",0,1,0,-1]],"request_id":"r","type":"commit_hwm","v":1}',
                b'{"broker_id":"a","entries":[["t","0",1,0,1]],"request_id":"r","type":"commit_hwm","v":1}',
                b'{"broker_id":"a","entries":{},"request_id":"r","type":"commit_hwm","v":1}',
                b'{"broker_id":"a","request_id":"r","type":"commit_hwm","v":1}'):
        with pytest.raises(ValueError):
            decode(bad)


def test_entries_apply_one_by_one_with_reasons() -> None:
    state = _with_topic(_cluster("a", "b", "c"))
    leader = state.assignments[("t", 0)].leader
    assert leader is not None
    other = next(b for b in "abc" if b != leader)
    a0 = state.assignments[("t", 0)]
    p1 = state.assignments[("t", 1)]
    entries = (
        HwmEntry("t", 0, a0.leader_epoch, a0.lifecycle_epoch, 5),        # accepted
        HwmEntry("t", 0, a0.leader_epoch, a0.lifecycle_epoch, 8),        # the latest of one partition wins
        HwmEntry("t", 1, p1.leader_epoch, p1.lifecycle_epoch, 3),        # accepted only if we lead t-1
        HwmEntry("t", 0, a0.leader_epoch - 1, a0.lifecycle_epoch, 9),    # stale epoch
        HwmEntry("t", 0, a0.leader_epoch + 1, a0.lifecycle_epoch, 9),    # from the future: fenced
        HwmEntry("t", 0, a0.leader_epoch, a0.lifecycle_epoch + 1, 9),    # another lifecycle
        HwmEntry("t", 0, a0.leader_epoch, a0.lifecycle_epoch, 4),        # backwards
        HwmEntry("t", 9, 1, 0, 4),                                       # unknown partition
    )
    new, result = apply(state, CommitHwm("r", leader, entries))
    assert new.assignments[("t", 0)].committed_hwm == 8 and new.revision == state.revision + 1
    reasons = [r for _, _, r in result.hwm_rejected]
    leads_p1 = p1.leader == leader
    assert new.assignments[("t", 1)].committed_hwm == (3 if leads_p1 else 0)
    assert reasons == ([] if leads_p1 else ["NOT_PARTITION_LEADER"]) + [
        "STALE_LEADER_EPOCH", "PARTITION_LEADER_FENCED", "PARTITION_LEADER_FENCED", "hwm_not_above_committed",
        "partition_metadata_not_found"]
    assert ("t", 0) in result.hwm_accepted and result.changed
    # a command from a broker that does not lead: nothing changes, no error
    same, refused = apply(new, CommitHwm("r2", other, (HwmEntry("t", 0, a0.leader_epoch, 0, 20),)))
    assert same is new and not refused.changed and refused.hwm_rejected == (("t", 0, "NOT_PARTITION_LEADER"),)
    # not recorded as an applied request: the bounded record stays for commands whose retries need it
    assert "r" not in new.applied
    # a retry of the same command is a no-op by monotonicity
    again, retry = apply(new, CommitHwm("r", leader, entries[:2]))
    assert again is new and not retry.changed


def test_standalone_never_takes_commit_hwm() -> None:
    state, _ = apply(MetadataState(initial_leader_epoch=0), RegisterBroker("reg", BrokerInfo("x", "x:1")))
    state, _ = apply(state, CreateTopic("c", _spec("t")))
    with pytest.raises(BrokerError) as info:
        apply(state, CommitHwm("r", "x", (HwmEntry("t", 0, 0, 0, 1),)))
    assert info.value.error.code == "invalid_cluster_request"


def test_results_round_trip_through_the_fsm_and_snapshots() -> None:
    fsm = MetadataFSM(_with_topic(_cluster("a", "b"), rf=2))
    a0 = fsm.state.assignments[("t", 0)]
    assert a0.leader is not None
    raw = fsm.apply(encode(CommitHwm("r", a0.leader, (HwmEntry("t", 0, a0.leader_epoch, 0, 4),
                                                       HwmEntry("t", 0, a0.leader_epoch + 3, 0, 9)))))
    result = decode_result(raw)
    assert result.hwm_accepted == (("t", 0),) and result.hwm_rejected == (("t", 0, "PARTITION_LEADER_FENCED"),)
    assert decode_state(encode_state(fsm.state)) == fsm.state
    assert fsm.state.assignments[("t", 0)].committed_hwm == 4


# --------------------------------------------------------------------------------------- properties

BROKERS = st.sampled_from(["a", "b", "c"])
TOPIC_KEYS = st.tuples(st.sampled_from(["x", "y"]), st.integers(0, 2))


def _commit(broker: str, key: tuple[str, int], epoch: int, lifecycle: int, hwm: int, rid: int) -> CommitHwm:
    return CommitHwm(f"h{rid}", broker, (HwmEntry(key[0], key[1], epoch, lifecycle, hwm),))


COMMANDS = st.one_of(
    st.builds(lambda b, r: BrokerHeartbeat(f"hb{r}", BrokerInfo(b, f"{b}:1"), 50), BROKERS, st.integers(0, 99)),
    st.builds(lambda b, r: FenceBroker(f"f{r}", b), BROKERS, st.integers(0, 99)),
    st.builds(lambda n, p, rf, r: CreateTopic(f"c{r}", _spec(n, partitions=str(p), replication_factor=str(rf))),
              st.sampled_from(["x", "y"]), st.integers(1, 3), st.integers(1, 3), st.integers(0, 99)),
    st.builds(lambda n, b, r: ElectLeader(f"e{r}", n, 0, b), st.sampled_from(["x", "y"]), BROKERS,
              st.integers(0, 99)),
    st.builds(lambda k, e, isr, r: ChangeIsr(f"i{r}", k[0], k[1], e, tuple(isr)), TOPIC_KEYS, st.integers(0, 4),
              st.lists(BROKERS, min_size=1, max_size=3, unique=True), st.integers(0, 99)),
    st.builds(_commit, BROKERS, TOPIC_KEYS, st.integers(0, 4), st.integers(0, 1), st.integers(0, 50),
              st.integers(0, 99)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(COMMANDS, max_size=40))
def test_committed_hwm_never_decreases_and_stale_commits_change_nothing(commands: list[Command]) -> None:
    state = MetadataState(cluster=True)
    for command in commands:
        before = state
        try:
            state, result = apply(state, command)
        except BrokerError:
            assert not isinstance(command, CommitHwm)
            continue
        for key, a in before.assignments.items():
            after = state.assignments.get(key)
            if after is not None:
                assert after.committed_hwm >= a.committed_hwm, (command, a, after)
        if isinstance(command, CommitHwm):
            (entry,) = command.entries
            key = (entry.topic, entry.partition)
            a = before.assignments.get(key)
            valid = (a is not None and a.leader == command.broker_id and a.leader_epoch == entry.leader_epoch
                     and a.lifecycle_epoch == entry.lifecycle_epoch and entry.hwm > a.committed_hwm)
            if valid:
                assert a is not None
                assert state.assignments[key] == dataclasses.replace(a, committed_hwm=entry.hwm)
                assert result.hwm_accepted == (key,)
            else:
                assert state is before and not result.changed and len(result.hwm_rejected) == 1
        else:
            for a in state.assignments.values():
                assert set(a.isr) <= set(a.replicas)
                assert a.leader is None or a.leader in a.isr
