"""Listeners and lifecycle: recover, listen, serve, and shut down in stages.

Shutdown (SIGTERM/SIGINT), uvicorn style: stop accepting; let in-flight requests finish (bounded by
``shutdown_grace_ms``); close connections; drain the writer thread so every pending append is fsynced;
checkpoint every partition; write the clean-shutdown marker; release the log dir.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Any

from prometheus_client import start_http_server

from cursus.broker.config import BrokerConfig
from cursus.broker.core import Broker
from cursus.broker.health import serve_health
from cursus.broker.metrics import (
    BrokerMetrics,
    ClusterCollector,
    GroupStateCollector,
    ReplicationCollector,
    TransactionCollector,
)
from cursus.broker.session import ByteBudget, Session, SessionProtocol
from cursus.broker.tls import server_context

log = logging.getLogger("cursus.server")


class BrokerServer:
    """A running broker node: domain state plus its client, health and metrics listeners."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.metrics = BrokerMetrics()
        self.broker: Broker | None = None
        self.sessions: set[Session] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._client_server: asyncio.Server | None = None
        self._health_server: asyncio.Server | None = None
        self._metrics_server: object | None = None
        self._stopping = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connection_slots = asyncio.Semaphore(config.max_client_connections)
        self._budget = ByteBudget(config.max_inflight_request_bytes)

    def not_ready(self) -> dict[str, str]:
        if self.broker is None:
            return {"recovery": "in progress"}
        reasons = dict(self.broker.not_ready_reasons)
        reasons.update(self.broker.metadata.readiness())
        if self._client_server is None or not self._client_server.is_serving():
            reasons.setdefault("listener", "not accepting yet")
        return reasons

    async def start(self) -> None:
        """Start the health listener, bind the client listener, recover storage off the loop, then serve.

        ``/live`` answers throughout recovery; ``/ready`` turns 200 once recovery and group replay are done
        and the client listener accepts. Raises on any startup failure.
        """
        cfg = self.config
        host = cfg.host
        if cfg.health_check_port >= 0:
            self._health_server = await serve_health(host, cfg.health_check_port, self.not_ready)
        if cfg.exporter_port >= 0:
            self._metrics_server = start_http_server(cfg.exporter_port, addr=host, registry=self.metrics.registry)
        ssl_context = server_context(cfg)
        self._loop = asyncio.get_running_loop()
        # Bound (not yet accepting) first: the bound port names the broker (``<advertised_host>-<port>``).
        loop = self._loop

        def protocol() -> SessionProtocol:  # asyncio.start_server's factory, with the fast-path protocol
            return SessionProtocol(asyncio.StreamReader(limit=1 << 20, loop=loop), self._on_connection, loop)

        self._client_server = await loop.create_server(
            protocol, host, cfg.broker_port, backlog=1024, ssl=ssl_context,
            ssl_handshake_timeout=cfg.tls_handshake_timeout_ms / 1000.0 if ssl_context else None,
            start_serving=False,
        )
        port = self._client_server.sockets[0].getsockname()[1]
        try:
            broker = self.broker = await Broker.open(cfg, self.metrics, client_port=port)
            broker.is_connection_open = self._is_connection_open
        except BaseException:
            self._client_server.close()
            raise
        await self._client_server.start_serving()
        self.metrics.registry.register(GroupStateCollector(self._group_snapshot))
        self.metrics.registry.register(ClusterCollector(lambda: broker.metadata.state, broker.metadata.raft_status))
        if broker.replication is not None:
            replication = broker.replication
            self.metrics.registry.register(ReplicationCollector(lambda: replication.lag_snapshot,
                                                                lambda: replication.refusal_snapshot))
        self.metrics.registry.register(TransactionCollector(self._txn_snapshot))
        self.metrics.topics.set(len(broker.metadata.names()))
        self.metrics.partitions.set(len(broker.replicas))
        self.metrics.ready.set(1)
        broker.ready = True
        log.info("listening client=%s:%d tls=%s health=%s metrics=%s advertised=%s broker_id=%s", host,
                 broker.client_port, "on" if ssl_context else "off", self._port_text(self._health_server),
                 self._metrics_port_text(), broker.leader_address(), broker.broker_id)
        log.info("ready")

    def _txn_snapshot(self) -> dict[str, Any]:
        """Transaction gauges for the metrics thread, computed on the event loop."""
        broker, loop = self.broker, self._loop
        assert broker is not None and loop is not None

        async def snapshot() -> dict[str, Any]:
            return broker.transactions.metrics_snapshot()

        return asyncio.run_coroutine_threadsafe(snapshot(), loop).result(timeout=2)

    def _group_snapshot(self) -> tuple[list[dict[str, Any]], int]:
        """Group status for the metrics thread, computed on the event loop (see GroupStateCollector)."""
        broker, loop = self.broker, self._loop
        assert broker is not None and loop is not None

        async def snapshot() -> tuple[list[dict[str, Any]], int]:
            coordinator = broker.coordinator
            return [coordinator.status(name) for name in coordinator.list_groups()], len(broker.streams)

        return asyncio.run_coroutine_threadsafe(snapshot(), loop).result(timeout=2.0)

    @staticmethod
    def _port_text(server: asyncio.Server | None) -> str:
        if server is None:
            return "off"
        name = server.sockets[0].getsockname()
        return f"{name[0]}:{name[1]}"

    def _metrics_port_text(self) -> str:
        if self._metrics_server is None:
            return "off"
        server = self._metrics_server[0] if isinstance(self._metrics_server, tuple) else self._metrics_server
        addr = getattr(server, "server_address", None)
        return f"{addr[0]}:{addr[1]}" if addr else "on"

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self.broker is not None
        if self._stopping.is_set():
            writer.close()
            return
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        async with self._connection_slots:
            session = Session(self.broker, reader, writer, self._budget)
            protocol = writer.transport.get_protocol()
            if isinstance(protocol, SessionProtocol):
                protocol.session = session  # from now on, small PUBLISH frames take the fast path
            self.sessions.add(session)
            self.metrics.connections_total.inc()
            self.metrics.connections_active.inc()
            try:
                await session.run()
            except asyncio.CancelledError:
                # Shutdown cancels connections that outlived the grace period. This is the outermost frame of
                # the connection's task, and asyncio's stream callback would log a cancelled task as an error.
                pass
            finally:
                self.sessions.discard(session)
                self.metrics.connections_active.dec()

    def _is_connection_open(self, peer: str) -> bool:
        """Is a client session with this ``host:port`` open (joins are rare: a scan is cheap)."""
        return any(session.info.peer == peer for session in self.sessions)

    async def run_until_stopped(self) -> None:
        """Serve until SIGTERM/SIGINT (or :meth:`request_stop`), then shut down cleanly."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        assert self.broker is not None
        broker = self.broker
        periodic = [
            asyncio.create_task(self._every(self.config.log_retention_check_interval_ms, broker.enforce_retention)),
            asyncio.create_task(self._every(min(self.config.producer_state_ttl_ms, 60_000),
                                            broker.expire_producers)),
            asyncio.create_task(self._every(broker.cleaner.interval_s * 1000.0, broker.cleaner.run_once)),
            asyncio.create_task(self._every(self.config.topic_cleanup_retry_interval_ms, broker.retry_topic_cleanup)),
        ]
        await self._stopping.wait()
        for task in periodic:
            task.cancel()
        await self.shutdown()

    def request_stop(self) -> None:
        self._stopping.set()

    @staticmethod
    async def _every(interval_ms: float, job: object) -> None:
        """Run ``job`` (sync or async callable) every ``interval_ms``; errors are logged, never fatal."""
        while True:
            await asyncio.sleep(interval_ms / 1000.0)
            try:
                result = job()  # type: ignore[operator]
                if asyncio.iscoroutine(result):
                    await result
            except Exception:
                log.exception("periodic task %s failed", getattr(job, "__name__", job))

    async def shutdown(self) -> None:
        """Staged shutdown; every acknowledged and pending append is fsynced before the marker is written."""
        started = time.monotonic()
        self._stopping.set()
        if self._client_server is not None:
            self._client_server.close()
        if self.broker is not None:
            self.broker.begin_shutdown()  # active STREAMs end with reason=stopped
        for session in list(self.sessions):
            session.abort_long_poll()  # read-only waits end now rather than after wait_ms
        deadline = time.monotonic() + self.config.shutdown_grace_ms / 1000.0
        while any(s.busy for s in self.sessions) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # bounded by shutdown_grace_ms
        for session in list(self.sessions):
            session.closing = True
            session.writer.close()
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel("broker shutting down")
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        if self.broker is not None:
            await self.broker.close()
        if self._health_server is not None:
            self._health_server.close()
        if self._metrics_server is not None:
            server = self._metrics_server[0] if isinstance(self._metrics_server, tuple) else self._metrics_server
            shutdown = getattr(server, "shutdown", None)
            if shutdown is not None:
                await asyncio.get_running_loop().run_in_executor(None, shutdown)
        log.info("stopped in %.0f ms", (time.monotonic() - started) * 1000)
