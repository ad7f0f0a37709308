"""Event-sourcing commands (spec "Event Sourcing Commands", "Aggregate replay proof"; facts A6, B3.6).

APPEND_STREAM routes by key (FNV-1a 64, as keyed PUBLISH) and appends one version-2 record (version 3 with
``event_id``/``payload_digest`` on aggregate-replay topics) through the partition's normal append path,
answering once it is committed (acks=all: fsynced, replicated to the ISR, under the committed HWM). The
version check counts this leader's appends in flight (:mod:`cursus.broker.eventstore`) and runs with no
``await`` between it and the append, so of two concurrent appends with one expected version exactly one
succeeds.

Reads (READ_STREAM, STREAM_VERSION, READ_SNAPSHOT, the proofs) see the stream index caught up to the
committed HWM only. READ_STREAM and BROWSE_MESSAGES answer two frames with the request's id (a JSON
envelope, then a CBV2 batch), sent as Stream frames (facts decision 6); their argument errors are one
typed ERROR frame (facts B3.6).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging

from cursus.broker.args import (
    AppendStreamArgs,
    BrowseArgs,
    RangeReadArgs,
    ReadStreamArgs,
    ReplayProofArgs,
    SaveSnapshotArgs,
    StreamKeyArgs,
)
from cursus.broker.core import Broker, now_ms
from cursus.broker.eventstore import PartitionEvents, PendingAppend, read_records
from cursus.broker.handlers.common import check_topic_access, partition_of
from cursus.broker.handlers.fetch import read_batch
from cursus.broker.handlers.produce import _check_min_isr, target_topic, wait_ack
from cursus.broker.replica import Replica
from cursus.broker.request import Frames, Request
from cursus.eventstore import Snapshot, StreamEntry, replay_proof
from cursus.eventstore.snapshots import MAX_SNAPSHOT_RECORD_BYTES, encode_snapshot_record
from cursus.metadata.topics import TopicDefinition, validate_topic_name
from cursus.partitioning import partition_for_key
from cursus.storage import CorruptLogError
from cursus.wire import (
    Record,
    decode_record,
    encode_batch_header,
    encode_record,
    iter_record_slices,
    record_offset_field_position,
    stamp_offsets,
)
from cursus.wire.errors import BrokerError
from cursus.wire.responses import json_envelope, ok_text

log = logging.getLogger("cursus.events")
_U32_LEN = 4


# ------------------------------------------------------------------------------------------------ helpers


def _es_topic(broker: Broker, topic: str, req: Request, operation: str, command: str) -> TopicDefinition:
    """The event-sourcing topic ``topic``; ``topic_not_found``, ``event_sourcing_not_enabled``,
    ``NOT_AUTHORIZED_FOR_TOPIC`` (writes also ``internal_topic_write_forbidden``)."""
    if operation == "write":
        defn = target_topic(broker, topic, req, command)
    else:
        defn = broker.topic(validate_topic_name(topic, command=command))
        check_topic_access(defn, "read", req.session)
    if not defn.event_sourcing:
        raise BrokerError.of("event_sourcing_not_enabled", topic=defn.name)
    return defn


def _replica_for_key(broker: Broker, defn: TopicDefinition, key: str, partition: int | None = None) -> Replica:
    """The leader replica of ``key``'s partition (``NOT_LEADER leader=`` on another broker)."""
    return partition_of(broker, defn, partition_for_key(key, defn.partitions) if partition is None else partition)


async def _events(broker: Broker, replica: Replica) -> PartitionEvents:
    try:
        return await broker.events.partition(replica)
    except (OSError, CorruptLogError) as exc:
        if replica.deleted:
            raise replica.removed_error() from None
        log.error("stream index of %s/%d failed: %s", replica.topic, replica.partition, exc)
        raise BrokerError.of("stream_index_failed", topic=replica.topic, partition=replica.partition,
                             reason=type(exc).__name__) from None


async def _read_events(broker: Broker, replica: Replica) -> PartitionEvents:
    """:func:`_events` for a read: refused (``leader_not_available``, retryable) while the replica may not
    show its HWM (:meth:`Replica.check_readable`: a restarted or new leader not ready yet, whose local HWM
    may be below the committed one), so a read never answers a version or stream older than one already
    acknowledged. Checked again after the catch-up (the role may change meanwhile)."""
    replica.check_readable()
    events = await _events(broker, replica)
    replica.check_readable()
    return events


def _payload_digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


# ------------------------------------------------------------------------------------------ APPEND_STREAM


async def _ready_to_check(broker: Broker, replica: Replica, events: PartitionEvents) -> None:
    """:meth:`cursus.broker.eventstore.EventStore.ready_to_check` (the version check may run after it)."""
    await broker.events.ready_to_check(replica, events)


async def handle_append_stream(broker: Broker, req: Request, args: AppendStreamArgs) -> bytes:
    """APPEND_STREAM: ``OK version= offset= partition=`` once the event is committed; ``version_conflict
    current= expected=`` (nothing written) unless ``version`` is current + 1."""
    defn = _es_topic(broker, args.topic, req, "write", "APPEND_STREAM")
    replica = _replica_for_key(broker, defn, args.key)
    payload = args.message.encode("utf-8")
    event_id = digest = None
    if defn.aggregate_replay:
        if not args.event_id:
            raise BrokerError.of("missing_event_id", command="APPEND_STREAM")
        if not args.producer_id:
            raise BrokerError.of("missing_producer_id", command="APPEND_STREAM")
        if args.seq_num < 1:
            raise BrokerError.of("invalid_seq_num", command="APPEND_STREAM", value=args.seq_num)
        event_id, digest = args.event_id, _payload_digest(payload)
    events = await _events(broker, replica)
    await _ready_to_check(broker, replica, events)
    # ---- from here to replica.append: no await (the version check must see every earlier append) ----
    current = events.current_version(args.key)
    if defn.aggregate_replay and args.version <= current:
        same = events.find(args.key, args.version)
        if same is not None and same.event_id == event_id and same.digest == digest:
            # an exact retry: answer with the original offset once it is committed (nothing appended)
            await wait_ack(broker, replica, "all", same.offset + 1, replica.isr)
            return ok_text(version=args.version, offset=same.offset, partition=replica.partition)
    events.check_version(args.key, args.version, None, broker.events._undecided(replica))
    _check_min_isr(broker, defn, replica, "all")
    record = Record(
        topic=defn.name, partition=replica.partition, payload=payload, timestamp=now_ms(), key=args.key,
        event_type=args.event_type or None, schema_version=args.schema_version or None,
        aggregate_version=args.version, metadata=args.metadata or None, event_id=event_id,
        payload_digest=digest,
    )
    encoded = encode_record(record)
    if len(encoded) > broker.config.max_message_bytes:
        raise BrokerError.of("message_too_large", size=len(encoded), limit=broker.config.max_message_bytes)
    buf = bytearray(len(encoded).to_bytes(4, "big") + encoded)
    stamp_offsets(buf, [_U32_LEN + record_offset_field_position(len(defn.name.encode("utf-8")))], replica.leo)
    offset = replica.leo
    isr = replica.isr
    replica.append(memoryview(buf), 1)
    events.reserve(args.key, PendingAppend(args.version, offset, event_id, digest))
    # ---- appended: the outcome is unknown until committed, and the version stays reserved meanwhile ----
    broker.metrics.topic_in(replica.topic, 1, len(buf))
    await wait_ack(broker, replica, "all", offset + 1, isr)
    return ok_text(version=args.version, offset=offset, partition=replica.partition)


# ------------------------------------------------------------------------------------------ reads


async def _event_batch(broker: Broker, replica: Replica, entries: list[StreamEntry]) -> tuple[bytes, int]:
    """The stored records of the first ``entries`` as a records section and their count: at most
    ``eventstore_max_read_events`` records and ``consume_max_bytes_limit`` bytes (at least one), so the
    count may be below ``len(entries)`` (the caller tells the client where to continue)."""
    offsets = [e.offset for e in entries][:broker.config.eventstore_max_read_events]
    if not offsets:
        return b"", 0
    try:
        return await broker.offload.run(1 << 30, lambda: read_records(replica.log, offsets,
                                                                       broker.config.consume_max_bytes_limit))
    except (OSError, CorruptLogError) as exc:
        if replica.deleted:
            raise replica.removed_error() from None
        raise BrokerError.of("stream_index_failed", topic=replica.topic, partition=replica.partition,
                             reason=type(exc).__name__) from None


async def handle_read_stream(broker: Broker, req: Request, args: ReadStreamArgs) -> Frames:
    """READ_STREAM: envelope ``{"status","topic","key","partition","count"[,"snapshot"][,"more",
    "next_from_version"]}`` then the events (version >= from_version, or > the snapshot's version when a
    snapshot at or after from_version exists). A reply cut by ``eventstore_max_read_events`` or
    ``consume_max_bytes_limit`` says ``"more": true`` and the version to continue from; a stream whose
    events to serve lie below the log start answers ``stream_retention_gap`` (never a gapped stream)."""
    defn = _es_topic(broker, args.topic, req, "read", "READ_STREAM")
    replica = _replica_for_key(broker, defn, args.key)
    events = await _read_events(broker, replica)
    start = args.from_version
    snapshot = broker.events.visible_snapshot(events, args.key)
    if snapshot is not None and snapshot.version < args.from_version:
        snapshot = None
    if snapshot is not None:
        start = snapshot.version + 1
    entries = events.index.entries(args.key, start)
    if entries and entries[0].offset < replica.log_start_offset:
        # events of this stream are gone from the log (below its start): never serve a gapped stream
        raise BrokerError.of("stream_retention_gap", topic=defn.name, key=args.key, partition=replica.partition,
                             from_version=start, missing_version=entries[0].version,
                             log_start_offset=replica.log_start_offset,
                             snapshot_version=snapshot.version if snapshot is not None else 0)
    records, count = await _event_batch(broker, replica, entries)
    envelope: dict[str, object] = {"status": "OK", "topic": defn.name, "key": args.key,
                                   "partition": replica.partition, "count": count}
    if snapshot is not None:
        envelope["snapshot"] = snapshot.to_json()
    if count < len(entries):
        # a partial read (the reply's event or byte limit): an extra field official clients ignore; ours
        # read on with from_version=next_from_version (docs/event-sourcing.md "Reading long streams")
        envelope["more"] = True
        envelope["next_from_version"] = entries[count].version
    header = encode_batch_header(defn.name, replica.partition, acks="1", record_count=count)
    return Frames((json_envelope(envelope), [header, records]))


async def handle_stream_version(broker: Broker, req: Request, args: StreamKeyArgs) -> bytes:
    """STREAM_VERSION: ``OK version=N`` (committed; 0 when the aggregate has no events)."""
    defn = _es_topic(broker, args.topic, req, "read", "STREAM_VERSION")
    replica = _replica_for_key(broker, defn, args.key)
    events = await _read_events(broker, replica)
    return ok_text(version=events.index.version(args.key))


async def handle_save_snapshot(broker: Broker, req: Request, args: SaveSnapshotArgs) -> bytes:
    """SAVE_SNAPSHOT: ``OK version= partition=`` once fsynced; ``snapshot_version_exceeds_stream`` above
    the committed version."""
    defn = _es_topic(broker, args.topic, req, "write", "SAVE_SNAPSHOT")
    replica = _replica_for_key(broker, defn, args.key)
    events = await _events(broker, replica)
    replica.check_writable()
    current = events.index.version(args.key)
    if args.version > current:
        raise BrokerError.of("snapshot_version_exceeds_stream", version=args.version, current=current)
    snapshot = Snapshot(args.key, args.version, args.message)
    size = len(encode_snapshot_record(snapshot))
    if size > min(broker.config.max_message_bytes, MAX_SNAPSHOT_RECORD_BYTES):
        raise BrokerError.of("message_too_large", size=size, limit=broker.config.max_message_bytes)
    try:
        await broker.events.save_snapshot(events, snapshot)
    except OSError as exc:
        log.error("snapshot of %s/%d not stored: %s", replica.topic, replica.partition, exc)
        raise BrokerError.of("snapshot_store_failed", topic=defn.name, partition=replica.partition,
                             reason=type(exc).__name__, outcome="unknown") from None
    await broker.events.replicate_snapshot(replica, snapshot)  # cluster: to every in-sync replica before OK
    return ok_text(version=args.version, partition=replica.partition)


async def handle_read_snapshot(broker: Broker, req: Request, args: StreamKeyArgs) -> bytes:
    """READ_SNAPSHOT: ``OK snapshot=null`` or ``OK snapshot={"version":N,"payload":"..."}``."""
    defn = _es_topic(broker, args.topic, req, "read", "READ_SNAPSHOT")
    replica = _replica_for_key(broker, defn, args.key)
    events = await _read_events(broker, replica)
    snapshot = broker.events.visible_snapshot(events, args.key)
    if snapshot is None:
        return b"OK snapshot=null"
    return b"OK snapshot=" + json_envelope(snapshot.to_json())


async def handle_browse(broker: Broker, req: Request, args: BrowseArgs) -> Frames:
    """BROWSE_MESSAGES: ``{"status":"OK","next_offset":N}`` then a CBV2 batch of committed records from
    ``offset`` (default: the log start); any topic (facts B3.6). Commits nothing."""
    defn = broker.topic(args.topic)
    check_topic_access(defn, "read", req.session)
    replica = partition_of(broker, defn, args.partition)
    replica.check_readable()
    offset = replica.log_start_offset if args.offset is None else max(args.offset, replica.log_start_offset)
    offset = min(offset, replica.hwm)
    parts, next_offset = await read_batch(broker, replica, defn.name, offset, args.limit,
                                          broker.config.consume_default_max_bytes)
    envelope = json_envelope({"status": "OK", "next_offset": next_offset})
    return Frames((envelope, parts))


# ------------------------------------------------------------------------------------------ replay proofs


def _replay_topic(broker: Broker, req: Request, topic: str, command: str) -> TopicDefinition:
    defn = _es_topic(broker, topic, req, "read", command)
    if not defn.aggregate_replay:
        raise BrokerError.of("invalid_topic_policy", topic=defn.name, field="aggregate_replay",
                             reason="topic not created with aggregate_replay=true")
    return defn


def _proof_error(code: str, proof: dict[str, object]) -> BrokerError:
    return BrokerError.of(code, proof=json.dumps(proof, separators=(",", ":"), sort_keys=True))


async def handle_replay_proof(broker: Broker, req: Request, args: ReplayProofArgs) -> bytes:
    """AGGREGATE_REPLAY_PROOF: ``OK proof=<json>`` when the committed retained log holds exactly sequences
    1..last of the match; else one of the four ``aggregate_proof_*`` errors with ``proof=<json>``."""
    defn = _replay_topic(broker, req, args.topic, "AGGREGATE_REPLAY_PROOF")
    replica = _replica_for_key(broker, defn, args.match_id, args.partition)
    events = await _read_events(broker, replica)
    result = replay_proof(defn.name, args.match_id, replica.partition, events.index.entries(args.match_id),
                          log_start_offset=replica.log_start_offset, proof_hwm=events.index.indexed_offset,
                          expected_last_sequence=args.expected_last_sequence)
    if result.code is not None:
        raise _proof_error(result.code, result.proof)
    return b"OK proof=" + json.dumps(result.proof, separators=(",", ":"), sort_keys=True).encode("utf-8")


async def handle_range_read(broker: Broker, req: Request, args: RangeReadArgs) -> bytes:
    """AGGREGATE_EVENT_RANGE_READ: JSON ``{"status":"OK","proof":{...},"events":[...]}``, the events of
    sequences ``from_sequence..to_sequence`` (at most ``max_records``) as envelopes with sequence, offset,
    event_id, payload_digest, event_type, schema_version, metadata, timestamp and ``payload_base64``.
    Needs a valid replay proof (its failure codes otherwise); never touches consumer offsets."""
    if args.to_sequence < args.from_sequence:
        raise BrokerError.of("invalid_to_sequence", value=args.to_sequence, from_sequence=args.from_sequence)
    defn = _replay_topic(broker, req, args.topic, "AGGREGATE_EVENT_RANGE_READ")
    replica = _replica_for_key(broker, defn, args.match_id, args.partition)
    events = await _read_events(broker, replica)
    entries = events.index.entries(args.match_id)
    result = replay_proof(defn.name, args.match_id, replica.partition, entries,
                          log_start_offset=replica.log_start_offset, proof_hwm=events.index.indexed_offset)
    if result.code is not None:
        raise _proof_error(result.code, result.proof)
    in_range = [e for e in entries if args.from_sequence <= e.version <= args.to_sequence]
    records, count = await _event_batch(broker, replica, in_range[:args.max_records])
    envelopes = []
    for raw in iter_record_slices(records, count):
        r = decode_record(raw)
        envelopes.append({
            "sequence": r.aggregate_version, "offset": r.offset, "event_id": r.event_id,
            "payload_digest": r.payload_digest, "event_type": r.event_type or "",
            "schema_version": r.schema_version, "metadata": r.metadata or "", "timestamp": r.timestamp,
            "payload_base64": base64.b64encode(r.payload).decode("ascii"),
        })
    reply: dict[str, object] = {"status": "OK", "proof": result.proof, "events": envelopes}
    if count < len(in_range):
        # more events in the range than this reply holds (max_records or the broker's limits): an extra
        # field official clients ignore (docs/event-sourcing.md "Reading long streams")
        reply["more"] = True
        reply["next_from_sequence"] = in_range[count].version
    return json_envelope(reply)
