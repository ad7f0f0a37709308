"""The metadata seam: the :class:`Metadata` protocol and its standalone backend.

Handlers and the broker submit :mod:`~cursus.metadata.commands` and read the current
:class:`~cursus.metadata.state.MetadataState`; they never ask whether the broker is clustered. A backend
applies each command with :func:`~cursus.metadata.apply.apply`, makes the new state durable, then publishes
it to listeners (the reconciler turns it into local replicas). The Raft backend of the cluster issue
implements the same protocol by replicating the command bytes and applying them in its FSM.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

from cursus.metadata.apply import ApplyResult, apply
from cursus.metadata.commands import Command, PutTopic, RegisterBroker
from cursus.metadata.state import BrokerInfo, MetadataState
from cursus.metadata.topics import TopicDefinition, load_manifest, save_manifest

log = logging.getLogger("cursus.metadata")

#: Called on the event loop after a state is committed: ``listener(old, new)``; must not block.
Listener = Callable[[MetadataState, MetadataState], None]
RunBlocking = Callable[[Callable[[], object]], Awaitable[object]]


class Metadata(Protocol):
    """Authoritative metadata, durable before visible."""

    @property
    def state(self) -> MetadataState:
        """The latest committed state (read-only)."""
        ...

    def get(self, name: str) -> TopicDefinition | None:
        """The committed definition of topic ``name``, or None."""
        ...

    def names(self) -> list[str]:
        """Every committed topic name, sorted."""
        ...

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(old, new)`` after every committed change."""
        ...

    @property
    def replayed(self) -> bool:
        """True once :attr:`state` is at least as new as every state committed before this node started
        (standalone: always). Before that, published states may be *older* than what the local replicas
        already hold (a cluster node replaying its Raft snapshot and journal): nothing may take a partition
        role, truncate or otherwise act destructively on them (docs/cluster.md, "Restart and replay")."""
        ...

    async def start(self) -> None:
        """Become usable (the cluster backend joins Raft and registers this broker). Raises on failure."""
        ...

    async def stop(self) -> None:
        """Release what :meth:`start` acquired."""
        ...

    def readiness(self) -> dict[str, str]:
        """``/ready`` checks that fail: {check: reason}; empty when the metadata is ready."""
        ...

    def raft_status(self) -> dict[str, object] | None:
        """Raft ``leader_id``, ``is_leader``, ``term``, ``commit_index``, ``applied_index``; None standalone."""
        ...

    async def submit(self, command: Command) -> ApplyResult:
        """Apply ``command``, commit it durably, publish it; return what it did.

        Raises:
            BrokerError: the command was rejected (validation, ``version_conflict``); nothing changed.
            OSError: the commit failed; nothing changed.
        """
        ...


class PublishedState:
    """The read side every backend shares: the latest committed state and its listeners."""

    def __init__(self, state: MetadataState) -> None:
        self._state = state
        self._listeners: list[Listener] = []

    @property
    def state(self) -> MetadataState:
        return self._state

    def get(self, name: str) -> TopicDefinition | None:
        return self._state.topics.get(name)

    def names(self) -> list[str]:
        return self._state.names()

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    @property
    def replayed(self) -> bool:
        return True

    def _publish_state(self, new: MetadataState) -> None:
        """Make ``new`` the committed state and tell every listener (on the event loop)."""
        old, self._state = self._state, new
        for listener in list(self._listeners):
            try:
                listener(old, new)
            except Exception:
                log.exception("metadata listener failed")


class StandaloneMetadata(PublishedState):
    """Metadata of a cluster of one: topic definitions persisted in the manifest (format 3, facts B6).

    Commands are serialized by an internal lock (each commit stages the whole manifest). The partition
    assignment and the broker registry are not persisted: placement is deterministic over the one local
    broker, so they are rebuilt from the manifest at open. Standalone partitions have leader epoch 0
    (facts B5). Manifest writes run through ``run_blocking``
    (the storage writer thread, so a deletion's commit is ordered after the appends queued before it).

    Args:
        log_dir: the broker's data directory.
        run_blocking: runs a blocking callable off the event loop and awaits it.
        local: this broker's registration.

    Raises:
        ManifestError: the manifest is unreadable or malformed.
    """

    def __init__(self, log_dir: Path, run_blocking: RunBlocking, local: BrokerInfo) -> None:
        self._log_dir = log_dir
        self._run_blocking = run_blocking
        self._lock = asyncio.Lock()
        state, _ = apply(MetadataState(initial_leader_epoch=0), RegisterBroker(f"register-{local.id}", local))
        for name, defn in sorted(load_manifest(log_dir).items()):
            state, _ = apply(state, PutTopic(f"restore-{name}", defn))
        super().__init__(state)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def readiness(self) -> dict[str, str]:
        return {}

    def raft_status(self) -> dict[str, object] | None:
        return None

    async def submit(self, command: Command) -> ApplyResult:
        async with self._lock:
            old = self._state
            new, result = apply(old, command)
            if new is old:
                return result
            if new.topics != old.topics:
                topics = dict(new.topics)
                await self._run_blocking(lambda: save_manifest(self._log_dir, topics))
            self._publish_state(new)
            return result
