"""A restarting broker replays old metadata states (its Raft snapshot, then its journal) before it catches up:
it must never take a partition role, nor truncate its log, from such an old state.

Reproduction: the partition leader's Raft snapshot names it leader with an old committed HWM; more records
are committed afterwards; the leader is killed (kill -9) and restarted. The snapshot state is published at
once at startup, before this node has heard from a Raft leader: without the rule the reopened replica
takes the leader role of that old state and cuts its log to the old committed HWM (the new-leader
truncation), dropping records committed in later states. A journal-only replay (no snapshot) is checked too
(a smoke test: whether a replayed journal state is seen before the latest one is a race)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.cluster.clustersupport import Cluster, wait_for
from tests.cluster.replsupport import leader_proc, partition_state, read_partition, status, wait_isr
from tests.cluster.test_replication import conn, publish_ok
from tests.integration.helpers import create_topic, ok_fields

#: Snapshots only by time (every SNAPSHOT_MS), so the snapshot holds an older state than the journal.
SNAPSHOT_MS = 4000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, pki) -> Cluster:
    c = Cluster(Path(tmp_path_factory.mktemp("replay")), pki, raft_snapshot_min_entries=1_000_000,
                raft_snapshot_interval_ms=SNAPSHOT_MS, log_recovery_point_interval_ms=600_000)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def _snapshot_mtime(broker) -> float:
    path = broker.log_dir / "raft" / "snapshot.v9"
    return path.stat().st_mtime if path.exists() else 0.0


def _since_start(broker) -> str:
    text = broker.output()
    return text[text.rfind(f"--- start {broker.starts} ---"):]


def test_a_restarted_leader_never_truncates_from_a_replayed_old_state(cluster: Cluster) -> None:
    topic = "replay-old-leader"
    with conn(cluster.brokers[0]) as c:
        create_topic(c, topic, 1, replication_factor="3")
    wait_isr(cluster, topic, 3)
    old = leader_proc(cluster, topic)
    with conn(old) as c:
        for i in range(5):
            publish_ok(c, topic, [f"a{i}-{j}".encode() for j in range(5)])
    for _attempt in range(3):
        # a fresh snapshot (naming ``old`` leader with the committed HWM so far), then more commits, then the
        # kill, all before the next snapshot
        before = _snapshot_mtime(old)
        wait_for(lambda b=old, t=before: _snapshot_mtime(b) > t, SNAPSHOT_MS / 1000 * 3, "a new Raft snapshot")
        taken = _snapshot_mtime(old)
        started = time.monotonic()
        with conn(old) as c:
            for i in range(20):
                publish_ok(c, topic, [f"b{i}-{j}".encode() for j in range(5)])
        committed = partition_state(cluster, topic, via=old)["committed_hwm"]
        old.kill()
        if _snapshot_mtime(old) == taken and time.monotonic() - started < SNAPSHOT_MS / 1000:
            break
        old.start(timeout_s=60)
        wait_isr(cluster, topic, 3, timeout=30)
        old = leader_proc(cluster, topic)
    else:
        pytest.skip("the machine is too slow to commit before the next snapshot")
    old.start(timeout_s=60)
    wait_isr(cluster, topic, 3, timeout=30)
    output = _since_start(old)
    assert f"{topic}/0: new leader of epoch" not in output, output
    assert "below the committed HWM" not in output, output
    # the restarted replica holds every committed record: lead it again and read everything from it
    with conn(cluster.brokers[0]) as c:
        ok_fields(c.command(f"ELECT_LEADER topic={topic} partition=0 broker={old.log_dir.name}"))
    wait_for(lambda: leader_proc(cluster, topic) is old, 15, "the restarted broker leads")
    records = read_partition(cluster, topic)
    assert len(records) >= committed == 125, (len(records), committed)
    assert "storage_unavailable" not in _since_start(old)
    wait_for(lambda: status(cluster.brokers[0])["inactive_brokers"] == 0, 30, "every broker active")


@pytest.fixture(scope="module")
def journal_cluster(tmp_path_factory: pytest.TempPathFactory, pki) -> Cluster:
    c = Cluster(Path(tmp_path_factory.mktemp("replay-journal")), pki, raft_snapshot_min_entries=1_000_000,
                raft_snapshot_interval_ms=3_600_000, log_recovery_point_interval_ms=600_000)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def test_a_restarted_leader_replaying_its_journal_keeps_every_committed_record(journal_cluster: Cluster) -> None:
    cluster = journal_cluster
    topic = "replay-journal"
    with conn(cluster.brokers[0]) as c:
        create_topic(c, topic, 1, replication_factor="3")
    wait_isr(cluster, topic, 3)
    old = leader_proc(cluster, topic)
    with conn(old) as c:  # every acks=all batch commits the HWM through the metadata log (one entry each)
        for i in range(60):
            publish_ok(c, topic, [f"j{i}-{j}".encode() for j in range(5)])
    assert not (old.log_dir / "raft" / "snapshot.v9").exists()
    old.kill()
    old.start(timeout_s=60)
    wait_isr(cluster, topic, 3, timeout=30)
    output = _since_start(old)
    assert f"{topic}/0: new leader of epoch" not in output, output
    assert "below the committed HWM" not in output, output
    wait_for(lambda: leader_proc(cluster, topic) is not None, 15, "a leader")
    assert len(read_partition(cluster, topic)) == 300
