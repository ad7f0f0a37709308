"""Producers: :class:`Producer` (background threads, ``concurrent.futures`` results) and
:class:`AsyncProducer` (asyncio tasks, awaitable results).

Both drive the same sans-IO :class:`ProducerCore`, which owns every decision:

* **Routing** (facts decision 12): a record with an explicit ``partition`` goes there; a keyed record on a
  ``hash_key`` topic goes to ``partition_for_key(key, partitions)``, exactly the broker's FNV-1a 64 rule;
  other records are spread "sticky round-robin" (one partition's batch fills before the next is used).
* **Batching**: records queue per partition and leave as one CBV2 batch when ``batch_size`` records or
  ``batch_bytes`` bytes are queued, ``linger_ms`` after the first one, or at once during ``flush``/``close``.
* **Pipelining**: each connection carries up to ``max_in_flight`` PUBLISH requests before it reads the
  oldest reply (the broker answers them in request order and appends them in arrival order). The batches in
  flight for one partition all travel on one connection, so its records keep their order and sequences.
* **Connections**: a small pool per broker (``connections_per_broker``); partitions go to their leader from
  ``METADATA`` (refreshed on redirects and connection failures).
* **Idempotence** (spec section 9, facts decision 13): every record carries producer id, epoch and a
  per-partition sequence from 1 (facts A5). With ``idempotent=True`` (acks=all), batches are retried on
  connection loss and on retryable errors, and the broker de-duplicates the repeats: each record is written
  exactly once per producer session. When a batch fails retriably while later batches of its partition are
  in flight, those later batches are resent after it, in sequence order, once every reply of the partition
  is in (the broker answers the later ones ``idempotency_gap`` when the earlier one is missing, or
  acknowledges a repeat with its original offsets). A batch that fails for good takes the later batches of
  its partition still unacknowledged with it (their sequences would have a gap), and the partition's next
  batch starts after the last acknowledged sequence. Otherwise ``producer_fenced``,
  ``stale_producer_epoch``, ``idempotency_gap`` and ``sequence_out_of_order`` are terminal: the producer
  fails every pending record and refuses new ones.
  A batch that still has an unknown outcome at ``delivery_timeout_s`` fails with ``DeliveryUnknownError``
  and, once nothing of its partition is in flight, the partition moves to the next producer epoch at
  sequence 1 (as Kafka's epoch bump), so the records after it are never refused for a sequence gap.
* **Retries only where safe**: a batch never written (connect failure) or redirected (``NOT_LEADER``) is
  always resent; a non-idempotent batch whose connection dropped after writing fails with
  ``DeliveryUnknownError``, non-idempotent producers retry only refusals (nothing appended), and never resend
  a batch once a later batch of its partition may be in the log (acknowledged, or its outcome unknown: that
  would reorder the partition). A batch refused while later ones are in flight waits for their replies: if
  they were refused too (a pipelined window redirected by ``NOT_LEADER``), all are resent in order; if one
  was appended, the earlier refused ones fail with their own error. Retries use exponential backoff with
  jitter and end at ``delivery_timeout_s``; a redirect to another broker than the one that refused goes at once.
* **Delivery deadline** (Kafka's ``delivery.timeout.ms``): every record's ``delivery_timeout_s`` starts when
  ``send`` accepts it. A batch's deadline is its oldest record's; a record still queued at its deadline
  fails with ``DeliveryTimeoutError`` (never written). Idle senders wake for the next deadline.
* **Topic lifecycle** (spec "DELETE", "TRUNCATE"): after a truncate or a delete + re-create the broker has
  forgotten the producer. Learned from ``idempotency_gap expected=1`` (for a batch after sequence 1),
  ``topic_not_found`` on PUBLISH, or METADATA (``lifecycle_epoch`` changed, ``revision`` lower), the
  partitions' pending batches fail instead of being resent into the new generation, and each partition
  then moves to the next producer epoch at sequence 1 (the producer stays usable).
* **Wake-ups**: the sender threads of each leader wait on their own condition, so a batch becoming due
  wakes a sender that can send it.
* **Intake** (:class:`Producer`): ``send`` appends the record to an intake deque without a lock (never
  the producer lock the senders hold); the records reach the core in bulk and in order
  (:meth:`ProducerCore.append_all`) when a sender passes by, every 256 records, or at once when every
  sender sleeps beyond ``linger_ms``; ``flush``, ``close`` and ``produce`` take them first.
* **Results**: ``send`` returns a future per record resolving to :class:`RecordMetadata` (offset None for
  acks=0) or failing with a :class:`~cursus.client.errors.CursusError`. ``flush``/``close`` wait for every
  record and raise :class:`~cursus.client.errors.DeliveryFailedError` if any failed since the last flush.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import operator
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import _base as _futures_base
from dataclasses import dataclass, replace
from itertools import repeat
from typing import Any, Protocol

from cursus.client.admin import TopicMetadata, parse_metadata
from cursus.client.aio import AsyncClient, AsyncConnection, open_connection
from cursus.client.connection import (
    DEFAULT_ADDRESS,
    Address,
    Backoff,
    Client,
    Connection,
    ConnectionOptions,
    ok_fields,
    options_from,
)
from cursus.client.errors import (
    TERMINAL_PRODUCER_CODES,
    BufferFullError,
    ClientClosedError,
    CursusError,
    DeliveryFailedError,
    DeliveryTimeoutError,
    DeliveryUnknownError,
    NotFoundError,
    ProtocolViolationError,
    RequestTimeoutError,
    RoutingError,
    TopicNotFoundError,
    ValidationError,
    error_from_ack,
    error_from_frame,
)
from cursus.client.records import RecordMetadata
from cursus.partitioning import partition_for_key
from cursus.wire import (
    MAX_RECORDS_PER_BATCH,
    Command,
    Frame,
    ProtocolError,
    RecordEncoder,
    Status,
    encode_batch_header,
    encode_text_field,
)

__all__ = ["AsyncProducer", "Producer", "ProducerConfig", "ProducerCore", "RecordMetadata", "normalize_acks"]

log = logging.getLogger("cursus.client.producer")

_ACKS = {"0": "0", "none": "0", "1": "1", "": "1", "leader": "1", "-1": "-1", "all": "-1"}
#: Bytes a record costs beyond its value and key in the batch (length prefix, header, producer group).
_RECORD_OVERHEAD_BYTES = 64
_FAILURES_KEPT_MAX = 100
_METADATA_REFRESH_INTERVAL_S = 0.2
_time = time.time
_monotonic = time.monotonic
#: Batches per producer and partition the broker remembers for de-duplication (facts decision 13), so the
#: most an idempotent producer may have in flight per connection (Kafka's rule too).
MAX_IN_FLIGHT_IDEMPOTENT = 5


def normalize_acks(acks: str | int) -> str:
    """The wire acks string for ``acks``: ``"0"`` (0, none), ``"1"`` (1, leader) or ``"-1"`` (all, -1).

    Raises ``ValueError`` for anything else (facts decision 11).
    """
    value = _ACKS.get(str(acks).strip().lower())
    if value is None:
        raise ValueError(f"invalid acks {acks!r}: use 0, 1 or all")
    return value


@dataclass(frozen=True, slots=True)
class ProducerConfig:
    """Validated producer settings (see :class:`Producer` for their meaning and units)."""

    acks: str
    idempotent: bool
    batch_size: int
    batch_bytes: int
    linger_s: float
    connections_per_broker: int
    buffer_records: int
    max_block_s: float
    delivery_timeout_s: float
    request_timeout_s: float
    backoff: Backoff
    producer_id: str
    producer_epoch: int
    max_record_bytes: int = 1 << 20
    max_in_flight: int = 5

    @classmethod
    def build(cls, *, acks: str | int | None, idempotent: bool, batch_size: int, batch_bytes: int,
              linger_ms: float, connections_per_broker: int, buffer_records: int, max_block_s: float,
              delivery_timeout_s: float, request_timeout_s: float, backoff: Backoff, producer_id: str | None,
              producer_epoch: int | None, id_prefix: str, max_record_bytes: int = 1 << 20,
              max_in_flight: int = 5) -> ProducerConfig:
        """Validate and fill defaults. Raises ``ValueError`` for inconsistent or out-of-range settings."""
        wire_acks = normalize_acks(acks if acks is not None else ("all" if idempotent else "1"))
        if idempotent and wire_acks != "-1":
            raise ValueError("an idempotent producer needs acks=all (spec section 9)")
        if not 1 <= batch_size <= MAX_RECORDS_PER_BATCH:
            raise ValueError(f"batch_size must be 1-{MAX_RECORDS_PER_BATCH} records")
        if batch_bytes < 1 or linger_ms < 0 or connections_per_broker < 1 or buffer_records < 1:
            raise ValueError("batch_bytes, connections_per_broker and buffer_records must be positive, "
                             "linger_ms >= 0")
        if max_block_s < 0 or delivery_timeout_s <= 0 or request_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if max_record_bytes < 1:
            raise ValueError("max_record_bytes must be positive")
        if not 1 <= max_in_flight <= MAX_IN_FLIGHT_IDEMPOTENT and (idempotent or max_in_flight < 1):
            raise ValueError(f"max_in_flight must be 1-{MAX_IN_FLIGHT_IDEMPOTENT} for an idempotent producer "
                             "(the broker remembers that many batches per producer), positive otherwise")
        return cls(wire_acks, idempotent, batch_size, batch_bytes, linger_ms / 1000.0, connections_per_broker,
                   buffer_records, max_block_s, delivery_timeout_s, request_timeout_s, backoff,
                   producer_id or f"{id_prefix}{os.urandom(8).hex()}",
                   int(time.time() * 1000) if producer_epoch is None else producer_epoch, max_record_bytes,
                   max_in_flight)


class PendingRecord(Protocol):
    """What the core keeps of one record accepted by ``send`` and not yet delivered: :class:`_Pending`
    (the asyncio producer's, with its asyncio future) or :class:`DeliveryFuture` (the blocking producer's
    record is its own future: one object per record)."""

    value: bytes
    key_field: bytes | None
    timestamp: int
    size: int
    #: Monotonic seconds after which the record fails (``send`` time plus ``delivery_timeout_s``, set by
    #: :meth:`ProducerCore.append`; until then the time ``send`` accepted it).
    deadline: float

    @property
    def future(self) -> Any:
        """What the record's outcome resolves."""


class _Pending:
    """One record accepted by ``send`` and not yet delivered (a :class:`PendingRecord`)."""

    __slots__ = ("value", "key_field", "timestamp", "future", "size", "deadline")

    def __init__(self, value: bytes, key_field: bytes | None, timestamp: int | None, future: Any,
                 deadline: float = 0.0) -> None:
        #: Monotonic seconds after which the record fails (``send`` time plus ``delivery_timeout_s``, set
        #: by :meth:`ProducerCore.append`; until then the time ``send`` accepted it).
        self.deadline = deadline
        self.value = value
        self.key_field = key_field
        self.timestamp = int(_time() * 1000) if timestamp is None else timestamp  # CreateTime, as Kafka
        self.future = future
        self.size = len(value) + (len(key_field) if key_field else 0) + _RECORD_OVERHEAD_BYTES


class _PartitionState:
    """Queue, in-flight and sequence state of one partition."""

    __slots__ = ("topic", "partition", "queue", "queued_bytes", "first_enqueued", "in_flight", "sender",
                 "retries", "next_seq", "sent_end", "acked_end", "logged_end", "failing", "uncertain", "restart",
                 "encoder", "leader", "epoch")

    def __init__(self, topic: str, partition: int, leader: Address, encoder: RecordEncoder, epoch: int) -> None:
        self.topic = topic
        self.partition = partition
        self.queue: deque[PendingRecord] = deque()
        self.queued_bytes = 0
        self.first_enqueued = 0.0
        #: Batches written (or being written) whose outcome is not known yet, all by ``sender``.
        self.in_flight = 0
        self.sender: object = None
        #: Batches to resend, in sequence order; resent one at a time once nothing is in flight.
        self.retries: list[ProducerBatch] = []
        self.next_seq = 1
        #: The last sequence sent, and the last one acknowledged (0: none).
        self.sent_end = 0
        self.acked_end = 0
        #: The last sequence that may be in the log: acknowledged, or of a batch whose outcome is unknown
        #: (without idempotence no earlier batch is resent once a later one may be there: reorder).
        self.logged_end = 0
        #: A batch failed for good while later ones were unacknowledged: until the partition settles, their
        #: failures are final too (idempotent producers; see the module docstring).
        self.failing = False
        #: Some failed batch may have been appended (its outcome is unknown).
        self.uncertain = False
        #: The broker no longer knows this producer's sequences here (the topic was deleted, re-created or
        #: truncated): batches still in flight fail rather than being resent, and once none is left the
        #: partition moves to the next producer epoch at sequence 1.
        self.restart = False
        self.encoder = encoder
        self.leader = leader
        #: The producer epoch this partition's batches carry: the producer's, plus one per sequence reset.
        self.epoch = epoch

    @property
    def busy(self) -> bool:
        """A batch is in flight or waiting to be resent."""
        return self.in_flight > 0 or bool(self.retries)


class ProducerBatch:
    """One CBV2 batch: records with sequences ``seq_start .. seq_start + len(records) - 1``."""

    __slots__ = ("state", "pendings", "seq_start", "seq_end", "payload", "attempts", "deadline", "not_before",
                 "uncertain", "sent_to", "error")

    def __init__(self, state: _PartitionState, pendings: list[PendingRecord], seq_start: int, deadline: float) -> None:
        self.state = state
        self.pendings = pendings
        self.seq_start = seq_start
        self.seq_end = seq_start + len(pendings) - 1
        self.payload: bytes | None = None
        self.attempts = 0
        self.deadline = deadline
        self.not_before = 0.0
        self.uncertain = False  # some attempt was written and its outcome never learned
        #: The broker the last attempt went to (the partition's leader when it left).
        self.sent_to: Address | None = None
        #: The last attempt's error (what a batch waiting for a resend fails with if it cannot go).
        self.error: BaseException | None = None

    @property
    def topic(self) -> str:
        """The batch's topic."""
        return self.state.topic

    @property
    def partition(self) -> int:
        """The batch's partition."""
        return self.state.partition


class Delivery:
    """Where one acknowledged batch landed, shared by its records' futures: record ``i`` (in batch order) is
    at ``first_offset + i`` (None for acks=0) with sequence ``seq_start + i``. Holds no reference to the
    batch, so futures kept by the caller keep nothing else alive."""

    __slots__ = ("topic", "partition", "first_offset", "producer_id", "producer_epoch", "seq_start")

    def __init__(self, topic: str, partition: int, first_offset: int | None, producer_id: str,
                 producer_epoch: int, seq_start: int) -> None:
        self.topic = topic
        self.partition = partition
        self.first_offset = first_offset
        self.producer_id = producer_id
        self.producer_epoch = producer_epoch
        self.seq_start = seq_start

    def metadata(self, index: int) -> RecordMetadata:
        """The :class:`RecordMetadata` of the batch's record ``index`` (0-based)."""
        first = self.first_offset
        return RecordMetadata(self.topic, self.partition, None if first is None else first + index,
                              self.producer_id, self.producer_epoch, self.seq_start + index)


#: (future, result or exception, is_exception): applied by the wrapper outside its lock.
Resolution = tuple[Any, Any, bool]


class _TopicState:
    __slots__ = ("metadata", "sticky", "refreshed_at")

    def __init__(self, metadata: TopicMetadata, now: float) -> None:
        self.metadata = metadata
        self.sticky = 0
        self.refreshed_at = now


class ProducerCore:
    """The producer's state machine, without threads, sockets or clocks (time is passed in).

    Not thread-safe: :class:`Producer` calls it under a lock, :class:`AsyncProducer` from one event loop.
    ``buffered`` counts records accepted and not yet completed.
    """

    def __init__(self, config: ProducerConfig, default_leader: Address) -> None:
        self.config = config
        self.default_leader = default_leader
        self.topics: dict[str, _TopicState] = {}
        self.partitions: dict[tuple[str, int], _PartitionState] = {}
        self.by_address: dict[Address, list[_PartitionState]] = {}
        self.buffered = 0
        self.in_flight = 0
        self.fatal: CursusError | None = None
        self.failures: list[BaseException] = []
        self.failed_count = 0
        self.flushing = 0
        self.closing = False
        #: Monotonic seconds by which some queued record's delivery deadline passes (a lower bound:
        #: :meth:`expire` recomputes it); ``inf`` when nothing is queued.
        self.next_expiry = float("inf")
        self._rotation = itertools.count()

    # ----------------------------------------------------------------------------------------- metadata

    def set_metadata(self, metadata: TopicMetadata, now: float) -> list[Resolution]:
        """Install (or refresh) a topic's metadata; existing partitions move to their new leaders. Returns
        the failures to resolve (outside any lock) when the topic turns out truncated or re-created (its
        ``lifecycle_epoch`` changed or its ``revision`` went down): see :meth:`restart_topic`."""
        resolutions: list[Resolution] = []
        state = self.topics.get(metadata.topic)
        if state is None:
            self.topics[metadata.topic] = _TopicState(metadata, now)
        else:
            old = state.metadata
            state.metadata = metadata
            state.refreshed_at = now
            if metadata.lifecycle_epoch != old.lifecycle_epoch or metadata.revision < old.revision:
                # truncated (lifecycle epoch) or deleted and re-created (the revision starts again at 1)
                resolutions = self.restart_topic(metadata.topic, TopicNotFoundError(
                    "topic_not_found", f"topic {metadata.topic} was truncated or re-created while the batch "
                    "was pending (not resent into the new topic)", fields={"topic": metadata.topic}))
        for (topic, partition), pstate in self.partitions.items():
            if topic == metadata.topic:
                self._move(pstate, metadata.leader_address(partition) or self.default_leader)
        return resolutions

    def restart_topic(self, topic: str, error: BaseException,
                      skip: _PartitionState | None = None) -> list[Resolution]:
        """The topic was deleted, re-created or truncated: the broker forgot this producer's sequences on
        every partition of it. Batches waiting for a retry fail with ``error`` (``DeliveryUnknownError`` if
        an attempt may have been appended): they belong to the old incarnation. Idle partitions move to
        the next producer epoch at sequence 1 now, busy ones once their batches in flight are back (those
        fail instead of being resent; see ``_PartitionState.restart``). Queued records (never sent, no
        sequence yet) stay queued for the topic as it is now. ``skip``: a partition the caller restarts
        itself."""
        resolutions: list[Resolution] = []
        for (name, _), pstate in self.partitions.items():
            if name == topic and pstate is not skip:
                pstate.restart = True
                resolutions.extend(self._drop_retries(pstate, error))
                self._settle(pstate)
        return resolutions

    def _drop_retries(self, pstate: _PartitionState, error: BaseException) -> list[Resolution]:
        resolutions: list[Resolution] = []
        for retry in pstate.retries:
            resolutions.extend(self._fail_pendings(retry.pendings, _unknown(retry, error) if retry.uncertain
                                                   else error))
        pstate.retries.clear()
        return resolutions

    def needs_refresh(self, topic: str, now: float) -> bool:
        """True when the topic's metadata is older than the refresh interval (rate limit)."""
        state = self.topics.get(topic)
        return state is None or now - state.refreshed_at >= _METADATA_REFRESH_INTERVAL_S

    def _move(self, pstate: _PartitionState, leader: Address) -> None:
        if pstate.leader == leader:
            return
        self.by_address[pstate.leader].remove(pstate)
        pstate.leader = leader
        self.by_address.setdefault(leader, []).append(pstate)

    def addresses(self) -> list[Address]:
        """Broker addresses that lead at least one partition this producer has used."""
        return [a for a, states in self.by_address.items() if states]

    # ----------------------------------------------------------------------------------------- accepting

    def route(self, topic: str, key: str | None, partition: int | None) -> int:
        """The partition for a record (see module doc). Needs the topic's metadata.

        Raises ``ValidationError`` (``partition_not_found``/``invalid_partition``) for a bad explicit partition.
        """
        state = self.topics[topic]
        count = state.metadata.partitions
        if count < 1:
            raise ValidationError("invalid_partitions", f"topic {topic} reports {count} partitions",
                                  fields={"topic": topic})
        if partition is not None:
            if not 0 <= partition < count:
                raise NotFoundError("partition_not_found", f"topic {topic} has {count} partitions",
                                    fields={"topic": topic, "partition": str(partition)})
            return partition
        if key is not None and state.metadata.partitioner == "hash_key":
            return partition_for_key(key, count)
        sticky = state.sticky % count
        pstate = self.partitions.get((topic, sticky))
        if pstate is not None and len(pstate.queue) + 1 >= self.config.batch_size:
            state.sticky = sticky + 1  # this record fills the batch: the next one starts the next partition
        return sticky

    def append(self, topic: str, partition: int, pending: PendingRecord, now: float) -> bool | Resolution:
        """Queue a record. Returns True when a sender should wake (new linger deadline or full batch), or the
        record's failure (to resolve outside the lock) when its encoded size exceeds ``max_record_bytes``
        (the broker would refuse it, and with ``acks=0`` drop it without a word)."""
        key = (topic, partition)
        pstate = self.partitions.get(key)
        if pstate is None:
            metadata = self.topics[topic].metadata
            leader = metadata.leader_address(partition) or self.default_leader
            encoder = RecordEncoder(topic, partition, self.config.producer_id, self.config.producer_epoch)
            pstate = self.partitions[key] = _PartitionState(topic, partition, leader, encoder,
                                                            self.config.producer_epoch)
            self.by_address.setdefault(leader, []).append(pstate)
        limit = self.config.max_record_bytes
        if pending.size > limit:  # the overhead estimate is generous: only then measure exactly
            size = len(pstate.encoder.encode(pending.value, pending.key_field, pending.timestamp, 0)) - 4
            if size > limit:
                error = ValidationError("message_too_large", "the record is larger than the producer's max_record_bytes (the broker's own limit is its max_message_bytes setting)",
                                        retryable=False, fields={"size": str(size), "limit": str(limit),
                                                                 "topic": topic, "partition": str(partition)})
                self.buffered += 1  # _fail_pendings counts it out again
                return self._fail_pendings([pending], error)[0]
        was_empty = not pstate.queue
        if was_empty:
            pstate.first_enqueued = now
        pending.deadline = deadline = now + self.config.delivery_timeout_s
        if deadline < self.next_expiry:
            self.next_expiry = deadline
        pstate.queue.append(pending)
        pstate.queued_bytes += pending.size
        self.buffered += 1
        return was_empty or len(pstate.queue) == self.config.batch_size or \
            pstate.queued_bytes >= self.config.batch_bytes

    def append_all(self, items: Sequence[DeliveryFuture], due: set[Address],
                   created: set[Address]) -> list[Resolution]:
        """Queue records handed over in bulk, in order (their ``topic``, ``chosen`` partition or None and
        ``key_text`` say where), ``deadline`` holding the monotonic time ``send`` accepted each (its delivery
        deadline and linger count from then). A None partition is routed now (sticky). Adds to ``due`` the leaders whose
        partitions became due (new linger deadline or full batch) and to ``created`` the leaders of
        partitions used for the first time. Returns the failures to resolve outside the lock: records too
        large, routing errors, or every record when the producer already stopped on a terminal error."""
        failures: list[Resolution] = []
        route = self.route
        partitions = self.partitions
        cfg = self.config
        timeout_s = cfg.delivery_timeout_s
        batch_size = cfg.batch_size
        batch_bytes = cfg.batch_bytes
        limit = cfg.max_record_bytes
        topic_state: _TopicState | None = None
        last_topic = None
        for pending in items:
            topic = pending.topic
            chosen = pending.chosen
            if self.fatal is not None:
                self.buffered += 1  # _fail_pendings counts it out again
                failures.extend(self._fail_pendings([pending], self.fatal))
                continue
            try:
                sticky = chosen is None
                if chosen is None:
                    if topic != last_topic or topic_state is None:
                        topic_state = self.topics[topic]
                        last_topic = topic
                    count = topic_state.metadata.partitions
                    chosen = topic_state.sticky % count if count > 0 else route(topic, pending.key_text, None)
                pstate = partitions.get((topic, chosen))
                existed = pstate is not None
                if pstate is None or pending.size > limit:  # the general path: new partition, maybe too large
                    known = len(partitions)
                    result = self.append(topic, chosen, pending, pending.deadline)
                    pstate = partitions[(topic, chosen)]
                    if len(partitions) != known:
                        created.add(pstate.leader)
                    if isinstance(result, tuple):
                        failures.append(result)
                        continue
                    queued = len(pstate.queue)
                    if result:
                        due.add(pstate.leader)
                else:  # ProducerCore.append, inline (this runs once per record)
                    queue = pstate.queue
                    now = pending.deadline
                    if not queue:
                        pstate.first_enqueued = now
                        due.add(pstate.leader)
                    pending.deadline = deadline = now + timeout_s
                    if deadline < self.next_expiry:
                        self.next_expiry = deadline
                    queue.append(pending)
                    pstate.queued_bytes += pending.size
                    self.buffered += 1
                    queued = len(queue)
                    if queued == batch_size or pstate.queued_bytes >= batch_bytes:
                        due.add(pstate.leader)
                if sticky and existed and queued >= batch_size:
                    # this record filled the batch: the next one starts the next partition (as route())
                    assert topic_state is not None
                    topic_state.sticky = chosen + 1
            except CursusError as exc:  # metadata changed since send validated it
                self.buffered += 1
                failures.extend(self._fail_pendings([pending], exc))
                continue
        return failures

    def take(self, topic: str, partition: int, now: float, sender: object = None) -> ProducerBatch | None:
        """Seal ``(topic, partition)``'s queued records into a batch now, for delivery by the caller
        (``sender``), or None when the partition already has a batch in flight (or waiting for a retry),
        nothing is queued, or the producer stopped."""
        pstate = self.partitions.get((topic, partition))
        if self.fatal is not None or pstate is None or pstate.busy or pstate.restart or not pstate.queue:
            return None
        return self._seal(pstate, now, sender)

    def leader_of(self, topic: str, partition: int) -> Address:
        """Where the partition's batches currently go."""
        return self.partitions[(topic, partition)].leader

    # ----------------------------------------------------------------------------------------- sending

    def poll(self, address: Address, now: float, sender: object = None,
             room: int = 1) -> tuple[ProducerBatch | None, float | None]:
        """The next batch for ``sender``, connected to ``address`` with ``room`` more requests allowed in
        flight, or (None, seconds until one may be ready; None: nothing pending for it).

        A partition with batches in flight takes more only from the sender carrying them (so they stay in
        order on one connection); one with batches to resend resends them first, one at a time, once
        nothing of it is in flight.
        """
        if self.fatal is not None or room < 1:
            return None, None
        states = self.by_address.get(address)
        if not states:
            return None, None
        wait: float | None = None
        count = len(states)
        start = next(self._rotation) % count
        cfg = self.config
        for i in range(count):
            pstate = states[(start + i) % count]
            if pstate.failing or pstate.restart:
                continue  # settles when its last reply is in
            if pstate.in_flight and (sender is None or pstate.sender is not sender
                                     or pstate.in_flight >= cfg.max_in_flight):
                continue
            if pstate.retries:
                if pstate.in_flight:
                    continue
                retry = pstate.retries[0]
                if retry.not_before <= now:
                    del pstate.retries[0]
                    self._launch(pstate, sender, retry)
                    return retry, None
                wait = retry.not_before - now if wait is None else min(wait, retry.not_before - now)
                continue
            if not pstate.queue:
                continue
            ready_at = pstate.first_enqueued + cfg.linger_s
            if (now >= ready_at or len(pstate.queue) >= cfg.batch_size or pstate.queued_bytes >= cfg.batch_bytes
                    or self.flushing or self.closing):
                return self._seal(pstate, now, sender), None
            wait = ready_at - now if wait is None else min(wait, ready_at - now)
        return None, wait

    def _launch(self, pstate: _PartitionState, sender: object, batch: ProducerBatch) -> None:
        """``batch`` leaves with ``sender`` (it is written next: later batches of the partition follow it)."""
        pstate.in_flight += 1
        pstate.sender = sender
        self.in_flight += 1
        batch.sent_to = pstate.leader
        if batch.seq_end > pstate.sent_end:
            pstate.sent_end = batch.seq_end

    def _seal(self, pstate: _PartitionState, now: float, sender: object) -> ProducerBatch:
        cfg = self.config
        taken: list[PendingRecord] = []
        size = 0
        queue = pstate.queue
        while queue and len(taken) < cfg.batch_size:
            if taken and size + queue[0].size > cfg.batch_bytes:
                break
            pending = queue.popleft()
            size += pending.size
            taken.append(pending)
        pstate.queued_bytes -= size
        topic_state = self.topics[pstate.topic]
        if topic_state.sticky % max(1, topic_state.metadata.partitions) == pstate.partition:
            topic_state.sticky += 1  # unkeyed records move on once the sticky partition's batch leaves
        # Records left behind keep their (old) first_enqueued: they are due as soon as this batch is done.
        # Kafka's delivery.timeout.ms: the batch gives up when its oldest record's time is up
        batch = ProducerBatch(pstate, taken, pstate.next_seq, taken[0].deadline)
        pstate.next_seq += len(taken)
        self._launch(pstate, sender, batch)
        return batch

    def encode(self, batch: ProducerBatch) -> bytes:
        """The PUBLISH payload of ``batch`` (computed once, kept for retries). Pure: call outside locks."""
        if batch.payload is None:
            pstate = batch.state
            seq = batch.seq_start
            pendings = batch.pendings
            count = len(pendings)
            records = pstate.encoder.encode_run(list(map(_value_of, pendings)), list(map(_key_field_of, pendings)),
                                                list(map(_timestamp_of, pendings)), seq)
            header = encode_batch_header(pstate.topic, pstate.partition, acks=self.config.acks,
                                         flags=1 if self.config.idempotent else 0, seq_start=seq,
                                         seq_end=seq + count - 1, record_count=count)
            batch.payload = header + records
        return batch.payload

    # ----------------------------------------------------------------------------------------- outcomes

    def succeed(self, batch: ProducerBatch, last_offset: int | None) -> Iterator[Resolution]:
        """The broker acknowledged ``batch`` (``last_offset`` None for acks=0). The resolutions are built
        lazily, as the caller applies them (outside its lock: they read only the sealed batch)."""
        records, delivery, overtaken = self.succeed_split(batch, last_offset)
        results = zip(map(_future_of, records), map(delivery.metadata, range(len(batch.pendings))), repeat(False))
        return itertools.chain(results, overtaken) if overtaken else results

    def succeed_split(self, batch: ProducerBatch, last_offset: int | None) -> tuple[
            list[PendingRecord], Delivery, list[Resolution]]:
        """:meth:`succeed` as (the batch's records, in order; the :class:`Delivery` their
        :class:`RecordMetadata` come from, by index; other resolutions: earlier batches that can no longer be
        resent)."""
        pstate = batch.state
        self._land(pstate)
        if batch.seq_end > pstate.acked_end:
            pstate.acked_end = batch.seq_end
        overtaken = self._logged(pstate, batch)
        count = len(batch.pendings)
        self.buffered -= count
        delivery = Delivery(pstate.topic, pstate.partition,
                            None if last_offset is None else last_offset - count + 1,
                            self.config.producer_id, pstate.epoch, batch.seq_start)
        self._settle(pstate)
        return batch.pendings, delivery, overtaken

    def _logged(self, pstate: _PartitionState, batch: ProducerBatch) -> list[Resolution]:
        """``batch`` is (or may be) in the log. Without idempotence, the partition's earlier batches waiting
        for a resend (refused while it was in flight: never written) can no longer go, as they would land
        behind it: they fail with their own error. Returns their failures."""
        if batch.seq_end > pstate.logged_end:
            pstate.logged_end = batch.seq_end
        if self.config.idempotent or not pstate.retries:
            return []
        resolutions: list[Resolution] = []
        keep: list[ProducerBatch] = []
        for retry in pstate.retries:
            if retry.seq_start < batch.seq_start:
                error = retry.error
                assert error is not None  # set by failed(), the only way into retries
                resolutions.extend(self._fail_pendings(retry.pendings, _unknown(retry, error) if retry.uncertain
                                                       else error))
            else:
                keep.append(retry)
        pstate.retries[:] = keep
        return resolutions

    def _land(self, pstate: _PartitionState) -> None:
        pstate.in_flight -= 1
        self.in_flight -= 1
        if not pstate.in_flight:
            pstate.sender = None

    def _settle(self, pstate: _PartitionState) -> None:
        """Once a partition whose batch failed for good has nothing in flight or to resend, its next batch
        starts after the last acknowledged sequence, or, when a failed batch may have been appended or the
        broker forgot the producer (``restart``), at sequence 1 of the next producer epoch."""
        if (pstate.failing or pstate.restart) and not pstate.busy:
            pstate.failing = False
            if pstate.restart or (pstate.uncertain and self.config.idempotent):
                self._reset_sequence(pstate)  # the broker's last sequence is unknown: next epoch, sequence 1
                pstate.acked_end = pstate.sent_end = pstate.logged_end = 0
            else:
                pstate.next_seq = pstate.acked_end + 1
            pstate.uncertain = False
            pstate.restart = False

    def failed(self, batch: ProducerBatch, error: BaseException, *, written: bool,
               now: float) -> tuple[list[Resolution], Address | None]:
        """An attempt of ``batch`` failed. Decide: retry later, fail the batch, or stop the producer.

        Args:
            error: a typed broker error (``CursusError``) or a transport exception.
            written: whether the request may have reached the broker (False only for connect failures).
            now: monotonic time in seconds.

        Returns:
            (resolutions to apply, the new leader the partition was redirected to or None; the caller
            makes sure it has senders, also when the batch itself failed).
        """
        pstate = batch.state
        self._land(pstate)
        batch.error = error
        cfg = self.config
        behind_a_retry = bool(pstate.retries) and pstate.retries[0].seq_start < batch.seq_start
        gap = isinstance(error, CursusError) and error.code in _BEHIND_A_FAILED_BATCH_CODES
        if gap and cfg.idempotent and not behind_a_retry and not pstate.failing and _producer_forgotten(
                error, batch):
            # The broker expects a new session (sequence 1) although this producer already used the
            # partition: the topic was deleted and re-created or truncated (or the producer's state
            # expired). The batch was not appended; it and any later batch in flight fail, and the
            # partition continues at the next producer epoch, sequence 1.
            pstate.restart = True
        if isinstance(error, CursusError) and error.code in TERMINAL_PRODUCER_CODES and not (
                gap and cfg.idempotent and (behind_a_retry or pstate.failing or pstate.restart)):
            return self._terminal(batch, error), None
        resolutions: list[Resolution] = []
        if isinstance(error, CursusError) and error.code in _TOPIC_GONE_CODES:
            pstate.restart = True  # that incarnation of the topic is gone
            resolutions = self.restart_topic(batch.topic, error, skip=pstate)
        redirect: Address | None = None
        delay = cfg.backoff.delay_s(batch.attempts)
        if gap:
            retry = behind_a_retry  # refused only because an earlier batch is missing
        elif isinstance(error, RoutingError):
            redirect = getattr(error, "leader", None) or getattr(error, "coordinator", None)
            # NOT_LEADER is a refusal before append, unless the old leader appended the batch and lost the
            # partition while it waited for the acknowledgement (outcome=unknown): the next leader may hold
            # it, so only an idempotent producer resends it (the broker de-duplicates)
            unknown = written and error.fields.get("outcome") == "unknown"
            if unknown:
                batch.uncertain = True
            retry = cfg.idempotent or not unknown
            if redirect is not None and redirect != batch.sent_to:
                # a new leader: go now (a redirect to the broker that refused backs off instead); a later
                # batch of a pipelined window finds the partition moved by the first one already
                self._move(pstate, redirect)
                delay = 0.0
            else:
                redirect = None
        elif isinstance(error, CursusError) and not isinstance(error, ProtocolViolationError):
            # A typed refusal means the broker handled the request and wrote nothing, unless it says the
            # outcome is unknown (an acks=all timeout, a failed fsync): only those need idempotence.
            refused = error.fields.get("outcome") != "unknown" and error.code not in _OUTCOME_UNKNOWN_CODES
            if written and not refused:
                batch.uncertain = True
            retry = error.retryable and (cfg.idempotent or not written or refused)
        elif not written:
            retry = True
        else:
            batch.uncertain = True
            retry = cfg.idempotent
        if not cfg.idempotent and pstate.logged_end > batch.seq_end:
            # a later batch of the partition may be in the log: resending this one would reorder. Later
            # batches still in flight decide when their replies are in (see _logged); meanwhile this one
            # waits with the retries, which are resent only once nothing of the partition is in flight.
            retry = False
        if pstate.restart:
            retry = False  # never resend a batch of a dead topic incarnation into the new one
        if retry and not pstate.failing and now + delay < batch.deadline:
            batch.attempts += 1
            batch.not_before = now + delay
            pstate.retries.append(batch)
            pstate.retries.sort(key=_seq_start)
            return resolutions, redirect
        if batch.uncertain:
            pstate.uncertain = True
            error = _unknown(batch, error)
        resolutions.extend(self._fail_pendings(batch.pendings, error))
        if batch.uncertain:
            resolutions.extend(self._logged(pstate, batch))
        if pstate.restart:
            resolutions.extend(self._drop_retries(pstate, error))
        if cfg.idempotent and pstate.next_seq > batch.seq_end + 1:
            # later batches of the partition exist: their sequences now have a gap, they fail with this one
            pstate.failing = True
            for later in pstate.retries:
                resolutions.extend(self._fail_pendings(later.pendings, error))
            pstate.retries.clear()
        elif not batch.uncertain and pstate.next_seq == batch.seq_end + 1:
            pstate.next_seq = batch.seq_start  # never written: the next batch reuses the sequences
        elif batch.uncertain and cfg.idempotent:
            pstate.failing = True  # settling moves the partition to the next epoch (_reset_sequence)
        if pstate.failing or pstate.restart:
            self._settle(pstate)
        else:
            pstate.uncertain = False  # only a failing partition's settling needs it
        # The partition moved even though this batch failed: its next batches (queued, or in flight and
        # redirected later) go to the new leader, which needs senders (issue 11: they stalled there).
        return resolutions, redirect

    def expire(self, now: float) -> list[Resolution]:
        """Fail every queued (not yet sealed) record whose delivery deadline (``send`` time plus
        ``delivery_timeout_s``) has passed, with :class:`~cursus.client.errors.DeliveryTimeoutError` (never
        written: no sequence was given to them), and recompute :attr:`next_expiry`. Senders call it when
        ``now >= next_expiry``, also while idle, so no record waits beyond its deadline for a partition
        that cannot send (busy, settling, no leader). Batches already sealed keep their own deadline."""
        resolutions: list[Resolution] = []
        soonest = float("inf")
        for pstate in self.partitions.values():
            queue = pstate.queue
            if not queue:
                continue
            if queue[0].deadline <= now:
                expired: list[PendingRecord] = []
                while queue and queue[0].deadline <= now:
                    pending = queue.popleft()
                    pstate.queued_bytes -= pending.size
                    expired.append(pending)
                error = DeliveryTimeoutError(
                    f"{len(expired)} record(s) for {pstate.topic}/{pstate.partition} were not sent within "
                    f"delivery_timeout_s={self.config.delivery_timeout_s} (never written)",
                    fields={"topic": pstate.topic, "partition": str(pstate.partition)})
                resolutions.extend(self._fail_pendings(expired, error))
            if queue and queue[0].deadline < soonest:
                soonest = queue[0].deadline
        self.next_expiry = soonest
        return resolutions

    def _reset_sequence(self, pstate: _PartitionState) -> None:
        """After a batch whose outcome stays unknown (delivery timeout), the broker's last sequence for this
        partition is unknown too: continuing at ``next_seq`` would leave a gap (``sequence_out_of_order``,
        fatal) if the batch never landed. Like Kafka's epoch bump (KIP-360), the partition moves to the next
        producer epoch and starts again at sequence 1, which the broker accepts (facts A decision 13: a higher
        epoch fences the old one and must start at seq 1). Only this partition changes; no batch of it is in
        flight (one per partition), and records still queued are encoded under the new epoch."""
        pstate.epoch += 1
        pstate.encoder = RecordEncoder(pstate.topic, pstate.partition, self.config.producer_id, pstate.epoch)
        pstate.next_seq = 1
        log.info("producer %s: %s/%d moves to epoch %d at sequence 1 (%s)", self.config.producer_id, pstate.topic,
                 pstate.partition, pstate.epoch,
                 "topic truncated or re-created" if pstate.restart else "a delivery with unknown outcome")

    def _fail_pendings(self, pendings: Sequence[PendingRecord], error: BaseException) -> list[Resolution]:
        self.buffered -= len(pendings)
        self.failed_count += len(pendings)
        if pendings and len(self.failures) < _FAILURES_KEPT_MAX and error not in self.failures:
            self.failures.append(error)
        return [(p.future, error, True) for p in pendings]

    def _terminal(self, batch: ProducerBatch, error: CursusError) -> list[Resolution]:
        self.fatal = error
        resolutions = self._fail_pendings(batch.pendings, error)
        resolutions.extend(self.abort(error))
        return resolutions

    def abort(self, error: BaseException) -> list[Resolution]:
        """Fail every queued record and every batch waiting for a retry (in-flight batches finish on
        their own)."""
        resolutions: list[Resolution] = []
        for pstate in self.partitions.values():
            for retry in pstate.retries:
                resolutions.extend(self._fail_pendings(retry.pendings, error))
            pstate.retries.clear()
            if pstate.queue:
                resolutions.extend(self._fail_pendings(list(pstate.queue), error))
                pstate.queue.clear()
                pstate.queued_bytes = 0
        return resolutions

    def take_failures(self) -> DeliveryFailedError | None:
        """The failures since the last call, as one exception (None if there were none); resets them."""
        if not self.failed_count:
            return None
        error = DeliveryFailedError(self.failures, self.failed_count)
        self.failures = []
        self.failed_count = 0
        return error


#: Error replies after which a PUBLISH may or may not have been appended.
_OUTCOME_UNKNOWN_CODES = frozenset({"replication_unavailable", "storage_unavailable", "request_timeout"})
#: What the broker answers a pipelined idempotent batch whose predecessor was not appended (retried after it).
_BEHIND_A_FAILED_BATCH_CODES = frozenset({"idempotency_gap", "sequence_out_of_order"})
#: PUBLISH replies saying the topic (this incarnation of it) no longer exists.
_TOPIC_GONE_CODES = frozenset({"topic_not_found", "TOPIC_NOT_FOUND"})


def _unknown(batch: ProducerBatch, error: BaseException) -> DeliveryUnknownError:
    unknown = DeliveryUnknownError(
        f"batch of {len(batch.pendings)} record(s) to {batch.topic}/{batch.partition} may or may not "
        f"have been written; last error: {error}")
    unknown.__cause__ = error
    return unknown


def _producer_forgotten(error: BaseException, batch: ProducerBatch) -> bool:
    """An ``idempotency_gap`` asking for sequence 1 (a new session) for a batch after sequence 1: the
    broker has no state for this producer on the partition (facts decision 13)."""
    return isinstance(error, CursusError) and error.fields.get("expected") == "1" and batch.seq_start > 1


def _seq_start(batch: ProducerBatch) -> int:
    return batch.seq_start


_future_of = operator.attrgetter("future")
_value_of = operator.attrgetter("value")
_key_field_of = operator.attrgetter("key_field")
_timestamp_of = operator.attrgetter("timestamp")


def parse_ack(frame: Frame) -> int:
    """The ``last_offset`` of a PUBLISH reply (AckResponse JSON, facts A6).

    Raises:
        CursusError: an ERROR reply, or an AckResponse with ``status`` other than OK.
        ProtocolViolationError: anything that is not an AckResponse (outcome unknown).
    """
    if frame.status == Status.ERROR:
        raise error_from_frame(frame)
    try:
        doc = json.loads(frame.payload)
    except ValueError:
        raise ProtocolViolationError(f"PUBLISH reply is not JSON: {frame.payload[:80]!r}") from None
    if not isinstance(doc, dict):
        raise ProtocolViolationError("PUBLISH reply is not a JSON object")
    if doc.get("status") != "OK":
        raise error_from_ack(doc)
    last_offset = doc.get("last_offset")
    if not isinstance(last_offset, int) or isinstance(last_offset, bool):
        raise ProtocolViolationError(f"PUBLISH ack has no integer last_offset: {doc}")
    return last_offset


def _needs_refresh(error: BaseException | None) -> bool:
    """Whether a failed attempt suggests the partition moved: a redirect or a transport failure."""
    if error is None:
        return False
    if isinstance(error, RoutingError):  # a redirect that names the new leader needs no lookup
        return getattr(error, "leader", None) is None and getattr(error, "coordinator", None) is None
    return not isinstance(error, CursusError)


def _as_bytes(value: bytes | bytearray | memoryview | str) -> bytes:
    if type(value) is bytes:
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"record value must be bytes or str, not {type(value).__name__}")


def _key_field(key: str | bytes | None) -> tuple[str | None, bytes | None]:
    if key is None:
        return None, None
    text = key.decode("utf-8") if isinstance(key, bytes | bytearray) else str(key)
    return text, encode_text_field(text)


_LAZY_FUTURE_LOCK = threading.Lock()
_LAZY_FUTURE_FIELDS = {"_condition": threading.Condition, "_waiters": list, "_done_callbacks": list}
_FUTURE_PENDING = getattr(_futures_base, "PENDING", "PENDING")
_FUTURE_FINISHED = getattr(_futures_base, "FINISHED", "FINISHED")
#: The sender token of batches ``produce`` delivers from the calling thread.
_DIRECT = object()


class DeliveryFuture(Future):
    """A ``concurrent.futures.Future`` whose lock and waiter lists are created on first use.

    A producer keeps one future per record in flight; the standard constructor allocates a Condition, an
    RLock and two lists per future, and resolving it builds a :class:`RecordMetadata`. Both made garbage
    collection the largest per-record cost. Until a caller touches the future (``result()``, ``done()``,
    ``add_done_callback()`` ...: every ``Future`` method takes ``_condition`` first), the producer completes
    it with attribute writes: a failure with its exception and state (:func:`_resolve_sync`), a delivery
    with the batch's shared :class:`Delivery` and the record's index in it (:func:`_resolve_delivered`). The
    first touch turns that into the ordinary ``Future`` state, under :data:`_LAZY_FUTURE_LOCK`, so a
    resolver either sees the future touched (and resolves it with ``set_result``) or the toucher sees it
    resolved. Behaviour is otherwise that of ``Future``.
    """

    # Class-level defaults: creating one costs no attribute writes (deliberately not calling
    # Future.__init__); resolving writes the instance's own values.
    _state = _FUTURE_PENDING
    _result = None
    _exception = None
    # Slots, in the object itself (not its __dict__): the record fields, then the lazy-future fields.
    __slots__ = ("value", "key_field", "timestamp", "size", "deadline", "topic", "chosen", "key_text",
                 "_touched", "_delivery", "_index")

    def __init__(self, value: bytes = b"", key_field: bytes | None = None, timestamp: int | None = None,
                 deadline: float = 0.0, topic: str = "", key_text: str | None = None) -> None:
        # The record, as a PendingRecord (the blocking producer keeps one object per record in flight:
        # each one more is garbage collection work per record).
        self.value = value
        self.key_field = key_field
        self.timestamp = int(_time() * 1000) if timestamp is None else timestamp  # CreateTime, as Kafka
        self.size = len(value) + (len(key_field) if key_field else 0) + _RECORD_OVERHEAD_BYTES
        self.deadline = deadline
        #: Where ``send`` routes it: the topic, the partition (None: sticky, chosen by the core) and the key.
        self.topic = topic
        self.chosen: int | None = None
        self.key_text = key_text
        self._touched = False
        #: Set by _resolve_delivered on an untouched future: it is done, its result is
        #: _delivery.metadata(_index).
        self._delivery: Delivery | None = None
        self._index = 0

    @property
    def future(self) -> DeliveryFuture:
        """The record's future: itself."""
        return self

    def __getattr__(self, name: str) -> Any:
        factory = _LAZY_FUTURE_FIELDS.get(name)
        if factory is None:
            raise AttributeError(name)
        with _LAZY_FUTURE_LOCK:
            value = self.__dict__.get(name)
            if value is None:
                value = self.__dict__[name] = factory()
            if not self._touched:
                self._touched = True
                delivery = self._delivery
                if delivery is not None and self._state == _FUTURE_PENDING:
                    self._result = delivery.metadata(self._index)
                    self._state = _FUTURE_FINISHED
        return value


def _resolve_sync(resolutions: Iterable[Resolution]) -> None:
    slow: list[Resolution] = []
    finished = _FUTURE_FINISHED
    with _LAZY_FUTURE_LOCK:  # nobody can start waiting on an untouched future meanwhile
        for resolution in resolutions:
            future, value, is_error = resolution
            if type(future) is DeliveryFuture and not future._touched:
                if is_error:
                    future._exception = value
                else:
                    future._result = value
                future._state = finished
            else:
                slow.append(resolution)
    for future, value, is_error in slow:
        try:
            if is_error:
                future.set_exception(value)
            else:
                future.set_result(value)
        except InvalidStateError:  # cancelled by the caller
            pass


def _resolve_delivered(futures: Iterable[Any], delivery: Delivery) -> None:
    """Complete a delivered batch's futures (record order): three slot writes per untouched future, the
    common case of :func:`_resolve_sync` without a resolution or a metadata tuple per record. The record's
    value is let go (the batch keeps its encoded bytes)."""
    slow: list[Resolution] = []
    with _LAZY_FUTURE_LOCK:  # nobody can start waiting on an untouched future meanwhile
        for index, future in enumerate(futures):
            if type(future) is DeliveryFuture and not future._touched:
                future._delivery = delivery
                future._index = index
                future.value = b""
            else:
                slow.append((future, delivery.metadata(index), False))
    if slow:
        _resolve_sync(slow)


def _outcome(future: DeliveryFuture) -> tuple[bool, Any]:
    """(done, result) of a future nobody else can have touched (``produce``'s own); raises its error."""
    delivery = future._delivery
    if delivery is not None:
        return True, delivery.metadata(future._index)
    if future._state == _FUTURE_FINISHED:
        if future._exception is not None:
            raise future._exception
        return True, future._result
    return False, None


def _resolve_async(resolutions: Iterable[Resolution]) -> None:
    for future, value, is_error in resolutions:
        if not future.done():
            if is_error:
                future.set_exception(value)
            else:
                future.set_result(value)


def _idle_wait(wait: float | None, until_expiry: float) -> float | None:
    """How long an idle sender sleeps: until a batch may be due (``wait``, None: nothing pending) or the
    next record delivery deadline (``until_expiry``, ``inf``: none), whichever comes first."""
    if until_expiry == float("inf"):
        return wait
    return until_expiry if wait is None or until_expiry < wait else wait


def _metadata_options(options: ConnectionOptions) -> ConnectionOptions:
    """Options for best-effort metadata refreshes from sender threads: one quick attempt."""
    return options.with_(backoff=replace(options.backoff, attempts_max=0))




class _ProducerSettings:
    """Constructor shared by :class:`Producer` and :class:`AsyncProducer`: settings, clients and the
    sans-IO :class:`ProducerCore`; ``_client_type`` picks the transport, ``_setup`` adds the flavour's own
    synchronisation (threads or tasks)."""

    _client_type: Any
    _id_prefix: str

    def __init__(self, bootstrap: str | Sequence[str] = DEFAULT_ADDRESS, *, acks: str | int | None = None,
                 idempotent: bool = False, batch_size: int = 1000, batch_bytes: int = 1 << 20,
                 linger_ms: float = 5.0, connections_per_broker: int = 2, buffer_records: int = 100_000,
                 max_block_s: float = 60.0, delivery_timeout_s: float = 120.0, request_timeout_s: float = 30.0,
                 producer_id: str | None = None, producer_epoch: int | None = None, max_record_bytes: int = 1 << 20,
                 max_in_flight: int = 5, options: ConnectionOptions | None = None, **overrides: Any) -> None:
        self.options = options_from(options, overrides)
        self.config = ProducerConfig.build(
            acks=acks, idempotent=idempotent, batch_size=batch_size, batch_bytes=batch_bytes,
            linger_ms=linger_ms, connections_per_broker=connections_per_broker, buffer_records=buffer_records,
            max_block_s=max_block_s, delivery_timeout_s=delivery_timeout_s, request_timeout_s=request_timeout_s,
            backoff=self.options.backoff, producer_id=producer_id, producer_epoch=producer_epoch,
            id_prefix=self._id_prefix, max_record_bytes=max_record_bytes, max_in_flight=max_in_flight)
        self._client = self._client_type(bootstrap, self.options)
        self._refresh_client = self._client_type(bootstrap, _metadata_options(self.options))
        self._core = ProducerCore(self.config, self._client.bootstrap[0])
        self._stopping = False
        self._closed = False
        self._setup()

    def _setup(self) -> None:
        raise NotImplementedError

    @property
    def producer_id(self) -> str:
        """The producer id records carry."""
        return self.config.producer_id

    @property
    def producer_epoch(self) -> int:
        """The producer epoch records carry."""
        return self.config.producer_epoch


class Producer(_ProducerSettings):
    """Thread-safe blocking producer with background sender threads.

    Use it as a context manager, or call :meth:`close`.

    Args:
        bootstrap: ``host:port`` of a broker (or a list); partition leaders come from its METADATA.
        acks: ``0`` (no reply, offsets unknown), ``1`` (leader durable append) or ``all``; default ``1``,
            or ``all`` when ``idempotent``.
        idempotent: de-duplicated retries (needs acks=all).
        batch_size: records per batch at most (1-100000).
        batch_bytes: approximate bytes per batch at most (a single larger record still goes alone).
        linger_ms: how long a partition's first queued record waits for company, in milliseconds.
        connections_per_broker: connections per broker.
        max_in_flight: PUBLISH requests written on one connection before the oldest reply is read (1-5
            with ``idempotent``; the broker pipelines up to its ``max_in_flight_requests_per_connection``,
            default 5). 1 waits for each reply before the next batch leaves.
        buffer_records: records accepted and not yet delivered at most; ``send`` blocks beyond it.
        max_block_s: how long ``send`` blocks on a full buffer before ``BufferFullError``, seconds.
        delivery_timeout_s: time from ``send`` to giving up on a record (its retries, or its wait in the
            queue: ``DeliveryTimeoutError``), seconds.
        request_timeout_s: reply timeout of one PUBLISH, seconds.
        producer_id, producer_epoch: producer identity; default a random ``py-<hex>`` id and the creation
            time in milliseconds as epoch. A higher epoch for the same id fences older sessions.
        max_record_bytes: the largest encoded record sent, bytes (default 1 MiB, the broker's default
            ``max_message_bytes``); a larger one fails at once with ``message_too_large`` (its future, and
            ``flush``), with any ``acks`` (with ``acks=0`` the broker would drop it silently).
        options: :class:`~cursus.client.connection.ConnectionOptions`; keyword arguments override fields
            (``compression``, ``timeout_s``, ``ssl_context``, ``principal``, ``token``, ``backoff``).

    Raises:
        ValueError: inconsistent settings (e.g. idempotent with acks=1).
    """

    _client_type = Client
    _id_prefix = "py-"

    def _setup(self) -> None:
        self._lock = threading.Lock()
        #: Waiters for completions (flush, produce, a full buffer); senders wait on ``_ready_for(address)``.
        self._cond = threading.Condition(self._lock)
        #: Sender threads of one leader wait on its condition for a batch to become due: notified once per
        #: due batch, not per record, and only that leader's senders (a notify() meant for one leader's
        #: senders must not wake another's and be lost).
        self._ready_by_address: dict[Address, threading.Condition] = {}
        #: The connection ``produce`` delivers on from the calling thread (no hand-off to a sender).
        self._direct_lock = threading.Lock()
        self._direct_conn: Connection | None = None
        self._threads: dict[Address, list[threading.Thread]] = {}
        self._connections: set[Connection] = set()
        #: Records accepted by ``send`` and not yet handed to the core, in send order (each says its topic,
        #: partition or None and key). ``send`` appends without any lock (``deque.append`` is atomic; never the
        #: producer lock senders hold); the records move to the core in bulk (:meth:`_drain_locked`, under the
        #: producer lock) when a sender passes by, when 256 have gathered, or at once when no sender would
        #: pass by soon.
        self._intake: deque[DeliveryFuture] = deque()
        #: Records taken from the intake and not yet in ``core.buffered`` (the buffer limit counts them).
        self._in_transit = 0
        #: Sender threads running, and those sleeping with no wake-up within ``linger_ms`` (changed under the
        #: producer lock, read by ``send`` without it): when all sleep, ``send`` hands its record over itself.
        self._senders_running = 0
        self._senders_asleep = 0
        #: ``send`` hands the intake to the core itself once it holds this many records.
        self._drain_before = max(1, min(self.config.batch_size, 256)) - 1
        self._buffer_records = self.config.buffer_records

    # ----------------------------------------------------------------------------------------- public

    def send(self, topic: str, value: bytes | bytearray | memoryview | str, *, key: str | bytes | None = None,
             partition: int | None = None, timestamp_ms: int | None = None) -> Future[RecordMetadata]:
        """Queue one record; returns a future resolving to its :class:`RecordMetadata`.

        Args:
            topic: existing topic (its metadata is fetched on first use).
            value: payload bytes (``str`` is UTF-8 encoded); stored and served as is.
            key: routing key (UTF-8 text); keyed records on ``hash_key`` topics go where the broker would put
                them.
            partition: explicit partition (overrides the key for routing; the key is still stored).
            timestamp_ms: the record timestamp (milliseconds since the epoch); default the time of this call
                (CreateTime, as Kafka producers set it).

        Raises:
            ClientClosedError: after ``close()``.
            BufferFullError: the buffer stayed full for ``max_block_s``.
            CursusError: the producer hit a terminal error earlier, or the topic's METADATA failed
                (``TopicNotFoundError`` ...); ``ValidationError`` for a bad explicit partition.
            TypeError: value is not bytes or str.
        """
        if key is None:
            key_text = key_field = None
        else:
            key_text, key_field = _key_field(key)
        future = DeliveryFuture(value if type(value) is bytes else _as_bytes(value), key_field, timestamp_ms,
                                _monotonic(), topic, key_text)  # accepted now (ProducerCore.append_all)
        core = self._core
        state = core.topics.get(topic)
        if state is None:
            self._load_metadata(topic)
            state = core.topics[topic]
        metadata = state.metadata
        # Routing that depends only on metadata is done here (a bad partition raises to the caller); sticky
        # records are routed as they reach the core, in order.
        if partition is not None or metadata.partitions < 1 or (key_text is not None
                                                                 and metadata.partitioner == "hash_key"):
            future.chosen = core.route(topic, key_text, partition)
        if core.fatal is not None:
            raise core.fatal
        intake = self._intake
        queued = len(intake)
        if core.buffered + queued + self._in_transit >= self._buffer_records:
            self._append(topic, future, key_text, partition)  # the buffer is full: wait for room, locked
            return future
        # No lock: deque.append is atomic. The checks after the append pair with the senders' (which
        # count themselves asleep before looking at the intake) and close()'s (closing set before its
        # last drain): either they see this record, or this thread sees them and acts.
        intake.append(future)
        if core.closing:
            self._withdraw(future)
        elif queued >= self._drain_before or self._senders_asleep >= self._senders_running:
            self._drain()  # enough gathered, or no sender passes by soon: hand them to the core now
        return future

    def _withdraw(self, record: DeliveryFuture) -> None:
        """``send`` raced ``close``: take the record back (ClientClosedError) unless a drain already moved it
        to the core (then flush delivers it, or close fails it)."""
        with self._lock:
            try:
                self._intake.remove(record)
            except ValueError:
                return
        raise ClientClosedError("producer is closed")

    def _drain(self) -> None:
        """Hand the intake to the core now (from ``send``)."""
        with self._lock:
            resolutions = self._drain_locked()
        if resolutions:
            _resolve_sync(resolutions)

    def _drain_locked(self) -> list[Resolution]:
        """Move the intake's records to the core in send order (call with the producer lock held), start
        senders for new leaders and wake those with a batch due. Returns failures to resolve outside the
        lock."""
        intake = self._intake
        count = len(intake)
        if not count:
            return []
        self._in_transit = count  # before the records leave the intake: the buffer limit always counts them
        popleft = intake.popleft
        items = [popleft() for _ in range(count)]  # send() may append meanwhile (at the other end)
        due: set[Address] = set()
        created: set[Address] = set()
        try:
            resolutions = self._core.append_all(items, due, created)
        finally:
            self._in_transit = 0
        for address in created:
            self._ensure_senders(address)
        for address in due:
            self._ready_for(address).notify()
        if resolutions:
            self._cond.notify_all()
        return resolutions

    def _append(self, topic: str, pending: DeliveryFuture, key_text: str | None, partition: int | None,
                take: bool = False) -> tuple[int, ProducerBatch | None]:
        """Queue ``pending`` (routed by ``key_text``/``partition``). Returns the partition chosen and, with
        ``take``, the batch sealed at once for the caller to deliver (None when the partition is busy)."""
        core = self._core
        if topic not in core.topics:
            self._load_metadata(topic)
        drained: list[Resolution] = []
        try:
            with self._lock:
                drained = self._drain_locked()  # records sent before this one reach the core first
                return self._append_locked(topic, pending, key_text, partition, take)
        finally:
            if drained:
                _resolve_sync(drained)

    def _append_locked(self, topic: str, pending: DeliveryFuture, key_text: str | None, partition: int | None,
                       take: bool) -> tuple[int, ProducerBatch | None]:
        core = self._core
        if self._closed or core.closing:
            raise ClientClosedError("producer is closed")
        if core.fatal is not None:
            raise core.fatal
        if core.buffered >= self.config.buffer_records:
            self._wait_for_room()
        chosen = core.route(topic, key_text, partition)
        known = len(core.partitions)
        now = time.monotonic()
        due = core.append(topic, chosen, pending, now)
        if len(core.partitions) != known:  # a new partition: its leader may need senders
            self._ensure_senders(core.leader_of(topic, chosen))
        if isinstance(due, tuple):  # refused (too large): nobody holds the future yet
            _resolve_sync([due])
            return chosen, None
        batch = core.take(topic, chosen, now, _DIRECT) if take else None
        if due and batch is None:
            self._ready_for(core.leader_of(topic, chosen)).notify()
        return chosen, batch

    def _ready_for(self, address: Address) -> threading.Condition:
        """The condition ``address``'s sender threads wait on (call with the lock held)."""
        ready = self._ready_by_address.get(address)
        if ready is None:
            ready = self._ready_by_address[address] = threading.Condition(self._lock)
        return ready

    def _wake_all(self) -> None:
        """Wake every sender thread (call with the lock held)."""
        for ready in self._ready_by_address.values():
            ready.notify_all()

    def _wait_for_room(self) -> None:
        """Block (lock held) until the buffer has room; raises BufferFullError or the terminal error."""
        core = self._core
        deadline = time.monotonic() + self.config.max_block_s
        while core.buffered >= self.config.buffer_records and core.fatal is None and not core.closing:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BufferFullError(f"{core.buffered} records buffered for {self.config.max_block_s}s")
            self._cond.wait(remaining)
        if core.fatal is not None:
            raise core.fatal
        if core.closing:
            raise ClientClosedError("producer is closed")

    def produce(self, topic: str, value: bytes | bytearray | memoryview | str, *,
                key: str | bytes | None = None, partition: int | None = None, timestamp_ms: int | None = None,
                timeout_s: float | None = None) -> RecordMetadata:
        """:meth:`send` one record and wait for it (this sends its partition's batch at once).

        Raises what :meth:`send` raises, the record's delivery error, or ``TimeoutError``.
        """
        key_text, key_field = (None, None) if key is None else _key_field(key)
        future = pending = DeliveryFuture(value if type(value) is bytes else _as_bytes(value), key_field,
                                          timestamp_ms, topic=topic, key_text=key_text)
        # With the partition idle, seal and deliver from this thread: no sender wake-up and back. Not with
        # a timeout: this thread must then stay free to give up waiting after timeout_s.
        direct = timeout_s is None and self._direct_lock.acquire(blocking=False)
        try:
            _, batch = self._append(topic, pending, key_text, partition, take=direct)
            if batch is not None:
                self._direct_conn = self._deliver(batch, self._direct_conn)
        finally:
            if direct:
                self._direct_lock.release()
        done, metadata = _outcome(future)  # delivered (or failed) already: no waiting machinery
        if done:
            return metadata
        with self._lock:
            self._core.flushing += 1
            self._wake_all()
        try:
            return future.result(timeout_s)
        finally:
            with self._lock:
                self._core.flushing -= 1

    def partitions_for(self, topic: str) -> int:
        """The topic's partition count (from METADATA, cached)."""
        if topic not in self._core.topics:
            self._load_metadata(topic)
        return self._core.topics[topic].metadata.partitions

    def flush(self, timeout_s: float | None = None) -> None:
        """Send everything queued now (ignoring ``linger_ms``) and wait until every record is delivered or
        failed.

        Raises:
            DeliveryFailedError: some records failed since the previous ``flush`` (each future holds its
                own error); the failures are then cleared.
            RequestTimeoutError: records were still pending after ``timeout_s`` seconds.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        core = self._core
        with self._cond:
            core.flushing += 1
            self._wake_all()
        try:
            while True:
                with self._cond:
                    drained = self._drain_locked()  # every record sent before flush() is covered
                    if not drained:
                        if core.buffered <= 0 and not self._intake:
                            break
                        remaining = None if deadline is None else deadline - time.monotonic()
                        if remaining is not None and remaining <= 0:
                            raise RequestTimeoutError(f"flush timed out with {core.buffered} record(s) pending")
                        if not self._intake:
                            self._cond.wait(remaining)
                        continue
                _resolve_sync(drained)  # outside the lock: done-callbacks may call send()
        finally:
            with self._cond:
                core.flushing -= 1
        with self._cond:
            failure = core.take_failures()
        if failure is not None:
            raise failure

    def close(self, timeout_s: float | None = None) -> None:
        """Flush, stop the sender threads and close connections. Idempotent.

        Records still pending after ``timeout_s`` fail with ``ClientClosedError``.

        Raises:
            DeliveryFailedError: records failed (including ones aborted by the timeout).
        """
        with self._cond:
            if self._closed:
                return
            self._core.closing = True  # send() takes back (and refuses) a record it appends after this
            self._cond.notify_all()
            self._wake_all()
        failure: BaseException | None = None
        try:
            self.flush(timeout_s)
        except DeliveryFailedError as exc:
            failure = exc
        except RequestTimeoutError:
            with self._cond:
                resolutions = self._drain_locked()
                resolutions.extend(self._core.abort(ClientClosedError("producer closed before delivery")))
            _resolve_sync(resolutions)
        self._stop()
        with self._cond:
            self._closed = True
            late = self._core.take_failures()
        if failure is None:
            failure = late
        if failure is not None:
            raise failure

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # do not hide the body's exception behind a delivery failure
            try:
                self.close()
            except CursusError:
                pass

    # ----------------------------------------------------------------------------------------- internals

    def _load_metadata(self, topic: str) -> None:
        metadata = parse_metadata(ok_fields(self._client.call(Command.METADATA, {"topic": topic})), topic)
        with self._cond:
            resolutions = self._core.set_metadata(metadata, time.monotonic())
        _resolve_sync(resolutions)

    def _refresh_metadata(self, topic: str) -> None:
        with self._cond:
            if not self._core.needs_refresh(topic, time.monotonic()):
                return
            self._core.topics[topic].refreshed_at = time.monotonic()
        try:
            frame = self._refresh_client.call(Command.METADATA, {"topic": topic})
            metadata = parse_metadata(ok_fields(frame), topic)
        except CursusError:
            return
        with self._cond:
            resolutions = self._core.set_metadata(metadata, time.monotonic())
            for address in self._core.addresses():
                self._ensure_senders(address)
            self._wake_all()  # partitions may have moved to other leaders' senders
            if resolutions:
                self._cond.notify_all()
        _resolve_sync(resolutions)

    def _ensure_senders(self, address: Address) -> None:
        """Start the sender threads for ``address`` (call with the lock held)."""
        if address in self._threads or self._stopping:
            return
        threads = []
        self._senders_running += self.config.connections_per_broker
        for index in range(self.config.connections_per_broker):
            thread = threading.Thread(target=self._sender, args=(address,), daemon=True,
                                      name=f"cursus-producer-{address[0]}:{address[1]}-{index}")
            threads.append(thread)
        self._threads[address] = threads
        for thread in threads:
            thread.start()

    def _next_batch(self, address: Address, sender: object, room: int, block: bool) -> ProducerBatch | None:
        """The next batch for ``sender`` (``room`` more requests may be in flight on its connection);
        ``block``: wait until one is due (else None at once when none is)."""
        core = self._core
        linger_s = self.config.linger_s
        while True:
            with self._lock:
                ready = self._ready_for(address)
                while True:
                    if self._stopping:
                        return None
                    resolutions = self._drain_locked() if self._intake else []
                    now = time.monotonic()
                    if now >= core.next_expiry:  # records past their delivery deadline, wherever queued
                        expired = core.expire(now)
                        if expired:
                            resolutions.extend(expired)
                            self._cond.notify_all()
                    if resolutions:
                        break
                    batch, wait = core.poll(address, now, sender, room)
                    if batch is not None or not block:
                        return batch
                    timeout = _idle_wait(wait, core.next_expiry - now)
                    # Sleeping beyond linger_ms (or with no deadline): send() must not leave records in the
                    # intake for this sender. Checked with the intake empty, atomically with send().
                    # Count this sender asleep first, then look (send() appends first, then looks at the
                    # count): one of the two sees the other. The counts change under the producer lock only.
                    asleep = timeout is None or timeout > linger_s
                    if asleep:
                        self._senders_asleep += 1
                        if self._intake:
                            self._senders_asleep -= 1
                            continue
                    try:
                        ready.wait(timeout)
                    finally:
                        if asleep:
                            self._senders_asleep -= 1
            _resolve_sync(resolutions)  # outside the lock: done-callbacks may call send()

    def _sender(self, address: Address) -> None:
        """Sender thread: one connection to ``address`` with up to ``max_in_flight`` requests in flight;
        it writes due batches while there is room, else reads the oldest reply."""
        conn: Connection | None = None
        window: deque[tuple[ProducerBatch, int]] = deque()
        limit = 1 if self.config.acks == "0" else self.config.max_in_flight
        token = object()
        try:
            while True:
                batch = self._next_batch(address, token, limit - len(window), block=not window)
                if batch is not None:
                    conn = self._write(batch, conn, window)
                elif window:
                    assert conn is not None
                    self._read_reply(conn, window)
                else:
                    return
        finally:
            with self._lock:
                self._senders_running -= 1
            if conn is not None:
                conn.close()
                with self._lock:
                    self._connections.discard(conn)

    def _write(self, batch: ProducerBatch, conn: Connection | None,
               window: deque[tuple[ProducerBatch, int]]) -> Connection | None:
        """Write ``batch`` on ``conn`` (opened to the batch's leader when there is none), adding it to
        ``window``; a failure fails it and everything in ``window`` (their connection is gone)."""
        payload = self._core.encode(batch)
        written = False
        try:
            if conn is None or conn.stale() or (not window and conn.address != batch.state.leader):
                if conn is not None:
                    conn.close()
                conn = self.options.connect(batch.state.leader)
                with self._lock:
                    self._connections.add(conn)
            written = True
            request_id = conn.send(Command.PUBLISH, payload)
        except (OSError, ProtocolError, CursusError) as exc:
            self._fail_window(window, exc)
            self._apply(batch, exc, written, None)
            return conn
        if self.config.acks == "0":
            self._apply(batch, None, True, None)
        else:
            window.append((batch, request_id))
        return conn

    def _read_reply(self, conn: Connection, window: deque[tuple[ProducerBatch, int]]) -> None:
        """Read the reply of the oldest batch in ``window`` and apply it; a broken connection fails the
        rest of the window (outcome unknown: idempotent batches are resent in order)."""
        batch, request_id = window.popleft()
        error: BaseException | None = None
        last_offset: int | None = None
        try:
            last_offset = parse_ack(conn.receive(request_id, Command.PUBLISH,
                                                 timeout_s=self.config.request_timeout_s))
        except ProtocolViolationError as exc:  # unreadable ack: outcome unknown, drop the connection
            error = exc
            conn.close()
        except (OSError, ProtocolError, CursusError) as exc:
            error = exc
        self._apply(batch, error, True, last_offset)
        if conn.closed:
            self._fail_window(window, error or ConnectionError("connection closed"))

    def _fail_window(self, window: deque[tuple[ProducerBatch, int]], error: BaseException) -> None:
        while window:
            self._apply(window.popleft()[0], error, True, None)

    def _deliver(self, batch: ProducerBatch, conn: Connection | None) -> Connection | None:
        """One attempt of ``batch`` on ``conn`` from the calling thread (``produce``; reopened to the
        batch's leader when needed), waiting for its reply. Returns the connection for the next batch."""
        core = self._core
        payload = core.encode(batch)
        error: BaseException | None = None
        written = False
        last_offset: int | None = None
        address = batch.state.leader
        try:
            if conn is None or conn.stale() or conn.address != address:
                if conn is not None:
                    conn.close()
                conn = self.options.connect(address)
                with self._lock:
                    self._connections.add(conn)
            written = True
            if self.config.acks == "0":
                conn.send(Command.PUBLISH, payload)
            else:
                last_offset = parse_ack(conn.request(Command.PUBLISH, payload,
                                                     timeout_s=self.config.request_timeout_s))
        except ProtocolViolationError as exc:  # unreadable ack: outcome unknown, drop the connection
            error = exc
            if conn is not None:
                conn.close()
        except (OSError, ProtocolError, CursusError) as exc:
            error = exc
        self._apply(batch, error, written, last_offset)
        return conn

    def _apply(self, batch: ProducerBatch, error: BaseException | None, written: bool,
               last_offset: int | None) -> None:
        """Apply one attempt's outcome (the core decides: done, retry later, failed) and resolve futures."""
        core = self._core
        resolutions: Iterable[Resolution]
        succeeded = None
        with self._lock:
            if error is None:
                futures, delivery, resolutions = succeeded = core.succeed_split(batch, last_offset)
            else:
                resolutions, redirect = core.failed(batch, error, written=written, now=time.monotonic())
                if redirect is not None:
                    self._ensure_senders(redirect)
                self._wake_all()  # a retry is scheduled (or the producer stopped)
            if batch.state.queue:
                # records queued behind the batch are due now (for the partition's leader, which a
                # redirect may just have changed)
                self._ready_for(batch.state.leader).notify()
            self._cond.notify_all()
        if succeeded is not None:
            _resolve_delivered(futures, delivery)
        _resolve_sync(resolutions)
        if _needs_refresh(error):
            self._refresh_metadata(batch.topic)

    def _stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            self._wake_all()
            threads = [t for group in self._threads.values() for t in group]
            connections = list(self._connections)
        for conn in connections:  # unblock a sender stuck in a request
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5)
        with self._cond:  # batches left waiting for a retry by senders that stopped
            resolutions = self._drain_locked()
            resolutions.extend(self._core.abort(ClientClosedError("producer closed before delivery")))
        _resolve_sync(resolutions)
        self._client.close()
        self._refresh_client.close()


class _AsyncSignal:
    """notify_all/wait(timeout) for tasks of one event loop (no lock needed: no awaits between check and
    wait)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify_all(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout_s: float | None) -> None:
        event = self._event
        try:
            async with asyncio.timeout(timeout_s):
                await event.wait()
        except TimeoutError:
            pass


class AsyncProducer(_ProducerSettings):
    """asyncio producer: the same behaviour as :class:`Producer`, with sender tasks on the running loop.

    ``await send(...)`` queues a record and returns an ``asyncio.Future`` of its :class:`RecordMetadata`;
    ``await send_and_wait(...)`` waits for delivery. Use ``async with`` or ``await close()``. Arguments,
    units and errors are those of :class:`Producer`; the producer id defaults to ``py-async-<hex>``.
    """

    _client_type = AsyncClient
    _id_prefix = "py-async-"

    def _setup(self) -> None:
        self._signal: _AsyncSignal | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: dict[Address, list[asyncio.Task[None]]] = {}
        self._connections: set[AsyncConnection] = set()

    def _wake(self) -> _AsyncSignal:
        if self._signal is None:
            self._signal = _AsyncSignal()
        return self._signal

    async def send(self, topic: str, value: bytes | bytearray | memoryview | str, *,
                   key: str | bytes | None = None, partition: int | None = None,
                   timestamp_ms: int | None = None) -> asyncio.Future[RecordMetadata]:
        """Queue one record; returns a future of its :class:`RecordMetadata`. Arguments and errors as
        :meth:`Producer.send` (waiting on a full buffer is asynchronous)."""
        data = value if type(value) is bytes else _as_bytes(value)
        key_text, key_field = (None, None) if key is None else _key_field(key)
        core = self._core
        if self._closed or core.closing:
            raise ClientClosedError("producer is closed")
        if topic not in core.topics:
            frame = await self._client.call(Command.METADATA, {"topic": topic})
            _resolve_async(core.set_metadata(parse_metadata(ok_fields(frame), topic), time.monotonic()))
        if core.fatal is not None:
            raise core.fatal
        if core.buffered >= self.config.buffer_records:
            deadline = time.monotonic() + self.config.max_block_s
            while core.buffered >= self.config.buffer_records and core.fatal is None and not core.closing:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise BufferFullError(f"{core.buffered} records buffered for {self.config.max_block_s}s")
                await self._wake().wait(remaining)
            if core.fatal is not None:
                raise core.fatal
            if core.closing:
                raise ClientClosedError("producer is closed")
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        future: asyncio.Future[RecordMetadata] = loop.create_future()
        chosen = core.route(topic, key_text, partition)
        known = len(core.partitions)
        due = core.append(topic, chosen, _Pending(data, key_field, timestamp_ms, future), time.monotonic())
        if len(core.partitions) != known:  # a new partition: its leader may need senders
            self._ensure_senders(core.leader_of(topic, chosen))
        if isinstance(due, tuple):  # refused (too large)
            _resolve_async([due])
            return future
        if due:
            self._wake().notify_all()
            # A batch became due: let the sender tasks run now (a loop of sends never suspends otherwise,
            # and the senders would wait for the buffer to fill). Once per batch, not per record.
            await asyncio.sleep(0)
        return future

    async def send_and_wait(self, topic: str, value: bytes | bytearray | memoryview | str, *,
                            key: str | bytes | None = None, partition: int | None = None,
                            timestamp_ms: int | None = None) -> RecordMetadata:
        """Send one record and wait for its delivery (its batch leaves at once)."""
        future = await self.send(topic, value, key=key, partition=partition, timestamp_ms=timestamp_ms)
        self._core.flushing += 1
        self._wake().notify_all()
        try:
            return await future
        finally:
            self._core.flushing -= 1

    async def flush(self, timeout_s: float | None = None) -> None:
        """See :meth:`Producer.flush`."""
        core = self._core
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        core.flushing += 1
        self._wake().notify_all()
        try:
            while core.buffered > 0:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise RequestTimeoutError(f"flush timed out with {core.buffered} record(s) pending")
                await self._wake().wait(remaining)
        finally:
            core.flushing -= 1
        failure = core.take_failures()
        if failure is not None:
            raise failure

    async def close(self, timeout_s: float | None = None) -> None:
        """See :meth:`Producer.close`."""
        if self._closed:
            return
        self._core.closing = True
        failure: BaseException | None = None
        try:
            await self.flush(timeout_s)
        except DeliveryFailedError as exc:
            failure = exc
        except RequestTimeoutError:
            _resolve_async(self._core.abort(ClientClosedError("producer closed before delivery")))
        self._stopping = True
        self._wake().notify_all()
        tasks = [t for group in self._tasks.values() for t in group]
        for conn in list(self._connections):
            await conn.close()
        if tasks:
            _, still = await asyncio.wait(tasks, timeout=5)
            for task in still:
                task.cancel()
        _resolve_async(self._core.abort(ClientClosedError("producer closed before delivery")))
        await self._client.close()
        await self._refresh_client.close()
        self._closed = True
        late = self._core.take_failures()
        failure = failure or late
        if failure is not None:
            raise failure

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            await self.close()
        else:
            try:
                await self.close()
            except CursusError:
                pass

    def _ensure_senders(self, address: Address) -> None:
        if address in self._tasks or self._stopping:
            return
        self._tasks[address] = [asyncio.get_running_loop().create_task(self._sender(address))
                                for _ in range(self.config.connections_per_broker)]

    async def _refresh_metadata(self, topic: str) -> None:
        core = self._core
        if not core.needs_refresh(topic, time.monotonic()):
            return
        core.topics[topic].refreshed_at = time.monotonic()
        try:
            frame = await self._refresh_client.call(Command.METADATA, {"topic": topic})
            resolutions = core.set_metadata(parse_metadata(ok_fields(frame), topic), time.monotonic())
        except CursusError:
            return
        _resolve_async(resolutions)
        for address in core.addresses():
            self._ensure_senders(address)
        self._wake().notify_all()

    async def _sender(self, address: Address) -> None:
        """Sender task: one connection to ``address`` with up to ``max_in_flight`` requests in flight (see
        :meth:`Producer._sender`)."""
        conn: AsyncConnection | None = None
        core = self._core
        window: deque[tuple[ProducerBatch, int]] = deque()
        limit = 1 if self.config.acks == "0" else self.config.max_in_flight
        token = object()
        try:
            while not self._stopping or window:
                now = time.monotonic()
                if now >= core.next_expiry:  # records past their delivery deadline, wherever queued
                    expired = core.expire(now)
                    if expired:
                        _resolve_async(expired)
                        self._wake().notify_all()
                batch, wait = core.poll(address, now, token, limit - len(window))
                if batch is not None:
                    payload = core.encode(batch)
                    written = False
                    try:
                        if conn is None or conn.stale() or (not window and conn.address != batch.state.leader):
                            if conn is not None:
                                await conn.close()
                                self._connections.discard(conn)
                            conn = await open_connection(self.options, batch.state.leader)
                            self._connections.add(conn)
                        written = True
                        request_id = await conn.send(Command.PUBLISH, payload)
                    except (OSError, ProtocolError, CursusError) as exc:
                        while window:
                            await self._apply(window.popleft()[0], exc, True, None)
                        await self._apply(batch, exc, written, None)
                        continue
                    if self.config.acks == "0":
                        await self._apply(batch, None, True, None)
                    else:
                        window.append((batch, request_id))
                    continue
                if not window:
                    await self._wake().wait(_idle_wait(wait, core.next_expiry - now))
                    continue
                assert conn is not None
                batch, request_id = window.popleft()
                error: BaseException | None = None
                last_offset: int | None = None
                try:
                    last_offset = parse_ack(await conn.receive(request_id, Command.PUBLISH,
                                                               timeout_s=self.config.request_timeout_s))
                except ProtocolViolationError as exc:
                    error = exc
                    await conn.close()
                except (OSError, ProtocolError, CursusError) as exc:
                    error = exc
                await self._apply(batch, error, True, last_offset)
                if conn.closed:
                    while window:
                        await self._apply(window.popleft()[0], error or ConnectionError("connection closed"),
                                          True, None)
        finally:
            if conn is not None:
                self._connections.discard(conn)
                await conn.close()

    async def _apply(self, batch: ProducerBatch, error: BaseException | None, written: bool,
                     last_offset: int | None) -> None:
        """Apply one attempt's outcome (the core decides) and resolve its futures."""
        core = self._core
        resolutions: Iterable[Resolution]
        if error is None:
            resolutions = core.succeed(batch, last_offset)
        else:
            resolutions, redirect = core.failed(batch, error, written=written, now=time.monotonic())
            if redirect is not None:
                self._ensure_senders(redirect)
        self._wake().notify_all()
        _resolve_async(resolutions)
        if _needs_refresh(error):
            await self._refresh_metadata(batch.topic)


#: Signature of the callbacks some tools pass around (topic, partition, offset).
DeliveryCallback = Callable[[RecordMetadata], None]
