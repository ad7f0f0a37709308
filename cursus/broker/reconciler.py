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

Every topic folder records the *generation* it holds (incarnation, lifecycle epoch:
:mod:`cursus.broker.topic_storage`). A partition is opened only from a folder of the committed generation:
a missing folder is created with its marker; a folder of an older incarnation (this node missed a DELETE
and re-CREATE, e.g. restored from a snapshot) is moved to the trash first; a folder of a *newer* generation
than the state being applied (a node replaying its Raft log at startup passes through older states) is
left alone and not opened until the state catches up; removal of a deleted topic likewise never touches a
folder of a later incarnation. Partitions opened during such a replay are installed without a role (the
broker gives none while the metadata is not ``replayed``: no leader role, no truncation from an old state;
docs/cluster.md "Restart and replay").

A topic whose lifecycle epoch grows (TRUNCATE, committed in the metadata first) is *reset*: its local
replicas are detached at once (every request for it is fenced: ``leader_not_available``), the host drops
the topic's node-local state (``drop_topic_state``: groups, transactions, ...), the logs are closed and the
folder replaced by an empty one whose marker names the new generation
(:func:`cursus.broker.topic_storage.reset_topic_storage`; the marker is written last, so a synced marker
means every step before it is done), then its partitions are opened again (LEO = HWM = 0). At startup a
topic whose folder is behind the committed lifecycle epoch stays fenced until the host calls
:meth:`Reconciler.resume_resets` (once the group coordinator and transactions are open), and a failed step
keeps the topic fenced on this node (``cleanup_pending``) until :meth:`Reconciler.retry_pending` succeeds
(the broker calls it every ``topic_cleanup_retry_interval_ms``; ``cursus_topic_cleanup_pending`` counts
what is left).

A partition whose open fails (a corrupt log the host could not repair, an I/O error) is retried with an
exponential backoff (``open_retry_backoff_ms``, doubling, at most 60 times that), never on every metadata
change; after ``open_max_attempts`` failures it is left unopened (one error line, ``on_open_failed(True)``)
until the topic's generation changes, the broker restarts, or a caller waits for it explicitly
(:meth:`Reconciler.wait_open`, e.g. a CREATE), which retries at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from cursus.broker.topic_storage import (
    Generation,
    create_topic_dir,
    empty_trash,
    move_to_trash,
    read_marker,
    reset_topic_storage,
)
from cursus.metadata.state import MetadataState, PartitionKey

__all__ = ["Reconciler", "ReplicaHost", "empty_trash", "move_to_trash"]

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

    async def drop_topic_state(self, name: str) -> bool:
        """Loop: drop the node-local state of truncated topic ``name`` (groups, transactions, ...) before its
        storage is reset; True when a step failed (the reset waits for a retry)."""
        ...


class Reconciler:
    """Local replicas follow the committed metadata (see the module docstring).

    Args:
        host: the broker (see :class:`ReplicaHost`).
        log_dir: the data directory (``topics/`` and ``trash/`` live in it).
        threads: size of the partition-open pool (at least 1).
        on_orphans: called with the number of orphaned topic names whenever it may have changed.
    """

    def __init__(self, host: ReplicaHost, log_dir: Path, threads: int,
                 on_orphans: Callable[[int], None] = lambda count: None, *, open_retry_backoff_ms: int = 1000,
                 open_max_attempts: int = 8, clock: Callable[[], float] = time.monotonic) -> None:
        self._host = host
        self._topics_dir = log_dir / "topics"
        self._trash_dir = log_dir / TRASH_DIR_NAME
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="cursus-open")
        self._state = MetadataState()
        self._opening: dict[PartitionKey, asyncio.Task[None]] = {}
        self._removing: dict[str, asyncio.Task[bool]] = {}
        #: Topic names whose old storage could not be moved away; CREATE of them is refused.
        self.orphans: set[str] = set()
        #: The incarnation each orphan had (its removal never touches a folder of a later one).
        self._orphan_incarnations: dict[str, int] = {}
        self._on_orphans = on_orphans
        #: Topic -> generation whose local storage reset is running or failed: never opened meanwhile.
        self.resets_pending: dict[str, Generation] = {}
        self._resetting: dict[str, asyncio.Task[bool]] = {}
        #: Serializes the blocking folder steps of one topic (partition opens run in parallel in the pool).
        self._dir_locks: dict[str, threading.Lock] = {}
        self._dir_locks_guard = threading.Lock()
        #: Called after every retry round with the number of topics still pending (metrics).
        self.on_pending: Callable[[int], None] = lambda count: None
        #: Called once per retry of a pending cleanup (metrics).
        self.on_retry: Callable[[], None] = lambda: None
        #: Called once per failed partition open: True when the reconciler gave up on it (metrics).
        self.on_open_failed: Callable[[bool], None] = lambda gave_up: None
        self._open_backoff_s = max(0.001, open_retry_backoff_ms / 1000.0)
        self._open_max_attempts = max(1, open_max_attempts)
        self._clock = clock
        #: Partition -> (generation, failed attempts, monotonic time before which it is not retried).
        self.open_failures: dict[PartitionKey, tuple[Generation, int, float]] = {}
        self._closed = False

    def _dir_lock(self, name: str) -> threading.Lock:
        with self._dir_locks_guard:
            return self._dir_locks.setdefault(name, threading.Lock())

    @staticmethod
    def generation(state: MetadataState, name: str) -> Generation:
        """The committed generation of topic ``name`` in ``state`` (its lifecycle epoch 0 when absent)."""
        defn = state.topics.get(name)
        return (state.incarnation(name), defn.lifecycle_epoch if defn is not None else 0)

    # ----------------------------------------------------------------------------------------- plan

    def on_metadata(self, old: MetadataState, new: MetadataState) -> None:
        """Metadata listener: detach deleted topics now, reset truncated ones, open newly assigned partitions
        in the pool."""
        self._state = new
        for name in sorted(set(old.topics) - set(new.topics)):
            self.resets_pending.pop(name, None)
            self._start_removal(name, old.incarnation(name))
        for name in sorted(set(old.topics) & set(new.topics)):
            if old.incarnation(name) != new.incarnation(name):  # deleted and created again in one step (a
                self.resets_pending.pop(name, None)             # snapshot restore): the old one goes first
                self._start_removal(name, old.incarnation(name))
        for name, defn in sorted(new.topics.items()):
            before = old.topics.get(name)
            if (before is not None and defn.lifecycle_epoch > before.lifecycle_epoch
                    and old.incarnation(name) == new.incarnation(name)):
                self._start_reset(name, self.generation(new, name))
        self._open_missing(new)

    def _open_missing(self, state: MetadataState) -> None:
        for key in sorted(state.partitions_on(self._host.broker_id)):
            if key[0] in self.resets_pending or key[0] in self._removing or key[0] in self.orphans:
                # fenced until its storage holds the committed generation, or until the storage of a
                # deleted topic of that name is gone (a same-name topic must never open the old folder)
                continue
            if key not in self._host.replicas and key not in self._opening:
                failed = self.open_failures.get(key)
                if failed is not None:
                    if failed[0] == self.generation(state, key[0]) and self._clock() < failed[2]:
                        continue  # backing off (or given up: inf)
                task = asyncio.get_running_loop().create_task(self._open(key))
                self._opening[key] = task
                task.add_done_callback(lambda t, k=key: self._opened(k, t))  # type: ignore[misc]

    def _opened(self, key: PartitionKey, task: asyncio.Task[None]) -> None:
        if self._opening.get(key) is task:
            del self._opening[key]
        if task.cancelled():
            return
        error = task.exception()
        if error is None:
            self.open_failures.pop(key, None)
            return
        generation = self.generation(self._state, key[0])
        previous = self.open_failures.get(key)
        attempts = previous[1] + 1 if previous is not None and previous[0] == generation else 1
        if attempts >= self._open_max_attempts:
            self.open_failures[key] = (generation, attempts, math.inf)
            log.error("opening %s/%d failed %d times, giving up (the partition stays unavailable on this broker "
                      "until a restart or a new topic generation): %s", key[0], key[1], attempts, error)
            self.on_open_failed(True)
            return
        backoff = min(self._open_backoff_s * 2 ** (attempts - 1), self._open_backoff_s * 60)
        self.open_failures[key] = (generation, attempts, self._clock() + backoff)
        log.error("opening %s/%d failed (attempt %d of %d, retried in %.1f s): %s", key[0], key[1], attempts,
                  self._open_max_attempts, backoff, error)
        self.on_open_failed(False)
        asyncio.get_running_loop().call_later(backoff, self._retry_opens)

    def _retry_opens(self) -> None:
        if not self._closed:
            self._open_missing(self._state)

    def _prepare_topic_dir(self, name: str, wanted: Generation) -> bool:
        """Blocking (the pool): make ``topics/<name>`` hold ``wanted`` before a partition of it is opened.
        False when the folder holds a newer generation or the same incarnation at an older lifecycle epoch
        (a reset is due): nothing may be opened from it now. Raises OSError, ValueError (a bad marker)."""
        with self._dir_lock(name):
            topic_dir = self._topics_dir / name
            if not topic_dir.exists():
                create_topic_dir(self._topics_dir, name, wanted)
                return True
            found = read_marker(topic_dir)
            if found == wanted:
                return True
            if found[0] < wanted[0]:  # storage of an older incarnation of the name: never served
                log.warning("topic %s: local storage is of an older incarnation (%d < %d); removing it",
                            name, found[0], wanted[0])
                reset_topic_storage(self._topics_dir, self._trash_dir, name, wanted)
                return True
            return False

    async def _open(self, key: PartitionKey) -> None:
        loop = asyncio.get_running_loop()
        generation = self.generation(self._state, key[0])
        if not await loop.run_in_executor(self._pool, self._prepare_topic_dir, key[0], generation):
            return  # a newer state (or the pending reset) opens it
        opened = await loop.run_in_executor(self._pool, self._host.open_partition, *key)
        wanted = self._state.assignment(*key)
        if (wanted is None or self._host.broker_id not in wanted.replicas or key in self._host.replicas
                or self.generation(self._state, key[0]) != generation or key[0] in self.resets_pending):
            await loop.run_in_executor(self._pool, self._host.discard_opened, opened)
            if wanted is not None and self._host.broker_id in wanted.replicas and key not in self._host.replicas:
                loop.call_soon(self._open_missing, self._state)  # the generation moved on meanwhile
            return
        self._host.install_replica(key[0], key[1], opened)

    async def wait_open(self, keys: Iterable[PartitionKey]) -> None:
        """Wait until every key in ``keys`` that is assigned here is open; a partition whose earlier open
        failed is opened again at once (its backoff is skipped). Raises the open's error (CorruptLogError,
        OSError)."""
        keys = list(keys)
        for key in keys:
            failed = self.open_failures.get(key)
            if failed is not None:
                self.open_failures[key] = (failed[0], failed[1], 0.0)
        self._open_missing(self._state)
        tasks = [self._opening[k] for k in keys if k in self._opening]
        if tasks:
            await asyncio.gather(*[asyncio.shield(t) for t in tasks])

    async def start(self, state: MetadataState) -> int:
        """Startup: empty the trash, move away storage of topics ``state`` does not name, find interrupted
        resets, then open every other local partition (bounded parallel). Returns the partitions opened.
        Raises the first open error."""
        self._state = state
        loop = asyncio.get_running_loop()
        known = set(state.topics)
        self.orphans = set(await loop.run_in_executor(self._pool, self._clear_unknown_storage, known))
        self._on_orphans(len(self.orphans))
        generations = {name: self.generation(state, name) for name in state.topics}
        self.resets_pending = await loop.run_in_executor(self._pool, self._find_resets, generations)
        self.on_pending(len(self.resets_pending) + len(self.orphans))
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

    def _find_resets(self, generations: dict[str, Generation]) -> dict[str, Generation]:
        """Startup (blocking, nothing open yet): the topics whose folder is of the committed incarnation but
        an older lifecycle epoch (an interrupted TRUNCATE): they stay fenced until :meth:`resume_resets`
        finishes their reset (after the host dropped their node-local state)."""
        behind: dict[str, Generation] = {}
        for name, wanted in sorted(generations.items()):
            topic_dir = self._topics_dir / name
            try:
                found = read_marker(topic_dir)
            except (OSError, ValueError) as exc:
                log.error("topic %s: unreadable lifecycle epoch marker (%s); its storage is reset", name, exc)
                found = (wanted[0], -1)
            if topic_dir.exists() and found[0] == wanted[0] and found[1] < wanted[1]:
                log.warning("topic %s: local storage is of lifecycle epoch %d, not %d; its reset resumes",
                            name, found[1], wanted[1])
                behind[name] = wanted
        return behind

    async def resume_resets(self) -> bool:
        """Startup, once the host's group coordinator and transactions are open: finish every interrupted
        reset found by :meth:`start` and open those partitions. True when one is still pending."""
        for name, generation in sorted(self.resets_pending.items()):
            if name not in self._resetting:
                self._start_reset(name, generation)
        pending = False
        for name in list(self.resets_pending):
            pending |= await self.reset_done(name)
        return pending

    # ---------------------------------------------------------------------------------------- reset

    def _start_reset(self, name: str, generation: Generation) -> asyncio.Task[bool]:
        self.resets_pending[name] = generation
        replicas = self._host.detach_topic(name)  # fenced from here on
        previous = self._resetting.get(name) or self._removing.get(name)
        task = asyncio.get_running_loop().create_task(self._reset(name, generation, replicas, previous))
        self._resetting[name] = task
        task.add_done_callback(
            lambda t: self._resetting.pop(name, None) if self._resetting.get(name) is t else None)
        return task

    async def _reset(self, name: str, generation: Generation, replicas: list[Any],
                     previous: asyncio.Task[bool] | None) -> bool:
        """Replace the topic's storage by an empty folder of ``generation``, then reopen its partitions.
        Returns True when the reset failed (the topic stays fenced here; :meth:`retry_pending` retries)."""
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
        opening = [t for k, t in self._opening.items() if k[0] == name]
        if opening:
            await asyncio.gather(*opening, return_exceptions=True)
            replicas += self._host.detach_topic(name)
        loop = asyncio.get_running_loop()
        try:
            found = await loop.run_in_executor(self._pool, read_marker, self._topics_dir / name)
        except (OSError, ValueError):
            found = (generation[0], -1)
        done = found >= generation
        if done:
            # The folder already holds this generation or a newer one (a node replaying its Raft log at
            # startup sees every earlier TRUNCATE again; the marker is written last): nothing to drop or
            # reset; the partitions open when the state matches the folder.
            for replica in replicas:
                await self._host.run_blocking(replica.log.close)
        elif await self._host.drop_topic_state(name):
            log.warning("truncated topic %s stays unavailable here until its cleanup is retried", name)
            return True

        def reset() -> None:
            for replica in replicas:
                replica.log.close()
            with self._dir_lock(name):
                reset_topic_storage(self._topics_dir, self._trash_dir, name, generation)

        try:
            if not done:
                await self._host.run_blocking(reset)
        except OSError as exc:
            log.warning("storage reset of truncated topic %s pending: %s", name, exc)
            return True
        if self.resets_pending.get(name) == generation:
            del self.resets_pending[name]
        if self._resetting.get(name) is asyncio.current_task():
            del self._resetting[name]
        self._open_missing(self._state)
        await loop.run_in_executor(self._pool, empty_trash, self._trash_dir)
        return False

    async def reset_done(self, name: str) -> bool:
        """Wait for the storage reset of truncated topic ``name`` and the open of its local partitions; True
        when the reset is still pending (cleanup_pending). Raises a partition open's error."""
        task = self._resetting.get(name)
        if task is not None:
            await asyncio.shield(task)
        if name in self.resets_pending:
            return True
        await self.wait_open(key for key in self._state.partitions_on(self._host.broker_id) if key[0] == name)
        return False

    async def retry_pending(self) -> int:
        """Retry every failed storage reset and orphaned removal; return how many are still pending."""
        for name, generation in sorted(self.resets_pending.items()):
            if name in self._resetting or self.generation(self._state, name) != generation:
                continue
            self.on_retry()
            await self._start_reset(name, generation)
        for name in sorted(self.orphans):
            if name not in self._removing:
                self.on_retry()
                await self._start_removal(name, self._orphan_incarnations.get(name, 0))
        pending = len(self.resets_pending) + len(self.orphans)
        self.on_pending(pending)
        return pending

    # --------------------------------------------------------------------------------------- remove

    def _start_removal(self, name: str, incarnation: int) -> asyncio.Task[bool]:
        replicas = self._host.detach_topic(name)
        previous = self._removing.get(name) or self._resetting.get(name)
        task = asyncio.get_running_loop().create_task(self._remove(name, incarnation, replicas, previous))
        self._removing[name] = task
        task.add_done_callback(lambda t: self._removing.pop(name, None) if self._removing.get(name) is t else None)
        return task

    async def _remove(self, name: str, incarnation: int, replicas: list[Any],
                      previous: asyncio.Task[bool] | None) -> bool:
        """Close the replicas and move the topic folder to the trash (unless it holds a later incarnation of
        the name). Returns True when that failed."""
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
        opening = [t for k, t in self._opening.items() if k[0] == name]
        if opening:  # an open in flight would recreate files under the folder
            await asyncio.gather(*opening, return_exceptions=True)
            replicas += self._host.detach_topic(name)

        def remove() -> None:
            for replica in replicas:
                replica.log.close()
            with self._dir_lock(name):
                try:
                    found = read_marker(self._topics_dir / name)
                except ValueError:
                    found = (0, 0)
                if found[0] > incarnation:
                    log.info("topic %s: storage of a later incarnation (%d) kept", name, found[0])
                    return
                move_to_trash(self._topics_dir, self._trash_dir, name)

        try:
            await self._host.run_blocking(remove)
        except OSError as exc:
            log.warning("storage cleanup of deleted topic %s pending: %s", name, exc)
            self.orphans.add(name)
            self._orphan_incarnations[name] = incarnation
            self._on_orphans(len(self.orphans))
            return True
        self.orphans.discard(name)
        self._orphan_incarnations.pop(name, None)
        self._on_orphans(len(self.orphans))
        if self._removing.get(name) is asyncio.current_task():
            del self._removing[name]
        self._open_missing(self._state)  # a same-name topic created meanwhile (a cluster) opens now
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
        return await self._start_removal(name, self._orphan_incarnations.get(name, 0))

    async def close(self) -> None:
        """Wait for opens, resets and removals in flight, then stop the pool."""
        self._closed = True
        pending = [*self._opening.values(), *self._removing.values(), *self._resetting.values()]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        self._pool.shutdown(wait=True)
