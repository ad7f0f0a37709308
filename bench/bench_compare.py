"""Side-by-side comparison: Cursus (through its SDK) against RabbitMQ Streams and Redis streams.

Run with ``python -m bench compare`` (it is not part of the default ``python -m bench`` run). Every server
is started here as a child process bound to 127.0.0.1 with its data in a temporary directory, and stopped by
PID; nothing system-wide is touched. A system whose server or Python client is missing is skipped with one
``{"system": ..., "skipped": ...}`` line.

Workloads (the same for every system; ``RECORDS`` records of ``PAYLOAD_BYTES`` bytes, one partition/stream):

* ``publish``: acknowledged publish of every record, at most ``WINDOW`` records per request/batch.
  Cursus: :class:`~cursus.client.Producer` acks=1 (the leader fsyncs before it acks) and, as
  ``publish_idempotent``, idempotent acks=all; RabbitMQ Streams: ``rstream`` ``send_batch`` with publish
  confirms (RabbitMQ does not fsync before confirming); Redis: pipelined ``XADD`` with
  ``appendfsync always``.
* ``consume``: read every record from the earliest offset. Cursus: :class:`~cursus.client.Consumer` with
  records as :class:`~cursus.client.ConsumerRecord` objects; RabbitMQ Streams: ``rstream`` subscribe from
  ``FIRST``; Redis: ``XRANGE`` pages of ``WINDOW``.
* ``latency``: ``LATENCY_SAMPLES`` records one at a time (send, wait for the ack, repeat): p50 and p99 in
  microseconds, plus the server's CPU per record.

Rounds interleave the systems (the order rotates each round), so machine noise hits all of them alike. Each
round prints one JSON line per workload with every system's figure and the Cursus/other ratio of that same
round; the last lines give medians and ranges over the rounds. Environment: ``CURSUS_BENCH_COMPARE_ROUNDS``
(7), ``CURSUS_BENCH_COMPARE_RECORDS`` (200000), ``CURSUS_BENCH_COMPARE_LATENCY`` (2000 samples),
``CURSUS_BENCH_COMPARE_NODES`` (1).

Three-node mode (``CURSUS_BENCH_COMPARE_NODES=3``): Cursus runs as a three-broker Raft cluster (mutual TLS
between brokers, the timers of :mod:`bench.bench_replication`) with topics of ``replication_factor=3``, and
every Cursus publish is acks=all (``publish``: plain, ``publish_idempotent``: idempotent; each record fsynced
on every ISR replica and covered by a committed HWM before its ack). RabbitMQ runs as a three-node cluster
(classic-config peer discovery, one epmd, one Erlang cookie) with streams of ``initial-cluster-size`` 3
(its publish confirm waits for a quorum of replicas, none of which fsyncs). Redis is skipped: its
replication is asynchronous, so there is no replicated acknowledgement to compare.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROUNDS = int(os.environ.get("CURSUS_BENCH_COMPARE_ROUNDS", "7"))
RECORDS = int(os.environ.get("CURSUS_BENCH_COMPARE_RECORDS", "200000"))
LATENCY_SAMPLES = int(os.environ.get("CURSUS_BENCH_COMPARE_LATENCY", "2000"))
NODES = int(os.environ.get("CURSUS_BENCH_COMPARE_NODES", "1"))
PAYLOAD_BYTES = 100
WINDOW = 1000
START_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)  # polling a port with a deadline: there is no event to wait on
    raise TimeoutError(f"{what} did not listen on {port} within {timeout_s}s")


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tree_cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            total += _proc_cpu_s(pid)
        except OSError:
            pass
    return total


def _stop_pid(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _payload() -> bytes:
    return os.urandom(PAYLOAD_BYTES // 2).hex().encode()


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class System:
    """One broker under test: ``start``/``stop`` its server, run the workloads on a fresh stream each."""

    name = ""
    version = ""

    def start(self, tmp: Path) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def server_pids(self) -> list[int]:
        raise NotImplementedError

    def publish(self, stream: str, payload: bytes, count: int) -> None:
        raise NotImplementedError

    def consume(self, stream: str, count: int) -> None:
        raise NotImplementedError

    def latency(self, stream: str, payload: bytes, count: int) -> list[float]:
        """Seconds per send-and-wait, one sample per record."""
        raise NotImplementedError


# --------------------------------------------------------------------------------------------- Cursus


class CursusSystem(System):
    """One broker, or (``nodes=3``) a three-broker cluster with topics of three replicas and acks=all."""

    name = "cursus"

    def __init__(self, nodes: int = 1) -> None:
        self.nodes = nodes
        self.brokers: list[Any] = []
        self.address: list[str] = []
        #: The producers' acks: the SDK default (1, or all when idempotent) on one broker, all on a cluster.
        self.acks = None if nodes == 1 else "all"

    def start(self, tmp: Path) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        if self.nodes == 1:
            from tests.brokerproc import BrokerProcess

            self.brokers = [BrokerProcess(tmp / "cursus-data", health=False).start()]
        else:
            from bench.bench_replication import TIMERS
            from tests.cluster.clustersupport import Cluster
            from tests.cluster.raftsupport import make_test_pki

            (tmp / "cursus-nodes").mkdir()
            cluster = Cluster(tmp / "cursus-nodes", make_test_pki(tmp / "cursus-pki"), **TIMERS)
            self.brokers = cluster.brokers
            cluster.start()
        self.address = [f"127.0.0.1:{broker.port}" for broker in self.brokers]
        self.version = importlib.metadata.version("cursus")

    def stop(self) -> None:
        for broker in self.brokers:
            broker.stop()

    def server_pids(self) -> list[int]:
        return [broker.proc.pid for broker in self.brokers]

    def _create(self, stream: str, **settings: Any) -> None:
        from cursus.client import Admin
        from tests.cluster.clustersupport import wait_for

        with Admin(self.address) as admin:
            admin.create_topic(stream, 1, replication_factor=self.nodes if self.nodes > 1 else None, **settings)
            if self.nodes > 1:  # until every replica has joined the ISR
                wait_for(lambda: len(admin.describe_topic(stream).partition_states[0].isr) == self.nodes, 30,
                         f"{stream}: an ISR of {self.nodes} replicas")

    def publish(self, stream: str, payload: bytes, count: int, *, idempotent: bool = False) -> None:
        from cursus.client import Producer

        self._create(stream, idempotent=idempotent)
        with Producer(self.address, batch_size=WINDOW, linger_ms=5, idempotent=idempotent,
                      acks=self.acks) as producer:
            send = producer.send
            for _ in range(count):
                send(stream, payload)
            producer.flush()

    def consume(self, stream: str, count: int) -> None:
        from cursus.client import Consumer

        seen = 0
        with Consumer(stream, self.address, batch_size=WINDOW, start="earliest") as consumer:
            for record in consumer.records(until_end=True):
                seen += 1
                _ = record.value
        assert seen == count, (seen, count)

    def latency(self, stream: str, payload: bytes, count: int) -> list[float]:
        from cursus.client import Producer

        self._create(stream)
        samples = []
        with Producer(self.address, acks=self.acks) as producer:
            producer.produce(stream, payload)  # metadata and connection outside the samples
            for _ in range(count):
                started = time.perf_counter()
                producer.produce(stream, payload)
                samples.append(time.perf_counter() - started)
        return samples


# --------------------------------------------------------------------------------------------- RabbitMQ


class RabbitStreamsSystem(System):
    """RabbitMQ with the stream plugin: ``nodes`` child processes with their own node names, dirs, one epmd
    and one Erlang cookie; with more than one node they form a cluster (classic-config peer discovery) and
    every stream is created with ``initial-cluster-size`` = ``nodes``."""

    name = "rabbitmq_streams"

    def __init__(self, nodes: int = 1) -> None:
        self.nodes = nodes
        self.epmd: subprocess.Popen[bytes] | None = None
        self.servers: list[subprocess.Popen[bytes]] = []
        self.port = 0
        self.version = ""
        self._ctl_env: dict[str, str] = {}
        self._node_names: list[str] = []

    @staticmethod
    def missing() -> str | None:
        if not Path("/usr/lib/rabbitmq/bin/rabbitmq-server").exists() or shutil.which("epmd") is None:
            return "rabbitmq-server is not installed (apt-get install rabbitmq-server)"
        try:
            import rstream  # noqa: F401
        except ImportError:
            return "the rstream client is not installed (pip install '.[bench]')"
        return None

    def start(self, tmp: Path) -> None:
        base = tmp / "rabbitmq"
        base.mkdir()
        cookie = base / ".erlang.cookie"  # HOME is ``base`` for every node and rabbitmqctl
        cookie.write_text(os.urandom(16).hex())
        cookie.chmod(0o400)
        epmd_port = _free_port()
        self._ctl_env = {**os.environ, "HOME": str(base), "ERL_EPMD_PORT": str(epmd_port),
                         "ERL_EPMD_ADDRESS": "127.0.0.1"}
        self._node_names = [f"cursusbench{os.getpid()}n{i}@localhost" for i in range(self.nodes)]
        epmd_out = open(base / "epmd.out", "wb")  # noqa: SIM115 (lives as long as epmd)
        # Our own epmd, so the one RabbitMQ would daemonise is never started (and we can stop ours by PID).
        self.epmd = subprocess.Popen(["epmd", "-address", "127.0.0.1", "-port", str(epmd_port)],
                                     stdout=epmd_out, stderr=subprocess.STDOUT, env=self._ctl_env)
        _wait_port(epmd_port, self.epmd, "epmd")
        discovery = "" if self.nodes == 1 else "cluster_formation.peer_discovery_backend = classic_config\n" + "".join(
            f"cluster_formation.classic_config.nodes.{i + 1} = {name}\n" for i, name in enumerate(self._node_names))
        stream_ports = []
        for i, node_name in enumerate(self._node_names):
            node = base / f"node{i}"
            node.mkdir()
            stream_port, amqp_port, dist_port = _free_port(), _free_port(), _free_port()
            stream_ports.append(stream_port)
            (node / "rabbitmq.conf").write_text(
                f"listeners.tcp.1 = 127.0.0.1:{amqp_port}\n"
                f"stream.listeners.tcp.1 = 127.0.0.1:{stream_port}\n"
                f"stream.advertised_host = 127.0.0.1\nstream.advertised_port = {stream_port}\n" + discovery)
            (node / "enabled_plugins").write_text("[rabbitmq_stream].\n")
            env = {**self._ctl_env, "RABBITMQ_NODENAME": node_name,
                   "RABBITMQ_MNESIA_BASE": str(node / "mnesia"), "RABBITMQ_LOG_BASE": str(node / "log"),
                   "RABBITMQ_CONFIG_FILE": str(node / "rabbitmq.conf"),
                   "RABBITMQ_ENABLED_PLUGINS_FILE": str(node / "enabled_plugins"),
                   "RABBITMQ_DIST_PORT": str(dist_port), "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
                   "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}"}
            out = open(node / "server.out", "wb")  # noqa: SIM115 (lives as long as the server)
            self.servers.append(subprocess.Popen(["/usr/lib/rabbitmq/bin/rabbitmq-server"], stdout=out,
                                                 stderr=subprocess.STDOUT, env=env))
        for port, server in zip(stream_ports, self.servers, strict=True):
            _wait_port(port, server, "rabbitmq-server")
        self.port = stream_ports[0]
        if self.nodes > 1:
            self._wait_clustered()
        self.version = _dpkg_version("rabbitmq-server")

    def _wait_clustered(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until the first node reports every node running (a stream created earlier gets fewer replicas)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = subprocess.run(["/usr/lib/rabbitmq/bin/rabbitmqctl", "-n", self._node_names[0], "-q",
                                     "cluster_status", "--formatter", "json"], capture_output=True, text=True,
                                    env=self._ctl_env, check=False, timeout=60)
            try:
                running = json.loads(status.stdout).get("running_nodes", [])
            except ValueError:
                running = []
            if len(running) == self.nodes:
                return
            time.sleep(0.5)  # polling with a deadline: there is no event to wait on
        raise TimeoutError(f"RabbitMQ: {self.nodes} nodes did not form a cluster within {timeout_s}s")

    def server_pids(self) -> list[int]:
        return [pid for server in self.servers for pid in (*_children(server.pid), server.pid)]

    def stop(self) -> None:
        for server in self.servers:
            for pid in _children(server.pid) if server.poll() is None else []:
                try:  # the script's child beam.smp handles SIGTERM as a clean shutdown
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for server in self.servers:
            _stop_pid(server)
        if self.epmd is not None:
            _stop_pid(self.epmd)
        self.servers, self.epmd = [], None

    def _create(self, producer: Any, stream: str) -> Any:
        arguments = {"initial-cluster-size": self.nodes} if self.nodes > 1 else None
        return producer.create_stream(stream, arguments=arguments, exists_ok=True)

    def _run(self, body: Callable[[Any], Any]) -> Any:
        async def main() -> Any:
            from rstream import Producer

            async with Producer("127.0.0.1", self.port, username="guest", password="guest") as producer:
                return await body(producer)

        return asyncio.run(main())

    def publish(self, stream: str, payload: bytes, count: int) -> None:
        async def body(producer: Any) -> None:
            await self._create(producer, stream)
            done = asyncio.Event()
            confirmed = 0

            async def on_confirm(status: Any) -> None:
                nonlocal confirmed
                if not status.is_confirmed:
                    raise RuntimeError(f"rabbitmq refused a message: {status}")
                confirmed += 1
                if confirmed == count:
                    done.set()

            for start in range(0, count, WINDOW):
                await producer.send_batch(stream, [payload] * min(WINDOW, count - start),
                                          on_publish_confirm=on_confirm)
            await asyncio.wait_for(done.wait(), 120)

        self._run(body)

    def consume(self, stream: str, count: int) -> None:
        async def main() -> None:
            from rstream import Consumer, ConsumerOffsetSpecification, OffsetType

            done = asyncio.Event()
            seen = 0

            async def on_message(message: Any, context: Any) -> None:
                nonlocal seen
                seen += 1
                if seen == count:
                    done.set()

            async with Consumer("127.0.0.1", self.port, username="guest", password="guest") as consumer:
                await consumer.subscribe(stream, on_message,
                                         offset_specification=ConsumerOffsetSpecification(OffsetType.FIRST))
                await asyncio.wait_for(done.wait(), 120)

        asyncio.run(main())

    def latency(self, stream: str, payload: bytes, count: int) -> list[float]:
        async def body(producer: Any) -> list[float]:
            await self._create(producer, stream)
            await producer.send_wait(stream, payload)
            samples = []
            for _ in range(count):
                started = time.perf_counter()
                await producer.send_wait(stream, payload)
                samples.append(time.perf_counter() - started)
            return samples

        result: list[float] = self._run(body)
        return result


# --------------------------------------------------------------------------------------------- Redis


class RedisSystem(System):
    """redis-server with ``appendonly yes`` and ``appendfsync always`` (fsync before the reply)."""

    name = "redis_streams"

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.version = ""

    @staticmethod
    def missing() -> str | None:
        if shutil.which("redis-server") is None:
            return "redis-server is not installed (apt-get install redis-server)"
        try:
            import redis  # noqa: F401
        except ImportError:
            return "the redis client is not installed (pip install '.[bench]')"
        return None

    def start(self, tmp: Path) -> None:
        base = tmp / "redis"
        base.mkdir()
        self.port = _free_port()
        out = open(base / "server.out", "wb")  # noqa: SIM115 (lives as long as the server)
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(base),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no",
             "--protected-mode", "yes"], stdout=out, stderr=subprocess.STDOUT)
        _wait_port(self.port, self.proc, "redis-server")
        self.version = self._client().info("server")["redis_version"]

    def _client(self) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port)

    def server_pids(self) -> list[int]:
        assert self.proc is not None
        return [self.proc.pid]

    def stop(self) -> None:
        if self.proc is not None:
            _stop_pid(self.proc)

    def publish(self, stream: str, payload: bytes, count: int) -> None:
        client = self._client()
        for start in range(0, count, WINDOW):
            pipe = client.pipeline(transaction=False)
            for _ in range(min(WINDOW, count - start)):
                pipe.xadd(stream, {"v": payload})
            pipe.execute()
        client.close()

    def consume(self, stream: str, count: int) -> None:
        client = self._client()
        seen = 0
        low = "-"
        while True:
            page = client.xrange(stream, min=low, max="+", count=WINDOW)
            if not page:
                break
            for _entry_id, fields in page:
                _ = fields[b"v"]
            seen += len(page)
            low = "(" + page[-1][0].decode()
        client.close()
        assert seen == count, (seen, count)

    def latency(self, stream: str, payload: bytes, count: int) -> list[float]:
        client = self._client()
        client.xadd(stream, {"v": payload})
        samples = []
        for _ in range(count):
            started = time.perf_counter()
            client.xadd(stream, {"v": payload})
            samples.append(time.perf_counter() - started)
        client.close()
        return samples


# --------------------------------------------------------------------------------------------- driver


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _dpkg_version(package: str) -> str:
    try:
        return subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True,
                              check=False).stdout.strip()
    except OSError:
        return ""


def _measure(system: System, workload: str, stream: str, payload: bytes) -> dict[str, Any]:
    pids = system.server_pids()
    cpu0 = _tree_cpu_s(pids)
    client0 = time.process_time()
    started = time.perf_counter()
    result: dict[str, Any] = {}
    if workload == "latency":
        samples = system.latency(stream, payload, LATENCY_SAMPLES)
        ops = LATENCY_SAMPLES
        result["p50_us"] = round(_percentile(samples, 0.50) * 1e6, 1)
        result["p99_us"] = round(_percentile(samples, 0.99) * 1e6, 1)
    else:
        if workload == "publish_idempotent":
            assert isinstance(system, CursusSystem)
            system.publish(stream, payload, RECORDS, idempotent=True)
        elif workload == "publish":
            system.publish(stream, payload, RECORDS)
        else:
            system.consume(stream, RECORDS)
        ops = RECORDS
        result["records_per_s"] = round(RECORDS / (time.perf_counter() - started))
    result["server_cpu_us_per_record"] = round((_tree_cpu_s(pids) - cpu0) / ops * 1e6, 1)
    result["client_cpu_us_per_record"] = round((time.process_time() - client0) / ops * 1e6, 1)
    return result


_WORKLOADS = ("publish", "publish_idempotent", "consume", "latency")
_HEADLINE = {"publish": "records_per_s", "publish_idempotent": "records_per_s", "consume": "records_per_s",
             "latency": "p50_us"}


def _ratios(workload: str, figures: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Cursus / other for throughput; other / Cursus for latency (so > 1 always means Cursus is better)."""
    ours = figures.get("cursus")
    out: dict[str, float] = {}
    if ours is None:
        return out
    for name, theirs in figures.items():
        if name == "cursus":
            continue
        if workload == "latency":
            for key in ("p50_us", "p99_us"):
                out[f"{name}_{key}"] = round(theirs[key] / ours[key], 3)
        else:
            out[name] = round(ours["records_per_s"] / theirs["records_per_s"], 3)
    return out


def run() -> Iterator[dict]:
    """Start every installed system, run ``ROUNDS`` interleaved rounds; yield the result lines as they come."""
    systems: list[System] = [CursusSystem(NODES)]
    reason = RabbitStreamsSystem.missing()
    if reason is None:
        systems.append(RabbitStreamsSystem(NODES))
    else:
        yield {"system": RabbitStreamsSystem.name, "skipped": reason}
    reason = RedisSystem.missing() if NODES == 1 else "asynchronous replication: no replicated acknowledgement"
    if reason is None:
        systems.append(RedisSystem())
    else:
        yield {"system": RedisSystem.name, "skipped": reason}
    history: dict[str, dict[str, list[dict[str, Any]]]] = {w: {} for w in _WORKLOADS}
    with tempfile.TemporaryDirectory(prefix="cursus-compare-") as tmp_name:
        tmp = Path(tmp_name)
        started: list[System] = []
        try:
            for system in systems:
                system.start(tmp)
                started.append(system)
            yield {"settings": {"nodes": NODES, "rounds": ROUNDS, "records": RECORDS, "payload_bytes": PAYLOAD_BYTES,
                                "window": WINDOW, "latency_samples": LATENCY_SAMPLES, "cpus": os.cpu_count(),
                                "python": sys.version.split()[0],
                                "versions": {s.name: s.version for s in systems}}}
            for round_no in range(ROUNDS):
                shift = round_no % len(systems)
                order = systems[shift:] + systems[:shift]
                payload = _payload()
                for workload in _WORKLOADS:
                    figures: dict[str, dict[str, Any]] = {}
                    for system in order:
                        if workload == "publish_idempotent" and system.name != "cursus":
                            continue
                        stream = f"cmp-{'publish' if workload == 'consume' else workload.replace('_', '-')}-{round_no}"
                        figures[system.name] = _measure(system, workload, stream, payload)
                        history[workload].setdefault(system.name, []).append(figures[system.name])
                    if workload == "publish_idempotent":  # against the others' plain publish of this round
                        compared = {name: rows[-1] for name, rows in history["publish"].items()}
                        compared["cursus"] = figures["cursus"]
                        ratios = _ratios("publish", compared)
                    else:
                        ratios = _ratios(workload, figures)
                    yield {"round": round_no, "workload": workload, **figures, "ratios": ratios}
        finally:
            for system in reversed(started):
                system.stop()
    for workload in _WORKLOADS:
        summary: dict[str, Any] = {}
        keys = ("p50_us", "p99_us") if workload == "latency" else ("records_per_s",)
        for name, rows in history[workload].items():
            summary[name] = {key: {"median": statistics.median(r[key] for r in rows),
                                   "min": min(r[key] for r in rows), "max": max(r[key] for r in rows)}
                             for key in (*keys, "server_cpu_us_per_record", "client_cpu_us_per_record")}
        yield {"summary": workload, "rounds": ROUNDS, **summary}
