"""The command-id table (facts A4, decision 1)."""

from __future__ import annotations

import pytest

from cursus.wire import COMMAND_BY_NAME, INTERNAL_COMMANDS, Command, InvalidFrame, command_from_id


def test_table_is_dense_1_to_56_without_unknown() -> None:
    assert [int(c) for c in Command] == list(range(1, 57))
    assert "UNKNOWN" not in COMMAND_BY_NAME
    assert Command.NEGOTIATE == 46 and Command.EXIT == 47 and Command.READ_STREAM_HISTORY == 56


def test_command_by_name_is_read_only_and_complete() -> None:
    assert COMMAND_BY_NAME["PUBLISH"] is Command.PUBLISH
    assert len(COMMAND_BY_NAME) == 56
    with pytest.raises(TypeError):
        COMMAND_BY_NAME["X"] = Command.AUTH  # type: ignore[index]


@pytest.mark.parametrize("value", [0, 57, 1000, 0xFFFF, -1])
def test_command_from_id_rejects_unknown(value: int) -> None:
    with pytest.raises(InvalidFrame) as info:
        command_from_id(value)
    assert info.value.reason == "invalid_frame"


def test_command_from_id_accepts_every_member() -> None:
    for command in Command:
        assert command_from_id(int(command)) is command


def test_internal_commands() -> None:
    names = {c.name for c in INTERNAL_COMMANDS}
    assert names == {
        "RAFT_APPLY", "INTERNAL_BATCH", "JOIN_CLUSTER", "LEAVE_CLUSTER", "HEARTBEAT_CLUSTER", "REPLICA_CATCHUP",
        "REPLICATE_MESSAGE", "REPLICATE_SNAPSHOT", "LIST_SNAPSHOTS", "FETCH_SNAPSHOT", "CATCHUP_SNAPSHOTS",
    }
    assert Command.PUBLISH not in INTERNAL_COMMANDS
