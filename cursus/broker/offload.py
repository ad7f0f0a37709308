"""Keeping the event loop free: a small thread pool for large CPU or disk work, and a stall probe.

:class:`Offload` runs a function inline when its input is small (a thread hop costs more than the work)
and on a bounded pool of threads when it is at least ``offload_threshold_bytes``: (de)compression and
checksums of large frames, and large partition reads. The functions it runs are pure or thread-safe
(``PartitionLog.read`` may run beside the writer thread); zlib, lz4, snappy, CRC-32C and ``pread`` release
the GIL, so the loop keeps serving small requests meanwhile. How many tasks wait for the pool is bounded
by what produces them: one request at a time per connection, and the byte budget.

:class:`StallProbe` wakes every ``loop_probe_interval_ms`` and records how late it woke: the worst such
lateness is the loop's worst stall (``cursus_event_loop_max_stall_seconds``; every sample goes to the
``cursus_event_loop_stall_seconds`` histogram).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from prometheus_client import Gauge, Histogram

T = TypeVar("T")


class Offload:
    """Runs ``fn()`` inline below ``threshold_bytes`` of input, else on ``threads`` worker threads."""

    def __init__(self, threshold_bytes: int, threads: int) -> None:
        self.threshold_bytes = threshold_bytes
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cursus-offload")

    async def run(self, size_bytes: int, fn: Callable[[], T]) -> T:
        """``fn()``, off the loop when ``size_bytes`` (the input it works on) reaches the threshold.

        Exceptions of ``fn`` propagate. Cancelling the caller does not stop a pooled ``fn`` (it finishes,
        and its result is dropped), so ``fn`` must be safe to complete unobserved.
        """
        if size_bytes < self.threshold_bytes:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def close(self) -> None:
        """Wait for running work to finish and stop the threads (blocking: call it off the loop)."""
        self._pool.shutdown(wait=True, cancel_futures=True)


class StallProbe:
    """A task that measures the event loop's lateness (seconds): each sample goes to ``histogram``, the
    maximum to ``gauge``."""

    def __init__(self, interval_s: float, gauge: Gauge, histogram: Histogram) -> None:
        self.interval_s = interval_s
        self.max_stall_s = 0.0
        self._gauge = gauge
        self._histogram = histogram
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start probing on the running loop (idempotent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="cursus-stall-probe")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            expected = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.observe(loop.time() - expected)

    def observe(self, stall_s: float) -> None:
        """Record one lateness sample (seconds)."""
        self._histogram.observe(stall_s)
        if stall_s > self.max_stall_s:
            self.max_stall_s = stall_s
            self._gauge.set(stall_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
