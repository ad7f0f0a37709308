"""ProducerCore decisions without sockets or threads: batching, sequences, retries, redirects, fencing."""

from __future__ import annotations

import pytest

from cursus.client.admin import parse_metadata
from cursus.client.connection import Backoff
from cursus.client.errors import (
    DeliveryUnknownError,
    NotFoundError,
    ProducerFencedError,
    error_from_typed,
)
from cursus.client.producer import ProducerConfig, ProducerCore, _Pending, normalize_acks
from cursus.client.records import RecordMetadata
from cursus.partitioning import partition_for_key
from cursus.wire import decode_batch, make_error

A = ("broker-a", 9000)
B = ("broker-b", 9000)


def _core(*, idempotent: bool = False, batch_size: int = 100, linger_ms: float = 10.0, partitions: int = 3,
          partitioner: str = "hash_key", delivery_timeout_s: float = 60.0) -> ProducerCore:
    config = ProducerConfig.build(
        acks=None, idempotent=idempotent, batch_size=batch_size, batch_bytes=1 << 20, linger_ms=linger_ms,
        connections_per_broker=1, buffer_records=1000, max_block_s=1, delivery_timeout_s=delivery_timeout_s,
        request_timeout_s=5, backoff=Backoff(initial_s=0.1, max_s=1.0, jitter=0), producer_id="py-test",
        producer_epoch=7, id_prefix="py-")
    core = ProducerCore(config, A)
    leaders = ",".join(["broker-a:9000"] * partitions)
    core.set_metadata(parse_metadata({"topic": "t", "partitions": str(partitions), "leaders": leaders,
                                      "partitioner": partitioner}, "t"), 0.0)
    return core


def _send(core: ProducerCore, value: bytes, *, key: str | None = None, partition: int | None = None,
          now: float = 0.0) -> tuple[int, object]:
    token = object()
    chosen = core.route("t", key, partition)
    core.append("t", chosen, _Pending(value, None, None, token), now)
    return chosen, token


def test_acks_and_config_validation() -> None:
    assert [normalize_acks(a) for a in (0, "none", 1, "", "all", -1)] == ["0", "0", "1", "1", "-1", "-1"]
    with pytest.raises(ValueError):
        normalize_acks(2)
    with pytest.raises(ValueError):
        ProducerConfig.build(acks="1", idempotent=True, batch_size=1, batch_bytes=1, linger_ms=0,
                             connections_per_broker=1, buffer_records=1, max_block_s=1, delivery_timeout_s=1,
                             request_timeout_s=1, backoff=Backoff(), producer_id=None, producer_epoch=None,
                             id_prefix="py-")
    assert _core(idempotent=True).config.acks == "-1"


def test_linger_then_batch_with_sequences_from_one() -> None:
    core = _core(idempotent=True)
    for i in range(3):
        _send(core, b"v%d" % i, partition=1)
    assert core.poll(A, 0.005) == (None, pytest.approx(0.005))
    batch, _ = core.poll(A, 0.010)
    assert batch is not None and batch.seq_start == 1 and len(batch.pendings) == 3
    decoded = decode_batch(core.encode(batch))
    assert decoded.idempotent and decoded.acks == "-1" and (decoded.seq_start, decoded.seq_end) == (1, 3)
    assert [(r.producer_id, r.producer_epoch, r.seq_num, r.payload) for r in decoded.records] == \
        [("py-test", 7, 1, b"v0"), ("py-test", 7, 2, b"v1"), ("py-test", 7, 3, b"v2")]
    results = core.succeed(batch, last_offset=41)
    assert [(r.offset, r.seq_num) for _, r, _ in results] == [(39, 1), (40, 2), (41, 3)]
    assert core.buffered == 0


def test_full_batches_leave_at_once_and_one_batch_per_partition_is_in_flight() -> None:
    core = _core(batch_size=2)
    for i in range(5):
        _send(core, b"%d" % i, partition=0)
    first, _ = core.poll(A, 0.0)
    assert first is not None and len(first.pendings) == 2
    assert core.poll(A, 0.0) == (None, None)  # partition busy
    core.succeed(first, 1)
    second, _ = core.poll(A, 0.0)  # leftovers are due immediately
    assert second is not None and second.seq_start == 3


def test_flush_ignores_linger() -> None:
    core = _core(linger_ms=10_000)
    _send(core, b"x", partition=0)
    assert core.poll(A, 0.0)[0] is None
    core.flushing += 1
    assert core.poll(A, 0.0)[0] is not None


def test_routing_matches_the_broker_rule() -> None:
    core = _core(partitions=5)
    for key in ("alpha", "beta", "ключ", "k-17"):
        assert core.route("t", key, None) == partition_for_key(key, 5)
    assert core.route("t", "alpha", 4) == 4
    with pytest.raises(NotFoundError):
        core.route("t", None, 5)
    rr = _core(partitions=5, partitioner="round_robin")
    assert rr.route("t", "alpha", None) == 0  # keys ignored on round_robin topics


def test_unkeyed_records_stick_to_a_partition_until_its_batch_leaves() -> None:
    core = _core(batch_size=3, partitions=3)
    chosen = [_send(core, b"x")[0] for _ in range(3)]
    assert chosen == [0, 0, 0]
    assert _send(core, b"x")[0] == 1


def test_definite_failure_rewinds_sequences_for_the_next_batch() -> None:
    core = _core(idempotent=True)
    _, token = _send(core, b"too big", partition=0)
    batch, _ = core.poll(A, 1.0)
    resolutions, _ = core.failed(batch, error_from_typed(make_error("message_too_large")), written=True, now=1.0)
    assert resolutions[0][0] is token and resolutions[0][2]
    _send(core, b"ok", partition=0, now=1.0)
    retry, _ = core.poll(A, 2.0)
    assert retry is not None and retry.seq_start == 1  # the broker never saw sequence 1
    assert core.take_failures().failed_count == 1 and core.take_failures() is None


def test_idempotent_batch_is_retried_unchanged_after_a_dropped_connection() -> None:
    core = _core(idempotent=True)
    _send(core, b"a", partition=2)
    batch, _ = core.poll(A, 1.0)
    payload = core.encode(batch)
    assert core.failed(batch, ConnectionResetError(), written=True, now=1.0) == ([], None)
    assert core.poll(A, 1.05) == (None, pytest.approx(0.05))  # backoff 0.1 s
    again, _ = core.poll(A, 1.1)
    assert again is batch and core.encode(again) == payload


def test_non_idempotent_batch_fails_when_outcome_unknown() -> None:
    core = _core()
    _send(core, b"a", partition=0)
    batch, _ = core.poll(A, 1.0)
    resolutions, _ = core.failed(batch, ConnectionResetError(), written=True, now=1.0)
    assert isinstance(resolutions[0][1], DeliveryUnknownError)
    _send(core, b"b", partition=0, now=1.0)
    assert core.poll(A, 2.0)[0].seq_start == 2  # no rewind: sequence 1 may exist


def test_a_refusal_before_append_is_retried_without_idempotence_an_unknown_outcome_is_not() -> None:
    core = _core()
    _send(core, b"a", partition=0)
    batch, _ = core.poll(A, 1.0)
    refusal = error_from_typed(make_error("leader_not_available", topic="t", partition="0"))
    assert core.failed(batch, refusal, written=True, now=1.0) == ([], None)  # nothing was appended
    again, _ = core.poll(A, 2.0)
    assert again is batch
    unknown = error_from_typed(make_error("replication_unavailable", reason="replica timeout", outcome="unknown"))
    resolutions, _ = core.failed(again, unknown, written=True, now=2.0)
    assert isinstance(resolutions[0][1], DeliveryUnknownError)


def test_connect_failure_is_retried_even_without_idempotence() -> None:
    core = _core()
    _send(core, b"a", partition=0)
    batch, _ = core.poll(A, 1.0)
    assert core.failed(batch, ConnectionRefusedError(), written=False, now=1.0) == ([], None)
    assert core.poll(A, 2.0)[0] is batch


def test_not_leader_moves_the_partition() -> None:
    core = _core()
    _send(core, b"a", partition=1)
    batch, _ = core.poll(A, 1.0)
    redirect = error_from_typed(make_error("NOT_LEADER", leader="broker-b:9000"))
    assert core.failed(batch, redirect, written=True, now=1.0) == ([], B)
    assert core.poll(A, 1.0) == (None, None)
    assert core.poll(B, 1.0)[0] is batch and core.leader_of("t", 1) == B


def test_retries_stop_at_the_delivery_timeout() -> None:
    core = _core(idempotent=True, delivery_timeout_s=1.0)
    _send(core, b"a", partition=0)
    batch, _ = core.poll(A, 0.5)
    core.failed(batch, TimeoutError(), written=True, now=0.5)
    batch, _ = core.poll(A, 0.6)
    resolutions, _ = core.failed(batch, TimeoutError(), written=True, now=1.45)
    assert isinstance(resolutions[0][1], DeliveryUnknownError)


def test_fencing_is_terminal() -> None:
    core = _core(idempotent=True)
    _send(core, b"a", partition=0)
    _send(core, b"b", partition=1)
    batch, _ = core.poll(A, 1.0)
    fenced = error_from_typed(make_error("stale_producer_epoch", producer="py-test", current=9, got=7))
    resolutions, _ = core.failed(batch, fenced, written=True, now=1.0)
    assert len(resolutions) == 2 and all(isinstance(r[1], ProducerFencedError) for r in resolutions)
    assert core.fatal is fenced and core.buffered == 0
    assert core.poll(A, 5.0) == (None, None)


def test_delivery_future_behaves_like_a_future() -> None:
    import threading
    from concurrent.futures import InvalidStateError, as_completed

    from cursus.client.producer import DeliveryFuture, _resolve_sync

    untouched, waited, called, cancelled = (DeliveryFuture() for _ in range(4))
    seen: list[object] = []
    called.add_done_callback(lambda f: seen.append(f.result()))
    assert cancelled.cancel()
    results: list[object] = []
    waiter = threading.Thread(target=lambda: results.append(waited.result(timeout=5)))
    waiter.start()
    _resolve_sync([(untouched, 1, False), (waited, 2, False), (called, 3, False), (cancelled, 4, False)])
    waiter.join(timeout=5)
    assert untouched.result() == 1 and untouched.done() and results == [2] and seen == [3]
    assert cancelled.cancelled()
    failed = DeliveryFuture()
    _resolve_sync([(failed, ValueError("boom"), True)])
    assert isinstance(failed.exception(), ValueError)
    assert set(as_completed([untouched, failed], timeout=1)) == {untouched, failed}
    with pytest.raises(InvalidStateError):
        untouched.set_result(5)
    with pytest.raises(AttributeError):
        _ = untouched.no_such_attribute  # type: ignore[attr-defined]


def test_a_delivered_batch_resolves_its_futures_through_one_shared_delivery() -> None:
    """_resolve_delivered (issue 11): untouched futures get the batch's Delivery and their index, and read
    as ordinary done futures once touched; futures touched before (waited on, with callbacks, cancelled)
    resolve as with set_result."""
    import asyncio
    import threading
    from concurrent.futures import wait

    from cursus.client.producer import Delivery, DeliveryFuture, _resolve_delivered

    untouched, later, waited, called, cancelled = (DeliveryFuture(b"v", topic="t") for _ in range(5))
    seen: list[object] = []
    called.add_done_callback(lambda f: seen.append(f.result()))
    assert cancelled.cancel()
    results: list[object] = []
    waiter = threading.Thread(target=lambda: results.append(waited.result(timeout=5)))
    waiter.start()
    delivery = Delivery("t", 2, 40, "pid", 7, 11)
    _resolve_delivered([untouched, later, waited, called, cancelled], delivery)
    waiter.join(timeout=5)
    assert not waiter.is_alive()
    expected = [RecordMetadata("t", 2, 40 + i, "pid", 7, 11 + i) for i in range(5)]
    assert untouched.result() == expected[0] and untouched.done() and untouched.exception() is None
    assert results == [expected[2]] and seen == [expected[3]] and cancelled.cancelled()
    assert untouched.value == b""  # the batch keeps the encoded bytes; the future lets the value go
    assert wait([later], timeout=1).done == {later} and later.result() == expected[1]
    late: list[object] = []
    later.add_done_callback(late.append)  # already done: called at once
    assert late == [later]

    async def awaited() -> object:
        return await asyncio.wrap_future(untouched)

    assert asyncio.run(awaited()) == expected[0]
    unacked = DeliveryFuture()
    _resolve_delivered([unacked], Delivery("t", 0, None, "pid", 0, 1))  # acks=0: no offsets
    assert unacked.result(timeout=0).offset is None


def test_redirect_to_the_same_broker_backs_off() -> None:
    core = _core()
    _send(core, b"a", partition=0)
    batch, _ = core.poll(A, 1.0)
    same = error_from_typed(make_error("NOT_LEADER", leader="broker-a:9000"))
    assert core.failed(batch, same, written=True, now=1.0) == ([], None)
    assert core.poll(A, 1.0) == (None, pytest.approx(0.1))


# ------------------------------------------------------------------------------- pipelined in-flight batches

S1, S2 = object(), object()  # two senders (connections)


def _window(core: ProducerCore, sender: object, room: int = 5, now: float = 1.0) -> list:
    """Every batch ``sender`` may write now (as a sender fills its window)."""
    batches = []
    while len(batches) < room:
        batch, _ = core.poll(A, now, sender, room - len(batches))
        if batch is None:
            break
        batches.append(batch)
    return batches


def _fill(core: ProducerCore, count: int, per_batch: int, partition: int = 0) -> None:
    for i in range(count * per_batch):
        _send(core, b"%d" % i, partition=partition)


def test_batches_of_one_partition_pipeline_on_one_sender_up_to_max_in_flight() -> None:
    core = _core(idempotent=True, batch_size=2)
    _fill(core, 7, 2)
    first = _window(core, S1)
    assert [b.seq_start for b in first] == [1, 3, 5, 7, 9]  # max_in_flight 5, contiguous sequences
    assert _window(core, S2) == []  # pinned to the sender carrying its batches: order on one connection
    assert core.poll(A, 1.0, S1, 1) == (None, None)  # the partition's window is full
    core.succeed(first[0], 1)
    assert [b.seq_start for b in _window(core, S1)] == [11]
    for n, batch in enumerate(first[1:], 1):
        core.succeed(batch, 2 * n + 1)
    assert core.buffered == 4


def test_a_retriable_failure_resends_it_and_every_later_batch_in_order_once_replies_are_in() -> None:
    core = _core(idempotent=True, batch_size=1)
    _fill(core, 4, 1)
    b1, b2, b3, b4 = _window(core, S1)
    core.succeed(b1, 0)
    # b2: an acks=all timeout (outcome unknown); b3 is refused because b2 is missing; b4's connection dropped
    unknown = error_from_typed(make_error("replication_unavailable", reason="replica timeout", outcome="unknown"))
    assert core.failed(b2, unknown, written=True, now=1.0) == ([], None)
    gap = error_from_typed(make_error("idempotency_gap", producer="py-test", expected=2, got=3))
    assert core.failed(b3, gap, written=True, now=1.0) == ([], None)  # not terminal: behind a retry
    assert core.fatal is None
    assert core.poll(A, 5.0, S1, 5) == (None, None)  # b4 is still in flight: no resend before its reply
    assert core.failed(b4, ConnectionResetError(), written=True, now=1.0) == ([], None)
    assert core.poll(A, 5.0, S2, 5)[0] is b2  # nothing in flight: any sender may resend, oldest first
    assert core.poll(A, 5.0, S2, 5) == (None, None)  # one resend at a time
    dup = core.succeed(b2, 1)  # the broker had appended b2: a duplicate ack with its original offset
    assert [m.offset for _, m, _ in dup] == [1]
    assert core.poll(A, 5.0, S2, 5)[0] is b3
    core.succeed(b3, 2)
    assert core.poll(A, 5.0, S2, 5)[0] is b4
    core.succeed(b4, 3)
    assert core.buffered == 0 and core.take_failures() is None
    _send(core, b"next", partition=0)
    assert core.poll(A, 5.0, S1, 5)[0].seq_start == 5


def test_a_gap_without_an_earlier_failure_is_still_terminal() -> None:
    core = _core(idempotent=True, batch_size=1)
    _fill(core, 2, 1)
    b1, b2 = _window(core, S1)
    core.succeed(b1, 0)
    gap = error_from_typed(make_error("idempotency_gap", producer="py-test", expected=5, got=2))
    core.failed(b2, gap, written=True, now=1.0)
    assert core.fatal is gap


def test_a_final_failure_fails_the_later_unacknowledged_batches_and_restarts_after_the_last_ack() -> None:
    core = _core(idempotent=True, batch_size=1)
    _fill(core, 4, 1)
    b1, b2, b3, b4 = _window(core, S1)
    core.succeed(b1, 0)
    refused = error_from_typed(make_error("invalid_topic_config"))  # not retryable, nothing appended
    resolutions, _ = core.failed(b2, refused, written=True, now=1.0)
    assert len(resolutions) == 1 and resolutions[0][2]
    gap = error_from_typed(make_error("idempotency_gap", producer="py-test", expected=2, got=3))
    resolutions, _ = core.failed(b3, gap, written=True, now=1.0)  # behind the failed batch: fails, not fatal
    assert len(resolutions) == 1 and core.fatal is None
    _send(core, b"later", partition=0)
    assert core.poll(A, 1.0, S1, 5) == (None, None)  # the partition settles first
    resolutions, _ = core.failed(b4, gap, written=True, now=1.0)
    assert len(resolutions) == 1 and core.fatal is None
    again, _ = core.poll(A, 1.0, S1, 5)
    assert again.seq_start == 2  # right after the last acknowledged sequence: no gap at the broker
    assert core.take_failures().failed_count == 3


def test_without_idempotence_a_batch_is_never_resent_behind_a_later_acknowledged_one() -> None:
    core = _core(batch_size=1)
    _fill(core, 2, 1)
    b1, b2 = _window(core, S1)
    refusal = error_from_typed(make_error("leader_not_available", topic="t", partition="0"))
    assert core.failed(b1, refusal, written=True, now=1.0) == ([], None)  # b2's outcome decides
    assert core.poll(A, 2.0, S1, 5) == (None, None)  # no resend while b2 is in flight
    resolutions = list(core.succeed(b2, 0))  # b2 is in the log: resending b1 now would reorder
    assert [(token, error) for token, error, failed in resolutions if failed] == [(b1.pendings[0].future, refusal)]
    assert core.poll(A, 2.0, S1, 5) == (None, None) and core.buffered == 0
    assert core.take_failures().failed_count == 1


def test_without_idempotence_a_refused_batch_fails_when_a_later_one_may_be_in_the_log() -> None:
    core = _core(batch_size=1)
    _fill(core, 3, 1)
    b1, b2, b3 = _window(core, S1)
    refusal = error_from_typed(make_error("leader_not_available", topic="t", partition="0"))
    assert core.failed(b1, refusal, written=True, now=1.0) == ([], None)
    resolutions, _ = core.failed(b2, ConnectionResetError(), written=True, now=1.0)  # outcome unknown
    assert [type(error) for _, error, _ in resolutions] == [DeliveryUnknownError, type(refusal)]
    assert [token for token, _, _ in resolutions] == [b2.pendings[0].future, b1.pendings[0].future]
    assert core.failed(b3, refusal, written=True, now=1.0) == ([], None)  # b3 is after b2: may still go
    assert core.poll(A, 2.0, S1, 5)[0] is b3


def test_without_idempotence_pipelined_redirects_are_all_resent_in_order_at_the_new_leader() -> None:
    core = _core(batch_size=1)
    _fill(core, 3, 1)
    window = _window(core, S1)
    redirect = error_from_typed(make_error("NOT_LEADER", leader="broker-b:9000"))
    for batch in window:  # all refused: nothing of the partition was appended anywhere
        assert core.failed(batch, redirect, written=True, now=1.0) == ([], B)
    assert core.poll(A, 1.0, S1, 5) == (None, None)
    for offset, batch in enumerate(window):  # one at a time, in order, none backing off (a new leader)
        assert core.poll(B, 1.0, S2, 5)[0] is batch
        assert core.poll(B, 1.0, S2, 5) == (None, None)
        core.succeed(batch, offset)
    assert core.buffered == 0 and core.take_failures() is None
    # a later batch refused for good (never written) does not stop an earlier refused one
    _fill(core, 2, 1)
    b1, b2 = core.poll(B, 1.0, S2, 5)[0], core.poll(B, 1.0, S2, 4)[0]
    back = error_from_typed(make_error("NOT_LEADER", leader="broker-a:9000"))
    assert core.failed(b1, back, written=True, now=1.0) == ([], A)
    refused = error_from_typed(make_error("invalid_topic_config"))  # not retryable, nothing appended
    resolutions, _ = core.failed(b2, refused, written=True, now=1.0)
    assert [token for token, _, _ in resolutions] == [b2.pendings[0].future]
    assert core.poll(A, 1.0, S1, 5)[0] is b1


def test_max_in_flight_is_bounded_for_idempotent_producers() -> None:
    with pytest.raises(ValueError):
        ProducerConfig.build(acks=None, idempotent=True, batch_size=1, batch_bytes=1, linger_ms=0,
                             connections_per_broker=1, buffer_records=1, max_block_s=1, delivery_timeout_s=1,
                             request_timeout_s=1, backoff=Backoff(), producer_id=None, producer_epoch=None,
                             id_prefix="py-", max_in_flight=6)
    assert ProducerConfig.build(acks="1", idempotent=False, batch_size=1, batch_bytes=1, linger_ms=0,
                                connections_per_broker=1, buffer_records=1, max_block_s=1, delivery_timeout_s=1,
                                request_timeout_s=1, backoff=Backoff(), producer_id=None, producer_epoch=None,
                                id_prefix="py-", max_in_flight=20).max_in_flight == 20


def test_not_leader_with_an_unknown_outcome_is_never_resent_without_idempotence() -> None:
    """Break-it finding: an acks=all PUBLISH appended by a leader that lost the partition while it waited
    answered a plain ``NOT_LEADER``, which the producer took for a refusal and resent to the new leader, which
    may already hold the batch (a silent duplicate). The broker now says ``outcome=unknown``: without
    idempotence the batch fails with ``DeliveryUnknownError`` (the partition still moves); with idempotence
    it is resent to the new leader (the broker de-duplicates)."""
    unknown = error_from_typed(make_error("NOT_LEADER", leader="broker-b:9000", outcome="unknown"))
    core = _core()
    _send(core, b"a", partition=1)
    batch, _ = core.poll(A, 1.0)
    resolutions, redirect = core.failed(batch, unknown, written=True, now=1.0)
    assert isinstance(resolutions[0][1], DeliveryUnknownError)
    assert core.leader_of("t", 1) == B
    assert core.poll(B, 1.0) == (None, None)  # not resent
    core = _core(idempotent=True)
    _send(core, b"a", partition=1)
    batch, _ = core.poll(A, 1.0)
    assert core.failed(batch, unknown, written=True, now=1.0) == ([], B)
    assert core.poll(B, 1.0)[0] is batch
