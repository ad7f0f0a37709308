"""Prometheus metrics of one broker, with the reference broker's names (facts B9) where they apply.

Each broker owns its own :class:`prometheus_client.CollectorRegistry`, so several brokers in one process
(tests) never share counters.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.values import MutexValue

if TYPE_CHECKING:
    from cursus.broker.replica import Replica

_Family = TypeVar("_Family", bound=MetricWrapperBase)

WIRE_FAILURE_REASONS = (
    "invalid_frame", "frame_too_large", "checksum_mismatch", "compression_mismatch", "decompression_rejected",
    "unknown",
)

#: Labels of ``cursus_auth_failures_total``: unknown principal or wrong token (one reason: which of the two
#: is never revealed), and a request with only one of principal / token.
AUTH_FAILURE_REASONS = ("bad_credentials", "incomplete_credentials")


class _LoopCounter:
    """A counter child's value, incremented without its lock: one Python call per ``inc`` instead of five
    (validation, observability check, lock enter and exit). Only for children written by one thread, the
    event loop's (the scrape thread reads the float under the lock; a single writer loses nothing)."""

    __slots__ = ("_value",)

    def __init__(self, child: Counter) -> None:
        self._value: MutexValue = child._value

    def inc(self, amount: float = 1) -> None:
        """Add ``amount`` (>= 0, not checked)."""
        self._value._value += amount


class _LoopHistogram:
    """A histogram child observed without its locks (see :class:`_LoopCounter`): the sum and the one
    bucket ``amount`` falls in (``amount <= upper bound``, found by bisection)."""

    __slots__ = ("_sum", "_buckets", "_bounds")

    def __init__(self, child: Histogram) -> None:
        self._sum: MutexValue = child._sum
        self._buckets: list[MutexValue] = child._buckets
        self._bounds: list[float] = child._upper_bounds

    def observe(self, amount: float) -> None:
        """Count one observation of ``amount`` (seconds for the duration histograms)."""
        self._sum._value += amount
        self._buckets[bisect_left(self._bounds, amount)]._value += 1


class BrokerMetrics:
    """All metric families of one broker."""

    def __init__(self) -> None:
        disable_created_metrics()  # no ``*_created`` series next to every counter and histogram
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, open fds
        self._children: dict[tuple[MetricWrapperBase, tuple[str, ...]], Any] = {}
        #: (topic, partition) -> the replica whose log start, LEO and HWM are exported at scrape time.
        self._replicas: dict[tuple[str, int], Replica] = {}
        #: topic -> its records-in and bytes-in counter children (:meth:`topic_in`).
        self._topic_in: dict[str, tuple[Counter, Counter]] = {}
        self.connections_total = Counter(
            "cursus_broker_client_connections_total", "Client connections accepted.", registry=r)
        self.connections_active = Gauge(
            "cursus_broker_client_connections_active", "Client connections open now.", registry=r)
        self.commands_total = Counter(
            "cursus_broker_commands_total", "Commands handled, by command and result.", ["command", "result"],
            registry=r)
        self.command_errors_total = Counter(
            "cursus_broker_command_errors_total", "Typed error replies, by command and code.", ["command", "code"],
            registry=r)
        self.command_duration = Histogram(
            "cursus_broker_command_duration_seconds", "Command handling latency.", ["command"], registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.publish_acks_total = Counter(
            "cursus_broker_publish_acknowledgements_total", "PUBLISH outcomes by ack mode.", ["ack_mode", "result"],
            registry=r)
        self.wire_failures_total = Counter(
            "cursus_wire_protocol_failures_total", "Connections closed for malformed frames, by reason.", ["reason"],
            registry=r)
        for reason in WIRE_FAILURE_REASONS:
            self.wire_failures_total.labels(reason)
        self.auth_failures_total = Counter(
            "cursus_auth_failures_total",
            "Failed authentications (AUTH or inline principal=/auth_token=), by reason.", ["reason"], registry=r)
        for reason in AUTH_FAILURE_REASONS:
            self.auth_failures_total.labels(reason)
        self.retention_deletions_total = Counter(
            "cursus_storage_retention_deleted_segments_total", "Segments deleted by retention.", registry=r)
        self.cleaner_runs_total = Counter(
            "cursus_broker_log_compaction_runs_total", "Log cleaner passes, by result and trigger.",
            ["result", "reason"], registry=r)
        self.cleaner_bytes_read_total = Counter(
            "cursus_log_cleaner_bytes_read_total", "Chunk bytes the log cleaner read.", registry=r)
        self.cleaner_bytes_cleaned_total = Counter(
            "cursus_log_cleaner_bytes_cleaned_total", "Bytes the log cleaner removed from compacted segments.",
            registry=r)
        self.cleaner_last_run_seconds = Gauge(
            "cursus_log_cleaner_last_run_duration_seconds", "Duration of the last log cleaner pass.", registry=r)
        self.cleaner_dirty_ratio = Gauge(
            "cursus_log_cleaner_dirty_ratio", "Share of a compacted partition's cleanable bytes not cleaned yet.",
            ["topic", "partition"], registry=r)
        self.cleaner_gated_total = Counter(
            "cursus_log_cleaner_gated_total",
            "Cleaner checks skipped because the cluster gate was closed (replica not in ISR, epoch mismatch).",
            registry=r)
        self.ready = Gauge("cursus_broker_ready", "1 when the broker is ready to serve.", registry=r)
        self.metadata_commit_seconds = Histogram(
            "cursus_cluster_metadata_commit_seconds", "Metadata command submit-to-applied latency through Raft.",
            registry=r, buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
        self.topic_records_in = Counter(
            "cursus_broker_topic_records_in_total", "Records appended by clients, by topic.", ["topic"], registry=r)
        self.topic_bytes_in = Counter(
            "cursus_broker_topic_bytes_in_total", "Record bytes appended by clients, by topic.", ["topic"], registry=r)
        self.topic_records_out = Counter(
            "cursus_broker_topic_records_out_total", "Records served to clients (CONSUME, STREAM), by topic.",
            ["topic"], registry=r)
        self.topic_bytes_out = Counter(
            "cursus_broker_topic_bytes_out_total", "Batch bytes served to clients (CONSUME, STREAM), by topic.",
            ["topic"], registry=r)
        self.replication_bytes = Counter(
            "cursus_cluster_replication_fetch_bytes_total",
            "Chunk bytes of replica fetches: out (served as leader) and in (appended as follower).",
            ["direction"], registry=r)
        self.isr_changes = Counter(
            "cursus_cluster_isr_changes_total", "ISR shrinks and expansions proposed by this broker as leader.",
            ["kind"], registry=r)
        self.replication_quarantined = Counter(
            "cursus_cluster_replica_quarantined_total",
            "Follower partitions that stopped fetching because the leader's bytes could not be appended.", registry=r)
        self.replication_stream_errors = Counter(
            "cursus_cluster_replication_stream_errors_total", "Fetch streams to a leader that broke and reopened.",
            registry=r)
        self.acks_all_wait = Histogram(
            "cursus_cluster_acks_all_wait_seconds",
            "acks=all PUBLISH: append to completion (every captured ISR member durable, committed HWM applied).",
            registry=r, buckets=(0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5, 10))
        for label in ("in", "out"):
            self.replication_bytes.labels(label)
        for label in ("shrink", "expand"):
            self.isr_changes.labels(label)
        self.topics = Gauge("cursus_broker_topics", "Topics known to the broker.", registry=r)
        self.partitions = Gauge("cursus_broker_partitions", "Partition replicas hosted.", registry=r)
        self.orphan_topics = Gauge(
            "cursus_topic_metadata_orphan_topics",
            "Deleted topics whose storage could not be moved away yet (CREATE of their names is refused).",
            registry=r)
        self.topic_cleanup_pending = Gauge(
            "cursus_topic_cleanup_pending",
            "Deleted or truncated topics whose node-local cleanup (storage, groups, transactions) failed and is "
            "retried every topic_cleanup_retry_interval_ms.", registry=r)
        self.topic_cleanup_retries_total = Counter(
            "cursus_topic_cleanup_retries_total", "Retries of a pending node-local topic cleanup.", registry=r)
        self.replica_repairs = Counter(
            "cursus_replica_repairs_total",
            "Cluster replicas whose log failed to open as corrupt and was cut to its last valid chunk (the damaged "
            "bytes quarantined under <partition>/quarantine/); the replica re-fetches the rest from the leader.",
            registry=r)
        self.partition_open_failures = Counter(
            "cursus_partition_open_failures_total",
            "Failed opens of a local partition replica: outcome=retry (retried after a backoff) or gave_up (left "
            "unopened after partition_open_max_attempts until a restart or a new topic generation).",
            ["outcome"], registry=r)
        r.register(_ReplicaOffsetsCollector(self._replicas))  # the three partition offset gauges
        self.loop_max_stall = Gauge(
            "cursus_event_loop_max_stall_seconds", "Worst lateness of the event loop seen by its stall probe.",
            registry=r)
        self.loop_stall = Histogram(
            "cursus_event_loop_stall_seconds", "Lateness of the event loop's stall probe, per wake-up.", registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))

    def child(self, family: _Family, *labels: str) -> _Family:
        """``family.labels(*labels)``, looked up once per label set (``labels()`` validates the values
        and takes a lock on every call; the request path asks for the same few children each time).
        Counter and histogram children come back as lock-free stand-ins (:class:`_LoopCounter`,
        :class:`_LoopHistogram`: ``inc(amount=1)`` / ``observe(amount)`` only) writing the same values, so
        callers must be on the event loop. Label values must come from a bounded set: commands, results,
        error codes, ack modes, topics (:meth:`forget_topic` drops a topic's)."""
        key = (family, labels)
        found = self._children.get(key)
        if found is None:
            found = family.labels(*labels)
            if isinstance(getattr(found, "_value", getattr(found, "_sum", None)), MutexValue):
                if isinstance(found, Counter):
                    found = _LoopCounter(found)
                elif isinstance(found, Histogram):
                    found = _LoopHistogram(found)
            self._children[key] = found
        return found  # type: ignore[return-value]

    def observe_replica(self, replica: Replica) -> None:
        """Export the replica's log start offset, LEO and HWM (``cursus_partition_*`` gauges, labels topic
        and partition). Read from the replica at scrape time: one registration per replica, nothing per
        HWM change; calling it again (a replaced replica of the same partition) re-points the series."""
        self._replicas[(replica.topic, replica.partition)] = replica

    def topic_in(self, topic: str, records: int, size_bytes: int) -> None:
        """Count an append of ``records`` (``size_bytes``) to ``topic`` (event loop only)."""
        found = self._topic_in.get(topic)
        if found is None:
            found = self._topic_in[topic] = (self.child(self.topic_records_in, topic),
                                             self.child(self.topic_bytes_in, topic))
        found[0].inc(records)
        found[1].inc(size_bytes)

    def topic_out(self, topic: str, records: int, size_bytes: int) -> None:
        """Count ``records`` (``size_bytes``) of ``topic`` served to a client."""
        if records:
            self.child(self.topic_records_out, topic).inc(records)
            self.child(self.topic_bytes_out, topic).inc(size_bytes)

    def forget_topic(self, topic: str) -> None:
        """Drop a deleted topic's per-topic series."""
        self._topic_in.pop(topic, None)
        for family in (self.topic_records_in, self.topic_bytes_in, self.topic_records_out, self.topic_bytes_out):
            self._children.pop((family, (topic,)), None)
            try:
                family.remove(topic)
            except KeyError:
                pass

    def forget_partition(self, topic: str, partition: int) -> None:
        """Stop exporting a removed partition replica's offset gauges."""
        self._replicas.pop((topic, partition), None)


class _ReplicaOffsetsCollector:
    """``cursus_partition_log_start_offset``, ``cursus_partition_log_end_offset`` (LEO) and
    ``cursus_partition_high_watermark`` (HWM) per hosted replica (labels topic, partition), read at scrape
    time from the replicas' int fields (the scrape thread only reads them; a copy of the registry is taken
    first, so the loop may add or drop replicas meanwhile)."""

    def __init__(self, replicas: dict[tuple[str, int], Replica]) -> None:
        self._replicas = replicas

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        labels = ["topic", "partition"]
        start = GaugeMetricFamily("cursus_partition_log_start_offset", "First retained offset.", labels=labels)
        end = GaugeMetricFamily("cursus_partition_log_end_offset", "Log end offset (LEO).", labels=labels)
        hwm = GaugeMetricFamily("cursus_partition_high_watermark", "High-water mark (HWM).", labels=labels)
        for (topic, partition), replica in sorted(self._replicas.copy().items()):
            key = [topic, str(partition)]
            start.add_metric(key, replica.log_start_offset)
            end.add_metric(key, replica.leo)
            hwm.add_metric(key, replica.hwm)
        yield from (start, end, hwm)


class GroupStateCollector:
    """Consumer-group and STREAM gauges, computed at scrape time (facts B9 names).

    Prometheus scrapes on the metrics server's thread; group state belongs to the event loop, so
    ``snapshot()`` hands the work to the loop (``run_coroutine_threadsafe``) and waits briefly for it.
    ``snapshot`` returns (list of GROUP_STATUS dicts, number of active streams).
    """

    def __init__(self, snapshot: Callable[[], tuple[list[dict[str, Any]], int]]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: families are produced at collect time

    def collect(self) -> Iterator[Metric]:
        try:
            groups, streams = self._snapshot()
        except Exception:  # the loop is busy or shutting down: skip this scrape's group gauges
            return
        members = GaugeMetricFamily("cursus_consumer_group_members", "Members per group.", labels=["group", "topic"])
        generation = GaugeMetricFamily("cursus_consumer_group_generation", "Group generation.",
                                       labels=["group", "topic"])
        committed = GaugeMetricFamily("cursus_consumer_group_committed_offset", "Committed next offset.",
                                      labels=["group", "topic", "partition"])
        lag = GaugeMetricFamily("cursus_consumer_group_lag", "HWM minus committed offset.",
                                labels=["group", "topic", "partition"])
        for status in groups:
            name, topic = status["group_name"], status["topic_name"]
            members.add_metric([name, topic], status["member_count"])
            generation.add_metric([name, topic], status["generation"])
            for entry in status["offsets"]:
                labels = [name, entry["topic"], str(entry["partition"])]
                if entry["committed_offset"] is not None:
                    committed.add_metric(labels, entry["committed_offset"])
                lag.add_metric(labels, entry["lag"])
        yield from (members, generation, committed, lag)
        yield GaugeMetricFamily("cursus_streams_active", "Open STREAM requests.", value=streams)


class ClusterCollector:
    """The Cluster group of facts B9, computed at scrape time from the committed metadata state (an
    immutable value, safe to read from the metrics thread) and this node's Raft status.

    ``state()`` returns the :class:`~cursus.metadata.state.MetadataState`; ``raft()`` the metadata
    backend's ``raft_status()`` (None standalone: only ``cursus_distribution_enabled 0`` is exported).
    """

    def __init__(self, state: Callable[[], Any], raft: Callable[[], dict[str, Any] | None]) -> None:
        self._state, self._raft = state, raft

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        raft = self._raft()
        enabled = GaugeMetricFamily("cursus_distribution_enabled", "1 when this broker runs in a cluster.")
        enabled.add_metric([], 0 if raft is None else 1)
        yield enabled
        if raft is None:
            return
        state = self._state()
        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc)
            family.add_metric([], value)
            return family

        yield gauge("cursus_cluster_brokers", "Active registered brokers.", len(state.active_brokers()))
        yield gauge("cursus_cluster_has_leader", "1 when a Raft leader is known.", 1 if raft["leader_id"] else 0)
        yield gauge("cursus_cluster_is_leader", "1 when this node believes it leads Raft.",
                    1 if raft["is_leader"] else 0)
        yield gauge("cursus_cluster_raft_term", "Current Raft term.", raft["term"])
        yield gauge("cursus_cluster_raft_commit_index", "Raft commit index known here.", raft["commit_index"])
        yield gauge("cursus_cluster_raft_applied_index", "Raft index applied here.", raft["applied_index"])
        labels = ["topic", "partition"]
        replicas = GaugeMetricFamily("cursus_cluster_partition_replicas", "Replicas per partition.", labels=labels)
        in_sync = GaugeMetricFamily("cursus_cluster_partition_in_sync_replicas", "ISR size per partition.",
                                    labels=labels)
        epoch = GaugeMetricFamily("cursus_cluster_partition_leader_epoch", "Leader epoch per partition.",
                                  labels=labels)
        leader = GaugeMetricFamily("cursus_cluster_partition_leader", "1 for the partition's leader broker.",
                                   labels=[*labels, "broker_id"])
        offline = under = 0
        for (topic, partition), a in sorted(state.assignments.items()):
            key = [topic, str(partition)]
            replicas.add_metric(key, len(a.replicas))
            in_sync.add_metric(key, len(a.isr))
            epoch.add_metric(key, a.leader_epoch)
            if a.leader is not None:
                leader.add_metric([*key, a.leader], 1)
            offline += a.leader is None
            under += len(a.isr) < len(a.replicas)
        yield gauge("cursus_cluster_offline_partitions", "Partitions without a leader.", offline)
        yield gauge("cursus_cluster_under_replicated_partitions", "Partitions whose ISR is below their replicas.",
                    under)
        yield from (replicas, in_sync, epoch, leader)


class ReplicationCollector:
    """Follower lag of the partitions this broker leads (facts B9 ``cluster_replication_lag_seconds``), from
    the replication node's snapshot (refreshed on the loop every ``replica_isr_check_interval_ms``)."""

    def __init__(self, snapshot: Callable[[], tuple[tuple[str, int, str, int, float], ...]],
                 refusals: Callable[[], tuple[tuple[str, int], ...]] = tuple) -> None:
        self._snapshot = snapshot
        self._refusals = refusals

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        labels = ["topic", "partition", "broker"]
        seconds = GaugeMetricFamily("cluster_replication_lag_seconds",
                                    "Seconds since a follower was last caught up with this leader.", labels=labels)
        records = GaugeMetricFamily("cursus_cluster_replica_lag_records",
                                    "Records a follower is behind this leader's durable end.", labels=labels)
        for topic, partition, broker, behind, lag_s in self._snapshot():
            key = [topic, str(partition), broker]
            seconds.add_metric(key, lag_s)
            records.add_metric(key, behind)
        yield seconds
        yield records
        refused = CounterMetricFamily("cursus_cluster_internal_rejected_calls",
                                      "Refused calls on the internal listener, by reason.", labels=["reason"])
        for reason, count in self._refusals():
            refused.add_metric([reason], count)
        yield refused


class TransactionCollector:
    """The Transactions group of facts B9 plus the LSO lag per transactional partition, at scrape time.

    ``snapshot()`` returns ``{"ready": bool, "states": {state: count}, "expired": int, "oldest_active_seconds":
    float, "lso_lag": {(topic, partition): hwm - lso}}`` (computed on the event loop by the caller).
    """

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            snap = self._snapshot()
        except Exception:  # the loop is busy or shutting down: skip this scrape
            return
        yield GaugeMetricFamily("cursus_transaction_recovery_ready", "1 once transaction recovery finished.",
                                value=1 if snap["ready"] else 0)
        states = GaugeMetricFamily("cursus_transactions", "Transactional ids by state.", labels=["state"])
        for state, count in sorted(snap["states"].items()):
            states.add_metric([state], count)
        yield states
        yield GaugeMetricFamily("cursus_transactions_expired", "Transactions aborted by the coordinator timeout.",
                                value=snap["expired"])
        yield GaugeMetricFamily("cursus_transaction_oldest_active_seconds", "Age of the oldest open transaction.",
                                value=snap["oldest_active_seconds"])
        lag = GaugeMetricFamily("cursus_partition_last_stable_offset_lag", "HWM minus last stable offset.",
                                labels=["topic", "partition"])
        for (topic, partition), value in sorted(snap["lso_lag"].items()):
            lag.add_metric([topic, str(partition)], value)
        yield lag
