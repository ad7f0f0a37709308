"""Topic administration: DESCRIBE, ALTER_TOPIC_CONFIG, DELETE, TRUNCATE (spec "Topic Management", facts B5)."""

from __future__ import annotations

import json

from cursus.broker.args import AlterTopicConfigArgs, DeleteArgs, TopicArgs, TruncateArgs
from cursus.broker.core import Broker
from cursus.broker.replica import Replica
from cursus.broker.request import Request
from cursus.metadata.topics import check_min_isr, definition_fields, is_internal_topic
from cursus.wire.errors import BrokerError
from cursus.wire.responses import ok_text


def _readable(replica: Replica) -> bool:
    """Whether :meth:`Replica.check_readable` passes (its HWM may be shown)."""
    try:
        replica.check_readable()
    except BrokerError:
        return False
    return True


async def handle_describe(broker: Broker, req: Request, args: TopicArgs) -> bytes:
    """DESCRIBE: the definition plus per-partition leader, replicas, ISR and leader epoch (from the metadata
    assignment) and, where a local replica leads the partition and is ready (:meth:`Replica.check_readable`),
    its log start, LEO and HWM as JSON (else the committed HWM the metadata knows)."""
    defn = broker.topic(args.topic)
    state = broker.metadata.state
    partitions: list[dict[str, object]] = []
    for p in range(defn.partitions):
        a = state.assignment(defn.name, p)
        entry: dict[str, object] = {
            "id": p,
            "leader": broker.broker_address(a.leader if a else None),
            "replicas": list(a.replicas) if a else [],
            "isr": list(a.isr) if a else [],
            "leader_epoch": a.leader_epoch if a else 0,
        }
        r = broker.replicas.get((defn.name, p))
        if r is not None and a is not None and a.leader == broker.broker_id and _readable(r):
            # offsets of a ready leader only (a restarted leader still preparing knows only a stale HWM)
            entry.update(log_start_offset=r.log_start_offset, leo=r.leo, hwm=r.hwm)
        else:
            entry.update(hwm=a.committed_hwm if a else 0)
        partitions.append(entry)
    definition = defn.to_manifest()
    doc = {
        "status": "OK",
        "topic": defn.name,
        "definition": definition,
        "partitions": partitions,
        "policy": definition["policy"],
    }
    return json.dumps(doc, indent=2).encode("utf-8")


async def handle_alter_topic_config(broker: Broker, req: Request, args: AlterTopicConfigArgs) -> bytes:
    """ALTER_TOPIC_CONFIG topic= min_in_sync_replicas=N|default: replace only the min-ISR override."""
    defn = broker.topic(args.topic)
    value = args.min_in_sync_replicas
    override = None if value == "default" else check_min_isr(int(value), defn.replication_factor)
    defn = await broker.alter_min_isr(defn.name, override)
    return ok_text(*definition_fields(defn, broker.config.min_insync_replicas))


async def handle_delete(broker: Broker, req: Request, args: DeleteArgs) -> bytes:
    """DELETE topic= [if_exists=]: manifest removal committed first, then storage removed."""
    name = args.topic
    if is_internal_topic(name):
        raise BrokerError.of("internal_topic_delete_forbidden", topic=name)
    if broker.metadata.get(name) is None:
        if args.if_exists:
            # a retry also retries the storage cleanup of an earlier deletion of this name
            pending = await broker.retry_cleanup_of(name)
            return ok_text(("topic", name), ("deleted", False), ("cleanup_pending", True if pending else None))
        raise BrokerError.of("topic_not_found", topic=name)
    try:
        cleanup_pending = await broker.delete_topic(name)
    except OSError as exc:
        raise BrokerError.of("delete_topic_failed", topic=name, reason=str(exc)) from exc
    return ok_text(("topic", name), ("deleted", True), ("cleanup_pending", True if cleanup_pending else None))


async def handle_truncate(broker: Broker, req: Request, args: TruncateArgs) -> bytes:
    """TRUNCATE topic= expected_revision=: ``OK topic= truncated=true revision= lifecycle_epoch= leo=0 hwm=0
    [cleanup_pending=true]`` once the new lifecycle epoch is committed and (unless cleanup is pending) the
    local partitions are open again, empty."""
    defn, pending = await broker.truncate_topic(args.topic, args.expected_revision)
    return ok_text(("topic", defn.name), ("truncated", True), ("revision", defn.revision),
                   ("lifecycle_epoch", defn.lifecycle_epoch), ("leo", 0), ("hwm", 0),
                   ("cleanup_pending", True if pending else None))
