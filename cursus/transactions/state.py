"""The transaction coordinator's state machine: pure, deterministic, time passed in (no I/O).

One :class:`TxnEntry` per transactional id. Every transition is a function ``(entry, ...) -> entry`` that
either returns the next value (to be journaled, then published) or raises the spec's typed error; it never
mutates its input. States (spec "TXN_STATUS")::

    empty --BEGIN_TXN--> open --END_TXN commit--> prepare_commit --markers+decision--> committed
                          |  \\--END_TXN abort / timeout / re-init--> prepare_abort --markers--> aborted
    committed | aborted --INIT_PRODUCER_ID--> empty (epoch + 1)

``empty`` means "initialized epoch, no transaction begun yet". One epoch runs at most one transaction:
after ``committed`` or ``aborted`` BEGIN_TXN with that epoch answers ``producer_reinitialization_required``;
END_TXN retried with the same result and epoch is idempotent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from cursus.wire.errors import BrokerError

EMPTY = "empty"
OPEN = "open"
PREPARE_COMMIT = "prepare_commit"
PREPARE_ABORT = "prepare_abort"
COMMITTED = "committed"
ABORTED = "aborted"
STATES = (EMPTY, OPEN, PREPARE_COMMIT, PREPARE_ABORT, COMMITTED, ABORTED)
PREPARED = (PREPARE_COMMIT, PREPARE_ABORT)
TERMINAL = (COMMITTED, ABORTED)
FIRST_EPOCH = 1

#: (topic, partition)
TopicPartition = tuple[str, int]


@dataclass(frozen=True, slots=True)
class TxnEntry:
    """The coordinator's durable view of one transactional id.

    Attributes:
        transactional_id: the client's id.
        producer_id: the broker-managed producer id (decimal text, stable across epochs).
        epoch: the current producer epoch (>= 1); older epochs are fenced.
        state: one of :data:`STATES`.
        partitions: the output partitions registered as participants, sorted.
        messages: TXN_PUBLISH records appended in this transaction.
        group, member, generation: the consumer-group session of the staged offsets (None without offsets).
        offsets: staged offsets ``(topic, partition, next_offset)``, sorted.
        deadline_ms: wall-clock ms after which an open transaction is aborted (0 when not open).
        updated_ms: wall-clock ms of the last transition.
        reinit_from: the epoch a guarded INIT_PRODUCER_ID bumped to this one (0: a plain init, or a later
            transition), so a retry of that init whose reply was lost is recognised (:func:`guarded_retry`).
    """

    transactional_id: str
    producer_id: str
    epoch: int
    state: str = EMPTY
    partitions: tuple[TopicPartition, ...] = ()
    messages: int = 0
    group: str | None = None
    member: str | None = None
    generation: int | None = None
    offsets: tuple[tuple[str, int, int], ...] = ()
    deadline_ms: int = 0
    updated_ms: int = 0
    reinit_from: int = 0

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (the journal record's ``entry``; ``reinit_from`` only when set, so entries
        without it keep their old encoding)."""
        doc = {"transactional_id": self.transactional_id, "producer_id": self.producer_id, "epoch": self.epoch,
               "state": self.state, "partitions": [list(tp) for tp in self.partitions], "messages": self.messages,
               "group": self.group, "member": self.member, "generation": self.generation,
               "offsets": [list(o) for o in self.offsets], "deadline_ms": self.deadline_ms,
               "updated_ms": self.updated_ms}
        if self.reinit_from:
            doc["reinit_from"] = self.reinit_from
        return doc

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TxnEntry:
        """Inverse of :meth:`to_json`. Raises ValueError/KeyError/TypeError on a malformed dict."""
        state = data["state"]
        if state not in STATES:
            raise ValueError(f"unknown transaction state {state!r}")
        epoch = int(data["epoch"])
        if epoch < FIRST_EPOCH:
            raise ValueError(f"bad epoch {epoch}")
        return cls(
            transactional_id=str(data["transactional_id"]), producer_id=str(data["producer_id"]), epoch=epoch,
            state=state, partitions=tuple((str(t), int(p)) for t, p in data["partitions"]),
            messages=int(data["messages"]), group=data["group"], member=data["member"],
            generation=None if data["generation"] is None else int(data["generation"]),
            offsets=tuple((str(t), int(p), int(o)) for t, p, o in data["offsets"]),
            deadline_ms=int(data["deadline_ms"]), updated_ms=int(data["updated_ms"]),
            reinit_from=int(data.get("reinit_from", 0)))

    @property
    def offset_partitions(self) -> tuple[TopicPartition, ...]:
        """The partitions of the staged offsets."""
        return tuple(sorted({(t, p) for t, p, _ in self.offsets}))

    def staged_offsets_by_topic(self) -> dict[str, dict[int, int]]:
        """Staged offsets grouped by topic: ``{topic: {partition: next_offset}}``."""
        out: dict[str, dict[int, int]] = {}
        for topic, partition, offset in self.offsets:
            out.setdefault(topic, {})[partition] = offset
        return out


# --------------------------------------------------------------------------------------------- fencing


def _fenced(entry: TxnEntry, producer_id: str, epoch: int) -> None:
    """Raise unless ``(producer_id, epoch)`` is ``entry``'s current session.

    Raises:
        BrokerError: ``producer_fenced`` (another producer id, or an older epoch: a zombie),
            ``invalid_epoch`` (an epoch this coordinator never handed out).
    """
    if producer_id != entry.producer_id:
        raise BrokerError.of("producer_fenced", transactional_id=entry.transactional_id, producer=producer_id,
                             current_producer=entry.producer_id, reason="producer id does not own the transactional id")
    if epoch < entry.epoch:
        raise BrokerError.of("producer_fenced", transactional_id=entry.transactional_id, producer=producer_id,
                             current=entry.epoch, got=epoch)
    if epoch > entry.epoch:
        raise BrokerError.of("invalid_epoch", transactional_id=entry.transactional_id, current=entry.epoch,
                             got=epoch, reason="epoch was never initialized")


def _require(entry: TxnEntry | None, transactional_id: str) -> TxnEntry:
    if entry is None:
        raise BrokerError.of("transaction_not_found", transactional_id=transactional_id,
                             reason="call INIT_PRODUCER_ID first")
    return entry


def _require_open(entry: TxnEntry) -> None:
    if entry.state != OPEN:
        raise BrokerError.of("transaction_not_open", transactional_id=entry.transactional_id, state=entry.state,
                             epoch=entry.epoch)


# ------------------------------------------------------------------------------------------ transitions


def needs_abort_before_init(entry: TxnEntry | None) -> bool:
    """INIT_PRODUCER_ID on an open transaction must first abort it (markers) under the old epoch."""
    return entry is not None and entry.state in (OPEN, PREPARE_ABORT)


def check_guarded_init(entry: TxnEntry | None, transactional_id: str, producer_id: str, epoch: int) -> TxnEntry:
    """The guard of INIT_PRODUCER_ID ``producerId=<P> epoch=<E>`` (KIP-360 style): the caller names the
    session it last held, and only the id's latest owner may bump it. Nothing changes when it fails.

    Returns the entry (the caller then re-initializes as a plain INIT_PRODUCER_ID does).

    Raises:
        BrokerError: ``producer_fenced`` (no session for the id, another producer id, or an epoch older than
            the current one: a zombie, e.g. an instance paused while a newer one took the id over),
            ``invalid_epoch`` (an epoch this coordinator never handed out).
    """
    if entry is None:
        raise BrokerError.of("producer_fenced", transactional_id=transactional_id, producer=producer_id, got=epoch,
                             reason="the transactional id has no session to continue")
    _fenced(entry, producer_id, epoch)
    return entry


def guarded_retry(entry: TxnEntry | None, producer_id: str, epoch: int) -> bool:
    """Is a guarded INIT_PRODUCER_ID ``(producer_id, epoch)`` the retry of the one that made ``entry``
    (its reply lost)? Only while nothing happened since: the entry is that init's ``empty`` epoch + 1 and
    was bumped by a guarded init from ``epoch`` (a plain re-init clears ``reinit_from``, so a zombie
    holding that epoch is never taken for the owner)."""
    return (entry is not None and entry.producer_id == producer_id and entry.state == EMPTY
            and entry.epoch == epoch + 1 and entry.reinit_from == epoch)


def guard_admits(entry: TxnEntry | None, producer_id: str, epoch: int) -> bool:
    """The stored ``entry`` lets a guarded INIT_PRODUCER_ID ``(producer_id, epoch)`` persist: it is that
    session, or that init's own bump (:func:`guarded_retry`)."""
    return entry is not None and ((entry.producer_id, entry.epoch) == (producer_id, epoch)
                                  or guarded_retry(entry, producer_id, epoch))


def init_producer(entry: TxnEntry | None, transactional_id: str, *, new_producer_id: str, now_ms: int,
                  reinit_from: int = 0) -> TxnEntry:
    """INIT_PRODUCER_ID: a new session (epoch 1 with ``new_producer_id``) or the next epoch of the same id.

    The caller aborts an open transaction first (:func:`needs_abort_before_init`).

    Raises:
        BrokerError: ``transaction_not_abortable`` while a commit is prepared (it must be retried or
            recovered first), ``transaction_not_open`` when an open transaction was not aborted first.
    """
    if entry is None:
        return TxnEntry(transactional_id, new_producer_id, FIRST_EPOCH, EMPTY, updated_ms=now_ms)
    if entry.state == PREPARE_COMMIT:
        raise BrokerError.of("transaction_not_abortable", transactional_id=transactional_id, state=entry.state,
                             epoch=entry.epoch, reason="commit in progress: retry END_TXN result=commit")
    if entry.state in (OPEN, PREPARE_ABORT):
        raise BrokerError.of("transaction_not_open", transactional_id=transactional_id, state=entry.state,
                             reason="abort the open transaction first")
    return TxnEntry(transactional_id, entry.producer_id, entry.epoch + 1, EMPTY, updated_ms=now_ms,
                    reinit_from=reinit_from)


def begin(entry: TxnEntry | None, transactional_id: str, producer_id: str, epoch: int, *, now_ms: int,
          timeout_ms: int) -> TxnEntry:
    """BEGIN_TXN: ``empty`` -> ``open`` with a deadline; a retry while open is a no-op (same value).

    Raises:
        BrokerError: ``transaction_not_found``, ``producer_fenced``, ``invalid_epoch``,
            ``producer_reinitialization_required`` (the epoch already ran its transaction),
            ``transaction_not_open`` (a prepared transaction is finishing).
    """
    entry = _require(entry, transactional_id)
    _fenced(entry, producer_id, epoch)
    if entry.state == OPEN:
        return entry
    if entry.state in TERMINAL:
        raise BrokerError.of("producer_reinitialization_required", transactional_id=transactional_id, epoch=epoch)
    if entry.state in PREPARED:
        raise BrokerError.of("transaction_not_open", transactional_id=transactional_id, state=entry.state,
                             epoch=epoch)
    return dataclasses.replace(entry, state=OPEN, deadline_ms=now_ms + timeout_ms, updated_ms=now_ms, reinit_from=0)


def check_publish(entry: TxnEntry | None, transactional_id: str, producer_id: str, epoch: int) -> TxnEntry:
    """TXN_PUBLISH preflight: the session is current and its transaction open.

    Raises:
        BrokerError: as :func:`begin` for fencing; ``transaction_not_open``.
    """
    entry = _require(entry, transactional_id)
    _fenced(entry, producer_id, epoch)
    _require_open(entry)
    return entry


def add_partition(entry: TxnEntry, partition: TopicPartition) -> TxnEntry:
    """Register an output partition as a participant (the same value when already registered)."""
    if partition in entry.partitions:
        return entry
    return dataclasses.replace(entry, partitions=tuple(sorted({*entry.partitions, partition})))


def count_messages(entry: TxnEntry, count: int) -> TxnEntry:
    """``entry`` with ``count`` more appended records (in-memory bookkeeping between journal writes)."""
    return dataclasses.replace(entry, messages=entry.messages + count)


def stage_offsets(entry: TxnEntry | None, transactional_id: str, producer_id: str, epoch: int, *, group: str,
                  member: str, generation: int, topic: str, offsets: dict[int, int], now_ms: int) -> TxnEntry:
    """SEND_OFFSETS_TO_TXN: stage next offsets for ``topic`` under one group session.

    All staged offsets of a transaction belong to one (group, member, generation) session; several topics
    are allowed. A repeated partition may keep or advance its staged offset.

    Raises:
        BrokerError: fencing as :func:`begin`; ``transaction_not_open``; ``invalid_txn_offsets`` (another
            group session, no offsets, a negative offset); ``offset_regression`` (a repeated partition moved
            back).
    """
    entry = _require(entry, transactional_id)
    _fenced(entry, producer_id, epoch)
    _require_open(entry)
    if not offsets:
        raise BrokerError.of("invalid_txn_offsets", transactional_id=transactional_id, reason="no offsets")
    if entry.group is not None and (entry.group, entry.member, entry.generation) != (group, member, generation):
        raise BrokerError.of("invalid_txn_offsets", transactional_id=transactional_id, group=group, member=member,
                             generation=generation, reason="offsets of one transaction belong to one group session")
    staged = {(t, p): o for t, p, o in entry.offsets}
    for partition, offset in offsets.items():
        if partition < 0 or offset < 0:
            raise BrokerError.of("invalid_txn_offsets", transactional_id=transactional_id, partition=partition,
                                 offset=offset, reason="negative partition or offset")
        previous = staged.get((topic, partition))
        if previous is not None and offset < previous:
            raise BrokerError.of("offset_regression", transactional_id=transactional_id, topic=topic,
                                 partition=partition, staged=previous, requested=offset,
                                 reason="a staged offset may only stay or advance")
    for partition, offset in offsets.items():
        staged[(topic, partition)] = offset
    return dataclasses.replace(entry, group=group, member=member, generation=generation,
                               offsets=tuple(sorted((t, p, o) for (t, p), o in staged.items())), updated_ms=now_ms)


def end(entry: TxnEntry | None, transactional_id: str, producer_id: str, epoch: int, result: str, *,
        now_ms: int) -> TxnEntry:
    """END_TXN result=commit|abort: ``open`` -> ``prepare_commit`` / ``prepare_abort``.

    A retry finds the transaction prepared (same value: the caller resumes the commit order) or final (same
    value: the caller answers at once).

    Raises:
        BrokerError: fencing as :func:`begin`; ``transaction_not_abortable`` (abort after a durable
            prepare_commit), ``transaction_already_committed`` (abort of a committed one),
            ``transaction_aborted`` (commit of an aborted or aborting one), ``transaction_not_open`` (nothing
            begun in this epoch), ``invalid_transaction_result``.
    """
    if result not in ("commit", "abort"):
        raise BrokerError.of("invalid_transaction_result", value=result)
    entry = _require(entry, transactional_id)
    _fenced(entry, producer_id, epoch)
    state = entry.state
    if state == OPEN:
        target = PREPARE_COMMIT if result == "commit" else PREPARE_ABORT
        return dataclasses.replace(entry, state=target, deadline_ms=0, updated_ms=now_ms)
    if result == "commit":
        if state in (PREPARE_COMMIT, COMMITTED):
            return entry
        if state in (PREPARE_ABORT, ABORTED):
            raise BrokerError.of("transaction_aborted", transactional_id=transactional_id, epoch=epoch)
    else:
        if state in (PREPARE_ABORT, ABORTED):
            return entry
        if state == PREPARE_COMMIT:
            raise BrokerError.of("transaction_not_abortable", transactional_id=transactional_id, epoch=epoch,
                                 state=state, reason="commit is prepared: retry END_TXN result=commit")
        if state == COMMITTED:
            raise BrokerError.of("transaction_already_committed", transactional_id=transactional_id, epoch=epoch)
    raise BrokerError.of("transaction_not_open", transactional_id=transactional_id, state=state, epoch=epoch)


#: ``messages`` in :func:`largest_form`: more records than one transaction can append.
_MESSAGES_BOUND = 10**15


def largest_form(entry: TxnEntry) -> TxnEntry:
    """``entry`` in the largest encoding any of its later transitions can take (the longest state name,
    a message count of any size, 13-digit timestamps, the same partitions and offsets): a transaction
    whose largest form fits its store's limit can always be prepared, decided and aborted (only
    TXN_PUBLISH to a new partition and SEND_OFFSETS_TO_TXN grow it)."""
    return dataclasses.replace(entry, state=PREPARE_COMMIT, messages=_MESSAGES_BOUND,
                               deadline_ms=max(entry.deadline_ms, 10**13 - 1),
                               updated_ms=max(entry.updated_ms, 10**13 - 1))


def expire(entry: TxnEntry, now_ms: int) -> TxnEntry | None:
    """Timeout: an open transaction past its deadline becomes ``prepare_abort`` (else None)."""
    if entry.state == OPEN and entry.deadline_ms and now_ms >= entry.deadline_ms:
        return dataclasses.replace(entry, state=PREPARE_ABORT, deadline_ms=0, updated_ms=now_ms)
    return None


def abort_for_reinit(entry: TxnEntry, now_ms: int) -> TxnEntry:
    """The open transaction of a re-initialized id becomes ``prepare_abort`` (same value if already)."""
    if entry.state == OPEN:
        return dataclasses.replace(entry, state=PREPARE_ABORT, deadline_ms=0, updated_ms=now_ms)
    return entry


def abandon_prepared_commit(entry: TxnEntry, now_ms: int) -> TxnEntry:
    """The coordinator itself gives up a prepared commit whose group fence failed at revalidation (the
    client never saw it committed): ``prepare_commit`` -> ``prepare_abort``."""
    if entry.state != PREPARE_COMMIT:
        raise BrokerError.of("transaction_not_committing", transactional_id=entry.transactional_id, state=entry.state)
    return dataclasses.replace(entry, state=PREPARE_ABORT, updated_ms=now_ms)


def complete(entry: TxnEntry, now_ms: int) -> TxnEntry:
    """The final decision after the markers: ``prepare_commit`` -> ``committed``, ``prepare_abort`` ->
    ``aborted`` (same value when already final)."""
    if entry.state == PREPARE_COMMIT:
        return dataclasses.replace(entry, state=COMMITTED, updated_ms=now_ms)
    if entry.state == PREPARE_ABORT:
        return dataclasses.replace(entry, state=ABORTED, updated_ms=now_ms)
    if entry.state in TERMINAL:
        return entry
    raise BrokerError.of("transaction_not_committing", transactional_id=entry.transactional_id, state=entry.state)


def forget_topic(entry: TxnEntry, topic: str) -> TxnEntry:
    """A terminal ``entry`` without the partitions and offsets of a deleted ``topic``."""
    return dataclasses.replace(entry, partitions=tuple(tp for tp in entry.partitions if tp[0] != topic),
                               offsets=tuple(o for o in entry.offsets if o[0] != topic))


def tombstone(entry: TxnEntry, now_ms: int, expiration_ms: int) -> TxnEntry | None:
    """After ``transactional_id_expiration_ms`` a final entry drops its operation payloads (partitions,
    offsets, group session) and keeps a compact epoch tombstone (id, producer id, epoch, state), so a later
    INIT_PRODUCER_ID still gets epoch + 1. None when not due or already compact."""
    if entry.state not in TERMINAL or now_ms < entry.updated_ms + expiration_ms:
        return None
    if not entry.partitions and not entry.offsets and entry.group is None:
        return None
    return dataclasses.replace(entry, partitions=(), offsets=(), group=None, member=None, generation=None)


def next_tombstone_ms(entries: Iterable[TxnEntry], expiration_ms: int) -> int | None:
    """When the next final entry becomes due for :func:`tombstone` (None: none)."""
    due = [e.updated_ms + expiration_ms for e in entries
           if e.state in TERMINAL and (e.partitions or e.offsets or e.group is not None)]
    return min(due) if due else None


def marker_partitions(entry: TxnEntry) -> tuple[TopicPartition, ...]:
    """Every partition that takes a marker when ``entry`` ends: the output partitions."""
    return entry.partitions


def oldest_open(entries: Iterable[TxnEntry]) -> int | None:
    """The smallest deadline among open transactions (the next timeout to arm), or None."""
    deadlines = [e.deadline_ms for e in entries if e.state == OPEN and e.deadline_ms]
    return min(deadlines) if deadlines else None
