"""CLUSTER_STATUS pairs a live Raft applied index with the event loop's (possibly older) metadata view.

This is why the chaos checker orders polls by ``metadata_revision`` and not by ``raft_applied_index``
(issue 14 finding B, see docs/chaos.md): three real Raft members (mutual TLS on loopback) in one event
loop; while the loop is busy, the tick threads commit and apply entries, so the document reports a newer
applied index next to the older partition view, and ``metadata_revision`` says which view it is.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from cursus.cluster.metadata import RaftMetadata
from cursus.cluster.raft.node import RaftConfig
from cursus.cluster.status import cluster_status
from cursus.metadata.commands import CreateTopic
from cursus.metadata.state import BrokerInfo
from cursus.metadata.topics import TopicSpec
from cursus.params import parse_args
from tests.cluster.raftsupport import FAST, IDS, RaftPki, free_ports, members_on

COMMANDS = 5


def _backends(pki: RaftPki, root: Path) -> list[RaftMetadata]:
    members = members_on(free_ports(3))
    return [RaftMetadata(RaftConfig(node_id=i, members=members, data_dir=root / i, tls=pki.files(i), **FAST),
                         BrokerInfo(i, f"127.0.0.1:{9000 + n}", members[i]), coordinator_shards=50,
                         commit_timeout=10.0, heartbeat_interval=0.3, session_timeout=5.0)
            for n, i in enumerate(IDS)]


def _create(name: str) -> CreateTopic:
    spec = parse_args(TopicSpec, {"topic": name, "partitions": "1"}, "CREATE")
    return CreateTopic(f"{name:0>32}"[-32:], spec, default_replication_factor=3)


def _doc(backend: RaftMetadata) -> dict:
    raft = backend.raft_status()
    assert raft is not None
    return cluster_status(backend.state, raft, 1)


def test_status_applied_index_runs_ahead_of_the_view_it_reports(pki: RaftPki, tmp_path: Path) -> None:
    async def scenario() -> None:
        backends = _backends(pki, tmp_path)
        await asyncio.gather(*(b.start() for b in backends))
        try:
            leader = next(b for b in backends if b.node.is_leader)
            before = _doc(leader)
            tasks = [asyncio.create_task(leader.submit(_create(f"view-{n}"))) for n in range(COMMANDS)]
            await asyncio.sleep(0)  # every submit hands its entry to Raft, then waits on the loop
            # Keep the loop busy (deliberately blocking) while the tick threads commit and apply.
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and _doc(leader)["raft_applied_index"] < (
                    before["raft_applied_index"] + COMMANDS):
                time.sleep(0.02)
            during = _doc(leader)
            assert during["raft_applied_index"] >= before["raft_applied_index"] + COMMANDS, (before, during)
            # ... yet the partitions are still those of the old view, and its revision says so
            assert during["metadata_revision"] == before["metadata_revision"], (before, during)
            assert during["partitions"] == before["partitions"]
            await asyncio.gather(*tasks)
            after = _doc(leader)
            assert after["metadata_revision"] >= before["metadata_revision"] + COMMANDS
            assert {p["topic"] for p in after["partitions"]} >= {f"view-{n}" for n in range(COMMANDS)}
        finally:
            await asyncio.gather(*(b.stop() for b in backends))

    asyncio.run(scenario())
