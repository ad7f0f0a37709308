"""The replication pipeline of one cluster broker, assembled: the internal gRPC listener (leader side:
:class:`~cursus.replication.leader.LeaderFetchService`), the fetcher manager (follower side:
:class:`~cursus.replication.follower.ReplicaFetcherManager`) and the ISR upkeep task.

The broker builds one in cluster mode (``Broker._replication``, the one place that knows) and calls
:meth:`ReplicationNode.on_metadata` after its replicas took their roles from an applied state. Standalone
brokers have none: a one-member ISR needs no fetches.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from cursus.broker.replica_role import Role
from cursus.cluster.tls import TLSFiles
from cursus.internal.auth import TokenCheck
from cursus.internal.client import InternalClient
from cursus.internal.server import InternalServer
from cursus.metadata.commands import ChangeIsr
from cursus.metadata.state import MetadataState, PartitionKey
from cursus.replication.follower import FetcherConfig, FollowerObserver, ReplicaFetcherManager
from cursus.replication.isr import IsrChange, IsrTracker
from cursus.replication.leader import LeaderFetchConfig, LeaderFetchService, LeaderObserver
from cursus.wire.errors import TypedError

if TYPE_CHECKING:
    from cursus.broker.core import Broker
    from cursus.broker.metrics import BrokerMetrics

log = logging.getLogger("cursus.replication")

#: Headroom of a gRPC message over the largest fetch response (protobuf framing, partition rows).
_MESSAGE_SLACK = 1 << 20


def monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def internal_address(broker: Broker) -> str:
    """``host:port`` other brokers dial for this broker's internal listener (``internal_advertised_address``,
    else ``<advertised host>:<internal_broker_port>``)."""
    config = broker.config
    return config.internal_advertised_address or f"{config.advertised}:{config.internal_broker_port}"


def restarted_peers(old: MetadataState, new: MetadataState, local_id: str) -> dict[str, set[str]]:
    """Brokers other than ``local_id`` registered in both states with another (non-empty) incarnation in
    ``new``: broker id -> their internal addresses in either state (non-empty)."""
    restarted: dict[str, set[str]] = {}
    for broker_id, info in new.brokers.items():
        before = old.brokers.get(broker_id)
        if broker_id == local_id or before is None or not info.incarnation or before.incarnation == info.incarnation:
            continue
        restarted[broker_id] = {a for a in (before.internal_address, info.internal_address) if a}
    return restarted


class _Observer(LeaderObserver, FollowerObserver):
    """Replication events as Prometheus metrics."""

    def __init__(self, metrics: BrokerMetrics) -> None:
        self.metrics = metrics

    def chunk_bytes_out(self, follower_id: str, key: PartitionKey, size_bytes: int) -> None:
        self.metrics.replication_bytes.labels("out").inc(size_bytes)

    def chunk_bytes_in(self, leader_id: str, key: PartitionKey, size_bytes: int) -> None:
        self.metrics.replication_bytes.labels("in").inc(size_bytes)

    def isr_change_proposed(self, key: PartitionKey, change: IsrChange) -> None:
        if change.shrunk:
            self.metrics.isr_changes.labels("shrink").inc()
        if change.expanded:
            self.metrics.isr_changes.labels("expand").inc()

    def append_refused(self, key: PartitionKey, error: TypedError) -> None:
        self.metrics.replication_quarantined.inc()

    def stream_broken(self, leader_id: str, error: BaseException) -> None:
        self.metrics.replication_stream_errors.inc()


class ReplicationNode:
    """Leader service, fetchers and ISR upkeep of one cluster broker.

    Lifecycle: construct (no I/O), :meth:`start` once the local replicas are open (binds
    ``internal_broker_port``; raises OSError when it cannot bind or read the TLS files), :meth:`close`.
    """

    def __init__(self, broker: Broker, members: Callable[[], set[str]]) -> None:
        config = broker.config
        self.broker = broker
        tls = (TLSFiles(Path(config.internal_tls_cert_path), Path(config.internal_tls_key_path),
                        Path(config.internal_tls_ca_path)) if config.internal_use_tls else None)
        max_message = config.replica_fetch_response_max_bytes + config.replica_fetch_max_bytes + _MESSAGE_SLACK
        observer = _Observer(broker.metrics)
        self.tracker = IsrTracker(broker.broker_id)
        self.leader = LeaderFetchService(
            lambda: broker.replicas, lambda t, p: broker.metadata.state.assignment(t, p), self.tracker,
            LeaderFetchConfig(partition_max_bytes=config.replica_fetch_max_bytes,
                              response_max_bytes=config.replica_fetch_response_max_bytes,
                              max_wait_ms=config.replica_fetch_wait_max_ms,
                              lag_time_max_ms=config.replica_lag_time_max_ms,
                              isr_check_interval_ms=config.replica_isr_check_interval_ms),
            monotonic_ms, self._submit_isr_change, run_blocking=broker.offload.run, observer=observer,
            is_active=self._is_active)
        self.client = InternalClient(broker.broker_id, tls=tls, token=config.internal_auth_token,
                                     max_message_bytes=max_message)
        self.fetchers = ReplicaFetcherManager(
            broker.broker_id, lambda: broker.replicas, self._internal_address_of, self.client.fetch_stream,
            FetcherConfig(max_wait_ms=config.replica_fetch_wait_max_ms,
                          partition_max_bytes=config.replica_fetch_max_bytes,
                          response_max_bytes=config.replica_fetch_response_max_bytes,
                          backoff_ms=config.replica_fetch_backoff_ms,
                          reconnect_backoff_ms=config.replica_fetch_backoff_ms),
            monotonic_ms, assignment_lookup=lambda t, p: broker.metadata.state.assignment(t, p), observer=observer,
            run_blocking=broker.offload.run)
        self.server = InternalServer(
            config.host, config.internal_broker_port, self.leader, tls=tls,
            token=TokenCheck(config.internal_auth_token, config.internal_auth_token_next),
            members=members(), max_message_bytes=max_message)
        self._maintain: asyncio.Task[None] | None = None
        self._lag_task: asyncio.Task[None] | None = None
        #: (topic, partition, follower, records behind, seconds behind) of the partitions led here; an
        #: immutable snapshot the metrics thread may read.
        self.lag_snapshot: tuple[tuple[str, int, str, int, float], ...] = ()
        #: (reason, count) of refused internal calls, likewise.
        self.refusal_snapshot: tuple[tuple[str, int], ...] = ()

    def _is_active(self, broker_id: str) -> bool:
        info = self.broker.metadata.state.brokers.get(broker_id)
        return info is not None and info.status == "active"

    def _internal_address_of(self, broker_id: str) -> str | None:
        info = self.broker.metadata.state.brokers.get(broker_id)
        return info.internal_address if info is not None and info.internal_address else None

    async def _submit_isr_change(self, command: ChangeIsr) -> object:
        return await self.broker.metadata.submit(command)

    async def start(self) -> int:
        """Bind the internal listener, start fetching for local followers and the ISR upkeep. Returns the
        bound internal port."""
        port = await self.server.start()
        self.fetchers.refresh()
        loop = asyncio.get_running_loop()
        self._maintain = loop.create_task(self.leader.maintain_forever())
        self._lag_task = loop.create_task(self._observe_lag())
        return port

    def on_metadata(self, old: MetadataState, new: MetadataState) -> None:
        """Metadata listener (after the replicas took their roles): fetch from the current leaders.

        A peer registered with a new incarnation restarted: its channel is replaced and a session fetching
        from it ends its reconnect backoff (:func:`restarted_peers`), so followers reach a restarted
        broker as soon as it listens instead of after the backoffs grown while it was down (issue 13:
        seconds of acks=all delay when a broker that had just restarted became a partition leader)."""
        for broker_id, addresses in restarted_peers(old, new, self.broker.broker_id).items():
            for address in addresses:
                self.client.reset(address)
            self.fetchers.peer_restarted(broker_id)
        self.fetchers.refresh()

    def replica_lag(self) -> dict[PartitionKey, dict[str, tuple[int, float]]]:
        """For every partition this broker leads: follower -> (records behind the leader's durable end,
        seconds since it was last caught up). Loop thread."""
        now = monotonic_ms()
        lag: dict[PartitionKey, dict[str, tuple[int, float]]] = {}
        state = self.broker.metadata.state
        for key, replica in self.broker.replicas.items():
            assignment = state.assignments.get(key)
            if replica.role is not Role.LEADER or assignment is None:
                continue
            end = replica.durable_end_offset
            rows = lag[key] = {}
            for follower in assignment.replicas:
                if follower == self.broker.broker_id:
                    continue
                offset = self.tracker.fetch_offset(key, follower)
                rows[follower] = (max(0, end - (offset or 0)), self.tracker.lag_ms(key, follower, end, now) / 1000.0)
        return lag

    async def _observe_lag(self) -> None:
        """Refresh :attr:`lag_snapshot` (read by the metrics thread) every ISR check interval."""
        interval = self.broker.config.replica_isr_check_interval_ms / 1000.0
        while True:
            self.lag_snapshot = tuple((t, p, b, records, seconds) for (t, p), rows in self.replica_lag().items()
                                      for b, (records, seconds) in rows.items())
            self.refusal_snapshot = tuple(sorted(self.refusals().items()))
            await asyncio.sleep(interval)

    def refusals(self) -> dict[str, int]:
        """Refused internal calls by reason (for CLUSTER_STATUS and metrics; TLS handshake refusals happen
        inside gRPC and are not counted)."""
        return dict(self.server.stats()["refusals"])

    async def close(self) -> None:
        """Stop the upkeep, the fetchers and the listener (in that order: no fetch is answered after)."""
        tasks = [t for t in (self._maintain, self._lag_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.fetchers.close()
        await self.server.stop(0.5)
        await self.client.close()

