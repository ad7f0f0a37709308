"""The consumer's poll decisions (sans-IO): one plan drives the blocking and the asyncio consumer."""

from __future__ import annotations

from cursus.client.consumer import ConsumerCore, PartitionCursor
from cursus.client.records import ConsumerRecord

A = ("a", 1)


def _core(partitions: int) -> ConsumerCore:
    core = ConsumerCore("t", auto_offset_reset="earliest", isolation_level="read_committed", batch_size=10,
                        max_bytes=None, group=None, member=None)
    core.assign({p: PartitionCursor(p, 0, A) for p in range(partitions)})
    return core


def test_poll_plan_sweeps_without_waiting_then_long_polls_until_the_deadline() -> None:
    now = [0.0]
    plan = _core(2).poll_plan(400, None, clock=lambda: now[0])
    asked = [next(plan)]
    asked.append(plan.send([]))
    asked.append(plan.send([]))
    now[0] = 0.3
    asked.append(plan.send([]))
    assert [(c.partition, wait) for c, wait in asked] == [(1, 0), (0, 0), (1, 200), (0, 100)]
    now[0] = 0.5
    try:
        plan.send([])
    except StopIteration as done:
        assert done.value == []
    else:
        raise AssertionError("the plan must end at the deadline")


def test_poll_plan_returns_buffered_records_first_and_the_first_batch_found() -> None:
    core = _core(1)
    record = ConsumerRecord("t", 0, 5, b"x")
    core.unread([record])
    plan = core.poll_plan(100, None)
    try:
        next(plan)
    except StopIteration as done:
        assert done.value == [record]
    plan = core.poll_plan(100, None)
    cursor, wait = next(plan)
    assert (cursor.partition, wait) == (0, 0)
    try:
        plan.send([record])
    except StopIteration as done:
        assert done.value == [record]


def test_cut_keeps_every_partition_record_before_its_own_end() -> None:
    """Break-it finding: a record past one partition's end put back the other partitions' records too, so
    ``records(until_end=True)`` saw the same buffer forever under concurrent writes."""
    core = _core(2)
    r = [ConsumerRecord("t", 0, 8, b"a"), ConsumerRecord("t", 0, 9, b"b"), ConsumerRecord("t", 0, 10, b"late"),
         ConsumerRecord("t", 1, 3, b"c"), ConsumerRecord("t", 1, 4, b"d")]
    ends = {0: 10, 1: 10}
    assert core.cut(list(r), ends) == [r[0], r[1], r[3], r[4]]
    assert core.buffer == [r[2]]  # only the record past partition 0's end waits
    assert core.position(0) == 10  # partition 0 has reached its end
    assert core.cut([], ends) == [] and core.cut([r[3]], None) == [r[3]]


def test_consume_steps_follow_redirects_and_fail_over_for_both_transports() -> None:
    """The routing decisions of one CONSUME live in the core, so the asyncio consumer fails over as the
    blocking one does (review finding: only the blocking consumer had the failover branch)."""
    from cursus.client.errors import BrokerUnavailableError, NotLeaderError
    from cursus.wire import Command, Frame, Kind, Status

    core = _core(1)
    cursor = core.cursors[0]
    steps = core.consume_steps(cursor, 0, redirects_max=5)
    assert next(steps)[0] == "consume"
    # NOT_LEADER naming the leader: go there at once
    assert steps.throw(NotLeaderError("NOT_LEADER", fields={"leader": "b:2"})) == ("consume", core.fields(cursor, 0))
    assert cursor.leader == ("b", 2)
    # the leader is unreachable: ask the metadata; it still names the dead broker (failover in progress): back off
    assert steps.throw(BrokerUnavailableError("gone")) == ("leader", None)
    assert steps.send(("b", 2)) == ("backoff", 1)  # the second attempt
    assert steps.send(None)[0] == "consume"
    # unreachable again; now the metadata names the new leader: no backoff
    assert steps.throw(BrokerUnavailableError("gone")) == ("leader", None)
    assert steps.send(("c", 3))[0] == "consume" and cursor.leader == ("c", 3)
    reply = Frame(Kind.RESPONSE, Command.CONSUME, Status.OK, 1, b"", None)
    try:
        steps.send(reply)
    except StopIteration as done:
        assert done.value is reply
    else:
        raise AssertionError("the reply ends the steps")


def test_consume_steps_reset_an_out_of_range_position_from_the_bounds() -> None:
    from cursus.client.errors import OffsetOutOfRangeError

    core = _core(1)
    cursor = core.cursors[0]
    cursor.position = 99
    steps = core.consume_steps(cursor, 0, redirects_max=1)
    next(steps)
    assert steps.throw(OffsetOutOfRangeError("OFFSET_OUT_OF_RANGE", fields={"requested": "99"})) == ("bounds", None)
    try:
        steps.send((4, 10))
    except StopIteration as done:
        assert done.value is None and cursor.position == 4
    else:
        raise AssertionError("a reset ends the steps")


def test_a_retryable_refusal_after_the_clients_retries_backs_off_and_never_surfaces() -> None:
    """Break-it finding: a new leader preparing longer than the client's backoff budget (about 4-7 s) made
    ``Consumer.poll`` raise ``leader_not_available`` (retryable) to the application. The plan now re-reads
    the leader and backs off, and the poll ends with nothing (the next one tries again); a non-retryable
    error still raises."""
    from cursus.client.errors import error_from_typed
    from cursus.wire.errors import make_error

    core = _core(1)
    cursor = core.cursors[0]
    steps = core.consume_steps(cursor, 100, redirects_max=1)
    assert next(steps)[0] == "consume"
    refusal = error_from_typed(make_error("leader_not_available", topic="t", partition=0, reason="preparing"))
    assert refusal.retryable
    assert steps.throw(refusal) == ("leader", None)
    assert steps.send(("b", 2)) == ("backoff", 0)
    assert steps.send(None) == ("consume", core.fields(cursor, 100))
    assert cursor.leader == ("b", 2)
    assert steps.throw(refusal) == ("leader", None)
    assert steps.send(("b", 2)) == ("backoff", 1)
    try:
        steps.send(None)
    except StopIteration as done:
        assert done.value is None
    else:
        raise AssertionError("the attempts are bounded")
    steps = core.consume_steps(cursor, 100, redirects_max=1)
    next(steps)
    fatal = error_from_typed(make_error("NOT_AUTHORIZED_FOR_TOPIC", topic="t", operation="read"))
    assert not fatal.retryable
    try:
        steps.throw(fatal)
    except type(fatal):
        pass
    else:
        raise AssertionError("a non-retryable error raises")
