"""The SDK group consumers (cursus.client.group) in-process: join, rebalance callbacks, commit semantics,
resume from committed offsets, stream mode, and the asyncio flavour."""

from __future__ import annotations

import time

import pytest

from cursus.client.connection import Client
from cursus.client.connection import ok_fields as client_ok_fields
from cursus.client.errors import FencingError
from cursus.client.group import AsyncGroupConsumer, GroupConsumer, GroupMembership, parse_partition_list
from tests.integration.conftest import connect
from tests.integration.helpers import create_topic, ok_fields, publish_batch


def drain(consumer, want: int, timeout_s: float = 15.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        got.extend(consumer.poll(0.2))
    return got


def test_membership_decisions_without_io():
    state = GroupMembership("t", "g", "c")
    assert state.join_fields() == {"topic": "t", "group": "g", "member": "c"}
    assert state.on_join({"member": "c-0001", "generation": "3"}, "OK generation=3 member=c-0001 assignments=[2 0]")
    assert state.assignment == (0, 2) and state.join_fields()["generation"] == "3"
    state.processed = {0: 5, 2: 7, 9: 1}
    state.committed = {2: 7}
    assert state.pending_commits() == {0: 5}
    assert state.commit_request({0: 5})[0].name == "COMMIT_OFFSET"
    command, fields = state.commit_request({0: 5, 2: 8})
    assert command.name == "BATCH_COMMIT" and fields["offsets"] == "P0:5,P2:8"
    assert parse_partition_list("OK assignments=[] x") == []


def test_two_consumers_rebalance_and_resume(shared_broker, topic_name):
    address = f"127.0.0.1:{shared_broker.port}"
    group = f"g-{topic_name}"
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name, partitions=4)
        for p in range(4):
            publish_batch(conn, topic_name, p, [f"{p}-{i}".encode() for i in range(25)])
    events: list[tuple[str, list[int]]] = []
    first = GroupConsumer(topic_name, group, address, auto_commit=False, heartbeat_interval_s=0.2, wait_ms=100,
                          on_assigned=lambda ps: events.append(("assigned", ps)),
                          on_revoked=lambda ps: events.append(("revoked", ps)))
    second = None
    try:
        assert first.assignment() == [0, 1, 2, 3]
        records = drain(first, 40)
        assert len(records) >= 40
        committed = first.commit()
        assert committed and all(v > 0 for v in committed.values())
        second = GroupConsumer(topic_name, group, address, auto_commit=False, heartbeat_interval_s=0.2, wait_ms=100)
        assert second.assignment() == []  # the join barrier: the first member still holds every partition
        # the first member learns of the rebalance from its heartbeat and rejoins on its next poll, giving the
        # second member's share up; the second learns that from its heartbeat and rejoins
        early: list = []
        deadline = time.monotonic() + 10
        while (len(first.state.assignment), len(second.state.assignment)) != (2, 2) and time.monotonic() < deadline:
            records.extend(first.poll(0.1))
            early.extend(second.poll(0.1))
        assert sorted(first.state.assignment + second.state.assignment) == [0, 1, 2, 3]
        assert ("revoked", sorted(set(range(4)) - set(first.state.assignment))) in events
        # the second member starts at the committed offsets, which include what the first member processed
        # before it gave the partitions up: nothing it was handed is delivered again
        handed = {}
        for record in records:
            handed[record.partition] = max(handed.get(record.partition, 0), record.offset + 1)
        with connect(shared_broker) as conn:
            for p in second.state.assignment:
                publish_batch(conn, topic_name, p, [b"more"] * 5)
        got = early + drain(second, 10)
        assert got and all(r.offset >= handed.get(r.partition, 0) for r in got)
        # a commit with the old generation is fenced
        stale = GroupMembership(topic_name, group, "x", member_id=first.member_id, generation=1,
                                assignment=tuple(first.state.assignment))
        command, fields = stale.commit_request({first.state.assignment[0]: 1})
        with Client(address) as client, pytest.raises(FencingError):
            client_ok_fields(client.call(command, fields))
    finally:
        first.close()
        if second is not None:
            second.close()
    with connect(shared_broker) as conn:
        assert group in ok_fields(conn.command("LIST_GROUPS"))["groups"].split(",")


def test_stream_mode_reads_everything(shared_broker, topic_name):
    address = f"127.0.0.1:{shared_broker.port}"
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name, partitions=2)
        for p in range(2):
            publish_batch(conn, topic_name, p, [b"s"] * 30)
    with GroupConsumer(topic_name, f"gs-{topic_name}", address, mode="stream", wait_ms=100) as consumer:
        got = drain(consumer, 60)
        assert sorted((r.partition, r.offset) for r in got) == [(p, o) for p in range(2) for o in range(30)]
        with connect(shared_broker) as conn:
            publish_batch(conn, topic_name, 1, [b"late"])
        assert [(r.partition, r.offset, r.value) for r in drain(consumer, 1)] == [(1, 30, b"late")]
    with connect(shared_broker) as conn:  # close() auto-committed what poll returned
        assert ok_fields(conn.command(f"FETCH_OFFSET topic={topic_name} partition=1 group=gs-{topic_name}")) == \
            {"offset": "31"}


async def test_async_group_consumer(shared_broker, topic_name):
    address = f"127.0.0.1:{shared_broker.port}"
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name, partitions=2)
        for p in range(2):
            publish_batch(conn, topic_name, p, [b"a"] * 10)
    group = f"ga-{topic_name}"
    async with AsyncGroupConsumer(topic_name, group, address, auto_commit=False, wait_ms=100) as consumer:
        assert await consumer.assignment() == [0, 1]
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 20 and time.monotonic() < deadline:
            got.extend(await consumer.poll(0.2))
        assert len(got) == 20
        assert await consumer.commit() == {0: 10, 1: 10}
    with connect(shared_broker) as conn:
        assert ok_fields(conn.command(f"FETCH_OFFSET topic={topic_name} partition=0 group={group}")) == \
            {"offset": "10"}
