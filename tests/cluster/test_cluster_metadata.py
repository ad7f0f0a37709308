"""``RaftMetadata`` in process: three real Raft members (mutual TLS on loopback) in one event loop.

A command whose commit timed out (outcome unknown) and is retried with the same request id applies once;
a submit on a follower commits through the leader; listeners see each state before submit returns.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from cursus.cluster.metadata import RaftMetadata
from cursus.cluster.raft.node import RaftConfig
from cursus.metadata.commands import CreateTopic
from cursus.metadata.state import BrokerInfo, MetadataState
from cursus.metadata.topics import TopicSpec
from cursus.params import parse_args
from cursus.wire.errors import BrokerError
from tests.cluster.raftsupport import FAST, IDS, RaftPki, free_ports, members_on


def _backends(pki: RaftPki, root: Path, commit_timeout: float = 3.0) -> list[RaftMetadata]:
    members = members_on(free_ports(3))
    return [RaftMetadata(RaftConfig(node_id=i, members=members, data_dir=root / i, tls=pki.files(i), **FAST),
                         BrokerInfo(i, f"127.0.0.1:{9000 + n}", members[i]), coordinator_shards=50,
                         commit_timeout=commit_timeout, heartbeat_interval=0.3, session_timeout=5.0)
            for n, i in enumerate(IDS)]


def _create(name: str, request_id: str) -> CreateTopic:
    spec = parse_args(TopicSpec, {"topic": name, "partitions": "2"}, "CREATE")
    return CreateTopic(request_id, spec, default_replication_factor=3)


def test_retry_after_unknown_outcome_applies_once_and_followers_submit(pki: RaftPki, tmp_path: Path) -> None:
    async def scenario() -> None:
        backends = _backends(pki, tmp_path)
        await asyncio.gather(*(b.start() for b in backends))
        try:
            follower = next(b for b in backends if not b.node.is_leader)
            seen: list[MetadataState] = []
            follower.subscribe(lambda old, new: seen.append(new))
            command = _create("retried", "0123456789abcdef0123456789abcdef")
            follower._commit_timeout = 1e-6  # the commit cannot finish in time: outcome unknown
            with pytest.raises(BrokerError) as info:
                await follower.submit(command)
            assert info.value.error.code == "request_timeout" and info.value.error.fields["outcome"] == "unknown"
            follower._commit_timeout = 3.0
            first = await follower.submit(command)  # the retry: same request id
            assert seen and seen[-1] is follower.state  # listeners ran before submit returned
            revision = follower.state.revision
            again = await follower.submit(dataclasses.replace(command))
            assert again == first and follower.state.revision == revision  # the first result, applied once
            assert first.topic is not None and first.topic.name == "retried"
            for b in backends:  # every member applied it exactly once
                for _ in range(100):
                    if b.get("retried") is not None:
                        break
                    await asyncio.sleep(0.02)
                assert b.get("retried") == first.topic
                assert sum(1 for r in b.state.applied if r == command.request_id) == 1
        finally:
            await asyncio.gather(*(b.stop() for b in backends))

    asyncio.run(scenario())


def test_no_local_fallback_without_a_raft_leader(pki: RaftPki, tmp_path: Path) -> None:
    async def scenario() -> None:
        (alone, *_) = _backends(pki, tmp_path)
        await asyncio.to_thread(alone.node.start)
        alone._loop = asyncio.get_running_loop()
        try:
            with pytest.raises(BrokerError) as info:
                await alone.submit(_create("nowhere", "fedcba9876543210fedcba9876543210"))
            assert info.value.error.code == "no_raft_leader" and info.value.error.retryable
            assert alone.get("nowhere") is None and alone.readiness() == {"raft": "no leader"}
        finally:
            await alone.stop()

    asyncio.run(scenario())
