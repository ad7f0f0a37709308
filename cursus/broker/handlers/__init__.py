"""Command handlers, one module per area, registered in one table."""

from __future__ import annotations

from collections.abc import Mapping

from cursus.broker.handlers import admin, fetch, groups, produce, session_cmds, stream, topics
from cursus.broker.request import Handler
from cursus.wire import Command

HANDLERS: Mapping[Command, Handler] = {
    Command.AUTH: session_cmds.handle_auth,
    Command.EXIT: session_cmds.handle_exit,
    Command.HELP: session_cmds.handle_help,
    Command.CREATE: topics.handle_create,
    Command.LIST: topics.handle_list,
    Command.DESCRIBE: admin.handle_describe,
    Command.ALTER_TOPIC_CONFIG: admin.handle_alter_topic_config,
    Command.DELETE: admin.handle_delete,
    Command.METADATA: topics.handle_metadata,
    Command.LIST_OFFSETS: topics.handle_list_offsets,
    Command.PUBLISH: produce.handle_publish,
    Command.CONSUME: fetch.handle_consume,
    Command.STREAM: stream.handle_stream,
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
}
