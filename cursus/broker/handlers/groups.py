"""Consumer-group and offset commands (spec "Consumer Group Coordination", "Offset Management", section 6;
facts A6, B5, decisions 8 and 9).

REGISTER_GROUP, JOIN_GROUP, SYNC_GROUP, HEARTBEAT, LEAVE_GROUP, COMMIT_OFFSET, BATCH_COMMIT, FETCH_OFFSET,
GROUP_STATUS, LIST_GROUPS and FIND_COORDINATOR. Handlers only parse and format; the state machine is
:mod:`cursus.coordinator.groups`, durability and timers are :mod:`cursus.coordinator.service`.
"""

from __future__ import annotations

import re

from cursus.broker.args import (
    BatchCommitArgs,
    CommitOffsetArgs,
    FetchOffsetArgs,
    FindCoordinatorArgs,
    GroupArgs,
    MemberArgs,
    NoArgs,
    RegisterGroupArgs,
    SyncGroupArgs,
)
from cursus.broker.core import Broker
from cursus.broker.request import Request
from cursus.coordinator.groups import Group, Selector
from cursus.metadata.state import transaction_coordinator
from cursus.wire.errors import BrokerError
from cursus.wire.responses import json_envelope, ok_text

#: BATCH_COMMIT carries at most this many unique partitions (spec BATCH_COMMIT).
MAX_BATCH_PARTITIONS = 1024
_BATCH_ENTRY = re.compile(r"P([0-9]{1,10}):([0-9]{1,19})")


# ------------------------------------------------------------------------------------------------ parsing


def _assignment_fields(group: Group, member_id: str, topic: str | None) -> list[tuple[str, object]]:
    """``assignments=[0,1,2]`` (decision 9) for one-topic groups or the requested topic, and
    ``topic_assignments=t:P0,t:P1`` for multi-topic groups."""
    fields: list[tuple[str, object]] = []
    if not group.selector.multi_topic:
        only = group.selector.topics[0]
        fields.append(("assignments", _bracketed(group.partitions_of(member_id, only))))
        return fields
    if topic is not None:
        fields.append(("assignments", _bracketed(group.partitions_of(member_id, topic))))
    member = group.members.get(member_id)
    pairs = member.assignment if member is not None else ()
    fields.append(("topic_assignments", ",".join(f"{t}:P{p}" for t, p in pairs)))
    return fields


def _bracketed(partitions: list[int]) -> str:
    return "[" + ",".join(str(p) for p in partitions) + "]"


def parse_batch_offsets(args: BatchCommitArgs) -> dict[int, int]:
    """BATCH_COMMIT ``offsets=P<p>:<next>,...`` or its one positional alias (decision 8), validated whole.

    Raises:
        BrokerError: ``invalid_batch_commit_entry reason=`` (missing field, several positionals, malformed entry,
            more than 1,024 partitions), ``no_valid_offsets`` (empty list), ``duplicate_partition``.
    """
    group, topic = args.group, args.topic
    raw = args.offsets
    if raw is None:
        if len(args.positionals) > 1:
            raise BrokerError.of("invalid_batch_commit_entry", command="BATCH_COMMIT",
                                 reason="positional_offsets_must_be_one_list")
        raw = args.positionals[0] if args.positionals else None
    if raw is None:
        raise BrokerError.of("invalid_batch_commit_entry", command="BATCH_COMMIT", reason="missing_offsets")
    if not raw.strip():
        raise BrokerError.of("no_valid_offsets", command="BATCH_COMMIT", group=group, topic=topic)
    offsets: dict[int, int] = {}
    for entry in raw.split(","):
        match = _BATCH_ENTRY.fullmatch(entry.strip())
        if match is None:
            raise BrokerError.of("invalid_batch_commit_entry", command="BATCH_COMMIT", reason="malformed_entry",
                                 entry=re.sub(r"\s", "_", entry.strip())[:64] or "empty")
        partition, offset = int(match.group(1)), int(match.group(2))
        if partition in offsets:
            raise BrokerError.of("duplicate_partition", partition=partition, group=group, topic=topic)
        offsets[partition] = offset
        if len(offsets) > MAX_BATCH_PARTITIONS:
            raise BrokerError.of("invalid_batch_commit_entry", command="BATCH_COMMIT",
                                 reason="too_many_partitions", limit=MAX_BATCH_PARTITIONS)
    return offsets


# ------------------------------------------------------------------------------------------------ handlers


async def handle_register_group(broker: Broker, req: Request, args: RegisterGroupArgs) -> bytes:
    """REGISTER_GROUP group= (topic= | topics= | pattern=) -> ``OK group=G topic=T registered=true``
    (``topics=a,b`` / ``pattern=P`` for the other selectors), plus the expansion's ``partitions=N``."""
    await broker.route_group(args.group)
    selector = Selector.parse(topic=args.topic, topics=args.topics, pattern=args.pattern, command="REGISTER_GROUP")
    group = await broker.coordinator.register(args.group, selector)
    key = "pattern" if selector.kind == "pattern" else selector.kind
    value = selector.pattern if selector.kind == "pattern" else ",".join(selector.topics)
    return ok_text(("group", args.group), (key, value), ("registered", True),
                   ("partitions", group.partition_count), ("epoch", group.epoch))


async def handle_join_group(broker: Broker, req: Request, args: MemberArgs) -> bytes:
    """JOIN_GROUP [topic=] group= member= [generation=] ->
    ``OK generation=N member=<id>-NNNN assignments=[0,1,2]`` (``topic_assignments=`` for multi-topic groups,
    ``resumed=true`` when a full id with ``generation=`` was kept). Creates a missing group for ``topic``. A retry
    of a join whose reply was lost (same client id and host, the member not heard from since) answers the same
    member."""
    await broker.route_group(args.group)
    result = await broker.coordinator.join(args.group, args.member, topic=args.topic, generation=args.generation,
                                           origin=req.session.peer, origin_open=broker.is_connection_open)
    group = result.group
    return ok_text(("generation", group.generation), ("member", result.member_id),
                   *_assignment_fields(group, result.member_id, args.topic),
                   ("resumed", True if result.resumed else None))


async def handle_sync_group(broker: Broker, req: Request, args: SyncGroupArgs) -> bytes:
    """SYNC_GROUP [topic=] group= member= generation= -> ``OK generation=N member=M assignments=[...]``."""
    await broker.route_group(args.group)
    group = broker.coordinator.sync(args.group, args.member, args.generation, args.topic)
    return ok_text(("generation", group.generation), ("member", args.member),
                   *_assignment_fields(group, args.member, args.topic))


async def handle_heartbeat(broker: Broker, req: Request, args: MemberArgs) -> bytes:
    """HEARTBEAT [topic=] group= member= [generation=] -> ``OK member=M generation=N``; a stale generation is
    ``GEN_MISMATCH`` (the member must rejoin)."""
    await broker.route_group(args.group)
    group = broker.coordinator.heartbeat(args.group, args.member, args.generation, args.topic)
    return ok_text(("member", args.member), ("generation", group.generation))


async def handle_leave_group(broker: Broker, req: Request, args: MemberArgs) -> bytes:
    """LEAVE_GROUP [topic=] group= member= [generation=] -> ``OK group=G member=M left=true``."""
    await broker.route_group(args.group)
    await broker.coordinator.leave(args.group, args.member, args.generation)
    return ok_text(("group", args.group), ("member", args.member), ("left", True))


async def handle_commit_offset(broker: Broker, req: Request, args: CommitOffsetArgs) -> bytes:
    """COMMIT_OFFSET topic= partition= group= offset= member= generation= -> ``OK``.

    Durable (fsynced) before OK, monotonic, idempotent for the same value. ``validate_only=true`` or
    ``ownership_only=true`` check the fencing only and answer ``OK validated=true`` (facts B5).
    """
    await broker.route_group(args.group)
    broker.topic(args.topic)
    offsets = {args.partition: args.offset}
    if args.validate_only:
        await broker.coordinator.validate_commit(args.group, args.topic, args.member, args.generation, offsets)
        return ok_text(("validated", True))
    await broker.coordinator.commit(args.group, args.topic, args.member, args.generation, offsets)
    return ok_text()


async def handle_batch_commit(broker: Broker, req: Request, args: BatchCommitArgs) -> bytes:
    """BATCH_COMMIT topic= group= member= generation= offsets=P0:n,P1:n -> ``OK batched=N``; all or nothing."""
    await broker.route_group(args.group)
    broker.topic(args.topic)
    offsets = parse_batch_offsets(args)
    count = await broker.coordinator.commit(args.group, args.topic, args.member, args.generation, offsets)
    return ok_text(("batched", count))


async def handle_fetch_offset(broker: Broker, req: Request, args: FetchOffsetArgs) -> bytes:
    """FETCH_OFFSET topic= partition= group= -> ``OK offset=N`` (0 when nothing is committed; decision 9)."""
    await broker.route_group(args.group)
    return ok_text(("offset", broker.coordinator.fetch_offset(args.group, args.topic, args.partition)))


async def handle_group_status(broker: Broker, req: Request, args: GroupArgs) -> bytes:
    """GROUP_STATUS group= -> compact JSON with ``"status":"OK"`` (facts B5; shape in docs/groups.md)."""
    await broker.route_group(args.group)
    return json_envelope(broker.coordinator.status(args.group))


async def handle_list_groups(broker: Broker, req: Request, args: NoArgs) -> bytes:
    """LIST_GROUPS -> ``OK count=N groups=a,b`` (sorted); on the coordinator (``NOT_COORDINATOR`` elsewhere)."""
    await broker.route_group()
    names = broker.coordinator.list_groups()
    return ok_text(("count", len(names)), ("groups", ",".join(names)))


async def handle_find_coordinator(broker: Broker, req: Request, args: FindCoordinatorArgs) -> bytes:
    """FIND_COORDINATOR group= | transactional_id= (txn=, transaction=) ->
    ``OK coordinator_id=<broker_id> coordinator_type=group|transaction host=H port=P`` (its registered address).

    Groups: the group's owner on the ring of active brokers in the committed metadata (facts B7
    ``ring.Get(group)``). Transactional ids: the owner of the id's shard on the same ring; standalone both
    are this broker."""
    if args.group:
        kind, coordinator = "group", broker.coordinator_id(args.group)
    elif args.transactional_id:
        state = broker.metadata.state
        # standalone has no shard table: this broker coordinates every transactional id
        kind, coordinator = "transaction", (transaction_coordinator(state, args.transactional_id)
                                            if state.coordinator_shards else broker.broker_id)
    else:
        raise BrokerError.of("missing_coordinator_key", command="FIND_COORDINATOR")
    if coordinator is None:  # no active broker owns the key: never a fallback
        raise BrokerError.of("coordinator_not_available", command="FIND_COORDINATOR", coordinator_type=kind,
                             reason="no broker coordinates this key right now; retry")
    host, _, port = broker.broker_address(coordinator).rpartition(":")
    return ok_text(("coordinator_id", coordinator), ("coordinator_type", kind), ("host", host), ("port", port))
