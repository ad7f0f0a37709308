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
