"""Group consumers: :class:`GroupConsumer` (blocking) and :class:`AsyncGroupConsumer` (asyncio).

A group consumer shares one topic, a topic list or the topics matching a pattern with the other members of
its consumer group (spec section 6 "Consumer Group Protocol", "SDK Offset and Group Contract"; REGISTER_GROUP
selectors, see :class:`GroupMembership`):

1. ``JOIN_GROUP`` (``SYNC_GROUP`` only when the join reply carries no assignment), then ``FETCH_OFFSET`` for
   every assigned partition: the broker's committed offset is where reading resumes (``auto_offset_reset``
   applies when nothing was committed: ``earliest``, ``latest``, or ``error`` via ``OFFSET_OUT_OF_RANGE``);
2. read the assigned partitions by polling ``CONSUME`` (``mode="poll"``, through
   :class:`~cursus.client.consumer.Consumer`) or by one ``STREAM`` per partition (``mode="stream"``, blocking
   flavour only);
3. commit ``lastProcessedOffset + 1``: :meth:`GroupConsumer.commit` commits everything :meth:`~GroupConsumer.poll`
   returned so far (records returned by poll count as processed when poll is called again, or when commit is
   called), with ``COMMIT_OFFSET`` for one partition and ``BATCH_COMMIT`` for several; ``auto_commit`` does
   this at most every ``auto_commit_interval_s`` from poll and on close;
4. ``HEARTBEAT`` every ``heartbeat_interval_s`` (3 s) from its own thread/task, on its own connection (a long
   poll never delays it);
5. on ``GEN_MISMATCH``, ``NOT_OWNER``, ``member_not_found`` or ``group_not_found`` (from a heartbeat or a
   commit) the consumer stops reading, commits the processed offsets of every partition it holds (under its
   own generation: the broker hands a partition to another member only once its holder has rejoined, left
   or expired), rejoins with its full member id, fetches the committed offsets of its new assignment and
   resumes. ``on_revoked(partitions)`` runs once the rejoin has given partitions up (their processed work is
   committed already), ``on_assigned(partitions)`` after the new assignment is known. A new member may get
   an empty assignment until the holders have rejoined; it waits (heartbeating) and rejoins.

Delivery is at least once: a record is committed only after poll returned it and the application came back
for more (or called commit); a consumer killed mid-batch leaves its uncommitted records to the next owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cursus.client.admin import parse_list_offsets
from cursus.client.aio import AsyncClient
from cursus.client.connection import (
    DEFAULT_ADDRESS,
    Address,
    Client,
    Connection,
    ConnectionOptions,
    ok_fields,
    ok_text_fields,
    options_from,
)
from cursus.client.consumer import AsyncConsumer, Consumer
from cursus.client.errors import (
    ClientClosedError,
    CursusError,
    OffsetOutOfRangeError,
    ProtocolViolationError,
    TlsError,
    error_from_frame,
)
from cursus.client.records import ConsumerRecord, decode_consumed_batch
from cursus.client.signals import sigterm_exits
from cursus.client.steps import StepDriver
from cursus.wire import Command, CommandPayload, Frame, ProtocolError, Status, encode_crq2

__all__ = ["AsyncGroupConsumer", "GroupConsumer", "GroupMembership", "PartitionKey", "REJOIN_CODES",
           "parse_topic_assignments"]

log = logging.getLogger("cursus.client.group")

#: Error codes that mean "this membership is over: stop, rejoin" (spec section 6, facts A6).
REJOIN_CODES = frozenset({"GEN_MISMATCH", "NOT_OWNER", "member_not_found", "group_not_found"})
_RESETS = ("earliest", "latest", "error")
_MODES = ("poll", "stream")
_R = TypeVar("_R")
_C = TypeVar("_C")

Callback = Callable[[list[Any]], Any]  # partition numbers, or (topic, partition) pairs


def _default_client_id() -> str:
    return f"consumer-{os.urandom(4).hex()}"


def parse_partition_list(text: str) -> list[int]:
    """The integers between the first ``[`` and ``]`` of ``text`` (commas or spaces; facts A6 JOIN_GROUP)."""
    start, end = text.find("["), text.find("]")
    if start < 0 or end < start:
        return []
    return sorted({int(tok) for tok in text[start + 1:end].replace(",", " ").split() if tok.strip()})


#: A partition as the group consumer names it: the partition number in a one-topic group, a
#: ``(topic, partition)`` pair in a group subscribed to a topic list or a pattern.
PartitionKey = Any


def parse_topic_assignments(text: str) -> list[tuple[str, int]]:
    """``t1:P0,t2:P3`` (facts A6 JOIN_GROUP/SYNC_GROUP ``topic_assignments=``) as sorted (topic, partition)
    pairs; empty text is no partitions. Raises ``ValueError`` for a malformed entry."""
    pairs = set()
    for entry in text.split(","):
        entry = entry.strip()
        if not entry:
            continue
        topic, sep, partition = entry.rpartition(":P")
        if not sep or not topic or not partition.isdigit():
            raise ValueError(f"malformed topic assignment {entry!r}")
        pairs.add((topic, int(partition)))
    return sorted(pairs)


@dataclass(slots=True)
class GroupMembership:
    """The group-consumer decisions without I/O: request fields, reply parsing, positions and commits.

    A group reads one topic (``topic``; partitions are keyed by number), or a topic list (``topics``) or an
    :mod:`fnmatch` pattern (``pattern``), which the broker expands to concrete topics (spec REGISTER_GROUP);
    then partitions are keyed by ``(topic, partition)`` pairs, the group is registered with that selector
    before the first JOIN, and JOIN/SYNC/HEARTBEAT/LEAVE omit ``topic=`` (replies carry
    ``topic_assignments=``).

    Attributes:
        topic, group, client_id: as configured (``topic`` is ``""`` for a topic list or pattern).
        topics, pattern: the multi-topic selector (empty / None for a one-topic group).
        member_id: the full id the broker gave (None before the first join).
        generation: the current generation (0 before the first join).
        assignment: owned partition keys, sorted.
        processed: partition key -> next offset after everything handed to the application.
        committed: partition key -> the offset last committed (or fetched) for it.
        rejoin_needed: a fencing error was seen; the next poll rejoins.
    """

    topic: str
    group: str
    client_id: str
    member_id: str | None = None
    generation: int = 0
    assignment: tuple[PartitionKey, ...] = ()
    rejoin_needed: bool = True
    processed: dict[PartitionKey, int] = field(default_factory=dict)
    committed: dict[PartitionKey, int] = field(default_factory=dict)
    topics: tuple[str, ...] = ()
    pattern: str | None = None

    @property
    def multi_topic(self) -> bool:
        """True for a topic-list or pattern subscription (keys are ``(topic, partition)``)."""
        return bool(self.topics) or self.pattern is not None

    def topic_partition(self, key: PartitionKey) -> tuple[str, int]:
        """``(topic, partition)`` of a partition key."""
        return (key[0], int(key[1])) if self.multi_topic else (self.topic, int(key))

    def key(self, topic: str, partition: int) -> PartitionKey:
        """The partition key of ``topic``/``partition``."""
        return (topic, partition) if self.multi_topic else partition

    def key_of(self, record: ConsumerRecord) -> PartitionKey:
        """The partition key of a consumed record."""
        return self.key(record.topic, record.partition)

    def register_fields(self) -> dict[str, str]:
        """REGISTER_GROUP fields of a multi-topic group (``topics=a,b`` or ``pattern=P``)."""
        if self.pattern is not None:
            return {"group": self.group, "pattern": self.pattern}
        return {"group": self.group, "topics": ",".join(self.topics)}

    def join_fields(self) -> dict[str, str]:
        """JOIN_GROUP fields; a member that had an id asks to keep it (``generation=`` marks the resume)."""
        fields = {"group": self.group, "member": self.member_id or self.client_id}
        if not self.multi_topic:
            fields = {"topic": self.topic, **fields}
        if self.member_id is not None:
            fields["generation"] = str(self.generation)
        return fields

    def on_join(self, reply: Mapping[str, str], raw: str) -> bool:
        """Apply a JOIN_GROUP reply; returns True when it carried an assignment (else SYNC_GROUP)."""
        self.member_id = reply.get("member") or self.member_id or self.client_id
        self.generation = int(reply.get("generation", "0"))
        if self.multi_topic:
            if "topic_assignments" not in reply:
                return False
            self.assignment = tuple(parse_topic_assignments(reply["topic_assignments"]))
            return True
        if "assignments=" in raw and "[" in raw:
            self.assignment = tuple(parse_partition_list(raw))
            return True
        return False

    def on_sync(self, raw: str) -> None:
        """Apply a SYNC_GROUP reply (the partitions in its first ``[...]``, or its ``topic_assignments=``)."""
        if self.multi_topic:
            self.assignment = tuple(parse_topic_assignments(ok_text_fields(raw).get("topic_assignments", "")))
        else:
            self.assignment = tuple(parse_partition_list(raw))

    def member_fields(self) -> dict[str, str]:
        """topic (one-topic groups), group, member and generation (HEARTBEAT, commits, SYNC_GROUP)."""
        assert self.member_id is not None
        fields = {"group": self.group, "member": self.member_id, "generation": str(self.generation)}
        return fields if self.multi_topic else {"topic": self.topic, **fields}

    def leave_fields(self) -> dict[str, str]:
        """LEAVE_GROUP fields (``topic=`` only for a one-topic group)."""
        assert self.member_id is not None
        fields = {"group": self.group, "member": self.member_id}
        return fields if self.multi_topic else {"topic": self.topic, **fields}

    def pending_commits(self, offsets: Mapping[PartitionKey, int] | None = None) -> dict[PartitionKey, int]:
        """Offsets to commit, minus those already committed at that value.

        Without ``offsets``: every processed position of an owned partition beyond its committed offset.
        With ``offsets``: all of them, as given (the broker refuses a lower offset with ``offset_regression``
        and a partition this member does not own with ``NOT_OWNER``; nothing is dropped silently).
        """
        if offsets is None:
            owned = set(self.assignment)
            return {p: o for p, o in sorted(self.processed.items())
                    if p in owned and o > self.committed.get(p, -1) and o >= 0}
        return {p: o for p, o in sorted(offsets.items()) if o != self.committed.get(p)}

    def commit_request(self, offsets: Mapping[PartitionKey, int]) -> tuple[Command, dict[str, str]]:
        """COMMIT_OFFSET for one partition, BATCH_COMMIT ``offsets=P<p>:<n>,...`` for several, all of one
        topic (see :meth:`commit_requests` for several topics)."""
        fields = self.member_fields()
        by_partition = {self.topic_partition(k): o for k, o in offsets.items()}
        topics = {t for t, _ in by_partition}
        assert len(topics) == 1, "one topic per commit request"
        (topic,) = topics
        if len(offsets) == 1:
            (((_, partition), offset),) = by_partition.items()
            return Command.COMMIT_OFFSET, {"topic": topic, "partition": str(partition), "group": self.group,
                                           "offset": str(offset), "member": fields["member"],
                                           "generation": fields["generation"]}
        fields = {"topic": topic, **{k: v for k, v in fields.items() if k != "topic"}}
        fields["offsets"] = ",".join(f"P{p}:{o}" for (_, p), o in sorted(by_partition.items()))
        return Command.BATCH_COMMIT, fields

    def commit_requests(self, offsets: Mapping[PartitionKey, int]) -> list[tuple[dict[PartitionKey, int], Step]]:
        """One commit request per topic (the commands are per topic): (its offsets, the request)."""
        by_topic: dict[str, dict[PartitionKey, int]] = {}
        for key, offset in sorted(offsets.items()):
            by_topic.setdefault(self.topic_partition(key)[0], {})[key] = offset
        return [(part, self.commit_request(part)) for _, part in sorted(by_topic.items())]

    def on_committed(self, offsets: Mapping[PartitionKey, int]) -> None:
        """Record a successful commit."""
        for p, o in offsets.items():
            self.committed[p] = max(o, self.committed.get(p, -1))

    @staticmethod
    def is_rejoin_error(err: BaseException) -> bool:
        """Whether ``err`` ends the membership (stop, rejoin)."""
        return isinstance(err, CursusError) and err.code in REJOIN_CODES

    def on_records(self, partition: PartitionKey, records: list[ConsumerRecord]) -> list[ConsumerRecord]:
        """Records handed to the application: drop any below the processed position, advance it."""
        floor = self.processed.get(partition, -1)
        kept = [r for r in records if r.offset >= floor]
        if kept:
            self.processed[partition] = kept[-1].offset + 1
        return kept

    def accept(self, records: list[ConsumerRecord], unchanged: bool) -> list[ConsumerRecord]:
        """What the application gets of one topic consumer's ``records`` (all of one partition): nothing
        when the assignment changed while they were read (``unchanged`` False) or their partition is no
        longer assigned, else :meth:`on_records`."""
        if not unchanged or not records:
            return []
        key = self.key_of(records[0])
        if key not in self.assignment:
            return []
        return self.on_records(key, records)


#: One request of a sans-IO step sequence: (command, CRQ2 fields); the driver sends it and sends back the
#: reply frame, or throws the typed error in.
Step = tuple[Command, dict[str, str]]
Steps = Generator[Step, Frame, _R]


def commit_steps(state: GroupMembership, offsets: Mapping[int, int] | None) -> Steps[dict[int, int]]:
    """COMMIT/BATCH_COMMIT of ``offsets`` (None: every processed position) not yet committed
    (:meth:`GroupMembership.pending_commits`); returns what was committed.

    A fencing error marks the membership for a rejoin and is re-raised.
    """
    pending = state.pending_commits(offsets)
    if not pending:
        return {}
    for part, request in state.commit_requests(pending):  # one per topic
        try:
            yield request
        except CursusError as exc:
            if state.is_rejoin_error(exc):
                state.rejoin_needed = True
            raise
        state.on_committed(part)
    return pending


def rejoin_steps(state: GroupMembership, auto_offset_reset: str,
                 on_revoked: Callback | None) -> Steps[tuple[dict[int, int], list[int]] | None]:
    """Commit the processed work of every held partition under the member's generation (the broker keeps
    them this member's until it rejoins, so the next owner starts after it), JOIN (+SYNC), commit what is
    still uncommitted of the partitions kept, FETCH_OFFSET each assigned partition (LIST_OFFSETS once for
    ``auto_offset_reset="latest"``).

    Returns (start position per assigned partition, the assignment), or None when the generation moved on
    during the commit (the next poll rejoins again).
    """
    old = set(state.assignment) if state.member_id is not None else set()
    if state.multi_topic and state.member_id is None:  # a JOIN without topic= needs the group to exist
        yield Command.REGISTER_GROUP, state.register_fields()
    if old:
        try:
            yield from commit_steps(state, None)  # before the partitions can move
        except CursusError as exc:
            if not state.is_rejoin_error(exc):
                raise
            log.info("commit before rejoining failed (%s): the next owner may process those records again",
                     exc.code)
    frame = yield Command.JOIN_GROUP, state.join_fields()
    if not state.on_join(ok_fields(frame), frame.payload.decode("utf-8", "replace")):
        sync = yield Command.SYNC_GROUP, state.member_fields()
        state.on_sync(sync.payload.decode("utf-8", "replace"))
    new = set(state.assignment)
    if old - new and on_revoked is not None:
        on_revoked(sorted(old - new))
    for p in old - new:
        state.processed.pop(p, None)
        state.committed.pop(p, None)
    kept = {p: o for p, o in state.processed.items() if p in new}
    if kept:
        try:
            yield from commit_steps(state, None)  # still-owned work, under the new generation
        except CursusError as exc:
            log.info("commit of still-owned partitions after rejoin failed: %s", exc)
            if state.is_rejoin_error(exc):
                return None
    positions = {}
    latest: dict[str, dict[int, int]] = {}
    for p in sorted(new):
        topic, partition = state.topic_partition(p)
        reply = yield Command.FETCH_OFFSET, {"topic": topic, "partition": str(partition), "group": state.group}
        offset = int(ok_fields(reply)["offset"])
        if offset == 0 and auto_offset_reset == "latest":
            if topic not in latest:
                bounds = yield Command.LIST_OFFSETS, {"topic": topic}
                latest[topic] = {b.partition: b.latest for b in parse_list_offsets(ok_fields(bounds))}
            offset = latest[topic].get(partition, 0)
        positions[p] = max(offset, state.processed.get(p, 0)) if p in kept else offset
        state.committed[p] = max(state.committed.get(p, -1), offset)
        state.processed[p] = positions[p]
    state.rejoin_needed = False
    log.info("group %s member %s generation %d assignment %s", state.group, state.member_id, state.generation,
             sorted(new))
    return positions, sorted(new)


def run_steps(steps: Steps[_R], call: Callable[[Command, dict[str, str]], Frame]) -> _R:
    """Drive ``steps`` with a blocking ``call``: each request's reply (or typed error) goes back in."""
    driver = StepDriver(steps)
    while driver.advance():
        try:
            driver.reply = call(*driver.step)
        except CursusError as exc:
            driver.error = exc
    result: _R = driver.result
    return result


async def run_steps_async(steps: Steps[_R], call: Callable[[Command, dict[str, str]], Awaitable[Frame]]) -> _R:
    """:func:`run_steps` with an asyncio ``call``."""
    driver = StepDriver(steps)
    while driver.advance():
        try:
            driver.reply = await call(*driver.step)
        except CursusError as exc:
            driver.error = exc
    result: _R = driver.result
    return result


class _GroupSettings:
    """Constructor shared by :class:`GroupConsumer` and :class:`AsyncGroupConsumer` (arguments: see
    :class:`GroupConsumer`); ``_client_type``/``_consumer_type`` pick the transport, ``_setup`` adds the
    flavour's own synchronisation (threads or tasks)."""

    _client_type: Any
    _consumer_type: Any
    _modes: tuple[str, ...]

    def __init__(self, topic: str | Sequence[str] | None, group: str,
                 bootstrap: str | Sequence[str] = DEFAULT_ADDRESS, *, pattern: str | None = None,
                 client_id: str | None = None, mode: str = "poll", auto_commit: bool = True,
                 auto_commit_interval_s: float = 5.0, auto_offset_reset: str = "earliest",
                 isolation_level: str = "read_committed", batch_size: int = 1000, max_bytes: int | None = None,
                 wait_ms: int = 500, heartbeat_interval_s: float = 3.0, on_assigned: Callback | None = None,
                 on_revoked: Callback | None = None, options: ConnectionOptions | None = None,
                 **overrides: Any) -> None:
        if mode not in self._modes:
            raise ValueError(f"mode must be one of {self._modes}")
        if auto_offset_reset not in _RESETS:
            raise ValueError(f"auto_offset_reset must be one of {_RESETS}")
        if heartbeat_interval_s <= 0 or auto_commit_interval_s < 0:
            raise ValueError("heartbeat_interval_s must be positive and auto_commit_interval_s >= 0")
        if (topic is None) == (pattern is None):
            raise ValueError("give a topic, a list of topics, or pattern= (exactly one)")
        if isinstance(topic, str):
            topics: tuple[str, ...] = ()
        elif topic is not None:
            topics = tuple(dict.fromkeys(topic))
            if not topics or not all(isinstance(t, str) and t for t in topics):
                raise ValueError("the topic list must name at least one topic")
        else:
            topics = ()
        #: The one topic read, or None for a topic list or pattern (see ``topics``/``pattern``).
        self.topic: str | None = topic if isinstance(topic, str) else None
        self.topics = topics
        self.pattern = pattern
        self.group = group
        self.mode = mode
        self.auto_commit = auto_commit
        self.auto_commit_interval_s = auto_commit_interval_s
        self.auto_offset_reset = auto_offset_reset
        self.isolation_level = isolation_level
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.wait_ms = wait_ms
        self.heartbeat_interval_s = heartbeat_interval_s
        self.on_assigned = on_assigned
        self.on_revoked = on_revoked
        self.options = options_from(options, overrides)
        self.state = GroupMembership(self.topic or "", group, client_id or _default_client_id(), topics=topics,
                                     pattern=pattern)
        self._bootstrap = bootstrap
        self._client = self._client_type(bootstrap, self.options)
        self._heartbeat_client = self._client_type(bootstrap, self.options)
        #: One partition consumer per topic read (created when the topic is first assigned).
        self._consumers: dict[str, Any] = {}
        self._rotation = 0
        if self.topic is not None:
            self._consumer = self._consumer_for(self.topic)
        self._last_commit = time.monotonic()
        self._assignment_token = 0
        self._setup()

    def _setup(self) -> None:
        raise NotImplementedError

    def _consumer_for(self, topic: str) -> Any:
        consumer = self._consumers.get(topic)
        if consumer is None:
            consumer = self._consumers[topic] = self._consumer_type(
                topic, self._bootstrap, auto_offset_reset=self.auto_offset_reset,
                isolation_level=self.isolation_level, batch_size=self.batch_size, max_bytes=self.max_bytes,
                wait_ms=self.wait_ms, group=self.group, options=self.options)
        return consumer

    def _positions_by_topic(self, positions: Mapping[PartitionKey, int]) -> dict[str, dict[int, int]]:
        """Start positions grouped per topic; every topic read before gets an entry (maybe empty)."""
        by_topic: dict[str, dict[int, int]] = {t: {} for t in self._consumers}
        for key, offset in positions.items():
            topic, partition = self.state.topic_partition(key)
            by_topic.setdefault(topic, {})[partition] = offset
        return by_topic

    def _reading(self) -> list[Any]:
        """The partition consumers with owned partitions, rotated between calls (fairness across topics)."""
        owned = {self.state.topic_partition(k)[0] for k in self.state.assignment}
        consumers = [c for t, c in sorted(self._consumers.items()) if t in owned]
        if not consumers:
            return []
        self._rotation = (self._rotation + 1) % len(consumers)
        return consumers[self._rotation:] + consumers[:self._rotation]


#: Long-poll slice per topic when a group reads several topics (so one idle topic does not hold up others).
_MULTI_TOPIC_SLICE_S = 0.1


def _poll_schedule(consumers: Sequence[_C], budget_s: float,
                   clock: Callable[[], float] = time.monotonic) -> Iterator[tuple[_C, float]]:
    """Which topic's consumer to poll next and for how long (seconds), until one returns records (the
    caller stops then) or ``budget_s`` is spent: the only topic with the whole budget; several topics each
    once without waiting, then in turn with long polls of at most ``_MULTI_TOPIC_SLICE_S``."""
    if len(consumers) <= 1:
        if consumers:
            yield consumers[0], budget_s
        return
    deadline = clock() + budget_s
    for consumer in consumers:
        yield consumer, 0
    while True:
        for consumer in consumers:
            remaining = deadline - clock()
            if remaining <= 0:
                return
            yield consumer, min(remaining, _MULTI_TOPIC_SLICE_S)


class GroupConsumer(_GroupSettings):
    """Blocking group consumer: ``for record in consumer`` or :meth:`poll`, plus :meth:`commit`.

    ``mode="poll"`` reads with CONSUME long polls; ``mode="stream"`` opens one STREAM per assigned
    partition (a reader thread each) and hands their batches to :meth:`poll`.

    Args:
        topic: the topic the group reads, or a list of topics (partition keys are then
            ``(topic, partition)`` pairs), or None with ``pattern``.
        group: the consumer group.
        pattern: an :mod:`fnmatch` glob of topic names (``orders-*``; ``*``, ``?``, ``[...]``) instead of
            ``topic``: the broker expands it and rebalances the group when a matching topic is created or
            deleted. A topic list or pattern registers the group with that selector (REGISTER_GROUP)
            before the first join; the partition keys of :meth:`assignment`, :meth:`positions`,
            :meth:`commit` and the callbacks are then ``(topic, partition)`` pairs.
        bootstrap: ``host:port`` of a broker (or a list).
        client_id: the member id prefix sent on the first JOIN (default ``consumer-<random>``).
        auto_commit: commit processed offsets from poll every ``auto_commit_interval_s`` and on close.
        auto_commit_interval_s: seconds between auto-commits.
        auto_offset_reset: ``earliest`` | ``latest`` | ``error``: where to start a partition without a
            committed offset (0 counts as none) and what ``OFFSET_OUT_OF_RANGE`` does.
        isolation_level: ``read_committed`` | ``read_uncommitted``.
        batch_size: records per CONSUME reply or STREAM frame at most.
        max_bytes: bytes per reply at most (None: broker default).
        wait_ms: long-poll time of one CONSUME, milliseconds.
        heartbeat_interval_s: seconds between heartbeats (the spec recommends 3).
        on_assigned, on_revoked: callbacks with the list of partitions gained / given up.
        options: :class:`~cursus.client.connection.ConnectionOptions`; keyword arguments override fields.

    Errors: ``FencingError`` from :meth:`commit` when the membership ended (the consumer rejoins on the next
    poll); ``ConflictError`` (``offset_regression``) for a commit below the committed offset;
    ``OffsetOutOfRangeError`` with ``auto_offset_reset="error"``; ``BrokerUnavailableError`` when the broker
    stays unreachable; ``ClientClosedError`` after close.
    """

    _client_type = Client
    _consumer_type = Consumer
    _modes = _MODES

    def _setup(self) -> None:
        self._coordinator: Address | None = None
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        self._streams: list[_PartitionStreamThread] = []
        self._stream_queue: queue.Queue[tuple[int, PartitionKey, list[ConsumerRecord]]] = queue.Queue()
        self._sigterm: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        self._rebalance = threading.Event()  # the heartbeat saw the membership end (wakes an idle poll)

    # ---------------------------------------------------------------------------------------- properties

    @property
    def member_id(self) -> str | None:
        """The broker-assigned member id (joins first if needed; None only after close without a join)."""
        if not self._closed.is_set():
            self._ensure_member()
        return self.state.member_id

    @property
    def generation(self) -> int:
        """The generation of this member's assignment (joins first if needed)."""
        if not self._closed.is_set():
            self._ensure_member()
        return self.state.generation

    def assignment(self) -> list[PartitionKey]:
        """The partitions this member owns now (joins first if needed): numbers for one topic,
        ``(topic, partition)`` pairs for a topic list or pattern."""
        self._ensure_member()
        return list(self.state.assignment)

    def positions(self) -> dict[PartitionKey, int]:
        """Next offset per owned partition after everything poll returned."""
        return {p: self.state.processed[p] for p in self.state.assignment if p in self.state.processed}

    # ---------------------------------------------------------------------------------------- group

    def _coordinator_address(self) -> Address | None:
        if self._coordinator is None:
            try:
                fields = ok_fields(self._client.call(Command.FIND_COORDINATOR, {"group": self.group}))
                self._coordinator = (fields["host"], int(fields["port"]))
            except (CursusError, KeyError, ValueError):
                self._coordinator = self._client.bootstrap[0]  # tolerated: use the bootstrap broker
        return self._coordinator

    def _call(self, command: Command, fields: Mapping[str, str], *, client: Client | None = None,
              retry_safe: bool = True) -> Any:
        return (client or self._client).call(command, fields, address=self._coordinator_address(),
                                             retry_safe=retry_safe)

    def _ensure_member(self) -> None:
        if self._closed.is_set():
            raise ClientClosedError("group consumer is closed")
        with self._lock:
            if not self.state.rejoin_needed:
                return
            self._rejoin()
        if self._heartbeat_thread is None:
            self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                                      name=f"cursus-heartbeat-{self.group}")
            self._heartbeat_thread.start()

    def _rejoin(self) -> None:
        """Rejoin (:func:`rejoin_steps`) and restart reading from the new positions. Lock held."""
        self._stop_streams()
        result = run_steps(rejoin_steps(self.state, self.auto_offset_reset, self.on_revoked), self._call)
        if result is None:
            return
        positions, assignment = result
        self._assignment_token += 1
        if self.mode == "poll":
            for topic, start in self._positions_by_topic(positions).items():
                self._consumer_for(topic).assign(start)
        else:
            self._start_streams(positions)
        if self.on_assigned is not None:
            self.on_assigned(assignment)

    def _heartbeat_loop(self) -> None:
        while not self._closed.wait(self.heartbeat_interval_s):
            with self._lock:
                if self.state.rejoin_needed or self.state.member_id is None:
                    continue
                fields = self.state.member_fields()
            try:
                self._call(Command.HEARTBEAT, fields, client=self._heartbeat_client)
            except CursusError as exc:
                if self.state.is_rejoin_error(exc):
                    with self._lock:
                        if fields["generation"] == str(self.state.generation):
                            log.info("group %s: %s; rejoining", self.group, exc.code)
                            self.state.rejoin_needed = True
                            self._rebalance.set()
                elif not self._closed.is_set():
                    log.debug("heartbeat failed: %s", exc)

    # ---------------------------------------------------------------------------------------- reading

    def poll(self, timeout_s: float | None = None) -> list[ConsumerRecord]:
        """Records from one owned partition (offset order), ``[]`` if none arrive in ``timeout_s`` seconds
        (default: one long poll of ``wait_ms``). Rejoins first when the membership ended, and auto-commits
        the records previous polls returned when the interval passed. A member that owns nothing (yet:
        the holders have not given partitions up) waits within ``timeout_s`` for the rebalance and reads
        what it then gets."""
        self._ensure_member()
        if self.auto_commit and time.monotonic() - self._last_commit >= self.auto_commit_interval_s:
            self._auto_commit()
        budget_s = self.wait_ms / 1000.0 if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget_s
        while not self.state.assignment:  # nothing owned: wait for a rebalance (the heartbeat notices)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._rebalance.wait(remaining) or self._closed.is_set():
                return []
            self._rebalance.clear()
            self._ensure_member()
        budget_s = max(0.0, deadline - time.monotonic())
        if self.mode == "stream":
            return self._poll_streams(budget_s)
        token = self._assignment_token
        records = self._poll_consumers(budget_s)
        with self._lock:
            return self.state.accept(records, token == self._assignment_token)

    def _poll_consumers(self, budget_s: float) -> list[ConsumerRecord]:
        """One topic's records, polled as :func:`_poll_schedule` says ([] once the budget is spent)."""
        for consumer, wait_s in _poll_schedule(self._reading(), budget_s):
            records: list[ConsumerRecord] = consumer.poll(wait_s)
            if records:
                return records
        return []

    def _poll_streams(self, budget_s: float) -> list[ConsumerRecord]:
        deadline = time.monotonic() + budget_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.state.rejoin_needed:
                return []
            try:
                token, partition, records = self._stream_queue.get(timeout=remaining)
            except queue.Empty:
                return []
            with self._lock:
                if token != self._assignment_token or partition not in self.state.assignment:
                    continue
                kept = self.state.on_records(partition, records)
            if kept:
                return kept

    def records(self, *, max_records: int | None = None, idle_timeout_s: float | None = None) -> Iterator[ConsumerRecord]:
        """Iterate records (forever, or until ``max_records`` or ``idle_timeout_s`` without records)."""
        count = 0
        idle_since = time.monotonic()
        while not self._closed.is_set():
            batch = self.poll()
            if batch:
                idle_since = time.monotonic()
            elif idle_timeout_s is not None and time.monotonic() - idle_since >= idle_timeout_s:
                return
            for record in batch:
                yield record
                count += 1
                if max_records is not None and count >= max_records:
                    return

    def __iter__(self) -> Iterator[ConsumerRecord]:
        return self.records()

    # ---------------------------------------------------------------------------------------- commits

    def commit(self, offsets: Mapping[PartitionKey, int] | None = None) -> dict[PartitionKey, int]:
        """Commit next offsets (default: everything poll returned so far) of owned partitions, keyed by
        partition number (one topic) or ``(topic, partition)`` (a topic list or pattern; one request per
        topic); returns what was committed (offsets equal to the committed ones are left out). Joins first if needed. Durable on
        the broker when this returns.

        Raises:
            FencingError: the membership ended (the next poll rejoins), or ``NOT_OWNER`` for a partition in
                ``offsets`` this member does not own; nothing was committed.
            ConflictError: ``offset_regression`` (an offset below the committed one).
        """
        self._ensure_member()
        with self._lock:
            return self._commit_now(self.state.pending_commits(offsets))

    def _commit_now(self, offsets: Mapping[PartitionKey, int]) -> dict[PartitionKey, int]:
        committed = run_steps(commit_steps(self.state, offsets), self._call)
        if committed:
            self._last_commit = time.monotonic()
        return committed

    def _auto_commit(self) -> None:
        self._last_commit = time.monotonic()
        try:
            with self._lock:
                self._commit_now(self.state.pending_commits())
        except CursusError as exc:
            log.info("auto-commit failed: %s", exc)

    # ---------------------------------------------------------------------------------------- streams

    def _start_streams(self, positions: Mapping[int, int]) -> None:
        for partition, offset in positions.items():
            topic, number = self.state.topic_partition(partition)
            thread = _PartitionStreamThread(self, partition, topic, number, offset, self._assignment_token)
            self._streams.append(thread)
            thread.start()

    def _stop_streams(self) -> None:
        threads, self._streams = self._streams, []
        for thread in threads:
            thread.stop()
        for thread in threads:
            thread.join(timeout=10)
        while True:
            try:
                self._stream_queue.get_nowait()
            except queue.Empty:
                break

    # ---------------------------------------------------------------------------------------- close

    def close(self) -> None:
        """Auto-commit (if enabled), leave the group, stop threads and close connections (idempotent)."""
        if self._closed.is_set():
            return
        self._rebalance.set()  # an idle poll in another thread returns
        with self._lock:
            if self.auto_commit and self.state.member_id is not None and not self.state.rejoin_needed:
                with contextlib.suppress(CursusError):
                    self._commit_now(self.state.pending_commits())
            self._closed.set()
            self._stop_streams()
            if self.state.member_id is not None:
                with contextlib.suppress(CursusError):
                    self._call(Command.LEAVE_GROUP, self.state.leave_fields(), retry_safe=False)
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout=10)
        for consumer in self._consumers.values():
            consumer.close()
        self._client.close()
        self._heartbeat_client.close()

    def __enter__(self) -> GroupConsumer:
        """Inside the block SIGTERM exits cleanly (:func:`~cursus.client.signals.sigterm_exits`): leaving the
        block leaves the group, also when the process is stopped with ``kill`` (unless the application set
        its own SIGTERM handler)."""
        self._sigterm = sigterm_exits()
        self._sigterm.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.close()
        finally:
            self._sigterm.__exit__(None, None, None)


class _PartitionStreamThread(threading.Thread):
    """Reads one partition with STREAM and queues its batches; reconnects and resumes after STREAM_END or a
    lost connection (from its last offset), applies ``auto_offset_reset`` on ``offset_out_of_range``."""

    def __init__(self, owner: GroupConsumer, key: PartitionKey, topic: str, partition: int, offset: int,
                 token: int) -> None:
        super().__init__(daemon=True, name=f"cursus-stream-{topic}-{partition}")
        self.owner = owner
        self.key = key
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.token = token
        self._halt = threading.Event()
        self._conn: Connection | None = None

    def stop(self) -> None:
        """Ask the thread to end; unblocks its socket read."""
        self._halt.set()
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    def _fields(self) -> dict[str, str]:
        owner = self.owner
        fields = {"topic": self.topic, "partition": str(self.partition), "group": owner.group,
                  "member": owner.state.member_id or "", "offset": str(self.offset),
                  "batch": str(owner.batch_size), "isolation": owner.isolation_level}
        if owner.max_bytes is not None:
            fields["max_bytes"] = str(owner.max_bytes)
        return fields

    def run(self) -> None:
        """Stream until stopped, reconnecting with backoff after failures."""
        backoff = self.owner.options.backoff
        attempt = 0
        while not self._halt.is_set():
            try:
                self._stream_once()
                attempt = 0
            except OffsetOutOfRangeError as exc:
                if self.owner.auto_offset_reset == "error":
                    log.error("stream of %s/%d: %s", self.topic, self.partition, exc)
                    return
                target = exc.earliest if self.owner.auto_offset_reset == "earliest" else exc.latest
                self.offset = target if target is not None else self.offset
            except TlsError as exc:  # a configuration mismatch: reconnecting cannot help
                log.error("stream of %s/%d: %s", self.topic, self.partition, exc)
                return
            except (OSError, ProtocolError, CursusError) as exc:
                if self._halt.is_set():
                    return
                log.debug("stream of %s/%d: %s; reconnecting", self.topic, self.partition, exc)
                self._halt.wait(backoff.delay_s(attempt))
                attempt = min(attempt + 1, 16)

    def _stream_once(self) -> None:
        owner = self.owner
        address = owner._consumer_for(self.topic).metadata().leader_address(self.partition) or \
            owner._client.bootstrap[0]
        conn = owner.options.connect(address)
        self._conn = conn
        try:
            if self._halt.is_set():
                return
            payload = encode_crq2(CommandPayload((), self._fields()))
            for frame in conn.stream(Command.STREAM, payload):
                if self._halt.is_set():
                    return
                if frame.status == Status.ERROR:
                    raise error_from_frame(frame)
                data = frame.payload
                if not data:
                    continue  # keepalive
                if data.startswith(b"STREAM_CONTROL"):
                    self._on_control(data.decode("utf-8", "replace"))
                    return
                try:
                    _, _, records = decode_consumed_batch(data)
                except Exception as exc:
                    raise ProtocolViolationError(f"undecodable STREAM batch: {exc}") from None
                records = [r for r in records if r.offset >= self.offset]
                if records:
                    self.offset = records[-1].offset + 1
                    owner._stream_queue.put((self.token, self.key, records))
        finally:
            self._conn = None
            conn.close()

    def _on_control(self, text: str) -> None:
        fields = dict(tok.split("=", 1) for tok in text.split()[1:] if "=" in tok)
        if fields.get("reason") == "offset_out_of_range":
            raise OffsetOutOfRangeError("OFFSET_OUT_OF_RANGE", text, fields={
                k: fields[k] for k in ("requested", "earliest", "latest") if k in fields})
        if fields.get("offset", "").isdigit():
            self.offset = max(self.offset, int(fields["offset"]))
        if fields.get("reason") in ("stopped", "removed", "error", "timeout"):
            self._halt.wait(0.5)  # facts A6: the client reconnects after 0.5 s


class AsyncGroupConsumer(_GroupSettings):
    """asyncio group consumer (``mode="poll"`` only): ``await poll()`` and ``await commit()``; same protocol
    and semantics as :class:`GroupConsumer`, heartbeats on a task. Arguments, units and errors are those of
    :class:`GroupConsumer` (``mode`` accepts only ``"poll"``).
    """

    _client_type = AsyncClient
    _consumer_type = AsyncConsumer
    _modes = ("poll",)

    def _setup(self) -> None:
        self._lock = asyncio.Lock()
        self._closed = False
        self._heartbeat_task: asyncio.Task[None] | None = None

    @property
    def member_id(self) -> str | None:
        """The broker-assigned member id (None before the first join)."""
        return self.state.member_id

    @property
    def generation(self) -> int:
        """The current generation."""
        return self.state.generation

    async def assignment(self) -> list[PartitionKey]:
        """Owned partitions (joins first if needed; ``(topic, partition)`` pairs for a list or pattern)."""
        await self._ensure_member()
        return list(self.state.assignment)

    async def _ensure_member(self) -> None:
        if self._closed:
            raise ClientClosedError("group consumer is closed")
        async with self._lock:
            if self.state.rejoin_needed:
                await self._rejoin()
        if self._heartbeat_task is None:
            self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeat_loop())

    async def _rejoin(self) -> None:
        """See :meth:`GroupConsumer._rejoin`."""
        result = await run_steps_async(rejoin_steps(self.state, self.auto_offset_reset, self.on_revoked),
                                       self._call)
        if result is None:
            return
        positions, assignment = result
        self._assignment_token += 1
        for topic, start in self._positions_by_topic(positions).items():
            await self._consumer_for(topic).assign(start)
        if self.on_assigned is not None:
            self.on_assigned(assignment)

    async def _call(self, command: Command, fields: Mapping[str, str]) -> Frame:
        return await self._client.call(command, fields, retry_safe=True)

    async def _heartbeat_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.heartbeat_interval_s)
            if self.state.rejoin_needed or self.state.member_id is None:
                continue
            fields = self.state.member_fields()
            try:
                await self._heartbeat_client.call(Command.HEARTBEAT, fields, retry_safe=True)
            except CursusError as exc:
                if self.state.is_rejoin_error(exc) and fields["generation"] == str(self.state.generation):
                    self.state.rejoin_needed = True

    async def poll(self, timeout_s: float | None = None) -> list[ConsumerRecord]:
        """See :meth:`GroupConsumer.poll`."""
        await self._ensure_member()
        if self.auto_commit and time.monotonic() - self._last_commit >= self.auto_commit_interval_s:
            self._last_commit = time.monotonic()
            try:
                await self.commit()
            except CursusError as exc:
                log.info("auto-commit failed: %s", exc)
        budget_s = self.wait_ms / 1000.0 if timeout_s is None else timeout_s
        if not self.state.assignment:
            await asyncio.sleep(budget_s)
            return []
        token = self._assignment_token
        records = await self._poll_consumers(budget_s)
        return self.state.accept(records, token == self._assignment_token)

    async def _poll_consumers(self, budget_s: float) -> list[ConsumerRecord]:
        """See :meth:`GroupConsumer._poll_consumers`."""
        for consumer, wait_s in _poll_schedule(self._reading(), budget_s):
            records: list[ConsumerRecord] = await consumer.poll(wait_s)
            if records:
                return records
        return []

    async def commit(self, offsets: Mapping[PartitionKey, int] | None = None) -> dict[PartitionKey, int]:
        """See :meth:`GroupConsumer.commit`."""
        await self._ensure_member()
        async with self._lock:
            return await self._commit_now(self.state.pending_commits(offsets))

    async def _commit_now(self, offsets: Mapping[PartitionKey, int]) -> dict[PartitionKey, int]:
        committed = await run_steps_async(commit_steps(self.state, offsets), self._call)
        if committed:
            self._last_commit = time.monotonic()
        return committed

    async def close(self) -> None:
        """Auto-commit (if enabled), leave the group, close connections (idempotent)."""
        if self._closed:
            return
        if self.auto_commit and self.state.member_id is not None and not self.state.rejoin_needed:
            with contextlib.suppress(CursusError):
                async with self._lock:
                    await self._commit_now(self.state.pending_commits())
        self._closed = True
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat_task
        if self.state.member_id is not None:
            with contextlib.suppress(CursusError):
                await self._client.call(Command.LEAVE_GROUP, self.state.leave_fields(), retry_safe=False)
        for consumer in self._consumers.values():
            await consumer.close()
        await self._client.close()
        await self._heartbeat_client.close()

    async def __aenter__(self) -> AsyncGroupConsumer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

