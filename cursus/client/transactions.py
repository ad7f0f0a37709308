"""Transactional producers (blocking and asyncio): exactly-once consume-transform-produce.

::

    from cursus.client import TransactionalProducer

    with TransactionalProducer("127.0.0.1:9000", "orders-enricher") as txn:
        txn.begin()
        txn.send("enriched", b"...", key="customer-1")
        txn.append_stream("orders-es", "order-7", '{"paid":true}', expected_version=3, event_type="Paid")
        txn.send_offsets("orders", "enricher", consumer.member_id, consumer.generation, consumer.positions())
        txn.commit()          # output and input offsets become visible together

The session logic (:class:`TransactionSession`) is sans-IO: it builds each request's fields and folds the
replies in; :class:`TransactionalProducer` and :class:`AsyncTransactionalProducer` only move bytes.

Rules (spec "Transaction Coordinator"): :meth:`~TransactionalProducer.begin` initializes the session on
first use and re-initializes (next epoch) after a completed transaction, because one epoch runs one
transaction (that automatic re-init is *guarded*: it names the finished session, so a zombie instance
gets ``ProducerFencedError`` instead of fencing the instance that replaced it); an END_TXN whose outcome is unknown (connection lost, timeout) is retried with the *same*
epoch on the next :meth:`commit` / :meth:`abort` call (idempotent on the broker). ``ProducerFencedError``
(another instance re-initialized the id) is terminal: the producer refuses further calls. TXN_PUBLISH
carries a per-topic ``seqNum`` from 1, so retries never duplicate a record.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cursus.client.aio import AsyncClient
from cursus.client.connection import Address, Client, ConnectionOptions, ok_fields
from cursus.client.errors import (
    AvailabilityError,
    ClientClosedError,
    CursusError,
    DeliveryUnknownError,
    ProducerFencedError,
    RequestTimeoutError,
    RoutingError,
    ValidationError,
)
from cursus.wire import Command

RESULTS = ("commit", "abort")


@dataclass(slots=True)
class TransactionSession:
    """Sans-IO state of one transactional producer (see the module docstring).

    Attributes:
        transactional_id: the id.
        producer_id, epoch: the session from INIT_PRODUCER_ID ("" / 0 before).
        state: ``none`` (no session), ``ready`` (initialized, nothing begun), ``open``, ``ending`` (END_TXN
            sent, outcome unknown), ``done`` (the epoch's transaction finished), ``fenced`` (terminal).
        ending: the result of the END_TXN in flight or uncertain.
        sequences: next seqNum per topic in this epoch.
    """

    transactional_id: str
    producer_id: str = ""
    epoch: int = 0
    state: str = "none"
    ending: str | None = None
    sequences: dict[str, int] = field(default_factory=dict)

    def _session(self) -> dict[str, str]:
        return {"transactional_id": self.transactional_id, "producerId": self.producer_id, "epoch": str(self.epoch)}

    def check_usable(self) -> None:
        if self.state == "fenced":
            raise ProducerFencedError("producer_fenced",
                                      f"transactional id {self.transactional_id} was fenced by a newer producer")

    def init_request(self, guarded: bool = False) -> dict[str, str]:
        """INIT_PRODUCER_ID fields. ``guarded`` (the automatic re-init after a finished epoch) names this
        session's last (producerId, epoch): the broker bumps it only while that is still the id's current
        session, so this instance, when it is a zombie (another instance took the id over), gets
        ``producer_fenced`` instead of fencing the newer one. The plain form (first / explicit init) always
        bumps (spec)."""
        self.check_usable()
        if guarded and self.producer_id and self.epoch:
            return self._session()
        return {"transactional_id": self.transactional_id}

    def needs_guarded_init(self) -> bool:
        """The next init continues this instance's own session (a finished epoch), so it is guarded."""
        return self.state == "done" and bool(self.producer_id)

    def on_init(self, reply: Mapping[str, str]) -> None:
        pid = reply.get("producerId") or reply.get("producer_id") or ""
        epoch = reply.get("epoch", "")
        if not pid or not epoch:
            raise ValidationError("invalid_reply", f"INIT_PRODUCER_ID reply lacks producerId/epoch: {dict(reply)}")
        self.producer_id, self.epoch, self.state, self.ending = pid, int(epoch), "ready", None
        self.sequences.clear()

    def needs_init(self) -> bool:
        """BEGIN needs a (new) session first: none yet, or the epoch already ran its transaction."""
        return self.state in ("none", "done")

    def begin_request(self) -> dict[str, str]:
        self.check_usable()
        if self.state in ("open", "ending"):
            raise ValidationError("transaction_in_progress",
                                  f"a transaction of {self.transactional_id} is still {self.state}")
        return self._session()

    def on_begin(self) -> None:
        self.state = "open"

    def _require_open(self) -> None:
        self.check_usable()
        if self.state != "open":
            raise ValidationError("transaction_not_open",
                                  f"no open transaction (state {self.state}); call begin()")

    def publish_request(self, topic: str, value: bytes | str, key: str | None, partition: int | None
                        ) -> dict[str, str]:
        self._require_open()
        seq = self.sequences.get(topic, 1)
        self.sequences[topic] = seq + 1
        text = value.decode("utf-8") if isinstance(value, bytes) else value
        fields = {"transactional_id": self.transactional_id, "topic": topic,
                  "partition": str(-1 if partition is None else partition), "producerId": self.producer_id,
                  "seqNum": str(seq), "epoch": str(self.epoch)}
        if key is not None:
            fields["key"] = key
        fields["message"] = text
        return fields

    def append_stream_request(self, topic: str, key: str, payload: bytes | str, expected_version: int,
                              event_type: str, schema_version: int,
                              metadata: str | Mapping[str, Any] | None) -> dict[str, str]:
        """TXN_APPEND_STREAM fields (facts A6): the event fields of APPEND_STREAM plus the session; the
        seqNum shares the topic's TXN_PUBLISH sequence."""
        self._require_open()
        seq = self.sequences.get(topic, 1)
        self.sequences[topic] = seq + 1
        fields = {"transactional_id": self.transactional_id, "topic": topic, "key": key,
                  "expected_version": str(expected_version), "producerId": self.producer_id, "seqNum": str(seq),
                  "epoch": str(self.epoch), "schema_version": str(schema_version)}
        if event_type:
            fields["event_type"] = event_type
        if metadata:
            fields["metadata"] = metadata if isinstance(metadata, str) else json.dumps(metadata,
                                                                                        separators=(",", ":"))
        fields["message"] = payload.decode("utf-8") if isinstance(payload, bytes) else payload
        return fields

    def offsets_request(self, topic: str, group: str, member: str, generation: int,
                        offsets: Mapping[int, int]) -> dict[str, str]:
        self._require_open()
        if not offsets:
            raise ValidationError("invalid_txn_offsets", "send_offsets needs at least one partition offset")
        spec = ",".join(f"P{p}:{o}" for p, o in sorted(offsets.items()))
        return {**self._session(), "topic": topic, "group": group, "member": member,
                "generation": str(generation), "offsets": spec}

    def end_request(self, result: str) -> dict[str, str]:
        """END_TXN fields; an uncertain earlier END_TXN must be retried with its own result.

        ``abort`` is also sent for an epoch whose transaction already ended (``done``: e.g. a failed
        commit the broker aborted; the broker answers ``aborted`` idempotently, or
        ``transaction_already_committed``) or that holds nothing known to be open (``ready``: a BEGIN_TXN
        whose outcome was unknown may have opened one). ``commit`` needs an open transaction."""
        self.check_usable()
        if result not in RESULTS:
            raise ValueError(f"result must be commit or abort, got {result!r}")
        if self.state == "ending" and self.ending != result:
            raise ValidationError("transaction_outcome_unknown",
                                  f"the uncertain END_TXN result={self.ending} must be retried first")
        allowed = ("open", "ending", "done", "ready") if result == "abort" else ("open", "ending")
        if self.state not in allowed:
            raise ValidationError("transaction_not_open", f"no open transaction (state {self.state})")
        self.state, self.ending = "ending", result
        return {**self._session(), "result": result}

    def nothing_to_abort(self) -> bool:
        """abort() without a session: nothing was ever begun, so there is nothing to abort."""
        return self.state == "none"

    def on_abort_error(self, exc: BaseException) -> str | None:
        """An abort's ``transaction_not_open`` for an epoch that never began a transaction (broker state
        ``empty``) means there is nothing to abort: the session goes back to ``ready`` and abort() answers
        ``empty``. None: the error stands (after :meth:`on_error`)."""
        if isinstance(exc, CursusError) and exc.code == "transaction_not_open" \
                and exc.fields.get("state") == "empty":
            self.state, self.ending = "ready", None
            return "empty"
        self.on_error(exc)
        return None

    def on_end(self, reply: Mapping[str, str]) -> str:
        self.state, self.ending = "done", None
        return reply.get("state", "")

    def on_error(self, exc: BaseException) -> None:
        """Fold a failed request in: fencing is terminal; an END_TXN error that is not an unknown outcome
        ends the epoch (the broker decided)."""
        if isinstance(exc, ProducerFencedError):
            self.state = "fenced"
        elif self.state == "ending" and isinstance(exc, CursusError) and not isinstance(
                exc, DeliveryUnknownError | RequestTimeoutError) and not exc.retryable:
            self.state, self.ending = "done", None


def _coordinator_after(error: BaseException, coordinator: Address | None) -> Address | None:
    """The cached coordinator address after a failed call: forgotten when the broker is gone or no longer
    coordinates the id (unreachable, NOT_COORDINATOR, coordinator_not_available), so the next call asks
    FIND_COORDINATOR again (a new shard owner after a failover); kept otherwise."""
    if isinstance(error, (AvailabilityError, RoutingError, OSError)):
        return None
    return coordinator


class TransactionalProducer:
    """Blocking transactional producer over a :class:`~cursus.client.connection.Client`.

    Args:
        bootstrap: ``host:port`` (or a list); transaction commands go to the coordinator
            (``FIND_COORDINATOR transactional_id=``, ``NOT_COORDINATOR`` redirects are followed).
        transactional_id: the stable id of this processing instance (the same id after a restart fences
            the old instance).
        options: connection options; keyword arguments override fields.

    Raises (from the methods): ``ProducerFencedError`` (terminal), ``ValidationError`` (misuse: no open
    transaction), the broker's typed errors (``ConflictError`` for ``transaction_not_abortable`` and
    friends), ``BrokerUnavailableError`` / ``DeliveryUnknownError`` when the broker stays unreachable (a
    later :meth:`commit` / :meth:`abort` retries an uncertain END_TXN).
    """

    def __init__(self, bootstrap: str | list[str], transactional_id: str, options: ConnectionOptions | None = None,
                 **overrides: Any) -> None:
        self._client = Client(bootstrap, options, **overrides)
        self.session = TransactionSession(transactional_id)
        self._coordinator: Address | None = None

    @property
    def transactional_id(self) -> str:
        return self.session.transactional_id

    def _address(self) -> Address:
        if self._coordinator is None:
            try:
                fields = ok_fields(self._client.call(Command.FIND_COORDINATOR,
                                                     {"transactional_id": self.transactional_id}))
                self._coordinator = (fields["host"], int(fields["port"]))
            except (CursusError, KeyError, ValueError):
                self._coordinator = self._client.bootstrap[0]
        return self._coordinator

    def _call(self, command: Command, fields: dict[str, str]) -> dict[str, str]:
        try:
            return self._call_raw(command, fields)
        except Exception as exc:
            self.session.on_error(exc)
            raise

    def _call_raw(self, command: Command, fields: dict[str, str]) -> dict[str, str]:
        """One call to the coordinator (the session is not told about a failure)."""
        if self._client.closed:
            raise ClientClosedError("transactional producer is closed")
        try:
            return ok_fields(self._client.call(command, fields, address=self._address(), retry_safe=True))
        except Exception as exc:
            self._coordinator = _coordinator_after(exc, self._coordinator)
            raise

    def init(self) -> tuple[str, int]:
        """INIT_PRODUCER_ID (plain form): a new epoch (aborts this id's open transaction on the broker,
        fences older instances, whatever their epoch). Returns (producer id, epoch)."""
        self.session.on_init(self._call(Command.INIT_PRODUCER_ID, self.session.init_request()))
        return self.session.producer_id, self.session.epoch

    def begin(self) -> None:
        """Start a transaction: initializes the session on first use; after a finished epoch re-initializes
        it in the guarded form (this session's last producerId/epoch), so a zombie instance gets
        ``ProducerFencedError`` instead of fencing the instance that took the id over."""
        if self.session.needs_init():
            guarded = self.session.needs_guarded_init()
            self.session.on_init(self._call(Command.INIT_PRODUCER_ID, self.session.init_request(guarded)))
        self._call(Command.BEGIN_TXN, self.session.begin_request())
        self.session.on_begin()

    def send(self, topic: str, value: bytes | str, *, key: str | None = None, partition: int | None = None) -> int:
        """TXN_PUBLISH one record (UTF-8 text payload); returns its partition. Durable when this returns,
        visible to read_committed consumers only after :meth:`commit`."""
        reply = self._call(Command.TXN_PUBLISH, self.session.publish_request(topic, value, key, partition))
        return int(reply.get("partition", "-1"))

    def append_stream(self, topic: str, key: str, payload: bytes | str, *, expected_version: int,
                      event_type: str = "", schema_version: int = 1,
                      metadata: str | Mapping[str, Any] | None = None) -> int:
        """TXN_APPEND_STREAM: stage one event of aggregate ``key`` on the event-sourcing ``topic`` at
        version ``expected_version`` (current + 1, counting this transaction's staged events); returns its
        partition. Durable when this returns; READ_STREAM / STREAM_VERSION see it only after
        :meth:`commit`, and :meth:`abort` discards it (the version is free again).

        Raises:
            VersionConflictError: the version is taken, or another open transaction holds the aggregate
                (``reason=transaction_in_progress``); nothing staged, the transaction stays open.
        """
        reply = self._call(Command.TXN_APPEND_STREAM, self.session.append_stream_request(
            topic, key, payload, expected_version, event_type, schema_version, metadata))
        return int(reply.get("partition", "-1"))

    def send_offsets(self, topic: str, group: str, member: str, generation: int, offsets: Mapping[int, int]) -> int:
        """SEND_OFFSETS_TO_TXN: stage next offsets of ``topic`` for ``group`` (committed with the output).
        Returns how many offsets the transaction stages in total."""
        reply = self._call(Command.SEND_OFFSETS_TO_TXN,
                           self.session.offsets_request(topic, group, member, generation, offsets))
        return int(reply.get("staged_offsets", "0"))

    def send_consumer_offsets(self, consumer: Any) -> int:
        """:meth:`send_offsets` with a :class:`~cursus.client.GroupConsumer`'s topic, group, member,
        generation and positions (everything it returned so far)."""
        return self.send_offsets(consumer.topic, consumer.group, consumer.member_id, consumer.generation,
                                 consumer.positions())

    def commit(self) -> str:
        """END_TXN result=commit (retried with the same epoch while its outcome is unknown). Returns the
        final state (``committed``)."""
        return self.session.on_end(self._call(Command.END_TXN, self.session.end_request("commit")))

    def abort(self) -> str:
        """END_TXN result=abort for this epoch; safe to call after any failure. Returns ``aborted`` (also
        when the broker had aborted it already: a timeout, a failed commit, an earlier abort) or ``empty``
        (the epoch never began a transaction: nothing to abort).

        Raises:
            ConflictError: ``transaction_already_committed`` (the commit went through),
                ``transaction_not_abortable`` (a commit is prepared: retry :meth:`commit`).
            ValidationError: ``transaction_outcome_unknown`` (an uncertain commit must be retried first).
            ProducerFencedError: another instance re-initialized the id.
        """
        if self.session.nothing_to_abort():
            return "empty"
        try:
            reply = self._call_raw(Command.END_TXN, self.session.end_request("abort"))
        except Exception as exc:
            if self.session.on_abort_error(exc) is not None:
                return "empty"
            raise
        return self.session.on_end(reply)

    def status(self) -> dict[str, str]:
        """TXN_STATUS fields (state, messages, participants, offsets, ...)."""
        return self._call(Command.TXN_STATUS, {"transactional_id": self.transactional_id})

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> TransactionalProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncTransactionalProducer:
    """The asyncio twin of :class:`TransactionalProducer` (same arguments, methods are coroutines)."""

    def __init__(self, bootstrap: str | list[str], transactional_id: str, options: ConnectionOptions | None = None,
                 **overrides: Any) -> None:
        self._client = AsyncClient(bootstrap, options, **overrides)
        self.session = TransactionSession(transactional_id)
        self._coordinator: Address | None = None

    @property
    def transactional_id(self) -> str:
        return self.session.transactional_id

    async def _address(self) -> Address:
        if self._coordinator is None:
            try:
                fields = ok_fields(await self._client.call(Command.FIND_COORDINATOR,
                                                           {"transactional_id": self.transactional_id}))
                self._coordinator = (fields["host"], int(fields["port"]))
            except (CursusError, KeyError, ValueError):
                self._coordinator = self._client.bootstrap[0]
        return self._coordinator

    async def _call(self, command: Command, fields: dict[str, str]) -> dict[str, str]:
        try:
            return await self._call_raw(command, fields)
        except Exception as exc:
            self.session.on_error(exc)
            raise

    async def _call_raw(self, command: Command, fields: dict[str, str]) -> dict[str, str]:
        if self._client.closed:
            raise ClientClosedError("transactional producer is closed")
        try:
            return ok_fields(await self._client.call(command, fields, address=await self._address(),
                                                     retry_safe=True))
        except Exception as exc:
            self._coordinator = _coordinator_after(exc, self._coordinator)
            raise

    async def init(self) -> tuple[str, int]:
        """:meth:`TransactionalProducer.init` (asyncio; plain form)."""
        self.session.on_init(await self._call(Command.INIT_PRODUCER_ID, self.session.init_request()))
        return self.session.producer_id, self.session.epoch

    async def begin(self) -> None:
        """:meth:`TransactionalProducer.begin` (asyncio; guarded re-init after a finished epoch)."""
        if self.session.needs_init():
            guarded = self.session.needs_guarded_init()
            self.session.on_init(await self._call(Command.INIT_PRODUCER_ID, self.session.init_request(guarded)))
        await self._call(Command.BEGIN_TXN, self.session.begin_request())
        self.session.on_begin()

    async def send(self, topic: str, value: bytes | str, *, key: str | None = None,
                   partition: int | None = None) -> int:
        reply = await self._call(Command.TXN_PUBLISH, self.session.publish_request(topic, value, key, partition))
        return int(reply.get("partition", "-1"))

    async def append_stream(self, topic: str, key: str, payload: bytes | str, *, expected_version: int,
                            event_type: str = "", schema_version: int = 1,
                            metadata: str | Mapping[str, Any] | None = None) -> int:
        """:meth:`TransactionalProducer.append_stream` (asyncio)."""
        reply = await self._call(Command.TXN_APPEND_STREAM, self.session.append_stream_request(
            topic, key, payload, expected_version, event_type, schema_version, metadata))
        return int(reply.get("partition", "-1"))

    async def send_offsets(self, topic: str, group: str, member: str, generation: int,
                           offsets: Mapping[int, int]) -> int:
        reply = await self._call(Command.SEND_OFFSETS_TO_TXN,
                                 self.session.offsets_request(topic, group, member, generation, offsets))
        return int(reply.get("staged_offsets", "0"))

    async def commit(self) -> str:
        return self.session.on_end(await self._call(Command.END_TXN, self.session.end_request("commit")))

    async def abort(self) -> str:
        """:meth:`TransactionalProducer.abort` (asyncio): ``aborted`` or ``empty``."""
        if self.session.nothing_to_abort():
            return "empty"
        try:
            reply = await self._call_raw(Command.END_TXN, self.session.end_request("abort"))
        except Exception as exc:
            if self.session.on_abort_error(exc) is not None:
                return "empty"
            raise
        return self.session.on_end(reply)

    async def status(self) -> dict[str, str]:
        return await self._call(Command.TXN_STATUS, {"transactional_id": self.transactional_id})

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> AsyncTransactionalProducer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
