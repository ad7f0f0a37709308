"""The session's ByteBudget: released bytes go to the waiters that fit, cancellation-safe, synchronous release."""

from __future__ import annotations

import asyncio

import pytest

from cursus.broker.session import ByteBudget


async def test_released_bytes_go_to_the_waiters_that_fit_in_arrival_order():
    budget = ByteBudget(100)
    assert await budget.acquire(90) == 90
    large = asyncio.ensure_future(budget.acquire(60))
    first = asyncio.ensure_future(budget.acquire(10))  # fits now: never held back by the large waiter
    await asyncio.sleep(0)
    assert first.done() and not large.done()
    small = [asyncio.ensure_future(budget.acquire(30)) for _ in range(2)]
    await asyncio.sleep(0)
    budget.release(90)  # 10 used: the large waiter (60) and then one 30 fit, the second 30 does not
    assert await asyncio.wait_for(large, 1) == 60
    assert await asyncio.wait_for(small[0], 1) == 30
    assert not small[1].done()
    assert budget.used_bytes == 100
    budget.release(30)
    assert await asyncio.wait_for(small[1], 1) == 30


async def test_a_cancelled_waiter_keeps_nothing():
    budget = ByteBudget(100)
    await budget.acquire(100)
    blocked = asyncio.ensure_future(budget.acquire(80))
    await asyncio.sleep(0)
    blocked.cancel()
    with pytest.raises(asyncio.CancelledError):
        await blocked
    budget.release(100)
    assert budget.used_bytes == 0
    assert await budget.acquire(100) == 100


async def test_cancelled_after_the_grant_returns_the_bytes():
    budget = ByteBudget(100)
    await budget.acquire(100)
    waiter = asyncio.ensure_future(budget.acquire(50))
    await asyncio.sleep(0)
    budget.release(100)  # grants the waiter synchronously
    waiter.cancel()  # ... which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert budget.used_bytes == 0
