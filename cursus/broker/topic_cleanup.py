"""The one place where per-topic node-local state is dropped when a topic is deleted or truncated.

Components register a *dropper* under a name; :meth:`TopicStateDroppers.drop` runs every dropper for a
topic after the DELETE or TRUNCATE is committed in the metadata (never before: a failed commit leaves
everything live). Registered by the broker (:class:`cursus.broker.core.Broker`): ``groups`` (inactive
consumer groups of the topic are tombstoned and their offsets removed), ``transactions`` (target-topic
operations leave terminal transactions, per-partition transaction indexes are forgotten). Storage and the
idempotent-producer state live with the partition logs and are removed or reset by the reconciler
(:mod:`cursus.broker.reconciler`). Further components (an event store's ``drop_topic(topic)``: indexes and
snapshots) register here::

    broker.topic_state.register("eventstore", lambda topic, reason: store.drop_topic(topic))

A dropper is ``drop(topic, reason)`` with ``reason`` ``"delete"`` or ``"truncate"``; it may be a coroutine
function, must be idempotent (a failure is retried by :meth:`retry`) and raises on failure.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("cursus.broker")

#: ``drop(topic, reason)``; reason ``"delete"`` or ``"truncate"``; may return an awaitable.
Dropper = Callable[[str, str], Awaitable[None] | None]
REASONS = ("delete", "truncate")


class TopicStateDroppers:
    """Registered droppers and the (topic, reason, dropper name) runs that failed, for retries."""

    def __init__(self) -> None:
        self._droppers: dict[str, Dropper] = {}
        #: (topic, reason, dropper name) -> last error text, for every run that failed.
        self.pending: dict[tuple[str, str, str], str] = {}

    def register(self, name: str, drop: Dropper) -> None:
        """Add ``drop`` under ``name`` (unique); it runs after those registered before it."""
        if name in self._droppers:
            raise ValueError(f"topic state dropper {name!r} registered twice")
        self._droppers[name] = drop

    def names(self) -> list[str]:
        return list(self._droppers)

    async def drop(self, topic: str, reason: str) -> bool:
        """Run every dropper for ``topic`` (each one even when an earlier one failed). Returns True when one
        failed (``cleanup_pending``; it is recorded for :meth:`retry`)."""
        assert reason in REASONS, reason
        for key in [k for k in self.pending if k[0] == topic]:
            del self.pending[key]  # a newer lifecycle step supersedes older failures
        failed = False
        for name in list(self._droppers):
            failed |= not await self._run(topic, reason, name)
        return failed

    async def retry(self) -> int:
        """Run every failed dropper again; return how many are still pending."""
        for topic, reason, name in list(self.pending):
            await self._run(topic, reason, name)
        return len(self.pending)

    def pending_for(self, topic: str) -> bool:
        return any(k[0] == topic for k in self.pending)

    async def _run(self, topic: str, reason: str, name: str) -> bool:
        drop = self._droppers.get(name)
        if drop is None:
            return True
        try:
            result = drop(topic, reason)
            if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                await result
        except Exception as exc:
            code = getattr(getattr(exc, "error", None), "code", None) or repr(exc)
            log.warning("%s cleanup of %s topic %s pending: %s", name, "deleted" if reason == "delete"
                        else "truncated", topic, code)
            self.pending[(topic, reason, name)] = str(code)
            return False
        self.pending.pop((topic, reason, name), None)
        return True
