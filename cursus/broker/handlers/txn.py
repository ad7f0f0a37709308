"""Transaction commands (spec "Transaction Coordinator"; facts A6 "Transactions", B5): INIT_PRODUCER_ID,
BEGIN_TXN, TXN_PUBLISH, TXN_APPEND_STREAM, SEND_OFFSETS_TO_TXN, END_TXN, TXN_STATUS.

In a cluster a command reaching a broker that does not own the id's coordinator shard answers
``NOT_COORDINATOR host= port=`` (the owner from the metadata FSM's shard table); the owner runs it, its
state persisted through ``TxnSync`` (docs/transactions.md "Cluster"). The work happens in
:class:`cursus.transactions.coordinator.TransactionCoordinator` (``broker.transactions``).
"""

from __future__ import annotations

import re

from cursus.broker.args import (
    EndTxnArgs,
    InitProducerIdArgs,
    SendOffsetsArgs,
    TxnAppendStreamArgs,
    TxnPublishArgs,
    TxnSessionArgs,
    TxnStatusArgs,
)
from cursus.broker.core import Broker
from cursus.broker.handlers.produce import target_topic
from cursus.broker.request import Request
from cursus.metadata.state import transaction_coordinator
from cursus.metadata.topics import TopicDefinition
from cursus.partitioning import partition_for_key, partition_for_txn_record
from cursus.transactions.coordinator import TransactionCoordinator
from cursus.transactions.markers import EventSpec
from cursus.transactions.state import TxnEntry
from cursus.wire.errors import BrokerError
from cursus.wire.responses import ok_text

MAX_TXN_OFFSETS = 1024
_ENTRY = re.compile(r"P([0-9]{1,10}):([0-9]{1,19})")


def _coordinator(broker: Broker, command: str, transactional_id: str) -> TransactionCoordinator:
    """This broker's coordinator, when it coordinates ``transactional_id``.

    Raises:
        BrokerError: in a cluster ``NOT_COORDINATOR host= port=`` (retryable) when another broker owns the id's
            shard, ``coordinator_not_available`` when no broker does.
    """
    if broker.config.enabled_distribution:
        state = broker.metadata.state
        owner = transaction_coordinator(state, transactional_id)
        if owner is None:
            raise BrokerError.of("coordinator_not_available", command=command, coordinator_type="transaction",
                                 reason="no broker owns this transactional id's shard right now; retry")
        if owner != broker.broker_id:
            host, _, port = broker.broker_address(owner).rpartition(":")
            if host:
                raise BrokerError.of("NOT_COORDINATOR", host=host, port=port)
            raise BrokerError.of("coordinator_not_available", command=command, coordinator_type="transaction",
                                 reason="the shard owner has no registered address")
    return broker.transactions


def check_partition(defn: TopicDefinition, partition: int) -> None:
    """Raises ``invalid_partition`` / ``partition_not_found`` for a partition ``defn`` does not have."""
    if partition < 0:
        raise BrokerError.of("invalid_partition", topic=defn.name, partition=partition)
    if partition >= defn.partitions:
        raise BrokerError.of("partition_not_found", topic=defn.name, partition=partition)


def txn_partition(defn: TopicDefinition, args: TxnPublishArgs) -> int:
    """The partition of a TXN_PUBLISH with ``partition=-1`` (docs/transactions.md "Partition choice"): a keyed
    record on a ``hash_key`` topic by its key (like PUBLISH); otherwise (no key, or a ``round_robin`` topic)
    a pure function of (producer id, topic, seqNum), never the broker's round-robin counter, so a retry on
    any coordinator lands on the first copy's partition and its seqNum deduplicates it there."""
    if args.key and defn.policy.partitioner == "hash_key":
        return partition_for_key(args.key, defn.partitions)
    return partition_for_txn_record(args.producer_id, defn.name, args.seq_num, defn.partitions)


def parse_txn_offsets(args: SendOffsetsArgs) -> dict[int, int]:
    """``offsets=P<p>:<next>,...`` (or one positional list). Raises ``invalid_txn_offsets reason=``."""
    raw = args.offsets if args.offsets is not None else (args.positionals[0] if len(args.positionals) == 1 else None)
    if raw is None or not raw.strip():
        raise BrokerError.of("invalid_txn_offsets", command="SEND_OFFSETS_TO_TXN", reason="missing_offsets")
    offsets: dict[int, int] = {}
    for entry in raw.split(","):
        match = _ENTRY.fullmatch(entry.strip())
        if match is None:
            raise BrokerError.of("invalid_txn_offsets", command="SEND_OFFSETS_TO_TXN", reason="malformed_entry",
                                 entry=re.sub(r"\s", "_", entry.strip())[:64] or "empty")
        partition, offset = int(match.group(1)), int(match.group(2))
        if partition in offsets:
            raise BrokerError.of("duplicate_partition", partition=partition, group=args.group, topic=args.topic)
        offsets[partition] = offset
        if len(offsets) > MAX_TXN_OFFSETS:
            raise BrokerError.of("invalid_txn_offsets", command="SEND_OFFSETS_TO_TXN", reason="too_many_partitions",
                                 limit=MAX_TXN_OFFSETS)
    return offsets


def _session(entry: TxnEntry) -> tuple[tuple[str, object], ...]:
    return (("transactional_id", entry.transactional_id), ("producerId", entry.producer_id),
            ("epoch", entry.epoch))


async def handle_init_producer_id(broker: Broker, req: Request, args: InitProducerIdArgs) -> bytes:
    """INIT_PRODUCER_ID transactional_id= [producerId= epoch=] -> ``OK transactional_id= producerId= epoch=``.

    Without producerId/epoch (spec): re-initialization bumps the epoch and fences older sessions. With
    both (the caller's last session; docs/transactions.md "Zombie fencing"): the bump happens only when that
    is the id's current session, else ``producer_fenced`` and nothing changes. One without the other is
    ``missing_producer_id`` / ``invalid_epoch``."""
    if (args.producer_id is None) != (args.epoch is None):
        if args.producer_id is None:
            raise BrokerError.of("missing_producer_id", command="INIT_PRODUCER_ID",
                                 reason="epoch= needs producerId=")
        raise BrokerError.of("invalid_epoch", command="INIT_PRODUCER_ID", reason="producerId= needs epoch=")
    coordinator = _coordinator(broker, "INIT_PRODUCER_ID", args.transactional_id)
    expect = (args.producer_id, args.epoch) if args.producer_id is not None and args.epoch is not None else None
    entry = await coordinator.init_producer(args.transactional_id, expect)
    return ok_text(*_session(entry))


async def handle_begin_txn(broker: Broker, req: Request, args: TxnSessionArgs) -> bytes:
    """BEGIN_TXN -> ``OK transactional_id= state=open producerId= epoch=``."""
    coordinator = _coordinator(broker, "BEGIN_TXN", args.transactional_id)
    entry = await coordinator.begin(args.transactional_id, args.producer_id, args.epoch)
    return ok_text(("transactional_id", entry.transactional_id), ("state", entry.state),
                   ("producerId", entry.producer_id), ("epoch", entry.epoch))


async def handle_txn_publish(broker: Broker, req: Request, args: TxnPublishArgs) -> bytes:
    """TXN_PUBLISH -> ``OK transactional_id= appended=true topic= partition= state=open`` once the record is
    committed (acks=all semantics: durable on the ISR, below the HWM)."""
    coordinator = _coordinator(broker, "TXN_PUBLISH", args.transactional_id)
    defn = target_topic(broker, args.topic, req, "TXN_PUBLISH")
    partition = args.partition if args.partition != -1 else txn_partition(defn, args)
    check_partition(defn, partition)
    # a retry whose (topic, seqNum) this coordinator already appended answers the first append's partition
    entry, partition = await coordinator.publish(
        args.transactional_id, args.producer_id, args.epoch, (defn.name, partition), seq_num=args.seq_num,
        key=args.key, payload=args.message.encode("utf-8"))
    return ok_text(("transactional_id", entry.transactional_id), ("appended", True), ("topic", defn.name),
                   ("partition", partition), ("state", "open"))


async def handle_txn_append_stream(broker: Broker, req: Request, args: TxnAppendStreamArgs) -> bytes:
    """TXN_APPEND_STREAM -> ``OK transactional_id= appended=true topic= key= version= partition= state=open``
    once the staged event is committed to the log (acks=all; invisible to READ_STREAM, STREAM_VERSION and
    read_committed until the transaction commits). Routed by key like APPEND_STREAM; ``version`` must be
    current + 1 counting this transaction's staged appends, else ``version_conflict`` (also while another
    undecided transaction holds the key: ``reason=transaction_in_progress``). Aggregate-replay topics refuse
    it (``transactional_append_unsupported``: their events need an event_id and a replay proof)."""
    coordinator = _coordinator(broker, "TXN_APPEND_STREAM", args.transactional_id)
    defn = target_topic(broker, args.topic, req, "TXN_APPEND_STREAM")
    if not defn.event_sourcing:
        raise BrokerError.of("event_sourcing_not_enabled", topic=defn.name)
    if defn.aggregate_replay:
        raise BrokerError.of("transactional_append_unsupported", topic=defn.name,
                             reason="aggregate_replay topics take APPEND_STREAM with event_id only")
    partition = partition_for_key(args.key, defn.partitions)
    event = EventSpec(args.version, event_type=args.event_type or None, schema_version=args.schema_version or None,
                      metadata=args.metadata or None)
    entry, partition = await coordinator.publish(
        args.transactional_id, args.producer_id, args.epoch, (defn.name, partition), seq_num=args.seq_num,
        key=args.key, payload=args.message.encode("utf-8"), event=event)
    return ok_text(("transactional_id", entry.transactional_id), ("appended", True), ("topic", defn.name),
                   ("key", args.key), ("version", args.version), ("partition", partition), ("state", "open"))


async def handle_send_offsets(broker: Broker, req: Request, args: SendOffsetsArgs) -> bytes:
    """SEND_OFFSETS_TO_TXN -> ``OK transactional_id= staged_offsets=N`` (N = all staged partitions)."""
    coordinator = _coordinator(broker, "SEND_OFFSETS_TO_TXN", args.transactional_id)
    offsets = parse_txn_offsets(args)
    await broker.route_group()
    entry = await coordinator.stage_offsets(args.transactional_id, args.producer_id, args.epoch, group=args.group,
                                            member=args.member, generation=args.generation, topic=args.topic,
                                            offsets=offsets)
    return ok_text(("transactional_id", entry.transactional_id), ("staged_offsets", len(entry.offsets)))


async def handle_end_txn(broker: Broker, req: Request, args: EndTxnArgs) -> bytes:
    """END_TXN result=commit|abort -> ``OK transactional_id= state=committed|aborted messages=N offsets=N``."""
    coordinator = _coordinator(broker, "END_TXN", args.transactional_id)
    entry = await coordinator.end(args.transactional_id, args.producer_id, args.epoch, args.result)
    return ok_text(("transactional_id", entry.transactional_id), ("state", entry.state),
                   ("messages", entry.messages), ("offsets", len(entry.offsets)))


async def handle_txn_status(broker: Broker, req: Request, args: TxnStatusArgs) -> bytes:
    """TXN_STATUS -> ``OK transactional_id= mode=exactly_once state= messages= participants= offsets=
    producerId= epoch=``."""
    entry = _coordinator(broker, "TXN_STATUS", args.transactional_id).status(args.transactional_id)
    return ok_text(("transactional_id", entry.transactional_id), ("mode", "exactly_once"), ("state", entry.state),
                   ("messages", entry.messages), ("participants", len(entry.partitions)),
                   ("offsets", len(entry.offsets)), ("producerId", entry.producer_id), ("epoch", entry.epoch))
