"""Authoritative topic metadata behind one interface.

Handlers ask the catalog for topic definitions and hand it changes; they never ask whether the broker is
clustered. :class:`StandaloneCatalog` keeps the definitions in the durable manifest
``{log_dir}/__topic_metadata.json``; the cluster issues add a Raft-FSM implementation of the same protocol.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

from cursus.metadata.topics import TopicDefinition, load_manifest, save_manifest


class Catalog(Protocol):
    """Topic definitions, durable before visible."""

    def get(self, name: str) -> TopicDefinition | None: ...

    def names(self) -> list[str]: ...

    async def put(self, definition: TopicDefinition) -> None: ...

    async def remove(self, name: str) -> None: ...


class StandaloneCatalog:
    """Definitions in the local manifest; writes run on the storage writer thread.

    Mutations must be serialized by the caller (the broker's admin lock), since each one stages the whole
    manifest.

    Args:
        log_dir: the broker's data directory.
        run_blocking: runs a blocking callable off the event loop (the writer thread) and awaits it.
    """

    def __init__(self, log_dir: Path, run_blocking: Callable[[Callable[[], object]], Awaitable[object]]) -> None:
        self._log_dir = log_dir
        self._run_blocking = run_blocking
        self._topics: dict[str, TopicDefinition] = load_manifest(log_dir)

    def get(self, name: str) -> TopicDefinition | None:
        return self._topics.get(name)

    def names(self) -> list[str]:
        return sorted(self._topics)

    async def put(self, definition: TopicDefinition) -> None:
        """Persist ``definition`` (manifest replaced and synced), then expose it. Raises OSError."""
        staged = dict(self._topics)
        staged[definition.name] = definition
        await self._run_blocking(lambda: save_manifest(self._log_dir, staged))
        self._topics[definition.name] = definition

    async def remove(self, name: str) -> None:
        """Persist the removal of ``name``, then hide it. Raises OSError."""
        staged = {n: d for n, d in self._topics.items() if n != name}
        await self._run_blocking(lambda: save_manifest(self._log_dir, staged))
        self._topics.pop(name, None)
