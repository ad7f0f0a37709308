"""Three broker processes as one Raft metadata cluster (loopback, mutual TLS): formation, metadata on
every node, routing, failover, restart. One cluster per module keeps CI time bounded."""

from __future__ import annotations

import json
import socket
import ssl
from pathlib import Path

import pytest

from cursus.client.connection import Connection
from cursus.wire import Status
from tests.cluster.clustersupport import Cluster, wait_for, wait_topic_ready
from tests.cluster.raftsupport import closed_by_peer
from tests.integration.helpers import create_topic, error_of, ok_fields, render


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, pki) -> Cluster:
    # small snapshot thresholds: the restart test recovers from snapshot plus journal
    c = Cluster(Path(tmp_path_factory.mktemp("cluster")), pki, raft_snapshot_min_entries=20,
                raft_snapshot_interval_ms=500, exporter_port=0)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def conn(broker) -> Connection:
    return Connection(*broker.address, timeout_s=10)


def status(broker) -> dict:
    with conn(broker) as c:
        frame = c.command("CLUSTER_STATUS")
    text = frame.payload.decode()
    assert text.startswith("OK cluster="), render(frame)
    return json.loads(text[len("OK cluster="):])


def test_forms_from_empty_dirs_and_create_is_visible_everywhere(cluster: Cluster) -> None:
    for broker in cluster.brokers:
        code, _ = broker.http_get("/ready")
        assert code == 200
        assert (broker.log_dir / "raft" / ".cursus-raft-format").read_text().strip() == "9"
    with conn(cluster.brokers[1]) as c:
        create_topic(c, "orders", 3)
    for broker in cluster.brokers:
        with conn(broker) as c:
            wait_for(lambda c=c: c.command("LIST").payload.decode().find("orders") >= 0, 10, "topic visible")
            doc = json.loads(c.command("DESCRIBE topic=orders").payload)
            assert [p["id"] for p in doc["partitions"]] == [0, 1, 2]
    st = status(cluster.brokers[0])
    assert st["active_brokers"] == 3 and st["raft_leader"]
    assert {p["leader"] for p in st["partitions"] if p["topic"] == "orders"} <= {"node-1", "node-2", "node-3"}


def leader_of(cluster: Cluster, topic: str, partition: int) -> tuple[str, int]:
    """(leader, leader epoch) as brokers[0] sees it, once it has applied the partition's creation."""
    def row() -> dict | None:
        rows = [p for p in status(cluster.brokers[0])["partitions"]
                if p["topic"] == topic and p["partition"] == partition]
        return rows[0] if rows else None

    p = wait_for(row, 10, f"{topic}-{partition} applied on brokers[0]")
    return p["leader"], p["leader_epoch"]


def test_partition_commands_on_a_non_leader_redirect_and_acks_all_is_refused(cluster: Cluster) -> None:
    from tests.integration.helpers import publish_batch

    with conn(cluster.brokers[0]) as c:
        create_topic(c, "routed", 1, replication_factor="1")
        wait_topic_ready(cluster, "routed", 1)
    leader, _ = leader_of(cluster, "routed", 0)
    leader_proc = cluster.by_id(leader)
    other = next(b for b in cluster.brokers if b is not leader_proc)
    with conn(other) as c:
        err = error_of(c.command("CONSUME topic=routed partition=0 offset=0"))
        assert err.code == "NOT_LEADER" and err.fields["leader"] == f"127.0.0.1:{leader_proc.port}"
        assert error_of(publish_batch(c, "routed", 0, [b"x"])).code == "NOT_LEADER"
        assert error_of(c.command("LIST_OFFSETS topic=routed partition=0")).code == "NOT_LEADER"
    with conn(leader_proc) as c:  # RF 1: the CREATE answered on another broker, the leader may still open it
        wait_for(lambda: publish_batch(c, "routed", 0, [b"x"]).status == Status.OK, 10, "leader serving")
        # replication factor 1: ISR = [leader] < min ISR 2, refused before append
        assert error_of(publish_batch(c, "routed", 0, [b"y"], acks="all")).code == "insufficient_in_sync_replicas"
    coordinator = ok_fields(conn(other).command("FIND_COORDINATOR group=g1"))
    coord_proc = next(b for b in cluster.brokers if b.port == int(coordinator["port"]))
    non_coord = next(b for b in cluster.brokers if b is not coord_proc)
    with conn(non_coord) as c:
        err = error_of(c.command("JOIN_GROUP topic=routed group=g1 member=m"))
        assert err.code == "NOT_COORDINATOR" and err.fields["port"] == str(coord_proc.port)
    with conn(coord_proc) as c:
        ok_fields(c.command("JOIN_GROUP topic=routed group=g1 member=m"))


def test_elect_leader_rules(cluster: Cluster) -> None:
    with conn(cluster.brokers[2]) as c:
        create_topic(c, "elect", 1, replication_factor="3")
        leader, epoch = leader_of(cluster, "elect", 0)
        other = next(i for i in ("node-1", "node-2", "node-3") if i != leader)
        again = ok_fields(c.command(f"ELECT_LEADER topic=elect partition=0 broker={leader}"))
        assert again == {"topic": "elect", "partition": "0", "previous_leader": leader, "leader": leader,
                         "leader_epoch": str(epoch), "changed": "false"}
        err = error_of(c.command("ELECT_LEADER topic=elect partition=0 broker=node-9"))
        assert err.code == "leader_election_rejected" and "replica" in err.fields["reason"]
        assert error_of(c.command("ELECT_LEADER topic=elect partition=0")).code == "missing_broker"
        assert error_of(c.command("ELECT_LEADER topic=elect partition=7 broker=x")).code == "partition_not_found"
        # every replica is in the ISR at placement: another one may be elected (the epoch grows by one)
        moved = ok_fields(c.command(f"ELECT_LEADER topic=elect partition=0 broker={other}"))
        assert (moved["leader"], moved["leader_epoch"], moved["changed"]) == (other, str(epoch + 1), "true")
    # CLUSTER_STATUS of brokers[0]: it may apply the election a moment after brokers[2] answered
    wait_for(lambda: leader_of(cluster, "elect", 0) == (other, epoch + 1), 10, "the election applied everywhere")


def test_sdk_follows_redirects_from_any_broker(cluster: Cluster) -> None:
    from cursus.client.admin import Admin
    from cursus.client.consumer import Consumer
    from cursus.client.producer import Producer

    with conn(cluster.brokers[0]) as c:  # RF 1: the committed HWM advances through CommitHwm alone
        create_topic(c, "sdk", 3, replication_factor="1")
        wait_topic_ready(cluster, "sdk", 3)
    for broker in cluster.brokers:  # every broker leads at most some partitions: the rest are redirects
        address = f"127.0.0.1:{broker.port}"
        with Producer(address, acks="1") as producer:
            for p in range(3):
                producer.produce("sdk", f"{broker.log_dir.name}-{p}".encode(), partition=p, timeout_s=20)
        assert Admin(address).describe_topic("sdk").topic == "sdk"
    with Consumer("sdk", f"127.0.0.1:{cluster.brokers[2].port}", wait_ms=50) as consumer:
        got: list[bytes] = []
        wait_for(lambda: got.extend(r.value for r in consumer.poll(1.0)) or len(got) >= 9, 20, "nine records")
    assert sorted(got) == sorted(f"node-{n}-{p}".encode() for n in (1, 2, 3) for p in range(3))


def test_topic_wide_offsets_and_reads_when_partitions_have_different_leaders(cluster: Cluster) -> None:
    """Break-it finding: a topic-wide LIST_OFFSETS redirects partition by partition and no broker can answer
    it whole; Admin.list_offsets, Consumer.records(until_end=True) and cursusctl offsets ask each leader."""
    from cursus.client.admin import Admin
    from cursus.client.consumer import Consumer
    from cursus.client.producer import Producer

    with conn(cluster.brokers[0]) as c:
        create_topic(c, "spread", 6, replication_factor="1")
        wait_topic_ready(cluster, "spread", 6)
    leaders = {leader_of(cluster, "spread", p)[0] for p in range(6)}
    assert len(leaders) > 1, leaders  # six partitions over three brokers on the ring
    address = f"127.0.0.1:{cluster.brokers[0].port}"
    with Producer(address, acks="1") as producer:
        for p in range(6):
            producer.produce("spread", f"r{p}".encode(), partition=p, timeout_s=20)
    for broker in cluster.brokers:  # acks=1 answers at the durable append; the committed HWM follows soon
        admin = Admin(f"127.0.0.1:{broker.port}")
        wait_for(lambda admin=admin: [(o.partition, o.latest) for o in admin.list_offsets("spread")]
                 == [(p, 1) for p in range(6)], 15, "committed HWMs")
    with Consumer("spread", address, start="earliest") as consumer:
        assert sorted(r.value for r in consumer.records(until_end=True)) == [f"r{p}".encode() for p in range(6)]


def test_partitions_added_through_any_broker_reach_the_groups(cluster: Cluster) -> None:
    """Break-it finding: partitions added by a CREATE on a broker that is not the group coordinator never
    reached existing groups (their records were never consumed)."""
    with conn(cluster.brokers[0]) as c:
        create_topic(c, "widen", 2)
        wait_topic_ready(cluster, "widen", 2)
        found = ok_fields(c.command("FIND_COORDINATOR group=gw"))
    coordinator = next(b for b in cluster.brokers if b.port == int(found["port"]))
    other = next(b for b in cluster.brokers if b is not coordinator)
    with conn(coordinator) as c:
        ok_fields(c.command("REGISTER_GROUP group=gw topic=widen"))
    with conn(other) as c:
        assert ok_fields(c.command("CREATE topic=widen partitions=5"))["partitions"] == "5"
    with conn(coordinator) as c:
        assert json.loads(c.command("GROUP_STATUS group=gw").payload)["partition_count"] in (2, 5)
        wait_for(lambda: json.loads(c.command("GROUP_STATUS group=gw").payload)["partition_count"] == 5, 15,
                 "the group took the new partitions")


def test_cursusctl_cluster_status(cluster: Cluster) -> None:
    import subprocess
    import sys

    def ctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cursus.cli.ctl", *args,
                               "--broker", f"127.0.0.1:{cluster.brokers[1].port}"],
                              capture_output=True, text=True, timeout=60)

    done = ctl("cluster-status", "--json")
    doc = json.loads(done.stdout)
    # placement puts every replica in the ISR (all empty, all in sync): nothing is under-replicated
    assert doc["under_replicated_partitions"] == 0 and doc["healthy"] is True and done.returncode == 0
    assert doc["active_brokers"] == 3 and doc["raft_leader"] in ("node-1", "node-2", "node-3")
    # the RF-1 partitions' committed HWMs went through CommitHwm (three records each, see the SDK test)
    assert [p["committed_hwm"] for p in doc["partitions"] if p["topic"] == "sdk"] == [3, 3, 3]
    table = ctl("cluster-status", "--unhealthy")
    assert table.returncode == 0 and "healthy=true" in table.stdout and "UNHEALTHY" not in table.stdout


def test_cluster_metrics(cluster: Cluster) -> None:
    broker = cluster.brokers[0]
    code, body = broker.http_get("/metrics", port=broker.metrics_port)
    text = body.decode()
    assert code == 200 and "cursus_distribution_enabled 1.0" in text and "cursus_cluster_brokers 3.0" in text
    assert "cursus_cluster_has_leader 1.0" in text and 'cursus_cluster_partition_leader_epoch{partition="0",topic="orders"}' in text
    assert "cursus_cluster_metadata_commit_seconds_count" in text and "cursus_cluster_under_replicated_partitions" in text
    for family in ("cursus_cluster_replication_fetch_bytes_total", "cursus_cluster_isr_changes_total",
                   "cursus_cluster_acks_all_wait_seconds_count", "cursus_cluster_internal_rejected_calls_total",
                   "cluster_replication_lag_seconds"):
        assert f"# TYPE {family.removesuffix('_total').removesuffix('_count')}" in text, family


def test_standalone_refuses_cluster_commands(tmp_path: Path) -> None:
    from tests.brokerproc import BrokerProcess

    broker = BrokerProcess(tmp_path / "solo").start()
    try:
        with conn(broker) as c:
            assert error_of(c.command("CLUSTER_STATUS")).code == "distribution_required"
            assert error_of(c.command("ELECT_LEADER topic=t partition=0 broker=b")).code == "distribution_required"
    finally:
        broker.stop()


def test_kill_raft_leader_new_leader_commits_and_state_survives_restart(cluster: Cluster) -> None:
    st = status(cluster.brokers[0])
    old_leader = cluster.by_id(st["raft_leader"])
    old_id = old_leader.log_dir.name
    led = [p for p in st["partitions"] if p["leader"] == old_id]
    old_leader.kill()
    survivors = [b for b in cluster.brokers if b is not old_leader]
    with conn(survivors[0]) as c:
        wait_for(lambda: ok_fields(c.command("CREATE topic=after-failover partitions=2")), 15, "commit after failover")
    st = wait_for(lambda: (s := status(survivors[1]))["inactive_brokers"] == 1 and s, 15, "dead broker fenced")
    assert st["raft_leader"] != old_id and st["healthy"] is False
    after = {p["key"]: p for p in st["partitions"]}
    # the dead broker left every ISR, except as the recorded last member of a partition it alone held
    assert led and all(old_id not in p["isr"] or p["isr"] == [old_id] for p in st["partitions"])
    for p in led:  # its partitions move to the next ISR member (epoch + 1), or, RF 1, become leaderless
        now = after[p["key"]]
        if len(p["isr"]) > 1:
            assert now["leader"] in p["isr"] and now["leader"] != old_id and now["leader_epoch"] == p["leader_epoch"] + 1
        else:
            assert now["leader"] == ""  # its only ISR member is gone: no unclean election
    dead = [p for p in st["partitions"] if p["isr"] == [old_id]]
    old_leader.start(timeout_s=60)
    st = wait_for(lambda: (s := status(old_leader))["inactive_brokers"] == 0 and s, 15, "broker back")
    back = {p["key"]: p for p in st["partitions"]}
    assert all(back[p["key"]]["leader"] == old_leader.log_dir.name for p in dead)  # the last ISR member leads again
    topics_before = sorted(p["key"] for p in st["partitions"])
    wait_for(lambda: all((b.log_dir / "raft" / "snapshot.v9").exists() for b in cluster.brokers), 20,
             "a snapshot on every node")
    with conn(cluster.brokers[0]) as c:
        create_topic(c, "in-journal-only", 1)  # most likely after the last snapshot
    topics_before = sorted([*topics_before, "in-journal-only-0"])
    for broker in cluster.brokers:
        broker.kill()
    cluster.start()
    st = wait_for(lambda: status(cluster.brokers[0])["active_brokers"] == 3 and status(cluster.brokers[0]), 20,
                  "restarted cluster")
    assert sorted(p["key"] for p in st["partitions"]) == topics_before
    with conn(cluster.brokers[1]) as c:
        assert "after-failover" in c.command("LIST").payload.decode()


def _raft_port(cluster: Cluster, broker) -> int:
    return int(cluster.raft[broker.log_dir.name].rsplit(":", 1)[1])


def test_raft_port_refuses_plaintext_and_foreign_ca_peers(cluster: Cluster, pki) -> None:
    target = cluster.brokers[0]
    before = status(target)["raft_rejected_connections"].get("handshake_failed", 0)
    with socket.create_connection(("127.0.0.1", _raft_port(cluster, target)), timeout=5) as sock:
        sock.sendall(b'{"type": "request_vote", "term": 999}\n' * 4)
        assert closed_by_peer(sock)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.load_cert_chain(pki.foreign.cert, pki.foreign.key)
    with socket.create_connection(("127.0.0.1", _raft_port(cluster, target)), timeout=5) as raw:
        try:
            with context.wrap_socket(raw) as sock:
                sock.sendall(b"hello")
                assert closed_by_peer(sock)
        except (ssl.SSLError, ConnectionError):
            pass
    wait_for(lambda: status(target)["raft_rejected_connections"].get("handshake_failed", 0) >= before + 2, 10,
             "two refused handshakes")
    with conn(cluster.brokers[1]) as c:  # the cluster is unaffected
        create_topic(c, "after-refusals", 1)
