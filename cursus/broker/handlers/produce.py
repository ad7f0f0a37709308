"""PUBLISH: CBV2 batches and the text form (spec "PUBLISH", section 9; facts decisions 11-13, B3.3).

Hot path for a batch: one validate-and-index pass over the bytes (:func:`cursus.wire.scan_batch`), one
copy into a bytearray, offsets stamped in place, the records section handed to the writer thread as one
chunk. No Python object per record.

Acknowledgement (spec "Acks Semantics"): acks=1 answers after the leader's durable local append
(:meth:`Replica.wait_durable`); acks=all refuses before the append when the ISR is below the effective
minimum, else captures the ISR at the append and answers once the committed HWM covers the records and
every captured member has them durable (:meth:`Replica.wait_committed`), within ``replica_ack_timeout_ms``:
after it, ``replication_unavailable reason="replica timeout" outcome=unknown`` (retryable; an idempotent
retry deduplicates). A leader change fails the wait with ``NOT_LEADER`` (outcome unknown too). acks=0
sends nothing and releases its byte budget once the append is durable.
"""

from __future__ import annotations

import array
import asyncio
import functools
import json
import logging
import struct

from cursus.broker.args import ACK_MODES, PublishArgs, parse_acks
from cursus.broker.core import Broker, now_ms
from cursus.broker.handlers.common import check_topic_access, partition_of
from cursus.broker.replica import Replica
from cursus.broker.request import NO_REPLY, NoReply, Pending, Request
from cursus.metadata.topics import TopicDefinition, is_internal_topic, validate_topic_name
from cursus.params import parse_args
from cursus.partitioning import partition_for_key
from cursus.wire import (
    BatchView,
    Record,
    encode_record,
    iter_record_slices,
    record_offset_field_position,
    scan_batch,
    stamp_offsets,
)
from cursus.wire.errors import BrokerError

log = logging.getLogger("cursus.produce")
_U32_LEN = 4
_TXN_FIELDS = ("transactional_id", "transaction_state", "transaction_marker")
#: A record's version (u16) and presence bitmap (u64); bits 5 aggregate_version, 15 event_id, 16 payload_digest.
_PRESENCE = struct.Struct(">HQ")
_EVENT_FIELD_BITS = (1 << 5) | (1 << 15) | (1 << 16)


async def handle_publish(broker: Broker, req: Request) -> Pending | NoReply:
    """PUBLISH; acks=0/none gets no reply even when it fails (facts B1.5)."""
    if req.batch is not None:
        batch = req.batch
        if len(batch) < broker.offload.threshold_bytes:  # no coroutine step at all: the hot path
            return publish_batch_now(broker, req)
        # ProtocolError: an undecodable batch closes the connection (decision 5). A large one is scanned off
        # the loop.
        view = await broker.offload.run(len(batch), functools.partial(scan_batch, batch))
        return _publish_scanned(broker, req, view)
    suppressed = ACK_MODES.get((req.get("acks") or "").strip().lower()) == "none"
    try:
        return _publish_text(broker, req)
    except Exception as exc:
        if not suppressed:
            raise
        return _suppressed(broker, exc)


def publish_batch_now(broker: Broker, req: Request) -> Pending | NoReply:
    """A CBV2 batch PUBLISH (``req.batch`` set, smaller than the offload threshold) handled synchronously on
    the loop: scan, checks, dedup, append (what :func:`handle_publish` does, without a coroutine; the
    session's fast path calls it directly).

    Raises:
        ProtocolError: the batch is undecodable (the connection is closed; nothing was appended).
        BrokerError: the typed refusal (not for acks=0, which answers :data:`NO_REPLY` instead).
    """
    assert req.batch is not None
    return _publish_scanned(broker, req, scan_batch(req.batch))


def _publish_scanned(broker: Broker, req: Request, view: BatchView) -> Pending | NoReply:
    try:
        return _publish_batch(broker, req, view)
    except Exception as exc:
        if ACK_MODES.get((view.acks or "").strip().lower()) != "none":
            raise
        return _suppressed(broker, exc)


def _suppressed(broker: Broker, exc: Exception) -> NoReply:
    """acks=0: the client never reads a reply, so even a failure sends nothing (a stray frame would
    desynchronise its connection)."""
    code = exc.error.code if isinstance(exc, BrokerError) else "broker_error"
    if not isinstance(exc, BrokerError):
        log.exception("acks=0 PUBLISH failed")
    broker.metrics.child(broker.metrics.publish_acks_total, "none", code).inc()
    return NO_REPLY


@functools.lru_cache(maxsize=1024)
def _plain_topic_name(topic: str | None) -> bool:
    """True when ``topic`` is a valid client topic name (:func:`validate_topic_name`) and not internal;
    memoized (a pure function of the name: the request path checks the same few names on every PUBLISH)."""
    try:
        return not is_internal_topic(validate_topic_name(topic, command="PUBLISH"))
    except BrokerError:
        return False


def target_topic(broker: Broker, topic: str, req: Request, command: str = "PUBLISH") -> TopicDefinition:
    """The writable topic ``topic`` (PUBLISH, TXN_PUBLISH) for ``req``'s connection. Raises
    ``invalid_topic_name``, ``topic_not_found``, ``internal_topic_write_forbidden``, ``NOT_AUTHORIZED_FOR_TOPIC``."""
    if not _plain_topic_name(topic):  # missing, invalid or internal: the checks in their usual order
        name = validate_topic_name(topic, command=command)
        broker.topic(name)
        raise BrokerError.of("internal_topic_write_forbidden", topic=name)
    defn = broker.topic(topic)
    check_topic_access(defn, "write", req.session)
    if defn.aggregate_replay and command in ("PUBLISH", "TXN_PUBLISH"):
        raise BrokerError.of("invalid_topic_policy", topic=topic, field="aggregate_replay", command=command,
                             reason="aggregate replay topics take APPEND_STREAM only")
    return defn


def _check_min_isr(broker: Broker, defn: TopicDefinition, replica: Replica, mode: str) -> None:
    if mode != "all":
        return
    required = defn.effective_min_isr(broker.config.min_insync_replicas)
    if len(replica.isr) < required:
        raise BrokerError.of("insufficient_in_sync_replicas", topic=defn.name, partition=replica.partition,
                             isr=len(replica.isr), required=required)


def _append_and_ack(
    broker: Broker, replica: Replica, mode: str, buf: bytearray, positions: array.array | list[int] | range,
    body: memoryview,
    record_count: int, *, producer: tuple[str, int, int, int] | None, idempotent: bool,
) -> Pending | NoReply:
    """Writability check, dedup check (idempotent), stamp offsets, append; then the wait for the promised durability and the
    AckResponse as a :class:`Pending` (so the session can read the next request meanwhile).

    Everything that must follow arrival order (the dedup check, the offsets, the append, the producer
    state) happens here, synchronously. ``buf`` holds the records; ``positions`` are the indexes of their
    offset fields in ``buf``; ``body`` is the records section inside ``buf`` that becomes the stored chunk.
    """
    producer_id, epoch, first_seq, last_seq = producer or ("", 0, 0, 0)
    # Writable first: a new leader's table is the one rebuilt from its truncated log only once it is ready;
    # before, a retry could match a batch its preparation is cutting and be acked at other records' offsets.
    replica.check_writable()
    table = broker.producer_table(replica.topic, replica.partition)
    stamp = now_ms()
    if idempotent:
        dup = table.check(producer_id, epoch, first_seq, last_seq, stamp)
        if dup is not None:
            end = dup.first_offset + record_count
            # the original may still be in flight: never ack before it is as safe as its mode promises
            return _pending_ack(broker, replica, mode, end, replica.isr, "duplicate",
                                (end - 1, producer_id, epoch, first_seq, last_seq))
    base_offset = replica.leo
    isr = replica.isr  # captured at the append: acks=all waits for exactly these members
    stamp_offsets(buf, positions, base_offset)
    replica.append(body, record_count)
    broker.metrics.topic_in(replica.topic, record_count, len(body))
    if producer is not None and first_seq > 0:
        table.record(producer_id, epoch, first_seq, last_seq, base_offset, stamp)
    end = base_offset + record_count
    if mode == "none":
        broker.metrics.child(broker.metrics.publish_acks_total, "none", "ok").inc()
        return NoReply(written=replica.wait_durable(end))
    return _pending_ack(broker, replica, mode, end, isr, "ok", (end - 1, producer_id, epoch, first_seq, last_seq))


def _pending_ack(broker: Broker, replica: Replica, mode: str, end: int, isr: tuple[str, ...], outcome: str,
                 ack: tuple[int, str, int, int, int]) -> Pending:
    """The wait for records below ``end`` (:func:`wait_ack`; acks=1 waits on the replica's future itself,
    no task) and the AckResponse built once it is done (counted as ``outcome``)."""
    done: asyncio.Future[None] = (replica.wait_durable(end) if mode != "all"
                                  else asyncio.ensure_future(wait_ack(broker, replica, mode, end, isr)))

    def reply() -> bytes:
        broker.metrics.child(broker.metrics.publish_acks_total, mode, outcome).inc()
        return _ack(*ack)

    return Pending(done, reply)


async def wait_ack(broker: Broker, replica: Replica, mode: str, end: int, isr: tuple[str, ...]) -> None:
    """Wait until records below ``end`` are as safe as ``mode`` promises (see the module docstring).

    Raises:
        BrokerError: ``replication_unavailable outcome=unknown`` (acks=all timeout), ``NOT_LEADER``,
            ``storage_unavailable``, ``topic_not_found`` (deleted), ``leader_not_available outcome=unknown``
            (the topic was truncated meanwhile: :meth:`Replica.removed_error`) (from the replica's waiters).
    """
    if mode != "all":
        await replica.wait_durable(end)
        return
    defn = broker.metadata.get(replica.topic)
    min_isr = defn.effective_min_isr(broker.config.min_insync_replicas) if defn is not None else 1
    waiter = replica.wait_committed(end, isr, min_isr)
    if waiter.done():
        waiter.result()
        return
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        await asyncio.wait_for(waiter, broker.config.replica_ack_timeout_ms / 1000.0)
        broker.metrics.acks_all_wait.observe(loop.time() - started)
    except TimeoutError:
        broker.metrics.child(broker.metrics.publish_acks_total, mode, "timeout").inc()
        raise BrokerError.of("replication_unavailable", "replication quorum unavailable", topic=replica.topic,
                             partition=replica.partition, offset=end - 1, reason="replica timeout",
                             outcome="unknown") from None


#: The earlier private name (tests and other callers import it).
_wait_ack = wait_ack


def _publish_batch(broker: Broker, req: Request, view: BatchView) -> Pending | NoReply:
    """A CBV2 batch naming one partition (facts decision 12)."""
    mode = parse_acks(view.acks)
    defn = target_topic(broker, view.topic, req)
    replica = partition_of(broker, defn, view.partition)
    if view.record_count == 0:
        raise BrokerError.of("empty_messages", command="PUBLISH")
    if view.has_transactional:
        raise BrokerError.of("transaction_metadata_forbidden", command="PUBLISH")
    if view.max_record_size > broker.config.max_message_bytes:
        raise BrokerError.of("message_too_large", size=view.max_record_size,
                             limit=broker.config.max_message_bytes)
    buf = bytearray(req.batch or b"")
    body = memoryview(buf)[view.records_offset:]
    if defn.event_sourcing:
        _refuse_event_records(defn, body, view.record_count)
    producer = None
    if view.producer_id is not None:
        producer = (view.producer_id, view.producer_epoch, view.first_seq, view.last_seq)
    if view.idempotent:
        if mode != "all":
            raise BrokerError.of("invalid_acks", value=view.acks, reason="idempotent producers need acks=all")
        if producer is None or not view.producer_id:
            raise BrokerError.of("missing_producer_id", command="PUBLISH")
        if view.producer_epoch < 0:
            raise BrokerError.of("invalid_epoch", command="PUBLISH", producer=view.producer_id,
                                 value=view.producer_epoch, reason="a producer epoch is >= 0")
        if not view.uniform_producer or view.first_seq < 1:
            raise BrokerError.of("invalid_seq_num", producer=view.producer_id, seq_start=view.first_seq,
                                 seq_end=view.last_seq, reason="records must carry contiguous sequences from one producer session")
    elif not view.uniform_producer:
        producer = None  # mixed producers: nothing to remember for deduplication
    _check_min_isr(broker, defn, replica, mode)
    return _append_and_ack(broker, replica, mode, buf, view.offset_positions, body, view.record_count,
                                 producer=producer, idempotent=view.idempotent)


def _refuse_event_records(defn: TopicDefinition, records: memoryview, count: int) -> None:
    """PUBLISH to an event-sourcing topic carries ordinary records only: a record with event fields
    (``aggregate_version``, ``event_id``, ``payload_digest``) would enter the stream index past the version
    check, so it is refused (``invalid_topic_policy field=aggregate_version``; APPEND_STREAM appends events)."""
    for index, raw in enumerate(iter_record_slices(records, count)):
        if len(raw) >= _PRESENCE.size and _PRESENCE.unpack_from(raw, 0)[1] & _EVENT_FIELD_BITS:
            raise BrokerError.of("invalid_topic_policy", topic=defn.name, field="aggregate_version",
                                 command="PUBLISH", record=index,
                                 reason="event records are appended with APPEND_STREAM only")


def _publish_text(broker: Broker, req: Request) -> Pending | NoReply:
    """Text PUBLISH: one record built by the broker (record version 2)."""
    for name in _TXN_FIELDS:
        if name in req.fields:
            raise BrokerError.of("transaction_metadata_forbidden", command="PUBLISH", field=name)
    args = parse_args(PublishArgs, req.fields, "PUBLISH")
    mode = args.acks
    defn = target_topic(broker, args.topic, req)
    if args.idempotent and mode != "all":
        raise BrokerError.of("invalid_acks", value=req.get("acks"), reason="idempotent producers need acks=all")
    if args.idempotent and args.seq_num < 1:
        raise BrokerError.of("invalid_seq_num", producer=args.producer_id, value=args.seq_num)
    if args.idempotent and args.epoch < 0:
        raise BrokerError.of("invalid_epoch", command="PUBLISH", producer=args.producer_id, value=args.epoch,
                             reason="a producer epoch is >= 0")
    partition = args.partition
    if partition == -1:
        partition = choose_partition(broker, defn, args.key)
    replica = partition_of(broker, defn, partition)
    record = Record(topic=defn.name, partition=partition, payload=args.message.encode("utf-8"),
                    producer_id=args.producer_id, seq_num=args.seq_num, producer_epoch=args.epoch, key=args.key)
    encoded = encode_record(record)
    if len(encoded) > broker.config.max_message_bytes:
        raise BrokerError.of("message_too_large", size=len(encoded), limit=broker.config.max_message_bytes)
    _check_min_isr(broker, defn, replica, mode)
    buf = bytearray(len(encoded).to_bytes(4, "big") + encoded)
    positions = [_U32_LEN + record_offset_field_position(len(defn.name.encode("utf-8")))]
    seq, epoch = args.seq_num, args.epoch
    producer = (args.producer_id, epoch, seq, seq)  # remembered for deduplication only when seq > 0
    return _append_and_ack(broker, replica, mode, buf, positions, memoryview(buf), 1,
                                 producer=producer, idempotent=args.idempotent)


def choose_partition(broker: Broker, defn: TopicDefinition, key: str | None) -> int:
    """Broker-side partition choice: FNV-1a 64 of the key on hash_key topics, else round-robin."""
    if key and defn.policy.partitioner == "hash_key":
        return partition_for_key(key, defn.partitions)
    counter = broker.round_robin.get(defn.name, 0)
    broker.round_robin[defn.name] = counter + 1
    return counter % defn.partitions


#: The AckResponse (facts B3.3: this key order), filled in with ``%`` (a dict and ``json.dumps`` per ack
#: cost more than the rest of the reply).
_ACK_TEMPLATE = (b'{"status":"OK","last_offset":%d,"producer_epoch":%d,"producer_id":%s,'
                 b'"seq_start":%d,"seq_end":%d}')
_NO_PRODUCER_ID = b'""'


def _ack(last_offset: int, producer_id: str, epoch: int, seq_start: int, seq_end: int) -> bytes:
    """The AckResponse JSON bytes, byte for byte what ``json.dumps(..., separators=(",", ":"))`` gives."""
    quoted = json.dumps(producer_id).encode("ascii") if producer_id else _NO_PRODUCER_ID
    return _ACK_TEMPLATE % (last_offset, epoch, quoted, seq_start, seq_end)
