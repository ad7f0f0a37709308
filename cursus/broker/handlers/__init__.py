"""Command handlers, one module per area, registered in one table.

Each entry pairs a command with its argument type (:data:`cursus.broker.args.ARGS`) and its handler: the
request's fields are parsed and validated once, here, and the handler receives the typed arguments
(``handler(broker, request, args)``). PUBLISH alone parses inside its handler (see the table). Every
handler runs behind :func:`cursus.broker.handlers.access.guarded`: authentication and the permission table
(:data:`cursus.broker.auth.COMMAND_PERMISSIONS`) are checked before dispatch.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from cursus.broker.args import ARGS
from cursus.broker.handlers import (
    admin,
    cluster,
    events,
    fetch,
    groups,
    produce,
    session_cmds,
    stream,
    topics,
    txn,
)
from cursus.broker.handlers.access import guarded
from cursus.broker.request import Answer, Handler, Request
from cursus.params import Args, parse_args
from cursus.wire import Command

TypedHandler = Callable[[Any, Request, Any], Awaitable[Answer]]


def typed(command: Command, handler: TypedHandler) -> Handler:
    """``handler`` behind the parse of ``command``'s arguments (raises the spec's typed errors first)."""
    args_type: type[Args] = ARGS[command]

    async def run(broker: Any, req: Request) -> Answer:
        return await handler(broker, req, parse_args(args_type, req.fields, command.name, req.positionals))

    run.__name__ = run.__qualname__ = getattr(handler, "__name__", "handler")
    run.__doc__ = handler.__doc__
    return run


_TYPED: Mapping[Command, TypedHandler] = {
    Command.AUTH: session_cmds.handle_auth,
    Command.EXIT: session_cmds.handle_exit,
    Command.HELP: session_cmds.handle_help,
    Command.CREATE: topics.handle_create,
    Command.LIST: topics.handle_list,
    Command.DESCRIBE: admin.handle_describe,
    Command.ALTER_TOPIC_CONFIG: admin.handle_alter_topic_config,
    Command.DELETE: admin.handle_delete,
    Command.TRUNCATE: admin.handle_truncate,
    Command.METADATA: topics.handle_metadata,
    Command.LIST_OFFSETS: topics.handle_list_offsets,
    Command.REGISTER_GROUP: groups.handle_register_group,
    Command.JOIN_GROUP: groups.handle_join_group,
    Command.SYNC_GROUP: groups.handle_sync_group,
    Command.HEARTBEAT: groups.handle_heartbeat,
    Command.LEAVE_GROUP: groups.handle_leave_group,
    Command.COMMIT_OFFSET: groups.handle_commit_offset,
    Command.BATCH_COMMIT: groups.handle_batch_commit,
    Command.FETCH_OFFSET: groups.handle_fetch_offset,
    Command.GROUP_STATUS: groups.handle_group_status,
    Command.LIST_GROUPS: groups.handle_list_groups,
    Command.FIND_COORDINATOR: groups.handle_find_coordinator,
    Command.CONSUME: fetch.handle_consume,
    Command.STREAM: stream.handle_stream,
    Command.CLUSTER_STATUS: cluster.handle_cluster_status,
    Command.LIST_CLUSTER: cluster.handle_list_cluster,
    Command.ELECT_LEADER: cluster.handle_elect_leader,
    Command.INIT_PRODUCER_ID: txn.handle_init_producer_id,
    Command.BEGIN_TXN: txn.handle_begin_txn,
    Command.TXN_PUBLISH: txn.handle_txn_publish,
    Command.TXN_APPEND_STREAM: txn.handle_txn_append_stream,
    Command.SEND_OFFSETS_TO_TXN: txn.handle_send_offsets,
    Command.END_TXN: txn.handle_end_txn,
    Command.TXN_STATUS: txn.handle_txn_status,
    Command.APPEND_STREAM: events.handle_append_stream,
    Command.READ_STREAM: events.handle_read_stream,
    Command.STREAM_VERSION: events.handle_stream_version,
    Command.SAVE_SNAPSHOT: events.handle_save_snapshot,
    Command.READ_SNAPSHOT: events.handle_read_snapshot,
    Command.BROWSE_MESSAGES: events.handle_browse,
    Command.AGGREGATE_REPLAY_PROOF: events.handle_replay_proof,
    Command.AGGREGATE_EVENT_RANGE_READ: events.handle_range_read,
}

_UNGUARDED: Mapping[Command, Handler] = {
    **{command: typed(command, handler) for command, handler in _TYPED.items()},
    # PUBLISH parses its own arguments: a CBV2 batch carries them in its header, and an acks=0 request
    # must stay silent even when its arguments are wrong.
    Command.PUBLISH: produce.handle_publish,
}

#: What the session dispatches: every handler behind authentication and its permissions (``enable_sasl``).
HANDLERS: Mapping[Command, Handler] = {command: guarded(command, handler) for command, handler in _UNGUARDED.items()}
