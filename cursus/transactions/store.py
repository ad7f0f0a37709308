"""Where the transaction coordinator persists its transitions: the one seam between standalone and cluster.

The coordinator (:mod:`cursus.transactions.coordinator`) is the same in both modes; only its
:class:`TxnStore` differs:

* :class:`JournalStore` (standalone): ``{log_dir}/__transaction_state.journal``; :meth:`~TxnStore.persist`
  returns once the record is written and fsynced (transitions of different ids submitted meanwhile share
  one write and one fsync);
* :class:`RaftTxnStore` (cluster): one :class:`~cursus.metadata.commands.TxnSync` metadata command per
  transition; :meth:`~TxnStore.persist` returns once it is committed through Raft and applied here. The FSM
  accepts it only from the shard's owner at the shard's epoch, so a previous owner can never persist.

Either way a failure raises and nothing of that transition is published; an unknown outcome (a Raft commit
timeout) is ``transaction_sync_failed outcome=unknown``, never success.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from cursus.transactions.journal import TxnJournal
from cursus.transactions.state import TopicPartition, TxnEntry, largest_form
from cursus.wire.errors import BrokerError

log = logging.getLogger("cursus.transactions")

#: Refusals of the metadata FSM's group fence (a commit's staged offsets), answered as they are.
FENCE_CODES = frozenset({"group_not_found", "GEN_MISMATCH", "member_not_found", "NOT_OWNER"})
#: Headroom below the Raft command limit a TxnSync keeps (the origin's id length, encoding drift).
_COMMAND_SLACK_BYTES = 256
#: ``run_blocking(fn) -> awaitable``: the broker's worker thread.
RunBlocking = Callable[[Callable[[], Any]], Awaitable[Any]]


class TxnStore(Protocol):
    """The coordinator's durable store (see the module docstring)."""

    def new_producer_id(self, transactional_id: str) -> tuple[str, int]:
        """A fresh producer id for ``transactional_id`` and the counter value to persist with it."""
        ...

    def coordinator_epoch(self, transactional_id: str) -> int:
        """The coordinator epoch markers of ``transactional_id`` carry (0 standalone, the shard epoch)."""
        ...

    def touched(self) -> set[TopicPartition]:
        """Every partition that ever took a transactional record."""
        ...

    async def persist(self, entry: TxnEntry, *, touched: list[TopicPartition], next_producer_id: int | None,
                      expect: tuple[str, int] | None = None) -> None:
        """Durably store ``entry`` (and the partitions it newly touches, the producer-id counter).

        ``expect`` = (producerId, epoch): store only while the id's stored session is exactly that one (the
        guard of INIT_PRODUCER_ID ``producerId= epoch=``). The journal has a single writer that checked it
        under the id's lock; the Raft store lets the FSM check it again in log order.

        Raises:
            BrokerError: ``transaction_sync_failed`` (retryable; ``outcome=unknown`` when it may have been
                stored), ``transaction_manager_not_available`` (closed), ``NOT_COORDINATOR`` (cluster: this
                broker no longer owns the shard), ``producer_fenced`` (``expect`` no longer holds).
        """
        ...

    def check_fits(self, entry: TxnEntry, *, touched: list[TopicPartition]) -> None:
        """Raise ``transaction_too_large`` unless ``entry`` (about to be persisted with ``touched``) and
        every later form of it (:func:`state.largest_form`) stay within this store's limit, so a
        transition that grows a transaction is refused up front and a later prepare, decision or abort
        can never fail for its size."""
        ...

    async def close(self) -> None:
        """Wait for writes in flight and release the store (idempotent)."""
        ...


def _too_large(entry: TxnEntry, size: int, limit: int) -> BrokerError:
    return BrokerError.of("transaction_too_large", transactional_id=entry.transactional_id, size=size, limit=limit,
                          partitions=len(entry.partitions), offsets=len(entry.offsets),
                          reason="the transaction's coordinator state would exceed its limit; commit or abort it"
                                 " and spread the work over smaller transactions")


def _state_bytes(entry: TxnEntry) -> int:
    return len(json.dumps(largest_form(entry).to_json(), separators=(",", ":")).encode())


class JournalStore:
    """:class:`TxnStore` over the fsynced standalone journal. Create with :meth:`open`."""

    def __init__(self, journal: TxnJournal, run_blocking: RunBlocking, *, max_state_bytes: int = 60 * 1024) -> None:
        self.journal: TxnJournal | None = journal
        #: ``transaction_state_max_bytes`` (the journal's own record limit is far larger)
        self.max_state_bytes = max_state_bytes
        self._run_blocking = run_blocking
        self._lock = asyncio.Lock()
        self._pending: list[tuple[list[dict[str, Any]], asyncio.Future[None]]] = []
        self._flusher: asyncio.Future[None] | None = None
        self._reserved = journal.state.next_producer_id

    @classmethod
    async def open(cls, log_dir: Path, run_blocking: RunBlocking, *, compact_min_superseded: int,
                   max_state_bytes: int = 60 * 1024) -> JournalStore:
        """Replay the journal (off the loop). Raises JournalCorruptError / OSError (startup must stop)."""
        journal = await run_blocking(lambda: TxnJournal.open(log_dir, compact_min_superseded=compact_min_superseded))
        return cls(journal, run_blocking, max_state_bytes=max_state_bytes)

    def check_fits(self, entry: TxnEntry, *, touched: list[TopicPartition]) -> None:
        size = _state_bytes(entry)
        if size > self.max_state_bytes:
            raise _too_large(entry, size, self.max_state_bytes)

    def new_producer_id(self, transactional_id: str) -> tuple[str, int]:
        journal = self._require()
        pid = max(self._reserved, journal.state.next_producer_id)
        self._reserved = pid + 1
        return str(pid), pid + 1

    def coordinator_epoch(self, transactional_id: str) -> int:
        return 0

    def touched(self) -> set[TopicPartition]:
        return set(self._require().state.touched)

    def _require(self) -> TxnJournal:
        if self.journal is None:
            raise BrokerError.of("transaction_manager_not_available", reason="coordinator closed")
        return self.journal

    async def persist(self, entry: TxnEntry, *, touched: list[TopicPartition], next_producer_id: int | None,
                      expect: tuple[str, int] | None = None) -> None:
        journal = self._require()
        if next_producer_id is not None:
            journal.state.next_producer_id = max(journal.state.next_producer_id, next_producer_id)
        records: list[dict[str, Any]] = []
        new = [tp for tp in touched if tp not in journal.state.touched]
        if new:
            records.append({"kind": "touched", "partitions": [list(tp) for tp in new]})
        records.append({"kind": "entry", "entry": entry.to_json()})
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((records, done))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush())
        try:
            await done
        except OSError as exc:
            log.error("transaction journal write failed: %s", exc)
            raise BrokerError.of("transaction_sync_failed", transactional_id=entry.transactional_id,
                                 reason=str(exc)) from None

    async def _flush(self) -> None:
        """Write everything queued, one append (one fsync) per round, until the queue is empty."""
        async with self._lock:
            while self._pending:
                batch, self._pending = self._pending, []
                journal = self.journal
                records = [r for recs, _ in batch for r in recs]
                error: BaseException | None = None
                if journal is None:
                    error = BrokerError.of("transaction_manager_not_available", reason="coordinator closed")
                else:
                    try:
                        await self._run_blocking(functools.partial(journal.append, records))
                    except Exception as exc:
                        error = exc
                for _, done in batch:
                    if done.done():
                        continue
                    if error is None:
                        done.set_result(None)
                    else:
                        done.set_exception(error)

    async def close(self) -> None:
        async with self._lock:
            if self.journal is not None:
                journal, self.journal = self.journal, None
                await self._run_blocking(journal.close)


class RaftTxnStore:
    """:class:`TxnStore` over the metadata log (one ``TxnSync`` per transition).

    Args:
        broker_id: this broker (the commands' ``origin``).
        submit: commits a metadata command and returns once it is applied here (``Metadata.submit``).
        state: the latest applied metadata state.
        address_of: a broker id's client address ``host:port`` ("" when unknown).
    """

    def __init__(self, broker_id: str, submit: Callable[[Any], Awaitable[Any]], state: Callable[[], Any],
                 address_of: Callable[[str | None], str], *, max_state_bytes: int = 60 * 1024) -> None:
        self.broker_id = broker_id
        #: ``transaction_state_max_bytes``; the TxnSync carrying the state must also fit a Raft command
        self.max_state_bytes = max_state_bytes
        self._submit = submit
        self._state = state
        self._address_of = address_of
        #: request ids of TxnSync commands this broker is waiting for (observers skip them)
        self.pending: set[str] = set()
        self._reserved: dict[int, int] = {}
        self._closed = False

    def _shard(self, transactional_id: str) -> int:
        from cursus.metadata.state import transaction_shard

        shards = self._state().coordinator_shards
        if not shards:
            raise BrokerError.of("coordinator_not_available", coordinator_type="transaction",
                                 reason="the cluster has no coordinator shards yet")
        return transaction_shard(transactional_id, shards)

    def new_producer_id(self, transactional_id: str) -> tuple[str, int]:
        state = self._state()
        shard = self._shard(transactional_id)
        applied = state.txn.get(shard)
        counter = max(self._reserved.get(shard, 1), applied.next_producer_id if applied is not None else 1)
        self._reserved[shard] = counter + 1
        return str(counter * state.coordinator_shards + shard), counter + 1

    def coordinator_epoch(self, transactional_id: str) -> int:
        owner = self._state().txn_shards.get(self._shard(transactional_id))
        return owner.epoch if owner is not None else 0

    def touched(self) -> set[TopicPartition]:
        return set(self._state().txn_touched)

    def check_fits(self, entry: TxnEntry, *, touched: list[TopicPartition]) -> None:
        from cursus.cluster.raft.commands import MAX_COMMAND_BYTES
        from cursus.metadata.commands import TxnSync, encode

        size = _state_bytes(entry)
        if size > self.max_state_bytes:
            raise _too_large(entry, size, self.max_state_bytes)
        # the largest TxnSync that will ever carry it: this one's touched partitions, a guarded init's
        # expect, the longest ids (request ids are 32 hex digits, counters below 2**63)
        state = self._state()
        shard = self._shard(entry.transactional_id)
        owner = state.txn_shards.get(shard)
        probe = TxnSync("f" * 32, self.broker_id, shard, 2**62 if owner is None else max(owner.epoch, 2**62),
                        (largest_form(entry),), 2**62, tuple(sorted(touched)), (entry.producer_id, 2**31))
        command_size = len(encode(probe))
        if command_size > MAX_COMMAND_BYTES - _COMMAND_SLACK_BYTES:
            raise _too_large(entry, command_size, MAX_COMMAND_BYTES - _COMMAND_SLACK_BYTES)

    async def persist(self, entry: TxnEntry, *, touched: list[TopicPartition], next_producer_id: int | None,
                      expect: tuple[str, int] | None = None) -> None:
        from cursus.metadata.commands import TxnSync

        if self._closed:
            raise BrokerError.of("transaction_manager_not_available", reason="coordinator closed")
        state = self._state()
        tid = entry.transactional_id
        shard = self._shard(tid)
        owner = state.txn_shards.get(shard)
        if owner is None or owner.owner != self.broker_id:
            raise self._not_coordinator(owner.owner if owner is not None else None)
        applied = state.txn.get(shard)
        counter = max(next_producer_id or 1, applied.next_producer_id if applied is not None else 1)
        new_touched = tuple(sorted(tp for tp in touched if tp not in state.txn_touched))
        command = TxnSync(uuid.uuid4().hex, self.broker_id, shard, owner.epoch, (entry,), counter, new_touched,
                          expect)
        self.pending.add(command.request_id)
        try:
            await self._submit(command)
        except BrokerError as exc:
            code = exc.error.code
            if code == "NOT_COORDINATOR":
                raise self._not_coordinator(exc.error.fields.get("owner")) from None
            if code in FENCE_CODES or code == "producer_fenced":  # the FSM's fences: nothing stored
                raise
            unknown = exc.error.fields.get("outcome") == "unknown"
            log.warning("transactions: TxnSync for %s failed: %s%s", tid, code, " (outcome unknown)" if unknown else "")
            raise BrokerError.of("transaction_sync_failed", transactional_id=tid, reason=code,
                                 outcome="unknown" if unknown else "not_applied") from None
        finally:
            self.pending.discard(command.request_id)

    def _not_coordinator(self, owner: str | None) -> BrokerError:
        host, _, port = self._address_of(owner).rpartition(":")
        if not host:
            return BrokerError.of("coordinator_not_available", coordinator_type="transaction",
                                  reason="no broker owns this transactional id's shard right now; retry")
        return BrokerError.of("NOT_COORDINATOR", host=host, port=port)

    async def close(self) -> None:
        self._closed = True
