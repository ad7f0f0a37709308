"""The group coordinator service: the state machine, made durable and timed, inside one broker.

:class:`GroupCoordinator` owns a :class:`~cursus.coordinator.groups.GroupTable` and an
:class:`~cursus.coordinator.offsets.OffsetStore`. Every mutating command validates and applies its change to
the table and appends the matching records to ``__consumer_offsets`` in one synchronous step (no await in
between, so log order is state order), then awaits the partition's HWM (fsynced) before the handler answers
OK. Read commands answer from memory.

Session expiry is event driven: one ``loop.call_later`` timer armed for the earliest member deadline
(:meth:`GroupTable.next_deadline_ms`); when it fires, expired members are removed, their groups rebalance and
the new memberships are appended. No polling loop.

Topic lifecycle: :meth:`on_topic_changed` (CREATE of a new topic or added partitions) updates every matching
group's expansion durably and rebalances it; :meth:`check_topic_deletable` / :meth:`on_topic_deleted` implement
DELETE's ``topic_delete_blocked`` preflight and the tombstones written after the manifest commit. At startup
the same reconciliation repairs groups whose topics changed while the broker was down (a crash between a
manifest commit and the group records).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from cursus.broker.replica import Replica
from cursus.coordinator.groups import Group, GroupTable, JoinResult, Selector, expansion_for
from cursus.coordinator.offsets import (
    OFFSETS_TOPIC,
    GroupRecord,
    MembershipRecord,
    OffsetSnapshotRecord,
    OffsetStore,
    RegistrationRecord,
    ReplayError,
    TombstoneRecord,
    utc_timestamp,
)
from cursus.metadata.topics import TopicDefinition, TopicPolicy, is_internal_topic
from cursus.wire.errors import BrokerError

if TYPE_CHECKING:
    from cursus.broker.core import Broker

log = logging.getLogger("cursus.coordinator")

#: The readiness check this service owns in ``broker.not_ready_reasons``.
READINESS_CHECK = "coordinator"


def wall_ms() -> int:
    """Wall-clock milliseconds (session deadlines, heartbeat and rebalance times)."""
    return int(time.time() * 1000)


class GroupCoordinator:
    """Consumer groups and committed offsets of one broker (spec "Consumer Group Coordination", section 6).

    Create it, then ``await open()`` before the broker reports ready. Until :attr:`ready`, group commands
    raise ``coordinator_not_available`` (retryable) and the broker's ``/ready`` lists the reason.
    """

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        cfg = broker.config
        self.table = GroupTable(cfg.consumer_session_timeout_ms)
        self.store: OffsetStore | None = None
        self.ready = False
        #: Topics whose DELETE is in progress: no new group may subscribe to them meanwhile.
        self.deleting: set[str] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at_ms: int | None = None
        #: group -> (replica, end offset) of its latest appended records.
        self._last_write: dict[str, tuple[Replica, int]] = {}
        broker.not_ready_reasons[READINESS_CHECK] = "replay not started"

    # -------------------------------------------------------------------------------------- lifecycle

    async def open(self) -> None:
        """Create ``__consumer_offsets`` if missing, replay it, repair groups against the catalog, arm the
        session timer. A replay failure leaves the coordinator unavailable with the reason in
        ``broker.not_ready_reasons["coordinator"]`` (never an empty coordinator)."""
        broker = self.broker
        started = time.monotonic()
        try:
            defn = broker.catalog.get(OFFSETS_TOPIC)
            if defn is None:
                defn = TopicDefinition(OFFSETS_TOPIC, broker.config.offsets_topic_num_partitions,
                                       policy=TopicPolicy(cleanup_policy="compact"))
                await broker.apply_definition(defn)
            replicas = [broker.replica(OFFSETS_TOPIC, p) for p in range(defn.partitions)]
            self.store = OffsetStore(replicas, broker.run_blocking,
                                     compaction_min_records=broker.config.offsets_compaction_min_records,
                                     clock_ms=wall_ms)
            snapshot = self.store.replay()
        except ReplayError as exc:
            broker.not_ready_reasons[READINESS_CHECK] = f"__consumer_offsets replay failed: {exc}"
            log.error("group coordinator not ready: %s", exc)
            return
        self._restore(snapshot.registrations, snapshot.tombstones, snapshot.offsets, snapshot.memberships)
        self.ready = True
        await self._reconcile(list(self.table.groups))
        broker.not_ready_reasons.pop(READINESS_CHECK, None)
        self._arm_timer()
        log.info("group coordinator: replayed %d records (%d stale) into %d groups in %.0f ms",
                 snapshot.records, snapshot.stale, len(self.table.groups), (time.monotonic() - started) * 1000)

    def _restore(self, registrations: dict[str, RegistrationRecord], tombstones: dict[str, TombstoneRecord],
                 offsets: dict[tuple[str, str], OffsetSnapshotRecord],
                 memberships: dict[str, MembershipRecord]) -> None:
        now = wall_ms()
        table = self.table
        for name, reg in registrations.items():
            table.groups[name] = Group(name, reg.selector, dict(reg.partitions), reg.epoch)
        for name, tomb in tombstones.items():
            table.tombstones[name] = tomb.epoch
        for (name, topic), snap in offsets.items():
            group = table.groups[name]
            count = group.partitions.get(topic, 0)
            for partition, offset in snap.offsets.items():
                if partition < count:
                    group.offsets[(topic, partition)] = offset
        for name, membership in memberships.items():
            group = table.groups[name]
            table.restore_membership(group, membership.generation, dict(membership.members), now)
            group.last_rebalance_ms = now

    async def close(self) -> None:
        """Stop the session timer and wait for running compactions."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.store is not None:
            await self.store.close()

    def check_ready(self) -> OffsetStore:
        """The store; raises ``coordinator_not_available`` (retryable) until replay succeeded."""
        if not self.ready or self.store is None:
            reason = self.broker.not_ready_reasons.get(READINESS_CHECK, "not ready")
            raise BrokerError.of("coordinator_not_available", reason=reason.replace(" ", "_")[:200])
        return self.store

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

    def _append(self, name: str, records: list[GroupRecord]) -> tuple[Replica, int]:
        """Append now (synchronously, right after the state change)."""
        store = self.check_ready()
        replica, end = store.write(name, records)
        self._last_write[name] = (replica, end)
        return replica, end

    async def _durable(self, name: str) -> None:
        """Wait until ``name``'s latest appended records are fsynced (HWM past them)."""
        last = self._last_write.get(name)
        if last is not None:
            replica, end = last
            await replica.wait_hwm(end)

    # -------------------------------------------------------------------------------------- timer

    def _arm_timer(self) -> None:
        deadline = self.table.next_deadline_ms()
        if deadline is None:
            return
        if self._timer is not None:
            if self._timer_at_ms is not None and self._timer_at_ms <= deadline:
                return
            self._timer.cancel()
        delay_s = max(0.0, (deadline - wall_ms()) / 1000.0)
        self._timer_at_ms = deadline
        self._timer = self.broker.loop.call_later(delay_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at_ms = None
        for group, expired in self.table.expire(wall_ms()):
            log.info("group %s: session expired for %s; generation %d", group.name, ",".join(expired),
                     group.generation)
            try:
                self._append(group.name, [self._membership(group)])
            except BrokerError as exc:
                log.warning("group %s: membership after expiry not persisted: %s", group.name, exc.error.code)
        self._arm_timer()

    # -------------------------------------------------------------------------------------- commands

    async def register(self, name: str, selector: Selector) -> Group:
        """REGISTER_GROUP: create or re-subscribe ``name``; durable before returning.

        Raises:
            BrokerError: ``topic_not_found`` for a named topic that does not exist, ``coordinator_not_available``,
                ``storage_unavailable``.
        """
        store = self.check_ready()
        counts = self._partition_counts()
        for topic in selector.topics:
            if topic not in counts or topic in self.deleting:
                raise BrokerError.of("topic_not_found", topic=topic)
        store.check_writable(name)
        group, changed = self.table.register(name, selector, expansion_for(selector, counts), wall_ms())
        if changed:
            records: list[GroupRecord] = [self._registration(group)]
            if group.members:
                records.append(self._membership(group))
            self._append(name, records)
        await self._durable(name)
        return group

    async def join(self, name: str, member: str, *, topic: str | None, generation: int | None) -> JoinResult:
        """JOIN_GROUP: a missing group is registered for ``topic`` (which must exist); durable before
        returning. See :meth:`GroupTable.join` for ids and rebalancing."""
        store = self.check_ready()
        now = wall_ms()
        records: list[GroupRecord] = []
        if name not in self.table.groups:
            if topic is None:
                raise BrokerError.of("group_not_found", group=name)
            defn = self.broker.topic(topic)
            if topic in self.deleting:
                raise BrokerError.of("topic_not_found", topic=topic)
            store.check_writable(name)
            group, _ = self.table.register(name, Selector.single(topic), {topic: defn.partitions}, now)
            records.append(self._registration(group))
        else:
            if topic is not None:
                self.broker.topic(topic)
            store.check_writable(name)
        result = self.table.join(name, member, now, topic=topic, generation=generation)
        if result.rebalanced:
            records.append(self._membership(result.group))
        if records:
            self._append(name, records)
        self._arm_timer()
        await self._durable(name)
        return result

    def sync(self, name: str, member: str, generation: int) -> Group:
        """SYNC_GROUP: raises ``group_not_found``/``member_not_found``/``GEN_MISMATCH``; returns the group."""
        self.check_ready()
        self.table.sync(name, member, generation, wall_ms())
        return self.table.groups[name]

    def heartbeat(self, name: str, member: str, generation: int | None) -> Group:
        """HEARTBEAT: extends the session (see :meth:`GroupTable.heartbeat`)."""
        self.check_ready()
        return self.table.heartbeat(name, member, generation, wall_ms())

    async def leave(self, name: str, member: str, generation: int | None) -> Group:
        """LEAVE_GROUP: remove the member, rebalance, durable before returning."""
        store = self.check_ready()
        store.check_writable(name)
        group = self.table.leave(name, member, generation, wall_ms())
        self._append(name, [self._membership(group)])
        await self._durable(name)
        return group

    async def commit(self, name: str, topic: str, member: str, generation: int, offsets: dict[int, int]) -> int:
        """COMMIT_OFFSET / BATCH_COMMIT: validate everything (all-or-nothing), store, fsync; returns the number
        of partitions in the request. Re-committing the same offsets waits for their earlier write.

        Raises the fencing and regression errors of :meth:`GroupTable.check_commit`, then ``invalid_offset``
        for an offset past the partition's log end (it could never be consumed from).
        """
        store = self.check_ready()
        group, changed = self.table.check_commit(name, topic, member, generation, offsets)
        for partition, offset in changed.items():
            replica = self.broker.replicas.get((topic, partition))
            if replica is not None and offset > replica.leo:
                raise BrokerError.of("invalid_offset", command="COMMIT_OFFSET", topic=topic, partition=partition,
                                     value=offset, reason="beyond_log_end", log_end_offset=replica.leo)
        if changed:
            store.check_writable(name)
            self.table.apply_commit(group, topic, changed, wall_ms())
            self._append(name, [self._offsets(group, topic)])
        await self._durable(name)
        return len(offsets)

    def fetch_offset(self, name: str, topic: str, partition: int) -> int:
        """FETCH_OFFSET: the committed next offset, 0 when none (decision 9).

        Raises ``group_not_found``, ``topic_not_assigned_to_group``, ``partition_not_found``.
        """
        self.check_ready()
        group = self.table.get(name)
        self.table.check_topic(group, topic)
        if not 0 <= partition < group.partitions.get(topic, 0):
            raise BrokerError.of("partition_not_found", topic=topic, partition=partition, group=name)
        return group.offsets.get((topic, partition), 0)

    def committed(self, name: str | None, topic: str, partition: int) -> int | None:
        """The committed offset for CONSUME/STREAM resume, or None (unknown group, nothing committed, or the
        coordinator not ready). Never raises."""
        if not name or not self.ready:
            return None
        group = self.table.groups.get(name)
        return group.offsets.get((topic, partition)) if group is not None else None

    def last_activity_ms(self, name: str | None, member: str | None, topic: str) -> int:
        """Latest wall-clock ms the group showed life for a stream: the member's heartbeat or the group's
        latest commit on ``topic`` (0 when unknown)."""
        group = self.table.groups.get(name or "")
        if group is None:
            return 0
        stamps = [group.last_commit_ms.get(topic, 0)]
        found = group.members.get(member or "")
        if found is not None:
            stamps.append(found.last_heartbeat_ms)
        return max(stamps)

    def list_groups(self) -> list[str]:
        """Registered group names, sorted."""
        self.check_ready()
        return sorted(self.table.groups)

    def status(self, name: str) -> dict[str, Any]:
        """GROUP_STATUS as a JSON-ready dict (spec shape plus subscription, epoch and per-partition offsets
        with lag = HWM - committed, or HWM - log start when nothing is committed)."""
        self.check_ready()
        group = self.table.get(name)
        topics = list(group.partitions)
        first = group.selector.topics[0] if group.selector.kind == "topic" else (topics[0] if topics else "")
        members = []
        for m in group.members.values():
            members.append({
                "member_id": m.member_id,
                "last_heartbeat": utc_timestamp(m.last_heartbeat_ms),
                "assignments": [p for t, p in m.assignment if t == first],
                "topic_assignments": [f"{t}:P{p}" for t, p in m.assignment],
            })
        offsets = []
        for topic, partition in group.topic_partitions():
            replica = self.broker.replicas.get((topic, partition))
            hwm = replica.hwm if replica is not None else 0
            start = replica.log_start_offset if replica is not None else 0
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
            "last_rebalance": utc_timestamp(group.last_rebalance_ms) if group.last_rebalance_ms else None,
            "offsets": offsets,
        }

    # -------------------------------------------------------------------------------------- topic lifecycle

    def _partition_counts(self) -> dict[str, int]:
        catalog = self.broker.catalog
        counts = {}
        for name in catalog.names():
            defn = catalog.get(name)
            if defn is not None and not is_internal_topic(name) and name not in self.deleting:
                counts[name] = defn.partitions
        return counts

    async def _reconcile(self, names: list[str]) -> None:
        """Bring each group's expansion in line with the catalog, durably: rebalance on change, an empty
        offset snapshot for each topic that left it, a tombstone for a one-topic group whose topic is gone."""
        if not self.ready:
            return
        counts = self._partition_counts()
        now = wall_ms()
        for name in names:
            group = self.table.groups.get(name)
            if group is None:
                continue
            wanted = expansion_for(group.selector, counts)
            if wanted == group.partitions:
                continue
            try:
                self.check_ready().check_writable(name)
            except BrokerError as exc:
                log.warning("group %s not reconciled: %s", name, exc.error.code)
                continue
            removed = [t for t in group.partitions if t not in wanted]
            if group.selector.kind == "topic" and not wanted:
                group.members.clear()
                epoch = self.table.tombstone(name)
                self._append(name, [TombstoneRecord(name, epoch)])
                log.info("group %s deleted with its topic %s", name, group.selector.topics[0])
            else:
                had_members = bool(group.members)
                self.table.set_expansion(group, wanted, now)
                records: list[GroupRecord] = [self._registration(group)]
                records += [OffsetSnapshotRecord(name, t, {}, group.epoch) for t in removed]
                if had_members:
                    records.append(self._membership(group))
                self._append(name, records)
                log.info("group %s: expansion now %s (generation %d)", name, group.partitions, group.generation)
        for name in names:
            await self._durable(name)
        self._arm_timer()

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
                                 reason="consumer_group_has_active_members")
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
