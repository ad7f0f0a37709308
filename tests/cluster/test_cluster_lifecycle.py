"""TRUNCATE and DELETE on a 3-node Raft cluster (spec "DELETE", "TRUNCATE"): one metadata transition each,
every replica resets or removes its storage, groups lose their offsets, the state stays so after a kill -9
and restart (journal replay and snapshot restore), recreation starts empty, and the lifecycle protocol
version every broker advertises.

One cluster for the module; every test leaves all three brokers running."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from cursus.client.connection import Connection, ConnectionClosed
from cursus.wire import Command, Status
from tests.cluster.clustersupport import Cluster, wait_for
from tests.cluster.replsupport import (
    module_cluster,
    partition_state,
    read_partition,
    restore_brokers,
    status,
    wait_isr,
)
from tests.cluster.test_cluster_groups import RoutingConnection
from tests.integration.helpers import error_of, ok_fields, render

pytestmark = pytest.mark.timeout(180)


# frequent snapshots: a restarted node restores from a snapshot taken after the lifecycle transition
cluster = module_cluster("lifecycle", raft_snapshot_min_entries=20, raft_snapshot_interval_ms=200)


@pytest.fixture(autouse=True)
def all_brokers_running(cluster: Cluster):
    yield
    restore_brokers(cluster)


@pytest.fixture
def routed(cluster: Cluster):
    conn = RoutingConnection([b.address for b in cluster.brokers])
    yield conn
    conn.close()


@contextmanager
def via(broker) -> Iterator[RoutingConnection]:
    """A routing connection that starts at ``broker``."""
    conn = RoutingConnection([broker.address])
    try:
        yield conn
    finally:
        conn.close()


def _publish(routed: RoutingConnection, topic: str, partition: int, count: int, prefix: str) -> None:
    for i in range(count):
        frame = routed.command(f"PUBLISH topic={topic} partition={partition} acks=all producerId=p "
                               f"message={prefix}{i}")
        assert frame.status == Status.OK, render(frame)


def _group_with_offsets(routed: RoutingConnection, topic: str, group: str, offset: int) -> None:
    joined = ok_fields(routed.command(f"JOIN_GROUP topic={topic} group={group} member=m"))
    frame = routed.command(f"COMMIT_OFFSET topic={topic} partition=0 group={group} offset={offset} "
                           f"member={joined['member']} generation={joined['generation']}")
    assert frame.status == Status.OK, render(frame)
    ok_fields(routed.command(f"LEAVE_GROUP topic={topic} group={group} member={joined['member']}"))


def _everywhere(cluster: Cluster, check) -> None:
    for broker in cluster.brokers:
        with via(broker) as conn:
            check(conn)


def test_every_broker_advertises_lifecycle_protocol_2(cluster: Cluster) -> None:
    brokers = status(cluster.brokers[1])["brokers"]
    assert [b["lifecycle_protocol"] for b in brokers] == [2, 2, 2]  # TRUNCATE (1) and compaction (2)
    with via(cluster.brokers[2]) as conn:
        text = conn.command("LIST_CLUSTER").payload.decode()
    assert text.startswith("OK brokers="), text
    rows = json.loads(text[len("OK brokers="):])
    assert [(r["id"], r["status"], r["lifecycle_protocol"]) for r in rows] == [
        ("node-1", "active", 2), ("node-2", "active", 2), ("node-3", "active", 2)]
    assert all(r["client_addr"] and r["addr"] and r["last_seen"].endswith("Z") for r in rows)


def test_truncate_resets_every_replica_and_survives_restart(cluster: Cluster, routed) -> None:
    ok_fields(routed.command("CREATE topic=trunc partitions=1 replication_factor=3"))
    wait_isr(cluster, "trunc", 3)
    _publish(routed, "trunc", 0, 20, "old")
    _group_with_offsets(routed, "trunc", "tg", 15)
    before = partition_state(cluster, "trunc")
    assert before["committed_hwm"] == 20
    joined = ok_fields(routed.command("JOIN_GROUP topic=trunc group=busy member=b"))
    assert error_of(routed.command("TRUNCATE topic=trunc expected_revision=1")).code == "topic_truncate_blocked"
    ok_fields(routed.command(f"LEAVE_GROUP topic=trunc group=busy member={joined['member']}"))

    # through a broker that is not the Raft leader: one Raft transition, applied everywhere
    leader_id = status(cluster.brokers[0])["raft_leader"]
    follower = next(b for b in cluster.brokers if b.log_dir.name != leader_id)
    with via(follower) as conn:
        reply = ok_fields(conn.command("TRUNCATE topic=trunc expected_revision=1"))
    assert reply == {"topic": "trunc", "truncated": "true", "revision": "2", "lifecycle_epoch": "1",
                     "leo": "0", "hwm": "0"}
    after = wait_isr(cluster, "trunc", 3)
    assert after["committed_hwm"] == 0 and after["leader_epoch"] > before["leader_epoch"]
    # the TRUNCATE answered once the broker that took it reset its replica; the others converge shortly
    assert wait_for(lambda: read_partition(cluster, "trunc") == [], 10, "the leader serving the new epoch")
    for group in ("tg", "busy"):
        assert error_of(routed.command(f"GROUP_STATUS group={group}")).code == "group_not_found"
    _publish(routed, "trunc", 0, 3, "new")
    assert [r.payload for r in read_partition(cluster, "trunc")] == [b"new0", b"new1", b"new2"]
    assert [r.offset for r in read_partition(cluster, "trunc")] == [0, 1, 2]
    for broker in cluster.brokers:
        marker = broker.log_dir / "topics" / "trunc" / "lifecycle_epoch"
        # "<lifecycle epoch> <incarnation>": the generation the folder holds
        assert wait_for(lambda m=marker: m.exists() and m.read_text().split()[0] == "1", 10, f"{marker}")

    # a kill -9 of the partition leader: the new leader and the restarted node serve the new generation
    victim = cluster.by_id(partition_state(cluster, "trunc")["leader"])
    victim.kill()
    victim.start(timeout_s=60)
    wait_isr(cluster, "trunc", 3, timeout=30)
    # (a restarted leader whose replayed log ends below the committed HWM hands the partition over first)
    assert wait_for(lambda: [r.payload for r in read_partition(cluster, "trunc")], 30, "a serving leader") == \
        [b"new0", b"new1", b"new2"]

    def describe(conn) -> None:
        doc = json.loads(conn.command("DESCRIBE topic=trunc").payload)
        assert (doc["definition"]["revision"], doc["definition"]["lifecycle_epoch"]) == (2, 1)

    _everywhere(cluster, describe)
    assert error_of(routed.command("TRUNCATE topic=trunc expected_revision=1")).code == "version_conflict"
    assert error_of(routed.command("TRUNCATE topic=__consumer_offsets expected_revision=1")).code == \
        "internal_topic_delete_forbidden"


def test_delete_then_recreate_starts_empty_and_stays_empty_after_restart(cluster: Cluster, routed) -> None:
    ok_fields(routed.command("CREATE topic=gone partitions=1 replication_factor=3"))
    wait_isr(cluster, "gone", 3)
    _publish(routed, "gone", 0, 10, "old")
    _group_with_offsets(routed, "gone", "dg", 7)
    assert ok_fields(routed.command("FETCH_OFFSET topic=gone partition=0 group=dg")) == {"offset": "7"}

    leader_id = status(cluster.brokers[0])["raft_leader"]
    follower = next(b for b in cluster.brokers if b.log_dir.name != leader_id)
    with via(follower) as conn:
        assert ok_fields(conn.command("DELETE topic=gone")) == {"topic": "gone", "deleted": "true"}

    def absent(conn) -> None:
        assert error_of(conn.command("METADATA topic=gone")).code == "topic_not_found"

    wait_for(lambda: _everywhere(cluster, absent) or True, 10, "the topic gone everywhere")
    for broker in cluster.brokers:
        wait_for(lambda b=broker: not (b.log_dir / "topics" / "gone").exists(), 10, f"{broker.log_dir} storage")
    assert error_of(routed.command("GROUP_STATUS group=dg")).code == "group_not_found"

    fresh = ok_fields(routed.command("CREATE topic=gone partitions=1 replication_factor=3"))
    assert (fresh["revision"], fresh["lifecycle_epoch"]) == ("1", "0")
    wait_isr(cluster, "gone", 3)
    assert wait_for(lambda: read_partition(cluster, "gone") == [], 10, "the recreated topic served")
    assert error_of(routed.command("GROUP_STATUS group=dg")).code == "group_not_found"

    # every node restarts (journal plus snapshot): nothing old comes back
    for broker in cluster.brokers:
        broker.kill()
    cluster.start()
    wait_isr(cluster, "gone", 3, timeout=30)
    assert wait_for(lambda: read_partition(cluster, "gone") == [], 30, "a serving leader")
    assert error_of(routed.command("GROUP_STATUS group=dg")).code == "group_not_found"
    _publish(routed, "gone", 0, 1, "new")
    assert [(r.offset, r.payload) for r in read_partition(cluster, "gone")] == [(0, b"new0")]



def test_a_replica_killed_in_the_middle_of_its_reset_restarts_into_the_new_generation(cluster: Cluster,
                                                                                       routed) -> None:
    """A follower dies (kill -9 at the crash point) after moving the old folder away and before writing the
    new generation's marker; restarted, it serves only the new generation once it leads."""
    ok_fields(routed.command("CREATE topic=midway partitions=1 replication_factor=3"))
    wait_isr(cluster, "midway", 3)
    _publish(routed, "midway", 0, 12, "old")
    row = partition_state(cluster, "midway")
    victim = next(b for b in cluster.brokers if b.log_dir.name != row["leader"])
    victim.kill()
    victim.env = {"CURSUS_LIFECYCLE_CRASH_AT": "truncate_after_trash"}
    try:
        victim.start(timeout_s=60)
        wait_isr(cluster, "midway", 3, timeout=30)
        leader = cluster.by_id(partition_state(cluster, "midway")["leader"])
        with via(leader) as conn:
            assert ok_fields(conn.command("TRUNCATE topic=midway expected_revision=1"))["truncated"] == "true"
        assert victim.wait_exit(30) == 137
    finally:
        victim.env = {}
    _publish(routed, "midway", 0, 2, "new")
    victim.start(timeout_s=60)
    wait_isr(cluster, "midway", 3, timeout=30)
    with via(leader) as conn:
        wait_for(lambda: ok_fields(conn.command(f"ELECT_LEADER topic=midway partition=0 broker={victim.log_dir.name}")),
                 20, "the victim elected")
    wait_for(lambda: partition_state(cluster, "midway")["leader"] == victim.log_dir.name, 10, "the victim leads")
    assert wait_for(lambda: [r.payload for r in read_partition(cluster, "midway")], 20, "the victim serving") == \
        [b"new0", b"new1"]
    assert (victim.log_dir / "topics" / "midway" / "lifecycle_epoch").read_text().split()[0] == "1"


def _raw_publish(conn, topic: str, payload: bytes, acks: str) -> int:
    """Send one PUBLISH batch without reading its answer; returns its request id."""
    from tests.integration.test_pipelining import _batch, _send_all
    return _send_all(conn, [(Command.PUBLISH, _batch(topic, 0, [payload], acks=acks))])[0][0]


def test_an_acks_all_publish_waiting_during_truncate_answers_leader_not_available_outcome_unknown(
        cluster: Cluster, routed) -> None:
    """An acks=all PUBLISH appended on the leader waits for a follower (paused with SIGSTOP, still in the
    ISR); the TRUNCATE replaces the leader's replica: the waiter answers the retryable ``leader_not_available
    outcome=unknown`` (its record was appended to the old generation and is gone), never success and never
    ``topic_not_found`` (issue 18). The new generation is empty on every replica."""
    ok_fields(routed.command("CREATE topic=waiting partitions=1 replication_factor=3"))
    wait_isr(cluster, "waiting", 3)
    _publish(routed, "waiting", 0, 5, "old")
    row = partition_state(cluster, "waiting")
    raft_leader = status(cluster.brokers[0])["raft_leader"]
    leader = cluster.by_id(row["leader"])
    follower = next(b for b in cluster.brokers if b.log_dir.name not in (row["leader"], raft_leader))
    follower.pause()
    try:
        with Connection(*leader.address, timeout_s=20) as conn:
            request_id = _raw_publish(conn, "waiting", b"lost", "all")
            with via(leader) as admin:
                assert ok_fields(admin.command("TRUNCATE topic=waiting expected_revision=1"))["truncated"] == "true"
            conn.sock.settimeout(20)
            answer = conn.read_frame()
        assert answer.request_id == request_id
        assert answer.status != Status.OK, "a record wiped by TRUNCATE was acknowledged"
        err = error_of(answer)
        assert (err.code, err.retryable, err.fields.get("outcome")) == ("leader_not_available", True, "unknown"), err
    finally:
        follower.resume()
    wait_isr(cluster, "waiting", 3, timeout=30)
    assert wait_for(lambda: read_partition(cluster, "waiting") == [], 20, "the new generation served")
    _publish(routed, "waiting", 0, 1, "new")
    assert [(r.offset, r.payload) for r in read_partition(cluster, "waiting")] == [(0, b"new0")]
    for broker in cluster.brokers:
        marker = broker.log_dir / "topics" / "waiting" / "lifecycle_epoch"
        assert wait_for(lambda m=marker: m.exists() and m.read_text().split()[0] == "1", 10, f"{marker}")


@pytest.mark.parametrize("point", ["truncate_after_commit", "truncate_after_trash"])
def test_kill_of_the_broker_executing_truncate_mid_reset_then_restart_serves_only_the_new_generation(
        cluster: Cluster, routed, point: str) -> None:
    """The partition leader takes the TRUNCATE and dies (kill -9 at the crash point) after the Raft
    transition, before its own storage reset completed; the request's answer is lost. Restarted, it
    finishes the reset: every replica holds the new lifecycle epoch and is empty, nothing old is served,
    whoever leads (the victim is elected again to check its own log)."""
    topic = f"killed-{point.split('_')[-1]}"
    ok_fields(routed.command(f"CREATE topic={topic} partitions=1 replication_factor=3"))
    wait_isr(cluster, topic, 3)
    _publish(routed, topic, 0, 15, "old")
    victim = cluster.by_id(partition_state(cluster, topic)["leader"])
    victim.kill()
    victim.env = {"CURSUS_LIFECYCLE_CRASH_AT": point}
    try:
        victim.start(timeout_s=60)
        wait_isr(cluster, topic, 3, timeout=30)
        with via(victim) as conn:
            wait_for(lambda: conn.command(f"ELECT_LEADER topic={topic} partition=0 broker={victim.log_dir.name}"
                                          ).status == Status.OK, 20, "the victim elected")
        wait_for(lambda: partition_state(cluster, topic)["leader"] == victim.log_dir.name, 10, "the victim leads")
        with Connection(*victim.address, timeout_s=20) as conn:
            with pytest.raises((ConnectionClosed, OSError)):
                conn.command(f"TRUNCATE topic={topic} expected_revision=1")
        assert victim.wait_exit(30) == 137
    finally:
        victim.env = {}
    # committed in Raft: the survivors serve the new generation (the victim's leadership moves on)
    survivor = next(b for b in cluster.brokers if b is not victim)
    with via(survivor) as conn:
        doc = json.loads(conn.command(f"DESCRIBE topic={topic}").payload)
        assert (doc["definition"]["revision"], doc["definition"]["lifecycle_epoch"]) == (2, 1)
    assert wait_for(lambda: read_partition(cluster, topic) == [], 30, "a survivor serving the new generation")
    victim.start(timeout_s=60)
    wait_isr(cluster, topic, 3, timeout=30)
    with via(victim) as conn:
        wait_for(lambda: conn.command(f"ELECT_LEADER topic={topic} partition=0 broker={victim.log_dir.name}"
                                      ).status == Status.OK, 20, "the victim elected again")
    wait_for(lambda: partition_state(cluster, topic)["leader"] == victim.log_dir.name, 10, "the victim leads")
    assert wait_for(lambda: read_partition(cluster, topic) == [], 20, "the victim serving")
    _publish(routed, topic, 0, 2, "new")
    assert [(r.offset, r.payload) for r in read_partition(cluster, topic)] == [(0, b"new0"), (1, b"new1")]
    for broker in cluster.brokers:
        marker = broker.log_dir / "topics" / topic / "lifecycle_epoch"
        assert wait_for(lambda m=marker: m.exists() and m.read_text().split()[0] == "1", 10, f"{marker}")
