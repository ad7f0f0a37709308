"""The metadata seam: command encoding, the pure apply() and the standalone backend."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cursus.metadata.apply import ApplyResult, apply
from cursus.metadata.backend import StandaloneMetadata
from cursus.metadata.commands import (
    AlterTopicConfig,
    Command,
    CreateTopic,
    DeleteTopic,
    PutTopic,
    RegisterBroker,
    decode,
    encode,
)
from cursus.metadata.state import BrokerInfo, MetadataState, ring_replicas
from cursus.metadata.topics import MANIFEST_NAME, TopicDefinition, TopicPolicy, TopicSpec, load_manifest
from cursus.params import parse_args
from cursus.wire.errors import BrokerError


def create_topic(request_id: str, topic: str, fields: dict[str, str], default_partitions: int = 1,
                 default_cleanup_policy: str = "delete", expected_revision: int | None = None) -> CreateTopic:
    """A CreateTopic command from CREATE's string fields (validated as the session would)."""
    spec = parse_args(TopicSpec, {"topic": topic, **fields}, "CREATE")
    return CreateTopic(request_id, spec, default_partitions, default_cleanup_policy, expected_revision)


NAMES = st.sampled_from(["a", "b", "c.d"])
REQUEST_IDS = st.sampled_from([f"r{i}" for i in range(6)])
REVISIONS = st.none() | st.integers(0, 4)
BROKERS = st.builds(BrokerInfo, st.sampled_from(["b1", "b2", "b3"]), st.just("h:1"), st.just(""),
                    st.sampled_from(["active", "inactive"]))
CREATE_FIELDS = st.fixed_dictionaries({}, optional={
    "partitions": st.sampled_from(["1", "2", "3"]),
    "replication_factor": st.sampled_from(["1", "3"]),
    "min_in_sync_replicas": st.sampled_from(["1", "2", "default"]),
    "retention_hours": st.sampled_from(["0", "5"]),
    "partitioner": st.sampled_from(["hash_key", "round_robin"]),
})
COMMANDS: st.SearchStrategy[Command] = st.one_of(
    st.builds(create_topic, REQUEST_IDS, NAMES, CREATE_FIELDS, st.integers(1, 3), st.just("delete"), REVISIONS),
    st.builds(AlterTopicConfig, REQUEST_IDS, NAMES, st.none() | st.integers(0, 3), REVISIONS),
    st.builds(DeleteTopic, REQUEST_IDS, NAMES, REVISIONS),
    st.builds(RegisterBroker, REQUEST_IDS, BROKERS),
    st.builds(PutTopic, REQUEST_IDS,
              st.builds(TopicDefinition, NAMES, st.integers(1, 3), st.integers(1, 5), st.integers(1, 2),
                        policy=st.just(TopicPolicy(cleanup_policy="compact"))), REVISIONS),
)

LOCAL = BrokerInfo("h-9000", "h:9000")


def start_state() -> MetadataState:
    return apply(MetadataState(), RegisterBroker("boot", LOCAL))[0]


def run(state: MetadataState, commands: list[Command]) -> list[tuple[MetadataState, ApplyResult | str]]:
    """Apply each command; a rejected one leaves the state and records its error code."""
    out: list[tuple[MetadataState, ApplyResult | str]] = []
    for command in commands:
        try:
            state, result = apply(state, command)
            out.append((state, result))
        except BrokerError as exc:
            out.append((state, exc.error.code))
    return out


@given(COMMANDS)
def test_command_bytes_round_trip_and_are_canonical(command):
    data = encode(command)
    assert decode(data) == command
    assert encode(decode(data)) == data
    doc = json.loads(data)
    assert doc["v"] == 1 and list(doc) == sorted(doc)


@pytest.mark.parametrize("data", [
    b"", b"[]", b'{"v":2,"type":"delete_topic","request_id":"r","topic":"t","expected_revision":null}',
    b'{"v":1,"type":"nope","request_id":"r"}',
    b'{"v":1,"type":"delete_topic","request_id":"r","topic":"t"}',
    b'{"v":1,"type":"delete_topic","request_id":"r","topic":"t","expected_revision":"1"}',
    b'{"v":1,"type":"delete_topic","request_id":"r","topic":"t","expected_revision":null,"x":1}',
    b'{"v":1,"type":"register_broker","request_id":"r","broker":{"id":"b"}}',
])
def test_decode_is_strict(data):
    with pytest.raises(ValueError):
        decode(data)


@given(st.lists(COMMANDS, max_size=25))
def test_apply_invariants(commands):
    state = start_state()
    history = run(state, commands)
    assert run(state, commands) == history  # deterministic
    previous = state
    for after, outcome in history:
        if isinstance(outcome, str):
            assert after is previous  # a rejected command changes nothing
        else:
            assert after.revision == previous.revision + (1 if outcome.changed else 0)
        for name, old in previous.topics.items():
            new = after.topics.get(name)
            if new is not None:
                assert new.partitions >= old.partitions and new.revision >= old.revision
                for p in range(old.partitions):  # existing partitions keep their assignment
                    assert after.assignments[(name, p)] == previous.assignments[(name, p)]
        # every partition of every topic is assigned, nothing else is
        assert set(after.assignments) == {(n, p) for n, d in after.topics.items() for p in range(d.partitions)}
        for a in after.assignments.values():
            assert a.leader == (a.replicas[0] if a.replicas else None) and set(a.isr) <= set(a.replicas)
            assert a.leader_epoch == after.initial_leader_epoch == 1 and a.committed_hwm == 0
        for defn in after.topics.values():
            if defn.min_in_sync_replicas is not None:
                assert 1 <= defn.min_in_sync_replicas <= defn.replication_factor
        previous = after


@given(st.lists(COMMANDS, max_size=12), COMMANDS)
def test_compare_and_set_on_topic_revision(commands, command):
    state = run(start_state(), commands)[-1][0] if commands else start_state()
    if isinstance(command, RegisterBroker):
        return
    name = command.definition.name if isinstance(command, PutTopic) else command.topic
    current = state.topics.get(name)
    actual = current.revision if current is not None else 0
    fields = {f: getattr(command, f) for f in command.__slots__}
    stale = type(command)(**{**fields, "request_id": "fresh", "expected_revision": actual + 1})
    with pytest.raises(BrokerError) as info:
        apply(state, stale)
    assert info.value.error.code == "version_conflict"
    matching = type(command)(**{**fields, "request_id": "fresh", "expected_revision": actual})
    try:
        apply(state, matching)
    except BrokerError as exc:  # any rejection, but never a revision conflict
        assert exc.error.code != "version_conflict"


def test_a_retried_request_applies_once():
    state = start_state()
    create = create_topic("req-1", "t", {"partitions": "2"}, 4, "delete")
    once, first = apply(state, create)
    assert first.changed and first.added == (("t", 0), ("t", 1))
    twice, second = apply(once, create)
    assert twice is once and not second.changed and second.topic == first.topic
    # the same request id after a deletion does not recreate the topic
    deleted, _ = apply(once, DeleteTopic("req-2", "t"))
    again, _ = apply(deleted, create)
    assert "t" not in again.topics


def test_create_places_on_the_active_brokers_and_caps_the_replication_factor():
    state = start_state()
    state, _ = apply(state, RegisterBroker("r1", BrokerInfo("b", "b:1")))
    state, _ = apply(state, RegisterBroker("r2", BrokerInfo("c", "c:1", status="inactive")))
    state, result = apply(state, create_topic("r3", "t", {"partitions": "8", "replication_factor": "3"}, 1, "delete"))
    assert result.topic is not None and result.topic.replication_factor == 2
    for p in range(8):
        a = state.assignments[("t", p)]
        assert sorted(a.replicas) == ["b", "h-9000"] and a.leader == a.replicas[0] and a.isr == a.replicas
    with pytest.raises(BrokerError) as info:
        apply(state, create_topic("r4", "u", {"replication_factor": "3", "min_in_sync_replicas": "3"}, 1, "delete"))
    assert info.value.error.code == "invalid_min_in_sync_replicas"


def test_standalone_create_stores_rf_1_and_refuses_a_higher_min_isr():
    state = start_state()
    with pytest.raises(BrokerError) as info:
        apply(state, create_topic("r", "t", {"replication_factor": "3", "min_in_sync_replicas": "2"}, 1, "delete"))
    assert info.value.error.code == "invalid_min_in_sync_replicas"
    state, result = apply(state, create_topic("r", "t", {"replication_factor": "3"}, 1, "delete"))
    assert result.topic is not None and result.topic.replication_factor == 1
    assert state.assignments[("t", 0)].replicas == ("h-9000",)


@given(st.lists(st.sampled_from(["b1", "b2", "b3", "b4"]), min_size=1, unique=True), st.text(max_size=8),
       st.integers(1, 5))
def test_ring_placement_is_distinct_and_order_independent(brokers, key, count):
    chosen = ring_replicas(brokers, key, count)
    assert len(chosen) == min(count, len(brokers)) and len(set(chosen)) == len(chosen)
    assert ring_replicas(list(reversed(brokers)), key, count) == chosen


def test_standalone_backend_persists_then_publishes(tmp_path):
    async def scenario() -> None:
        async def run_blocking(fn):
            return fn()

        seen: list[tuple[int, int]] = []
        backend = StandaloneMetadata(tmp_path, run_blocking, LOCAL)

        def listener(old: MetadataState, new: MetadataState) -> None:
            # durable before visible: the manifest already names the topics of the new state
            assert set(load_manifest(tmp_path)) == set(new.topics)
            seen.append((old.revision, new.revision))

        backend.subscribe(listener)
        await backend.submit(create_topic("r1", "t", {"partitions": "3"}, 4, "delete"))
        await backend.submit(create_topic("r2", "t", {"partitions": "3"}, 4, "delete"))  # no-op: no publish
        await backend.submit(AlterTopicConfig("r3", "t", 1))
        assert seen == [(1, 2), (2, 3)]
        reopened = StandaloneMetadata(tmp_path, run_blocking, LOCAL)
        assert reopened.state.topics == backend.state.topics
        assert reopened.state.assignments == backend.state.assignments
        await backend.submit(DeleteTopic("r4", "t"))
        assert load_manifest(tmp_path) == {} and (tmp_path / MANIFEST_NAME).exists()

    asyncio.run(scenario())


def test_standalone_backend_commit_failure_changes_nothing(tmp_path):
    async def scenario() -> None:
        async def failing(fn):
            raise OSError(28, "No space left on device")

        backend = StandaloneMetadata(tmp_path, failing, LOCAL)
        backend.subscribe(lambda old, new: pytest.fail("published an uncommitted state"))
        with pytest.raises(OSError):
            await backend.submit(create_topic("r1", "t", {}, 4, "delete"))
        assert backend.get("t") is None and backend.state.revision == 1

    asyncio.run(scenario())
