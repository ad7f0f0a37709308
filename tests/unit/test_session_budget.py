"""The session's ByteBudget: first come, first served, cancellation-safe, synchronous release."""

from __future__ import annotations

import asyncio

import pytest

from cursus.broker.session import ByteBudget


async def test_waiters_are_served_in_order_so_large_ones_are_not_starved():
    budget = ByteBudget(100)
    assert await budget.acquire(90) == 90
    large = asyncio.ensure_future(budget.acquire(60))
    await asyncio.sleep(0)
    small = asyncio.ensure_future(budget.acquire(5))  # would fit now, but waits behind the large one
    await asyncio.sleep(0)
    assert not large.done() and not small.done()
    budget.release(90)
    assert await asyncio.wait_for(large, 1) == 60
    assert await asyncio.wait_for(small, 1) == 5
    assert budget.used_bytes == 65


async def test_a_cancelled_waiter_gives_way_and_keeps_nothing():
    budget = ByteBudget(100)
    await budget.acquire(100)
    blocked = asyncio.ensure_future(budget.acquire(80))
    await asyncio.sleep(0)
    behind = asyncio.ensure_future(budget.acquire(10))
    await asyncio.sleep(0)
    budget.release(20)  # 10 would fit, but only behind the 80
    await asyncio.sleep(0)
    assert not behind.done()
    blocked.cancel()
    with pytest.raises(asyncio.CancelledError):
        await blocked
    assert await asyncio.wait_for(behind, 1) == 10
    assert budget.used_bytes == 90


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
