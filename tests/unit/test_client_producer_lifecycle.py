"""ProducerCore and topic lifecycle (issue 11): delivery deadlines counted from ``send`` and enforced for
records that never leave the queue, and sequence restarts after a DELETE + re-CREATE or a TRUNCATE (the
broker forgot the producer: ``idempotency_gap expected=1``, ``topic_not_found``, a changed
``lifecycle_epoch`` or a lower ``revision`` in METADATA)."""

from __future__ import annotations

import pytest

from cursus.client.admin import parse_metadata
from cursus.client.errors import (
    DeliveryTimeoutError,
    DeliveryUnknownError,
    SequenceError,
    TopicNotFoundError,
    error_from_typed,
)
from cursus.client.producer import _idle_wait
from cursus.wire import decode_batch, make_error
from tests.unit.test_client_producer_core import A, B, _core, _send


def _metadata(*, revision: int = 1, lifecycle_epoch: int = 0, partitions: int = 3):
    return parse_metadata({"topic": "t", "partitions": str(partitions), "leaders": ",".join(["broker-a:9000"] *
                                                                                          partitions),
                           "revision": str(revision), "lifecycle_epoch": str(lifecycle_epoch)}, "t")


def _forgotten(got: int) -> SequenceError:
    error = error_from_typed(make_error("idempotency_gap", producer="py-test", epoch=7, expected=1, got=got,
                                        reason="a new producer session must start at seqNum=1"))
    assert isinstance(error, SequenceError)
    return error


def _acked(core, partition: int, now: float) -> None:
    """One record sent and acknowledged on ``partition``."""
    _send(core, b"x", partition=partition, now=now)
    batch, _ = core.poll(A, now + 1.0)
    list(core.succeed(batch, 0))


def test_queued_records_fail_at_their_send_deadline_even_when_no_batch_can_leave() -> None:
    core = _core(idempotent=True, delivery_timeout_s=2.0, linger_ms=0)
    _send(core, b"a", partition=0, now=0.0)
    in_flight, _ = core.poll(A, 0.0)  # the partition is busy: the next records stay queued
    _, late = _send(core, b"b", partition=0, now=0.5)
    _, later = _send(core, b"c", partition=0, now=1.0)
    assert core.next_expiry == pytest.approx(2.0)
    assert core.expire(2.4) == []  # the first record is no longer queued: nothing is due yet
    assert core.next_expiry == pytest.approx(2.5)
    resolutions = core.expire(2.5)
    assert [r[0] for r in resolutions] == [late] and isinstance(resolutions[0][1], DeliveryTimeoutError)
    assert resolutions[0][1].retryable and core.next_expiry == pytest.approx(3.0)
    assert core.buffered == 2
    list(core.succeed(in_flight, 0))
    batch, _ = core.poll(A, 2.6)
    assert [p.future for p in batch.pendings] == [later]
    assert batch.seq_start == 2  # an expired record never had a sequence: no gap
    assert batch.deadline == pytest.approx(3.0)  # the batch's deadline is its oldest record's
    assert core.expire(10.0) == [] and core.next_expiry == float("inf")


def test_the_batch_deadline_counts_from_send_not_from_sealing() -> None:
    core = _core(idempotent=True, delivery_timeout_s=1.0)
    _send(core, b"a", partition=0, now=0.0)
    batch, _ = core.poll(A, 0.9)
    resolutions, _ = core.failed(batch, ConnectionResetError(), written=True, now=0.95)
    assert isinstance(resolutions[0][1], DeliveryUnknownError)  # no time left for a retry


def test_idle_wait_takes_the_sooner_of_linger_and_expiry() -> None:
    assert _idle_wait(None, float("inf")) is None
    assert _idle_wait(0.5, float("inf")) == 0.5
    assert _idle_wait(None, 3.0) == 3.0
    assert _idle_wait(0.5, 0.2) == 0.2


def test_a_forgotten_producer_restarts_the_partition_at_the_next_epoch_instead_of_stopping() -> None:
    core = _core(idempotent=True, batch_size=1, linger_ms=0)
    _acked(core, 0, 0.0)
    sender = object()
    _, first = _send(core, b"a", partition=0, now=2.0)
    one, _ = core.poll(A, 2.0, sender)
    _, second = _send(core, b"b", partition=0, now=2.0)
    two, _ = core.poll(A, 2.0, sender, room=4)  # pipelined behind the first
    assert (one.seq_start, two.seq_start) == (2, 3)
    _, queued = _send(core, b"c", partition=0, now=2.0)
    resolutions, _ = core.failed(one, _forgotten(2), written=True, now=2.1)
    assert core.fatal is None and [r[0] for r in resolutions] == [first]
    assert core.poll(A, 2.1, sender, room=4) == (None, None)  # settling: nothing new leaves
    resolutions, _ = core.failed(two, _forgotten(3), written=True, now=2.1)
    assert core.fatal is None and [r[0] for r in resolutions] == [second]  # failed, not resent
    batch, _ = core.poll(A, 2.2)
    assert [p.future for p in batch.pendings] == [queued]
    assert (batch.seq_start, batch.state.epoch) == (1, 8)
    decoded = decode_batch(core.encode(batch))
    assert decoded.seq_start == 1 and [(r.producer_epoch, r.seq_num) for r in decoded.records] == [(8, 1)]
    list(core.succeed(batch, 0))
    assert core.failed_count == 2 and core.buffered == 0


def test_an_idempotency_gap_for_a_known_session_stays_terminal() -> None:
    core = _core(idempotent=True)
    _acked(core, 0, 0.0)
    _send(core, b"a", partition=0, now=2.0)
    batch, _ = core.poll(A, 3.0)
    error = error_from_typed(make_error("idempotency_gap", producer="py-test", epoch=7, expected=5, got=2))
    core.failed(batch, error, written=True, now=3.0)
    assert core.fatal is error


def test_topic_not_found_restarts_every_partition_of_the_topic_and_drops_its_retries() -> None:
    core = _core(idempotent=True, batch_size=1, linger_ms=0)
    for p in (0, 1, 2):
        _acked(core, p, 0.0)
    _send(core, b"p0", partition=0, now=2.0)
    _send(core, b"p1", partition=1, now=2.0)
    on0, _ = core.poll(A, 2.0)
    on1, _ = core.poll(A, 2.0)
    assert {on0.partition, on1.partition} == {0, 1}
    on0, on1 = (on0, on1) if on0.partition == 0 else (on1, on0)
    assert core.failed(on1, ConnectionResetError(), written=True, now=2.0) == ([], None)  # waits for a retry
    gone = error_from_typed(make_error("topic_not_found", topic="t"))
    resolutions, _ = core.failed(on0, gone, written=True, now=2.0)
    errors = {r[0]: r[1] for r in resolutions}
    assert len(errors) == 2 and core.fatal is None
    assert isinstance(errors[on0.pendings[0].future], TopicNotFoundError)
    assert isinstance(errors[on1.pendings[0].future], DeliveryUnknownError)  # might have been written
    assert [core.partitions[("t", p)].epoch for p in (0, 1, 2)] == [8, 8, 8]
    assert all(core.partitions[("t", p)].next_seq == 1 for p in (0, 1, 2))
    _send(core, b"new", partition=2, now=3.0)
    batch, _ = core.poll(A, 3.0)
    assert (batch.partition, batch.seq_start, batch.state.epoch) == (2, 1, 8)


def test_metadata_of_a_truncated_or_recreated_topic_restarts_sequences() -> None:
    core = _core(idempotent=True, batch_size=1, linger_ms=0)
    core.set_metadata(_metadata(revision=3), 0.0)
    _acked(core, 0, 0.0)
    _acked(core, 1, 0.0)
    _send(core, b"busy", partition=1, now=2.0)
    busy, _ = core.poll(A, 2.0)
    assert core.set_metadata(_metadata(revision=3), 2.0) == []  # unchanged: nothing happens
    assert core.partitions[("t", 0)].epoch == 7
    assert core.set_metadata(_metadata(revision=4, lifecycle_epoch=1), 2.0) == []  # truncated
    assert core.partitions[("t", 0)].epoch == 8 and core.partitions[("t", 0)].next_seq == 1
    assert core.partitions[("t", 1)].epoch == 7  # busy: restarts once its batch is back
    resolutions, _ = core.failed(busy, ConnectionResetError(), written=True, now=2.1)
    assert isinstance(resolutions[0][1], DeliveryUnknownError)  # not resent into the new generation
    assert core.partitions[("t", 1)].epoch == 8 and core.partitions[("t", 1)].next_seq == 1
    core.set_metadata(_metadata(revision=1), 3.0)  # deleted and re-created: the revision starts again
    assert core.partitions[("t", 0)].epoch == 9


def test_a_redirected_batch_that_fails_still_reports_the_new_leader() -> None:
    """Root cause 2 of issue 11: a NOT_LEADER redirect moved the partition to a new leader, but when the
    batch itself could not be retried (here: its delivery deadline has passed) the move was not reported,
    no sender was started for the new leader and the partition's next batches never left."""
    core = _core(batch_size=1, linger_ms=0, delivery_timeout_s=1.0)
    sender = object()
    _send(core, b"a", partition=0, now=0.0)
    first, _ = core.poll(A, 0.0, sender)
    _send(core, b"b", partition=0, now=0.5)
    redirect = error_from_typed(make_error("NOT_LEADER", leader="broker-b:9000"))
    resolutions, moved = core.failed(first, redirect, written=True, now=1.0)
    assert len(resolutions) == 1 and moved == B and core.leader_of("t", 0) == B
    assert core.poll(B, 1.0)[0].pendings[0].value == b"b"
