"""The group rejoin and commit decisions are one sans-IO step sequence, driven by the blocking and the
asyncio group consumers alike: here it is driven by hand with canned replies."""

from __future__ import annotations

import asyncio

import pytest

from cursus.client.errors import error_from_typed
from cursus.client.group import GroupMembership, commit_steps, rejoin_steps, run_steps, run_steps_async
from cursus.wire import Command, Frame, Kind, Status, make_error


def _ok(text: str, command: Command) -> Frame:
    return Frame(Kind.RESPONSE, command, Status.OK, 1, text.encode(), None)


def _broker(replies: dict[Command, list[str]], log: list[tuple[Command, dict[str, str]]]):
    def call(command: Command, fields: dict[str, str]) -> Frame:
        log.append((command, dict(fields)))
        text = replies[command].pop(0)
        if text.startswith("ERROR"):
            raise error_from_typed(make_error(text.split()[1]))
        return _ok(text, command)
    return call


def test_rejoin_with_latest_reset_lists_offsets_once_and_both_drivers_agree() -> None:
    def run(driver: str) -> tuple[object, list[tuple[Command, dict[str, str]]]]:
        state = GroupMembership("orders", "billing", "c1")
        log: list[tuple[Command, dict[str, str]]] = []
        call = _broker({
            Command.JOIN_GROUP: ["OK member=c1-1 generation=3 assignments=[0,1,2]"],
            Command.FETCH_OFFSET: ["OK offset=0", "OK offset=7", "OK offset=0"],
            Command.LIST_OFFSETS: ["OK topic=orders offsets=P0:earliest=0:latest=10:leo=10:hwm=10,P1:earliest=0:latest=20:leo=20:hwm=20,"
                                   "P2:earliest=0:latest=30:leo=30:hwm=30"],
        }, log)
        steps = rejoin_steps(state, "latest", None)
        if driver == "sync":
            return run_steps(steps, call), log

        async def acall(command: Command, fields: dict[str, str]) -> Frame:
            return call(command, fields)
        return asyncio.run(run_steps_async(steps, acall)), log

    (sync_result, sync_log), (async_result, async_log) = run("sync"), run("async")
    assert sync_result == async_result
    assert sync_log == async_log
    assert [c for c, _ in sync_log].count(Command.LIST_OFFSETS) == 1
    positions, assignment = sync_result  # type: ignore[misc]
    assert assignment == [0, 1, 2] and positions[1] == 7
    assert (positions[0], positions[2]) == (10, 30)  # "latest" for the partitions with nothing committed


def test_fenced_commit_marks_the_membership_for_a_rejoin() -> None:
    state = GroupMembership("orders", "billing", "c1")
    state.member_id, state.generation, state.assignment = "c1-1", 2, (0,)
    call = _broker({Command.COMMIT_OFFSET: ["ERROR GEN_MISMATCH"], Command.BATCH_COMMIT: ["ERROR GEN_MISMATCH"]},
                   [])
    with pytest.raises(Exception) as raised:
        run_steps(commit_steps(state, {0: 5}), call)
    assert state.is_rejoin_error(raised.value) and state.rejoin_needed
