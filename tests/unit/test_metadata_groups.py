"""GroupRecords in the metadata FSM: encoding, the fold and fencing rules of cursus.metadata.groups, the
snapshot (v2 with groups, the deliberate v1 rule), layering, and a Hypothesis property over random command
sequences (ownership fencing, sequence order, determinism, snapshot round trip)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cursus.metadata
from cursus.cluster.fsm import MetadataFSM, decode_result
from cursus.cluster.raft.errors import UnsupportedRecoveryProtocol
from cursus.coordinator.groups import Selector
from cursus.coordinator.offsets import (
    GroupRecord,
    MembershipRecord,
    OffsetSnapshotRecord,
    RegistrationRecord,
    TombstoneRecord,
    encode_payload,
)
from cursus.metadata.apply import apply
from cursus.metadata.commands import BrokerHeartbeat, Command, FenceBroker, GroupRecords, decode, encode
from cursus.metadata.groups import MEMBERSHIP_SLOT, REGISTRATION_SLOT, parse_record
from cursus.metadata.snapshot import UnsupportedGroupState, decode_state, encode_state
from cursus.metadata.state import BrokerInfo, MetadataState
from cursus.metadata.topics import TopicDefinition
from cursus.wire.errors import BrokerError

BROKERS = ("a", "b", "c")


def _cluster(*brokers: str) -> MetadataState:
    state = MetadataState(cluster=True)
    for b in brokers:
        state, _ = apply(state, BrokerHeartbeat(f"hb-{b}", BrokerInfo(b, f"{b}:9000"), 50))
    return state


def _text(rec: GroupRecord) -> str:
    return encode_payload(rec).decode()


def reg(group: str = "g", epoch: int = 1, revision: int = 1, partitions: int = 2) -> str:
    return _text(RegistrationRecord(group, Selector.single("t"), {"t": partitions}, epoch, revision, "x"))


def offsets(group: str = "g", epoch: int = 1, revision: int = 1, **values: int) -> str:
    parsed = {int(k[1:]): v for k, v in values.items()}
    return _text(OffsetSnapshotRecord(group, "t", parsed, epoch, revision, "x"))


def members(group: str = "g", epoch: int = 1, revision: int = 1, generation: int = 1) -> str:
    return _text(MembershipRecord(group, generation, (("m-0001", (("t", 0), ("t", 1))),), epoch, revision, "x"))


def tomb(group: str = "g", epoch: int = 1, revision: int = 2) -> str:
    return _text(TombstoneRecord(group, epoch, revision, "x"))


def cmd(state: MetadataState, *records: str, group: str = "g", origin: str | None = None, seq: int | None = None,
        rid: str = "r") -> GroupRecords:
    entry = state.groups.get(group)
    sequence = seq if seq is not None else (entry.sequence if entry else 0) + 1
    return GroupRecords(rid, group, origin or state.group_coordinator(group) or "", sequence, records)


def code(state: MetadataState, command: Command) -> str:
    with pytest.raises(BrokerError) as info:
        apply(state, command)
    return info.value.error.code


def test_encoding_is_canonical_and_strict() -> None:
    command = GroupRecords("r1", "g", "a", 3, (reg(),))
    assert decode(encode(command)) == command
    doc = json.loads(encode(command))
    assert doc["type"] == "group_records" and doc["sequence"] == 3
    for bad in ({**doc, "sequence": 0}, {**doc, "records": "x"}, {**doc, "records": [1]},
                {k: v for k, v in doc.items() if k != "origin"}, {**doc, "extra": 1}):
        with pytest.raises(ValueError):
            decode(json.dumps(bad).encode())


def test_standalone_refuses_group_records() -> None:
    state = MetadataState()
    assert code(state, GroupRecords("r", "g", "a", 1, (reg(),))) == "invalid_cluster_request"


def test_only_the_owner_on_the_ring_of_active_brokers_may_append() -> None:
    state = _cluster(*BROKERS)
    owner = state.group_coordinator("g")
    other = next(b for b in BROKERS if b != owner)
    assert code(state, cmd(state, reg(), origin=other)) == "NOT_COORDINATOR"
    state, result = apply(state, cmd(state, reg()))
    assert result.changed and state.groups["g"].sequence == 1 and state.groups["g"].origin == owner
    fenced, _ = apply(state, FenceBroker("f", owner))  # the owner is gone: the ring moves the group
    successor = fenced.group_coordinator("g")
    assert successor not in (None, owner)
    assert code(fenced, cmd(fenced, offsets(p0=3), origin=owner)) == "NOT_COORDINATOR"
    after, _ = apply(fenced, cmd(fenced, offsets(p0=3), origin=successor))
    assert after.groups["g"].records["offset/t"].revision == 1
    back, _ = apply(after, BrokerHeartbeat("hb2", BrokerInfo(owner, f"{owner}:9000"), 50))
    assert back.group_coordinator("g") == owner  # it returns: ownership moves back, the successor is fenced
    assert code(back, cmd(back, offsets(revision=2, p0=4), origin=successor)) == "NOT_COORDINATOR"


def test_sequence_must_follow_the_applied_one() -> None:
    state = _cluster(*BROKERS)
    state, _ = apply(state, cmd(state, reg()))
    for wrong in (1, 3):
        err = pytest.raises(BrokerError, apply, state, cmd(state, offsets(p0=1), seq=wrong)).value.error
        assert err.code == "coordinator_not_available" and err.fields["reason"] == "out_of_sequence"
    state, _ = apply(state, cmd(state, offsets(p0=1), seq=2))
    assert state.groups["g"].sequence == 2


def test_fold_keeps_the_latest_record_per_key_and_drops_superseded_ones() -> None:
    state = _cluster(*BROKERS)
    state, _ = apply(state, cmd(state, reg(), members()))
    state, _ = apply(state, cmd(state, offsets(p0=5)))
    state, _ = apply(state, cmd(state, offsets(revision=2, p0=7, p1=1)))
    entry = state.groups["g"]
    assert set(entry.records) == {REGISTRATION_SLOT, MEMBERSHIP_SLOT, "offset/t"}
    assert json.loads(entry.records["offset/t"].payload)["offsets"] == [{"partition": 0, "offset": 7},
                                                                       {"partition": 1, "offset": 1}]
    # a record going back, one without a registration at its epoch, a re-registration not above the tombstone
    assert code(state, cmd(state, offsets(revision=2, p0=9))) == "invalid_cluster_request"
    assert code(state, cmd(state, offsets(epoch=2, revision=3, p0=9))) == "invalid_cluster_request"
    state, _ = apply(state, cmd(state, tomb()))
    assert set(state.groups["g"].records) == {REGISTRATION_SLOT}  # the tombstone drops offsets and membership
    assert code(state, cmd(state, reg(epoch=1, revision=3))) == "invalid_cluster_request"
    state, _ = apply(state, cmd(state, reg(epoch=2, revision=3), offsets(epoch=2, revision=1, p0=0)))
    assert state.groups["g"].records["offset/t"].epoch == 2
    # envelope validation: another group's record, unknown fields, not JSON
    assert code(state, cmd(state, reg(group="h", epoch=3, revision=4))) == "invalid_cluster_request"
    assert code(state, cmd(state, '{"version":1}')) == "invalid_cluster_request"
    assert code(state, cmd(state, "nope")) == "invalid_cluster_request"
    assert code(state, cmd(state)) == "invalid_cluster_request"


def test_a_refused_command_changes_nothing_and_results_are_not_kept() -> None:
    state = _cluster(*BROKERS)
    state, _ = apply(state, cmd(state, reg()))
    before = encode_state(state)
    with pytest.raises(BrokerError):
        apply(state, cmd(state, offsets(epoch=5, p0=1)))
    assert encode_state(state) == before
    new, _ = apply(state, cmd(state, offsets(p0=1), rid="x"))
    assert "x" not in new.applied and new.revision == state.revision + 1


def test_snapshot_round_trip_with_groups() -> None:
    state = _cluster(*BROKERS)
    state, _ = apply(state, cmd(state, reg(), members()))
    state, _ = apply(state, cmd(state, offsets(p0=42)))
    state, _ = apply(state, cmd(state, reg(group="old"), group="old"))
    state, _ = apply(state, cmd(state, tomb(group="old"), group="old"))
    raw = encode_state(state)
    restored = decode_state(raw)
    assert restored.groups == state.groups and encode_state(restored) == raw
    assert json.loads(raw)["v"] == 3
    fsm = MetadataFSM(MetadataState(cluster=True))
    fsm.restore(raw)
    assert fsm.state.groups["g"].records["offset/t"].payload == state.groups["g"].records["offset/t"].payload


def test_v1_state_is_defaulted_only_when_no_group_can_have_existed() -> None:
    state = _cluster(*BROKERS)
    doc = json.loads(encode_state(state))
    doc["v"] = 1
    del doc["groups"]
    assert decode_state(json.dumps(doc).encode()).groups == {}
    doc["topics"] = [TopicDefinition("__consumer_offsets", 1).to_manifest()]
    with pytest.raises(UnsupportedGroupState):
        decode_state(json.dumps(doc).encode())
    with pytest.raises(UnsupportedRecoveryProtocol):
        MetadataFSM(MetadataState(cluster=True)).restore(json.dumps(doc).encode())
    doc["v"] = 2  # a v2 state must carry groups
    with pytest.raises(ValueError):
        decode_state(json.dumps(doc).encode())


def test_snapshot_refuses_a_bad_group_row() -> None:
    state = _cluster(*BROKERS)
    state, _ = apply(state, cmd(state, reg()))
    doc = json.loads(encode_state(state))
    doc["groups"][0][4] = ['{"version":9}']
    with pytest.raises(ValueError):
        decode_state(json.dumps(doc).encode())


def test_metadata_does_not_import_the_coordinator() -> None:
    package = Path(cursus.metadata.__file__).parent
    offenders = []
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [(path.name, n) for n in names if n.startswith("cursus.coordinator")]
    assert offenders == []


def test_parse_record_envelope() -> None:
    rec = parse_record("g", offsets(epoch=3, revision=4, p0=1))
    assert (rec.kind, rec.epoch, rec.revision, rec.topic, rec.slot) == ("offset_snapshot", 3, 4, "t", "offset/t")


# ---------------------------------------------------------------------------------------------- property

GROUPS = ("g0", "g1", "g2", "g3")

step = st.one_of(
    st.tuples(st.just("records"), st.sampled_from(GROUPS), st.sampled_from(BROKERS), st.integers(-1, 1),
              st.integers(0, 3)),
    st.tuples(st.just("fence"), st.sampled_from(BROKERS)),
    st.tuples(st.just("heartbeat"), st.sampled_from(BROKERS)),
)


def _records_for(state: MetadataState, group: str, kind: int) -> tuple[str, ...]:
    """A plausible next change of ``group`` as its owner would stage it (revisions from the state)."""
    entry = state.groups.get(group)
    rev = {slot: r.revision for slot, r in entry.records.items()} if entry else {}
    reg_rec = entry.records.get(REGISTRATION_SLOT) if entry else None
    epoch = reg_rec.epoch if reg_rec else 1
    live = reg_rec is not None and reg_rec.kind == "group_registration"
    if not live or kind == 0:
        new_epoch = epoch + 1 if reg_rec is not None and not live else epoch
        return (reg(group, new_epoch, rev.get(REGISTRATION_SLOT, 0) + 1),)
    if kind == 1:
        return (offsets(group, epoch, rev.get("offset/t", 0) + 1, p0=rev.get("offset/t", 0)),)
    if kind == 2:
        return (members(group, epoch, rev.get(MEMBERSHIP_SLOT, 0) + 1),)
    return (tomb(group, epoch, rev.get(REGISTRATION_SLOT, 0) + 1),)


@settings(max_examples=150, deadline=None)
@given(st.lists(step, max_size=40))
def test_group_records_apply_rules(steps: list[tuple]) -> None:
    state = _cluster(*BROKERS)
    commands: list[Command] = []
    for n, s in enumerate(steps):
        if s[0] == "records":
            _, group, origin, seq_delta, kind = s
            entry = state.groups.get(group)
            seq = (entry.sequence if entry else 0) + 1 + seq_delta
            command: Command = GroupRecords(f"r{n}", group, origin, max(seq, 1),
                                            _records_for(state, group, kind))
        elif s[0] == "fence":
            command = FenceBroker(f"f{n}", s[1])
        else:
            command = BrokerHeartbeat(f"h{n}", BrokerInfo(s[1], f"{s[1]}:9000"), 50)
        commands.append(command)
        try:
            new, _ = apply(state, command)
        except BrokerError:
            new = None
        if isinstance(command, GroupRecords):
            entry = state.groups.get(command.group)
            expected_seq = (entry.sequence if entry else 0) + 1
            owner = state.group_coordinator(command.group)
            if owner != command.origin or command.sequence != expected_seq:
                assert new is None  # fenced by the state it is applied to
            if new is not None:
                assert owner == command.origin and new.groups[command.group].sequence == expected_seq
                assert new.groups[command.group].last_request == command.request_id
                assert {g: e for g, e in new.groups.items() if g != command.group} == \
                    {g: e for g, e in state.groups.items() if g != command.group}
        if new is not None:
            state = new
    # determinism: the FSM applying the same bytes reaches the same bytes; the snapshot round-trips
    fsm = MetadataFSM(MetadataState(cluster=True))
    for b in BROKERS:
        decode_result(fsm.apply(encode(BrokerHeartbeat(f"hb-{b}", BrokerInfo(b, f"{b}:9000"), 50))))
    for command in commands:
        fsm.apply(encode(command))
    assert encode_state(fsm.state) == encode_state(state)
    assert encode_state(decode_state(encode_state(state))) == encode_state(state)
