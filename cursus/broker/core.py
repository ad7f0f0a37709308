"""The broker's domain state: metadata, replicas, producer state and the storage writer.

:class:`Broker` owns everything a request handler needs and nothing about sockets (see
:mod:`cursus.broker.server` for listeners and :mod:`cursus.broker.session` for connections). Authoritative
state lives behind the :class:`~cursus.metadata.backend.Metadata` seam; topic commands are submitted to it,
and the :class:`~cursus.broker.reconciler.Reconciler` turns what it commits into local replicas.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cursus.broker import group_log
from cursus.broker.cleaning import LogCleanerService
from cursus.broker.config import BrokerConfig
from cursus.broker.eventstore import EventStore
from cursus.broker.fdlimit import check_partition_headroom
from cursus.broker.metrics import BrokerMetrics
from cursus.broker.offload import Offload, StallProbe
from cursus.broker.producer_state import ProducerStateTable
from cursus.broker.reconciler import Reconciler
from cursus.broker.replica import Replica
from cursus.broker.replica_role import Role, TransitionRefused
from cursus.broker.topic_cleanup import TopicStateDroppers
from cursus.broker.topic_storage import crash_point
from cursus.cluster.group_log import RaftGroupLog
from cursus.cluster.metadata import RaftMetadata
from cursus.cluster.raft.node import RaftConfig
from cursus.cluster.tls import TLSFiles
from cursus.coordinator.ports import GroupLog
from cursus.coordinator.service import GroupCoordinator
from cursus.metadata.apply import ApplyResult
from cursus.metadata.backend import Metadata, StandaloneMetadata
from cursus.metadata.commands import (
    AlterTopicConfig,
    Command,
    CreateTopic,
    DeleteTopic,
    ElectLeader,
    PutTopic,
    TruncateTopic,
)
from cursus.metadata.lifecycle import (
    LIFECYCLE_COMPACTION,
    LIFECYCLE_PROTOCOL_VERSION,
    require_lifecycle_protocol,
)
from cursus.metadata.state import BrokerInfo, MetadataState, PartitionAssignment
from cursus.metadata.topics import TopicDefinition, TopicSpec, is_compacted_policy, is_internal_topic
from cursus.replication.hwm import HwmCommitter, LocalHwmCommitter
from cursus.replication.node import ReplicationNode, internal_address
from cursus.storage import (
    Completion,
    CorruptLogError,
    GroupCommitWriter,
    LogConfig,
    LogDir,
    PartitionLog,
    open_log_dir,
)
from cursus.storage.repair import truncate_to_last_valid_chunk
from cursus.transactions.coordinator import TransactionCoordinator
from cursus.wire.errors import BrokerError

log = logging.getLogger("cursus.broker")


def now_ms() -> int:
    """Wall-clock milliseconds since the epoch (record and producer-state timestamps)."""
    return time.time_ns() // 1_000_000


def monotonic_ms() -> int:
    """Monotonic milliseconds (deadlines and timeouts; immune to wall-clock jumps)."""
    return time.monotonic_ns() // 1_000_000


@dataclasses.dataclass(frozen=True, slots=True)
class Clock:
    """The broker's clocks, injected so tests can drive time.

    ``monotonic_ms`` is for deadlines, timeouts and intervals; ``wall_ms`` only for timestamps that are
    stored or compared across restarts: record append times, retention by append time, producer-state
    activity (persisted in the producer snapshot, as Kafka expires producers by batch timestamp).
    """

    monotonic_ms: Callable[[], int] = monotonic_ms
    wall_ms: Callable[[], int] = now_ms


#: Descriptors kept free beyond one per client connection (listeners, Raft, gRPC, temp files).
FD_RESERVE = 128


def default_broker_id(config: BrokerConfig, port: int) -> str:
    """``broker_id`` when set, else ``<advertised_host>-<port>`` (facts B7 "Broker identity")."""
    return str(config.broker_id) or f"{config.advertised}-{port}"


def cluster_members(config: BrokerConfig) -> dict[str, str]:
    """``static_cluster_members`` as {broker id: Raft address ``host:port``}."""
    return dict(member.split("@", 1) for member in config.static_cluster_members)


def recovery_threads(config: BrokerConfig) -> int:
    """Size of the partition-open pool: ``recovery_threads``, or min(4, CPUs) when 0."""
    return int(config.recovery_threads) or min(4, os.cpu_count() or 1)


#: The blocking result of opening one partition: its recovered log and rebuilt producer state.
OpenedPartition = tuple[PartitionLog, ProducerStateTable]


class Broker:
    """Domain state of one broker node. Create with :meth:`open`, close with :meth:`close`."""

    def __init__(self, config: BrokerConfig, log_dir: LogDir, metrics: BrokerMetrics, *,
                 client_port: int = 0, clock: Clock | None = None) -> None:
        self.config = config
        self.clock = clock or Clock()
        self.log_dir = log_dir
        self.metrics = metrics
        self.client_port = client_port or config.broker_port
        self.broker_id = default_broker_id(config, self.client_port)
        self.loop = asyncio.get_running_loop()
        self.writer = GroupCommitWriter(self._notify_from_writer_thread, on_written=self._written_from_writer_thread)
        #: Authoritative metadata (topics, partition assignment, broker registry): the one place that
        #: chooses the backend by ``enabled_distribution``.
        self.metadata: Metadata = self._metadata_backend()
        #: Commits leader replicas' candidate HWMs: through the metadata log in a cluster, at once standalone
        #: (the one place that chooses).
        self.hwm_committer: HwmCommitter | LocalHwmCommitter = (
            HwmCommitter(self.broker_id, self.metadata.submit,
                         retry_backoff_s=config.replica_fetch_backoff_ms / 1000.0,
                         max_in_flight=config.replica_hwm_commits_in_flight)
            if config.enabled_distribution else LocalHwmCommitter())
        self.reconciler = Reconciler(self, log_dir.path, recovery_threads(config), metrics.orphan_topics.set,
                                     open_retry_backoff_ms=config.partition_open_retry_backoff_ms,
                                     open_max_attempts=config.partition_open_max_attempts)
        self.reconciler.on_open_failed = (
            lambda gave_up: metrics.partition_open_failures.labels("gave_up" if gave_up else "retry").inc())
        self.metadata.subscribe(self.reconciler.on_metadata)
        self.metadata.subscribe(self._follow_leadership)
        self.metadata.subscribe(self._groups_follow_topics)
        self._group_tasks: set[asyncio.Task[None]] = set()
        self.replicas: dict[tuple[str, int], Replica] = {}
        self.producers: dict[tuple[str, int], ProducerStateTable] = {}
        self.round_robin: dict[str, int] = {}
        #: Serializes the consumer-group follow-up of topic changes (groups take new partitions in order).
        self._group_sync = asyncio.Lock()
        self.ready = False
        self.not_ready_reasons: dict[str, str] = {"recovery": "not started"}
        self._coordinator_readiness = group_log.readiness_reporter(self.not_ready_reasons, "coordinator")
        self.log_config = LogConfig(
            segment_bytes=config.log_segment_bytes,
            segment_roll_ms=config.log_segment_roll_ms,
            index_interval_bytes=config.log_index_interval_bytes,
            recovery_point_interval_ms=config.log_recovery_point_interval_ms,
            producer_state_ttl_ms=config.producer_state_ttl_ms,
        )
        #: Broker-owned topics (``__consumer_offsets``) use small segments so compaction can free them.
        self.internal_log_config = dataclasses.replace(
            self.log_config, segment_bytes=min(config.log_segment_bytes, config.offsets_topic_segment_bytes))
        #: The cluster's group log (records committed through the metadata log); None standalone, where
        #: groups live in ``__consumer_offsets`` (the one place that chooses the GroupLog backend).
        self.raft_group_log: RaftGroupLog | None = None
        if isinstance(self.metadata, RaftMetadata):
            self.raft_group_log = RaftGroupLog(
                self.broker_id, self.metadata.submit, lambda: self.metadata.state, self.broker_address,
                wall_ms=self.clock.wall_ms, clock_ms=self.clock.monotonic_ms,
                session_timeout_ms=config.consumer_session_timeout_ms)
        #: Consumer groups and committed offsets (ready once the group log is replayed). In a cluster every
        #: broker holds every group; it coordinates those it owns (:meth:`coordinator_id`).
        self.coordinator = GroupCoordinator(
            open_log=self._open_group_log,
            topic=self.metadata.get, topic_names=self.metadata.names,
            partition_offsets=functools.partial(group_log.partition_offsets, self),
            report=self._report_coordinator,
            call_later=self.loop.call_later, clock_ms=self.clock.monotonic_ms, wall_ms=self.clock.wall_ms,
            session_timeout_ms=config.consumer_session_timeout_ms,
            owns=self._owns_group if self.raft_group_log is not None else None)
        if self.raft_group_log is not None and isinstance(self.metadata, RaftMetadata):
            self.raft_group_log.on_adopt = self.coordinator.adopt
            self.raft_group_log.on_adopt_offsets = self.coordinator.adopt_offsets
            self.metadata.observe(self.raft_group_log.observe)
            self.metadata.subscribe(self._groups_follow_ownership)
        #: Transactions: coordinator state (journal standalone, TxnSync in a cluster), per-partition
        #: transaction indexes.
        self.transactions = TransactionCoordinator(self)
        #: Event sourcing: per-partition stream indexes and snapshot stores (cursus.broker.eventstore).
        self.events = EventStore(self)
        if isinstance(self.metadata, RaftMetadata):
            self.metadata.subscribe(self.transactions.on_metadata)
            self.metadata.observe(self.transactions.observe)
        #: Per-topic node-local state dropped after a committed DELETE or TRUNCATE (the one registry;
        #: storage and producer state are the reconciler's): consumer groups, transactions, and whatever
        #: registers later (an event store's indexes and snapshots).
        self.topic_state = TopicStateDroppers()
        self.topic_state.register("groups", self._drop_group_state)
        self.topic_state.register("transactions", lambda topic, reason: self.transactions.on_topic_deleted(topic))
        self.reconciler.on_retry = metrics.topic_cleanup_retries_total.inc
        self.topic_state.register("eventstore", lambda topic, reason: self.events.drop_topic(topic, remove_files=True))
        #: Active STREAM requests; each has ``stop(reason)`` (see cursus.broker.handlers.stream).
        self.streams: set[Any] = set()
        #: Is the client connection ``host:port`` still open? The server installs its answer; until then
        #: every connection counts as closed (a JOIN_GROUP retry is recognised only once its first
        #: connection is gone).
        self.is_connection_open: Callable[[str], bool] = lambda peer: False
        #: Callbacks run once by :meth:`begin_shutdown`, before client connections are closed.
        self.on_shutdown: list[Callable[[], None]] = []
        self._shutting_down = False
        #: Large (de)compression, checksums and partition reads run here, off the event loop.
        self.offload = Offload(config.offload_threshold_bytes, config.offload_threads)
        #: The log cleaner of compacted topics (its own thread; see cursus.broker.cleaning).
        self.cleaner = LogCleanerService(self)
        self.stall_probe = StallProbe(config.loop_probe_interval_ms / 1000.0, metrics.loop_max_stall,
                                      metrics.loop_stall)
        self.stall_probe.start()
        #: The replication pipeline (cluster only: a one-member ISR needs no fetches).
        self.replication: ReplicationNode | None = self._replication()
        if self.replication is not None:
            self.metadata.subscribe(self.replication.on_metadata)
            self.replication.server.snapshot_handler = self.events.on_replicated_snapshot

    def _report_coordinator(self, reason: str | None) -> None:
        """The coordinator's readiness gates ``/ready`` only during startup: a coordinator that moves here
        later (a cluster failover) replays while the broker keeps serving everything else."""
        if "recovery" in self.not_ready_reasons or reason is None:
            self._coordinator_readiness(reason)

    def _holds_partition_data(self) -> bool:
        """Does the log dir already hold partition folders (then its Raft state must exist too)?"""
        topics = self.log_dir.topics_dir
        return topics.is_dir() and any(topics.iterdir())

    def _metadata_backend(self) -> Metadata:
        config = self.config
        if not config.enabled_distribution:
            return StandaloneMetadata(self.log_dir.path, self.run_blocking,
                                      BrokerInfo(self.broker_id, self.leader_address(),
                                                 lifecycle_protocol=LIFECYCLE_PROTOCOL_VERSION))
        members = cluster_members(config)
        local = BrokerInfo(self.broker_id, self.leader_address(), internal_address(self),
                           incarnation=uuid.uuid4().hex, lifecycle_protocol=LIFECYCLE_PROTOCOL_VERSION)
        raft = RaftConfig(
            node_id=self.broker_id, members=members, data_dir=self.log_dir.path / "raft",
            tls=TLSFiles(Path(config.internal_tls_cert_path), Path(config.internal_tls_key_path),
                         Path(config.internal_tls_ca_path)),
            election_timeout_min=config.raft_election_timeout_min_ms / 1000.0,
            election_timeout_max=config.raft_election_timeout_max_ms / 1000.0,
            heartbeat_period=config.raft_heartbeat_ms / 1000.0,
            leader_fallback_timeout=config.raft_election_timeout_max_ms / 1000.0,
            connection_timeout=max(3.5, config.raft_election_timeout_max_ms / 1000.0),
            poll_interval=config.raft_poll_interval_ms / 1000.0,
            snapshot_min_entries=config.raft_snapshot_min_entries,
            snapshot_min_interval=config.raft_snapshot_interval_ms / 1000.0,
            allow_new=not self._holds_partition_data())
        backend = RaftMetadata(raft, local, coordinator_shards=config.transaction_coordinator_shards,
                               commit_timeout=config.metadata_commit_timeout_ms / 1000.0,
                               heartbeat_interval=config.broker_heartbeat_interval_ms / 1000.0,
                               session_timeout=config.broker_session_timeout_ms / 1000.0)
        backend.on_commit_latency = self.metrics.metadata_commit_seconds.observe
        return backend

    def _replication(self) -> ReplicationNode | None:
        if not self.config.enabled_distribution:
            return None
        return ReplicationNode(self, lambda: set(cluster_members(self.config)))

    # -------------------------------------------------------------------------------------- lifecycle

    @classmethod
    async def open(cls, config: BrokerConfig, metrics: BrokerMetrics, *, client_port: int = 0,
                   clock: Clock | None = None) -> Broker:
        """Open the log dir, recover every local partition in parallel off the loop (the reconciler's
        bounded pool: log recovery and producer-state rebuild), then replay consumer groups.

        ``client_port`` is the bound client port (default: ``broker_port``); it names the broker. ``clock``
        defaults to the real clocks (:class:`Clock`).

        Raises:
            LogDirLockedError, UnsupportedFormatError, CorruptLogError, ManifestError: startup must stop.
        """
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        log_dir = await loop.run_in_executor(None, open_log_dir, Path(config.log_dir))
        try:
            broker = cls(config, log_dir, metrics, client_port=client_port, clock=clock)
        except BaseException:
            log_dir.close()
            raise
        try:
            broker.writer.start()
            await broker.metadata.start()
            broker._take_roles()  # replicas opened during the replay take the roles of the latest state
            count = await broker.reconciler.start(broker.metadata.state)
            if broker.replication is not None:
                await broker.replication.start()
            await broker._open_coordinator()
            broker.events.start()
            broker.not_ready_reasons["transactions"] = "recovering"
            if broker.replication is not None:
                broker.replication.server.txn_handler = broker.transactions.serve_txn_record
            await broker.transactions.open()
            broker.not_ready_reasons.pop("transactions", None)
            await broker._resume_topic_cleanup()
        except BaseException:
            await broker.events.close()
            await broker.transactions.close()
            if broker.replication is not None:
                await broker.replication.close()
            await broker.metadata.stop()
            log_dir.close()
            raise
        elapsed_ms = (time.monotonic() - started) * 1000
        log.info("recovered %d partitions in %.0f ms (%s)", count, elapsed_ms, "new data directory" if count == 0
                 and not log_dir.clean_shutdown else f"clean shutdown: {log_dir.clean_shutdown}")
        broker.not_ready_reasons.pop("recovery", None)
        return broker

    async def _resume_topic_cleanup(self) -> None:
        """Startup, after groups and transactions are open: finish interrupted TRUNCATEs (their topics stay
        fenced until then) and drop the transaction references of topics deleted before a crash (the
        coordinator's replay already tombstoned their groups)."""
        gone = {t for entry in self.transactions.entries.values() for t, _ in entry.partitions} | {
            t for entry in self.transactions.entries.values() for t, _, _ in entry.offsets}
        for topic in sorted(gone - set(self.metadata.names())):
            await self.topic_state.drop(topic, "delete")
        if await self.reconciler.resume_resets():
            log.warning("a truncated topic stays unavailable: its cleanup is retried every %d ms",
                        self.config.topic_cleanup_retry_interval_ms)

    # ------------------------------------------------------------------------------- group coordinator

    async def _open_group_log(self) -> GroupLog:
        """The coordinator's ``open_log``: the metadata log in a cluster, ``__consumer_offsets`` standalone."""
        if self.raft_group_log is not None:
            return self.raft_group_log
        return await group_log.open_offsets_log(self)

    async def _open_coordinator(self) -> None:
        """Open (replay) the group coordinator: standalone from ``__consumer_offsets``, in a cluster from the
        applied metadata state (every broker holds every group and serves those it owns)."""
        await self.coordinator.open()

    def _owns_group(self, group: str) -> bool:
        """Does this broker coordinate ``group`` in the applied metadata state?"""
        return self.coordinator_id(group) == self.broker_id

    def _groups_follow_ownership(self, old: MetadataState, new: MetadataState) -> None:
        """Metadata listener (cluster): when the active brokers change, groups whose owner on the ring
        became this broker are taken over (fresh sessions, reconciled with the topics). Groups that moved
        away need nothing: their sessions are no longer timed here, and the metadata log refuses any
        record this broker still submits for them."""
        before, after = old.active_brokers(), new.active_brokers()
        if before == after:
            return
        gained = [name for name in self.coordinator.table.groups
                  if new.group_coordinator(name) == self.broker_id
                  and old.group_coordinator(name) != self.broker_id]
        if gained:
            self._spawn_group_task(self._take_groups(gained))

    async def _take_groups(self, names: list[str]) -> None:
        async with self._group_sync:
            await self.coordinator.take_ownership(names)

    def _spawn_group_task(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._group_tasks.add(task)
        task.add_done_callback(self._group_task_done)

    def coordinator_id(self, group: str | None = None) -> str | None:
        """The broker that coordinates ``group``: standalone this one; in a cluster the owner of the group
        on the consistent-hash ring of the active brokers in the applied (committed) metadata (facts B7
        ``ring.Get(group)``), None when no broker is active."""
        state = self.metadata.state
        if not state.cluster or group is None:
            return self.broker_id
        return state.group_coordinator(group)

    async def route_group(self, group: str | None = None) -> None:
        """Group commands run on the group's coordinator: return when it is this broker, else redirect.
        ``group`` None (LIST_GROUPS): every broker holds every group, so any broker answers.

        Raises:
            BrokerError: ``NOT_COORDINATOR host= port=`` (another broker coordinates the group);
                ``coordinator_not_available`` (retryable: no active broker owns it right now).
        """
        coordinator = self.coordinator_id(group)
        if coordinator == self.broker_id:
            return
        host, _, port = self.broker_address(coordinator).rpartition(":")
        if not host:
            raise BrokerError.of("coordinator_not_available", reason="the group has no coordinator right now")
        raise BrokerError.of("NOT_COORDINATOR", host=host, port=port)

    # ------------------------------------------------------------------- local replicas (reconciler)

    def open_partition(self, topic: str, partition: int) -> OpenedPartition:
        """Blocking (the reconciler's pool, never the loop): recover one partition's log and rebuild its
        producer state. Raises CorruptLogError / OSError.

        A cluster replica of a replicated partition (replication factor > 1) whose log is corrupt is
        repaired (:meth:`_repair_replica`) instead of failing; standalone, or with a single replica, the
        CorruptLogError is raised (one copy cannot be repaired: fail closed)."""
        directory = self.log_dir.partition_dir(topic, partition)
        directory.mkdir(parents=True, exist_ok=True)
        config = self.internal_log_config if is_internal_topic(topic) else self.log_config
        try:
            plog = PartitionLog.open(directory, config, clean_shutdown=self.log_dir.clean_shutdown)
        except CorruptLogError as exc:
            plog = self._repair_replica(topic, partition, directory, config, exc)
        return plog, self._rebuild_producer_state(directory, plog)

    def _repair_replica(self, topic: str, partition: int, directory: Path, config: LogConfig,
                        error: CorruptLogError) -> PartitionLog:
        """Blocking: the log of a cluster replica failed to open with ``error``. Quarantine the damaged bytes
        and cut the log to its last valid chunk (:func:`cursus.storage.repair.truncate_to_last_valid_chunk`),
        then open it (unclean path). The replica's log may now end below the committed HWM: made leader it
        fails closed (``storage_unavailable``) and hands over; as a follower it re-fetches the rest from the
        leader, and the leader shrinks it out of the ISR at its first fetch below the committed HWM
        (docs/cluster.md "Repair of a corrupted replica"). Raises ``error`` when repair is not allowed
        (standalone, a single replica) or finds nothing to cut; CorruptLogError / OSError when it fails."""
        state = self.metadata.state
        assignment = state.assignment(topic, partition)
        if not state.cluster or assignment is None or len(assignment.replicas) < 2:
            raise error
        for _ in range(3):  # every repair strictly lowers the end of the log; a second one is unexpected
            log.error("%s/%d: replica log is corrupt (%s); repairing it from the leader: the damaged bytes are "
                      "quarantined and the log is cut to its last valid chunk", topic, partition, error)
            report = truncate_to_last_valid_chunk(directory)
            if report is None:
                raise error
            self.metrics.replica_repairs.inc()
            log.error("%s/%d: REPAIRED replica: damage in %s at byte position %s (offset %d: %s); the log now ends "
                      "at offset %d and re-fetches the rest from the leader; evidence in %s", topic, partition,
                      report.path, report.position, report.offset, report.reason, report.offset, report.quarantine)
            try:
                return PartitionLog.open(directory, config, clean_shutdown=False)
            except CorruptLogError as again:
                error = again
        raise error

    def install_replica(self, topic: str, partition: int, opened: OpenedPartition) -> None:
        """Loop: serve an opened partition as a local replica."""
        plog, producers = opened
        replica = Replica(topic, partition, plog, self.writer, broker_id=self.broker_id)
        replica.on_leader_ready = self._leader_ready
        if isinstance(self.metadata, RaftMetadata):  # cluster: reads need this broker's heartbeat lease
            replica.lease = self.metadata.controller.lease_valid
        self.hwm_committer.attach(replica)
        # The role and leader epoch come from the partition's assignment (standalone: this broker leads
        # every partition with a one-member ISR, epoch 0 as the reference reports).
        assignment = self.metadata.state.assignment(topic, partition)
        if assignment is None:
            replica.become_leader(plog.leader_epoch)
        else:
            self._take_role(replica, assignment)
        self.replicas[(topic, partition)] = replica
        self.producers[(topic, partition)] = producers
        self.metrics.observe_replica(replica)
        self.metrics.partitions.set(len(self.replicas))
        if self.replication is not None:  # a new follower starts fetching at once
            self.replication.fetchers.schedule_refresh()

    def _take_role(self, replica: Replica, assignment: PartitionAssignment) -> None:
        """Lead or follow as ``assignment`` says (a leaderless partition keeps its current role). In a
        cluster the leader takes the assignment's ISR and committed HWM (its visible HWM); standalone
        leads a one-member ISR and commits locally.

        While the metadata is not :attr:`~cursus.metadata.backend.Metadata.replayed` (a restarting cluster
        node passing through its snapshot and journal, states maybe older than its local data) the replica
        stays ``OPENED``: no role, nothing served, fetched or truncated; :meth:`_take_roles` applies the
        latest state once it is."""
        if not self.metadata.replayed:
            return
        replica.lifecycle_epoch = assignment.lifecycle_epoch
        try:
            if assignment.leader == self.broker_id:
                if self.metadata.state.cluster:
                    isr = assignment.isr if self.broker_id in assignment.isr else (self.broker_id, *assignment.isr)
                    replica.become_leader(assignment.leader_epoch, isr, committed_hwm=assignment.committed_hwm)
                    if replica.unavailable is not None:
                        self._spawn_group_task(self._step_down(replica, assignment))
                else:
                    replica.become_leader(assignment.leader_epoch)
            elif assignment.leader is not None:
                replica.become_follower(assignment.leader_epoch, assignment.leader,
                                        committed_hwm=assignment.committed_hwm if self.metadata.state.cluster else None)
                if replica.role is Role.FOLLOWER:  # committed: safe to expose (clamped to the local LEO)
                    replica.advance_hwm(assignment.committed_hwm)
        except TransitionRefused as exc:
            log.warning("%s/%d keeps its role: %s", replica.topic, replica.partition, exc)

    async def _step_down(self, replica: Replica, assignment: PartitionAssignment) -> None:
        """This broker was made leader but its log ends below the committed HWM (it fails closed): hand the
        partition to another active ISR member (which holds the committed records), once per epoch, after a
        short pause so a cluster-wide problem does not turn into an election storm. Then this replica
        follows and fetches what it lacks."""
        await asyncio.sleep(self.config.replica_fetch_backoff_ms / 1000.0 * 5)
        state = self.metadata.state
        current = state.assignment(replica.topic, replica.partition)
        if current is None or current.leader != self.broker_id or current.leader_epoch != assignment.leader_epoch:
            return
        targets = [b for b in current.isr if b != self.broker_id and b in state.brokers
                   and state.brokers[b].status == "active"]
        if not targets:
            log.error("%s/%d: no other in-sync replica to take over; the partition stays unavailable",
                      replica.topic, replica.partition)
            return
        try:
            await self.metadata.submit(ElectLeader(uuid.uuid4().hex, replica.topic, replica.partition, targets[0],
                                                   expected_leader_epoch=current.leader_epoch))
            log.warning("%s/%d: handed leadership to %s (local log below the committed HWM)",
                        replica.topic, replica.partition, targets[0])
        except Exception as exc:
            log.warning("%s/%d: stepping down failed: %s", replica.topic, replica.partition, exc)

    def _leader_ready(self, replica: Replica, producers: ProducerStateTable) -> None:
        """A new cluster leader finished preparing: its producer state, rebuilt from its log (replicated
        chunks included, truncated tail excluded), becomes the partition's table (a retried batch after
        failover is a duplicate with its original offsets)."""
        key = (replica.topic, replica.partition)
        if self.replicas.get(key) is replica:
            self.producers[key] = producers
            self.transactions.on_leader_ready(replica)

    def _take_roles(self) -> None:
        """Every local replica takes the role of its assignment in the latest state (startup, once the
        metadata is replayed)."""
        state = self.metadata.state
        for key, replica in list(self.replicas.items()):
            assignment = state.assignments.get(key)
            if assignment is not None:
                self._take_role(replica, assignment)

    def _follow_leadership(self, old: MetadataState, new: MetadataState) -> None:
        """Metadata listener: local replicas whose assignment changed take their new role."""
        for key, replica in list(self.replicas.items()):
            assignment = new.assignments.get(key)
            if assignment is not None and assignment is not old.assignments.get(key):
                self._take_role(replica, assignment)

    def _groups_follow_topics(self, old: MetadataState, new: MetadataState) -> None:
        """Metadata listener: a topic created or grown by *any* broker's CREATE (applied here through the
        metadata log) reaches this broker's consumer groups, which take the new partitions. Only the broker
        whose coordinator is ready acts (:meth:`GroupCoordinator.on_topic_changed` is a no-op elsewhere and
        idempotent, so the local CREATE path calling it too is harmless)."""
        for name, defn in new.topics.items():
            before = old.topics.get(name)
            if before is None or before.partitions != defn.partitions:
                self._spawn_group_task(self._topic_changed(defn))
        if new.cluster:  # a DELETE on another broker: the groups this broker owns drop the topic too
            for name in old.topics.keys() - new.topics.keys():
                self._spawn_group_task(self._topic_deleted(name))

    async def _topic_deleted(self, name: str) -> None:
        async with self._group_sync:
            await self.coordinator.on_topic_deleted(name)

    async def _drop_group_state(self, name: str, reason: str) -> None:
        """The ``groups`` topic-state dropper: after a DELETE one-topic groups of ``name`` get a tombstone and
        multi-topic groups drop it (their offsets of it are cleared); after a TRUNCATE the same, then
        multi-topic groups take the (now empty) topic again with no committed offsets. Only groups this
        broker coordinates change; idempotent. Raises the group log's BrokerError."""
        async with self._group_sync:
            if reason == "truncate":
                self.coordinator.deleting.add(name)  # the topic is left out of every expansion once
            await self.coordinator.on_topic_deleted(name)
            defn = self.metadata.get(name)
            if reason == "truncate" and defn is not None:
                await self.coordinator.on_topic_changed(defn)

    def _group_task_done(self, task: asyncio.Task[None]) -> None:
        self._group_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("consumer groups did not take a topic change: %s", task.exception())

    @staticmethod
    def discard_opened(opened: OpenedPartition) -> None:
        """Blocking: close a partition opened for a topic that was deleted meanwhile."""
        opened[0].close()

    def detach_topic(self, name: str) -> list[Replica]:
        """Loop: drop the topic's local replicas (appends refused, waiters failed, long polls woken). When
        the committed metadata still names the topic (a TRUNCATE; a DELETE and re-CREATE applied at once)
        the replicas are *replaced*: their waiters and requests answer the retryable
        ``leader_not_available`` (``outcome=unknown`` for unacknowledged writes), ``topic_not_found`` only
        when the topic is gone (:meth:`Replica.removed_error`)."""
        replaced = self.metadata.get(name) is not None
        replicas = [r for (topic, _), r in self.replicas.items() if topic == name]
        for replica in replicas:
            del self.replicas[(name, replica.partition)]
            self.producers.pop((name, replica.partition), None)
            self.hwm_committer.detach(replica)
            replica.on_deleted(replaced=replaced)
            self.metrics.forget_partition(name, replica.partition)
        self.metrics.forget_topic(name)
        self.metrics.partitions.set(len(self.replicas))
        return replicas

    def _rebuild_producer_state(self, directory: Path, plog: PartitionLog) -> ProducerStateTable:
        """The loop's copy of the producer state the log rebuilt at open (its last snapshot plus the chunks
        after it, see :mod:`cursus.storage.producer_state`)."""
        stats = plog.recovery_stats
        if stats.producer_chunks_replayed:
            log.info("%s: producer state from the snapshot at offset %d plus %d chunks", directory,
                     stats.producer_snapshot_offset, stats.producer_chunks_replayed)
        return ProducerStateTable.copy_of(plog.producer_state)

    def begin_shutdown(self) -> None:
        """Run the shutdown callbacks once: every active STREAM ends with ``reason=stopped``.

        Call it before closing client connections (:meth:`close` calls it too, as a fallback).
        """
        if self._shutting_down:
            return
        self._shutting_down = True
        for stream in list(self.streams):
            stream.stop("stopped")
        for callback in list(self.on_shutdown):
            try:
                callback()
            except Exception:
                log.exception("shutdown callback failed")

    async def close(self) -> None:
        """Drain the writer (every pending append fsynced), checkpoint and close every log."""
        self.begin_shutdown()
        await self.stall_probe.stop()
        if self.replication is not None:  # no fetch is served or sent from here on
            await self.replication.close()
        await self.events.close()  # index checkpoints (on the offload threads)
        await self.loop.run_in_executor(None, self.offload.close)  # no read in flight when the logs close
        await self.loop.run_in_executor(None, self.cleaner.close)  # no pass in flight when the logs close
        for task in list(self._group_tasks):
            task.cancel()
        await asyncio.gather(*self._group_tasks, return_exceptions=True)
        await self.transactions.close()
        await self.coordinator.close()
        await self.hwm_committer.close()
        await self.reconciler.close()
        await self.loop.run_in_executor(None, self.writer.close)
        await self.metadata.stop()
        for replica in self.replicas.values():
            replica.log.close()  # writes the producer-state snapshot at the LEO
        failed = any(r.fenced is not None for r in self.replicas.values())
        if not failed:
            self.log_dir.mark_clean_shutdown()
        self.log_dir.close()

    # ------------------------------------------------------------------------------ writer thread glue

    def _notify_from_writer_thread(self, completions: list[Completion]) -> None:
        try:
            self.loop.call_soon_threadsafe(self._apply_completions, completions)
        except RuntimeError:
            pass  # loop closed during shutdown; nothing is waiting any more

    def _written_from_writer_thread(self, tokens: list[object]) -> None:
        # Only leaders that someone listens to (followers' long polls) need the wake-up: a standalone
        # publish does not wake the loop twice per fsync.
        tokens = [token for token in tokens if not isinstance(token, Replica) or token.wants_written]
        if not tokens:
            return
        try:
            self.loop.call_soon_threadsafe(self._apply_written, tokens)
        except RuntimeError:
            pass  # loop closed during shutdown

    @staticmethod
    def _apply_written(tokens: list[object]) -> None:
        for token in tokens:
            if isinstance(token, Replica):
                token.on_written()

    def _apply_completions(self, completions: list[Completion]) -> None:
        for c in completions:
            token = c.token
            if isinstance(token, Replica):
                if c.error is not None:
                    log.error("storage failure on %s/%d: %s", token.topic, token.partition, c.error)
                    token.on_failure(c.error)
                    self.not_ready_reasons["storage"] = f"{token.topic}/{token.partition}: {c.error}"
                else:
                    token.on_durable(c.durable_end_offset)
            elif isinstance(token, asyncio.Future):
                if token.done():
                    continue
                if c.error is not None:
                    token.set_exception(c.error)
                else:
                    token.set_result(c.result)

    async def run_blocking(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the writer thread, in order with appends, and await its result."""
        fut: asyncio.Future[Any] = self.loop.create_future()
        self.writer.submit_call(fn, fut)
        return await fut

    # ---------------------------------------------------------------------------------------- lookups

    def topic(self, name: str) -> TopicDefinition:
        """The definition of ``name``. Raises BrokerError ``topic_not_found``."""
        defn = self.metadata.get(name)
        if defn is None:
            raise BrokerError.of("topic_not_found", topic=name)
        return defn

    def replica(self, topic: str, partition: int) -> Replica:
        """The local replica, when this broker leads the partition.

        Raises:
            BrokerError: ``partition_not_found`` when the metadata has no such partition; ``NOT_LEADER
                leader=<host:port>`` (retryable) when another broker leads it;
                ``leader_not_available`` (retryable) when it is assigned but no local replica serves it
                (still opening, or placed on another broker); ``storage_unavailable`` when this broker leads
                it but its local log ends below the committed HWM (fails closed, never serves).
        """
        assignment = self.metadata.state.assignment(topic, partition)
        if assignment is None:
            raise BrokerError.of("partition_not_found", topic=topic, partition=partition)
        if assignment.leader != self.broker_id:
            address = self.broker_address(assignment.leader)
            if address:
                raise BrokerError.of("NOT_LEADER", topic=topic, partition=partition, leader=address)
            raise BrokerError.of("leader_not_available", topic=topic, partition=partition,
                                 reason="the partition has no leader")
        replica = self.replicas.get((topic, partition))
        if replica is None:
            raise BrokerError.of("leader_not_available", topic=topic, partition=partition,
                                 reason="no local replica of this partition is open")
        if replica.unavailable is not None:  # fails closed: its log ends below the committed HWM
            raise replica.unavailable
        return replica

    def producer_table(self, topic: str, partition: int) -> ProducerStateTable:
        return self.producers[(topic, partition)]

    def leader_address(self) -> str:
        """This broker's advertised client address ``host:port``."""
        return f"{self.config.advertised}:{self.client_port}"

    def broker_address(self, broker_id: str | None) -> str:
        """The client address of a registered broker (empty when unknown or None)."""
        info = self.metadata.state.brokers.get(broker_id) if broker_id is not None else None
        return info.client_address if info is not None else ""

    # --------------------------------------------------------------------------------- topic changes

    async def _submit(self, command: Command) -> ApplyResult:
        """Commit ``command`` and wait until every local partition of its topic is open."""
        result = await self.metadata.submit(command)
        if result.topic is not None:
            defn = result.topic
            await self.reconciler.wait_open((defn.name, p) for p in range(defn.partitions))
        self.metrics.topics.set(len(self.metadata.names()))
        return result

    async def _topic_changed(self, defn: TopicDefinition) -> None:
        async with self._group_sync:
            await self.coordinator.on_topic_changed(defn)

    async def create_topic(self, spec: TopicSpec) -> TopicDefinition:
        """CREATE (new topic or presence-aware patch): committed, local partitions open, groups updated.

        Raises:
            BrokerError: CREATE validation errors; ``resource_exhausted`` when the new partitions' files
                would not fit under the open-file limit; ``create_topic_failed`` when the commit or a
                partition open fails, or while storage of a deleted topic of that name could not be removed
                yet.
        """
        name = spec.topic
        if self.metadata.get(name) is None and await self.retry_cleanup_of(name):
            raise BrokerError.of("create_topic_failed", topic=name, cleanup_pending=True,
                                 reason="storage of a deleted topic of this name is not removed yet")
        current = self.metadata.get(name)
        wanted = spec.partitions or (current.partitions if current else self.config.default_partitions)
        # Refuse before the commit a topic whose partitions' files would not fit (else it is committed,
        # cannot be opened, and every restart fails with EMFILE). Conservative in a cluster: every new
        # partition is counted as local.
        check_partition_headroom(wanted - (current.partitions if current else 0),
                                 reserve=self.config.max_client_connections + FD_RESERVE)
        if self.metadata.state.cluster and spec.cleanup_policy is not None and is_compacted_policy(spec.cleanup_policy):
            # every active broker must advertise the lifecycle protocol of distributed compaction (spec
            # "ALTER_TOPIC_CONFIG"): unsupported_topic_policy otherwise
            require_lifecycle_protocol(self.metadata.state, "compaction", version=LIFECYCLE_COMPACTION)
        command = CreateTopic(uuid.uuid4().hex, spec, self.config.default_partitions, self.config.log_cleanup_policy,
                              default_replication_factor=self.config.default_replication_factor)
        try:
            result = await self._submit(command)
        except OSError as exc:
            raise BrokerError.of("create_topic_failed", topic=name, reason=str(exc)) from exc
        assert result.topic is not None
        if result.changed:
            await self._topic_changed(result.topic)
        return result.topic

    async def alter_min_isr(self, name: str, override: int | None) -> TopicDefinition:
        """ALTER_TOPIC_CONFIG: set (or clear, None) the min-ISR override.

        Raises:
            BrokerError: ``topic_not_found``, ``invalid_min_in_sync_replicas``, ``alter_topic_config_failed``.
        """
        try:
            result = await self._submit(AlterTopicConfig(uuid.uuid4().hex, name, override))
        except OSError as exc:
            raise BrokerError.of("alter_topic_config_failed", topic=name, reason=str(exc)) from exc
        assert result.topic is not None
        return result.topic

    async def apply_definition(self, defn: TopicDefinition) -> None:
        """Commit ``defn`` (a broker-owned topic), open its local partitions, then let consumer groups
        subscribed to it take new partitions (durably; they rebalance). Raises OSError, BrokerError."""
        result = await self._submit(PutTopic(uuid.uuid4().hex, defn))
        if result.changed:
            await self._topic_changed(defn)

    async def delete_topic(self, name: str) -> bool:
        """Remove ``name``: the metadata commit first (raises OSError, topic stays), then the node-local state
        (:attr:`topic_state`: groups, transactions, ...) and storage (the reconciler moves the folder to the
        trash).

        Returns True when a cleanup step failed after the commit (``cleanup_pending``): CREATE of the name is
        refused until a retry succeeds (``DELETE if_exists=true``, CREATE, the periodic retry, a restart).

        Raises:
            BrokerError: ``topic_not_found``; ``topic_delete_blocked`` while a consumer group with members
                subscribes to the topic or an open/committing transaction references it (checked before
                anything changes); after the commit inactive groups lose the topic (one-topic groups get a
                tombstone, their offsets go).
        """
        self.transactions.check_topic_deletable(name)
        self.coordinator.check_topic_deletable(name)
        try:
            await self.metadata.submit(DeleteTopic(uuid.uuid4().hex, name))
        except BaseException:
            self.coordinator.topic_delete_aborted(name)
            raise
        crash_point("delete_after_commit")
        try:
            pending = await self.topic_state.drop(name, "delete")
            return await self.reconciler.removal(name) or pending
        finally:
            self.metrics.topics.set(len(self.metadata.names()))

    def _truncate_preflight(self, name: str) -> None:
        """TRUNCATE's preflight, DELETE's rules with TRUNCATE's code: ``topic_truncate_blocked`` while a group
        with members subscribes to ``name`` or an open/committing transaction references it."""
        try:
            self.transactions.check_topic_deletable(name)
            self.coordinator.check_topic_deletable(name)
        except BrokerError as exc:
            if exc.error.code != "topic_delete_blocked":
                raise
            raise BrokerError.of("topic_truncate_blocked", **exc.error.fields) from None

    async def truncate_topic(self, name: str, expected_revision: int) -> tuple[TopicDefinition, bool]:
        """TRUNCATE (spec "TRUNCATE"): keep the definition; revision and lifecycle epoch + 1; every partition
        back to LEO = HWM = 0. The new epoch is committed first (standalone: the manifest; a cluster: one
        Raft TOPIC_TRUNCATE that also advances the leader epochs); then each replica's storage is reset by
        the reconciler (fenced meanwhile) and the node-local state dropped (:attr:`topic_state`).

        Returns the new definition and whether a node-local cleanup step failed (``cleanup_pending``: the
        topic stays fenced on this node until a retry succeeds).

        Raises:
            BrokerError: ``internal_topic_delete_forbidden`` (broker-owned topics), ``topic_not_found``,
                ``version_conflict`` (``expected_revision`` is not the revision), ``topic_truncate_blocked``
                (active group members, an open/committing transaction), ``unsupported_topic_policy`` (an
                active broker does not advertise lifecycle protocol 1), ``truncate_topic_failed`` (the commit
                failed: nothing changed).
        """
        if is_internal_topic(name):
            raise BrokerError.of("internal_topic_delete_forbidden", topic=name, command="TRUNCATE")
        defn = self.topic(name)
        if defn.revision != expected_revision:
            raise BrokerError.of("version_conflict", topic=name, expected_revision=expected_revision,
                                 revision=defn.revision)
        self._truncate_preflight(name)
        try:
            result = await self.metadata.submit(TruncateTopic(uuid.uuid4().hex, name, expected_revision))
        except OSError as exc:
            raise BrokerError.of("truncate_topic_failed", topic=name, reason=str(exc)) from exc
        finally:
            self.coordinator.topic_delete_aborted(name)  # subscriptions to the topic are allowed again
        crash_point("truncate_after_commit")
        assert result.topic is not None
        # the reconciler (on every replica: the same path in a cluster) drops the topic state, resets the
        # storage and reopens the partitions
        return result.topic, await self.reconciler.reset_done(name)

    async def drop_topic_state(self, name: str) -> bool:
        """The reconciler's hook before a truncated topic's storage is reset: drop its node-local state
        (:attr:`topic_state`); True when a dropper failed or the group coordinator is not open yet (a node
        replaying its metadata log at startup): the reset then waits for a retry."""
        if not self.coordinator.ready:
            return True
        return await self.topic_state.drop(name, "truncate")

    async def retry_cleanup_of(self, name: str) -> bool:
        """Retry the pending node-local cleanup of deleted topic ``name`` (storage, then the topic state);
        True while something is still pending (CREATE of the name is refused meanwhile)."""
        pending = await self.reconciler.retry_cleanup(name)
        if self.topic_state.pending_for(name) and name not in self.metadata.names():
            await self.topic_state.retry()
        return pending or self.topic_state.pending_for(name)

    async def retry_topic_cleanup(self) -> int:
        """Periodic (``topic_cleanup_retry_interval_ms``): retry every pending storage reset or removal and
        every failed topic-state dropper; return how many are still pending (``cursus_topic_cleanup_pending``)."""
        failed_before = len(self.topic_state.pending)
        if failed_before:
            self.metrics.topic_cleanup_retries_total.inc(failed_before)
        pending = await self.reconciler.retry_pending() + await self.topic_state.retry()
        self.metrics.topic_cleanup_pending.set(pending)
        return pending

    async def enforce_retention(self) -> int:
        """Delete whole closed segments past time or size retention; return segments deleted.

        Limits: the topic's ``retention_hours``/``retention_bytes`` when non-zero, else the broker's
        ``log_retention_ms`` (if >= 0) or ``log_retention_hours``, and ``log_retention_bytes``; -1 keeps all.
        Event-sourcing topics do not inherit the broker's defaults (only their own non-zero retention deletes
        events; READ_STREAM then answers ``stream_retention_gap`` rather than a gapped stream).
        Time is each segment's last chunk append time. The active segment is never deleted.
        """
        deleted = 0
        stamp = self.clock.wall_ms()
        for (topic, _), replica in list(self.replicas.items()):
            defn = self.metadata.get(topic)
            if defn is None or replica.fenced is not None or is_internal_topic(topic):
                continue  # broker-owned topics have unlimited retention (compaction bounds them)
            if defn.policy.cleanup_policy == "compact":
                continue  # compact only: the cleaner bounds it, retention never deletes segments
            retention_ms = self._retention_ms(defn)
            retention_bytes = defn.policy.retention_bytes or (
                -1 if defn.event_sourcing else self.config.log_retention_bytes)
            segments = replica.log.segments_info()
            closed = [s for s in segments if not s.is_active]
            total = sum(s.size_bytes for s in segments)
            cut = None
            for seg in closed:
                appended_ms = seg.last_append_time_ms
                expired = retention_ms >= 0 and appended_ms is not None and stamp - appended_ms > retention_ms
                oversize = retention_bytes >= 0 and total > retention_bytes
                if not (expired or oversize):
                    break
                total -= seg.size_bytes
                cut = seg.next_offset
            if cut is None or cut <= replica.log_start_offset:
                continue
            cut = min(cut, replica.hwm)  # never drop records consumers could not read yet
            count = await self.run_blocking(functools.partial(replica.log.delete_segments_before, cut))
            deleted += int(count or 0)
            self.metrics.retention_deletions_total.inc(int(count or 0))
        return deleted

    def _retention_ms(self, defn: TopicDefinition) -> int:
        if defn.policy.retention_hours > 0:
            return defn.policy.retention_hours * 3_600_000
        if defn.event_sourcing:
            return -1  # streams keep their whole history: only a topic's own retention deletes events
        if self.config.log_retention_ms >= 0:
            return self.config.log_retention_ms
        hours = self.config.log_retention_hours
        return -1 if hours < 0 else hours * 3_600_000

    def expire_producers(self) -> int:
        """Drop idempotent-producer state idle longer than ``producer_state_ttl_ms``; return entries dropped."""
        stamp = self.clock.wall_ms()
        return sum(table.expire(stamp) for table in self.producers.values())
