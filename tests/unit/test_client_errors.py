"""Typed broker errors become the SDK exception of their class (and code), carrying code/fields/retryable."""

from __future__ import annotations

import pickle

import pytest

from cursus.client import errors as e
from cursus.wire import Command, ErrorClass, Frame, Kind, Status, TypedError, encode_error, make_error


def _frame(err: TypedError) -> Frame:
    return Frame(Kind.RESPONSE, Command.PUBLISH, Status.ERROR, 7, encode_error(err), None)


@pytest.mark.parametrize(("code", "cls"), [
    ("invalid_acks", e.ValidationError),
    ("NOT_AUTHORIZED_FOR_TOPIC", e.AuthorizationError),
    ("authentication_required", e.AuthenticationError),
    ("NOT_LEADER", e.NotLeaderError),
    ("NOT_COORDINATOR", e.NotCoordinatorError),
    ("insufficient_in_sync_replicas", e.AvailabilityError),
    ("OFFSET_OUT_OF_RANGE", e.OffsetOutOfRangeError),
    ("stale_producer_epoch", e.ProducerFencedError),
    ("producer_fenced", e.ProducerFencedError),
    ("idempotency_gap", e.SequenceError),
    ("topic_not_found", e.TopicNotFoundError),
    ("partition_not_found", e.NotFoundError),
    ("UNSUPPORTED_FEATURE", e.UnsupportedFeatureError),
    ("create_topic_failed", e.InternalError),
])
def test_registry_codes_map_to_their_exception(code: str, cls: type[e.CursusError]) -> None:
    typed = make_error(code, "some words", topic="t")
    exc = e.error_from_frame(_frame(typed))
    assert type(exc) is cls
    assert exc.code == code and exc.error_class == typed.error_class and exc.retryable == typed.retryable
    assert exc.fields == {"topic": "t"} and exc.message == "some words"
    assert str(exc) == typed.render()


def test_specific_class_is_used_only_when_the_class_matches() -> None:
    # A broker that classifies NOT_LEADER as availability still gets an AvailabilityError (class wins).
    exc = e.error_from_typed(TypedError("NOT_LEADER", ErrorClass.AVAILABILITY, True, "", {}))
    assert type(exc) is e.AvailabilityError


def test_redirect_and_range_fields() -> None:
    leader = e.error_from_typed(make_error("NOT_LEADER", leader="10.0.0.5:9000"))
    assert isinstance(leader, e.NotLeaderError) and leader.leader == ("10.0.0.5", 9000)
    assert e.error_from_typed(make_error("NOT_LEADER")).leader is None
    coord = e.error_from_typed(make_error("NOT_COORDINATOR", host="b2", port=9001))
    assert isinstance(coord, e.NotCoordinatorError) and coord.coordinator == ("b2", 9001)
    oor = e.error_from_typed(make_error("OFFSET_OUT_OF_RANGE", requested=50, earliest=3, latest=9))
    assert isinstance(oor, e.OffsetOutOfRangeError)
    assert (oor.requested, oor.earliest, oor.latest) == (50, 3, 9)


def test_undecodable_error_payload_is_a_protocol_violation() -> None:
    frame = Frame(Kind.RESPONSE, Command.LIST, Status.ERROR, 1, b"\x00\x00", None)
    assert isinstance(e.error_from_frame(frame), e.ProtocolViolationError)
    with pytest.raises(ValueError):
        e.error_from_frame(Frame(Kind.RESPONSE, Command.LIST, Status.OK, 1, b"OK", None))


def test_ack_json_errors() -> None:
    exc = e.error_from_ack({"status": "ERROR", "error": "ERROR: idempotency_gap expected=5", "error_code":
                            "idempotency_gap", "error_class": "conflict", "retryable": False,
                            "error_fields": {"expected": 5}})
    assert isinstance(exc, e.SequenceError) and exc.fields == {"expected": "5"}
    fallback = e.error_from_ack({"status": "ERROR", "error": "ERROR: insufficient_in_sync_replicas isr=1"})
    assert isinstance(fallback, e.AvailabilityError) and fallback.retryable


def test_client_side_errors() -> None:
    assert e.BrokerUnavailableError("x").retryable and e.BrokerUnavailableError("x").code == "broker_unavailable"
    timeout = e.RequestTimeoutError("slow")
    assert isinstance(timeout, TimeoutError) and isinstance(timeout, e.AvailabilityError)
    assert not e.DeliveryUnknownError("?").retryable
    failed = e.DeliveryFailedError([e.error_from_typed(make_error("message_too_large"))], 3)
    assert failed.failed_count == 3 and failed.error_class == ErrorClass.VALIDATION and "3 record" in str(failed)


def test_errors_pickle_round_trip() -> None:
    for exc in (e.error_from_typed(make_error("NOT_LEADER", leader="h:1")), e.RequestTimeoutError("t"),
                e.ClientClosedError("c")):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and back.render() == exc.render()
