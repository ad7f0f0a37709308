"""Driving the clients' sans-IO step generators.

Consumer reads (:meth:`cursus.client.consumer.ConsumerCore.consume_steps`) and group protocol exchanges
(:mod:`cursus.client.group`) are generators: they yield what to do next and are sent its result, or thrown
the request's typed error. The blocking and the asyncio clients drive them with their own I/O; this module
holds what their loops share, so the two can only differ in how they perform a step.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

__all__ = ["StepDriver"]


class StepDriver:
    """The state of one drive of ``steps``: the last step's reply or error, and the outcome.

    Use::

        driver = StepDriver(steps)
        while driver.advance():
            try:
                driver.reply = perform(driver.step)       # or: await perform(...)
            except CursusError as exc:
                driver.error = exc
        return driver.result

    Attributes:
        step: what the generator asked for last (valid while :meth:`advance` returns True).
        reply: the result to send in at the next :meth:`advance` (reset to None by it).
        error: the exception to throw in instead (reset to None by it).
        result: the generator's return value once :meth:`advance` returned False.
    """

    __slots__ = ("steps", "step", "reply", "error", "result")

    def __init__(self, steps: Generator[Any, Any, Any]) -> None:
        self.steps = steps
        self.step: Any = None
        self.reply: Any = None
        self.error: BaseException | None = None
        self.result: Any = None

    def advance(self) -> bool:
        """Resume the generator with the pending reply (or throw the pending error into it). Returns True
        with its next request in :attr:`step`, or False once it returned (:attr:`result`). An exception
        the generator does not handle propagates."""
        reply, error = self.reply, self.error
        self.reply = self.error = None
        try:
            self.step = self.steps.throw(error) if error is not None else self.steps.send(reply)
        except StopIteration as done:
            self.result = done.value
            return False
        return True
