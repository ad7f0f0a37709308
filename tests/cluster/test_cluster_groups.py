"""Consumer groups and committed offsets on both backends: the group/offset test bodies of
tests/integration/test_groups_protocol.py run against a standalone broker process (groups in
``__consumer_offsets``) and against this module's 3-node Raft cluster (groups in the metadata log, each group
coordinated by its owner on the ring of active brokers). A routing connection follows ``NOT_COORDINATOR`` and
``NOT_LEADER`` the way the SDK does, so the bodies are unchanged.

Cluster-only cases: no ``__consumer_offsets`` topic; FIND_COORDINATOR spreads groups by the ring; a
coordinator kill -9 with the offsets and the member intact on the new owner, ownership back on return; a
full restart recovers groups from the Raft snapshot plus journal.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cursus.client.connection import Connection
from cursus.metadata.state import group_coordinator
from cursus.wire import Command, Frame, Status
from tests.brokerproc import BrokerProcess
from tests.cluster.clustersupport import Cluster, wait_for
from tests.integration import test_groups_protocol as shared
from tests.integration.helpers import consume, create_topic, error_of, ok_fields, render

SESSION_MS = shared.SESSION_MS
#: Replies a routing client follows to another broker, and retryable ones it polls through.
_REDIRECTS = ("NOT_COORDINATOR", "NOT_LEADER")
_RETRY = ("coordinator_not_available", "leader_not_available", "no_raft_leader", "NOT_PARTITION_LEADER")
_names = itertools.count(1)


class RoutingConnection:
    """A :class:`Connection` look-alike over several brokers: ``command``/``request`` follow redirects and
    poll retryable availability errors (deadline 15 s), as the SDK does; everything else is returned as is."""

    def __init__(self, addresses: list[tuple[str, int]]) -> None:
        self._addresses = addresses
        self._conns: dict[tuple[str, int], Connection] = {}
        self.current = addresses[0]

    def _conn(self, address: tuple[str, int]) -> Connection:
        if address not in self._conns:
            self._conns[address] = Connection(*address, timeout_s=15)
        return self._conns[address]

    def _route(self, send) -> Frame:
        deadline = time.monotonic() + 15
        address = self.current
        while True:
            try:
                frame = send(self._conn(address))
            except OSError:  # that broker is down: try the next one
                dead = self._conns.pop(address, None)
                if dead is not None:
                    dead.close()
                if time.monotonic() > deadline:
                    raise
                address = self._addresses[(self._addresses.index(address) + 1) % len(self._addresses)] \
                    if address in self._addresses else self._addresses[0]
                time.sleep(0.1)
                continue
            self.current = address  # sticky, as the SDK's coordinator and leader caches are
            if frame.status != Status.ERROR:
                return frame
            err = error_of(frame)
            if err.code == "NOT_COORDINATOR":
                address = (err.fields["host"], int(err.fields["port"]))
            elif err.code == "NOT_LEADER":
                host, _, port = err.fields["leader"].rpartition(":")
                address = (host, int(port))
            elif err.code in _RETRY and time.monotonic() < deadline:
                time.sleep(0.05)
            else:
                return frame

    def command(self, text: str, *, timeout_s: float | None = None) -> Frame:
        return self._route(lambda c: c.command(text, timeout_s=timeout_s))

    def request(self, command: Command, payload: bytes, *, timeout_s: float | None = None) -> Frame:
        return self._route(lambda c: c.request(command, payload, timeout_s=timeout_s))

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, pki) -> Iterator[Cluster]:
    c = Cluster(Path(tmp_path_factory.mktemp("gcluster")), pki, consumer_session_timeout_ms=SESSION_MS,
                raft_snapshot_min_entries=50, raft_snapshot_interval_ms=500)
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    broker = BrokerProcess(tmp_path_factory.mktemp("gstandalone") / "data",
                           settings={"consumer_session_timeout_ms": SESSION_MS}).start()
    yield broker
    broker.stop()


@pytest.fixture(params=["standalone", "cluster"])
def conn(request: pytest.FixtureRequest) -> Iterator[RoutingConnection]:
    if request.param == "standalone":
        brokers = [request.getfixturevalue("standalone")]
    else:
        brokers = request.getfixturevalue("cluster").brokers
    routed = RoutingConnection([b.address for b in brokers])
    yield routed
    routed.close()


@pytest.fixture
def group() -> str:
    return f"cg-{next(_names)}"


@pytest.fixture
def topic_name(request: pytest.FixtureRequest) -> str:
    base = "".join(c if c.isalnum() else "-" for c in request.node.name)[:50]
    return f"ct{next(_names)}-{base}"


# The shared bodies (same assertions on both backends).
test_rebalance_on_join_leave_and_session_timeout = shared.test_rebalance_on_join_leave_and_session_timeout
test_commit_fencing_regression_and_idempotence = shared.test_commit_fencing_regression_and_idempotence
test_batch_commit_is_all_or_nothing = shared.test_batch_commit_is_all_or_nothing
test_consume_with_group_starts_at_committed_offset = shared.test_consume_with_group_starts_at_committed_offset
test_fifty_groups_on_one_broker = shared.test_fifty_groups_on_one_broker


# ------------------------------------------------------------------------------------------ cluster only


def plain(broker: BrokerProcess) -> Connection:
    return Connection(*broker.address, timeout_s=10)


def cluster_status(broker: BrokerProcess) -> dict:
    with plain(broker) as c:
        text = c.command("CLUSTER_STATUS").payload.decode()
    assert text.startswith("OK cluster="), text
    return json.loads(text[len("OK cluster="):])


def owner_of(cluster: Cluster, group: str, via: BrokerProcess) -> BrokerProcess:
    with plain(via) as c:
        found = ok_fields(c.command(f"FIND_COORDINATOR group={group}"))
    return cluster.by_id(found["coordinator_id"])


def test_groups_are_placed_on_the_ring_and_no_offsets_topic_exists(cluster: Cluster) -> None:
    active = sorted(b.log_dir.name for b in cluster.brokers)
    owners = {}
    for i in range(12):
        name = f"ring-{i}"
        answers = {owner_of(cluster, name, b).log_dir.name for b in cluster.brokers}
        assert answers == {group_coordinator(active, name)}  # every broker answers the same owner
        owners[name] = answers.pop()
    assert len(set(owners.values())) > 1  # groups spread over the brokers
    name, owner = next(iter(owners.items()))
    other = next(b for b in cluster.brokers if b.log_dir.name != owner)
    with plain(other) as c:
        err = error_of(c.command(f"GROUP_STATUS group={name}"))
        assert err.code == "NOT_COORDINATOR" and int(err.fields["port"]) == cluster.by_id(owner).port
        assert "__consumer_offsets" not in c.command("LIST").payload.decode()
    assert all(not p["key"].startswith("__consumer_offsets") for p in cluster_status(other)["partitions"])


def _commit(conn: RoutingConnection, topic: str, group: str, member: str, generation: str, offset: int) -> None:
    frame = conn.command(f"COMMIT_OFFSET topic={topic} partition=0 group={group} offset={offset} "
                         f"member={member} generation={generation}")
    assert frame.status == Status.OK, render(frame)


class Heartbeats(threading.Thread):
    """Keeps one member alive (every 300 ms, following redirects) across a coordinator kill and restart."""

    def __init__(self, cluster: Cluster, topic: str, group: str, member: str) -> None:
        super().__init__(daemon=True)
        self.text = f"HEARTBEAT topic={topic} group={group} member={member}"
        self.routed = RoutingConnection([b.address for b in cluster.brokers])
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.3):
            try:
                self.routed.command(self.text)
            except OSError:
                pass

    def stop(self) -> None:
        self.stopped.set()
        self.join(20)
        self.routed.close()


def test_coordinator_kill_keeps_offsets_and_members_on_the_new_owner(cluster: Cluster) -> None:
    routed = RoutingConnection([b.address for b in cluster.brokers])
    beats: Heartbeats | None = None
    try:
        create_topic(routed, "grouped", 1)
        for i in range(60):  # acks=all: committed before the kill (a new leader truncates above the committed HWM)
            assert routed.command(f"PUBLISH topic=grouped partition=0 acks=all producerId=p message=m{i}").status \
                == Status.OK
        group = "gk"
        joined = ok_fields(routed.command(f"JOIN_GROUP topic=grouped group={group} member=m"))
        member, generation = joined["member"], joined["generation"]
        _commit(routed, "grouped", group, member, generation, 42)
        beats = Heartbeats(cluster, "grouped", group, member)
        beats.start()
        owner = owner_of(cluster, group, cluster.brokers[0])
        owner.kill()
        survivor = next(b for b in cluster.brokers if b is not owner)
        new = wait_for(lambda: (n := owner_of(cluster, group, survivor)) is not owner and n, 20, "a new owner")
        with plain(new) as c:  # the state is there at once: no replay, the member keeps its generation
            assert ok_fields(c.command(f"FETCH_OFFSET topic=grouped partition=0 group={group}")) == {"offset": "42"}
            assert ok_fields(c.command(f"HEARTBEAT topic=grouped group={group} member={member} "
                                       f"generation={generation}"))["generation"] == generation
        _commit(routed, "grouped", group, member, generation, 50)
        owner.start(timeout_s=60)
        wait_for(lambda: cluster_status(survivor)["inactive_brokers"] == 0, 20, "old owner active again")
        assert wait_for(lambda: owner_of(cluster, group, survivor) is owner, 10, "ownership back on the ring")
        with plain(owner) as c:  # it replayed the metadata state at startup: the interim commit is there
            assert ok_fields(c.command(f"FETCH_OFFSET topic=grouped partition=0 group={group}")) == {"offset": "50"}
        wait_for(lambda: ok_fields(routed.command(f"HEARTBEAT topic=grouped group={group} member={member}")), 10,
                 "the member served by the returned owner")
        _commit(routed, "grouped", group, member, generation, 55)
        # the partition leader (any broker) resumes the group at its committed offset
        seen: list[list[int]] = []
        try:
            wait_for(lambda: seen.append([r.offset for r in consume(routed, "grouped", 0, 0, group=group)][:1])
                     or seen[-1] == [55], 10, "the committed offset at the partition leader")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; consumed from {seen[-3:]}") from None
    finally:
        if beats is not None:
            beats.stop()
        routed.close()


def test_groups_survive_a_full_restart_from_snapshot_and_journal(cluster: Cluster) -> None:
    routed = RoutingConnection([b.address for b in cluster.brokers])
    try:
        create_topic(routed, "restarted", 2)
        for p in range(2):
            for i in range(10):
                frame = routed.command(f"PUBLISH topic=restarted partition={p} acks=all producerId=r message=m{i}")
                assert frame.status == Status.OK, render(frame)
        names = [f"rs-{i}" for i in range(6)]
        for i, name in enumerate(names):
            joined = ok_fields(routed.command(f"JOIN_GROUP topic=restarted group={name} member=c"))
            frame = routed.command(f"BATCH_COMMIT topic=restarted group={name} member={joined['member']} "
                                   f"generation={joined['generation']} offsets=P0:{i},P1:{i + 1}")
            assert frame.status == Status.OK, render(frame)
        wait_for(lambda: all((b.log_dir / "raft" / "snapshot.v9").exists() for b in cluster.brokers), 20,
                 "a snapshot on every node")
    finally:
        routed.close()
    for broker in cluster.brokers:
        broker.kill()
    cluster.start()
    routed = RoutingConnection([b.address for b in cluster.brokers])
    try:
        for i, name in enumerate(names):
            got = [ok_fields(routed.command(f"FETCH_OFFSET topic=restarted partition={p} group={name}"))["offset"]
                   for p in range(2)]
            assert got == [str(i), str(i + 1)]
            doc = json.loads(routed.command(f"GROUP_STATUS group={name}").payload)
            assert doc["subscription"] == {"type": "topic", "topics": ["restarted"]} and doc["generation"] >= 1
    finally:
        routed.close()
