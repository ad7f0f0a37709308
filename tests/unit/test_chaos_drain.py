"""Chaos harness, finding G: the final drain shares its time budget between partitions, so one partition that
never finishes cannot starve the others, and a partition it gave up on is reported as not drained."""

from __future__ import annotations

import time
from collections.abc import Callable

from chaos import checkers, report
from chaos.drainplan import Progress, drain_all
from tests.unit.test_chaos_checkers import Builder, T, clean


class FakeClock:
    """A monotonic clock the fake reader advances (no sleeping)."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _reader(clock: FakeClock, hwm: dict[str, int], stuck: set[str], cost: float = 1.0,
            calls: list[tuple[str, int | None, float]] | None = None) -> Callable[[str, int | None, float], Progress]:
    """A partition reader: ``cost`` s per 10 offsets; a ``stuck`` partition reads nothing until its deadline."""

    def read(key: str, position: int | None, deadline: float) -> Progress:
        if calls is not None:
            calls.append((key, position, deadline))
        pos = position or 0
        if key in stuck:
            clock.t = max(clock.t, deadline)  # spins until the deadline, as a failed-closed replica does
            return Progress(False, pos, hwm[key], "time share used up")
        while pos < hwm[key]:
            if clock.t >= deadline:
                return Progress(False, pos, hwm[key], "time share used up")
            clock.t += cost
            pos = min(hwm[key], pos + 10)
        return Progress(True, pos, hwm[key])

    return read


def test_a_partition_that_never_finishes_does_not_starve_the_others() -> None:
    clock = FakeClock()
    keys = ["a", "stuck", "b", "c"]
    hwm = {"a": 30, "stuck": 50, "b": 40, "c": 20}
    results = drain_all(keys, _reader(clock, hwm, {"stuck"}), 60.0, now=clock)
    assert [k for k in keys if results[k].done] == ["a", "b", "c"]
    assert not results["stuck"].done and results["stuck"].hwm == 50
    assert clock.t - 100.0 <= 60.0 + 1e-9  # within the budget


def test_a_partition_cut_short_resumes_with_the_time_left() -> None:
    clock = FakeClock()
    calls: list[tuple[str, int | None, float]] = []
    keys = ["big", "small"]
    hwm = {"big": 500, "small": 10}  # big needs 50 s, its first share is 30 s
    results = drain_all(keys, _reader(clock, hwm, set(), calls=calls), 60.0, now=clock)
    assert results["big"] == Progress(True, 500, 500) and results["small"].done
    assert [(k, p) for k, p, _ in calls] == [("big", None), ("small", None), ("big", 300)]
    assert calls[0][2] == 130.0  # first pass: 60 s / 2 partitions
    assert calls[2][2] == 160.0  # second pass: every second left


def test_with_no_time_left_the_second_pass_is_skipped() -> None:
    clock = FakeClock()
    results = drain_all(["x", "y"], _reader(clock, {"x": 10, "y": 10}, {"x", "y"}), 10.0, now=clock)
    assert not results["x"].done and not results["y"].done and clock.t == 110.0
    assert drain_all([], _reader(clock, {}, set()), 10.0, now=clock) == {}


def test_real_time_a_stuck_partition_costs_only_its_share() -> None:
    def read(key: str, position: int | None, deadline: float) -> Progress:
        if key == "stuck":
            while time.monotonic() < deadline:
                time.sleep(0.01)
            return Progress(False, position or 0, 5, "time share used up")
        return Progress(True, 5, 5)

    began = time.monotonic()
    results = drain_all(["stuck", "a", "b", "c"], read, 0.8)
    elapsed = time.monotonic() - began
    assert [k for k, p in results.items() if p.done] == ["a", "b", "c"]
    assert elapsed < 0.8 + 0.3


def _undrained_history(position: int | None) -> Builder:
    h = clean()
    h.send("idem-0", 1, ["idem-0:7", "idem-0:8"], [0, 1])
    if position:
        h.read("drain", 1, 0, [(0, "idem-0:7")], session="drain/1", final=True)
    h.op("drain", "drain-incomplete", {"topic": T, "partition": 1, "position": position, "hwm": 2,
                                       "reason": "time share used up"}, kind="fail", error="time share used up")
    return h


def test_a_partition_the_drain_gave_up_on_is_named_by_the_checker_and_the_report() -> None:
    for position in (None, 1):
        ops = _undrained_history(position).ops()
        lost = checkers.run_all(ops)["lost-writes"]
        assert [a.details["value"] for a in lost] == (["idem-0:7", "idem-0:8"] if position is None else ["idem-0:8"])
        for anomaly in lost:
            assert anomaly.details["partition_drained"] is False
            assert "(the drain could not read that partition)" in anomaly.message
            assert anomaly.details["drain_incomplete"]["reason"] == "time share used up"
        doc = report.build({"seed": 1, "schedule_length": 0}, ops, checkers.run_all(ops), [], workloads={},
                           errors=[], harness_errors=[])
        assert doc["drain_incomplete"] == [{"topic": T, "partition": 1, "position": position, "hwm": 2,
                                            "reason": "time share used up"}]
        assert f"DRAIN INCOMPLETE: {T}/1 read to {position} of hwm 2 (time share used up)" in report.summary(doc)


def test_a_partly_drained_partition_below_the_cut_is_still_a_real_loss() -> None:
    h = clean()
    h.send("idem-0", 1, ["idem-0:7", "idem-0:8"], [0, 1])
    h.read("drain", 1, 0, [(1, "idem-0:8")], session="drain/1", final=True)  # offset 0 missing, drain went past
    h.op("drain", "drain-incomplete", {"topic": T, "partition": 1, "position": 2, "hwm": 3, "reason": "x"},
         kind="fail", error="x")
    [lost] = checkers.run_all(h.ops())["lost-writes"]
    assert lost.details["value"] == "idem-0:7" and lost.details["partition_drained"] is True
    assert "could not read" not in lost.message
