"""CONSUME: one long-poll read of one partition (spec "CONSUME", facts decision 14, B3.4).

The reply is a CBV2 batch header followed by a records section read from the segment: the broker never
decodes stored records to serve them (it only peeks at the first and last record's producer sequence for
the batch header). Header and records go to the socket as separate buffers (``writelines``), and a large
read runs on the offload threads (:mod:`cursus.broker.offload`).
"""

from __future__ import annotations

import functools
import logging
import struct
from dataclasses import dataclass

from cursus.broker.args import ReadArgs
from cursus.broker.core import Broker
from cursus.broker.handlers.common import check_topic_access, partition_of
from cursus.broker.replica import Replica
from cursus.broker.request import Parts, Request, SessionInfo
from cursus.storage import CorruptLogError, OffsetOutOfRange, PartitionLog
from cursus.storage.chunk import uniform_stride
from cursus.storage.producer_state import record_producer
from cursus.transactions.index import filter_records
from cursus.wire import MAX_RECORDS_PER_BATCH, encode_batch_header
from cursus.wire.errors import BrokerError

DEFAULT_BATCH_RECORDS = 8192
#: Upper bound on one long poll; clients time out their sockets long before this (5 s by default).
MAX_WAIT_MS = 300_000
_U32 = struct.Struct(">I")
log = logging.getLogger("cursus.fetch")


def _out_of_range(replica: Replica, requested: int) -> BrokerError:
    return BrokerError.of("OFFSET_OUT_OF_RANGE", requested=requested, earliest=replica.log_start_offset,
                          latest=replica.hwm)


@dataclass(frozen=True, slots=True)
class ReadTarget:
    """The validated arguments shared by CONSUME and STREAM."""

    topic: str
    replica: Replica
    #: ``read_committed`` (stops at the LSO, hides aborted records and markers) or ``read_uncommitted``
    isolation: str
    max_records: int
    max_bytes: int
    #: Decision 14: max(requested offset, the group's committed offset); without ``offset=``, the committed
    #: offset, else the log start (or the HWM with ``autoOffsetReset=latest``). Not yet range-checked.
    start: int


def read_target(broker: Broker, args: ReadArgs, *, default_batch: int, session: SessionInfo | None = None) -> ReadTarget:
    """Resolve a validated CONSUME/STREAM request: topic and access, partition, limits, start offset.

    Raises:
        BrokerError: ``topic_not_found``, ``NOT_AUTHORIZED_FOR_TOPIC``, ``invalid_partition`` /
            ``partition_not_found``, ``leader_not_available`` (the argument errors were raised by the parse).
    """
    defn = broker.topic(args.topic)
    check_topic_access(defn, "read", session)
    replica = partition_of(broker, defn, args.partition)
    replica.check_readable()  # never serve a stale HWM (a restarted or new leader not ready yet)
    max_records = min(args.batch or default_batch, MAX_RECORDS_PER_BATCH)
    max_bytes = min(args.max_bytes or broker.config.consume_default_max_bytes, broker.config.consume_max_bytes_limit)
    committed = broker.coordinator.committed(args.group, defn.name, replica.partition)
    if committed is not None and committed > replica.leo:
        committed = None  # stale (the log was truncated below it): never block the partition
    if args.offset is None:
        start = replica.hwm if args.auto_offset_reset == "latest" else replica.log_start_offset
        start = committed if committed is not None else start
    else:
        start = max(args.offset, committed) if committed is not None else args.offset
    return ReadTarget(defn.name, replica, args.isolation, max_records, max_bytes, start)


async def handle_consume(broker: Broker, req: Request, args: ReadArgs) -> Parts:
    """CONSUME topic partition offset [batch] [wait_ms] [max_bytes] [isolation] [autoOffsetReset] [group]."""
    target = read_target(broker, args, default_batch=DEFAULT_BATCH_RECORDS, session=req.session)
    replica, offset = target.replica, target.start
    wait_ms = min(args.wait_ms, MAX_WAIT_MS)
    if offset < replica.log_start_offset or offset > replica.leo:
        raise _out_of_range(replica, offset)
    if offset >= broker.transactions.readable_end(replica, target.isolation) and wait_ms > 0:
        await broker.transactions.wait_readable(replica, offset, wait_ms / 1000.0, target.isolation)
        if replica.deleted:
            raise replica.removed_error()
        replica.check_readable()  # it may have lost (and regained) leadership while waiting
        if offset < replica.log_start_offset:
            raise _out_of_range(replica, offset)
    return (await read_batch(broker, replica, target.topic, offset, target.max_records, target.max_bytes,
                             target.isolation))[0]


async def read_batch(broker: Broker, replica: Replica, topic: str, offset: int, max_records: int,
                     max_bytes: int, isolation: str = "read_uncommitted") -> tuple[Parts, int]:
    """One CBV2 reply batch of ``replica`` from ``offset`` up to the HWM (CONSUME and STREAM).

    ``read_committed`` on a partition that holds transactional records reads up to its last stable offset
    and drops aborted records and markers (the ranges are taken on the loop, filtered with the read); a
    partition without transactional records takes exactly the plain path, and a cluster leader whose
    transaction index is not rebuilt from its log yet serves nothing (``readable_end``).

    Returns (the batch as parts: batch header, records section; next offset); the batch holds zero records
    when ``offset`` is at or past the HWM. A read expected to reach ``offload_threshold_bytes`` (records
    available times their average size, at most ``max_bytes``) runs on the offload threads, with its CRC
    checks; ``PartitionLog.read`` is safe beside the writer thread and retention (it pins segments).

    Raises:
        BrokerError: ``OFFSET_OUT_OF_RANGE`` when the range is no longer retained; ``topic_not_found`` when
            the topic was deleted during the read; ``corrupt_log_data`` when a stored chunk fails its
            checksum (never serve wrong bytes).
    """
    hwm = broker.transactions.readable_end(replica, isolation)  # the LSO for read_committed
    index = broker.transactions.read_index(topic, replica.partition) if isolation == "read_committed" else None
    hidden: tuple[tuple[int, int], ...] = ()
    markers: tuple[int, ...] = ()
    if index is not None:
        hidden = index.hidden_slice(offset, hwm)
        markers = index.markers_slice(offset, hwm)
    if offset >= hwm:
        return [encode_batch_header(topic, replica.partition, acks="1", record_count=0)], offset
    read = functools.partial(_read_reply, replica.log, topic, replica.partition, offset, hwm, max_records, max_bytes,
                             hidden, markers)
    try:
        parts, next_offset = await broker.offload.run(
            _expected_bytes(replica.log, offset, hwm, max_records, max_bytes), read)
    except OffsetOutOfRange:
        raise _out_of_range(replica, offset) from None
    except CorruptLogError as exc:
        if replica.deleted:
            raise replica.removed_error() from None
        log.error("refusing to serve %s/%d from offset %d: %s", topic, replica.partition, offset, exc)
        raise BrokerError.of("corrupt_log_data", topic=topic, partition=replica.partition, offset=offset,
                             corrupt_offset=exc.offset if exc.offset is not None else "unknown") from None
    except OSError:
        if replica.deleted:  # its segments were closed under the read
            raise replica.removed_error() from None
        raise
    broker.metrics.topic_out(topic, next_offset - offset, sum(len(part) for part in parts))
    return parts, next_offset


def _expected_bytes(partition_log: PartitionLog, offset: int, hwm: int, max_records: int, max_bytes: int) -> int:
    """Bytes a read from ``offset`` will likely return: available records times the log's average record
    size, capped by the limits."""
    stored_records = partition_log.log_end_offset - partition_log.log_start_offset
    if stored_records <= 0:
        return 0
    average_bytes = partition_log.size_bytes() / stored_records
    return int(min(max_bytes, min(max_records, hwm - offset) * average_bytes))


def _read_reply(partition_log: PartitionLog, topic: str, partition: int, offset: int, hwm: int, max_records: int,
                max_bytes: int, hidden: tuple[tuple[int, int], ...] = (), markers: tuple[int, ...] = ()
                ) -> tuple[Parts, int]:
    """Read, check and frame one reply batch (pure apart from the thread-safe log read; any thread).

    With ``hidden`` ranges (read_committed) the hidden records are dropped (a reply ending on a marker keeps
    that marker, see :func:`filter_records`); a read that kept nothing reads on (up to ``hwm``), so a run of
    aborted records never stalls a consumer below the next visible one."""
    result = partition_log.read(offset, max_offset=hwm, max_records=max_records, max_bytes=max_bytes)
    records, count = result.records, result.record_count
    if hidden:
        records, count = filter_records(records, result.first_offset, count, hidden, markers)
        while count == 0 and result.next_offset < hwm and result.record_count > 0:
            result = partition_log.read(result.next_offset, max_offset=hwm, max_records=max_records,
                                        max_bytes=max_bytes)
            records, count = filter_records(result.records, result.first_offset, result.record_count, hidden,
                                            markers)
    next_offset = result.next_offset
    if result.record_count and partition_log.has_compacted_segments():
        records, count, next_offset = _read_on_over_gaps(partition_log, records, count, next_offset, hwm,
                                                         max_records, max_bytes, hidden, markers)
    seq_start, seq_end = _seq_span(records, count)
    header = encode_batch_header(topic, partition, acks="1", seq_start=seq_start, seq_end=seq_end,
                                 record_count=count)
    return [header, records], next_offset


#: Most contiguous runs one reply of a compacted partition gathers.
_GAP_READS_MAX = 64


def _read_on_over_gaps(partition_log: PartitionLog, records: bytes, count: int, next_offset: int, hwm: int,
                       max_records: int, max_bytes: int, hidden: tuple[tuple[int, int], ...],
                       markers: tuple[int, ...]) -> tuple[bytes, int, int]:
    """A read stops at an offset gap the log cleaner left: fill the reply with the following runs, within
    ``max_records`` and (strictly) ``max_bytes``. Returns (records section, count, next offset)."""
    parts = [records]
    size = len(records)
    for _ in range(_GAP_READS_MAX):
        if count >= max_records or next_offset >= hwm or max_bytes - size < 4:
            break
        more = partition_log.read(next_offset, max_offset=hwm, max_records=max_records - count,
                                  max_bytes=max_bytes - size, at_least_one=False)
        if more.record_count == 0:
            break
        section, kept = more.records, more.record_count
        if hidden:
            section, kept = filter_records(section, more.first_offset, more.record_count, hidden, markers)
        parts.append(section)
        size += len(section)
        count += kept
        next_offset = more.next_offset
    return b"".join(parts), count, next_offset


def _seq_span(records: bytes, count: int) -> tuple[int, int]:
    """First and last record's producer sequence (0 without a producer), for the batch header (facts B3.1)."""
    if count == 0:
        return 0, 0
    first = record_producer(records, 4)
    stride = uniform_stride(records, count)  # records of one length: the last one's place is known
    if stride:
        pos = stride * (count - 1)
    else:
        pos = 0
        for _ in range(count - 1):
            pos += 4 + _U32.unpack_from(records, pos)[0]
    last = record_producer(records, pos + 4)
    return (first[1] if first else 0), (last[1] if last else 0)
