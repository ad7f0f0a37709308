"""Command handlers, one module per area, registered in one table."""

from __future__ import annotations

from collections.abc import Mapping

from cursus.broker.handlers import admin, fetch, produce, session_cmds, topics
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
}
