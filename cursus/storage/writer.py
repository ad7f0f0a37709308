"""GroupCommitWriter: the one thread that performs every append and fsync.

The event loop never blocks on disk: it submits appends (and any other storage operation) and gets
:class:`Completion` objects back through ``notify``. Work is done in *rounds*:

1. take everything queued, up to :data:`ROUND_ITEMS_MAX` items or :data:`ROUND_BYTES_MAX` bytes;
2. apply the items in submission order (appends per log in order; calls run where they were queued);
3. tell ``on_written`` which logs received appends (written, not yet fsynced: a partition leader may
   serve those bytes to its followers while it fsyncs, as Kafka serves the page cache), then ``flush()``
   each of them once: many appends from many producers share one fsync;
4. call ``notify`` once with every completion of the round;
5. checkpoint touched logs at most every ``recovery_point_interval_ms`` (also when idle, and at close).

Failure rule: if an append or fsync raises ``OSError`` the log fences itself (any other exception, a bug,
fences it too: the outcome is unknown, and no waiter may hang or be told its data is durable); that log's items of the round
and every later item for it complete with :class:`StorageFencedError`. A failed fsync is never retried
(Linux may drop dirty pages after reporting the error; a retry could falsely succeed). Other logs are
unaffected.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from cursus.storage.chunk import Buffer, buffer_size_bytes
from cursus.storage.errors import StorageFencedError
from cursus.storage.log import PartitionLog

logger = logging.getLogger("cursus.storage")

#: Items per round: bounds the notify batch and the latency added to the first item of a round.
ROUND_ITEMS_MAX = 10_000
#: Bytes per round (a larger single item still forms a round alone).
ROUND_BYTES_MAX = 64 * 1024 * 1024

_APPEND = 0
_CALL = 1


@dataclass(slots=True)
class Completion:
    """The outcome of one submitted item.

    Attributes:
        token: the caller's token, as submitted.
        log: the log appended to (or named by ``submit_call``), else ``None``.
        durable_end_offset: the log's durable end offset after the round's fsync (-1 without a log). For a
            successful append it covers the appended chunk.
        error: ``None`` on success; :class:`StorageFencedError` when the log is fenced; the exception a call
            raised; an ``AssertionError`` for a programmer error (e.g. an append at the wrong offset).
        result: what a call returned.
    """

    token: object
    log: PartitionLog | None
    durable_end_offset: int
    error: BaseException | None
    result: object = None


class GroupCommitWriter:
    """One daemon thread that performs every append and fsync, so the event loop never blocks on disk.
    Many appends from many partitions share one fsync per touched log per round.

    Thread-safety: ``submit_*`` may be called from any thread; ``notify`` is called on the writer thread
    (wrap it in ``loop.call_soon_threadsafe``). The logs given to the writer must not be appended to,
    flushed, truncated or closed by anyone else while the writer runs.
    """

    def __init__(self, notify: Callable[[list[Completion]], None], *, name: str = "cursus-writer",
                 on_written: Callable[[list[object]], None] | None = None) -> None:
        self._notify = notify
        #: Called on the writer thread before the round's fsyncs: for every log with written appends, the
        #: token of its first one (the broker's tokens are replicas).
        self._on_written = on_written
        self._name = name
        self._condition = threading.Condition()
        self._queue: deque[tuple] = deque()
        self._queued_bytes = 0
        self._closing = False
        self._thread: threading.Thread | None = None
        #: Monotonic time of the writer's last checkpoint per log, and logs waiting for one (-> due time).
        self._checkpointed_at_s: dict[PartitionLog, float] = {}
        self._checkpoint_due_s: dict[PartitionLog, float] = {}
        #: Statistics (writer thread writes, anyone reads): rounds run, log flushes performed.
        self.rounds = 0
        self.flushes = 0

    # ------------------------------------------------------------------------------------- control

    def start(self) -> None:
        """Start the writer thread (once)."""
        assert self._thread is None, "writer already started"
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def close(self, timeout: float | None = None) -> None:
        """Drain everything queued (appended, flushed, notified), run due checkpoints, stop the thread.

        Without :meth:`start` the queue is drained on the calling thread. Idempotent.
        """
        with self._condition:
            self._closing = True
            self._condition.notify()
        if self._thread is None:
            self._run()
        else:
            self._thread.join(timeout)

    @property
    def queued_bytes(self) -> int:
        """Bytes of append bodies queued and not yet taken by a round (for back-pressure)."""
        return self._queued_bytes

    @property
    def queued_items(self) -> int:
        """Items queued and not yet taken by a round."""
        return len(self._queue)

    # ------------------------------------------------------------------------------------- submit

    def submit_append(self, log: PartitionLog, base_offset: int, record_count: int, body: Buffer,
                      token: object, *, leader_epoch: int | None = None,
                      append_time_ms: int | None = None) -> None:
        """Queue ``log.append_chunk(base_offset, record_count, body, append_time_ms, leader_epoch=...)``;
        its completion comes after the fsync. Non-blocking. The caller must not modify ``body`` afterwards.

        Raises:
            RuntimeError: the writer is closing.
        """
        size_bytes = buffer_size_bytes(body)
        with self._condition:
            if self._closing:
                raise RuntimeError("storage writer is closed")
            was_empty = not self._queue
            self._queue.append((_APPEND, log, base_offset, record_count, body, token, size_bytes, leader_epoch,
                                append_time_ms))
            self._queued_bytes += size_bytes
            if was_empty:
                self._condition.notify()

    def submit_call(self, fn: Callable[[], object], token: object, *, log: PartitionLog | None = None) -> None:
        """Queue ``fn()`` to run on the writer thread in order with appends (retention, truncation,
        checkpoints, manifest writes). The completion carries the result or the exception; pass ``log`` to
        get its durable end offset in the completion.

        Raises:
            RuntimeError: the writer is closing.
        """
        with self._condition:
            if self._closing:
                raise RuntimeError("storage writer is closed")
            was_empty = not self._queue
            self._queue.append((_CALL, log, fn, token))
            if was_empty:
                self._condition.notify()

    # --------------------------------------------------------------------------------- the thread

    def _run(self) -> None:
        while True:
            batch, stop = self._take_round()
            if batch:
                self._run_round(batch)
            self._run_due_checkpoints(force=stop)
            if stop:
                return

    def _take_round(self) -> tuple[list[tuple], bool]:
        with self._condition:
            while not self._queue and not self._closing:
                wait_s = self._checkpoint_wait_s()
                if wait_s is not None and wait_s <= 0:
                    break
                self._condition.wait(wait_s)
            batch: list[tuple] = []
            size_bytes = 0
            while self._queue and len(batch) < ROUND_ITEMS_MAX and (size_bytes < ROUND_BYTES_MAX or not batch):
                item = self._queue.popleft()
                batch.append(item)
                if item[0] == _APPEND:
                    size_bytes += item[6]
            self._queued_bytes -= size_bytes
            return batch, self._closing and not self._queue

    def _run_round(self, batch: list[tuple]) -> None:
        try:
            completions = self._apply_round(batch)
        except Exception as error:  # a bug: never leave a waiter hanging
            logger.exception("storage writer round failed")
            completions = [Completion(item[5] if item[0] == _APPEND else item[3], item[1], -1, error)
                           for item in batch]
        self.rounds += 1
        try:
            self._notify(completions)
        except Exception:
            logger.exception("storage writer notify callback failed")

    def _apply_round(self, batch: list[tuple]) -> list[Completion]:
        completions: list[Completion] = []
        pending: dict[PartitionLog, list[tuple]] = {}
        appended: dict[PartitionLog, list[Completion]] = {}
        for item in batch:
            if item[0] == _APPEND:
                log, token = item[1], item[5]
                completion = Completion(token, log, -1, None)
                completions.append(completion)
                pending.setdefault(log, []).append((item, completion))
            else:
                self._apply_appends(pending, appended)  # a call sees every append queued before it
                pending.clear()
                _, log, fn, token = item
                completion = Completion(token, log, -1, None)
                completions.append(completion)
                try:
                    completion.result = fn()
                except Exception as error:
                    completion.error = error
        self._apply_appends(pending, appended)
        if self._on_written is not None and appended:
            try:
                self._on_written([done[0].token for done in appended.values() if done])
            except Exception:
                logger.exception("storage writer on_written callback failed")
        for log, log_completions in appended.items():
            self._flush(log)
            failed = log.failed
            for completion in log_completions:
                if failed is not None:
                    completion.error = StorageFencedError(failed)
            if failed is None and log not in self._checkpoint_due_s:
                interval_s = log.config.recovery_point_interval_ms / 1000.0
                self._checkpoint_due_s[log] = self._checkpointed_at_s.get(log, float("-inf")) + interval_s
        for completion in completions:
            if completion.log is not None:
                completion.durable_end_offset = completion.log.durable_end_offset
        return completions

    @staticmethod
    def _apply_appends(pending: dict[PartitionLog, list[tuple]],
                       appended: dict[PartitionLog, list[Completion]]) -> None:
        """Append each log's queued chunks with one batched call (in submission order)."""
        for log, entries in pending.items():
            if log.failed is not None:
                for _, completion in entries:
                    completion.error = StorageFencedError(log.failed)
                continue
            try:
                errors = log.append_chunks([(item[2], item[3], item[4], item[7], item[8]) for item, _ in entries])
            except OSError as error:
                for _, completion in entries:
                    completion.error = StorageFencedError(error)
                continue
            except StorageFencedError as error:
                for _, completion in entries:
                    completion.error = error
                continue
            except Exception as error:  # a bug: the outcome of these appends is unknown, so fence the log
                logger.exception("append to %s failed unexpectedly", log.directory)
                log.fence(error)
                for _, completion in entries:
                    completion.error = StorageFencedError(error)
                continue
            accepted = appended.setdefault(log, [])
            for (_, completion), rejection in zip(entries, errors, strict=True):
                if rejection is None:
                    accepted.append(completion)
                else:
                    completion.error = rejection

    def _flush(self, log: PartitionLog) -> None:
        """fsync ``log``; on any error the log ends up fenced, so its completions report a typed error."""
        if log.failed is not None:
            return
        try:
            log.flush()
            self.flushes += 1
        except (OSError, StorageFencedError):
            pass  # the log fenced itself; its completions report it
        except Exception as error:  # a bug: whether the data is durable is unknown, so fence the log
            logger.exception("flush of %s failed unexpectedly", log.directory)
            log.fence(error)

    # ----------------------------------------------------------------------------------- checkpoints

    def _checkpoint_wait_s(self) -> float | None:
        """Seconds until the earliest due checkpoint (None when none is pending). Condition held."""
        if not self._checkpoint_due_s:
            return None
        return min(self._checkpoint_due_s.values()) - time.monotonic()

    def _run_due_checkpoints(self, *, force: bool) -> None:
        if not self._checkpoint_due_s:
            return
        now_s = time.monotonic()
        for log, due_s in list(self._checkpoint_due_s.items()):
            if due_s > now_s and not force:
                continue
            del self._checkpoint_due_s[log]
            if log.is_closed:
                self._checkpointed_at_s.pop(log, None)  # forget logs the broker closed (deleted topics)
                continue
            self._checkpointed_at_s[log] = now_s
            if log.failed is not None:
                continue
            try:
                log.checkpoint()
            except Exception:
                logger.exception("checkpoint of %s failed", log.directory)
