"""The pure consumer-group state machine (cursus.coordinator.groups): membership, generations, assignment,
session expiry and commit fencing, plus a hypothesis state machine over random operation sequences."""

from __future__ import annotations

import random

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cursus.coordinator.groups import (
    FULL_MEMBER_ID,
    GroupTable,
    Selector,
    assign_round_robin,
    expansion_for,
    validate_group_name,
)
from cursus.wire.errors import BrokerError

TIMEOUT = 1000


def code_of(exc_info: pytest.ExceptionInfo[BrokerError]) -> str:
    return exc_info.value.error.code


def table_with(group: str = "g", partitions: int = 6) -> GroupTable:
    table = GroupTable(TIMEOUT, rng=random.Random(7))
    table.register(group, Selector.single("t"), {"t": partitions}, 0)
    return table


def test_round_robin_is_deterministic_complete_and_balanced():
    tps = [("t", p) for p in range(7)] + [("u", 0)]
    first = assign_round_robin(["b", "a", "c"], tps)
    assert first == assign_round_robin(["c", "a", "b"], list(reversed(tps)))
    owned = [tp for parts in first.values() for tp in parts]
    assert sorted(owned) == sorted(tps) and len(owned) == len(set(owned))
    sizes = [len(v) for v in first.values()]
    assert max(sizes) - min(sizes) <= 1
    assert first["a"][0] == ("t", 0)  # members sorted by id, partitions sorted by (topic, partition)
    assert assign_round_robin([], tps) == {}


def test_join_suffix_rejoin_and_resume():
    table = table_with()
    first = table.join("g", "c1", 0)
    assert FULL_MEMBER_ID.fullmatch(first.member_id) and first.member_id.startswith("c1-")
    assert first.rebalanced and first.group.generation == 1
    assert first.group.partitions_of(first.member_id, "t") == [0, 1, 2, 3, 4, 5]
    again = table.join("g", first.member_id, 10)  # a current member rejoining keeps its id, no rebalance
    assert (again.member_id, again.rebalanced, again.group.generation) == (first.member_id, False, 1)
    second = table.join("g", "c2", 20)
    assert second.group.generation == 2 and second.member_id != first.member_id
    assert sorted(second.group.partitions_of(first.member_id, "t") + second.group.partitions_of(second.member_id, "t")) \
        == list(range(6))
    # an expired member resuming with its full id and generation= keeps the id
    table.leave("g", second.member_id, None, 30)
    resumed = table.join("g", second.member_id, 40, generation=2)
    assert resumed.resumed and resumed.member_id == second.member_id and resumed.group.generation == 4


def test_join_checks_group_and_topic():
    table = table_with()
    with pytest.raises(BrokerError) as err:
        table.join("nope", "c", 0)
    assert code_of(err) == "group_not_found"
    with pytest.raises(BrokerError) as err:
        table.join("g", "c", 0, topic="other")
    assert code_of(err) == "topic_not_assigned_to_group"


def test_heartbeat_sync_leave_fencing():
    table = table_with()
    a = table.join("g", "a", 0).member_id
    b = table.join("g", "b", 0).member_id
    assert table.heartbeat("g", a, None, 5).generation == 2
    with pytest.raises(BrokerError) as err:
        table.heartbeat("g", a, 1, 5)
    assert code_of(err) == "GEN_MISMATCH" and err.value.error.fields["current"] == "2"
    with pytest.raises(BrokerError) as err:
        table.heartbeat("g", "ghost-0001", None, 5)
    assert code_of(err) == "member_not_found"
    with pytest.raises(BrokerError) as err:
        table.sync("g", b, 1, 5)
    assert code_of(err) == "GEN_MISMATCH"
    assert not table.sync("g", b, 2, 5).assignment  # a still holds every partition: nothing for b yet
    table.leave("g", b, None, 6)
    group = table.get("g")
    assert group.generation == 3 and list(group.members) == [a] and len(group.owners) == 6


def test_session_expiry_is_data():
    table = table_with()
    a = table.join("g", "a", 0).member_id
    b = table.join("g", "b", 100).member_id
    assert table.next_deadline_ms() == TIMEOUT
    table.heartbeat("g", a, None, 900)
    assert table.next_deadline_ms() == 100 + TIMEOUT  # b is now the earliest
    assert table.expire(1099) == []
    expired = table.expire(1100)
    assert [(g.name, ids) for g, ids in expired] == [("g", [b])]
    group = table.get("g")
    assert group.generation == 3 and set(group.owners.values()) == {a}
    assert table.next_deadline_ms() == 900 + TIMEOUT
    table.expire(1900)
    assert table.get("g").state == "Empty" and table.next_deadline_ms() is None and not table.get("g").owners


def test_commit_checks_in_order():
    table = table_with(partitions=4)
    a = table.join("g", "a", 0).member_id
    b = table.join("g", "b", 0).member_id
    table.join("g", a, 0)  # a gives b's partitions up: generation 3, and b takes them
    table.join("g", b, 0)
    group = table.get("g")
    assert group.generation == 3
    a_parts, b_parts = group.partitions_of(a, "t"), group.partitions_of(b, "t")

    def fails(code: str, **kwargs):
        args = dict(name="g", topic="t", member_id=a, generation=3, offsets={a_parts[0]: 5})
        args.update(kwargs)
        with pytest.raises(BrokerError) as err:
            table.check_commit(**args)
        assert code_of(err) == code, err.value.error.render()

    fails("group_not_found", name="other")
    fails("topic_not_assigned_to_group", topic="u")
    fails("partition_not_found", offsets={9: 1})
    fails("member_not_found", member_id="ghost-0000")
    fails("GEN_MISMATCH", generation=2)
    fails("NOT_OWNER", offsets={a_parts[0]: 5, b_parts[0]: 5})
    g, changed = table.check_commit("g", "t", a, 3, {a_parts[0]: 5})
    table.apply_commit(g, "t", changed, 1)
    assert changed == {a_parts[0]: 5} and g.committed("t", a_parts[0]) == 5
    assert table.check_commit("g", "t", a, 3, {a_parts[0]: 5})[1] == {}  # same value: idempotent
    fails("offset_regression", offsets={a_parts[0]: 4})


def test_expansion_change_rebalances_and_drops_old_offsets():
    table = GroupTable(TIMEOUT)
    table.register("g", Selector("pattern", (), "orders-*"), {"orders-a": 2}, 0)
    m = table.join("g", "m", 0).member_id
    group = table.get("g")
    group.offsets[("orders-a", 0)] = 3
    assert table.set_expansion(group, expansion_for(group.selector, {"orders-a": 2, "orders-b": 1, "x": 5}), 1)
    assert group.generation == 2 and group.partitions == {"orders-a": 2, "orders-b": 1}
    assert group.members[m].assignment == (("orders-a", 0), ("orders-a", 1))  # until m rejoins
    table.join("g", m, 1)
    assert group.members[m].assignment == (("orders-a", 0), ("orders-a", 1), ("orders-b", 0))
    assert not table.set_expansion(group, {"orders-a": 2, "orders-b": 1}, 2)
    table.set_expansion(group, {"orders-b": 1}, 3)
    assert group.offsets == {} and group.generation == 3


def test_selector_parsing():
    assert Selector.parse(topic="t", topics=None, pattern=None, command="X") == Selector.single("t")
    assert Selector.parse(topic=None, topics="a,b,a", pattern=None, command="X").topics == ("a", "b")
    pattern = Selector.parse(topic=None, topics=None, pattern="ev-*", command="X")
    assert pattern.matches("ev-1") and not pattern.matches("__ev-1") and not pattern.matches("x")
    for kwargs in ({}, {"topic": "a", "pattern": "b*"}):
        with pytest.raises(BrokerError) as err:
            Selector.parse(**{"topic": None, "topics": None, "pattern": None, **kwargs}, command="X")
        assert code_of(err) == "invalid_subscription"
    with pytest.raises(BrokerError) as err:
        validate_group_name("bad name", command="X")
    assert code_of(err) == "invalid_payload"


def test_tombstone_then_new_epoch():
    table = table_with()
    assert table.get("g").epoch == 1
    assert table.tombstone("g") == 1
    group, created = table.register("g", Selector.single("t"), {"t": 1}, 0)
    assert created and group.epoch == 2


def test_join_barrier_a_partition_moves_only_after_its_owner_rejoins():
    table = table_with(partitions=4)
    a = table.join("g", "a", 0).member_id
    b = table.join("g", "b", 0).member_id
    group = table.get("g")
    b_target = group.targets()[b]
    assert group.generation == 2 and group.partitions_of(b, "t") == []  # a holds all four
    # a has not rejoined: it may still commit what it holds, with its own generation (its revocation commit)
    g, changed = table.check_commit("g", "t", a, 1, {b_target[0][1]: 3})
    assert changed == {b_target[0][1]: 3}
    with pytest.raises(BrokerError) as err:
        table.check_commit("g", "t", a, 2, {0: 1})
    assert code_of(err) == "GEN_MISMATCH" and err.value.error.fields["current"] == "2"
    result = table.join("g", a, 1)  # a rejoins: gives up b's target; b (already in generation 2) waits for it
    assert result.rebalanced and group.generation == 3
    assert group.members[a].assignment == group.targets()[a] and group.partitions_of(b, "t") == []
    with pytest.raises(BrokerError) as err:
        table.heartbeat("g", b, 2, 2)
    assert code_of(err) == "GEN_MISMATCH"  # b learns it and rejoins
    assert table.join("g", b, 2).rebalanced and group.members[b].assignment == b_target
    assert table.join("g", a, 3).rebalanced is False and group.generation == 3  # converged
    # a third member: partitions come from a and b only as each rejoins
    c = table.join("g", "c", 4).member_id
    assert group.partitions_of(c, "t") == [] and group.generation == 4
    table.join("g", b, 5)
    table.join("g", a, 5)
    table.join("g", c, 5)
    for member in group.members.values():
        table.join("g", member.member_id, 6)
    assert {m: x.assignment for m, x in group.members.items()} == group.targets()
    # a member that leaves frees its partitions for the others' next join
    table.leave("g", c, None, 7)
    table.join("g", a, 8)
    table.join("g", b, 8)
    assert {m: x.assignment for m, x in group.members.items()} == group.targets()


def test_a_join_retry_gets_the_unconfirmed_member_back():
    table = table_with()
    first = table.join("g", "c", 0, origin="h1")
    retry = table.join("g", "c", 5, origin="h1")
    assert (retry.member_id, retry.rebalanced, retry.group.generation) == (first.member_id, False, 1)
    assert table.join("g", "c", 6, origin="h2").member_id != first.member_id  # another host: another member
    assert table.join("g", "c", 7).group.generation == 3  # no origin: never a retry
    table.touch("g", first.member_id, 8)  # heard from under its full id: confirmed
    assert table.join("g", "c", 9, origin="h1").member_id != first.member_id
    member = table.join("g", "d", 10, origin="h1").member_id
    table.confirm("g", member)
    assert table.join("g", "d", 11, origin="h1").member_id != member


def test_copies_are_independent_and_restore_keeps_sessions():
    table = table_with()
    a = table.join("g", "a", 0).member_id
    durable = table.get("g").copy()
    table.join("g", "b", 10)
    table.heartbeat("g", a, None, 500)
    assert durable.generation == 1 and list(durable.members) == [a] and durable.members[a].deadline_ms == TIMEOUT
    table.restore("g", durable.copy(), None)
    group = table.get("g")
    assert group.generation == 1 and list(group.members) == [a] and group.owners == {("t", p): a for p in range(6)}
    assert group.members[a].deadline_ms == 500 + TIMEOUT and table.next_deadline_ms() == 500 + TIMEOUT
    table.restore("g", None, 4)
    assert "g" not in table.groups and table.next_epoch("g") == 5


class GroupMachine(RuleBasedStateMachine):
    """Random joins, leaves, heartbeats, expiry and partition changes never break the invariants."""

    @initialize()
    def setup(self):
        self.table = GroupTable(TIMEOUT, rng=random.Random(1))
        self.table.register("g", Selector.single("t"), {"t": 5}, 0)
        self.now = 0
        self.last_generation = 0

    @rule(client=st.sampled_from(["a", "b", "c", "d"]), origin=st.sampled_from([None, "h1", "h2"]))
    def join_new(self, client, origin):
        self.table.join("g", client, self.now, origin=origin)

    @rule(data=st.data())
    def rejoin_existing(self, data):
        group = self.table.get("g")
        if group.members:
            member = group.members[data.draw(st.sampled_from(list(group.members)))]
            before, caught_up = group.generation, member.generation == group.generation
            result = self.table.join("g", member.member_id, self.now)
            assert result.group.generation in (before, before + 1)
            if caught_up and result.group.generation == before:
                assert not result.rebalanced  # a caught-up member rejoining changes nothing

    @rule(data=st.data())
    def commit_held(self, data):
        group = self.table.get("g")
        if group.members:
            member = group.members[data.draw(st.sampled_from(list(group.members)))]
            if member.assignment:
                partition = member.assignment[0][1]
                self.table.check_commit("g", "t", member.member_id, member.generation, {partition: 0})

    @rule()
    def everyone_rejoins(self):
        group = self.table.get("g")
        for _ in range(3):
            for member_id in list(group.members):
                self.table.join("g", member_id, self.now)
        assert {m: x.assignment for m, x in group.members.items()} == group.targets()
        assert all(x.generation == group.generation for x in group.members.values())

    @rule(data=st.data())
    def leave(self, data):
        members = list(self.table.get("g").members)
        if members:
            self.table.leave("g", data.draw(st.sampled_from(members)), None, self.now)

    @rule(data=st.data())
    def heartbeat(self, data):
        members = list(self.table.get("g").members)
        if members:
            self.table.heartbeat("g", data.draw(st.sampled_from(members)), None, self.now)

    @rule(ms=st.integers(0, 2 * TIMEOUT))
    def advance(self, ms):
        self.now += ms
        deadline = self.table.next_deadline_ms()
        expired = self.table.expire(self.now)
        if deadline is not None and deadline <= self.now:
            assert expired
        for member in self.table.get("g").members.values():
            assert member.deadline_ms > self.now

    @rule(extra=st.integers(1, 3))
    def add_partitions(self, extra):
        group = self.table.get("g")
        self.table.set_expansion(group, {"t": group.partitions["t"] + extra}, self.now)

    @invariant()
    def one_owner_per_partition_and_deterministic(self):
        if not hasattr(self, "table"):
            return
        group = self.table.get("g")
        assert group.generation >= self.last_generation
        self.last_generation = group.generation
        owned = [tp for m in group.members.values() for tp in m.assignment]
        assert len(owned) == len(set(owned))  # no partition held by two live members, in any generation
        assert set(owned) <= set(group.topic_partitions())
        assert group.owners == {tp: mid for mid, m in group.members.items() for tp in m.assignment}
        targets = assign_round_robin(group.members, group.topic_partitions())
        for mid, member in group.members.items():
            assert member.generation <= group.generation
            if member.generation == group.generation:  # caught up: its target minus what laggards hold
                assert set(member.assignment) <= set(targets[mid])
                held_elsewhere = {tp for tp, owner in group.owners.items() if owner != mid}
                assert set(targets[mid]) - held_elsewhere == set(member.assignment)
        if not group.members:
            assert not group.owners


TestGroupMachine = GroupMachine.TestCase
