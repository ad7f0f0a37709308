"""Deterministic reproductions of broker anomalies found by the cluster chaos harness (issue 14), fixed.

``test_restarted_leader_resumes_in_a_new_epoch``: kill -9 a partition leader and restart it at once, before
``broker_session_timeout_ms`` marks it inactive, so leadership never moves. The chaos runs (seeds 3, 101,
102, 11, ...) show the restarted broker leading again in the *same* leader epoch, with a truncated tail, after
which followers keep other bytes at the same offsets (epoch lineage cannot see the divergence), acks=all
writes are lost or duplicated, and the committed HWM stops. Expected: the restarted leader leads in a new
leader epoch (or another replica takes over), every acknowledged record survives, and every replica holds
the same records.

Fixed: every broker process registers with a new ``incarnation``; a registration with another one is a
restart, and ``apply`` moves the partitions it leads to leader epoch + 1 (``cursus.metadata.apply._register``).
"""

from __future__ import annotations

from cursus.client.connection import Connection
from tests.cluster.clustersupport import Cluster, wait_for
from tests.cluster.replsupport import (
    AcksAllWriter,
    check_history,
    leader_proc,
    module_cluster,
    partition_state,
    read_partition,
    wait_isr,
)
from tests.integration.helpers import create_topic

cluster = module_cluster("chaos-findings")



def test_restarted_leader_resumes_in_a_new_epoch(cluster: Cluster) -> None:
    topic = "restart-leader"
    with Connection(*cluster.brokers[0].address, timeout_s=10) as c:
        create_topic(c, topic, 1, replication_factor="3")
    wait_isr(cluster, topic, 3)
    writers = [AcksAllWriter(cluster, topic, f"w{i}") for i in range(2)]
    for w in writers:
        w.start()
    wait_for(lambda: all(len(w.acks) >= 20 for w in writers), 30, "writers acknowledged")
    before = partition_state(cluster, topic)
    leader = leader_proc(cluster, topic)
    leader.kill()
    leader.start(timeout_s=60)  # back before the session timeout: the metadata never moved leadership
    counts = [len(w.acks) for w in writers]
    wait_for(lambda: all(len(w.acks) >= n + 20 for w, n in zip(writers, counts, strict=True)), 60,
             "writers acknowledged after the restart")
    for w in writers:
        w.stop()
    after = wait_isr(cluster, topic, 3, timeout=30)
    check_history([a for w in writers for a in w.acks], read_partition(cluster, topic))
    assert after["leader"] != before["leader"] or after["leader_epoch"] > before["leader_epoch"], (before, after)
    # every replica the same: elect each in turn and read everything back
    expected = [bytes(r.payload) for r in read_partition(cluster, topic)]
    for broker in cluster.brokers:
        with Connection(*cluster.brokers[0].address, timeout_s=10) as c:
            c.command(f"ELECT_LEADER topic={topic} partition=0 broker={broker.log_dir.name}")
        wait_for(lambda b=broker: leader_proc(cluster, topic) is b, 20, "elected")
        got = wait_for(lambda: (g := [bytes(r.payload) for r in read_partition(cluster, topic)])
                       and len(g) >= len(expected) and g, 20, "the new leader serves everything")
        assert got[:len(expected)] == expected, f"replica {broker.log_dir.name} differs"
