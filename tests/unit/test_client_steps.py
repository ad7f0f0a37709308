"""StepDriver: the loop the blocking and asyncio clients share to drive sans-IO step generators."""

from __future__ import annotations

from collections.abc import Generator

import pytest

from cursus.client.steps import StepDriver


def _steps() -> Generator[str, int, tuple[int, str]]:
    first = yield "one"
    try:
        yield "two"
    except KeyError as exc:
        handled = str(exc)
    return first, handled


def test_replies_go_in_errors_are_thrown_in_and_the_return_value_comes_out() -> None:
    driver = StepDriver(_steps())
    seen = []
    while driver.advance():
        seen.append(driver.step)
        if driver.step == "one":
            driver.reply = 41
        else:
            driver.error = KeyError("gone")
    assert seen == ["one", "two"] and driver.result == (41, "'gone'")
    assert driver.reply is None and driver.error is None


def test_an_error_the_generator_does_not_handle_propagates() -> None:
    driver = StepDriver(_steps())
    assert driver.advance() and driver.step == "one"
    driver.error = ValueError("refused")
    with pytest.raises(ValueError, match="refused"):
        driver.advance()


def test_poll_schedule_gives_one_topic_the_budget_and_several_topics_slices_until_it_is_spent() -> None:
    from cursus.client.group import _MULTI_TOPIC_SLICE_S, _poll_schedule

    assert list(_poll_schedule([], 1.0)) == []
    assert list(_poll_schedule(["a"], 1.0)) == [("a", 1.0)]
    now = [0.0]

    def clock() -> float:
        return now[0]

    seen = []
    for consumer, wait_s in _poll_schedule(["a", "b"], 0.25, clock):
        seen.append((consumer, wait_s))
        now[0] += wait_s  # each poll waits its whole slice (nothing arrives)
    assert seen == [("a", 0), ("b", 0), ("a", _MULTI_TOPIC_SLICE_S), ("b", _MULTI_TOPIC_SLICE_S),
                    ("a", pytest.approx(0.05))]


def test_start_positions_resolve_each_wanted_partition_or_name_the_missing_one() -> None:
    from cursus.client.admin import parse_list_offsets
    from cursus.client.consumer import _start_positions
    from cursus.client.errors import NotFoundError

    listed = parse_list_offsets({"offsets": "P0:earliest=3:latest=10:leo=10:hwm=10,P1:earliest=0:latest=4:leo=4:hwm=4"})
    assert _start_positions("t", "earliest", [0, 1], listed) == {0: 3, 1: 0}
    assert _start_positions("t", {1: -2}, [0, 1], listed) == {0: 3, 1: 2}
    with pytest.raises(NotFoundError) as info:
        _start_positions("t", "latest", [0, 2], listed)
    assert info.value.fields == {"topic": "t", "partition": "2"}
