"""Topic administration: DESCRIBE, ALTER_TOPIC_CONFIG, DELETE (spec "Topic Management", facts B5)."""

from __future__ import annotations

import dataclasses
import json

from cursus.broker.core import Broker
from cursus.broker.handlers.common import topic_arg
from cursus.broker.request import Request
from cursus.metadata.topics import AUTH_FIELDS, definition_fields, is_internal_topic, validate_topic_name
from cursus.parsing import parse_int
from cursus.wire.errors import BrokerError
from cursus.wire.responses import ok_text


async def handle_describe(broker: Broker, req: Request) -> bytes:
    """DESCRIBE: the definition plus per-partition leader, replicas, ISR, LEO and HWM as JSON."""
    defn = topic_arg(broker, req)
    partitions = []
    for p in range(defn.partitions):
        r = broker.replica(defn.name, p)
        partitions.append({
            "id": p,
            "leader": broker.leader_address(),
            "replicas": [broker.broker_id],
            "isr": list(r.isr),
            "leader_epoch": r.leader_epoch,
            "log_start_offset": r.log_start_offset,
            "leo": r.leo,
            "hwm": r.hwm,
        })
    definition = defn.to_manifest()
    doc = {
        "status": "OK",
        "topic": defn.name,
        "definition": definition,
        "partitions": partitions,
        "policy": definition["policy"],
    }
    return json.dumps(doc, indent=2).encode("utf-8")


async def handle_alter_topic_config(broker: Broker, req: Request) -> bytes:
    """ALTER_TOPIC_CONFIG topic= min_in_sync_replicas=N|default: replace only the min-ISR override."""
    unknown = sorted(set(req.fields) - {"topic", "min_in_sync_replicas"} - AUTH_FIELDS)
    if unknown:
        raise BrokerError.of("invalid_field", command="ALTER_TOPIC_CONFIG", field=unknown[0],
                             reason="unknown ALTER_TOPIC_CONFIG field")
    raw = req.require("min_in_sync_replicas")
    async with broker.admin_lock:
        defn = topic_arg(broker, req)
        if raw == "default":
            override = None
        else:
            override = parse_int(raw, minimum=1)
            if override is None or override > defn.replication_factor:
                raise BrokerError.of("invalid_min_in_sync_replicas", value=raw,
                                     reason=f"must be between 1 and the replication factor {defn.replication_factor}")
        if override != defn.min_in_sync_replicas:
            defn = dataclasses.replace(defn, min_in_sync_replicas=override, revision=defn.revision + 1)
            try:
                await broker.apply_definition(defn)
            except OSError as exc:
                raise BrokerError.of("alter_topic_config_failed", topic=defn.name, reason=str(exc)) from exc
    return ok_text(*definition_fields(defn, broker.config.min_insync_replicas))


async def handle_delete(broker: Broker, req: Request) -> bytes:
    """DELETE topic= [if_exists=]: manifest removal committed first, then storage removed."""
    name = validate_topic_name(req.get("topic"), command="DELETE")
    raw_if_exists = (req.get("if_exists") or "false").lower()
    if raw_if_exists not in ("true", "false"):
        raise BrokerError.of("invalid_if_exists", value=req.get("if_exists"))
    if is_internal_topic(name):
        raise BrokerError.of("internal_topic_delete_forbidden", topic=name)
    async with broker.admin_lock:
        if broker.catalog.get(name) is None:
            if raw_if_exists == "true":
                return ok_text(("topic", name), ("deleted", False))
            raise BrokerError.of("topic_not_found", topic=name)
        try:
            cleanup_pending = await broker.delete_topic(name)
        except OSError as exc:
            raise BrokerError.of("delete_topic_failed", topic=name, reason=str(exc)) from exc
    return ok_text(("topic", name), ("deleted", True), ("cleanup_pending", True if cleanup_pending else None))
