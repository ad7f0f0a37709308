"""Workloads and checkers for replication tests: acks=all writers on raw Wire v2 that follow leaders, an
HWM observer, and the history check (every acknowledged record present once, in order); and the setup the
replication test modules share (a module cluster fixture, broker restoration after each test, topics of
replication factor 3, acks=all publishes that retry refusals before append)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cursus.client.connection import Connection
from cursus.wire import Status, decode_batch
from tests.cluster.clustersupport import Cluster, wait_for
from tests.integration.helpers import create_topic, error_of, publish_batch

#: Refusals before append (nothing written): a retry cannot duplicate anything.
BEFORE_APPEND = {"leader_not_available", "insufficient_in_sync_replicas", "NOT_LEADER"}


def module_cluster(name: str, **settings: Any) -> Callable[..., Iterator[Cluster]]:
    """A module-scoped ``cluster`` fixture: three real brokers in a fresh temporary folder ``name``, started
    once with the broker ``settings`` (as :class:`Cluster` takes them) and stopped after the module.
    Use it as ``cluster = module_cluster("name", ...)`` at module level."""
    @pytest.fixture(scope="module")
    def cluster(tmp_path_factory: pytest.TempPathFactory, pki) -> Iterator[Cluster]:
        c = Cluster(Path(tmp_path_factory.mktemp(name)), pki, **settings)
        try:
            c.start()
            yield c
        finally:
            c.stop()
    return cluster


def restored_cluster(name: str, **settings: Any) -> tuple[Callable[..., Iterator[Cluster]], Callable[..., Any]]:
    """:func:`module_cluster` plus an autouse fixture that runs :func:`restore_brokers` after every test.
    Use it as ``cluster, all_brokers_running = restored_cluster("name", ...)`` at module level."""
    @pytest.fixture(autouse=True)
    def all_brokers_running(cluster: Cluster) -> Iterator[None]:
        yield
        restore_brokers(cluster)
    return module_cluster(name, **settings), all_brokers_running


def restore_brokers(cluster: Cluster) -> None:
    """Resume every paused broker, restart every dead one, and wait (30 s) until the cluster counts every
    broker active: a failed test must not leave the next one with a dead broker."""
    for broker in cluster.brokers:
        broker.resume()
        if broker.proc is None or broker.proc.poll() is not None:
            broker.start(timeout_s=60)
    wait_for(lambda: status(cluster.brokers[0])["inactive_brokers"] == 0, 30, "every broker active")


def conn(broker) -> Connection:
    return Connection(*broker.address, timeout_s=10)


def make_topic(cluster: Cluster, name: str, **fields: str) -> dict:
    """Create a one-partition topic of replication factor 3, wait for its full ISR and for its leader to
    serve it (the ISR is in the FSM before the leader has opened its replica); its partition row."""
    with conn(cluster.brokers[0]) as c:
        create_topic(c, name, 1, replication_factor="3", **fields)
    row = wait_isr(cluster, name, 3)
    read_partition(cluster, name)
    return row


def publish_ok(c: Connection, topic: str, payloads: list[bytes], *, acks: str = "all", **kw) -> dict:
    """Publish to partition 0, retrying (20 s) refusals that happen before append (a leader still opening or
    preparing, an ISR regrowing); the OK answer's fields. Any other error fails the test."""
    def attempt():
        frame = publish_batch(c, topic, 0, payloads, acks=acks, **kw)
        if frame.status == Status.OK:
            return json.loads(frame.payload)
        err = error_of(frame)
        assert err.code in BEFORE_APPEND, (err.code, err.fields)
        return None
    return wait_for(attempt, 20, f"{topic} accepts a publish")


def status(broker) -> dict:
    with Connection(*broker.address, timeout_s=10) as c:
        text = c.command("CLUSTER_STATUS").payload.decode()
    assert text.startswith("OK cluster="), text
    return json.loads(text[len("OK cluster="):])


def partition_state(cluster: Cluster, topic: str, partition: int = 0, via=None) -> dict:
    """The partition row of CLUSTER_STATUS, asked of the first broker that answers (or ``via``)."""
    brokers = [via] if via is not None else cluster.brokers
    last: Exception | None = None
    for broker in brokers:
        try:
            st = status(broker)
        except Exception as exc:  # a killed or paused broker
            last = exc
            continue
        (row,) = [p for p in st["partitions"] if p["topic"] == topic and p["partition"] == partition]
        return row
    raise AssertionError(f"no broker answered CLUSTER_STATUS: {last!r}")


def leader_proc(cluster: Cluster, topic: str, partition: int = 0, via=None):
    row = partition_state(cluster, topic, partition, via)
    return cluster.by_id(row["leader"]) if row["leader"] else None


def wait_isr(cluster: Cluster, topic: str, size: int, partition: int = 0, timeout: float = 20.0, via=None) -> dict:
    return wait_for(lambda: (r := partition_state(cluster, topic, partition, via)) and len(r["isr"]) == size
                    and r["leader"] and r, timeout, f"{topic}-{partition} ISR of {size}")


def read_partition(cluster: Cluster, topic: str, partition: int = 0) -> list:
    """Every record up to the HWM, read from the current leader; a leader that is not ready yet (it
    answers ``leader_not_available`` while it prepares) is asked again, for 20 s."""
    def attempt() -> tuple[list] | None:
        leader = wait_for(lambda: leader_proc(cluster, topic, partition), 20, "a leader")
        out: list = []
        with Connection(*leader.address, timeout_s=10) as c:
            while True:
                frame = c.command(f"CONSUME topic={topic} partition={partition} "
                                  f"offset={len(out) and out[-1].offset + 1}")
                if frame.status != Status.OK:
                    err = error_of(frame)
                    assert err.code == "leader_not_available", (err.code, err.fields)
                    return None
                records = decode_batch(frame.payload).records if frame.payload else []
                if not records:
                    return (out,)
                out.extend(records)
    return wait_for(attempt, 20, f"{topic}-{partition} read from its leader")[0]


@dataclass
class Ack:
    producer: str
    first_seq: int
    payloads: list[bytes]
    last_offset: int


@dataclass(eq=False)
class AcksAllWriter(threading.Thread):
    """One idempotent producer (raw Wire v2, acks=all) writing batches of ``batch`` records to one partition.
    A batch whose outcome is unknown (error, timeout, dead connection) is retried with the same sequence
    numbers until it is acknowledged: idempotence must make the retry land once."""

    cluster: Cluster
    topic: str
    producer_id: str
    batch: int = 5
    partition: int = 0
    acks: list[Ack] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop_event: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        threading.Thread.__init__(self, daemon=True, name=f"writer-{self.producer_id}")
        self._conn: Connection | None = None
        self._target = 0

    def _connect(self, address: tuple[str, int] | None) -> Connection:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if address is None:
            broker = self.cluster.brokers[self._target % len(self.cluster.brokers)]
            self._target += 1
            address = broker.address
        self._conn = Connection(*address, timeout_s=8)
        return self._conn

    def run(self) -> None:
        seq, n = 1, 0
        while not self.stop_event.is_set():
            payloads = [f"{self.producer_id}-{n + k}".encode() for k in range(self.batch)]
            while True:  # until acknowledged (the last batch may stay unknown when we are stopped)
                try:
                    conn = self._conn or self._connect(None)
                    frame = publish_batch(conn, self.topic, self.partition, payloads, acks="all",
                                          producer=(self.producer_id, 0, seq), idempotent=True)
                except (OSError, ConnectionError, TimeoutError, EOFError) as exc:
                    self.errors.append(type(exc).__name__)
                    self._conn = None
                    if self.stop_event.wait(0.05):
                        return
                    continue
                if frame.status == Status.OK:
                    doc = json.loads(frame.payload)
                    self.acks.append(Ack(self.producer_id, seq, payloads, int(doc["last_offset"])))
                    break
                err = error_of(frame)
                self.errors.append(err.code)
                if err.code == "NOT_LEADER" and err.fields.get("leader"):
                    host, _, port = err.fields["leader"].rpartition(":")
                    try:
                        self._connect((host, int(port)))
                    except OSError:
                        self._conn = None
                elif not err.retryable and err.code not in ("insufficient_in_sync_replicas",):
                    raise AssertionError(f"non-retryable error: {err.code} {err.fields}")
                if self.stop_event.wait(0.05):
                    return
            seq += self.batch
            n += self.batch

    def stop(self) -> None:
        self.stop_event.set()
        self.join(30)
        if self._conn is not None:
            self._conn.close()


class HwmObserver(threading.Thread):
    """Polls LIST_OFFSETS on the broker the cluster names as leader; records every HWM it was told."""

    def __init__(self, cluster: Cluster, topic: str, partition: int = 0) -> None:
        super().__init__(daemon=True, name="hwm-observer")
        self.cluster, self.topic, self.partition = cluster, topic, partition
        self.seen: list[tuple[float, str, int]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(0.02):
            for broker in self.cluster.brokers:
                try:
                    with Connection(*broker.address, timeout_s=1) as c:
                        frame = c.command(f"LIST_OFFSETS topic={self.topic} partition={self.partition}")
                except Exception:
                    continue
                if frame.status == Status.OK:
                    doc = frame.payload.decode()
                    hwm = _field(doc, "hwm")
                    if hwm is not None:
                        self.seen.append((time.monotonic(), broker.log_dir.name, hwm))

    def stop(self) -> list[int]:
        self.stop_event.set()
        self.join(10)
        return [hwm for _, _, hwm in self.seen]


def _field(text: str, key: str) -> int | None:
    """``key`` of the first entry of a LIST_OFFSETS reply (``offsets=P0:earliest=..:latest=..:leo=..:hwm=..``)."""
    for part in text.replace(",", " ").replace(":", " ").split():
        name, _, value = part.partition("=")
        if name == key and value.isdigit():
            return int(value)
    return None


def check_history(acks: list[Ack], records: list) -> None:
    """Every acknowledged payload is stored once at its acknowledged offset; no payload is stored twice;
    each producer's records are in sequence order."""
    stored = {r.offset: bytes(r.payload) for r in records}
    values = [bytes(r.payload) for r in records]
    assert len(values) == len(set(values)), "a record is stored twice"
    for ack in acks:
        first = ack.last_offset - len(ack.payloads) + 1
        got = [stored.get(first + i) for i in range(len(ack.payloads))]
        assert got == ack.payloads, f"acknowledged batch {ack} lost or moved: stored {got}"
    by_producer: dict[str, list[int]] = {}
    for value in values:
        producer, _, n = value.decode().rpartition("-")
        by_producer.setdefault(producer, []).append(int(n))
    for producer, ns in by_producer.items():
        assert ns == list(range(len(ns))), f"{producer}: records missing or out of order: {ns[:20]}"
