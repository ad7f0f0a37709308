"""Event store client (spec "Event Sourcing Commands"; facts A6 "Event store"), blocking and asyncio.

    from cursus.client.events import EventStore

    with EventStore("127.0.0.1:9000", "orders") as store:
        store.create_topic(partitions=3)
        store.append("order-1", b'{"type":"created"}', expected_version=1, event_type="OrderCreated")
        aggregate = store.read("order-1")      # snapshot (if any) + the events after it

``expected_version`` is the version the new event takes (the aggregate's current version + 1, as on the
wire); a wrong one raises :class:`~cursus.client.errors.VersionConflictError` (``current``/``expected``)
and nothing is written. With ``snapshot_every=N`` (default 500) an append whose new version is a multiple
of N saves the snapshot given as ``snapshot=`` (a string or a callable returning one) right after it.

Requests follow ``NOT_LEADER leader=`` redirects (the broker routes each key to its partition's leader) and,
while a partition changes leader, retry ``NOT_LEADER`` with backoff for up to ``failover_timeout_s``
(default 15 s); reads are also retried on retryable errors, appends are not (an unknown outcome raises
``DeliveryUnknownError``: read the version before appending again).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from cursus.client.aio import AsyncClient
from cursus.client.connection import Address, Client, ConnectionOptions, ok_fields
from cursus.client.errors import (
    CursusError,
    DeliveryUnknownError,
    NotLeaderError,
    ProtocolViolationError,
    VersionConflictError,
    error_from_frame,
)
from cursus.wire import Command, CommandPayload, Frame, Status, decode_batch, encode_crq2

DEFAULT_SNAPSHOT_EVERY = 500
#: READ_STREAM attempts (redirects and retryable errors) before the last error is raised.
READ_ATTEMPTS = 5
#: How long a call keeps retrying NOT_LEADER / transient errors while a partition changes leader (seconds).
DEFAULT_FAILOVER_TIMEOUT_S = 15.0


@dataclass(frozen=True, slots=True)
class Event:
    """One stored event: its aggregate ``version``, ``payload`` bytes, type, schema version, metadata,
    log ``offset`` and append ``timestamp`` (ms, None when absent)."""

    version: int
    payload: bytes
    event_type: str
    schema_version: int
    metadata: str
    offset: int
    timestamp: int | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An aggregate state saved at ``version`` (``payload`` as saved)."""

    version: int
    payload: str


@dataclass(frozen=True, slots=True)
class Aggregate:
    """READ_STREAM's answer: the usable ``snapshot`` (or None) and the ``events`` after it, in order."""

    key: str
    partition: int
    snapshot: Snapshot | None
    events: list[Event]

    @property
    def version(self) -> int:
        """The version after the snapshot and events (0 for an empty aggregate)."""
        if self.events:
            return self.events[-1].version
        return self.snapshot.version if self.snapshot is not None else 0


@dataclass(frozen=True, slots=True)
class AppendResult:
    """APPEND_STREAM's answer: the event's ``version``, log ``offset`` and ``partition``."""

    version: int
    offset: int
    partition: int


SnapshotSource = str | Callable[[], str] | None
T = TypeVar("T")


class _Failover:
    """Retry policy of an event-store call while its partition changes leader (sans-IO).

    ``NOT_LEADER`` (after the client's redirect budget) and, for retry-safe calls, retryable errors
    (``leader_not_available``, a transient ``storage_unavailable``, an unreachable broker) are retried with
    exponential backoff (50 ms doubling to 1 s) until ``timeout_s`` has passed; then the last error is raised.
    An APPEND_STREAM retried after a ``NOT_LEADER`` may meet its own earlier attempt (the old leader may have
    appended it before losing its role), so a ``version_conflict`` then raises ``DeliveryUnknownError``.
    """

    def __init__(self, timeout_s: float, retry_safe: bool) -> None:
        self.deadline = time.monotonic() + timeout_s
        self.retry_safe = retry_safe
        self.attempt = 0
        self.redirected = False

    def after(self, exc: CursusError) -> float:
        """The delay before the next attempt, or raises ``exc`` (or ``DeliveryUnknownError``)."""
        if isinstance(exc, VersionConflictError) and self.redirected:
            raise DeliveryUnknownError(f"APPEND_STREAM retried after NOT_LEADER met a conflict; the first attempt "
                                       f"may have been applied: {exc}", fields=exc.fields) from exc
        if not (isinstance(exc, NotLeaderError) or (self.retry_safe and exc.retryable)):
            raise exc
        if time.monotonic() >= self.deadline:
            raise exc
        self.redirected = self.redirected or isinstance(exc, NotLeaderError)
        delay = min(0.05 * 2 ** self.attempt, 1.0, max(0.0, self.deadline - time.monotonic()))
        self.attempt += 1
        return delay


def _append_fields(topic: str, key: str, payload: bytes | str, expected_version: int, event_type: str,
                   schema_version: int, metadata: str | Mapping[str, Any] | None, event_id: str | None,
                   producer_id: str | None, seq_num: int | None) -> dict[str, str]:
    fields = {"topic": topic, "key": key, "version": str(expected_version), "schema_version": str(schema_version)}
    if event_type:
        fields["event_type"] = event_type
    if metadata:
        fields["metadata"] = metadata if isinstance(metadata, str) else json.dumps(metadata, separators=(",", ":"))
    if event_id:
        fields["event_id"] = event_id
    if producer_id:
        fields["producerId"] = producer_id
    if seq_num is not None:
        fields["seqNum"] = str(seq_num)
    fields["message"] = payload.decode("utf-8") if isinstance(payload, bytes) else payload
    return fields


def _append_result(frame: Frame) -> AppendResult:
    fields = ok_fields(frame)
    try:
        return AppendResult(int(fields["version"]), int(fields["offset"]), int(fields["partition"]))
    except (KeyError, ValueError):
        raise ProtocolViolationError(f"APPEND_STREAM reply lacks version/offset/partition: {fields}") from None


def parse_read_stream(key: str, envelope: Frame, batch: Frame) -> Aggregate:
    """The two READ_STREAM frames as an :class:`Aggregate` (facts A6). Raises the envelope's error."""
    return parse_read_stream_page(key, envelope, batch)[0]


def parse_read_stream_page(key: str, envelope: Frame, batch: Frame) -> tuple[Aggregate, int | None]:
    """The two READ_STREAM frames as an :class:`Aggregate` and the version to read on from when the broker
    cut the reply (envelope ``"more": true, "next_from_version": N``; None when the reply is whole)."""
    if envelope.status == Status.ERROR:
        raise error_from_frame(envelope)
    try:
        doc = json.loads(envelope.payload)
    except ValueError as exc:
        raise ProtocolViolationError(f"READ_STREAM envelope is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("status") != "OK":
        raise ProtocolViolationError(f"READ_STREAM envelope is not OK: {envelope.payload[:200]!r}")
    snap = doc.get("snapshot")
    snapshot = Snapshot(int(snap["version"]), str(snap["payload"])) if snap else None
    if batch.status == Status.ERROR:
        raise error_from_frame(batch)
    events = []
    if batch.payload:
        for r in decode_batch(batch.payload).records:
            events.append(Event(r.aggregate_version or 0, bytes(r.payload), r.event_type or "",
                                r.schema_version or 0, r.metadata or "", r.offset, r.timestamp))
    next_from = None
    if doc.get("more"):
        try:
            next_from = int(doc["next_from_version"])
        except (KeyError, TypeError, ValueError):
            raise ProtocolViolationError(f"READ_STREAM envelope says more without next_from_version: {doc}") from None
    return Aggregate(key, int(doc.get("partition", -1)), snapshot, events), next_from


def _merge_page(whole: Aggregate | None, page: Aggregate) -> Aggregate:
    """``page`` (read on from the version after ``whole``'s last event) added to ``whole``: a page with a
    snapshot (saved meanwhile, at or after that version) replaces what was read before it."""
    if whole is None or page.snapshot is not None:
        return page
    return Aggregate(whole.key, page.partition, whole.snapshot, whole.events + page.events)


def _read_fields(topic: str, key: str, from_version: int) -> dict[str, str]:
    fields = {"topic": topic, "key": key}
    if from_version > 1:
        fields["from_version"] = str(from_version)
    return fields


def _next_page(previous_from: int, next_from: int | None) -> int | None:
    if next_from is not None and next_from <= previous_from:
        raise ProtocolViolationError(f"READ_STREAM next_from_version={next_from} does not advance past "
                                     f"from_version={previous_from}")
    return next_from


def parse_snapshot(frame: Frame) -> Snapshot | None:
    """READ_SNAPSHOT's ``OK snapshot=null`` / ``OK snapshot=<json>``."""
    if frame.status == Status.ERROR:
        raise error_from_frame(frame)
    text = frame.payload.decode("utf-8")
    prefix = "OK snapshot="
    if not text.startswith(prefix):
        raise ProtocolViolationError(f"READ_SNAPSHOT reply: {text[:120]!r}")
    doc = json.loads(text[len(prefix):])
    return None if doc is None else Snapshot(int(doc["version"]), str(doc["payload"]))


def _snapshot_text(source: SnapshotSource) -> str | None:
    return source() if callable(source) else source


def _payload(fields: Mapping[str, str]) -> bytes:
    return encode_crq2(CommandPayload((), dict(fields)))


class EventStore:
    """Blocking event store client for one event-sourcing ``topic`` (see the module docstring).

    Args:
        bootstrap: ``host:port`` (or a list).
        topic: the event-sourcing topic.
        snapshot_every: auto-snapshot period in events (0: never).
        options, overrides: connection options, as for :class:`~cursus.client.connection.Client`.
    """

    def __init__(self, bootstrap: str | Sequence[str], topic: str, *, snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
                 failover_timeout_s: float = DEFAULT_FAILOVER_TIMEOUT_S, options: ConnectionOptions | None = None,
                 **overrides: Any) -> None:
        self.topic = topic
        self.snapshot_every = snapshot_every
        self.failover_timeout_s = failover_timeout_s
        self.client = Client(bootstrap, options, **overrides)

    def _failover(self, call: Callable[[], T], retry_safe: bool) -> T:
        """``call()``, again with backoff while the partition changes leader (see :class:`_Failover`)."""
        failover = _Failover(self.failover_timeout_s, retry_safe)
        while True:
            try:
                return call()
            except CursusError as exc:
                time.sleep(failover.after(exc))

    def create_topic(self, partitions: int = 1) -> None:
        """CREATE the topic with ``event_sourcing=true`` (an existing one is left as it is)."""
        ok_fields(self.client.call(Command.CREATE, {"topic": self.topic, "partitions": str(partitions),
                                                    "event_sourcing": "true"}, retry_safe=True))

    def append(self, key: str, payload: bytes | str, *, expected_version: int, event_type: str = "",
               schema_version: int = 1, metadata: str | Mapping[str, Any] | None = None,
               event_id: str | None = None, producer_id: str | None = None, seq_num: int | None = None,
               snapshot: SnapshotSource = None) -> AppendResult:
        """Append one event that takes version ``expected_version`` (current + 1).

        Raises:
            VersionConflictError: the aggregate is not at ``expected_version - 1`` (nothing written).
            CursusError: other broker errors; ``DeliveryUnknownError`` when the outcome is unknown.
        """
        fields = _append_fields(self.topic, key, payload, expected_version, event_type, schema_version, metadata,
                                event_id, producer_id, seq_num)
        result = _append_result(self._failover(
            lambda: self.client.call(Command.APPEND_STREAM, fields, retry_safe=False), retry_safe=False))
        if snapshot is not None and self.snapshot_every and result.version % self.snapshot_every == 0:
            state = _snapshot_text(snapshot)
            if state is not None:
                self.save_snapshot(key, result.version, state)
        return result

    def read(self, key: str, from_version: int = 1) -> Aggregate:
        """READ_STREAM: the latest usable snapshot and every event after it (from ``from_version``), so
        ``version`` is the aggregate's current committed version. A long stream the broker serves in
        parts (envelope ``more``/``next_from_version``) is read on until it is whole.

        Raises:
            CursusError: the broker's error (``stream_retention_gap`` when events are gone from the log).
        """
        whole: Aggregate | None = None
        next_from: int | None = from_version
        while next_from is not None:
            start = next_from
            page, more = self._failover(functools.partial(self._read_page, key, start), retry_safe=True)
            whole = _merge_page(whole, page)
            next_from = _next_page(next_from, more)
        assert whole is not None
        return whole

    def _read_page(self, key: str, from_version: int) -> tuple[Aggregate, int | None]:
        fields = _read_fields(self.topic, key, from_version)
        address: Address | None = None
        last: CursusError | None = None
        for attempt in range(READ_ATTEMPTS):
            conn = self.client.connection(address)
            request_id = conn.send(Command.READ_STREAM, _payload(fields))
            envelope = conn.receive(request_id, Command.READ_STREAM)
            if envelope.status == Status.ERROR:
                last = error_from_frame(envelope)
                if isinstance(last, NotLeaderError) and last.leader is not None:
                    address = last.leader
                    continue
                if last.retryable:
                    time.sleep(min(0.05 * 2 ** attempt, 1.0))
                    continue
                raise last
            return parse_read_stream_page(key, envelope, conn.receive(request_id, Command.READ_STREAM))
        assert last is not None
        raise last

    def version(self, key: str) -> int:
        """STREAM_VERSION: the aggregate's committed version (0 when it has no events)."""
        frame = self._failover(lambda: self.client.call(Command.STREAM_VERSION, {"topic": self.topic, "key": key}),
                               retry_safe=True)
        return int(ok_fields(frame)["version"])

    def save_snapshot(self, key: str, version: int, state: str) -> None:
        """SAVE_SNAPSHOT of the aggregate state at ``version`` (at most the current version)."""
        fields = {"topic": self.topic, "key": key, "version": str(version), "message": state}
        ok_fields(self._failover(lambda: self.client.call(Command.SAVE_SNAPSHOT, fields, retry_safe=True),
                                 retry_safe=True))

    def read_snapshot(self, key: str) -> Snapshot | None:
        """READ_SNAPSHOT: the latest snapshot, or None."""
        return parse_snapshot(self._failover(
            lambda: self.client.call(Command.READ_SNAPSHOT, {"topic": self.topic, "key": key}), retry_safe=True))

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> EventStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncEventStore:
    """The asyncio :class:`EventStore` (same methods, awaited)."""

    def __init__(self, bootstrap: str | Sequence[str], topic: str, *, snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
                 failover_timeout_s: float = DEFAULT_FAILOVER_TIMEOUT_S, options: ConnectionOptions | None = None,
                 **overrides: Any) -> None:
        self.topic = topic
        self.snapshot_every = snapshot_every
        self.failover_timeout_s = failover_timeout_s
        self.client = AsyncClient(bootstrap, options, **overrides)

    async def _failover(self, call: Callable[[], Awaitable[T]], retry_safe: bool) -> T:
        failover = _Failover(self.failover_timeout_s, retry_safe)
        while True:
            try:
                return await call()
            except CursusError as exc:
                await asyncio.sleep(failover.after(exc))

    async def create_topic(self, partitions: int = 1) -> None:
        ok_fields(await self.client.call(Command.CREATE, {"topic": self.topic, "partitions": str(partitions),
                                                          "event_sourcing": "true"}, retry_safe=True))

    async def append(self, key: str, payload: bytes | str, *, expected_version: int, event_type: str = "",
                     schema_version: int = 1, metadata: str | Mapping[str, Any] | None = None,
                     event_id: str | None = None, producer_id: str | None = None, seq_num: int | None = None,
                     snapshot: SnapshotSource = None) -> AppendResult:
        fields = _append_fields(self.topic, key, payload, expected_version, event_type, schema_version, metadata,
                                event_id, producer_id, seq_num)
        result = _append_result(await self._failover(
            lambda: self.client.call(Command.APPEND_STREAM, fields, retry_safe=False), retry_safe=False))
        if snapshot is not None and self.snapshot_every and result.version % self.snapshot_every == 0:
            state = _snapshot_text(snapshot)
            if state is not None:
                await self.save_snapshot(key, result.version, state)
        return result

    async def read(self, key: str, from_version: int = 1) -> Aggregate:
        """:meth:`EventStore.read` (reads on until the stream is whole)."""
        whole: Aggregate | None = None
        next_from: int | None = from_version
        while next_from is not None:
            start = next_from
            page, more = await self._failover(functools.partial(self._read_page, key, start), retry_safe=True)
            whole = _merge_page(whole, page)
            next_from = _next_page(next_from, more)
        assert whole is not None
        return whole

    async def _read_page(self, key: str, from_version: int) -> tuple[Aggregate, int | None]:
        fields = _read_fields(self.topic, key, from_version)
        address: Address | None = None
        last: CursusError | None = None
        for attempt in range(READ_ATTEMPTS):
            conn = await self.client.connection(address)
            request_id = await conn.send(Command.READ_STREAM, _payload(fields))
            envelope = await conn.receive(request_id, Command.READ_STREAM)
            if envelope.status == Status.ERROR:
                last = error_from_frame(envelope)
                if isinstance(last, NotLeaderError) and last.leader is not None:
                    address = last.leader
                    continue
                if last.retryable:
                    await asyncio.sleep(min(0.05 * 2 ** attempt, 1.0))
                    continue
                raise last
            return parse_read_stream_page(key, envelope, await conn.receive(request_id, Command.READ_STREAM))
        assert last is not None
        raise last

    async def version(self, key: str) -> int:
        frame = await self._failover(
            lambda: self.client.call(Command.STREAM_VERSION, {"topic": self.topic, "key": key}), retry_safe=True)
        return int(ok_fields(frame)["version"])

    async def save_snapshot(self, key: str, version: int, state: str) -> None:
        fields = {"topic": self.topic, "key": key, "version": str(version), "message": state}
        ok_fields(await self._failover(lambda: self.client.call(Command.SAVE_SNAPSHOT, fields, retry_safe=True),
                                       retry_safe=True))

    async def read_snapshot(self, key: str) -> Snapshot | None:
        return parse_snapshot(await self._failover(
            lambda: self.client.call(Command.READ_SNAPSHOT, {"topic": self.topic, "key": key}), retry_safe=True))

    async def close(self) -> None:
        await self.client.close()

    async def __aenter__(self) -> AsyncEventStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
