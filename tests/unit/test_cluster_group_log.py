"""RaftGroupLog and the coordinator of three brokers over one shared (in-process) metadata log.

The log applies commands with the real pure ``apply`` in submission order and delivers each applied state
to every broker (a broker can be held behind, to open the window where two brokers believe they own a
group). Checked: a non-owner holds every group's committed state at once (adopted, no replay); ownership
moves with the ring when the owner is fenced, the new owner serves the offsets and times the sessions; a
stale owner's records are refused by the applied state and its staged change rolls back; a lost command
does not wedge the group; oversize commands are refused before submission; replay equals adoption.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable

import pytest

from cursus.cluster.group_log import RaftGroupLog
from cursus.coordinator.ports import PartitionOffsets
from cursus.coordinator.service import GroupCoordinator
from cursus.metadata.apply import ApplyResult, apply
from cursus.metadata.commands import BrokerHeartbeat, Command, FenceBroker, GroupRecords
from cursus.metadata.state import BrokerInfo, MetadataState
from cursus.metadata.topics import TopicDefinition
from cursus.wire.errors import BrokerError

BROKERS = ("a", "b", "c")
SESSION_MS = 1_000


class SharedLog:
    """Applies commands in order; delivers every outcome to each node (held nodes queue them)."""

    def __init__(self) -> None:
        self.truth = MetadataState(cluster=True)
        for b in BROKERS:
            self.truth, _ = apply(self.truth, BrokerHeartbeat(f"hb-{b}", BrokerInfo(b, f"{b}-host:9{ord(b)}"), 50))
        self.nodes: dict[str, Node] = {}
        self.drop_next = False
        #: When set, a submit answers only once it is set (its command is applied and delivered at once).
        self.gate: asyncio.Event | None = None
        #: origin -> set when its cut ends: until then its submits hang, then time out unapplied.
        self.cut: dict[str, asyncio.Event] = {}

    async def submit(self, origin: str, command: Command) -> ApplyResult:
        gate = self.gate
        await asyncio.sleep(0)  # a commit takes a loop turn, so appends pipeline
        if origin in self.cut:  # isolated: the command never reaches the leader
            await self.cut[origin].wait()
            raise BrokerError.of("request_timeout", outcome="unknown")
        if self.drop_next:  # the commit timed out and the command never made it into the log
            self.drop_next = False
            raise BrokerError.of("request_timeout", outcome="unknown")
        try:
            self.truth, result = apply(self.truth, command)
        except BrokerError:
            for node in self.nodes.values():
                node.deliver(self.truth, command)
            raise
        for node in self.nodes.values():
            node.deliver(self.truth, command)
        if gate is not None:
            await gate.wait()
        return result

    def run(self, command: Command) -> None:
        """A controller command (fence, heartbeat) applied at once."""
        self.truth, _ = apply(self.truth, command)
        for node in self.nodes.values():
            node.deliver(self.truth, command)


class Node:
    def __init__(self, log: SharedLog, broker_id: str) -> None:
        self.log, self.id = log, broker_id
        self.view = log.truth
        self.held: list[tuple[MetadataState, Command]] | None = None
        self.mono = 1_000_000
        self.timers: list[tuple[float, Callable[[], None]]] = []
        self.group_log = RaftGroupLog(broker_id, lambda c: log.submit(broker_id, c), lambda: self.view,
                                      lambda b: self.view.brokers[b].client_address if b in self.view.brokers else "",
                                      wall_ms=lambda: 1_767_225_600_000, clock_ms=lambda: self.mono,
                                      session_timeout_ms=SESSION_MS)
        self.topics = {"t": TopicDefinition("t", 2)}
        self.coord = GroupCoordinator(
            open_log=self._open, topic=self.topics.get, topic_names=lambda: list(self.topics),
            partition_offsets=lambda t, p: PartitionOffsets(0, 100, 100), report=lambda r: None,
            call_later=self._call_later, clock_ms=lambda: self.mono, wall_ms=lambda: 1_767_225_600_000,
            session_timeout_ms=SESSION_MS, rng=random.Random(broker_id), owns=self.owns)
        self.group_log.on_adopt = self.coord.adopt
        self.group_log.on_adopt_offsets = self.coord.adopt_offsets
        log.nodes[broker_id] = self

    async def _open(self) -> RaftGroupLog:
        return self.group_log

    def _call_later(self, delay_s: float, callback: Callable[[], None]):
        self.timers.append((delay_s, callback))
        return asyncio.get_running_loop().call_later(3600, lambda: None)

    def owns(self, group: str) -> bool:
        return self.view.group_coordinator(group) == self.id

    def deliver(self, state: MetadataState, command: Command) -> None:
        if self.held is not None:
            self.held.append((state, command))
            return
        old, self.view = self.view, state
        self.group_log.observe(command)
        if old.active_brokers() != state.active_brokers():
            gained = [g for g in self.coord.table.groups if self.owns(g) and old.group_coordinator(g) != self.id]
            if gained:
                asyncio.ensure_future(self.coord.take_ownership(gained))

    def release(self) -> None:
        held, self.held = self.held or [], None
        for state, command in held:
            self.deliver(state, command)

    def install_snapshot(self) -> None:
        """Catch up by a Raft snapshot install: the latest state at once, the commands in between unseen."""
        self.held, self.view = None, self.log.truth
        self.group_log.observe(None)


async def cluster() -> tuple[SharedLog, dict[str, Node]]:
    log = SharedLog()
    nodes = {b: Node(log, b) for b in BROKERS}
    for node in nodes.values():
        await node.coord.open()
    return log, nodes


async def test_non_owners_hold_the_committed_state_and_the_new_owner_serves_it_at_once() -> None:
    log, nodes = await cluster()
    owner = nodes[log.truth.group_coordinator("g")]
    joined = await owner.coord.join("g", "c", topic="t", generation=None)
    assert await owner.coord.commit("g", "t", joined.member_id, joined.group.generation, {0: 42, 1: 7}) == 2
    for node in nodes.values():  # every broker has the group, its generation and the offsets
        assert node.coord.fetch_offset("g", "t", 0) == 42 and node.coord.committed("g", "t", 1) == 7
        assert node.coord.status("g")["generation"] == joined.group.generation
    log.run(FenceBroker("fence", owner.id))
    successor = nodes[log.truth.group_coordinator("g")]
    assert successor is not owner
    await asyncio.sleep(0)
    # the member keeps working on the new owner (fresh session, same generation and assignment)
    group = successor.coord.heartbeat("g", joined.member_id, joined.group.generation)
    assert group.members[joined.member_id].assignment == (("t", 0), ("t", 1))
    await successor.coord.commit("g", "t", joined.member_id, joined.group.generation, {0: 50})
    assert all(n.coord.fetch_offset("g", "t", 0) == 50 for n in nodes.values())
    # sessions are timed only by the owner: expiring on the old owner changes nothing
    owner.mono += 10 * SESSION_MS
    owner.coord._on_timer()
    assert joined.member_id in owner.coord.table.groups["g"].members
    successor.mono += 10 * SESSION_MS
    successor.coord._on_timer()
    for _ in range(5):  # the expiry's membership commits (a few loop turns)
        await asyncio.sleep(0)
    assert {b: n.coord.status("g")["member_count"] for b, n in nodes.items()} == {b: 0 for b in nodes}


async def test_a_stale_owner_is_fenced_by_the_applied_state_and_rolls_back() -> None:
    log, nodes = await cluster()
    owner = nodes[log.truth.group_coordinator("g")]
    joined = await owner.coord.join("g", "c", topic="t", generation=None)
    member, gen = joined.member_id, joined.group.generation
    await owner.coord.commit("g", "t", member, gen, {0: 10})
    owner.held = []  # the owner has not applied its own fencing yet: it still believes it owns the group
    log.run(FenceBroker("fence", owner.id))
    successor = nodes[log.truth.group_coordinator("g")]
    await asyncio.sleep(0)
    await successor.coord.commit("g", "t", member, gen, {0: 20})
    with pytest.raises(BrokerError) as info:  # both believe they own it; the log agrees with one
        await owner.coord.commit("g", "t", member, gen, {0: 30})
    assert info.value.error.code == "NOT_COORDINATOR"
    assert info.value.error.fields["host"] == successor.view.brokers[successor.id].client_address.split(":")[0]
    assert owner.coord.table.groups["g"].offsets[("t", 0)] == 10  # staged rolled back to its durable copy
    owner.release()
    assert owner.coord.fetch_offset("g", "t", 0) == 20  # and it caught up with the successor's commit
    log.run(BrokerHeartbeat("back", BrokerInfo(owner.id, owner.view.brokers[owner.id].client_address), 50))
    await asyncio.sleep(0)
    assert owner.owns("g")
    await owner.coord.commit("g", "t", member, gen, {0: 25})
    assert all(n.coord.fetch_offset("g", "t", 0) == 25 for n in nodes.values())


async def test_pipelined_commits_and_a_lost_command() -> None:
    log, nodes = await cluster()
    owner = nodes[log.truth.group_coordinator("g")]
    joined = await owner.coord.join("g", "c", topic="t", generation=None)
    member, gen = joined.member_id, joined.group.generation
    results = await asyncio.gather(*(owner.coord.commit("g", "t", member, gen, {0: n}) for n in range(1, 9)))
    assert results == [1] * 8 and log.truth.groups["g"].sequence == 9
    log.drop_next = True
    with pytest.raises(BrokerError) as info:
        await owner.coord.commit("g", "t", member, gen, {0: 90})
    assert info.value.error.code == "request_timeout"
    assert owner.coord.fetch_offset("g", "t", 0) == 8
    await owner.coord.commit("g", "t", member, gen, {0: 91})  # restarts from the applied state
    assert all(n.coord.fetch_offset("g", "t", 0) == 91 for n in nodes.values())


async def test_replay_equals_adoption_and_oversize_is_refused() -> None:
    log, nodes = await cluster()
    owner = nodes[log.truth.group_coordinator("g")]
    joined = await owner.coord.join("g", "c", topic="t", generation=None)
    await owner.coord.commit("g", "t", joined.member_id, joined.group.generation, {0: 3})
    late = Node(SharedLog(), "a")
    late.view = log.truth
    await late.coord.open()
    other = nodes[next(b for b in BROKERS if b != owner.id)]
    assert late.coord.status("g")["offsets"] == other.coord.status("g")["offsets"]
    assert late.coord.visible["g"].generation == other.coord.visible["g"].generation
    owner.group_log.max_command_bytes = 200
    before = log.truth.groups["g"].sequence
    with pytest.raises(BrokerError) as info:
        await owner.coord.commit("g", "t", joined.member_id, joined.group.generation, {0: 4})
    assert info.value.error.code == "message_too_large"
    assert log.truth.groups["g"].sequence == before and owner.coord.fetch_offset("g", "t", 0) == 3
    assert isinstance(GroupRecords, type)


async def test_a_commit_answered_after_newer_records_were_adopted_does_not_regress_them() -> None:
    log, nodes = await cluster()
    owner = nodes[log.truth.group_coordinator("g")]
    joined = await owner.coord.join("g", "c", topic="t", generation=None)
    member, gen = joined.member_id, joined.group.generation
    log.gate = gate = asyncio.Event()
    task = asyncio.ensure_future(owner.coord.commit("g", "t", member, gen, {0: 20}))
    for _ in range(5):
        await asyncio.sleep(0)
    assert json.loads(log.truth.groups["g"].records["offset/t"].payload)["offsets"][0]["offset"] == 20
    log.gate = None
    log.run(FenceBroker("fence", owner.id))  # the answer to that commit is still on its way to the owner
    successor = nodes[log.truth.group_coordinator("g")]
    await asyncio.sleep(0)
    await successor.coord.commit("g", "t", member, gen, {0: 30})
    assert owner.coord.fetch_offset("g", "t", 0) == 30
    gate.set()
    assert await task == 1
    assert owner.coord.fetch_offset("g", "t", 0) == 30  # the late answer did not publish its older copy


async def test_an_isolated_owner_caught_up_by_a_snapshot_does_not_serve_its_older_offsets() -> None:
    """Chaos finding J: the owner is cut off with commits in flight, another broker owns the group and
    commits newer offsets, the old owner catches up by a snapshot install (never seeing those commands),
    its own commits fail, and it owns the group again: it serves the newer offsets, not its copy from
    before the cut."""
    log, nodes = await cluster()
    owner = nodes[log.truth.group_coordinator("g")]
    joined = await owner.coord.join("g", "c", topic="t", generation=None)
    member, gen = joined.member_id, joined.group.generation
    await owner.coord.commit("g", "t", member, gen, {0: 10, 1: 10})
    owner.held, log.cut[owner.id] = [], asyncio.Event()
    inflight = [asyncio.ensure_future(owner.coord.commit("g", "t", member, gen, {0: 11 + n})) for n in range(3)]
    for _ in range(5):
        await asyncio.sleep(0)
    log.run(FenceBroker("fence", owner.id))
    successor = nodes[log.truth.group_coordinator("g")]
    await asyncio.sleep(0)
    await successor.coord.commit("g", "t", member, gen, {0: 60, 1: 70})
    log.run(BrokerHeartbeat("back", BrokerInfo(owner.id, owner.view.brokers[owner.id].client_address), 50))
    assert log.truth.group_coordinator("g") == owner.id
    owner.install_snapshot()
    log.cut.pop(owner.id).set()
    outcomes = await asyncio.gather(*inflight, return_exceptions=True)
    assert all(isinstance(o, BrokerError) and o.error.code == "request_timeout" for o in outcomes)
    await owner.coord.take_ownership(["g"])
    assert (owner.coord.fetch_offset("g", "t", 0), owner.coord.fetch_offset("g", "t", 1)) == (60, 70)
    await owner.coord.commit("g", "t", member, gen, {0: 61})
    assert all((n.coord.fetch_offset("g", "t", 0), n.coord.fetch_offset("g", "t", 1)) == (61, 70)
               for n in nodes.values())
