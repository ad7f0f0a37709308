"""Topic commands: CREATE, LIST, METADATA, LIST_OFFSETS (spec "Topic Management", facts B5)."""

from __future__ import annotations

from cursus.broker.args import ListOffsetsArgs, NoArgs, TopicArgs
from cursus.broker.auth import topic_allows
from cursus.broker.core import Broker
from cursus.broker.handlers.common import partition_of
from cursus.broker.request import Request
from cursus.metadata.topics import TopicSpec, definition_fields, is_internal_topic
from cursus.wire.errors import BrokerError
from cursus.wire.responses import ok_text


async def handle_create(broker: Broker, req: Request, args: TopicSpec) -> bytes:
    """CREATE: new topic or presence-aware patch; committed to the metadata before it is visible, and the
    local partitions are open when the reply is sent."""
    if is_internal_topic(args.topic):
        raise BrokerError.of("invalid_topic_name", topic=args.topic, reason="names starting with __ are broker-owned")
    defn = await broker.create_topic(args)
    return ok_text(*definition_fields(defn, broker.config.min_insync_replicas))


async def handle_list(broker: Broker, req: Request, args: NoArgs) -> bytes:
    """LIST: ``OK count=N topics=a,b``: the topics this connection may read (facts B5; internal topics,
    ``deny_read`` topics and ``acl`` topics whose read_acl does not admit the principal are hidden)."""
    principal = req.session.authenticated_principal
    names = []
    for name in broker.metadata.names():
        defn = broker.metadata.get(name)
        if defn is None or is_internal_topic(name):
            continue
        pol = defn.policy
        if topic_allows(pol.auth_policy, pol.read_acl, pol.write_acl, "read", principal):
            names.append(name)
    return ok_text(("count", len(names)), ("topics", ",".join(names)))


async def handle_metadata(broker: Broker, req: Request, args: TopicArgs) -> bytes:
    """METADATA: per partition the leader's client address and leader epoch, from the metadata assignment
    (no local replica needed), plus the topic policy."""
    defn = broker.topic(args.topic)
    state = broker.metadata.state
    assignments = [state.assignment(defn.name, p) for p in range(defn.partitions)]
    leaders = [broker.broker_address(a.leader if a else None) for a in assignments]
    epochs = [str(a.leader_epoch if a else 0) for a in assignments]
    pol = defn.policy
    return ok_text(
        ("topic", defn.name),
        ("partitions", defn.partitions),
        ("leaders", ",".join(leaders)),
        ("epochs", ",".join(epochs)),
        ("revision", defn.revision),
        ("replication_factor", defn.replication_factor),
        ("idempotent", defn.idempotent),
        ("event_sourcing", defn.event_sourcing),
        ("cleanup_policy", pol.cleanup_policy),
        ("partitioner", pol.partitioner),
        ("auth_policy", pol.auth_policy),
        ("read_acl", ",".join(pol.read_acl)),
        ("write_acl", ",".join(pol.write_acl)),
        ("retention_hours", pol.retention_hours),
        ("retention_bytes", pol.retention_bytes),
        ("lifecycle_epoch", defn.lifecycle_epoch),
    )


async def handle_list_offsets(broker: Broker, req: Request, args: ListOffsetsArgs) -> bytes:
    """LIST_OFFSETS: ``P<n>:earliest=E:latest=L:leo=X:hwm=H`` per partition (latest = HWM)."""
    defn = broker.topic(args.topic)
    if args.partition is not None:
        partitions = [partition_of(broker, defn, args.partition).partition]
    else:
        partitions = list(range(defn.partitions))
    entries = []
    for p in partitions:
        r = broker.replica(defn.name, p)
        r.check_readable()  # never a stale HWM (a restarted or new leader not ready yet)
        entries.append(f"P{p}:earliest={r.log_start_offset}:latest={r.hwm}:leo={r.leo}:hwm={r.hwm}")
    return ok_text(("topic", defn.name), ("partitions", len(entries)), ("offsets", ",".join(entries)))
