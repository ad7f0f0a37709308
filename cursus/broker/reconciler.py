"""The reconciler: turns committed metadata into local replicas, off the request path.

It listens to the metadata backend. For every partition assigned to this broker without a local replica it
opens one in a small bounded thread pool (log recovery and producer-state rebuild are a few fsyncs and file
reads each, never run on the event loop), then installs it on the loop. For every topic that left the
metadata it detaches the local replicas at once (no further appends) and removes the storage on the writer
thread, after every append queued for it.

Storage removal is rename-then-delete: the topic folder is first renamed into ``<log_dir>/trash`` (one
atomic rename, both parents fsynced), so a same-name topic can never reopen old data; the trash is emptied
afterwards and at every startup. When even the rename fails the name is an *orphan*: CREATE of that name
is refused (the spec's orphan-storage guard) until a retry succeeds (the next CREATE or ``DELETE
if_exists=true`` of the name, or a restart).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from cursus.metadata.state import MetadataState, PartitionKey
from cursus.storage import fsync_dir

log = logging.getLogger("cursus.reconciler")

TRASH_DIR_NAME = "trash"


class ReplicaHost(Protocol):
    """What the reconciler needs from the broker."""

    broker_id: str
    replicas: dict[PartitionKey, Any]

    def open_partition(self, topic: str, partition: int) -> Any:
        """Blocking: recover one partition's log and producer state (runs in the pool)."""
        ...

    def install_replica(self, topic: str, partition: int, opened: Any) -> None:
        """Loop: make an opened partition a serving replica."""
        ...

    def discard_opened(self, opened: Any) -> None:
        """Blocking: close an opened partition that is no longer wanted."""
        ...

    def detach_topic(self, name: str) -> list[Any]:
        """Loop: remove and fence the topic's local replicas; return them."""
        ...

    async def run_blocking(self, fn: Any) -> Any:
        """Run ``fn`` on the writer thread, in order with appends."""
        ...


def move_to_trash(topics_dir: Path, trash_dir: Path, name: str) -> None:
    """Atomically rename ``topics_dir/name`` into ``trash_dir`` (both parents fsynced). Raises OSError."""
    source = topics_dir / name
    if not source.exists():
        return
    if not trash_dir.is_dir():
        trash_dir.mkdir()
        fsync_dir(trash_dir.parent)
    os.rename(source, trash_dir / uuid.uuid4().hex)
    fsync_dir(topics_dir)
    fsync_dir(trash_dir)


def empty_trash(trash_dir: Path) -> None:
    """Delete everything in the trash; failures are logged (the next startup tries again)."""
    if not trash_dir.is_dir():
        return
    for entry in trash_dir.iterdir():
        try:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        except OSError as exc:
            log.warning("cannot empty trash entry %s: %s", entry, exc)


class Reconciler:
    """Local replicas follow the committed metadata (see the module docstring).

    Args:
        host: the broker (see :class:`ReplicaHost`).
        log_dir: the data directory (``topics/`` and ``trash/`` live in it).
        threads: size of the partition-open pool (at least 1).
        on_orphans: called with the number of orphaned topic names whenever it may have changed.
    """

    def __init__(self, host: ReplicaHost, log_dir: Path, threads: int,
                 on_orphans: Callable[[int], None] = lambda count: None) -> None:
        self._host = host
        self._topics_dir = log_dir / "topics"
        self._trash_dir = log_dir / TRASH_DIR_NAME
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="cursus-open")
        self._state = MetadataState()
        self._opening: dict[PartitionKey, asyncio.Task[None]] = {}
        self._removing: dict[str, asyncio.Task[bool]] = {}
        #: Topic names whose old storage could not be moved away; CREATE of them is refused.
        self.orphans: set[str] = set()
        self._on_orphans = on_orphans

    # ----------------------------------------------------------------------------------------- plan

    def on_metadata(self, old: MetadataState, new: MetadataState) -> None:
        """Metadata listener: detach deleted topics now, open newly assigned partitions in the pool."""
        self._state = new
        for name in sorted(set(old.topics) - set(new.topics)):
            self._start_removal(name)
        self._open_missing(new)

    def _open_missing(self, state: MetadataState) -> None:
        for key in sorted(state.partitions_on(self._host.broker_id)):
            if key not in self._host.replicas and key not in self._opening:
                task = asyncio.get_running_loop().create_task(self._open(key))
                self._opening[key] = task
                task.add_done_callback(lambda t, k=key: self._opened(k, t))  # type: ignore[misc]

    def _opened(self, key: PartitionKey, task: asyncio.Task[None]) -> None:
        if self._opening.get(key) is task:
            del self._opening[key]
        if not task.cancelled() and task.exception() is not None:
            log.error("opening %s/%d failed: %s", key[0], key[1], task.exception())

    async def _open(self, key: PartitionKey) -> None:
        loop = asyncio.get_running_loop()
        opened = await loop.run_in_executor(self._pool, self._host.open_partition, *key)
        wanted = self._state.assignment(*key)
        if wanted is None or self._host.broker_id not in wanted.replicas or key in self._host.replicas:
            await loop.run_in_executor(self._pool, self._host.discard_opened, opened)
            return
        self._host.install_replica(key[0], key[1], opened)

    async def wait_open(self, keys: Iterable[PartitionKey]) -> None:
        """Wait until every key in ``keys`` that is assigned here is open; a partition whose earlier open
        failed is opened again. Raises the open's error (CorruptLogError, OSError)."""
        self._open_missing(self._state)
        tasks = [self._opening[k] for k in keys if k in self._opening]
        if tasks:
            await asyncio.gather(*[asyncio.shield(t) for t in tasks])

    async def start(self, state: MetadataState) -> int:
        """Startup: empty the trash, move away storage of topics ``state`` does not name, then open every
        local partition (bounded parallel). Returns the partitions opened. Raises the first open error."""
        self._state = state
        loop = asyncio.get_running_loop()
        known = set(state.topics)
        self.orphans = set(await loop.run_in_executor(self._pool, self._clear_unknown_storage, known))
        self._on_orphans(len(self.orphans))
        self._open_missing(state)
        keys = list(self._opening)
        await self.wait_open(keys)
        return len(keys)

    def _clear_unknown_storage(self, known: set[str]) -> list[str]:
        orphans = []
        if self._topics_dir.is_dir():
            for entry in sorted(self._topics_dir.iterdir()):
                if entry.is_dir() and entry.name not in known:
                    log.warning("removing storage of deleted topic %s", entry.name)
                    try:
                        move_to_trash(self._topics_dir, self._trash_dir, entry.name)
                    except OSError as exc:
                        log.error("cannot move away storage of deleted topic %s: %s", entry.name, exc)
                        orphans.append(entry.name)
        empty_trash(self._trash_dir)
        return orphans

    # --------------------------------------------------------------------------------------- remove

    def _start_removal(self, name: str) -> asyncio.Task[bool]:
        replicas = self._host.detach_topic(name)
        previous = self._removing.get(name)
        task = asyncio.get_running_loop().create_task(self._remove(name, replicas, previous))
        self._removing[name] = task
        task.add_done_callback(lambda t: self._removing.pop(name, None) if self._removing.get(name) is t else None)
        return task

    async def _remove(self, name: str, replicas: list[Any], previous: asyncio.Task[bool] | None) -> bool:
        """Close the replicas and move the topic folder to the trash. Returns True when that failed."""
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
        opening = [t for k, t in self._opening.items() if k[0] == name]
        if opening:  # an open in flight would recreate files under the folder
            await asyncio.gather(*opening, return_exceptions=True)
            replicas += self._host.detach_topic(name)

        def remove() -> None:
            for replica in replicas:
                replica.log.close()
            move_to_trash(self._topics_dir, self._trash_dir, name)

        try:
            await self._host.run_blocking(remove)
        except OSError as exc:
            log.warning("storage cleanup of deleted topic %s pending: %s", name, exc)
            self.orphans.add(name)
            self._on_orphans(len(self.orphans))
            return True
        self.orphans.discard(name)
        self._on_orphans(len(self.orphans))
        await asyncio.get_running_loop().run_in_executor(self._pool, empty_trash, self._trash_dir)
        return False

    async def removal(self, name: str) -> bool:
        """Wait for the storage removal of deleted topic ``name``; True when cleanup is still pending."""
        task = self._removing.get(name)
        if task is not None:
            return await asyncio.shield(task)
        return name in self.orphans

    async def retry_cleanup(self, name: str) -> bool:
        """Retry moving away the orphaned storage of ``name`` (not in the metadata); True if still pending."""
        if name in self._removing:
            return await self.removal(name)
        if name not in self.orphans or name in self._state.topics:
            return False
        return await self._start_removal(name)

    async def close(self) -> None:
        """Wait for opens and removals in flight, then stop the pool."""
        pending = [*self._opening.values(), *self._removing.values()]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        self._pool.shutdown(wait=True)
