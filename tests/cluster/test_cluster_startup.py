"""Broker-level startup refusals of a cluster node: the Raft directory's format marker and snapshot
provenance (``unsupported recovery protocol``), and a coordinator shard count that differs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cursus.cluster.raft.commands import DedupTable
from cursus.cluster.raft.marker import MARKER_NAME
from cursus.cluster.raft.snapshot import Snapshot, write_snapshot
from cursus.metadata.snapshot import PARTITION_COLUMNS
from tests.brokerproc import BrokerProcess
from tests.cluster.clustersupport import Cluster, cluster_settings
from tests.cluster.raftsupport import free_ports


def _lonely_node(root: Path, pki) -> BrokerProcess:
    ports = free_ports(4)
    members = ",".join(f"node-{i}@127.0.0.1:{port}" for i, port in enumerate(ports[:3], 1))
    return BrokerProcess(root / "node-1", settings=cluster_settings(pki, "node-1", members,
                                                                    internal_broker_port=ports[3]))


def _refused(broker: BrokerProcess) -> str:
    with pytest.raises(RuntimeError) as info:
        broker.start(timeout_s=30)
    return str(info.value)


def test_unmarked_non_empty_raft_dir_refuses_startup(tmp_path: Path, pki) -> None:
    broker = _lonely_node(tmp_path, pki)
    (broker.log_dir / "raft").mkdir(parents=True)
    (broker.log_dir / "raft" / "journal.bin").write_bytes(b"old")
    text = _refused(broker)
    assert "unsupported recovery protocol" in text and "clean bootstrap" in text


def test_lost_raft_state_next_to_partition_data_refuses_startup(tmp_path: Path, pki) -> None:
    """Cluster break-it finding: a node whose Raft directory was wiped rejoined with its vote forgotten
    (it could vote twice in one term). Partition data without Raft state refuses startup."""
    broker = _lonely_node(tmp_path, pki)
    (broker.log_dir / "topics" / "orders" / "0").mkdir(parents=True)
    text = _refused(broker)
    assert "unsupported recovery protocol" in text and "vote twice" in text


def test_marker_of_another_version_refuses_startup(tmp_path: Path, pki) -> None:
    broker = _lonely_node(tmp_path, pki)
    (broker.log_dir / "raft").mkdir(parents=True)
    (broker.log_dir / "raft" / MARKER_NAME).write_text("8\n")
    assert "unsupported recovery protocol" in _refused(broker)


def test_snapshot_partition_without_provenance_refuses_startup(tmp_path: Path, pki) -> None:
    broker = _lonely_node(tmp_path, pki)
    raft = broker.log_dir / "raft"
    raft.mkdir(parents=True)
    (raft / MARKER_NAME).write_text("9\n")
    row = ["t", 0, ["node-1"], "node-1", 1, ["node-1"], None, 0, 0]  # committed_hwm_version missing
    state = {"v": 1, "revision": 3, "cluster": True, "initial_leader_epoch": 1, "coordinator_shards": 50,
             "topics": [], "partition_columns": list(PARTITION_COLUMNS), "partitions": [row], "brokers": [],
             "applied": []}
    write_snapshot(raft / "snapshot.v9", Snapshot((b"", 5, 1), (b"", 4, 1), ("127.0.0.1:1",),
                                                  DedupTable().encode(), json.dumps(state).encode()))
    text = _refused(broker)
    assert "unsupported recovery protocol" in text and "committed_hwm_version" in text


def test_a_broker_with_another_coordinator_shard_count_is_refused(tmp_path: Path, pki) -> None:
    cluster = Cluster(tmp_path, pki)
    odd = cluster.brokers[2]
    odd.settings["transaction_coordinator_shards"] = 7
    try:
        cluster.start(cluster.brokers[:2])
        text = _refused(odd)
        assert "cluster_join_failed" in text and "transaction_coordinator_shards" in text
    finally:
        cluster.stop()
