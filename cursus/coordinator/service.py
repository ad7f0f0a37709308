"""The group coordinator service: the state machine, made durable and timed.

:class:`GroupCoordinator` runs a :class:`~cursus.coordinator.groups.GroupTable` over a
:class:`~cursus.coordinator.ports.GroupLog`. It keeps two views of every group:

* the **staged** state (:attr:`GroupCoordinator.table`): the state at the end of the log, including records
  appended but not yet durable. Mutating commands validate against it and change it, and append the matching
  records in the same synchronous step (no await in between), so log order is state order, and two concurrent
  commits to one partition are checked in the order they will be applied.
* the **durable** state (:attr:`GroupCoordinator.visible`): a copy of each group published when the records of
  its latest change are durable. Everything a reader can observe answers from it: FETCH_OFFSET, CONSUME and
  STREAM resume (:meth:`committed`), GROUP_STATUS, LIST_GROUPS, SYNC_GROUP and HEARTBEAT. A command answers
  OK (and a JOIN its generation) only once its records are durable; a validation error computed from staged
  state is answered once the state it saw is durable.

A failed append (the log refuses it, or it fails to become durable) puts the staged group back to the state
after the latest *earlier* append still in flight, or to its durable copy when there is none, so memory never
keeps a change the log lost, and the command gets the log's typed error. The log fails every later record of
the group too, so the rollback never undoes a change that did become durable; an earlier append may still
become durable after a later one failed (a cluster follower whose earlier command the old Raft leader had
already accepted), and its change stays staged, so the next snapshot never writes an older offset over it.

Session expiry is event driven: one timer (``call_later``) armed for the earliest member deadline
(:meth:`GroupTable.next_deadline_ms`) on the injected monotonic clock, so a wall-clock jump expires nobody;
when it fires, expired members are removed, their groups rebalance and the new memberships are appended.

Topic lifecycle: :meth:`on_topic_changed` (CREATE of a new topic or added partitions) updates every matching
group's expansion durably and rebalances it; :meth:`check_topic_deletable` / :meth:`on_topic_deleted` implement
DELETE's ``topic_delete_blocked`` preflight and the tombstones written after the manifest commit. At startup
the same reconciliation repairs groups whose topics changed while the broker was down (a crash between a
manifest commit and the group records).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from cursus.coordinator.groups import (
    DEFAULT_SESSION_TIMEOUT_MS,
    Group,
    GroupTable,
    JoinResult,
    Selector,
    expansion_for,
)
from cursus.coordinator.offsets import (
    GroupRecord,
    MembershipRecord,
    OffsetSnapshotRecord,
    RegistrationRecord,
    ReplayError,
    Snapshot,
    TombstoneRecord,
    restore_snapshot,
    utc_timestamp,
)
from cursus.coordinator.ports import (
    CallLater,
    Clock,
    GroupLog,
    OpenLog,
    PartitionOffsetsLookup,
    ReadinessReport,
    TimerHandle,
    TopicLookup,
    TopicNames,
)
from cursus.metadata.topics import TopicDefinition, is_internal_topic
from cursus.wire.errors import BrokerError

log = logging.getLogger("cursus.coordinator")


class GroupCoordinator:
    """Consumer groups and committed offsets (spec "Consumer Group Coordination", section 6).

    Create it, then ``await open()`` before the broker reports ready. Until :attr:`ready`, group commands
    raise ``coordinator_not_available`` (retryable) and ``report`` carries the reason.

    Args:
        open_log: creates (if needed) and opens the group log; awaited by :meth:`open`.
        topic, topic_names: topic definitions (partition counts of subscribed topics).
        partition_offsets: a partition's log start, HWM and LEO (commit validation, GROUP_STATUS lag).
        report: readiness reporting (a reason while not ready, None once ready).
        call_later: the event loop's timer (session expiry).
        clock_ms: monotonic ms (session deadlines, activity times).
        wall_ms: wall-clock ms, only to display times (GROUP_STATUS ``last_heartbeat``, ``last_rebalance``).
        session_timeout_ms: ``consumer_session_timeout_ms``.
        rng: member-id suffixes (default: the system's secure source).
        owns: ``owns(group)``: does this broker coordinate ``group`` now (default: every group, standalone)?
            In a cluster every broker keeps every group's state (adopted from the metadata log), but only
            the owner times its sessions and reconciles it with topic changes; commands are routed to the
            owner before they get here (``NOT_COORDINATOR`` elsewhere) and the metadata log fences any
            record a non-owner still submits.
    """

    def __init__(self, *, open_log: OpenLog, topic: TopicLookup, topic_names: TopicNames,
                 partition_offsets: PartitionOffsetsLookup, report: ReadinessReport, call_later: CallLater,
                 clock_ms: Clock, wall_ms: Clock, session_timeout_ms: int = DEFAULT_SESSION_TIMEOUT_MS,
                 rng: random.Random | None = None, owns: Callable[[str], bool] | None = None) -> None:
        self._open_log = open_log
        self._topic = topic
        self._topic_names = topic_names
        self._partition_offsets = partition_offsets
        self._report = report
        self._call_later = call_later
        self._clock = clock_ms
        self._wall = wall_ms
        self._session_timeout_ms, self._rng = session_timeout_ms, rng
        self._owns: Callable[[str], bool] = owns if owns is not None else (lambda name: True)
        #: The staged state: the end of the group log (appended, maybe not durable yet).
        self.table = GroupTable(session_timeout_ms, rng)
        #: The durable state readers see: a copy of each group as of its latest durable records.
        self.visible: dict[str, Group] = {}
        #: Durable tombstone epochs (deleted group names).
        self.visible_tombstones: dict[str, int] = {}
        self.log: GroupLog | None = None
        self.ready = False
        #: Topics whose DELETE is in progress: no new group may subscribe to them meanwhile.
        self.deleting: set[str] = set()
        self._timer: TimerHandle | None = None
        self._timer_at_ms: int | None = None
        #: group -> the future of its latest appended records, until they are durable (or failed).
        self._pending: dict[str, asyncio.Future[None]] = {}
        #: group -> every append still in flight, in log order: (future, staged copy after it, tombstone,
        #: adoption count when appended). A failed append rolls back to the latest earlier entry.
        self._inflight: dict[str, list[tuple[asyncio.Future[None], Group | None, int | None, int]]] = {}
        #: group -> how many times committed records were adopted (:meth:`adopt`): a copy staged before an
        #: adoption is not published over it.
        self._adopts: dict[str, int] = {}
        self._reason = "replay not started"
        report(self._reason)

    # -------------------------------------------------------------------------------------- lifecycle

    async def open(self) -> None:
        """Open and replay the group log, repair groups against the topic definitions, arm the session timer.

        A replay failure leaves the coordinator unavailable with the reason reported (never an empty
        coordinator).
        """
        started = self._clock()
        try:
            self.log = await self._open_log()
            snapshot = await self.log.replay()
        except ReplayError as exc:
            self._reason = f"__consumer_offsets replay failed: {exc}"
            self._report(self._reason)
            log.error("group coordinator not ready: %s", exc)
            return
        self._restore(snapshot)
        self.ready = True
        await self._reconcile(list(self.table.groups))
        self._report(None)
        self._arm_timer()
        log.info("group coordinator: replayed %d records (%d stale) into %d groups in %d ms",
                 snapshot.records, snapshot.stale, len(self.table.groups), self._clock() - started)

    def _restore(self, snapshot: Snapshot) -> None:
        restore_snapshot(self.table, snapshot, self._clock())
        self.visible = {name: group.copy() for name, group in self.table.groups.items()}
        self.visible_tombstones = dict(self.table.tombstones)

    def adopt(self, name: str, group: Group | None, tombstone: int | None) -> None:
        """Records of ``name`` became durable that this coordinator did not stage (another broker owned the
        group, or an own append whose outcome was unknown did commit): make them both the staged and the
        durable state, at once (a new owner has the state without replay). Members still present keep
        their sessions; if this broker owns the group, new ones are timed from now. Before :meth:`open`
        this is a no-op (replay reads the same state)."""
        if not self.ready:
            return
        self._adopts[name] = self._adopts.get(name, 0) + 1
        self.table.restore(name, group.copy() if group is not None else None, tombstone)
        if group is None:
            self.visible.pop(name, None)
        else:
            self.visible[name] = group.copy()
        if tombstone is None:
            self.visible_tombstones.pop(name, None)
        else:
            self.visible_tombstones[name] = tombstone
        if self._owns(name):
            self.table.refresh_sessions(name, self._clock(), only_untracked=True)
            self._arm_timer()

    def adopt_offsets(self, name: str, epoch: int, topic: str, offsets: Mapping[int, int]) -> bool:
        """The fast path of :meth:`adopt` for the most frequent foreign change, an offset snapshot: set
        ``name``'s committed offsets of ``topic`` (staged and durable) to ``offsets``. Returns False when the
        group is not here at ``epoch`` (the caller then adopts the whole group)."""
        if not self.ready:
            return True
        staged, durable = self.table.groups.get(name), self.visible.get(name)
        if staged is None or durable is None or staged.epoch != epoch or durable.epoch != epoch:
            return False
        self._adopts[name] = self._adopts.get(name, 0) + 1
        for group in (staged, durable):
            count = group.partitions.get(topic, 0)
            for key in [k for k in group.offsets if k[0] == topic]:
                del group.offsets[key]
            for partition, offset in offsets.items():
                if partition < count:
                    group.offsets[(topic, partition)] = offset
        return True

    async def take_ownership(self, names: Sequence[str]) -> None:
        """The groups ``names`` moved to this broker (the ring of active brokers changed): their members
        get a fresh session here (as after a restart), and each group is reconciled with the topics (a
        change its previous owner may not have written)."""
        if not self.ready:
            return
        now = self._clock()
        owned = [name for name in names if name in self.table.groups and self._owns(name)]
        for name in owned:
            self.table.refresh_sessions(name, now)
        if owned:
            log.info("group coordinator now owns %d groups: %s", len(owned), ",".join(sorted(owned)[:10]))
        self._arm_timer()
        await self._reconcile(owned)

    async def close(self) -> None:
        """Stop the session timer and let the log finish background work."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.log is not None:
            await self.log.close()

    def check_ready(self) -> GroupLog:
        """The log; raises ``coordinator_not_available`` (retryable) until replay succeeded."""
        if not self.ready or self.log is None:
            raise BrokerError.of("coordinator_not_available", reason=self._reason.replace(" ", "_")[:200])
        return self.log

    # -------------------------------------------------------------------------------------- persistence

    @staticmethod
    def _registration(group: Group) -> RegistrationRecord:
        return RegistrationRecord(group.name, group.selector, dict(group.partitions), group.epoch)

    @staticmethod
    def _membership(group: Group) -> MembershipRecord:
        members = tuple((m.member_id, m.assignment) for m in group.members.values())
        return MembershipRecord(group.name, group.generation, members, group.epoch)

    @staticmethod
    def _offsets(group: Group, topic: str) -> OffsetSnapshotRecord:
        return OffsetSnapshotRecord(group.name, topic, group.topic_offsets(topic), group.epoch)

    def _append(self, name: str, records: Sequence[GroupRecord]) -> tuple[asyncio.Future[None], Group | None]:
        """Append ``records`` for the staged change just made to ``name`` (synchronously after it).

        Returns the durability future and the copy of the group that is published when it resolves (None:
        the change deleted the group). On any failure the staged group is rolled back to its durable copy.

        Raises:
            BrokerError: the log refused the records (rolled back already).
        """
        group_log = self.check_ready()
        group = self.table.groups.get(name)
        published = group.copy() if group is not None else None
        tombstone = self.table.tombstones.get(name)
        try:
            fut = group_log.append(name, records)
        except BrokerError:
            inflight = self._inflight.get(name)
            self._rollback(name, inflight[-1] if inflight else None)
            raise
        self._pending[name] = fut
        self._inflight.setdefault(name, []).append((fut, published, tombstone, self._adopts.get(name, 0)))
        settled = functools.partial(self._on_appended, name, published, tombstone, self._adopts.get(name, 0))
        if fut.done():
            settled(fut)  # publish now: awaiting a done future does not yield to its callbacks
        else:
            fut.add_done_callback(settled)
        return fut, published

    def _on_appended(self, name: str, published: Group | None, tombstone: int | None, adopts: int,
                     fut: asyncio.Future[None]) -> None:
        inflight = self._inflight.get(name, [])
        position = next((i for i, entry in enumerate(inflight) if entry[0] is fut), len(inflight))
        earlier = inflight[:position]
        del inflight[position:position + 1]
        if not inflight:
            self._inflight.pop(name, None)
        if self._pending.get(name) is fut:
            del self._pending[name]
        if fut.cancelled() or fut.exception() is not None:
            self._rollback(name, earlier[-1] if earlier else None)
            return
        if self._adopts.get(name, 0) != adopts:
            return  # records committed after these were adopted meanwhile: that state is newer, keep it
        if published is None:
            self.visible.pop(name, None)
        else:
            self.visible[name] = published
        if tombstone is None:
            self.visible_tombstones.pop(name, None)
        else:
            self.visible_tombstones[name] = tombstone

    def _rollback(self, name: str,
                  earlier: tuple[asyncio.Future[None], Group | None, int | None, int] | None = None) -> None:
        """Put the staged ``name`` back after a failed append (later ones fail too): to the state after
        ``earlier``, the latest earlier append still in flight (it may still become durable; if it fails,
        its own rollback goes further back), else to the durable copy. An adoption since ``earlier`` was
        appended is newer than it: then the durable copy (which holds the adoption) wins."""
        if earlier is not None and self._adopts.get(name, 0) == earlier[3]:
            fut, published, tombstone, _ = earlier
            self.table.restore(name, published.copy() if published is not None else None, tombstone)
            self._pending[name] = fut  # _settle waits for it again
            log.warning("group %s: change not durable; state rolled back to the change still in flight", name)
            return
        durable = self.visible.get(name)
        self.table.restore(name, durable.copy() if durable is not None else None,
                           self.visible_tombstones.get(name))
        log.warning("group %s: change not durable; state rolled back to the durable one", name)

    async def _persist(self, name: str, records: Sequence[GroupRecord]) -> Group | None:
        """:meth:`_append`, then wait until durable; returns the published copy. Raises the log's error."""
        fut, published = self._append(name, records)
        await asyncio.shield(fut)
        return published

    async def _settle(self, name: str) -> None:
        """Wait until every record already appended for ``name`` is durable (raises the log's error)."""
        fut = self._pending.get(name)
        if fut is not None:
            await asyncio.shield(fut)

    async def _refuse(self, name: str, error: BrokerError) -> BrokerError:
        """The error to raise for a command refused against staged state: once that state is durable."""
        await self._settle(name)
        return error

    def _durable_group(self, name: str) -> Group:
        """The durable copy of ``name``. Raises ``group_not_found``."""
        group = self.visible.get(name)
        if group is None:
            raise BrokerError.of("group_not_found", group=name)
        return group

    def _display_ms(self, monotonic_ms: int) -> int:
        """Wall-clock ms of a monotonic instant (for display only)."""
        return self._wall() - (self._clock() - monotonic_ms)

    # -------------------------------------------------------------------------------------- timer

    def _arm_timer(self) -> None:
        deadline = self.table.next_deadline_ms()
        if deadline is None:
            return
        if self._timer is not None:
            if self._timer_at_ms is not None and self._timer_at_ms <= deadline:
                return
            self._timer.cancel()
        delay_s = max(0.0, (deadline - self._clock()) / 1000.0)
        self._timer_at_ms = deadline
        self._timer = self._call_later(delay_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at_ms = None
        for group, expired in self.table.expire(self._clock(), self._owns):
            log.info("group %s: session expired for %s; generation %d", group.name, ",".join(expired),
                     group.generation)
            try:
                self._append(group.name, [self._membership(group)])
            except BrokerError as exc:
                log.warning("group %s: membership after expiry not persisted: %s", group.name, exc.error.code)
        self._arm_timer()

    # -------------------------------------------------------------------------------------- commands

    async def register(self, name: str, selector: Selector) -> Group:
        """REGISTER_GROUP: create or re-subscribe ``name``; durable before returning (the durable group).

        Raises:
            BrokerError: ``topic_not_found`` for a named topic that does not exist, ``coordinator_not_available``,
                ``storage_unavailable``.
        """
        self.check_ready()
        counts = self._partition_counts()
        for topic in selector.topics:
            if topic not in counts or topic in self.deleting:
                raise BrokerError.of("topic_not_found", topic=topic)
        group, changed = self.table.register(name, selector, expansion_for(selector, counts), self._clock())
        if changed:
            records: list[GroupRecord] = [self._registration(group)]
            if group.members:
                records.append(self._membership(group))
            published = await self._persist(name, records)
            assert published is not None
            return published
        await self._settle(name)
        return self._durable_group(name)

    async def join(self, name: str, member: str, *, topic: str | None, generation: int | None,
                   origin: str | None = None, origin_open: Callable[[str], bool] | None = None) -> JoinResult:
        """JOIN_GROUP: a missing group is registered for ``topic`` (which must exist); durable before
        returning; ``result.group`` is the durable group. ``origin`` (the client connection, ``host:port``)
        and ``origin_open`` (is that connection still open?) let a retried join get the same member (see
        :meth:`GroupTable.join` for ids, retries and rebalancing).

        Raises:
            BrokerError: ``topic_not_found``, ``group_not_found`` (no topic and no group),
                ``topic_not_assigned_to_group``, ``coordinator_not_available``, ``storage_unavailable``.
        """
        self.check_ready()
        now = self._clock()
        records: list[GroupRecord] = []
        tombstone = self.table.tombstones.get(name)
        if name not in self.table.groups:
            if topic is None:
                raise await self._refuse(name, BrokerError.of("group_not_found", group=name))
            defn = self._existing_topic(topic)
            if topic in self.deleting:
                raise BrokerError.of("topic_not_found", topic=topic)
            group, _ = self.table.register(name, Selector.single(topic), {topic: defn.partitions}, now)
            records.append(self._registration(group))
        elif topic is not None:
            self._existing_topic(topic)
        try:
            result = self.table.join(name, member, now, topic=topic, generation=generation, origin=origin,
                                     origin_open=origin_open)
        except BrokerError as exc:
            if records:  # nothing appended yet: forget the group this join registered
                self.table.restore(name, None, tombstone)
            raise await self._refuse(name, exc) from None
        self._arm_timer()
        if result.rebalanced:
            records.append(self._membership(result.group))
        if records:
            published = await self._persist(name, records)
            assert published is not None
            return replace(result, group=published)
        await self._settle(name)
        return replace(result, group=self._durable_group(name))

    def sync(self, name: str, member: str, generation: int, topic: str | None = None) -> Group:
        """SYNC_GROUP against the durable state; refreshes the session. Returns the durable group.

        Raises:
            BrokerError: ``group_not_found``, ``member_not_found``, ``GEN_MISMATCH``,
                ``topic_not_assigned_to_group`` (``topic`` given and not subscribed).
        """
        return self.heartbeat(name, member, generation, topic)

    def heartbeat(self, name: str, member: str, generation: int | None, topic: str | None = None) -> Group:
        """HEARTBEAT against the durable state (``generation`` optional); extends the session.

        Raises:
            BrokerError: ``group_not_found``, ``member_not_found``, ``GEN_MISMATCH`` (stale generation: rejoin),
                ``topic_not_assigned_to_group``.
        """
        self.check_ready()
        group = self._durable_group(name)
        GroupTable.member(group, member)
        GroupTable.check_generation(group, member, generation)
        if topic is not None:
            GroupTable.check_topic(group, topic)
        self.table.touch(name, member, self._clock())
        return group

    async def leave(self, name: str, member: str, generation: int | None) -> Group:
        """LEAVE_GROUP: remove the member, rebalance, durable before returning (the durable group).

        Raises:
            BrokerError: ``group_not_found``, ``member_not_found``, ``GEN_MISMATCH``, ``storage_unavailable``.
        """
        self.check_ready()
        try:
            group = self.table.leave(name, member, generation, self._clock())
        except BrokerError as exc:
            raise await self._refuse(name, exc) from None
        published = await self._persist(name, [self._membership(group)])
        assert published is not None
        return published

    def _check_commit(self, name: str, topic: str, member: str, generation: int,
                      offsets: dict[int, int]) -> tuple[Group, dict[int, int]]:
        group, changed = self.table.check_commit(name, topic, member, generation, offsets)
        for partition, offset in changed.items():
            found = self._partition_offsets(topic, partition)
            if found is not None and offset > found.leo:
                raise BrokerError.of("invalid_offset", command="COMMIT_OFFSET", topic=topic, partition=partition,
                                     value=offset, reason="beyond_log_end", log_end_offset=found.leo)
        return group, changed

    async def validate_commit(self, name: str, topic: str, member: str, generation: int,
                              offsets: dict[int, int]) -> None:
        """COMMIT_OFFSET ``validate_only``: the checks of :meth:`commit` without storing; answered once the
        state checked against is durable. Raises as :meth:`commit`."""
        self.check_ready()
        try:
            self._check_commit(name, topic, member, generation, offsets)
        except BrokerError as exc:
            raise await self._refuse(name, exc) from None
        await self._settle(name)

    async def commit(self, name: str, topic: str, member: str, generation: int, offsets: dict[int, int]) -> int:
        """COMMIT_OFFSET / BATCH_COMMIT: validate everything (all-or-nothing) against the staged state, append,
        and return once durable (the number of partitions in the request). Readers see the new offsets only
        then. Re-committing the same offsets waits until the earlier write is durable.

        Raises the fencing and regression errors of :meth:`GroupTable.check_commit`, ``invalid_offset`` for an
        offset past the partition's log end (it could never be consumed from), ``storage_unavailable`` (the
        offsets stay as they were).
        """
        self.check_ready()
        try:
            group, changed = self._check_commit(name, topic, member, generation, offsets)
        except BrokerError as exc:
            raise await self._refuse(name, exc) from None
        self.table.confirm(name, member)
        if changed:
            self.table.apply_commit(group, topic, changed, self._clock())
            await self._persist(name, [self._offsets(group, topic)])
        else:
            await self._settle(name)
        return len(offsets)

    async def materialize(self, name: str, topic: str, offsets: dict[int, int]) -> int:
        """Store the offsets of a committed transaction (its decision is durable, its fence was checked
        before the commit): no membership check, each partition only moves forward. Returns how many
        partitions changed; returns 0 when the group or topic is gone (nothing left to move).

        Raises ``storage_unavailable`` (the offsets stay as they were; the caller retries).
        """
        self.check_ready()
        group = self.table.groups.get(name)
        if group is None or topic not in group.partitions:
            return 0
        changed = {p: o for p, o in offsets.items()
                   if 0 <= p < group.partitions[topic] and o > group.offsets.get((topic, p), -1)}
        if not changed:
            await self._settle(name)
            return 0
        self.table.apply_commit(group, topic, changed, self._clock())
        await self._persist(name, [self._offsets(group, topic)])
        return len(changed)

    # -------------------------------------------------------------------------------------- reads (durable)

    def fetch_offset(self, name: str, topic: str, partition: int) -> int:
        """FETCH_OFFSET: the durable committed next offset, 0 when none (decision 9).

        Raises ``group_not_found``, ``topic_not_assigned_to_group``, ``partition_not_found``.
        """
        self.check_ready()
        group = self._durable_group(name)
        GroupTable.check_topic(group, topic)
        if not 0 <= partition < group.partitions.get(topic, 0):
            raise BrokerError.of("partition_not_found", topic=topic, partition=partition, group=name)
        return group.offsets.get((topic, partition), 0)

    def committed(self, name: str | None, topic: str, partition: int) -> int | None:
        """The durable committed offset for CONSUME/STREAM resume, or None (unknown group, nothing committed,
        or the coordinator not ready). Never raises."""
        if not name or not self.ready:
            return None
        group = self.visible.get(name)
        return group.offsets.get((topic, partition)) if group is not None else None

    def last_activity_ms(self, name: str | None, member: str | None, topic: str) -> int:
        """Latest time (the coordinator's monotonic ``clock_ms``) the group showed life for a stream: the
        member's heartbeat or the group's latest commit on ``topic`` (0 when unknown)."""
        group = self.table.groups.get(name or "")
        if group is None:
            return 0
        stamps = []
        if topic in group.last_commit_ms:
            stamps.append(group.last_commit_ms[topic])
        found = group.members.get(member or "")
        if found is not None:
            stamps.append(found.last_heartbeat_ms)
        return max(stamps) if stamps else 0

    def list_groups(self) -> list[str]:
        """Durably registered group names, sorted."""
        self.check_ready()
        return sorted(self.visible)

    def status(self, name: str) -> dict[str, Any]:
        """GROUP_STATUS of the durable group as a JSON-ready dict (spec shape plus subscription, epoch and
        per-partition offsets with lag = HWM - committed, or HWM - log start when nothing is committed).
        ``last_heartbeat`` is the session's latest heartbeat."""
        self.check_ready()
        group = self._durable_group(name)
        staged = self.table.groups.get(name)
        topics = list(group.partitions)
        first = group.selector.topics[0] if group.selector.kind == "topic" else (topics[0] if topics else "")
        members = []
        for m in group.members.values():
            session = staged.members.get(m.member_id) if staged is not None else None
            heartbeat = (session or m).last_heartbeat_ms
            members.append({
                "member_id": m.member_id,
                "last_heartbeat": utc_timestamp(self._display_ms(heartbeat)),
                "assignments": [p for t, p in m.assignment if t == first],
                "topic_assignments": [f"{t}:P{p}" for t, p in m.assignment],
            })
        offsets = []
        for topic, partition in group.topic_partitions():
            found = self._partition_offsets(topic, partition)
            hwm = found.hwm if found is not None else 0
            start = found.log_start_offset if found is not None else 0
            committed = group.offsets.get((topic, partition))
            offsets.append({
                "topic": topic, "partition": partition, "committed_offset": committed,
                "log_end_offset": hwm, "lag": max(0, hwm - (committed if committed is not None else start)),
                "owner": group.owners.get((topic, partition)),
            })
        subscription: dict[str, Any] = {"type": group.selector.kind}
        if group.selector.kind == "pattern":
            subscription["pattern"] = group.selector.pattern
        else:
            subscription["topics"] = list(group.selector.topics)
        last_rebalance = group.last_rebalance_ms
        return {
            "status": "OK",
            "group_name": group.name,
            "topic_name": first,
            "topics": topics,
            "subscription": subscription,
            "state": group.state,
            "generation": group.generation,
            "epoch": group.epoch,
            "member_count": len(group.members),
            "partition_count": group.partition_count,
            "members": members,
            "last_rebalance": utc_timestamp(self._display_ms(last_rebalance)) if last_rebalance else None,
            "offsets": offsets,
        }

    # -------------------------------------------------------------------------------------- topic lifecycle

    def _existing_topic(self, name: str) -> TopicDefinition:
        defn = self._topic(name)
        if defn is None:
            raise BrokerError.of("topic_not_found", topic=name)
        return defn

    def _partition_counts(self) -> dict[str, int]:
        counts = {}
        for name in self._topic_names():
            defn = self._topic(name)
            if defn is not None and not is_internal_topic(name) and name not in self.deleting:
                counts[name] = defn.partitions
        return counts

    async def _reconcile(self, names: list[str]) -> None:
        """Bring each group's expansion in line with the topic definitions, durably: rebalance on change, an
        empty offset snapshot for each topic that left it, a tombstone for a one-topic group whose topic is
        gone. Raises the first log error after every group was tried."""
        if not self.ready:
            return
        counts = self._partition_counts()
        now = self._clock()
        waits: list[asyncio.Future[None]] = []
        for name in names:
            group = self.table.groups.get(name)
            if group is None or not self._owns(name):
                continue  # its owner reconciles it
            wanted = expansion_for(group.selector, counts)
            if wanted == group.partitions:
                continue
            removed = [t for t in group.partitions if t not in wanted]
            if group.selector.kind == "topic" and not wanted:
                group.members.clear()
                epoch = self.table.tombstone(name)
                records: list[GroupRecord] = [TombstoneRecord(name, epoch)]
                what = f"deleted with its topic {group.selector.topics[0]}"
            else:
                had_members = bool(group.members)
                self.table.set_expansion(group, wanted, now)
                records = [self._registration(group)]
                records += [OffsetSnapshotRecord(name, t, {}, group.epoch) for t in removed]
                if had_members:
                    records.append(self._membership(group))
                what = f"expansion now {group.partitions} (generation {group.generation})"
            try:
                waits.append(self._append(name, records)[0])
            except BrokerError as exc:
                log.warning("group %s not reconciled: %s", name, exc.error.code)
                continue
            log.info("group %s %s", name, what)
        self._arm_timer()
        results = await asyncio.gather(*(asyncio.shield(w) for w in waits), return_exceptions=True)
        for outcome in results:
            if isinstance(outcome, BaseException):
                raise outcome

    async def on_topic_changed(self, defn: TopicDefinition) -> None:
        """After CREATE made ``defn`` durable: groups subscribed to it (or matching it) get the new expansion
        and rebalance. Internal topics are ignored."""
        if not self.ready or is_internal_topic(defn.name):
            return
        await self._reconcile([g.name for g in self.table.groups.values() if g.selector.matches(defn.name)])

    def check_topic_deletable(self, topic: str) -> None:
        """DELETE preflight: raise ``topic_delete_blocked`` while a group with members subscribes to ``topic``
        (``coordinator_not_available`` while the coordinator is not ready); then fence new subscriptions to
        it until :meth:`on_topic_deleted` or :meth:`topic_delete_aborted`."""
        self.check_ready()
        active = self.table.active_groups_for(topic)
        if active:
            raise BrokerError.of("topic_delete_blocked", topic=topic, group=active[0].name,
                                 reason="consumer_group_has_active_members", members=",".join(active[0].members),
                                 session_timeout_ms=self.table.session_timeout_ms)
        self.deleting.add(topic)

    def topic_delete_aborted(self, topic: str) -> None:
        """The manifest removal failed: the topic stays, subscriptions to it are allowed again."""
        self.deleting.discard(topic)

    async def on_topic_deleted(self, topic: str) -> None:
        """After the manifest no longer names ``topic``: tombstone its one-topic groups and drop it from
        multi-topic groups (their offsets for it are cleared)."""
        try:
            await self._reconcile([g.name for g in self.table.groups.values() if topic in g.partitions])
        finally:
            self.deleting.discard(topic)
