"""The reconciler against topic generations (incarnation, lifecycle epoch) with real folders: a folder of an
older incarnation is never opened for a recreated topic, a replayed DELETE never removes a later
incarnation's folder, an older replayed state never opens a newer folder, a replayed TRUNCATE whose epoch the
folder already holds resets nothing. Metadata states come from the pure ``apply`` (a 3-broker cluster), the
host is a minimal stand-in that records opens (the reconciler's own storage decisions are under test)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from cursus.broker.reconciler import Reconciler
from cursus.broker.topic_storage import read_marker
from cursus.metadata.apply import apply
from cursus.metadata.commands import BrokerHeartbeat, CreateTopic, DeleteTopic, TruncateTopic
from cursus.metadata.state import BrokerInfo, MetadataState
from cursus.metadata.topics import TopicSpec
from cursus.params import parse_args

LOCAL = "a"


class _Log:
    def close(self) -> None:
        pass


class _Replica:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.log = _Log()


class Host:
    """Opens a partition by creating its folder and a ``data`` file recording which generation wrote it."""

    broker_id = LOCAL

    def __init__(self, topics: Path) -> None:
        topics.mkdir(exist_ok=True)  # open_log_dir makes it
        self.topics = topics
        self.replicas: dict[tuple[str, int], Any] = {}
        self.dropped: list[str] = []
        self.label = "gen-?"

    def open_partition(self, topic: str, partition: int) -> _Replica:
        directory = self.topics / topic / str(partition)
        directory.mkdir(parents=True, exist_ok=True)
        data = directory / "data"
        if not data.exists():
            data.write_text(self.label)
        return _Replica(directory)

    def install_replica(self, topic: str, partition: int, opened: _Replica) -> None:
        self.replicas[(topic, partition)] = opened

    def discard_opened(self, opened: _Replica) -> None:
        pass

    def detach_topic(self, name: str) -> list[Any]:
        gone = [r for k, r in self.replicas.items() if k[0] == name]
        self.replicas = {k: r for k, r in self.replicas.items() if k[0] != name}
        return gone

    async def run_blocking(self, fn: Any) -> Any:
        return fn()

    async def drop_topic_state(self, name: str) -> bool:
        self.dropped.append(name)
        return False


def _cluster() -> MetadataState:
    state = MetadataState(cluster=True)
    for b in ("a", "b", "c"):
        state, _ = apply(state, BrokerHeartbeat(f"hb-{b}", BrokerInfo(b, f"{b}:1", lifecycle_protocol=1), 4))
    return state


def _create(state: MetadataState, rid: str) -> MetadataState:
    spec = parse_args(TopicSpec, {"topic": "t", "partitions": "1", "replication_factor": "3"}, "CREATE")
    return apply(state, CreateTopic(rid, spec))[0]


async def _settle(rec: Reconciler) -> None:
    for _ in range(20):
        await asyncio.sleep(0.01)
        await rec.wait_open([("t", 0)])


def _data(tmp_path: Path) -> str | None:
    path = tmp_path / "topics" / "t" / "0" / "data"
    return path.read_text() if path.exists() else None


def test_snapshot_jump_to_a_recreated_topic_replaces_the_old_folder(tmp_path):
    async def scenario() -> None:
        host = Host(tmp_path / "topics")
        rec = Reconciler(host, tmp_path, 2)
        base = _cluster()
        first = _create(base, "c1")
        host.label = "first"
        await rec.start(first)
        await _settle(rec)
        assert _data(tmp_path) == "first"
        old_marker = read_marker(tmp_path / "topics" / "t")
        assert old_marker == (first.incarnation("t"), 0)
        # a snapshot restore jumps over DELETE + CREATE: one step, same name, another incarnation
        second = _create(apply(first, DeleteTopic("d", "t"))[0], "c2")
        host.label = "second"
        rec.on_metadata(first, second)
        await _settle(rec)
        assert ("t", 0) in host.replicas and _data(tmp_path) == "second"
        assert read_marker(tmp_path / "topics" / "t") == (second.incarnation("t"), 0)
        await rec.close()

    asyncio.run(scenario())


def test_replaying_old_states_never_opens_or_removes_a_later_incarnation(tmp_path):
    async def scenario() -> None:
        base = _cluster()
        first = _create(base, "c1")
        deleted = apply(first, DeleteTopic("d", "t"))[0]
        second = _create(deleted, "c2")
        truncated = apply(second, TruncateTopic("x", "t", 1))[0]
        # the folder as the node left it: the second incarnation, truncated once
        host = Host(tmp_path / "topics")
        rec = Reconciler(host, tmp_path, 2)
        host.label = "kept"
        await rec.start(truncated)
        await _settle(rec)
        assert _data(tmp_path) == "kept" and host.dropped == []
        await rec.close()
        # restart: the Raft log replays every state from the start (published to the reconciler before its
        # start, which sees the final state)
        host = Host(tmp_path / "topics")
        host.label = "must-not-write"
        rec = Reconciler(host, tmp_path, 2)
        for old, new in ((MetadataState(cluster=True), base), (base, first), (first, deleted), (deleted, second),
                         (second, truncated)):
            rec.on_metadata(old, new)
            await _settle(rec)
            if new is not truncated:
                assert ("t", 0) not in host.replicas  # a newer folder is never opened for an older state
            assert _data(tmp_path) == "kept"  # nor removed by the replayed DELETE, nor reset by the TRUNCATE
        await rec.start(truncated)
        assert ("t", 0) in host.replicas and host.dropped == [] and _data(tmp_path) == "kept"
        assert read_marker(tmp_path / "topics" / "t") == (second.incarnation("t"), 1)
        await rec.close()

    asyncio.run(scenario())


def test_a_live_truncate_drops_the_topic_state_then_resets_the_folder(tmp_path):
    async def scenario() -> None:
        first = _create(_cluster(), "c1")
        host = Host(tmp_path / "topics")
        rec = Reconciler(host, tmp_path, 2)
        host.label = "old"
        await rec.start(first)
        truncated = apply(first, TruncateTopic("x", "t", 1))[0]
        host.label = "new"
        rec.on_metadata(first, truncated)
        assert ("t", 0) not in host.replicas  # fenced at once
        assert await rec.reset_done("t") is False
        assert host.dropped == ["t"] and _data(tmp_path) == "new" and ("t", 0) in host.replicas
        assert read_marker(tmp_path / "topics" / "t") == (first.incarnation("t"), 1)
        await rec.close()

    asyncio.run(scenario())


def test_a_restart_restored_from_a_snapshot_of_a_recreated_topic_never_opens_the_old_folder(tmp_path):
    async def scenario() -> None:
        first = _create(_cluster(), "c1")
        second = _create(apply(first, DeleteTopic("d", "t"))[0], "c2")
        host = Host(tmp_path / "topics")
        host.label = "first"
        rec = Reconciler(host, tmp_path, 2)
        await rec.start(first)
        await rec.close()
        # restart: the snapshot (taken after the DELETE and the CREATE) is the first state published
        host = Host(tmp_path / "topics")
        host.label = "second"
        rec = Reconciler(host, tmp_path, 2)
        rec.on_metadata(MetadataState(cluster=True), second)
        await rec.start(second)
        assert ("t", 0) in host.replicas and _data(tmp_path) == "second"
        assert read_marker(tmp_path / "topics" / "t") == (second.incarnation("t"), 0)
        await rec.close()

    asyncio.run(scenario())
