"""Partition consumers: :class:`Consumer` (blocking) and :class:`AsyncConsumer` (asyncio).

A consumer reads one topic: all of its partitions or the ones given, from a start position
(``earliest``, ``latest``, an offset, or an offset per partition), by polling ``CONSUME`` (spec
"CONSUME", facts A6 and decision 14):

* long poll: ``wait_ms`` lets the broker hold an empty poll until data arrives; with several partitions the
  consumer first asks each one without waiting, then long-polls them in turn;
* each reply is one CBV2 batch of at most ``batch_size`` records (and ``max_bytes``); records come out in
  offset order per partition, with every optional field as an attribute (:class:`ConsumerRecord`);
* ``isolation_level`` ``read_committed`` (default) or ``read_uncommitted``; transaction control markers are
  never yielded;
* ``OFFSET_OUT_OF_RANGE`` applies ``auto_offset_reset``: ``earliest`` resumes at the broker's earliest
  retained offset, ``latest`` at its latest, ``error`` raises
  :class:`~cursus.client.errors.OffsetOutOfRangeError` (never silently skipping or replaying);
* ``NOT_LEADER leader=`` moves the partition to the named broker; connection failures reconnect with
  bounded backoff (CONSUME is read-only, so retrying is always safe).

Extension points for consumer groups and STREAM (a later issue): partitions and positions enter through
:meth:`Consumer.assign` only, which a group membership (JOIN/SYNC/HEARTBEAT, committed offsets from
FETCH_OFFSET) will call on every rebalance; every read goes through ``_fetch``/:class:`ConsumerCore`, where a
STREAM fetcher can replace CONSUME polling; ``group``/``member`` are already carried on CONSUME so the broker
can apply committed offsets (facts decision 14).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Generator,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from typing import Any

from cursus.client.admin import PartitionOffsets, TopicMetadata, parse_list_offsets, parse_metadata
from cursus.client.aio import AsyncClient, open_connection
from cursus.client.connection import (
    DEFAULT_ADDRESS,
    Address,
    Client,
    ConnectionOptions,
    ok_fields,
    options_from,
)
from cursus.client.errors import (
    BrokerUnavailableError,
    ClientClosedError,
    CursusError,
    NotFoundError,
    NotLeaderError,
    OffsetOutOfRangeError,
    ProtocolViolationError,
)
from cursus.client.records import ConsumerRecord, decode_consumed_batch
from cursus.client.steps import StepDriver
from cursus.wire import (
    TXN_CONTROL_MARKER_PAYLOAD,
    Command,
    CommandPayload,
    Frame,
    InvalidFrame,
    ProtocolError,
    Status,
    encode_crq2,
    is_cbv2,
)

__all__ = ["AsyncConsumer", "Consumer", "ConsumerCore", "PartitionCursor", "Prefetch", "StartPosition"]

StartPosition = str | int | Mapping[int, int]
_RESETS = ("earliest", "latest", "error")
_ISOLATION_LEVELS = ("read_committed", "read_uncommitted")
#: Shortest per-partition long poll when several partitions share one consumer.
_MIN_LONG_POLL_MS = 50


@dataclass(slots=True)
class Prefetch:
    """A CONSUME written ahead (``wait_ms=0``) on its own connection, its reply not read yet: the broker
    reads the next batch while the application processes the current one."""

    partition: int
    position: int
    leader: Address
    request_id: int
    connection: Any


@dataclass(slots=True)
class PartitionCursor:
    """Where a consumer is in one partition: the next offset to read and the broker to read it from."""

    partition: int
    position: int
    leader: Address


#: One CONSUME's routing steps: yields (action, argument), is sent each result (see consume_steps).
ConsumeSteps = Generator[tuple[str, Any], Any, "Frame | None"]

#: One poll's fetches: yields (cursor, wait_ms), is sent the records, returns the batch (see poll_plan).
PollPlan = Generator[tuple["PartitionCursor", int], list[ConsumerRecord], list[ConsumerRecord]]


class ConsumerCore:
    """The consumer's decisions, without I/O: CONSUME fields, reply decoding, position updates, resets.

    Args:
        topic: the topic read.
        auto_offset_reset: ``earliest`` | ``latest`` | ``error``.
        isolation_level: ``read_committed`` | ``read_uncommitted``.
        batch_size: records per CONSUME at most.
        max_bytes: reply byte limit per CONSUME (None: broker default, 1 MiB).
        group, member: sent on CONSUME when set (consumer groups).
    """

    def __init__(self, topic: str, *, auto_offset_reset: str, isolation_level: str, batch_size: int,
                 max_bytes: int | None, group: str | None, member: str | None) -> None:
        if auto_offset_reset not in _RESETS:
            raise ValueError(f"auto_offset_reset must be one of {_RESETS}")
        if isolation_level not in _ISOLATION_LEVELS:
            raise ValueError(f"isolation_level must be one of {_ISOLATION_LEVELS}")
        if batch_size < 1 or (max_bytes is not None and max_bytes < 1):
            raise ValueError("batch_size and max_bytes must be positive")
        self.topic = topic
        self.auto_offset_reset = auto_offset_reset
        self.isolation_level = isolation_level
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.group = group
        self.member = member
        self.cursors: dict[int, PartitionCursor] = {}
        self._rotation = 0
        #: Fetched records not handed out yet (an iteration stopped mid-batch); served before fetching.
        self.buffer: list[ConsumerRecord] = []
        #: At most one CONSUME in flight ahead of the application (bounded prefetch).
        self.prefetched: Prefetch | None = None

    def assign(self, cursors: dict[int, PartitionCursor]) -> None:
        """Replace the assignment; records buffered from the previous one are dropped (the new positions
        are authoritative)."""
        self.cursors = cursors
        self.buffer = []

    def take_buffer(self) -> list[ConsumerRecord]:
        """Return and clear the records fetched earlier and not yet handed out."""
        records, self.buffer = self.buffer, []
        return records

    def unread(self, records: list[ConsumerRecord]) -> None:
        """Put records back (in order) to be returned by the next poll."""
        self.buffer[:0] = records

    def position(self, partition: int) -> int:
        """The next offset the application will see from ``partition`` (buffered records count as unread)."""
        for record in self.buffer:
            if record.partition == partition:
                return record.offset
        return self.cursors[partition].position

    def seek(self, partition: int, offset: int) -> None:
        """Continue ``partition`` at ``offset``, dropping its buffered records."""
        self.buffer = [r for r in self.buffer if r.partition != partition]
        self.cursors[partition].position = offset

    def cut(self, records: list[ConsumerRecord], ends: Mapping[int, int] | None) -> list[ConsumerRecord]:
        """The records before the first one at or past its partition's end in ``ends`` (all without
        ``ends``); the rest are put back with :meth:`unread`."""
        if ends is None or not records:
            return records
        last = records[-1]
        if records[0].partition == last.partition and last.offset < ends.get(last.partition, 0):
            return records  # one partition, offsets ascending: all before the end
        # Per partition: records before its end are returned, the rest put back. Cutting the whole list at
        # the first record past any end would also put back other partitions' records that are before
        # their ends, and ``records(until_end=True)`` would see the same buffer forever.
        before = [r for r in records if r.offset < ends.get(r.partition, 0)]
        if len(before) < len(records):
            self.unread([r for r in records if r.offset >= ends.get(r.partition, 0)])
        return before

    def reached(self, ends: Mapping[int, int]) -> bool:
        """True when every assigned partition's application position is at or past ``ends``."""
        return all(self.position(p) >= ends.get(p, 0) for p in self.cursors)

    def fields(self, cursor: PartitionCursor, wait_ms: int) -> dict[str, str]:
        """The CONSUME fields for one poll of ``cursor``."""
        fields = {"topic": self.topic, "partition": str(cursor.partition), "offset": str(cursor.position),
                  "batch": str(self.batch_size), "isolation": self.isolation_level}
        if wait_ms > 0:
            fields["wait_ms"] = str(wait_ms)
        if self.max_bytes is not None:
            fields["max_bytes"] = str(self.max_bytes)
        if self.group is not None:
            fields["group"] = self.group
        if self.member is not None:
            fields["member"] = self.member
        return fields

    def order(self) -> list[PartitionCursor]:
        """Cursors in poll order, rotating the starting partition between calls (fairness); a partition
        with a prefetched CONSUME goes first, so its reply is used."""
        cursors = list(self.cursors.values())
        if not cursors:
            return cursors
        self._rotation = (self._rotation + 1) % len(cursors)
        if self.prefetched is not None and self.prefetched.partition in self.cursors:
            self._rotation = list(self.cursors).index(self.prefetched.partition)
        return cursors[self._rotation:] + cursors[:self._rotation]

    def poll_plan(self, wait_ms: int, timeout_s: float | None,
                  clock: Callable[[], float] = time.monotonic) -> PollPlan:
        """The CONSUMEs of one poll, as a generator: it yields (cursor, wait in ms) to fetch and is sent
        each fetch's records; it returns the first non-empty batch, or ``[]`` once ``timeout_s`` (default
        ``wait_ms``) has passed. Buffered records come first; then every partition is asked once without
        waiting (so ``wait_ms=0`` still reads), then the partitions are long-polled in turn."""
        buffered = self.take_buffer()
        if buffered:
            return buffered
        deadline = clock() + (wait_ms / 1000.0 if timeout_s is None else timeout_s)
        cursors = self.order()
        if not cursors:
            return []
        for cursor in cursors:
            records = yield cursor, 0
            if records:
                return records
        per_poll_ms = wait_ms if len(cursors) == 1 else max(_MIN_LONG_POLL_MS, wait_ms // len(cursors))
        index = 0
        while True:
            remaining_ms = int((deadline - clock()) * 1000)
            if remaining_ms <= 0:
                return []
            records = yield cursors[index % len(cursors)], min(per_poll_ms, remaining_ms)
            if records:
                return records
            index += 1

    def consume_steps(self, cursor: PartitionCursor, wait_ms: int, redirects_max: int) -> ConsumeSteps:
        """One CONSUME of ``cursor`` with its routing decisions, as a generator the transports drive.

        It yields what to do and is sent the result (or thrown the request's typed error):

        * ``("consume", fields)``: send CONSUME to ``cursor.leader`` (no redirects followed, ``failover``: a
          leader that cannot be reached raises ``BrokerUnavailableError`` at once) -> the reply frame;
        * ``("leader", None)``: re-read metadata -> the partition's leader address now;
        * ``("backoff", attempt)``: wait the backoff delay of ``attempt`` -> None;
        * ``("bounds", None)``: LIST_OFFSETS of the partition -> ``(earliest, latest)``.

        ``NOT_LEADER`` moves the cursor to the leader it names (or the metadata's); an unreachable leader moves
        it to the metadata's leader, backing off while the metadata still names the dead one (a failover in
        progress); ``OFFSET_OUT_OF_RANGE`` applies ``auto_offset_reset``; any other retryable error (e.g.
        ``leader_not_available`` from a leader still preparing, after the client's own retries) re-reads the
        leader and backs off. Returns the reply frame, or None after a reset or when ``redirects_max + 1``
        attempts found no leader or no ready leader (the next poll tries again).

        Raises:
            OffsetOutOfRangeError: ``auto_offset_reset="error"``; other non-retryable typed errors of the
                request.
        """
        fields = self.fields(cursor, wait_ms)
        for attempt in range(redirects_max + 1):
            try:
                frame: Frame = yield "consume", fields
                return frame
            except NotLeaderError as exc:
                cursor.leader = exc.leader or (yield "leader", None)
            except BrokerUnavailableError:
                dead = cursor.leader
                cursor.leader = yield "leader", None
                if cursor.leader == dead:
                    yield "backoff", attempt
            except OffsetOutOfRangeError as exc:
                if not self.on_out_of_range(cursor, exc):
                    earliest, latest = yield "bounds", None
                    self.reset(cursor, earliest, latest)
                return None
            except CursusError as exc:
                if not exc.retryable:
                    raise
                # the client's own retries of a retryable refusal are spent (a new leader preparing longer
                # than its backoff budget, leader_not_available while leaderless): CONSUME is read-only, so
                # never surface it; ask the metadata where the leader is, back off, and try again
                cursor.leader = yield "leader", None
                yield "backoff", attempt
        return None

    def take_prefetch(self) -> Prefetch | None:
        """Return and forget the outstanding prefetch (its reply must then be read or its connection
        closed)."""
        prefetch, self.prefetched = self.prefetched, None
        return prefetch

    @staticmethod
    def prefetch_matches(prefetch: Prefetch, cursor: PartitionCursor) -> bool:
        """Whether a prefetched reply answers what ``cursor`` would ask now (same partition, position and
        leader: nothing sought, reset or redirected meanwhile)."""
        return (prefetch.partition, prefetch.position, prefetch.leader) == \
            (cursor.partition, cursor.position, cursor.leader)

    def on_reply(self, cursor: PartitionCursor, frame: Frame) -> list[ConsumerRecord]:
        """Records of an OK CONSUME reply at or after the cursor's position; advances the position.

        An empty payload (no data) or a ``STREAM_CONTROL`` text yields nothing.

        Raises:
            ProtocolViolationError: the payload is not a valid CBV2 batch of this topic and partition.
        """
        payload = frame.payload
        if not payload or payload.startswith(b"STREAM_CONTROL"):
            return []
        if not is_cbv2(payload):
            raise ProtocolViolationError(f"CONSUME reply is not a CBV2 batch: {payload[:60]!r}")
        try:
            topic, partition, records = decode_consumed_batch(payload, skip_control=False)
        except InvalidFrame as exc:
            raise ProtocolViolationError(f"undecodable CONSUME batch: {exc}") from None
        if topic != self.topic or partition != cursor.partition:
            raise ProtocolViolationError(f"CONSUME for {self.topic}/{cursor.partition} returned {topic}/{partition}")
        if not records:
            return []
        position = cursor.position
        cursor.position = max(position, records[-1].offset + 1)
        return [r for r in records if r.offset >= position and r.value != TXN_CONTROL_MARKER_PAYLOAD]

    def on_out_of_range(self, cursor: PartitionCursor, error: OffsetOutOfRangeError) -> bool:
        """Apply ``auto_offset_reset`` to ``cursor``. Returns False when the reply lacks the bounds (the
        caller must look them up with LIST_OFFSETS and call :meth:`reset`).

        Raises:
            OffsetOutOfRangeError: ``auto_offset_reset="error"``.
        """
        if self.auto_offset_reset == "error":
            raise error
        target = error.earliest if self.auto_offset_reset == "earliest" else error.latest
        if target is None:
            return False
        cursor.position = target
        return True

    def check_bounds(self, bounds: Mapping[int, tuple[int, int]]) -> None:
        """Apply ``auto_offset_reset`` to every assigned partition whose position lies outside its
        ``(earliest, latest)`` bounds (what the broker's CONSUME would answer ``OFFSET_OUT_OF_RANGE`` to, so
        an iteration that stops at the end sees it too).

        Raises:
            OffsetOutOfRangeError: ``auto_offset_reset="error"`` and a position out of range.
        """
        for partition, cursor in self.cursors.items():
            if partition not in bounds:
                continue
            earliest, latest = bounds[partition]
            position = self.position(partition)
            if earliest <= position <= latest:
                continue
            error = OffsetOutOfRangeError("OFFSET_OUT_OF_RANGE", f"{self.topic}/{partition} has offsets "
                                          f"{earliest}-{latest}", fields={
                                              "topic": self.topic, "partition": str(partition),
                                              "requested": str(position), "earliest": str(earliest),
                                              "latest": str(latest)})
            self.seek(partition, position)  # drop anything buffered for it
            self.on_out_of_range(cursor, error)

    def reset(self, cursor: PartitionCursor, earliest: int, latest: int) -> None:
        """Apply ``auto_offset_reset`` from LIST_OFFSETS bounds."""
        cursor.position = earliest if self.auto_offset_reset == "earliest" else latest


def _resolve_start(start: StartPosition, partition: int, earliest: int, latest: int) -> int:
    if isinstance(start, Mapping):
        value: Any = start.get(partition, "earliest")
    else:
        value = start
    if value == "earliest":
        return earliest
    if value == "latest":
        return latest
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value >= 0 else max(earliest, latest + value)
    raise ValueError(f"start position {value!r}: use 'earliest', 'latest' or an offset")


def _start_positions(topic: str, start: StartPosition, wanted: Iterable[int],
                     listed: Iterable[PartitionOffsets]) -> dict[int, int]:
    """The first offset to read of each ``wanted`` partition, from ``start`` and the partitions' LIST_OFFSETS
    bounds (``listed``). Raises ``NotFoundError`` (``partition_not_found``) for a partition not listed,
    ``ValueError`` for a bad start position."""
    offsets = {o.partition: o for o in listed}
    positions = {}
    for p in wanted:
        if p not in offsets:
            raise NotFoundError("partition_not_found", f"{topic} has no partition {p}",
                                fields={"topic": topic, "partition": str(p)})
        positions[p] = _resolve_start(start, p, offsets[p].earliest, offsets[p].latest)
    return positions


def _partition_list(partitions: int | Iterable[int] | None) -> list[int] | None:
    if partitions is None:
        return None
    if isinstance(partitions, int):
        return [partitions]
    return sorted(set(partitions))




class _ConsumerSettings:
    """Constructor shared by :class:`Consumer` and :class:`AsyncConsumer`; ``_client_type`` picks the
    transport (blocking or asyncio), everything else lives in the sans-IO :class:`ConsumerCore`."""

    _client_type: Any

    def __init__(self, topic: str, bootstrap: str | Sequence[str] = DEFAULT_ADDRESS, *,
                 partitions: int | Iterable[int] | None = None, start: StartPosition = "earliest",
                 auto_offset_reset: str = "earliest", isolation_level: str = "read_committed",
                 batch_size: int = 1000, max_bytes: int | None = None, wait_ms: int = 500,
                 group: str | None = None, member: str | None = None,
                 options: ConnectionOptions | None = None, **overrides: Any) -> None:
        if wait_ms < 0:
            raise ValueError("wait_ms must be >= 0")
        self.topic = topic
        self.wait_ms = wait_ms
        self.options = options_from(options, overrides)
        self._core = ConsumerCore(topic, auto_offset_reset=auto_offset_reset, isolation_level=isolation_level,
                                  batch_size=batch_size, max_bytes=max_bytes, group=group, member=member)
        self._client = self._client_type(bootstrap, self.options)
        self._wanted = _partition_list(partitions)
        self._start = start
        self._started = False
        self._closed = False
        self._metadata: TopicMetadata | None = None
        #: Connections that carry prefetched CONSUMEs, one per leader (never shared with other requests,
        #: so an unread reply cannot be mistaken for another request's).
        self._prefetch_connections: dict[Address, Any] = {}
        #: The latest ``records()`` iteration of an AsyncConsumer (its unreturned records are reclaimed).
        self._active: Any = None


class Consumer(_ConsumerSettings):
    """Blocking partition consumer; iterate it for records (forever), or use :meth:`poll`/:meth:`records`.

    Args:
        topic: the topic to read.
        bootstrap: ``host:port`` of a broker (or a list).
        partitions: a partition, several, or None for all.
        start: ``"earliest"``, ``"latest"`` (the next offset to be written), an offset (negative: that many
            records before the latest), or a mapping partition -> one of those.
        auto_offset_reset: what ``OFFSET_OUT_OF_RANGE`` does: ``earliest``, ``latest`` or ``error``.
        isolation_level: ``read_committed`` (default) or ``read_uncommitted``.
        batch_size: records per CONSUME reply at most.
        max_bytes: bytes per CONSUME reply at most (None: broker default 1 MiB).
        wait_ms: long-poll time when a partition has no data, milliseconds.
        group, member: carried on CONSUME for consumer groups (a later issue); None by default.
        options: :class:`~cursus.client.connection.ConnectionOptions`; keyword arguments override fields
            (``compression``, ``timeout_s``, ``ssl_context``, ``principal``, ``token``, ``backoff``).

    Errors (from the reading methods): ``TopicNotFoundError``/``NotFoundError`` for a missing topic or
    partition, ``OffsetOutOfRangeError`` with ``auto_offset_reset="error"``, ``BrokerUnavailableError`` when
    reconnecting exhausts the backoff budget, ``ClientClosedError`` after close.
    """

    _client_type = Client

    # ----------------------------------------------------------------------------------------- setup

    def _ensure_started(self) -> None:
        if self._closed:
            raise ClientClosedError("consumer is closed")
        if self._started:
            return
        metadata = self.metadata()
        wanted = self._wanted if self._wanted is not None else range(metadata.partitions)
        self.assign(_start_positions(self.topic, self._start, wanted, self._list_offsets()))

    def metadata(self) -> TopicMetadata:
        """The topic's METADATA (fetched once, refreshed on redirects)."""
        if self._metadata is None:
            frame = self._client.call(Command.METADATA, {"topic": self.topic})
            self._metadata = parse_metadata(ok_fields(frame), self.topic)
        return self._metadata

    def _list_offsets(self, partition: int | None = None) -> list[Any]:
        """LIST_OFFSETS of one partition or the whole topic (on a cluster whose partitions have different
        leaders, one request per partition, each redirected to its leader)."""
        fields = {"topic": self.topic}
        if partition is not None:
            fields["partition"] = str(partition)
        try:
            return parse_list_offsets(ok_fields(self._client.call(Command.LIST_OFFSETS, fields)))
        except NotLeaderError:
            if partition is not None:
                raise
            return [o for p in range(self.metadata().partitions) for o in self._list_offsets(p)]

    def assign(self, positions: Mapping[int, int]) -> None:
        """Read exactly these partitions, from these offsets (replacing any previous assignment and
        dropping records fetched but not yet returned).

        This is the one entry point for partitions and positions (group membership calls it).
        """
        metadata = self.metadata()
        default = self._client.bootstrap[0]
        self._core.assign({p: PartitionCursor(p, int(offset), metadata.leader_address(p) or default)
                           for p, offset in sorted(positions.items())})
        self._started = True

    def assignment(self) -> list[int]:
        """The partitions being read."""
        self._ensure_started()
        return sorted(self._core.cursors)

    def position(self, partition: int) -> int:
        """The offset of the next record this consumer will return from ``partition``."""
        self._ensure_started()
        return self._core.position(partition)

    def positions(self) -> dict[int, int]:
        """:meth:`position` of every assigned partition."""
        self._ensure_started()
        return {p: self._core.position(p) for p in self._core.cursors}

    def seek(self, partition: int, offset: int | str) -> None:
        """Continue ``partition`` at ``offset`` (an int, ``"earliest"`` or ``"latest"``)."""
        self._ensure_started()
        if isinstance(offset, str):
            bounds = self._list_offsets(partition)[0]
            offset = _resolve_start(offset, partition, bounds.earliest, bounds.latest)
        self._core.seek(partition, offset)

    def end_offsets(self) -> dict[int, int]:
        """The latest (next readable) offset of each assigned partition, from LIST_OFFSETS."""
        self._ensure_started()
        return {o.partition: o.latest for o in self._list_offsets() if o.partition in self._core.cursors}

    # ----------------------------------------------------------------------------------------- reading

    def _fetch(self, cursor: PartitionCursor, wait_ms: int) -> list[ConsumerRecord]:
        frame = self._prefetched_reply(cursor) or self._consume(cursor, wait_ms)
        if frame is None:
            return []
        records = self._core.on_reply(cursor, frame)
        if records:
            self._prefetch(cursor)
        return records

    def _consume(self, cursor: PartitionCursor, wait_ms: int) -> Frame | None:
        """Drive :meth:`ConsumerCore.consume_steps` with blocking I/O."""
        driver = StepDriver(self._core.consume_steps(cursor, wait_ms, self.options.redirects_max))
        while driver.advance():
            action, argument = driver.step
            if action == "consume":
                try:
                    driver.reply = self._client.call(Command.CONSUME, argument, address=cursor.leader,
                                                     timeout_s=self.options.timeout_s + wait_ms / 1000.0,
                                                     follow_redirects=False, failover=True)
                except CursusError as exc:
                    driver.error = exc
            elif action == "leader":
                driver.reply = self._refresh_leader(cursor.partition)
            elif action == "backoff":
                time.sleep(self.options.backoff.delay_s(argument))
            else:
                bounds = self._list_offsets(cursor.partition)[0]
                driver.reply = (bounds.earliest, bounds.latest)
        result: Frame | None = driver.result
        return result

    def _prefetched_reply(self, cursor: PartitionCursor) -> Frame | None:
        """The reply of the prefetched CONSUME when it answers ``cursor`` now; None otherwise (an error
        reply too: the regular request then handles redirects and resets)."""
        prefetch = self._core.take_prefetch()
        if prefetch is None:
            return None
        try:
            frame = prefetch.connection.receive(prefetch.request_id, Command.CONSUME)
        except (OSError, ProtocolError):
            return None  # the connection is closed; the next prefetch reopens it
        if frame.status == Status.ERROR or not self._core.prefetch_matches(prefetch, cursor):
            return None
        return frame

    def _prefetch(self, cursor: PartitionCursor) -> None:
        """Write the next CONSUME of ``cursor`` (no wait) on the prefetch connection; best effort."""
        conn = self._prefetch_connections.get(cursor.leader)
        try:
            if conn is None or conn.stale():
                conn = self._prefetch_connections[cursor.leader] = self.options.connect(cursor.leader)
            request_id = conn.send(Command.CONSUME, encode_crq2(CommandPayload((), self._core.fields(cursor, 0))))
        except (OSError, ProtocolError, CursusError):
            return
        self._core.prefetched = Prefetch(cursor.partition, cursor.position, cursor.leader, request_id, conn)

    def _refresh_leader(self, partition: int) -> Address:
        self._metadata = None
        return self.metadata().leader_address(partition) or self._client.bootstrap[0]

    def poll(self, timeout_s: float | None = None) -> list[ConsumerRecord]:
        """Records from the next partition that has some, in offset order; ``[]`` if none arrive within
        ``timeout_s`` seconds (default: one long poll of ``wait_ms``)."""
        self._ensure_started()
        plan = StepDriver(self._core.poll_plan(self.wait_ms, timeout_s))
        while plan.advance():
            if self._closed:
                raise ClientClosedError("consumer is closed")
            plan.reply = self._fetch(*plan.step)
        records: list[ConsumerRecord] = plan.result
        return records

    def records(self, *, max_records: int | None = None, until_end: bool = False,
                idle_timeout_s: float | None = None) -> Iterator[ConsumerRecord]:
        """Iterate records.

        Args:
            max_records: stop after this many records.
            until_end: stop once every partition reaches the latest offset it had when iteration started. A
                position outside the partition's offsets at the start is ``OFFSET_OUT_OF_RANGE`` as for
                ``poll`` (``auto_offset_reset`` applies; ``"error"`` raises ``OffsetOutOfRangeError``).
            idle_timeout_s: stop after this long without any record.
        """
        self._ensure_started()
        ends = None
        if until_end:
            bounds = {o.partition: (o.earliest, o.latest) for o in self._list_offsets()}
            self._core.check_bounds(bounds)
            ends = {p: latest for p, (_, latest) in bounds.items() if p in self._core.cursors}
        count = 0
        idle_since = time.monotonic()
        while not self._closed and (max_records is None or count < max_records):
            if ends is not None and self._core.reached(ends):
                return
            records = self.poll()
            if records:
                idle_since = time.monotonic()
            elif idle_timeout_s is not None and time.monotonic() - idle_since >= idle_timeout_s:
                return
            if max_records is not None and len(records) > max_records - count:
                self._core.unread(records[max_records - count:])
                records = records[:max_records - count]
            records = self._core.cut(records, ends)
            pending = iter(records)
            try:
                yield from pending
            finally:
                count += len(records)
                rest = list(pending)  # not handed out (the caller stopped early): returned first next time
                if rest:
                    count -= len(rest)
                    self._core.unread(rest)

    def __iter__(self) -> Iterator[ConsumerRecord]:
        return self.records()

    def close(self) -> None:
        """Close connections (idempotent); iteration stops."""
        self._closed = True
        self._client.close()
        for conn in self._prefetch_connections.values():
            conn.close()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Ready:
    """An awaitable that is already done: ``await`` returns ``value`` without suspending."""

    __slots__ = ("value",)

    def __init__(self, value: ConsumerRecord) -> None:
        self.value = value

    def __await__(self) -> Generator[Any, None, ConsumerRecord]:
        return self.value
        yield  # a generator function: awaiting it finishes at once


class _AsyncRecords:
    """``async for`` over batches from an async generator, one record at a time, with no coroutine step
    per record (only per batch)."""

    __slots__ = ("_core", "_batches", "_batch", "_index", "_left")

    def __init__(self, core: ConsumerCore, batches: AsyncIterator[list[ConsumerRecord]],
                 max_records: int | None) -> None:
        self._core = core
        self._batches = batches
        self._batch: list[ConsumerRecord] = []
        self._index = 0
        self._left = max_records

    def __aiter__(self) -> _AsyncRecords:
        return self

    def __anext__(self) -> Awaitable[ConsumerRecord]:
        index = self._index
        if index < len(self._batch):
            self._index = index + 1
            return _Ready(self._batch[index])
        return self._next_batch()

    async def _next_batch(self) -> ConsumerRecord:
        left = self._left
        if left is not None and left <= 0:
            raise StopAsyncIteration
        batch = await self._batches.__anext__()  # StopAsyncIteration ends the iteration
        if left is not None:
            if len(batch) > left:
                self._core.unread(batch[left:])
                batch = batch[:left]
            self._left = left - len(batch)
        self._batch, self._index = batch, 1
        return batch[0]

    def reclaim(self) -> list[ConsumerRecord]:
        """Return (and forget) the records fetched and not handed out yet."""
        rest = self._batch[self._index:]
        self._batch, self._index = [], 0
        if self._left is not None:
            self._left += len(rest)
        return rest


class AsyncConsumer(_ConsumerSettings):
    """asyncio partition consumer: ``async for record in consumer`` or ``await poll()``. Arguments, units,
    behaviour and errors are those of :class:`Consumer`.
    """

    _client_type = AsyncClient

    async def metadata(self) -> TopicMetadata:
        """The topic's METADATA (cached)."""
        if self._metadata is None:
            frame = await self._client.call(Command.METADATA, {"topic": self.topic})
            self._metadata = parse_metadata(ok_fields(frame), self.topic)
        return self._metadata

    async def _list_offsets(self, partition: int | None = None) -> list[Any]:
        """See :meth:`Consumer._list_offsets`."""
        fields = {"topic": self.topic}
        if partition is not None:
            fields["partition"] = str(partition)
        try:
            return parse_list_offsets(ok_fields(await self._client.call(Command.LIST_OFFSETS, fields)))
        except NotLeaderError:
            if partition is not None:
                raise
            count = (await self.metadata()).partitions
            return [o for p in range(count) for o in await self._list_offsets(p)]

    async def _ensure_started(self) -> None:
        if self._closed:
            raise ClientClosedError("consumer is closed")
        if self._started:
            return
        metadata = await self.metadata()
        wanted = self._wanted if self._wanted is not None else range(metadata.partitions)
        await self.assign(_start_positions(self.topic, self._start, wanted, await self._list_offsets()))

    async def assign(self, positions: Mapping[int, int]) -> None:
        """See :meth:`Consumer.assign`."""
        self._reclaim()
        metadata = await self.metadata()
        default = self._client.bootstrap[0]
        self._core.assign({p: PartitionCursor(p, int(offset), metadata.leader_address(p) or default)
                           for p, offset in sorted(positions.items())})
        self._started = True

    async def positions(self) -> dict[int, int]:
        """See :meth:`Consumer.positions`."""
        await self._ensure_started()
        self._reclaim()
        return {p: self._core.position(p) for p in self._core.cursors}

    async def seek(self, partition: int, offset: int | str) -> None:
        """See :meth:`Consumer.seek`."""
        await self._ensure_started()
        self._reclaim()
        if isinstance(offset, str):
            bounds = (await self._list_offsets(partition))[0]
            offset = _resolve_start(offset, partition, bounds.earliest, bounds.latest)
        self._core.seek(partition, offset)

    async def _fetch(self, cursor: PartitionCursor, wait_ms: int) -> list[ConsumerRecord]:
        frame = await self._prefetched_reply(cursor) or await self._consume(cursor, wait_ms)
        if frame is None:
            return []
        records = self._core.on_reply(cursor, frame)
        if records:
            await self._prefetch(cursor)
        return records

    async def _prefetched_reply(self, cursor: PartitionCursor) -> Frame | None:
        """See :meth:`Consumer._prefetched_reply`."""
        prefetch = self._core.take_prefetch()
        if prefetch is None:
            return None
        try:
            frame = await prefetch.connection.receive(prefetch.request_id, Command.CONSUME)
        except (OSError, ProtocolError):
            return None
        if frame.status == Status.ERROR or not self._core.prefetch_matches(prefetch, cursor):
            return None
        return frame

    async def _prefetch(self, cursor: PartitionCursor) -> None:
        """See :meth:`Consumer._prefetch`."""
        conn = self._prefetch_connections.get(cursor.leader)
        try:
            if conn is None or conn.stale():
                conn = self._prefetch_connections[cursor.leader] = await open_connection(self.options,
                                                                                         cursor.leader)
            request_id = await conn.send(Command.CONSUME,
                                         encode_crq2(CommandPayload((), self._core.fields(cursor, 0))))
        except (OSError, ProtocolError, CursusError):
            return
        self._core.prefetched = Prefetch(cursor.partition, cursor.position, cursor.leader, request_id, conn)

    async def _consume(self, cursor: PartitionCursor, wait_ms: int) -> Frame | None:
        """Drive :meth:`ConsumerCore.consume_steps` with asyncio I/O (the same decisions as the blocking
        consumer, failover included)."""
        driver = StepDriver(self._core.consume_steps(cursor, wait_ms, self.options.redirects_max))
        while driver.advance():
            action, argument = driver.step
            if action == "consume":
                try:
                    driver.reply = await self._client.call(
                        Command.CONSUME, argument, address=cursor.leader,
                        timeout_s=self.options.timeout_s + wait_ms / 1000.0, follow_redirects=False, failover=True)
                except CursusError as exc:
                    driver.error = exc
            elif action == "leader":
                self._metadata = None
                driver.reply = (await self.metadata()).leader_address(cursor.partition) or self._client.bootstrap[0]
            elif action == "backoff":
                await asyncio.sleep(self.options.backoff.delay_s(argument))
            else:
                bounds = (await self._list_offsets(cursor.partition))[0]
                driver.reply = (bounds.earliest, bounds.latest)
        result: Frame | None = driver.result
        return result

    async def poll(self, timeout_s: float | None = None) -> list[ConsumerRecord]:
        """See :meth:`Consumer.poll`."""
        self._reclaim()
        return await self._poll(timeout_s)

    async def _poll(self, timeout_s: float | None = None) -> list[ConsumerRecord]:
        await self._ensure_started()
        plan = StepDriver(self._core.poll_plan(self.wait_ms, timeout_s))
        while plan.advance():
            if self._closed:
                raise ClientClosedError("consumer is closed")
            plan.reply = await self._fetch(*plan.step)
        records: list[ConsumerRecord] = plan.result
        return records

    def records(self, *, max_records: int | None = None, until_end: bool = False,
                idle_timeout_s: float | None = None) -> AsyncIterator[ConsumerRecord]:
        """See :meth:`Consumer.records` (``async for``). Records of a batch are handed out without a
        coroutine step each; those not handed out when an iteration is abandoned come first in the next
        ``poll``/``records``."""
        self._reclaim()
        self._active = _AsyncRecords(self._core, self._batches(until_end, idle_timeout_s), max_records)
        return self._active

    def _reclaim(self) -> None:
        """Put what the latest ``records()`` iteration fetched and did not hand out yet back in front of
        the buffer (it goes on from there if it is resumed)."""
        if self._active is not None:
            self._core.unread(self._active.reclaim())

    async def _batches(self, until_end: bool, idle_timeout_s: float | None) -> AsyncIterator[list[ConsumerRecord]]:
        await self._ensure_started()
        ends = None
        if until_end:
            bounds = {o.partition: (o.earliest, o.latest) for o in await self._list_offsets()}
            self._core.check_bounds(bounds)
            ends = {p: latest for p, (_, latest) in bounds.items()}
        idle_since = time.monotonic()
        while not self._closed:
            if ends is not None and self._core.reached(ends):
                return
            records = await self._poll()
            if records:
                idle_since = time.monotonic()
            elif idle_timeout_s is not None and time.monotonic() - idle_since >= idle_timeout_s:
                return
            records = self._core.cut(records, ends)
            if records:
                yield records

    def __aiter__(self) -> AsyncIterator[ConsumerRecord]:
        return self.records()

    async def close(self) -> None:
        """Close connections (idempotent)."""
        self._closed = True
        await self._client.close()
        for conn in self._prefetch_connections.values():
            await conn.close()

    async def __aenter__(self) -> AsyncConsumer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

