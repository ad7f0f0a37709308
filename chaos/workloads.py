"""Workloads: client threads that drive the brokers and record every operation in the history.

All clients use the plain blocking :class:`cursus.client.connection.Connection`, so the harness controls
exactly what is sent and when an operation counts as acknowledged (the SDK's retries would hide that).

* :class:`IdempotentProducer`: acks=all, idempotent batches (producer id, epoch, per-partition sequence
  numbers); an unknown outcome is retried with the same sequence numbers, which the broker must
  de-duplicate. A definite failure or a give-up starts a new epoch.
* :class:`PlainProducer`: acks=1, never retried (an unknown outcome stays ``info``).
  Both write unique values (``<process>:<n>``) over several partitions, keyed (partition = FNV-1a 64 of the
  key, as the broker and SDK route) or unkeyed (a seeded random partition).
* :class:`DirectReader`: CONSUME from chosen offsets in *sessions*: a session reads one partition forward
  from its start; it ends on any error or when the reader jumps elsewhere.
* :class:`OffsetsPoller`: LIST_OFFSETS of every topic of one node, over and over.
* :class:`GroupConsumer`: consumer-group members (JOIN_GROUP, SYNC_GROUP, FETCH_OFFSET, CONSUME, then
  COMMIT_OFFSET ``lastProcessedOffset + 1``, HEARTBEAT), which also crash (drop the connection without
  leaving) and rejoin. Gated by :class:`GroupGate`: while the broker answers JOIN_GROUP with
  ``UNSUPPORTED_FEATURE`` the workload is skipped and the report says ``skipped: groups unavailable``.
* :func:`drain`: after the run, read every partition from its log start to its HWM, and fetch the final
  committed offsets.

Operation values are documented in ``docs/chaos.md``.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from chaos.history import FAIL, INFO, OK, Clock, History, Pending
from chaos.nodes import Cluster, Node
from cursus.client.connection import Connection, ok_text_fields
from cursus.partitioning import partition_for_key
from cursus.wire import (
    Batch,
    Command,
    ErrorClass,
    Frame,
    ProtocolError,
    Record,
    Status,
    decode_batch,
    decode_error,
    encode_batch,
    encode_crq2,
    parse_command_text,
)

#: Client connect and reply timeout; shorter than most pauses, so pauses produce unknown outcomes.
TIMEOUT_S = 2.0
#: An idempotent producer retries an unknown outcome for this long before giving up (``info``).
RETRY_WINDOW_S = 20.0
#: After stop is requested, an idempotent producer still retries for this long.
STOP_GRACE_S = 3.0
#: Distinct keys keyed producers draw from.
KEY_COUNT = 24
#: Values per produced batch.
BATCH_VALUES_MAX = 4
#: Pause between a worker's operations, so that two cores stay shared with the broker.
THINK_S_MIN, THINK_S_MAX = 0.005, 0.02
#: A worker that raises this many unexpected exceptions stops (a harness bug, reported).
WORKER_ERRORS_MAX = 20
#: Extra pause between a direct reader's CONSUMEs (bounds the history's size in long runs).
READER_PAUSE_S_MIN, READER_PAUSE_S_MAX = 0.01, 0.05
#: How long a STREAM consumer waits for the next pushed frame (keepalives come at least every 3 s).
STREAM_FRAME_TIMEOUT_S = 5.0
#: Heartbeat interval of group consumers.
HEARTBEAT_S = 1.0
#: Chance per consumer step that a group consumer crashes (drops its connection without leaving).
CONSUMER_CRASH_P = 0.003
#: The metadata workload creates at most this many topics (then only adds partitions, up to 4 each).
METADATA_TOPICS_MAX = 4
#: Error codes that mean a PUBLISH was certainly not appended (rejected before the append).
DEFINITE_PUBLISH_ERRORS = frozenset({
    "invalid_acks", "invalid_seq_num", "idempotency_gap", "stale_producer_epoch", "missing_producer_id",
    "message_too_large", "topic_not_found", "invalid_partition", "partition_not_found", "empty_messages",
    "insufficient_in_sync_replicas", "transaction_metadata_forbidden", "invalid_topic_name",
})
#: Group errors after which a member must rejoin (spec section 6).
REJOIN_ERRORS = frozenset({"GEN_MISMATCH", "NOT_OWNER", "member_not_found", "group_not_found",
                           "REBALANCE_IN_PROGRESS", "rebalance_in_progress", "NOT_COORDINATOR",
                           "coordinator_not_available", "unknown_member", "illegal_generation"})
TRANSPORT_ERRORS = (OSError, ProtocolError)


@dataclass(frozen=True, slots=True)
class TopicPlan:
    """A topic the workloads use: name, partition count, hosting node index, idempotent flag."""

    name: str
    partitions: int
    node: int
    idempotent: bool = False


@dataclass(slots=True)
class Context:
    """What every worker shares.

    Attributes:
        history: the run history.
        cluster: the nodes.
        topics: the topics (and where they live).
        seed: the run seed (each worker derives its own ``random.Random`` from it and its name).
        stop: set when workers should finish their current operation and exit.
        workers: every started worker (for :meth:`quiesce`).
        harness_errors: unexpected exceptions in workers (harness bugs), reported as errors.
    """

    history: History
    cluster: Cluster
    topics: list[TopicPlan]
    seed: int
    stop: threading.Event = field(default_factory=threading.Event)
    workers: list[Worker] = field(default_factory=list)
    harness_errors: list[str] = field(default_factory=list)
    #: Cluster runs: the :class:`chaos.cluster.LeaderTracker` that routes requests to partition leaders.
    leaders: Any = None

    @property
    def clock(self) -> Clock:
        """The run clock."""
        return self.history.clock

    def node(self, topic: TopicPlan) -> Node:
        """The node hosting ``topic``."""
        return self.cluster.nodes[topic.node]

    @property
    def clustered(self) -> bool:
        """True when the nodes form one Raft cluster (requests go to partition leaders)."""
        return self.leaders is not None

    def target(self, topic: TopicPlan, partition: int) -> Node:
        """Where a request for ``topic/partition`` goes: its leader in a cluster (a random up node while the
        leader is unknown), the hosting node standalone."""
        if self.leaders is None:
            return self.node(topic)
        return self.target_name(topic.name, partition)

    def coordinator(self, group: str) -> Node:
        """The node coordinating ``group`` (cluster runs; any up node while it is unknown)."""
        index = self.leaders.coordinator_of(group) if self.leaders is not None else None
        if index is None:
            up = [n for n in self.cluster.nodes if n.state == "up"] or self.cluster.nodes
            return random.choice(up)
        return self.cluster.nodes[index]

    def target_name(self, topic: str, partition: int) -> Node:
        """The leader of ``topic/partition`` by name (cluster runs; any up node while it is unknown)."""
        index = self.leaders.leader_of(topic, partition)
        if index is None:
            up = [n for n in self.cluster.nodes if n.state == "up"] or self.cluster.nodes
            return random.choice(up)
        return self.cluster.nodes[index]

    def quiesce(self, before: float, timeout_s: float = 10.0) -> bool:
        """Wait until no request sent before clock time ``before`` is still waiting for its outcome."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(w.inflight_since is None or w.inflight_since > before for w in self.workers):
                return True
            time.sleep(0.01)
        return False


def error_text(frame: Frame) -> tuple[str, str, ErrorClass | None]:
    """``(code, rendered text, class)`` of an ERROR frame (code ``undecodable_error`` if it is garbage)."""
    try:
        err = decode_error(frame.payload)
    except (ProtocolError, ValueError) as exc:
        return "undecodable_error", f"undecodable ERROR payload: {exc}", None
    return err.code, err.render(), ErrorClass(err.error_class)


def describe(exc: BaseException) -> str:
    """``Type: message`` for an exception."""
    return f"{type(exc).__name__}: {exc}"


class Worker(threading.Thread):
    """A client thread: one connection at a time, a seeded RNG, and bookkeeping for quiesce.

    Subclasses implement :meth:`step` (one operation, or a few).
    """

    def __init__(self, name: str, ctx: Context) -> None:
        super().__init__(name=name, daemon=True)
        self.ctx = ctx
        self.rng = random.Random(f"cursus-chaos-worker:{ctx.seed}:{name}")
        self.conn: Connection | None = None
        self.conn_node: Node | None = None
        #: Clock time the request now awaiting its outcome was sent, or None.
        self.inflight_since: float | None = None
        self.errors = 0
        #: Set by a worker that has nothing more to do (for example, groups unavailable).
        self.done = False

    @property
    def history(self) -> History:
        """The run history."""
        return self.ctx.history

    def run(self) -> None:
        """Call :meth:`step` until stop is requested; unexpected exceptions are counted as harness errors."""
        try:
            while not self.ctx.stop.is_set() and not self.done:
                try:
                    self.step()
                except Exception as exc:  # noqa: BLE001 - a harness bug must not kill the run silently
                    self.inflight_since = None
                    self.errors += 1
                    self.ctx.harness_errors.append(f"{self.name}: {describe(exc)}")
                    self.drop()
                    if self.errors >= WORKER_ERRORS_MAX:
                        return
                    time.sleep(0.1)
                self.think()
        finally:
            self.finish()
            self.drop()

    def step(self) -> None:
        """One unit of work (overridden)."""
        raise NotImplementedError

    def finish(self) -> None:
        """Called once when the worker exits (overridden by group consumers to leave)."""

    def think(self) -> None:
        """Sleep a little between operations."""
        time.sleep(self.rng.uniform(THINK_S_MIN, THINK_S_MAX))

    def connection(self, node: Node) -> Connection | None:
        """The connection to ``node``, opened if needed; None (after a short sleep) if it cannot be opened."""
        if self.conn is not None and not self.conn.closed and self.conn_node is node:
            return self.conn
        self.drop()
        if node.port == 0:
            time.sleep(0.1)
            return None
        try:
            self.conn = Connection(*node.address, timeout_s=TIMEOUT_S)
            self.conn_node = node
        except TRANSPORT_ERRORS:
            self.conn = None
            time.sleep(self.rng.uniform(0.05, 0.2))
        return self.conn

    def drop(self) -> None:
        """Close the current connection, if any."""
        if self.conn is not None:
            self.conn.close()
        self.conn = None
        self.conn_node = None

    def request(self, command: Command, payload: bytes) -> Frame:
        """Send on the current connection, tracking the in-flight time for quiesce (raises transport errors)."""
        assert self.conn is not None
        self.inflight_since = self.ctx.clock.now()
        try:
            return self.conn.request(command, payload)
        except TRANSPORT_ERRORS:
            self.drop()
            raise

    def text(self, node: Node, process: str, f: str, command: str, value: dict[str, Any],
             parse: Callable[[str], dict[str, Any]] | None = None) -> tuple[str, dict[str, Any], str | None]:
        """Run one text command as a recorded operation; return ``(type, result, error code)``.

        An ERROR reply is ``fail`` (group and offset commands are not applied when refused); a transport
        failure after sending is ``info``. ``parse`` turns the OK text into the result.
        """
        conn = self.connection(node)
        if conn is None:
            return "", {}, None
        cmd, payload = parse_command_text(command)
        pending = self.history.invoke(process, f, value)
        try:
            frame = self.request(cmd, encode_crq2(payload))
        except TRANSPORT_ERRORS as exc:
            self.history.complete(pending, INFO, error=describe(exc))
            self.inflight_since = None
            return INFO, {}, None
        if frame.status == Status.ERROR:
            code, rendered, _ = error_text(frame)
            self.history.complete(pending, FAIL, {"code": code}, error=rendered)
            self.inflight_since = None
            return FAIL, {}, code
        raw = frame.payload.decode("utf-8", "replace")
        try:
            result = parse(raw) if parse is not None else {"reply": raw[:200]}
        except ValueError as exc:
            self.history.complete(pending, INFO, {"reply": raw[:200]}, error=f"unparseable reply: {exc}")
            self.inflight_since = None
            return INFO, {}, None
        self.history.complete(pending, OK, result)
        self.inflight_since = None
        return OK, result, None


# ------------------------------------------------------------------------------------------ producers


class Producer(Worker):
    """Base of the producers: chooses topic, partition, key and unique values.

    Args:
        name: process name (values are ``<name>:<n>``).
        ctx: the shared context.
        topics: the topics it writes to.
        keyed: route by key (FNV-1a 64 of the key) instead of a random partition.
    """

    acks = "1"
    idempotent = False

    def __init__(self, name: str, ctx: Context, topics: list[TopicPlan], *, keyed: bool) -> None:
        super().__init__(name, ctx)
        assert topics, "a producer needs a topic"
        self.topics = topics
        self.keyed = keyed
        self.counter = 0

    def choose(self) -> tuple[TopicPlan, int, str | None, list[str]]:
        """Topic, partition, key and fresh values for the next batch."""
        topic = self.rng.choice(self.topics)
        key = None
        if self.keyed:
            key = f"k{self.rng.randrange(KEY_COUNT)}"
            partition = partition_for_key(key, topic.partitions)
        else:
            partition = self.rng.randrange(topic.partitions)
        values = []
        for _ in range(self.rng.randint(1, BATCH_VALUES_MAX)):
            values.append(f"{self.name}:{self.counter}")
            self.counter += 1
        return topic, partition, key, values

    def batch(self, topic: TopicPlan, partition: int, key: str | None, values: list[str], *,
              producer: tuple[str, int, int] | None) -> bytes:
        """The CBV2 batch bytes; ``producer`` is (id, epoch, first sequence) for idempotent batches."""
        records = []
        for i, value in enumerate(values):
            record = Record(topic=topic.name, partition=partition, payload=value.encode(), key=key,
                            producer_id=self.name)
            if producer is not None:
                record.producer_id, record.producer_epoch, record.seq_num = producer[0], producer[1], producer[2] + i
            records.append(record)
        return encode_batch(Batch(topic=topic.name, partition=partition, acks=self.acks, records=records,
                                  idempotent=self.idempotent))

    def attempt(self, node: Node, payload: bytes) -> tuple[str, dict[str, Any], str | None, str | None]:
        """One PUBLISH attempt: ``(outcome, result, error text, error code)``; outcome "" = not connected."""
        conn = self.connection(node)
        if conn is None:
            return "", {}, "not connected", None
        try:
            frame = self.request(Command.PUBLISH, payload)
        except TRANSPORT_ERRORS as exc:
            return INFO, {}, describe(exc), None
        if frame.status == Status.ERROR:
            code, rendered, error_class = error_text(frame)
            definite = code in DEFINITE_PUBLISH_ERRORS or error_class in (ErrorClass.VALIDATION,
                                                                           ErrorClass.AUTHORIZATION)
            return (FAIL if definite else INFO), {"code": code}, rendered, code
        try:
            doc = json.loads(frame.payload)
        except ValueError as exc:
            return INFO, {}, f"PUBLISH reply is not JSON: {exc}", None
        if not isinstance(doc, dict) or doc.get("status") != "OK" or not isinstance(doc.get("last_offset"), int):
            code = str(doc.get("error_code") or doc.get("error") or "bad_ack") if isinstance(doc, dict) else "bad_ack"
            return INFO, {}, f"PUBLISH reply not OK: {str(doc)[:200]}", code
        return OK, {"last_offset": doc["last_offset"]}, None, None


class PlainProducer(Producer):
    """acks=1 producer; never retries, so an unknown outcome stays ``info``."""

    acks = "1"

    def step(self) -> None:
        """Send one batch."""
        topic, partition, key, values = self.choose()
        node = self.ctx.target(topic, partition)
        if self.connection(node) is None:
            return
        payload = self.batch(topic, partition, key, values, producer=None)
        pending = self.history.invoke(self.name, "send", {
            "topic": topic.name, "partition": partition, "key": key, "values": values, "acks": self.acks,
            "idempotent": False})
        outcome, result, error, _ = self.attempt(node, payload)
        if outcome == OK:
            last = result["last_offset"]
            result = {"offsets": list(range(last - len(values) + 1, last + 1))}
        elif outcome == "":
            outcome = INFO  # the connection dropped between the check and the attempt
        self.history.complete(pending, outcome, result, error=error)
        self.inflight_since = None


class IdempotentProducer(Producer):
    """acks=all idempotent producer: retries an unknown outcome with the same sequence numbers."""

    acks = "all"
    idempotent = True

    def __init__(self, name: str, ctx: Context, topics: list[TopicPlan], *, keyed: bool) -> None:
        super().__init__(name, ctx, topics, keyed=keyed)
        self.epoch = 1
        self.next_seq: dict[tuple[str, int], int] = {}

    def new_epoch(self) -> None:
        """Start a new producer session: a higher epoch fences the old one and sequences restart at 1."""
        self.epoch += 1
        self.next_seq.clear()

    def step(self) -> None:
        """Send one batch, retrying unknown outcomes within :data:`RETRY_WINDOW_S`."""
        topic, partition, key, values = self.choose()
        node = self.ctx.target(topic, partition)
        if self.connection(node) is None:
            return
        seq = self.next_seq.get((topic.name, partition), 1)
        payload = self.batch(topic, partition, key, values, producer=(self.name, self.epoch, seq))
        pending = self.history.invoke(self.name, "send", {
            "topic": topic.name, "partition": partition, "key": key, "values": values, "acks": self.acks,
            "idempotent": True, "producer": self.name, "epoch": self.epoch, "seq": seq})
        outcome, result, error, code = self._until_resolved(pending, topic, partition, payload)
        if outcome == OK:
            last = result["last_offset"]
            result["offsets"] = list(range(last - len(values) + 1, last + 1))
            del result["last_offset"]
            self.next_seq[(topic.name, partition)] = seq + len(values)
        self.history.complete(pending, outcome, result, error=error)
        self.inflight_since = None
        if outcome != OK:
            self.new_epoch()  # a failed or unresolved batch leaves a gap: start a new session

    def _until_resolved(self, pending: Pending, topic: TopicPlan, partition: int,
                        payload: bytes) -> tuple[str, dict[str, Any], str | None, str | None]:
        deadline = time.monotonic() + RETRY_WINDOW_S
        stop_deadline: float | None = None
        attempts = 0
        last_error = "no attempt made"
        while True:
            node = self.ctx.target(topic, partition)  # a retry follows the leader (same sequence numbers)
            outcome, result, error, code = self.attempt(node, payload)
            if outcome in (OK, FAIL):  # in flight until step() has recorded it (see Context.quiesce)
                result["attempts"] = attempts + 1
                if outcome == FAIL and attempts:
                    # A refusal of a retry says nothing about the earlier attempts with unknown outcome (one
                    # may have been appended): the operation stays unknown.
                    return INFO, result, f"retry refused after {attempts} unknown attempts: {error}", code
                return outcome, result, error, code
            self.inflight_since = None
            attempts += outcome == INFO
            last_error = error or last_error
            now = time.monotonic()
            if self.ctx.stop.is_set() and stop_deadline is None:
                stop_deadline = now + STOP_GRACE_S
            if now > deadline or (stop_deadline is not None and now > stop_deadline):
                return INFO, {"attempts": attempts}, f"gave up after {attempts} attempts: {last_error}", code
            time.sleep(self.rng.uniform(0.05, 0.25))


# ------------------------------------------------------------------------------------------ readers


def decode_records(payload: bytes) -> list[list[Any]]:
    """``[[offset, value, key], ...]`` of a CONSUME reply (an empty payload is no records).

    Raises:
        ProtocolError: the payload is not a valid CBV2 batch.
    """
    if not payload:
        return []
    batch = decode_batch(payload)
    return [[r.offset, r.payload.decode("utf-8", "backslashreplace"), r.key] for r in batch.records]


class Reading:
    """A recorded CONSUME: shared by direct readers, group consumers and the drain."""

    @staticmethod
    def consume(worker: Worker, node: Node, process: str, value: dict[str, Any], command: str
                ) -> tuple[str, list[list[Any]], str | None]:
        """Run ``command`` (a CONSUME) as a ``read`` op; return ``(type, records, error code)``.

        An undecodable batch is an ``ok`` read with ``corrupt`` set (wrong bytes were served).
        """
        conn = worker.connection(node)
        if conn is None:
            return "", [], None
        cmd, payload = parse_command_text(command)
        if worker.ctx.clustered:
            value = {**value, "node": node.index}  # which broker served it (cluster diagnosis)
        pending = worker.history.invoke(process, "read", value)
        try:
            frame = worker.request(cmd, encode_crq2(payload))
        except TRANSPORT_ERRORS as exc:
            worker.history.complete(pending, INFO, error=describe(exc))
            worker.inflight_since = None
            return INFO, [], None
        try:
            if frame.status == Status.ERROR:
                code, rendered, _ = error_text(frame)
                worker.history.complete(pending, FAIL, {"code": code}, error=rendered)
                return FAIL, [], code
            try:
                records = decode_records(frame.payload)
            except (ProtocolError, ValueError) as exc:
                worker.history.complete(pending, OK, {"records": [], "corrupt": describe(exc),
                                                      "payload_head": frame.payload[:64].hex()})
                return OK, [], "corrupt"
            worker.history.complete(pending, OK, {"records": records})
            return OK, records, None
        finally:
            worker.inflight_since = None  # only after the outcome is in the history (see Context.quiesce)


class DirectReader(Worker):
    """CONSUME from chosen offsets, in sessions that read one partition forward."""

    def __init__(self, name: str, ctx: Context, topics: list[TopicPlan]) -> None:
        super().__init__(name, ctx)
        self.topics = topics
        self.session: tuple[TopicPlan, int] | None = None
        self.session_id = ""
        self.sessions = 0
        self.position = 0
        self.reads_left = 0
        self.seen_end: dict[tuple[str, int], int] = {}

    def new_session(self) -> None:
        """Pick a partition and a start offset: the log start, near the tail, or a random offset seen."""
        topic = self.rng.choice(self.topics)
        partition = self.rng.randrange(topic.partitions)
        end = self.seen_end.get((topic.name, partition), 0)
        choice = self.rng.random()
        if choice < 0.3 or end == 0:
            start = 0
        elif choice < 0.7:
            start = max(0, end - self.rng.randint(0, 40))
        else:
            start = self.rng.randint(0, end)
        self.sessions += 1
        self.session = (topic, partition)
        self.session_id = f"{self.name}/{self.sessions}"
        self.position = start
        self.reads_left = self.rng.randint(5, 60)

    def end_session(self) -> None:
        """Forget the session (the next step starts a new one)."""
        self.session = None

    def step(self) -> None:
        """One CONSUME in the current session."""
        if self.session is None or self.reads_left <= 0:
            self.new_session()
        assert self.session is not None
        topic, partition = self.session
        node = self.ctx.target(topic, partition)
        batch = self.rng.randint(1, 64)
        wait_ms = self.rng.choice((0, 0, 100, 250))
        value = {"topic": topic.name, "partition": partition, "offset": self.position, "session": self.session_id,
                 "batch": batch}
        command = (f"CONSUME topic={topic.name} partition={partition} offset={self.position} "
                   f"member={self.name} batch={batch} wait_ms={wait_ms}")
        kind, records, _ = Reading.consume(self, node, self.name, value, command)
        self.reads_left -= 1
        if kind == "":
            return
        if kind != OK:
            self.end_session()
            return
        if records:
            self.position = records[-1][0] + 1
            key = (topic.name, partition)
            self.seen_end[key] = max(self.seen_end.get(key, 0), self.position)
        time.sleep(self.rng.uniform(READER_PAUSE_S_MIN, READER_PAUSE_S_MAX))


class StreamConsumer(Worker):
    """STREAM (continuous push) sessions: open a stream on one partition's leader at a chosen offset, record
    every pushed frame as a ``read`` op of the session (``value.stream: true``; a keepalive is an ok read
    with no records), close after a few frames. The session checker sees every frame in order, so a pushed
    record going back or skipping is found like a CONSUME one.
    """

    def __init__(self, name: str, ctx: Context, topics: list[TopicPlan]) -> None:
        super().__init__(name, ctx)
        self.topics = topics
        self.stream: tuple[TopicPlan, int] | None = None
        self.session_id = ""
        self.sessions = 0
        self.position = 0
        self.frames_left = 0
        self.request_id = 0
        self.seen_end: dict[tuple[str, int], int] = {}

    def open(self) -> None:
        """Open a stream (a fresh connection to the partition's leader)."""
        self.drop()
        topic = self.rng.choice(self.topics)
        partition = self.rng.randrange(topic.partitions)
        end = self.seen_end.get((topic.name, partition), 0)
        start = 0 if self.rng.random() < 0.3 or end == 0 else max(0, end - self.rng.randint(0, 40))
        node = self.ctx.target(topic, partition)
        conn = self.connection(node)
        if conn is None:
            return
        self.sessions += 1
        self.session_id = f"{self.name}/{self.sessions}"
        self.position = start
        self.frames_left = self.rng.randint(5, 40)
        cmd, payload = parse_command_text(f"STREAM topic={topic.name} partition={partition} offset={start} "
                                          f"batch={self.rng.randint(1, 64)}")
        try:
            self.request_id = conn.send(cmd, encode_crq2(payload))
        except TRANSPORT_ERRORS:
            self.drop()
            return
        self.stream = (topic, partition)

    def close(self) -> None:
        """End the session (drop the connection: the broker closes the stream)."""
        self.stream = None
        self.drop()

    def step(self) -> None:
        """Receive one frame of the current stream (opening one if needed)."""
        if self.stream is None or self.frames_left <= 0 or self.conn is None:
            self.close()
            self.open()
            if self.stream is None:
                time.sleep(0.1)
                return
        assert self.stream is not None and self.conn is not None
        topic, partition = self.stream
        pending = self.history.invoke(self.name, "read", {
            "topic": topic.name, "partition": partition, "offset": self.position, "session": self.session_id,
            "stream": True, "node": self.conn_node.index if self.conn_node is not None else None})
        self.inflight_since = self.ctx.clock.now()
        try:
            self.conn.sock.settimeout(STREAM_FRAME_TIMEOUT_S)
            frame = self.conn.read_frame()
        except TRANSPORT_ERRORS as exc:
            self.history.complete(pending, INFO, error=describe(exc))
            self.inflight_since = None
            self.close()
            return
        self.frames_left -= 1
        try:
            if frame.status == Status.ERROR:
                code, rendered, _ = error_text(frame)
                self.history.complete(pending, FAIL, {"code": code}, error=rendered)
                self.close()
                return
            if frame.status == Status.STREAM_END:
                text = frame.payload.decode("utf-8", "replace")
                self.history.complete(pending, FAIL, {"code": "stream_end", "reply": text[:200]}, error=text[:200])
                self.close()
                return
            try:
                records = decode_records(frame.payload)
            except (ProtocolError, ValueError) as exc:
                self.history.complete(pending, OK, {"records": [], "corrupt": describe(exc),
                                                    "payload_head": frame.payload[:64].hex()})
                self.close()
                return
            self.history.complete(pending, OK, {"records": records})
            if records:
                self.position = records[-1][0] + 1
                key = (topic.name, partition)
                self.seen_end[key] = max(self.seen_end.get(key, 0), self.position)
        finally:
            self.inflight_since = None


class OffsetsPoller(Worker):
    """LIST_OFFSETS of every topic on one node, over and over (HWM and log start must never go back)."""

    def __init__(self, name: str, ctx: Context, node_index: int) -> None:
        super().__init__(name, ctx)
        self.node_index = node_index
        self.topics = [t for t in ctx.topics if t.node == node_index]

    def step(self) -> None:
        """One LIST_OFFSETS per topic (cluster: per partition, on its leader)."""
        if self.ctx.clustered:
            self.step_cluster()
            return
        node = self.ctx.cluster.nodes[self.node_index]
        for topic in self.topics:
            self.text(node, self.name, "list-offsets", f"LIST_OFFSETS topic={topic.name}",
                      {"topic": topic.name}, parse_list_offsets)
        time.sleep(self.rng.uniform(0.1, 0.3))

    def step_cluster(self) -> None:
        """LIST_OFFSETS ``partition=`` of every partition this poller owns, asked of its leader."""
        for topic in self.topics:
            for partition in range(topic.partitions):
                node = self.ctx.target(topic, partition)
                self.text(node, self.name, "list-offsets", f"LIST_OFFSETS topic={topic.name} partition={partition}",
                          {"topic": topic.name, "partition": partition, "node": node.index}, parse_list_offsets)
        time.sleep(self.rng.uniform(0.1, 0.3))


class MetadataWorker(Worker):
    """Metadata operations while faults run: CREATE of new topics, then partition increases (CREATE of an
    existing topic with more partitions). Recorded as ``create`` ops ``{topic, partitions}``; an unknown
    outcome is retried (CREATE is presence-aware, so a retry of an applied create is a no-op)."""

    def __init__(self, name: str, ctx: Context) -> None:
        super().__init__(name, ctx)
        self.created: dict[str, int] = {}
        self.counter = 0

    def step(self) -> None:
        """One CREATE (new topic, or one more partition on a topic this worker created)."""
        if self.created and (self.rng.random() < 0.5 or self.counter >= METADATA_TOPICS_MAX):
            topic = self.rng.choice(sorted(self.created))
            partitions = self.created[topic] + 1
            if partitions > 4:
                time.sleep(1.0)
                return
        else:
            topic = f"chaos-meta-{self.counter}"
            partitions = 1
        node = self.rng.choice(self.ctx.cluster.nodes)
        if node.state != "up":
            return
        kind, _, _ = self.text(node, self.name, "create", f"CREATE topic={topic} partitions={partitions}",
                               {"topic": topic, "partitions": partitions})
        if kind == OK:
            if topic not in self.created:
                self.counter += 1
            self.created[topic] = partitions
        time.sleep(self.rng.uniform(2.0, 5.0))


def parse_list_offsets(text: str) -> dict[str, Any]:
    """``{"partitions": {"0": {"earliest":..,"latest":..,"leo":..,"hwm":..}}}`` from a LIST_OFFSETS reply.

    Raises:
        ValueError: the reply is not in the spec's format.
    """
    fields = ok_text_fields(text)
    out: dict[str, dict[str, int]] = {}
    for entry in fields.get("offsets", "").split(","):
        if not entry:
            continue
        head, *parts = entry.split(":")
        if not head.startswith("P") or len(parts) != 4:
            raise ValueError(f"bad LIST_OFFSETS entry {entry!r}")
        values = dict(part.split("=", 1) for part in parts)
        out[head[1:]] = {k: int(values[k]) for k in ("earliest", "latest", "leo", "hwm")}
    return {"partitions": out}


# ------------------------------------------------------------------------------------------ groups


class GroupGate:
    """Decides once whether consumer groups are available (the first JOIN_GROUP tells)."""

    def __init__(self) -> None:
        self.decided = threading.Event()
        self.available: bool | None = None
        self.reason = ""

    def decide(self, available: bool, reason: str = "") -> None:
        """Record the decision (first caller wins)."""
        if not self.decided.is_set():
            self.available = available
            self.reason = reason
            self.decided.set()


_DIGITS = re.compile(r"\d+")


def parse_assignments(text: str) -> list[int] | None:
    """The partitions between the first ``[`` and the first ``]`` (facts A6), or None without brackets."""
    if "assignments=" not in text:
        return None
    start, end = text.find("["), text.find("]")
    if start < 0 or end < start:
        return None
    return sorted({int(d) for d in _DIGITS.findall(text[start + 1:end])})


def parse_join(text: str) -> dict[str, Any]:
    """``{"generation", "member", "assignments"}`` of a JOIN_GROUP or SYNC_GROUP reply."""
    fields = ok_text_fields(text)
    out: dict[str, Any] = {"assignments": parse_assignments(text)}
    if "generation" in fields:
        out["generation"] = int(fields["generation"])
    if "member" in fields:
        out["member"] = fields["member"]
    return out


def parse_offset(text: str) -> dict[str, Any]:
    """``{"offset": N}`` of a FETCH_OFFSET reply."""
    return {"offset": int(ok_text_fields(text)["offset"])}


class GroupConsumer(Worker):
    """A consumer-group member: join, sync, fetch offsets, consume, process, commit, heartbeat, crash.

    Args:
        name: process name.
        ctx: shared context.
        topic: the topic the group consumes.
        group: the group name.
        gate: decides whether groups are available; the member with ``leader=True`` probes first.
    """

    def __init__(self, name: str, ctx: Context, topic: TopicPlan, group: str, gate: GroupGate, *,
                 leader: bool) -> None:
        super().__init__(name, ctx)
        self.topic = topic
        self.group = group
        self.gate = gate
        self.leader = leader
        self.member: str | None = None
        self.generation = 0
        #: The full member id the broker gave us and its last generation: a rejoin after a rebalance or a
        #: broker restart resumes this member instead of adding a new one (which would rebalance again).
        self.full_id: str | None = None
        self.last_generation = 0
        self.positions: dict[int, int] = {}
        self.last_heartbeat = 0.0
        self.incarnation = 0
        self.sessions = 0
        self.session_ids: dict[int, str] = {}

    @property
    def node(self) -> Node:
        """The group's coordinator (standalone: the node hosting the topic; cluster: the group's ring owner)."""
        if self.ctx.clustered:
            return self.ctx.coordinator(self.group)
        return self.ctx.node(self.topic)

    def value(self, **extra: Any) -> dict[str, Any]:
        """Common fields of this member's operation values."""
        return {"group": self.group, "topic": self.topic.name, "member": self.member,
                "generation": self.generation, **extra}

    def step(self) -> None:
        """Join if needed, then consume, process and commit one partition."""
        if not self.gate.decided.is_set() and not self.leader:
            self.gate.decided.wait(0.2)
            return
        if self.gate.available is False:
            self.done = True
            return
        if self.member is None and not self.join_group():
            return
        if self.rng.random() < CONSUMER_CRASH_P:
            self.crash()
            return
        if time.monotonic() - self.last_heartbeat >= HEARTBEAT_S and not self.heartbeat():
            return
        if not self.positions:
            time.sleep(0.1)
            return
        partition = self.rng.choice(sorted(self.positions))
        self.consume_and_commit(partition)

    def join_group(self) -> bool:
        """JOIN_GROUP then SYNC_GROUP, then FETCH_OFFSET for every assigned partition."""
        requested = self.full_id or f"{self.name}-i{self.incarnation}"
        command = f"JOIN_GROUP topic={self.topic.name} group={self.group} member={requested}"
        if self.full_id is not None and self.last_generation:
            command += f" generation={self.last_generation}"  # resume this member id (no new member)
        kind, result, code = self.text(
            self.node, self.name, "join", command,
            {"group": self.group, "topic": self.topic.name, "member": requested,
             "generation": self.last_generation if self.full_id else None}, parse_join)
        if code == "UNSUPPORTED_FEATURE":
            self.gate.decide(False, "skipped: groups unavailable (JOIN_GROUP answered UNSUPPORTED_FEATURE)")
            return False
        if kind != OK or "generation" not in result:
            time.sleep(0.2)
            return False
        self.gate.decide(True)
        self.member = result.get("member") or requested
        self.generation = result["generation"]
        self.full_id = self.member
        self.last_generation = self.generation
        assignments = result.get("assignments")
        kind, synced, _ = self.text(
            self.node, self.name, "sync",
            f"SYNC_GROUP topic={self.topic.name} group={self.group} member={self.member} "
            f"generation={self.generation}", self.value(), parse_join)
        if kind == OK and synced.get("assignments") is not None:
            assignments = synced["assignments"]
        elif kind != OK:
            self.forget()
            return False
        self.positions = {}
        for partition in assignments or []:
            kind, fetched, _ = self.text(
                self.node, self.name, "fetch-offset",
                f"FETCH_OFFSET topic={self.topic.name} partition={partition} group={self.group}",
                {"group": self.group, "topic": self.topic.name, "partition": partition}, parse_offset)
            if kind != OK:
                self.forget()
                return False
            self.positions[partition] = fetched["offset"]
            self.sessions += 1
            self.session_ids[partition] = f"{self.name}/{self.member}/g{self.generation}/p{partition}/{self.sessions}"
        self.last_heartbeat = time.monotonic()
        return True

    def forget(self) -> None:
        """Drop membership state (the next step rejoins, resuming :attr:`full_id`)."""
        self.member = None
        self.generation = 0
        self.positions = {}

    def heartbeat(self) -> bool:
        """HEARTBEAT; False (and rejoin next step) on any error."""
        self.last_heartbeat = time.monotonic()
        kind, _, _ = self.text(
            self.node, self.name, "heartbeat",
            f"HEARTBEAT topic={self.topic.name} group={self.group} member={self.member} generation={self.generation}",
            self.value())
        if kind != OK:
            self.forget()
            return False
        return True

    def consume_and_commit(self, partition: int) -> None:
        """Read from the member's position, process (record), then commit ``last + 1``."""
        position = self.positions[partition]
        batch = self.rng.randint(1, 40)
        value = self.value(partition=partition, offset=position, session=self.session_ids[partition])
        kind, records, _ = Reading.consume(
            self, self.ctx.target(self.topic, partition), self.name, value,
            f"CONSUME topic={self.topic.name} partition={partition} offset={position} member={self.member} "
            f"batch={batch}")
        if kind != OK:
            self.forget()
            return
        if not records:
            time.sleep(0.03)
            return
        next_offset = records[-1][0] + 1
        if self.rng.random() < 0.3:  # BATCH_COMMIT for one partition (the same contract as COMMIT_OFFSET)
            command = (f"BATCH_COMMIT topic={self.topic.name} group={self.group} member={self.member} "
                       f"generation={self.generation} offsets=P{partition}:{next_offset}")
            value = self.value(partition=partition, offset=next_offset, batch=True)
        else:
            command = (f"COMMIT_OFFSET topic={self.topic.name} partition={partition} group={self.group} "
                       f"offset={next_offset} member={self.member} generation={self.generation}")
            value = self.value(partition=partition, offset=next_offset)
        kind, _, code = self.text(self.node, self.name, "commit", command, value)
        if kind == OK:
            self.positions[partition] = next_offset
        else:
            self.forget()

    def crash(self) -> None:
        """Drop the connection without leaving the group, wait, and rejoin as a new member."""
        pending = self.history.invoke(self.name, "crash", self.value())
        self.drop()
        self.history.complete(pending, INFO, error="consumer crashed (connection dropped, no LEAVE_GROUP)")
        self.forget()
        self.full_id = None  # a crashed consumer comes back as a new member
        self.last_generation = 0
        self.incarnation += 1
        time.sleep(self.rng.uniform(0.3, 2.0))

    def finish(self) -> None:
        """Leave the group on a clean exit (best effort)."""
        if self.member is not None:
            self.text(self.node, self.name, "leave",
                      f"LEAVE_GROUP topic={self.topic.name} group={self.group} member={self.member}", self.value())


# ------------------------------------------------------------------------------------------ setup/drain


class Admin(Worker):
    """A worker used only from the runner thread (setup and drain); never started as a thread."""

    def step(self) -> None:
        """Not used."""
        raise AssertionError("Admin is not a thread")


def create_topics(ctx: Context, timeout_s: float = 20.0) -> None:
    """CREATE every planned topic on its node (retried until ``timeout_s``).

    Raises:
        RuntimeError: a topic could not be created.
    """
    admin = Admin("setup", ctx)
    for topic in ctx.topics:
        deadline = time.monotonic() + timeout_s
        while True:
            kind, _, code = admin.text(
                ctx.node(topic) if not ctx.clustered else ctx.cluster.nodes[0], "setup", "create",
                f"CREATE topic={topic.name} partitions={topic.partitions} "
                f"idempotent={'true' if topic.idempotent else 'false'}",
                {"topic": topic.name, "partitions": topic.partitions})
            if kind == OK:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"cannot create topic {topic.name}: {kind} {code}")
            time.sleep(0.2)
    admin.drop()


def drain(ctx: Context, groups: list[tuple[str, TopicPlan]], timeout_s: float = 60.0) -> list[str]:
    """Read every partition from its log start to its HWM, then fetch each group's committed offsets.

    Operations are recorded under the process ``drain``; reads carry ``"final": true``. The ``timeout_s``
    budget is shared between partitions (:func:`chaos.drainplan.drain_all`: a first-pass share each, then
    the rest for the partitions cut short), so one unreadable partition cannot starve the others. A
    partition that could not be drained to its HWM is recorded as a ``drain-incomplete`` operation (value
    ``{topic, partition, position, hwm, reason}``, type ``fail``) and returned as a problem, which makes
    the run invalid.
    """
    from chaos.drainplan import Progress, drain_all

    admin = Admin("drain", ctx)
    plans = {topic.name: topic for topic in ctx.topics}
    keys: list[tuple[str, int]] = [(topic.name, p) for topic in ctx.topics for p in range(topic.partitions)]
    topic_offsets: dict[str, dict[str, Any]] = {}  # one-broker runs: one LIST_OFFSETS per topic

    def list_offsets(topic: TopicPlan, partition: int, deadline: float) -> tuple[Node, dict[str, Any] | None]:
        node = ctx.node(topic) if not ctx.clustered else ctx.target(topic, partition)
        if not ctx.clustered and topic.name in topic_offsets:
            return node, topic_offsets[topic.name].get(str(partition))
        command = f"LIST_OFFSETS topic={topic.name}" + (f" partition={partition}" if ctx.clustered else "")
        while time.monotonic() < deadline:
            value: dict[str, Any] = {"topic": topic.name}
            if ctx.clustered:  # each partition from its final leader
                value.update(partition=partition, node=node.index)
            kind, result, _ = admin.text(node, "drain", "list-offsets", command, value, parse_list_offsets)
            if kind == OK:
                if not ctx.clustered:
                    topic_offsets[topic.name] = result["partitions"]
                return node, result["partitions"].get(str(partition))
            time.sleep(0.2)
            if ctx.clustered:
                node = ctx.target(topic, partition)
        return node, None

    def read(key: tuple[str, int], position: int | None, deadline: float) -> Progress:
        topic, partition = plans[key[0]], key[1]
        node, entry = list_offsets(topic, partition, deadline)
        if entry is None:
            return Progress(False, position, None, "no LIST_OFFSETS answer")
        start = max(int(entry["earliest"]), position if position is not None else 0)
        hwm = int(entry["hwm"])
        reached, reason = _drain_partition(admin, node, topic, partition, start, hwm, deadline)
        return Progress(reached >= hwm, reached, hwm, reason)

    problems: list[str] = []
    for key, progress in drain_all(keys, read, timeout_s).items():
        if progress.done:
            continue
        topic_name, partition = key
        pending = admin.history.invoke("drain", "drain-incomplete", {
            "topic": topic_name, "partition": partition, "position": progress.position, "hwm": progress.hwm,
            "reason": progress.reason})
        admin.history.complete(pending, FAIL, error=progress.reason)
        if progress.hwm is None:
            problems.append(f"drain: no LIST_OFFSETS for {topic_name}/{partition}")
        else:
            problems.append(f"drain: could not read {topic_name}/{partition} up to hwm {progress.hwm} "
                            f"(stopped at {progress.position}: {progress.reason})")
    for group, topic in groups:
        for partition in range(topic.partitions):
            admin.text(ctx.node(topic) if not ctx.clustered else ctx.coordinator(group),
                       "drain", "fetch-offset",
                       f"FETCH_OFFSET topic={topic.name} partition={partition} group={group}",
                       {"group": group, "topic": topic.name, "partition": partition, "final": True}, parse_offset)
    admin.drop()
    return problems


def _drain_partition(admin: Admin, node: Node, topic: TopicPlan, partition: int, start: int, hwm: int,
                     deadline: float) -> tuple[int, str]:
    """Read ``start`` .. ``hwm`` until the monotonic ``deadline``; returns ``(next offset, why it stopped
    short)`` (reason empty when the HWM was reached)."""
    position = start
    session = f"drain/{topic.name}/{partition}"
    while position < hwm:
        if time.monotonic() > deadline:
            return position, "time share used up"
        value = {"topic": topic.name, "partition": partition, "offset": position, "session": session,
                 "final": True}
        kind, records, code = Reading.consume(
            admin, node, "drain", value,
            f"CONSUME topic={topic.name} partition={partition} offset={position} member=drain batch=2000")
        if kind == OK and records:
            position = records[-1][0] + 1
        elif kind == OK:
            return position, "an empty read below the HWM"  # the drain cannot make progress
        else:
            time.sleep(0.2)
            if time.monotonic() > deadline:
                last = " ".join(x for x in (kind or "no connection", code or "") if x)
                return position, f"time share used up (last reply: {last})"
    return position, ""
