"""The SDK's sans-IO transaction session (cursus.client.transactions.TransactionSession)."""

from __future__ import annotations

import pytest

from cursus.client.errors import ConflictError, DeliveryUnknownError, ProducerFencedError, ValidationError
from cursus.client.transactions import TransactionSession


def test_session_flow_sequences_and_reinit():
    s = TransactionSession("tx")
    assert s.needs_init() and s.init_request() == {"transactional_id": "tx"}
    s.on_init({"producer_id": "5", "epoch": "3"})  # the producer_id= alias is accepted
    assert (s.producer_id, s.epoch, s.state) == ("5", 3, "ready") and not s.needs_init()
    assert s.begin_request() == {"transactional_id": "tx", "producerId": "5", "epoch": "3"}
    s.on_begin()
    first = s.publish_request("a", b"x", None, None)
    assert first["seqNum"] == "1" and first["partition"] == "-1" and list(first)[-1] == "message"
    assert s.publish_request("a", "y", "k", 2)["seqNum"] == "2"
    assert s.publish_request("b", "z", None, None)["seqNum"] == "1"  # per topic
    assert s.offsets_request("in", "g", "m", 4, {2: 9, 0: 5})["offsets"] == "P0:5,P2:9"
    assert s.end_request("commit")["result"] == "commit"
    with pytest.raises(ValidationError):
        s.end_request("abort")  # the uncertain commit must be retried first
    assert s.end_request("commit")["epoch"] == "3"  # the retry keeps the epoch
    assert s.on_end({"state": "committed"}) == "committed"
    assert s.needs_init()
    with pytest.raises(ValidationError):
        s.publish_request("a", b"x", None, None)


def test_errors_fold_in():
    s = TransactionSession("tx")
    s.on_init({"producerId": "1", "epoch": "1"})
    s.on_begin()
    s.end_request("commit")
    s.on_error(DeliveryUnknownError("lost"))
    assert s.state == "ending"  # unknown: retried later with the same epoch
    s.on_error(ConflictError("transaction_aborted"))
    assert s.state == "done"  # the broker decided
    s.on_error(ProducerFencedError("producer_fenced", ""))
    with pytest.raises(ProducerFencedError):
        s.begin_request()


def test_reinit_after_a_finished_epoch_is_guarded_and_abort_is_idempotent():
    s = TransactionSession("t")
    assert not s.needs_guarded_init() and s.init_request(guarded=True) == {"transactional_id": "t"}
    assert s.nothing_to_abort()
    s.on_init({"producerId": "7", "epoch": "2"})
    assert s.end_request("abort")["epoch"] == "2"  # ready: a BEGIN_TXN of unknown outcome may have opened one
    empty = ValidationError("transaction_not_open", fields={"state": "empty"})
    assert s.on_abort_error(empty) == "empty" and s.state == "ready"
    s.begin_request()
    s.on_begin()
    s.end_request("commit")
    s.on_error(ConflictError("transaction_aborted"))  # the broker aborted it
    assert s.state == "done" and s.needs_guarded_init()
    assert s.init_request(guarded=True) == {"transactional_id": "t", "producerId": "7", "epoch": "2"}
    assert s.init_request() == {"transactional_id": "t"}
    assert s.end_request("abort")["result"] == "abort"  # done: abort is re-sent, the broker answers aborted
    assert s.on_end({"state": "aborted"}) == "aborted"
    with pytest.raises(ValidationError):
        s.end_request("commit")
