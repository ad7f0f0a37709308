"""Group consumers on a topic list or a pattern (sans-IO): REGISTER_GROUP before the first join,
``topic_assignments`` parsing, (topic, partition) keys, one commit request per topic."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cursus.client.group import (
    GroupMembership,
    commit_steps,
    parse_topic_assignments,
    rejoin_steps,
    run_steps,
)
from cursus.wire import Command, Frame, Kind, Status

_TOPIC = st.text(alphabet="abcdefghij-_.=0123456789", min_size=1, max_size=12)


@given(st.sets(st.tuples(_TOPIC, st.integers(0, 9999)), max_size=20))
def test_topic_assignments_round_trip(pairs: set[tuple[str, int]]) -> None:
    text = ",".join(f"{t}:P{p}" for t, p in pairs)
    assert parse_topic_assignments(text) == sorted(pairs)


def test_topic_assignments_refuse_malformed_entries() -> None:
    with pytest.raises(ValueError):
        parse_topic_assignments("orders:0")
    assert parse_topic_assignments("") == []


def _ok(text: str, command: Command) -> Frame:
    return Frame(Kind.RESPONSE, command, Status.OK, 1, text.encode(), None)


def test_pattern_group_registers_then_joins_without_topic_and_fetches_per_topic() -> None:
    state = GroupMembership("", "audit", "c1", pattern="events-*")
    log: list[tuple[Command, dict[str, str]]] = []
    replies = {
        Command.REGISTER_GROUP: ["OK group=audit pattern=events-* registered=true partitions=3 epoch=1"],
        Command.JOIN_GROUP: ["OK generation=1 member=c1-0001 topic_assignments=events-eu:P0,events-us:P1,events-eu:P1"],
        Command.FETCH_OFFSET: ["OK offset=4", "OK offset=0", "OK offset=2"],
    }

    def call(command: Command, fields: dict[str, str]) -> Frame:
        log.append((command, dict(fields)))
        return _ok(replies[command].pop(0), command)

    result = run_steps(rejoin_steps(state, "earliest", None), call)
    assert result is not None
    positions, assignment = result
    assert assignment == [("events-eu", 0), ("events-eu", 1), ("events-us", 1)]
    assert positions == {("events-eu", 0): 4, ("events-eu", 1): 0, ("events-us", 1): 2}
    assert [c for c, _ in log] == [Command.REGISTER_GROUP, Command.JOIN_GROUP] + [Command.FETCH_OFFSET] * 3
    assert log[0][1] == {"group": "audit", "pattern": "events-*"}
    assert "topic" not in log[1][1] and log[1][1]["member"] == "c1"
    assert [(f["topic"], f["partition"]) for c, f in log[2:]] == [("events-eu", "0"), ("events-eu", "1"),
                                                                    ("events-us", "1")]
    assert "topic" not in state.member_fields() and "topic" not in state.leave_fields()

    state.processed = {("events-eu", 0): 9, ("events-eu", 1): 3, ("events-us", 1): 2}
    sent: list[tuple[Command, dict[str, str]]] = []

    def commit_call(command: Command, fields: dict[str, str]) -> Frame:
        sent.append((command, dict(fields)))
        return _ok("OK", command)

    committed = run_steps(commit_steps(state, None), commit_call)
    assert committed == {("events-eu", 0): 9, ("events-eu", 1): 3}  # events-us/1 is already at 2
    assert [(c, f["topic"], f.get("offsets")) for c, f in sent] == [(Command.BATCH_COMMIT, "events-eu", "P0:9,P1:3")]
    state.processed[("events-us", 1)] = 5
    sent.clear()
    run_steps(commit_steps(state, None), commit_call)
    assert [(c, f["topic"], f["partition"], f["offset"]) for c, f in sent] == [
        (Command.COMMIT_OFFSET, "events-us", "1", "5")]


def test_one_topic_groups_keep_partition_numbers() -> None:
    state = GroupMembership("orders", "billing", "c1")
    assert not state.multi_topic and state.join_fields()["topic"] == "orders"
    assert state.key("orders", 3) == 3 and state.topic_partition(3) == ("orders", 3)
