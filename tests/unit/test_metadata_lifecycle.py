"""TruncateTopic (the TOPIC_TRUNCATE transition), the lifecycle protocol rule and the registrations that carry
it: encoding, apply, fencing of stale partition commits, snapshot round trips, and a property over command
sequences (a truncation always lands every partition on the new lifecycle epoch with committed HWM 0)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cursus.cluster.status import cluster_status
from cursus.metadata.apply import apply
from cursus.metadata.commands import (
    BrokerHeartbeat,
    CommitHwm,
    CreateTopic,
    DeleteTopic,
    HwmEntry,
    PutTopic,
    RegisterBroker,
    TruncateTopic,
    decode,
    encode,
)
from cursus.metadata.lifecycle import LIFECYCLE_PROTOCOL_VERSION, require_lifecycle_protocol
from cursus.metadata.snapshot import decode_state, encode_state
from cursus.metadata.state import BrokerInfo, MetadataState
from cursus.metadata.topics import TopicDefinition, TopicSpec
from cursus.params import parse_args
from cursus.wire.errors import BrokerError


def _spec(name: str, **fields: str) -> TopicSpec:
    return parse_args(TopicSpec, {"topic": name, **fields}, "CREATE")


def _cluster(*brokers: str, protocol: int = LIFECYCLE_PROTOCOL_VERSION) -> MetadataState:
    state = MetadataState(cluster=True)
    for b in brokers:
        info = BrokerInfo(b, f"{b}:9000", lifecycle_protocol=protocol)
        state, _ = apply(state, BrokerHeartbeat(f"hb-{b}", info, 8))
    state, _ = apply(state, CreateTopic("c", _spec("t", partitions="2", replication_factor=str(len(brokers)))))
    return state


def _standalone() -> MetadataState:
    state, _ = apply(MetadataState(initial_leader_epoch=0), RegisterBroker("r", BrokerInfo("s", "s:1")))
    state, _ = apply(state, CreateTopic("c", _spec("t", partitions="2")))
    return state


def test_encoding_is_canonical_and_strict() -> None:
    command = TruncateTopic("r1", "t", 3)
    raw = encode(command)
    assert raw == b'{"expected_revision":3,"request_id":"r1","topic":"t","type":"truncate_topic","v":1}'
    assert decode(raw) == command
    for bad in (b'{"expected_revision":null,"request_id":"r","topic":"t","type":"truncate_topic","v":1}',
                b'{"request_id":"r","topic":"t","type":"truncate_topic","v":1}',
                b'{"expected_revision":"3","request_id":"r","topic":"t","type":"truncate_topic","v":1}'):
        with pytest.raises(ValueError):
            decode(bad)


def test_truncate_bumps_revision_and_lifecycle_epoch_and_resets_partitions_in_a_cluster() -> None:
    state = _cluster("a", "b", "c")
    for p in range(2):
        a = state.assignments[("t", p)]
        state, _ = apply(state, CommitHwm(f"h{p}", a.leader or "", (HwmEntry("t", p, a.leader_epoch, 0, 9),)))
    before = state
    state, result = apply(state, TruncateTopic("x", "t", 1))
    defn = state.topics["t"]
    assert (defn.revision, defn.lifecycle_epoch) == (2, 1)
    assert dataclasses.replace(defn, revision=1, lifecycle_epoch=0) == before.topics["t"]  # definition kept
    assert result.changed and result.topic == defn and result.moved == (("t", 0), ("t", 1))
    for p in range(2):
        old, new = before.assignments[("t", p)], state.assignments[("t", p)]
        assert (new.replicas, new.leader, new.isr) == (old.replicas, old.leader, old.isr)
        assert (new.leader_epoch, new.committed_hwm, new.lifecycle_epoch) == (old.leader_epoch + 1, 0, 1)
    # a retry of the same request applies once
    again, retried = apply(state, TruncateTopic("x", "t", 1))
    assert again is state and not retried.changed


def test_partition_commits_of_the_old_generation_are_refused() -> None:
    state = _cluster("a", "b", "c")
    old = state.assignments[("t", 0)]
    state, _ = apply(state, TruncateTopic("x", "t", 1))
    new = state.assignments[("t", 0)]
    leader = new.leader or ""
    stale = [HwmEntry("t", 0, old.leader_epoch, old.lifecycle_epoch, 5),   # both epochs old
             HwmEntry("t", 0, new.leader_epoch, old.lifecycle_epoch, 5),   # lifecycle epoch missing/old
             HwmEntry("t", 0, old.leader_epoch, new.lifecycle_epoch, 5)]   # leader epoch old
    after, result = apply(state, CommitHwm("s", leader, tuple(stale)))
    assert after is state
    assert [reason for _, _, reason in result.hwm_rejected] == [
        "STALE_LEADER_EPOCH", "PARTITION_LEADER_FENCED", "STALE_LEADER_EPOCH"]
    after, result = apply(state, CommitHwm("ok", leader, (HwmEntry("t", 0, new.leader_epoch, 1, 4),)))
    assert after.assignments[("t", 0)].committed_hwm == 4


def test_truncate_refusals_change_nothing() -> None:
    state = _cluster("a", "b", "c")
    for command, code in ((TruncateTopic("1", "t", 2), "version_conflict"),
                          (TruncateTopic("2", "nope", 1), "topic_not_found"),
                          (TruncateTopic("3", "__consumer_offsets", 1), "internal_topic_delete_forbidden")):
        with pytest.raises(BrokerError) as err:
            apply(state, command)
        assert err.value.error.code == code


def test_standalone_truncate_keeps_leader_epochs_at_zero() -> None:
    state = _standalone()
    state, _ = apply(state, TruncateTopic("x", "t", 1))
    assert {(a.leader_epoch, a.lifecycle_epoch, a.committed_hwm) for a in state.assignments.values()} == {(0, 1, 0)}
    # a restart rebuilds the standalone assignment from the manifest: the same state
    rebuilt, _ = apply(MetadataState(initial_leader_epoch=0), RegisterBroker("r", BrokerInfo("s", "s:1")))
    rebuilt, _ = apply(rebuilt, PutTopic("restore-t", state.topics["t"]))
    assert rebuilt.assignments == state.assignments


def test_every_active_broker_must_advertise_the_lifecycle_protocol() -> None:
    state = _cluster("a", "b", "c")
    state, _ = apply(state, BrokerHeartbeat("old-b", BrokerInfo("b", "b:9000"), 8))  # b re-registers without it
    with pytest.raises(BrokerError) as err:
        apply(state, TruncateTopic("x", "t", 1))
    e = err.value.error
    assert (e.code, e.fields["brokers"], e.fields["required_lifecycle_protocol"]) == ("unsupported_topic_policy", "b", "1")
    assert e.error_class.name == "VALIDATION" and not e.retryable
    # an inactive broker does not count; a standalone state never refuses
    state = dataclasses.replace(state, brokers={**state.brokers, "b": dataclasses.replace(state.brokers["b"],
                                                                                          status="inactive")})
    require_lifecycle_protocol(state, "truncate")
    with pytest.raises(BrokerError):
        require_lifecycle_protocol(_cluster("a", protocol=1), "compaction", version=2)
    require_lifecycle_protocol(_standalone(), "compaction", version=2)


def test_registrations_carry_the_lifecycle_protocol_through_snapshots_and_status() -> None:
    state = _cluster("a", "b", "c")
    state, _ = apply(state, TruncateTopic("x", "t", 1))
    assert decode_state(encode_state(state)) == state
    assert BrokerInfo.from_dict({"id": "a", "client_address": "a:1", "internal_address": "", "status": "active"}
                                ).lifecycle_protocol == 0  # an older registration
    with pytest.raises(ValueError):
        BrokerInfo.from_dict({"id": "a", "client_address": "a:1", "internal_address": "", "status": "active",
                              "lifecycle_protocol": "1"})
    doc = cluster_status(state, {"leader_id": "a"}, 1)
    assert [b["lifecycle_protocol"] for b in doc["brokers"]] == [LIFECYCLE_PROTOCOL_VERSION] * 3


_STEPS = st.lists(st.sampled_from(["truncate", "commit", "delete", "create"]), max_size=12)


@settings(max_examples=60, deadline=None)
@given(_STEPS)
def test_any_sequence_keeps_lifecycle_invariants(steps: list[str]) -> None:
    """After any sequence: every partition carries its topic's lifecycle epoch; a truncation leaves every
    partition at committed HWM 0 under a higher leader epoch; a recreated topic starts at revision 1 and
    lifecycle epoch 0."""
    state = _cluster("a", "b", "c")
    for i, step in enumerate(steps):
        defn: TopicDefinition | None = state.topics.get("t")
        try:
            if step == "truncate" and defn is not None:
                before = dict(state.assignments)
                state, _ = apply(state, TruncateTopic(f"x{i}", "t", defn.revision))
                for key, a in state.assignments.items():
                    assert a.committed_hwm == 0 and a.leader_epoch == before[key].leader_epoch + 1
            elif step == "commit" and defn is not None:
                a = state.assignments[("t", 0)]
                state, _ = apply(state, CommitHwm(f"h{i}", a.leader or "", (
                    HwmEntry("t", 0, a.leader_epoch, a.lifecycle_epoch, a.committed_hwm + 3),)))
            elif step == "delete" and defn is not None:
                state, _ = apply(state, DeleteTopic(f"d{i}", "t"))
                assert not any(k[0] == "t" for k in state.assignments)
            elif step == "create" and defn is None:
                state, _ = apply(state, CreateTopic(f"c{i}", _spec("t", partitions="2", replication_factor="3")))
                assert (state.topics["t"].revision, state.topics["t"].lifecycle_epoch) == (1, 0)
                assert all(a.committed_hwm == 0 for k, a in state.assignments.items() if k[0] == "t")
        except BrokerError as exc:  # only the compare-and-set may refuse, and never here
            raise AssertionError(exc.error) from None
        defn = state.topics.get("t")
        for key, a in state.assignments.items():
            assert defn is not None and a.lifecycle_epoch == defn.lifecycle_epoch, key


def test_a_recreated_cluster_topic_is_a_new_incarnation_kept_in_snapshots() -> None:
    state = _cluster("a", "b", "c")
    first = state.incarnation("t")
    assert first > 0
    state, _ = apply(state, TruncateTopic("x", "t", 1))
    assert state.incarnation("t") == first  # a truncation keeps the incarnation
    state, _ = apply(state, DeleteTopic("d", "t"))
    assert "t" not in state.incarnations
    state, _ = apply(state, CreateTopic("c2", _spec("t", partitions="1", replication_factor="3")))
    assert state.incarnation("t") > first
    restored = decode_state(encode_state(state))
    assert restored == state and restored.incarnation("t") == state.incarnation("t")
    assert _standalone().incarnations == {}  # standalone: the manifest is the only authority
