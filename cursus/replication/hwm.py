"""Committing leader HWMs: :class:`HwmCommitter` (cluster, through the metadata log) and
:class:`LocalHwmCommitter` (standalone, at once).

A leader replica's *candidate* HWM (min durable end over its maximal ISR) becomes visible only once it is
committed: in a cluster as a :class:`~cursus.metadata.commands.CommitHwm` command through Raft, whose
applied assignment (``committed_hwm``) reaches the replica through the broker's metadata listener
(:meth:`cursus.broker.replica.Replica.on_committed_hwm`). The committer keeps at most ``max_in_flight``
commands in flight (pipelined: a candidate that moves while one command is being committed goes out at
once in the next, instead of waiting a whole Raft round) and coalesces every candidate change that arrives
while all are busy into the next one (group commit, no timer; the latest candidate of a partition wins).
Commands racing each other stay safe: ``apply`` moves a committed HWM only upward, so one that lands after
a later one is skipped (``hwm_not_above_committed``) and the committed HWM stays monotonic. A failed or unknown-outcome submit is retried after a backoff with
the then-current candidates: CommitHwm is idempotent by HWM monotonicity, so a duplicate is harmless.

Loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Protocol

from cursus.metadata.apply import ApplyResult
from cursus.metadata.commands import CommitHwm, HwmEntry

log = logging.getLogger("cursus.replication.hwm")

#: Entries' estimated encoded bytes per command, well under the Raft command limit (64 KiB).
MAX_COMMAND_BYTES = 48 * 1024
_ENTRY_OVERHEAD = 48  # brackets, quotes, commas and four integers


class LeaderReplica(Protocol):
    """What a committer needs of a replica (:class:`cursus.broker.replica.Replica`)."""

    topic: str
    partition: int
    leader_epoch: int
    lifecycle_epoch: int
    hwm: int
    on_candidate_hwm: Callable[..., None] | None

    @property
    def candidate_hwm(self) -> int: ...

    @property
    def writable(self) -> bool: ...

    def on_committed_hwm(self, leader_epoch: int, hwm: int) -> None: ...


Submit = Callable[[CommitHwm], Awaitable[ApplyResult]]


class LocalHwmCommitter:
    """Standalone: a leader's candidate HWM is committed (made visible) at once."""

    def attach(self, replica: LeaderReplica) -> None:
        """Commit ``replica``'s candidate HWM whenever it moves."""
        replica.on_candidate_hwm = self._commit

    def detach(self, replica: LeaderReplica) -> None:
        """Stop committing for ``replica`` (deleted or closed)."""
        replica.on_candidate_hwm = None

    @staticmethod
    def _commit(replica: LeaderReplica) -> None:
        replica.on_committed_hwm(replica.leader_epoch, replica.candidate_hwm)

    async def close(self) -> None:
        return None


class HwmCommitter:
    """Cluster: commits candidate HWMs of local leader replicas through ``submit`` (the metadata backend's
    :meth:`~cursus.metadata.backend.Metadata.submit`).

    Args:
        broker_id: this broker (the commands' ``broker_id``: only a partition's leader may commit).
        submit: commits one command, returns its :class:`ApplyResult`; raises on rejection or an unknown
            outcome (both retried).
        retry_backoff_s: wait after a failed submit before the next one (seconds).
        max_command_bytes: bound on one command's estimated size; more entries go into the next command.
        max_in_flight: commands submitted concurrently (``replica_hwm_commits_in_flight``; at least 1).
    """

    def __init__(self, broker_id: str, submit: Submit, *, retry_backoff_s: float = 0.1,
                 max_command_bytes: int = MAX_COMMAND_BYTES, max_in_flight: int = 1) -> None:
        assert max_in_flight >= 1, max_in_flight
        self.broker_id = broker_id
        self._submit = submit
        self.retry_backoff_s = retry_backoff_s
        self.max_command_bytes = max_command_bytes
        self.max_in_flight = max_in_flight
        #: Replicas whose candidate moved since they were last put in a command, in arrival order.
        self._dirty: dict[tuple[str, int], LeaderReplica] = {}
        self._attached: dict[tuple[str, int], LeaderReplica] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        #: Counters for tests and metrics: commands submitted, failed submits, entries rejected by the FSM.
        self.commands_submitted = 0
        self.submit_failures = 0
        self.entries_rejected = 0

    def attach(self, replica: LeaderReplica) -> None:
        """Commit ``replica``'s candidate HWM whenever it moves (while it leads)."""
        self._attached[(replica.topic, replica.partition)] = replica
        replica.on_candidate_hwm = self.on_candidate

    def detach(self, replica: LeaderReplica) -> None:
        """Forget ``replica`` (deleted or closed); a command in flight for it completes harmlessly."""
        key = (replica.topic, replica.partition)
        if self._attached.get(key) is replica:
            del self._attached[key]
        if self._dirty.get(key) is replica:
            del self._dirty[key]
        replica.on_candidate_hwm = None

    @property
    def in_flight(self) -> bool:
        """True while a command is being submitted (or the committer waits to retry)."""
        return any(not task.done() for task in self._tasks)

    def on_candidate(self, replica: LeaderReplica) -> None:
        """The hook a replica calls when its candidate HWM moved: queue it, start a submitter if fewer than
        ``max_in_flight`` run."""
        if self._closed:
            return
        self._dirty[(replica.topic, replica.partition)] = replica
        if len(self._tasks) < self.max_in_flight:
            task = asyncio.ensure_future(self._run())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _take_batch(self) -> list[tuple[LeaderReplica, HwmEntry]]:
        batch: list[tuple[LeaderReplica, HwmEntry]] = []
        size = 0
        for key in list(self._dirty):
            replica = self._dirty[key]
            entry_size = len(key[0].encode()) + _ENTRY_OVERHEAD
            if batch and size + entry_size > self.max_command_bytes:
                break
            del self._dirty[key]
            candidate = replica.candidate_hwm
            if not replica.writable or candidate <= replica.hwm:
                continue  # no longer leading, or nothing new to commit
            batch.append((replica, HwmEntry(replica.topic, replica.partition, replica.leader_epoch,
                                            replica.lifecycle_epoch, candidate)))
            size += entry_size
        return batch

    async def _run(self) -> None:
        while self._dirty and not self._closed:
            batch = self._take_batch()
            if not batch:
                continue
            command = CommitHwm(uuid.uuid4().hex, self.broker_id, tuple(entry for _, entry in batch))
            self.commands_submitted += 1
            try:
                result = await self._submit(command)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # rejected, no Raft leader, unknown outcome: retry the latest values
                self.submit_failures += 1
                log.info("CommitHwm of %d partitions failed, retrying: %s", len(batch), exc)
                for replica, _ in batch:
                    self._dirty.setdefault((replica.topic, replica.partition), replica)
                await asyncio.sleep(self.retry_backoff_s)
                continue
            if result.hwm_rejected:
                self.entries_rejected += len(result.hwm_rejected)
                log.debug("CommitHwm entries skipped: %s", result.hwm_rejected)

    async def close(self) -> None:
        """Stop submitting; a command in flight is abandoned (its outcome is harmless either way)."""
        self._closed = True
        tasks, self._tasks = list(self._tasks), set()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for replica in self._attached.values():
            replica.on_candidate_hwm = None
        self._attached.clear()
        self._dirty.clear()
