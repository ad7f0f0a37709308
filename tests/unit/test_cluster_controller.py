"""The pure cluster transitions (broker heartbeat/fencing, ELECT_LEADER, ISR change) as data-driven
scenarios in the etcd/raft style, plus properties of the FSM that applies them through Raft."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cursus.cluster.controller import overdue
from cursus.cluster.fsm import MetadataFSM, decode_result
from cursus.cluster.raft.errors import UnsupportedRecoveryProtocol
from cursus.metadata.apply import apply
from cursus.metadata.commands import (
    BrokerHeartbeat,
    ChangeIsr,
    Command,
    CreateTopic,
    ElectLeader,
    FenceBroker,
    decode,
    encode,
)
from cursus.metadata.snapshot import PARTITION_COLUMNS, decode_state, encode_state
from cursus.metadata.state import BrokerInfo, MetadataState, PartitionAssignment
from cursus.metadata.topics import TopicDefinition, TopicSpec
from cursus.params import parse_args
from cursus.wire.errors import BrokerError

# ------------------------------------------------------------------------------------------ scenarios
#
# One directive per line; ``>`` lines are expectations about the state after the directive before them.
#   brokers a b c                       heartbeat (register, active) each broker
#   topic t rf=3 partitions=1           CREATE
#   set t-0 replicas=a,b,c leader=a epoch=1 isr=a,b,c   test setup: overwrite one assignment
#   fence b | heartbeat b | elect t-0 b [expected=N] | isr t-0 a,b
#   > t-0 leader=b epoch=2 isr=b,c      expectation ("-" = leaderless)
#   > error leader_election_rejected    the directive before was refused, state unchanged

SCENARIOS = {
    "isr shrink and leadership moves within the ISR": """
        brokers a b c
        topic t rf=3 partitions=1
        set t-0 replicas=a,b,c leader=a epoch=1 isr=a,b,c
        fence c
        > t-0 leader=a epoch=1 isr=a,b
        fence a
        > t-0 leader=b epoch=2 isr=b
    """,
    "no unclean election and the last ISR member returns": """
        brokers a b c
        topic t rf=3 partitions=1
        set t-0 replicas=a,b,c leader=a epoch=1 isr=a,b
        fence a
        > t-0 leader=b epoch=2 isr=b
        fence b
        > t-0 leader=- epoch=3 isr=b
        heartbeat a
        > t-0 leader=- epoch=3 isr=b
        heartbeat c
        > t-0 leader=- epoch=3 isr=b
        heartbeat b
        > t-0 leader=b epoch=4 isr=b
    """,
    "fencing twice changes nothing": """
        brokers a b
        topic t rf=2 partitions=1
        set t-0 replicas=a,b leader=a epoch=5 isr=a,b
        fence b
        > t-0 leader=a epoch=5 isr=a
        fence b
        > t-0 leader=a epoch=5 isr=a
    """,
    "elect leader rules": """
        brokers a b c
        topic t rf=3 partitions=1
        set t-0 replicas=a,b,c leader=a epoch=1 isr=a,b
        elect t-0 c
        > error leader_election_rejected
        elect t-0 b expected=0
        > error leader_election_rejected
        elect t-0 b expected=1
        > t-0 leader=b epoch=2 isr=a,b
        elect t-0 b expected=1
        > t-0 leader=b epoch=2 isr=a,b
        fence a
        elect t-0 a
        > error leader_election_rejected
        elect t-9 a
        > error partition_not_found
    """,
    "isr change is fenced by the leader epoch": """
        brokers a b c
        topic t rf=3 partitions=1
        set t-0 replicas=a,b,c leader=a epoch=3 isr=a
        isr t-0 c,a epoch=3
        > t-0 leader=a epoch=3 isr=a,c
        isr t-0 a,b epoch=2
        > error STALE_LEADER_EPOCH
        isr t-0 b,c epoch=3
        > error invalid_cluster_request
    """,
    "an ISR expansion adds active brokers only; a shrink needs no liveness": """
        brokers a b c
        topic t rf=3 partitions=1
        set t-0 replicas=a,b,c leader=a epoch=1 isr=a
        fence c
        > t-0 leader=a epoch=1 isr=a
        isr t-0 a,c epoch=1
        > error invalid_cluster_request
        isr t-0 a,b epoch=1
        > t-0 leader=a epoch=1 isr=a,b
        isr t-0 a epoch=1
        > t-0 leader=a epoch=1 isr=a
    """,
}


def _spec(name: str, **fields: str) -> TopicSpec:
    return parse_args(TopicSpec, {"topic": name, **fields}, "CREATE")


def _key(text: str) -> tuple[str, int]:
    topic, _, partition = text.rpartition("-")
    return topic, int(partition)


def _kv(tokens: list[str]) -> dict[str, str]:
    return dict(token.split("=", 1) for token in tokens)


def _members(text: str) -> tuple[str, ...]:
    return tuple(text.split(",")) if text else ()


def run_scenario(script: str) -> None:
    state = MetadataState(cluster=True)
    counter = 0
    last_error: BrokerError | None = None
    for raw in script.strip().splitlines():
        words = raw.split()
        counter += 1
        rid = f"r{counter}"
        if words[0] == ">":
            if words[1] == "error":
                assert last_error is not None and last_error.error.code == words[2], (raw, last_error)
                continue
            assert last_error is None, (raw, last_error)
            a = state.assignments[_key(words[1])]
            want = _kv(words[2:])
            assert (a.leader or "-") == want["leader"], (raw, a)
            assert a.leader_epoch == int(want["epoch"]), (raw, a)
            assert a.isr == _members(want["isr"]), (raw, a)
            continue
        command: Command | None = None
        op = words[0]
        if op == "brokers":
            for b in words[1:]:
                state, _ = apply(state, BrokerHeartbeat(f"{rid}-{b}", BrokerInfo(b, f"{b}:9000"), 50))
        elif op == "topic":
            fields = _kv(words[2:])
            command = CreateTopic(rid, _spec(words[1], replication_factor=fields["rf"],
                                             partitions=fields["partitions"]))
        elif op == "set":
            f = _kv(words[2:])
            a = PartitionAssignment(_members(f["replicas"]), None if f["leader"] == "-" else f["leader"],
                                    int(f["epoch"]), _members(f["isr"]))
            state = dataclasses.replace(state, assignments={**state.assignments, _key(words[1]): a})
        elif op == "fence":
            command = FenceBroker(rid, words[1])
        elif op == "heartbeat":
            command = BrokerHeartbeat(rid, BrokerInfo(words[1], f"{words[1]}:9000"), 50)
        elif op == "elect":
            topic, partition = _key(words[1])
            expected = _kv(words[3:]).get("expected")
            command = ElectLeader(rid, topic, partition, words[2], int(expected) if expected else None)
        elif op == "isr":
            topic, partition = _key(words[1])
            command = ChangeIsr(rid, topic, partition, int(_kv(words[3:])["epoch"]), _members(words[2]))
        else:
            raise AssertionError(f"unknown directive {raw!r}")
        last_error = None
        if command is not None:
            assert decode(encode(command)) == command  # what Raft carries is exactly the command
            try:
                state, _ = apply(state, command)
            except BrokerError as exc:
                last_error = exc


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_controller_scenario(name: str) -> None:
    run_scenario(SCENARIOS[name])


def test_overdue_brokers() -> None:
    seen = {"a": 10.0, "b": 8.5}
    assert overdue(seen, ["a", "b", "c"], now=11.0, timeout=3.0) == []
    assert overdue(seen, ["a", "b", "c"], now=11.0, timeout=2.4) == ["b"]
    assert overdue(seen, ["a", "c"], now=20.0, timeout=3.0) == ["a"]  # c unseen: seeded at takeover


def test_cluster_create_refuses_rf_above_registered_brokers_and_places_isr_equal_to_replicas() -> None:
    state, _ = apply(MetadataState(cluster=True), BrokerHeartbeat("h", BrokerInfo("a", "a:1"), 50))
    with pytest.raises(BrokerError) as info:
        apply(state, CreateTopic("c", _spec("t"), default_replication_factor=3))
    assert info.value.error.code == "invalid_replication_factor"
    state, _ = apply(state, BrokerHeartbeat("h2", BrokerInfo("b", "b:1"), 50))
    state, result = apply(state, CreateTopic("c", _spec("t", partitions="4"), default_replication_factor=2))
    for key in result.added:
        a = state.assignments[key]
        assert len(a.replicas) == 2 and a.isr == a.replicas and a.leader == a.replicas[0]
        assert a.leader_epoch == 1 and a.committed_hwm == 0


def test_coordinator_shard_count_is_fixed_by_the_first_broker() -> None:
    state, _ = apply(MetadataState(cluster=True), BrokerHeartbeat("h", BrokerInfo("a", "a:1"), 50))
    assert state.coordinator_shards == 50
    with pytest.raises(BrokerError) as info:
        apply(state, BrokerHeartbeat("h2", BrokerInfo("b", "b:1"), 10))
    assert info.value.error.code == "cluster_join_failed" and "b" not in state.brokers


# ------------------------------------------------------------------------------------------ the FSM

BROKER_IDS = st.sampled_from(["a", "b", "c"])
CLUSTER_COMMANDS = st.one_of(
    st.builds(lambda b, r: BrokerHeartbeat(f"hb{r}", BrokerInfo(b, f"{b}:1"), 50), BROKER_IDS, st.integers(0, 99)),
    st.builds(lambda b, r: FenceBroker(f"f{r}", b), BROKER_IDS, st.integers(0, 99)),
    st.builds(lambda n, p, rf, r: CreateTopic(f"c{r}", _spec(n, partitions=str(p), replication_factor=str(rf))),
              st.sampled_from(["x", "y"]), st.integers(1, 3), st.integers(1, 3), st.integers(0, 99)),
    st.builds(lambda n, b, e, r: ElectLeader(f"e{r}", n, 0, b, e), st.sampled_from(["x", "y"]), BROKER_IDS,
              st.none() | st.integers(0, 4), st.integers(0, 99)),
)


def _fsm_run(commands: list[Command]) -> tuple[MetadataFSM, list[bytes]]:
    fsm = MetadataFSM(MetadataState(cluster=True))
    return fsm, [fsm.apply(encode(c)) for c in commands]


@settings(max_examples=60, deadline=None)
@given(st.lists(CLUSTER_COMMANDS, max_size=30))
def test_fsm_is_deterministic_and_snapshot_round_trips(commands: list[Command]) -> None:
    one, results_one = _fsm_run(commands)
    two, results_two = _fsm_run(commands)
    assert results_one == results_two and one.snapshot() == two.snapshot()
    for raw in results_one:
        try:
            decode_result(raw)
        except BrokerError as exc:
            assert exc.error.code != "raft_apply_failed"
    restored = MetadataFSM(MetadataState(cluster=True))
    restored.restore(one.snapshot())
    assert restored.state == one.state
    # invariants: ISR within replicas, leader in the ISR or leaderless
    for a in one.state.assignments.values():
        assert set(a.isr) <= set(a.replicas)
        assert a.leader is None or a.leader in a.isr


@settings(max_examples=30, deadline=None)
@given(st.lists(CLUSTER_COMMANDS, max_size=20), CLUSTER_COMMANDS)
def test_fsm_retried_request_id_applies_once(commands: list[Command], retried: Command) -> None:
    fsm, _ = _fsm_run([*commands, retried])
    before = fsm.snapshot()
    fsm.apply(encode(retried))
    if not isinstance(retried, BrokerHeartbeat):  # a heartbeat restated is a no-op by value anyway
        assert fsm.snapshot() == before


def test_fsm_rejects_garbage_deterministically() -> None:
    fsm = MetadataFSM(MetadataState(cluster=True))
    with pytest.raises(BrokerError) as info:
        decode_result(fsm.apply(b"not json"))
    assert info.value.error.code == "invalid_cluster_request"


def test_snapshot_partition_without_provenance_is_unsupported_recovery_protocol() -> None:
    fsm, _ = _fsm_run([BrokerHeartbeat("h", BrokerInfo("a", "a:1"), 50), CreateTopic("c", _spec("t"))])
    doc = json.loads(fsm.snapshot())
    version, hwm = PARTITION_COLUMNS.index("committed_hwm_version"), PARTITION_COLUMNS.index("committed_hwm")
    for column, value in ((version, 2), (version, None), (hwm, "7"), (hwm, None)):
        broken = json.loads(json.dumps(doc))
        broken["partitions"][0][column] = value
        with pytest.raises(UnsupportedRecoveryProtocol, match="unsupported recovery protocol"):
            MetadataFSM(MetadataState(cluster=True)).restore(json.dumps(broken).encode())
    del doc["partitions"][0][version]
    with pytest.raises(UnsupportedRecoveryProtocol):
        MetadataFSM(MetadataState(cluster=True)).restore(json.dumps(doc).encode())


def test_snapshot_of_10000_partitions_is_fast() -> None:
    brokers = {b: BrokerInfo(b, f"{b}:9000", f"{b}:9001") for b in ("a", "b", "c")}
    topics, assignments = {}, {}
    for t in range(100):
        name = f"topic-{t}"
        topics[name] = TopicDefinition(name, 100, replication_factor=3)
        for p in range(100):
            assignments[(name, p)] = PartitionAssignment(("a", "b", "c"), "a", 3, ("a",), committed_hwm=123456)
    state = MetadataState(revision=10, topics=topics, assignments=assignments, brokers=brokers, cluster=True)
    encode_s = 1.0
    for _ in range(3):  # best of three: the machine is shared
        started = time.perf_counter()
        data = encode_state(state)
        encode_s = min(encode_s, time.perf_counter() - started)
    started = time.perf_counter()
    assert decode_state(data) == state
    decode_s = time.perf_counter() - started
    print(f"10,000 partitions: {len(data)} bytes, encode {encode_s * 1000:.1f} ms, decode {decode_s * 1000:.1f} ms")
    assert encode_s < 0.1  # well under 100 ms even on a loaded CI core


def test_transaction_coordinator_is_the_shard_owner_on_the_active_ring() -> None:
    from cursus.metadata.state import ring_replicas, transaction_coordinator, transaction_shard

    assert transaction_coordinator(MetadataState(cluster=True), "tx") is None  # no shard count fixed yet
    state = MetadataState(cluster=True)
    for b in ("a", "b", "c"):
        state, _ = apply(state, BrokerHeartbeat(f"h{b}", BrokerInfo(b, f"{b}:1"), 50))
    shard = transaction_shard("payments-1", 50)
    assert 0 <= shard < 50 and shard == transaction_shard("payments-1", 50)
    owner = transaction_coordinator(state, "payments-1")
    assert owner == ring_replicas(["a", "b", "c"], f"__transaction_coordinator-{shard}", 1)[0]
    state, _ = apply(state, FenceBroker("f", owner))
    assert transaction_coordinator(state, "payments-1") not in (None, owner)


def test_shard_owners_and_coordinator_epochs_live_in_the_state() -> None:
    from cursus.metadata.snapshot import decode_state, encode_state
    from cursus.metadata.state import (
        transaction_coordinator,
        transaction_coordinator_epoch,
        transaction_shard,
    )

    state = MetadataState(cluster=True)
    state, _ = apply(state, BrokerHeartbeat("ha", BrokerInfo("a", "a:1"), 8))
    assert len(state.txn_shards) == 8 and {s.owner for s in state.txn_shards.values()} == {"a"}
    assert {s.epoch for s in state.txn_shards.values()} == {1}
    for b in ("b", "c"):
        state, _ = apply(state, BrokerHeartbeat(f"h{b}", BrokerInfo(b, f"{b}:1"), 8))
    moved = {shard for shard, s in state.txn_shards.items() if s.owner != "a"}
    assert moved and all(state.txn_shards[shard].epoch >= 2 for shard in moved)  # one bump per owner change
    assert all(s.epoch == 1 for shard, s in state.txn_shards.items() if shard not in moved)
    tid = next(f"id-{i}" for i in range(1000) if transaction_shard(f"id-{i}", 8) in moved)
    owner, epoch = transaction_coordinator(state, tid), transaction_coordinator_epoch(state, tid)
    again, _ = apply(state, BrokerHeartbeat("hb2", BrokerInfo("b", "b:1"), 8))  # no change of owners
    assert transaction_coordinator_epoch(again, tid) == epoch
    state, _ = apply(state, FenceBroker("f", owner))
    assert transaction_coordinator(state, tid) not in (None, owner)
    assert transaction_coordinator_epoch(state, tid) == epoch + 1  # the new owner's markers outrank the old
    assert decode_state(encode_state(state)) == state
