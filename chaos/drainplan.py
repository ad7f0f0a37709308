"""The final drain's time budget, shared fairly between partitions (finding G, docs/chaos.md).

One partition that cannot be read (a replica that failed closed, a leader that never answers) must not
starve the others. :func:`drain_all` gives each partition a first-pass share of the budget
(``timeout_s / partitions``), then spends what is left on the partitions that were cut short, each getting an
equal part of the remaining time, resuming where it stopped. It only schedules: the reading is the
``read`` function's (the real one is in :func:`chaos.workloads.drain`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class Progress:
    """What one attempt at a partition achieved.

    ``done``: read up to its HWM. ``position``: the next offset to read (None: nothing known yet, e.g. no
    LIST_OFFSETS answer). ``hwm``: the HWM the attempt read towards (None if unknown). ``reason``: why it
    stopped short (empty when done).
    """

    done: bool
    position: int | None = None
    hwm: int | None = None
    reason: str = ""


def drain_all(keys: list[K], read: Callable[[K, int | None, float], Progress], timeout_s: float,
              now: Callable[[], float] = time.monotonic) -> dict[K, Progress]:
    """Drain every partition in ``keys`` within ``timeout_s`` seconds in all.

    Pass 1 gives each partition at most ``timeout_s / len(keys)`` seconds, in order. Pass 2 (only if time is
    left) retries the partitions not done, in order, each with ``remaining / partitions still to retry``
    seconds, from the position where pass 1 stopped.

    ``read(key, position, deadline) -> Progress`` reads partition ``key`` from ``position`` (None: from its
    log start) until its HWM or the monotonic ``deadline`` (s, on the ``now`` clock); it must return by the
    deadline, give or take one request. Returns the final :class:`Progress` of every key; a key
    whose progress is not ``done`` could not be drained.
    """
    if not keys:
        return {}
    deadline = now() + timeout_s
    share = timeout_s / len(keys)
    results: dict[K, Progress] = {}
    for key in keys:
        results[key] = read(key, None, min(deadline, now() + share))
    retry = [k for k in keys if not results[k].done]
    for i, key in enumerate(retry):
        left = deadline - now()
        if left <= 0:
            break
        before = results[key]
        after = read(key, before.position, now() + left / (len(retry) - i))
        if after.position is None and before.position is not None:  # keep what pass 1 knew
            after = Progress(after.done, before.position, after.hwm if after.hwm is not None else before.hwm,
                             after.reason)
        results[key] = after
    return results
