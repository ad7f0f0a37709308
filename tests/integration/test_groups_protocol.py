"""Consumer-group commands against a real broker: reply formats, rebalances, every fencing error, offset
regression, BATCH_COMMIT all-or-nothing, subscriptions, topic lifecycle, CONSUME resume, 50 groups.

One broker for the module, with a 1.5 s session timeout so expiry is quick; tests isolate by topic and group.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator

import pytest

from cursus.client.connection import Connection
from cursus.wire import Command, CommandPayload, encode_crq2
from tests.brokerproc import BrokerProcess
from tests.integration.conftest import connect
from tests.integration.helpers import (
    consume,
    create_topic,
    error_of,
    ok_fields,
    publish_batch,
    render,
    wait_for,
)

SESSION_MS = 1500
_groups = itertools.count(1)


@pytest.fixture(scope="module")
def gbroker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    broker = BrokerProcess(tmp_path_factory.mktemp("groups") / "data",
                           settings={"consumer_session_timeout_ms": SESSION_MS}).start()
    yield broker
    broker.stop()


@pytest.fixture
def conn(gbroker: BrokerProcess) -> Iterator[Connection]:
    with connect(gbroker) as c:
        yield c


@pytest.fixture
def group() -> str:
    return f"grp-{next(_groups)}"


def join(conn: Connection, topic: str, group: str, member: str, **extra: object) -> dict[str, str]:
    args = " ".join(f"{k}={v}" for k, v in extra.items())
    return ok_fields(conn.command(f"JOIN_GROUP topic={topic} group={group} member={member} {args}".strip()))


def parts(value: str) -> list[int]:
    assert value.startswith("[") and value.endswith("]"), value
    return [int(x) for x in value[1:-1].split(",") if x]


def status(conn: Connection, group: str) -> dict:
    frame = conn.command(f"GROUP_STATUS group={group}")
    doc = json.loads(frame.payload)
    assert doc["status"] == "OK", render(frame)
    return doc


def commit(conn: Connection, topic: str, group: str, member: str, generation: object, partition: int,
           offset: int):
    return conn.command(f"COMMIT_OFFSET topic={topic} partition={partition} group={group} offset={offset} "
                        f"member={member} generation={generation}")


def test_join_retried_after_its_reply_was_lost_is_one_member(gbroker, conn, topic_name, group):
    """A client that times out on JOIN_GROUP and retries with its client id must not leave a ghost member
    holding partitions until its session expires (issue 10)."""
    create_topic(conn, topic_name, partitions=2)
    with connect(gbroker) as lost:  # the reply to this join is never read: the socket closes right away
        lost.send(Command.JOIN_GROUP, encode_crq2(CommandPayload((), {"topic": topic_name, "group": group,
                                                                       "member": "c1"})))
    first = wait_for(lambda: _status_or_none(conn, group), what="the lost join applied")
    assert first["member_count"] == 1
    ghost = first["members"][0]["member_id"]
    retry = join(conn, topic_name, group, "c1")
    assert (retry["member"], retry["generation"], parts(retry["assignments"])) == (ghost, "1", [0, 1])
    doc = status(conn, group)
    assert (doc["member_count"], doc["generation"]) == (1, 1)
    # once the member has been heard from under its full id, the same client id joining is a new member
    assert ok_fields(conn.command(f"HEARTBEAT topic={topic_name} group={group} member={ghost}"))
    other = join(conn, topic_name, group, "c1")
    assert other["member"] != ghost and other["generation"] == "2"


def test_two_live_consumers_sharing_a_client_id_stay_two_members(gbroker, conn, topic_name, group):
    """Break-it finding: two consumers started at once with the same client id on one host were merged into
    one member (both then read everything). A join is a retry only once its first connection is closed."""
    create_topic(conn, topic_name, partitions=2)
    with connect(gbroker) as first, connect(gbroker) as second:
        a = join(first, topic_name, group, "shared")
        b = join(second, topic_name, group, "shared")  # the first connection is still open: a new member
        assert a["member"] != b["member"]
        assert status(conn, group)["member_count"] == 2


def _status_or_none(conn: Connection, group: str) -> dict | None:
    payload = conn.command(f"GROUP_STATUS group={group}").payload
    return json.loads(payload) if payload.startswith(b"{") else None


def test_join_sync_heartbeat_and_discovery(gbroker, conn, topic_name, group):
    create_topic(conn, topic_name, partitions=3)
    reply = join(conn, topic_name, group, "c1")
    member = reply["member"]
    assert member.startswith("c1-") and len(member) == 7 and member[3:].isdigit()
    assert reply["generation"] == "1" and parts(reply["assignments"]) == [0, 1, 2]
    raw = conn.command(f"SYNC_GROUP topic={topic_name} group={group} member={member} generation=1").payload.decode()
    assert raw == f"OK generation=1 member={member} assignments=[0,1,2]"
    assert ok_fields(conn.command(f"HEARTBEAT topic={topic_name} group={group} member={member}")) == \
        {"member": member, "generation": "1"}
    assert ok_fields(conn.command(f"HEARTBEAT topic={topic_name} group={group} member={member} generation=1"))
    found = ok_fields(conn.command(f"FIND_COORDINATOR group={group}"))
    assert found == {"coordinator_id": f"127.0.0.1-{gbroker.port}", "coordinator_type": "group", "host": "127.0.0.1",
                     "port": str(gbroker.port)}
    assert ok_fields(conn.command("FIND_COORDINATOR transactional_id=x"))["coordinator_type"] == "transaction"
    assert group in ok_fields(conn.command("LIST_GROUPS"))["groups"].split(",")
    assert ok_fields(conn.command(f"FETCH_OFFSET topic={topic_name} partition=1 group={group}")) == {"offset": "0"}
    assert error_of(conn.command(f"FETCH_OFFSET topic={topic_name} partition=0 group=nope-{group}")).code == \
        "group_not_found"
    doc = status(conn, group)
    assert (doc["group_name"], doc["topic_name"], doc["state"], doc["generation"], doc["member_count"],
            doc["partition_count"]) == (group, topic_name, "Stable", 1, 1, 3)
    assert doc["members"][0]["member_id"] == member and doc["members"][0]["assignments"] == [0, 1, 2]
    # a rejoin with the full id keeps it and does not start a new generation
    again = join(conn, topic_name, group, member)
    assert again["member"] == member and again["generation"] == "1"
    assert error_of(conn.command(f"JOIN_GROUP topic=missing-{group} group=new-{group} member=x")).code == \
        "topic_not_found"
    assert error_of(conn.command(f"SYNC_GROUP topic={topic_name} group={group} member={member}")).code == \
        "missing_generation"


def test_rebalance_on_join_leave_and_session_timeout(conn, topic_name, group):
    create_topic(conn, topic_name, partitions=6)
    a = join(conn, topic_name, group, "a")["member"]
    b_reply = join(conn, topic_name, group, "b")
    b = b_reply["member"]
    assert b_reply["generation"] == "2" and parts(b_reply["assignments"]) == []  # a still holds all six
    assert error_of(conn.command(f"HEARTBEAT topic={topic_name} group={group} member={a} generation=1")).code == \
        "GEN_MISMATCH"
    a_now = join(conn, topic_name, group, a)  # a rejoins and gives b's share up: generation 3 for b to take it
    assert a_now["generation"] == "3" and len(parts(a_now["assignments"])) == 3
    assert error_of(conn.command(f"HEARTBEAT topic={topic_name} group={group} member={b} generation=2")).code == \
        "GEN_MISMATCH"
    b_now = join(conn, topic_name, group, b)
    assert b_now["generation"] == "3"
    assert sorted(parts(a_now["assignments"]) + parts(b_now["assignments"])) == list(range(6))
    c = join(conn, topic_name, group, "c")["member"]
    assert ok_fields(conn.command(f"LEAVE_GROUP topic={topic_name} group={group} member={c}")) == \
        {"group": group, "member": c, "left": "true"}
    assert status(conn, group)["generation"] == 5
    # b stops heartbeating; a keeps going: b expires within the session timeout and a gets everything
    started = time.monotonic()

    def b_gone():
        conn.command(f"HEARTBEAT topic={topic_name} group={group} member={a}")
        doc = status(conn, group)
        return doc if doc["member_count"] == 1 else None

    doc = wait_for(b_gone, timeout_s=10, what="session expiry")
    assert time.monotonic() - started < SESSION_MS / 1000 + 3
    assert doc["generation"] == 6 and doc["members"][0]["member_id"] == a
    assert parts(join(conn, topic_name, group, a)["assignments"]) == list(range(6))
    assert error_of(conn.command(f"HEARTBEAT topic={topic_name} group={group} member={b}")).code == \
        "member_not_found"


def test_commit_fencing_regression_and_idempotence(conn, topic_name, group):
    create_topic(conn, topic_name, partitions=2)
    publish_batch(conn, topic_name, 0, [b"x"] * 20)
    publish_batch(conn, topic_name, 1, [b"x"] * 20)
    a = join(conn, topic_name, group, "a")["member"]
    assert ok_fields(commit(conn, topic_name, group, a, 1, 0, 5)) == {}
    assert ok_fields(commit(conn, topic_name, group, a, 1, 0, 5)) == {}  # same value: idempotent
    err = error_of(commit(conn, topic_name, group, a, 1, 0, 3))
    assert err.code == "offset_regression" and err.error_class.label == "conflict"
    assert ok_fields(conn.command(f"FETCH_OFFSET topic={topic_name} partition=0 group={group}")) == {"offset": "5"}
    b = join(conn, topic_name, group, "b")["member"]  # generation 2; a holds both partitions until it rejoins
    assert ok_fields(commit(conn, topic_name, group, a, 1, 1, 4)) == {}  # a's revocation commit, generation 1
    a_part = parts(join(conn, topic_name, group, a)["assignments"])[0]  # generation 3
    b_part = 1 - a_part
    assert parts(join(conn, topic_name, group, b)["assignments"]) == [b_part]
    cases = {
        "GEN_MISMATCH": commit(conn, topic_name, group, a, 1, a_part, 6),
        "NOT_OWNER": commit(conn, topic_name, group, a, 3, b_part, 6),
        "member_not_found": commit(conn, topic_name, group, "ghost-0000", 3, a_part, 6),
        "missing_generation": conn.command(f"COMMIT_OFFSET topic={topic_name} partition=0 group={group} "
                                           f"offset=6 member={a}"),
        "missing_member": conn.command(f"COMMIT_OFFSET topic={topic_name} partition=0 group={group} "
                                       f"offset=6 generation=3"),
    }
    for code, frame in cases.items():
        err = error_of(frame)
        assert err.code == code, err.render()
    mismatch = error_of(cases["GEN_MISMATCH"])
    assert mismatch.error_class.label == "fencing" and mismatch.fields["current"] == "3"
    assert error_of(cases["NOT_OWNER"]).fields["partition"] == str(b_part)
    assert ok_fields(commit(conn, topic_name, group, a, 3, a_part, 7)) == {}
    validated = ok_fields(conn.command(f"COMMIT_OFFSET topic={topic_name} partition={b_part} group={group} "
                                       f"offset=5 member={b} generation=3 validate_only=true"))
    assert validated == {"validated": "true"}
    assert ok_fields(conn.command(f"FETCH_OFFSET topic={topic_name} partition={b_part} group={group}"))["offset"] \
        == ("5" if b_part == 0 else "4")


def test_commit_past_the_log_end_is_refused(conn, topic_name, group):
    """Standalone (and a cluster coordinator that leads the partition): the coordinator knows the log end.
    A cluster coordinator that does not lead the partition cannot, so this case is not shared with the
    cluster (tests/cluster/test_cluster_groups.py)."""
    create_topic(conn, topic_name, partitions=1)
    publish_batch(conn, topic_name, 0, [b"x"] * 20)
    a = join(conn, topic_name, group, "a")["member"]
    err = error_of(commit(conn, topic_name, group, a, 1, 0, 999))
    assert err.code == "invalid_offset" and err.fields["log_end_offset"] == "20"
    assert ok_fields(commit(conn, topic_name, group, a, 1, 0, 20)) == {}


def test_batch_commit_is_all_or_nothing(conn, topic_name, group):
    create_topic(conn, topic_name, partitions=4)
    for p in range(4):
        publish_batch(conn, topic_name, p, [b"x"] * 10)
    a = join(conn, topic_name, group, "a")["member"]
    base = f"BATCH_COMMIT topic={topic_name} group={group} member={a}"
    assert ok_fields(conn.command(f"{base} generation=1 offsets=P0:3,P1:4")) == {"batched": "2"}
    assert ok_fields(conn.command(f"{base} generation=1 P2:5,P3:6")) == {"batched": "2"}  # positional alias
    b = join(conn, topic_name, group, "b")["member"]
    join(conn, topic_name, group, a)  # generation 3: a gives b's share up
    b_parts = parts(join(conn, topic_name, group, b)["assignments"])
    assert len(b_parts) == 2
    bad = {
        "missing_generation": f"{base} offsets=P0:4",
        "duplicate_partition": f"{base} generation=3 offsets=P0:4,P0:5",
        "invalid_batch_commit_entry": f"{base} generation=3 offsets=P0:4,0:5",
        "no_valid_offsets": f"{base} generation=3 offsets=",
        "NOT_OWNER": f"{base} generation=3 offsets=" + ",".join(f"P{p}:9" for p in range(4)),
        "offset_regression": f"{base} generation=3 offsets=" + ",".join(
            f"P{p}:{1 if p == max(set(range(4)) - set(b_parts)) else 9}" for p in sorted(set(range(4)) - set(b_parts))),
    }
    for code, text in bad.items():
        err = error_of(conn.command(text))
        assert err.code == code, (code, err.render())
    too_many = ",".join(f"P{p}:1" for p in range(1025))
    err = error_of(conn.command(f"{base} generation=3 offsets={too_many}"))
    assert err.code == "invalid_batch_commit_entry" and err.fields["reason"] == "too_many_partitions"
    offsets = [ok_fields(conn.command(f"FETCH_OFFSET topic={topic_name} partition={p} group={group}"))["offset"]
               for p in range(4)]
    assert offsets == ["3", "4", "5", "6"]  # nothing from the rejected batches


def test_subscriptions_partition_increase_and_topic_delete(conn, topic_name, group):
    t1, t2 = f"{topic_name}-a", f"{topic_name}-b"
    create_topic(conn, t1, partitions=1)
    create_topic(conn, t2, partitions=2)
    reg = ok_fields(conn.command(f"REGISTER_GROUP group={group} topics={t1},{t2}"))
    assert reg["group"] == group and reg["registered"] == "true" and reg["partitions"] == "3"
    assert error_of(conn.command(f"REGISTER_GROUP group={group}")).code == "invalid_subscription"
    assert ok_fields(conn.command(f"FETCH_OFFSET topic={t2} partition=1 group={group}")) == {"offset": "0"}
    joined = ok_fields(conn.command(f"JOIN_GROUP group={group} member=m"))
    assert joined["topic_assignments"] == f"{t1}:P0,{t2}:P0,{t2}:P1"
    member = joined["member"]
    create_topic(conn, t2, partitions=3)  # partition increase: a new generation; P2 is the member's once it rejoins
    assert status(conn, group)["generation"] == 2
    assert f"{t2}:P2" in ok_fields(conn.command(f"JOIN_GROUP group={group} member={member}"))["topic_assignments"]
    doc = status(conn, group)
    assert doc["generation"] == 2 and f"{t2}:P2" in doc["members"][0]["topic_assignments"]
    assert error_of(conn.command(f"DELETE topic={t1}")).code == "topic_delete_blocked"
    ok_fields(conn.command(f"LEAVE_GROUP group={group} member={member}"))

    pattern_group = f"{group}-pat"
    ok_fields(conn.command(f"REGISTER_GROUP group={pattern_group} pattern={topic_name}-p*"))
    assert status(conn, pattern_group)["partition_count"] == 0
    create_topic(conn, f"{topic_name}-p1", partitions=2)
    assert status(conn, pattern_group)["topics"] == [f"{topic_name}-p1"]

    single = f"{group}-one"
    m = join(conn, t1, single, "x")["member"]
    commit(conn, t1, single, m, 1, 0, 0)
    ok_fields(conn.command(f"LEAVE_GROUP topic={t1} group={single} member={m}"))
    assert ok_fields(conn.command(f"DELETE topic={t1}"))["deleted"] == "true"
    assert error_of(conn.command(f"GROUP_STATUS group={single}")).code == "group_not_found"
    assert status(conn, group)["topics"] == [t2]  # the multi-topic group lost the deleted topic


def test_consume_with_group_starts_at_committed_offset(conn, topic_name, group):
    create_topic(conn, topic_name, partitions=1)
    publish_batch(conn, topic_name, 0, [f"m{i}".encode() for i in range(10)], acks="all")  # readable now
    m = join(conn, topic_name, group, "m")["member"]
    ok_fields(commit(conn, topic_name, group, m, 1, 0, 6))
    # a cluster partition leader that is not the group's coordinator applies the commit a moment later
    wait_for(lambda: [r.offset for r in consume(conn, topic_name, 0, 2, group=group)][:1] == [6], 5,
             "the committed offset at the partition leader")
    assert [r.offset for r in consume(conn, topic_name, 0, 8, group=group)][:1] == [8]
    assert [r.offset for r in consume(conn, topic_name, 0, 2)][:1] == [2]  # no group: as requested


def test_fifty_groups_on_one_broker(conn, topic_name, group):
    create_topic(conn, topic_name, partitions=4)
    for p in range(4):
        publish_batch(conn, topic_name, p, [b"x"] * 60)
    names = [f"{group}-{i}" for i in range(50)]
    members = {}
    for i, name in enumerate(names):
        reply = join(conn, topic_name, name, f"c{i}")
        members[name] = reply["member"]
        batch = ",".join(f"P{p}:{i + p}" for p in range(4))
        assert ok_fields(conn.command(f"BATCH_COMMIT topic={topic_name} group={name} member={reply['member']} "
                                      f"generation=1 offsets={batch}")) == {"batched": "4"}
        assert status(conn, name)["member_count"] == 1  # now: it is not heartbeating (1.5 s sessions)
    listed = set(ok_fields(conn.command("LIST_GROUPS"))["groups"].split(","))
    assert set(names) <= listed
    for i, name in enumerate(names):
        assert ok_fields(conn.command(f"FETCH_OFFSET topic={topic_name} partition=3 group={name}")) == \
            {"offset": str(i + 3)}
