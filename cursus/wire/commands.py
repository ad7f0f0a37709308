"""The command-id table (facts A4, decision 1), kept as data in exactly one place.

Id 0 is "unknown" on the wire and is deliberately *not* a member: a frame carrying it
(or any id not listed) is an invalid frame.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum
from types import MappingProxyType

from cursus.wire.errors import InvalidFrame


class Command(IntEnum):
    """Frame header command ids, numbered as the Go broker and current clients (facts A4)."""

    AUTH = 1
    CREATE = 2
    ALTER_TOPIC_CONFIG = 3
    DELETE = 4
    TRUNCATE = 5
    LIST = 6
    LIST_CLUSTER = 7
    CLUSTER_STATUS = 8
    ELECT_LEADER = 9
    PUBLISH = 10
    CONSUME = 11
    STREAM = 12
    HELP = 13
    HEARTBEAT = 14
    JOIN_GROUP = 15
    SYNC_GROUP = 16
    LEAVE_GROUP = 17
    COMMIT_OFFSET = 18
    BATCH_COMMIT = 19
    REGISTER_GROUP = 20
    GROUP_STATUS = 21
    FETCH_OFFSET = 22
    LIST_GROUPS = 23
    LIST_OFFSETS = 24
    DESCRIBE = 25
    INIT_PRODUCER_ID = 26
    BEGIN_TXN = 27
    TXN_PUBLISH = 28
    SEND_OFFSETS_TO_TXN = 29
    END_TXN = 30
    TXN_STATUS = 31
    APPEND_STREAM = 32
    READ_STREAM = 33
    SAVE_SNAPSHOT = 34
    READ_SNAPSHOT = 35
    STREAM_VERSION = 36
    REPLICATE_MESSAGE = 37
    REPLICATE_SNAPSHOT = 38
    LIST_SNAPSHOTS = 39
    FETCH_SNAPSHOT = 40
    CATCHUP_SNAPSHOTS = 41
    FIND_COORDINATOR = 42
    RAFT_APPLY = 43
    METADATA = 44
    INTERNAL_BATCH = 45
    NEGOTIATE = 46
    EXIT = 47
    JOIN_CLUSTER = 48
    LEAVE_CLUSTER = 49
    HEARTBEAT_CLUSTER = 50
    REPLICA_CATCHUP = 51
    AGGREGATE_REPLAY_PROOF = 52
    AGGREGATE_EVENT_RANGE_READ = 53
    TXN_APPEND_STREAM = 54
    BROWSE_MESSAGES = 55
    READ_STREAM_HISTORY = 56


COMMAND_BY_NAME: Mapping[str, Command] = MappingProxyType({member.name: member for member in Command})
"""Upper-case command name -> Command (``"PUBLISH"`` -> ``Command.PUBLISH``)."""

INTERNAL_COMMANDS: frozenset[Command] = frozenset(
    {
        Command.RAFT_APPLY,
        Command.INTERNAL_BATCH,
        Command.JOIN_CLUSTER,
        Command.LEAVE_CLUSTER,
        Command.HEARTBEAT_CLUSTER,
        Command.REPLICA_CATCHUP,
        Command.REPLICATE_MESSAGE,
        Command.REPLICATE_SNAPSHOT,
        Command.LIST_SNAPSHOTS,
        Command.FETCH_SNAPSHOT,
        Command.CATCHUP_SNAPSHOTS,
    }
)
"""Broker-to-broker commands; a client connection gets ``internal_command_unauthorized``
for them (decision 1)."""

_COMMAND_ID_MAX = max(Command)
#: Header command id -> member, built once (an enum call per frame costs more than the lookup).
_COMMAND_BY_ID: Mapping[int, Command] = MappingProxyType({int(command): command for command in Command})


def command_from_id(value: int) -> Command:
    """Map a header command id to ``Command`` (facts A4, B1.1).

    Raises ``InvalidFrame`` (reason ``invalid_frame``) for 0 or any id not in the table.
    """
    command = _COMMAND_BY_ID.get(value)
    if command is None:
        raise InvalidFrame(f"unknown command id {value}")
    return command
