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
