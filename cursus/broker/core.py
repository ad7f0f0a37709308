"""The broker's domain state: catalog, replicas, producer state and the storage writer.

:class:`Broker` owns everything a request handler needs and nothing about sockets (see
:mod:`cursus.broker.server` for listeners and :mod:`cursus.broker.session` for connections).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cursus.broker.catalog import StandaloneCatalog
from cursus.broker.config import BrokerConfig
from cursus.broker.metrics import BrokerMetrics
from cursus.broker.offload import Offload, StallProbe
from cursus.broker.producer_state import SNAPSHOT_NAME, ProducerStateTable, chunk_producer_span
from cursus.broker.replica import Replica
from cursus.metadata.topics import TopicDefinition, is_internal_topic
from cursus.storage import (
    Completion,
    GroupCommitWriter,
    LogConfig,
    LogDir,
    PartitionLog,
    atomic_write,
    fsync_dir,
    open_log_dir,
)
from cursus.wire.errors import BrokerError

log = logging.getLogger("cursus.broker")


def now_ms() -> int:
    return int(time.time() * 1000)


class Broker:
    """Domain state of one broker node. Create with :meth:`open`, close with :meth:`close`."""

    def __init__(self, config: BrokerConfig, log_dir: LogDir, metrics: BrokerMetrics) -> None:
        self.config = config
        self.log_dir = log_dir
        self.metrics = metrics
        self.broker_id = "standalone"
        self.loop = asyncio.get_running_loop()
        self.writer = GroupCommitWriter(self._notify_from_writer_thread)
        self.catalog = StandaloneCatalog(log_dir.path, self.run_blocking)
        self.replicas: dict[tuple[str, int], Replica] = {}
        self.producers: dict[tuple[str, int], ProducerStateTable] = {}
        self.round_robin: dict[str, int] = {}
        #: Serializes topic-definition changes (read-modify-write of the catalog).
        self.admin_lock = asyncio.Lock()
        self.client_port = 0
        self.ready = False
        self.not_ready_reasons: dict[str, str] = {"recovery": "not started"}
        self.log_config = LogConfig(
            segment_bytes=config.log_segment_bytes,
            segment_roll_ms=config.log_segment_roll_ms,
            index_interval_bytes=config.log_index_interval_bytes,
            recovery_point_interval_ms=config.log_recovery_point_interval_ms,
        )
        #: Broker-owned topics (``__consumer_offsets``) use small segments so compaction can free them.
        self.internal_log_config = dataclasses.replace(
            self.log_config, segment_bytes=min(config.log_segment_bytes, config.offsets_topic_segment_bytes))
        from cursus.coordinator.service import GroupCoordinator

        #: Consumer groups and committed offsets (ready once ``__consumer_offsets`` is replayed).
        self.coordinator = GroupCoordinator(self)
        #: Active STREAM requests; each has ``stop(reason)`` (see cursus.broker.handlers.stream).
        self.streams: set[Any] = set()
        #: Callbacks run once by :meth:`begin_shutdown`, before client connections are closed.
        self.on_shutdown: list[Callable[[], None]] = []
        self._shutting_down = False
        #: Large (de)compression, checksums and partition reads run here, off the event loop.
        self.offload = Offload(config.offload_threshold_bytes, config.offload_threads)
        self.stall_probe = StallProbe(config.loop_probe_interval_ms / 1000.0, metrics.loop_max_stall,
                                      metrics.loop_stall)
        self.stall_probe.start()

    # -------------------------------------------------------------------------------------- lifecycle

    @classmethod
    async def open(cls, config: BrokerConfig, metrics: BrokerMetrics) -> Broker:
        """Open the log dir, recover every partition and rebuild producer state.

        Raises:
            LogDirLockedError, UnsupportedFormatError, CorruptLogError, ManifestError: startup must stop.
        """
        started = time.monotonic()
        log_dir = open_log_dir(Path(config.log_dir))
        try:
            broker = cls(config, log_dir, metrics)
            broker.writer.start()
            broker._remove_orphan_topic_dirs()
            count = 0
            for name in broker.catalog.names():
                defn = broker.catalog.get(name)
                assert defn is not None
                for p in range(defn.partitions):
                    broker._open_replica(name, p)
                    count += 1
            await broker.coordinator.open()
        except BaseException:
            log_dir.close()
            raise
        elapsed_ms = (time.monotonic() - started) * 1000
        log.info("recovered %d partitions in %.0f ms (clean shutdown: %s)", count, elapsed_ms,
                 log_dir.clean_shutdown)
        broker.not_ready_reasons.pop("recovery", None)
        return broker

    def _remove_orphan_topic_dirs(self) -> None:
        """Delete topic folders the manifest no longer names (a deletion whose cleanup did not finish)."""
        topics_dir = self.log_dir.topics_dir
        if not topics_dir.exists():
            return
        known = set(self.catalog.names())
        for entry in topics_dir.iterdir():
            if entry.is_dir() and entry.name not in known:
                log.warning("removing storage of deleted topic %s", entry.name)
                shutil.rmtree(entry)

    def _open_replica(self, topic: str, partition: int) -> Replica:
        directory = self.log_dir.partition_dir(topic, partition)
        directory.mkdir(parents=True, exist_ok=True)
        config = self.internal_log_config if is_internal_topic(topic) else self.log_config
        plog = PartitionLog.open(directory, config, clean_shutdown=self.log_dir.clean_shutdown)
        replica = Replica(topic, partition, plog, self.writer, broker_id=self.broker_id)
        replica.on_hwm_change = self.metrics.observe_replica
        self.replicas[(topic, partition)] = replica
        self.producers[(topic, partition)] = self._rebuild_producer_state(directory, plog)
        self.metrics.observe_replica(replica)
        return replica

    def _rebuild_producer_state(self, directory: Path, plog: PartitionLog) -> ProducerStateTable:
        """Producer state from the clean-shutdown snapshot (if it matches the log) plus the chunks after it.

        The snapshot is consumed (deleted) here, so after a crash the state is always rebuilt from the log.
        Only the first and last record of each chunk are read.
        """
        ttl_ms = self.config.producer_state_ttl_ms
        table, start = ProducerStateTable(ttl_ms), plog.log_start_offset
        snapshot = directory / SNAPSHOT_NAME
        try:
            loaded, end_offset = ProducerStateTable.from_snapshot(snapshot.read_bytes(), ttl_ms)
            if plog.log_start_offset <= end_offset <= plog.durable_end_offset:
                table, start = loaded, end_offset
        except FileNotFoundError:
            pass
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable producer snapshot %s: %s", snapshot, exc)
        if snapshot.exists():
            snapshot.unlink()
            fsync_dir(directory)  # a stale snapshot must not reappear after a crash
        stamp = now_ms()
        for base_offset, record_count, body in plog.iter_chunks(start):
            span = chunk_producer_span(memoryview(body), record_count)
            if span is not None:
                table.record(span[0], span[1], span[2], span[3], base_offset, stamp)
        return table

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
        await self.loop.run_in_executor(None, self.offload.close)  # no read in flight when the logs close
        await self.coordinator.close()
        await self.loop.run_in_executor(None, self.writer.close)
        for (topic, partition), replica in self.replicas.items():
            replica.log.close()
            if replica.fenced is None:
                directory = self.log_dir.partition_dir(topic, partition)
                table = self.producers[(topic, partition)]
                atomic_write(directory / SNAPSHOT_NAME, table.to_snapshot(replica.log.log_end_offset))
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
        defn = self.catalog.get(name)
        if defn is None:
            raise BrokerError.of("topic_not_found", topic=name)
        return defn

    def replica(self, topic: str, partition: int) -> Replica:
        """The local replica. Raises BrokerError ``partition_not_found``."""
        replica = self.replicas.get((topic, partition))
        if replica is None:
            raise BrokerError.of("partition_not_found", topic=topic, partition=partition)
        return replica

    def producer_table(self, topic: str, partition: int) -> ProducerStateTable:
        return self.producers[(topic, partition)]

    def leader_address(self) -> str:
        return f"{self.config.advertised}:{self.client_port}"

    # --------------------------------------------------------------------------------- topic changes

    async def apply_definition(self, defn: TopicDefinition) -> None:
        """Persist ``defn``, open any partitions it adds, then let consumer groups subscribed to it take the
        new partitions (durably; they rebalance). Caller holds :attr:`admin_lock`."""
        await self.catalog.put(defn)
        for p in range(defn.partitions):
            if (defn.name, p) not in self.replicas:
                self._open_replica(defn.name, p)
        await self.coordinator.on_topic_changed(defn)

    async def delete_topic(self, name: str) -> bool:
        """Remove ``name``: manifest first (raises OSError, topic stays), then replicas and storage.

        Returns True when storage cleanup failed after the manifest commit (``cleanup_pending``); startup
        removes such orphaned folders. Caller holds :attr:`admin_lock`.

        Raises:
            BrokerError: ``topic_delete_blocked`` while a consumer group with members subscribes to the topic
                (checked before anything changes); after the manifest commit inactive groups lose the topic
                (one-topic groups get a tombstone, their offsets go).
        """
        self.coordinator.check_topic_deletable(name)
        try:
            await self.catalog.remove(name)
        except BaseException:
            self.coordinator.topic_delete_aborted(name)
            raise
        try:
            await self.coordinator.on_topic_deleted(name)
        except BrokerError as exc:
            log.warning("group cleanup of deleted topic %s pending: %s", name, exc.error.code)
        replicas = [r for (topic, _), r in self.replicas.items() if topic == name]
        for replica in replicas:
            del self.replicas[(name, replica.partition)]
            self.producers.pop((name, replica.partition), None)
            replica.on_deleted()
            self.metrics.forget_partition(name, replica.partition)
        topic_dir = self.log_dir.topics_dir / name

        def remove_storage() -> None:
            # Runs on the writer thread after every append queued for these logs.
            for replica in replicas:
                replica.log.close()
            shutil.rmtree(topic_dir, ignore_errors=False)

        try:
            await self.run_blocking(remove_storage)
        except OSError as exc:
            log.warning("storage cleanup of deleted topic %s pending: %s", name, exc)
            return True
        finally:
            self.metrics.topics.set(len(self.catalog.names()))
            self.metrics.partitions.set(len(self.replicas))
        return False

    async def enforce_retention(self) -> int:
        """Delete whole closed segments past time or size retention; return segments deleted.

        Limits: the topic's ``retention_hours``/``retention_bytes`` when non-zero, else the broker's
        ``log_retention_ms`` (if >= 0) or ``log_retention_hours``, and ``log_retention_bytes``; -1 keeps all.
        Time is each segment's last chunk append time. The active segment is never deleted.
        """
        deleted = 0
        stamp = now_ms()
        for (topic, _), replica in list(self.replicas.items()):
            defn = self.catalog.get(topic)
            if defn is None or replica.fenced is not None or is_internal_topic(topic):
                continue  # broker-owned topics have unlimited retention (compaction bounds them)
            retention_ms = self._retention_ms(defn)
            retention_bytes = defn.policy.retention_bytes or self.config.log_retention_bytes
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
            self.metrics.observe_replica(replica)
            self.metrics.retention_deletions_total.inc(int(count or 0))
        return deleted

    def _retention_ms(self, defn: TopicDefinition) -> int:
        if defn.policy.retention_hours > 0:
            return defn.policy.retention_hours * 3_600_000
        if self.config.log_retention_ms >= 0:
            return self.config.log_retention_ms
        hours = self.config.log_retention_hours
        return -1 if hours < 0 else hours * 3_600_000

    def expire_producers(self) -> int:
        stamp = now_ms()
        return sum(table.expire(stamp) for table in self.producers.values())
