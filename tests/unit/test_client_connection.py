"""Sans-IO pieces of the transport and reply parsing: addresses, backoff, retry decisions, reply fields."""

from __future__ import annotations

import random

import pytest

from cursus.cli.ctl import parse_duration
from cursus.client.admin import create_fields, parse_list_offsets, parse_metadata, parse_topic_config
from cursus.client.connection import (
    Attempts,
    Backoff,
    ConnectionOptions,
    compression_of,
    negotiation_offers,
    ok_text_fields,
    parse_address,
)
from cursus.client.errors import (
    BrokerUnavailableError,
    DeliveryUnknownError,
    ProtocolViolationError,
    RequestTimeoutError,
    error_from_typed,
)
from cursus.wire import Compression, ProtocolError, make_error


def test_parse_address() -> None:
    assert parse_address("broker-1:9000") == ("broker-1", 9000)
    assert parse_address("localhost") == ("localhost", 9000)
    assert parse_address("[::1]:9100") == ("::1", 9100)
    assert parse_address("fe80::1:9100") == ("fe80::1", 9100)  # split on the last colon (facts A1)
    for bad in ("", ":9000", "host:port", "host:70000"):
        with pytest.raises(ValueError):
            parse_address(bad)


def test_negotiation_offers_and_compression_names() -> None:
    assert negotiation_offers(Compression.NONE) == (Compression.NONE,)
    assert negotiation_offers(Compression.GZIP) == (Compression.GZIP, Compression.NONE)
    assert compression_of("LZ4") == Compression.LZ4 and compression_of(None) == Compression.NONE
    with pytest.raises(ValueError):
        compression_of("zstd")


def test_backoff_is_exponential_jittered_and_capped() -> None:
    backoff = Backoff(initial_s=0.1, max_s=1.0, multiplier=2.0, jitter=0.5)
    rng = random.Random(1)
    for attempt in range(20):
        base = min(1.0, 0.1 * 2**attempt)
        delay = backoff.delay_s(attempt, rng)
        assert base * 0.5 <= delay <= base
    assert Backoff(jitter=0).delay_s(3) == pytest.approx(0.4)
    with pytest.raises(ValueError):
        Backoff(initial_s=2, max_s=1)


def _attempts(retry_safe: bool, attempts_max: int = 2) -> Attempts:
    options = ConnectionOptions(backoff=Backoff(attempts_max=attempts_max, jitter=0))
    return Attempts(("a", 1), options, retry_safe, "TEST")


def test_connect_failures_retry_then_raise_unavailable() -> None:
    attempts = _attempts(retry_safe=False)
    assert attempts.after_connect_failure(ConnectionRefusedError()) == pytest.approx(0.05)
    assert attempts.after_connect_failure(ConnectionRefusedError()) == pytest.approx(0.1)
    with pytest.raises(BrokerUnavailableError):
        attempts.after_connect_failure(ConnectionRefusedError())


def test_transport_failure_after_write_depends_on_safety() -> None:
    assert _attempts(retry_safe=True).after_transport_failure(ConnectionResetError()) > 0
    with pytest.raises(DeliveryUnknownError):
        _attempts(retry_safe=False).after_transport_failure(ConnectionResetError())
    with pytest.raises(DeliveryUnknownError) as unknown:  # it may have been applied: never retryable
        _attempts(retry_safe=False).after_transport_failure(TimeoutError())
    assert not unknown.value.retryable and unknown.value.fields == {"reason": "timeout"}
    retry_safe = _attempts(retry_safe=True, attempts_max=1)
    assert retry_safe.after_transport_failure(TimeoutError()) > 0
    with pytest.raises(RequestTimeoutError):
        retry_safe.after_transport_failure(TimeoutError())
    with pytest.raises(ProtocolViolationError):  # never retried: the peer speaks something else
        _attempts(retry_safe=True).after_transport_failure(ProtocolError("bad magic"))


def test_error_replies_redirect_or_retry_only_when_safe() -> None:
    attempts = _attempts(retry_safe=False)
    assert attempts.after_error_reply(error_from_typed(make_error("NOT_LEADER", leader="b:2"))) is None
    assert attempts.target == ("b", 2)
    assert attempts.after_error_reply(error_from_typed(make_error("NOT_COORDINATOR", host="c", port=3))) is None
    assert attempts.target == ("c", 3)
    unavailable = error_from_typed(make_error("coordinator_not_available"))
    with pytest.raises(type(unavailable)):
        attempts.after_error_reply(unavailable)  # retryable, but the request is not safe to repeat
    assert _attempts(retry_safe=True).after_error_reply(unavailable) == pytest.approx(0.05)
    with pytest.raises(type(error_from_typed(make_error("topic_not_found")))):
        _attempts(retry_safe=True).after_error_reply(error_from_typed(make_error("topic_not_found")))
    no_follow = Attempts(("a", 1), ConnectionOptions(), True, "T", follow_redirects=False)
    with pytest.raises(type(error_from_typed(make_error("NOT_LEADER")))):
        no_follow.after_error_reply(error_from_typed(make_error("NOT_LEADER", leader="b:2")))


def test_a_redirect_with_an_unknown_outcome_is_followed_only_when_safe_to_repeat() -> None:
    """Break-it finding: an old leader that appended a request and lost the partition before acknowledging it
    answers ``NOT_LEADER outcome=unknown``; following that redirect with a request that is not retry-safe
    (APPEND_STREAM, text PUBLISH) could apply it twice. It raises ``DeliveryUnknownError``; a read follows."""
    unknown = error_from_typed(make_error("NOT_LEADER", leader="b:2", outcome="unknown"))
    attempts = _attempts(retry_safe=False)
    with pytest.raises(DeliveryUnknownError) as raised:
        attempts.after_error_reply(unknown)
    assert raised.value.fields["outcome"] == "unknown" and not raised.value.retryable
    assert attempts.target == ("a", 1)
    safe = _attempts(retry_safe=True)
    assert safe.after_error_reply(unknown) is None and safe.target == ("b", 2)


def test_redirects_are_bounded() -> None:
    attempts = Attempts(("a", 1), ConnectionOptions(redirects_max=2), True, "T")
    err = error_from_typed(make_error("NOT_LEADER", leader="b:2"))
    attempts.after_error_reply(err)
    attempts.after_error_reply(err)
    with pytest.raises(type(err)):
        attempts.after_error_reply(err)


def test_ok_text_fields() -> None:
    assert ok_text_fields('OK topic=t deleted=true note="quoted" stray') == \
        {"topic": "t", "deleted": "true", "note": "quoted"}
    assert ok_text_fields("OK") == {}
    with pytest.raises(ValueError):
        ok_text_fields("OKAY")


def test_reply_parsers() -> None:
    offsets = parse_list_offsets({"offsets": "P0:earliest=0:latest=5:leo=6:hwm=5,P2:earliest=1:latest=1:leo=1:hwm=1"})
    assert [(o.partition, o.earliest, o.latest, o.leo, o.hwm) for o in offsets] == [(0, 0, 5, 6, 5), (2, 1, 1, 1, 1)]
    with pytest.raises(ProtocolViolationError):
        parse_list_offsets({"offsets": "P0:earliest=0:latest=5"})
    meta = parse_metadata({"leaders": "h:1,h:2", "epochs": "3,4", "partitioner": "round_robin"}, "t")
    assert meta.partitions == 2 and meta.leader_address(1) == ("h", 2) and meta.epochs == (3, 4)
    assert meta.leader_address(5) is None and meta.topic == "t"
    config = parse_topic_config({"topic": "t", "partitions": "3", "min_in_sync_replicas": "default",
                                 "effective_min_in_sync_replicas": "1", "read_acl": "a,b", "future": "x"})
    assert config.min_in_sync_replicas is None and config.read_acl == ("a", "b") and config.extra == {"future": "x"}
    assert create_fields("t", 3, idempotent=True, read_acl=["a", "b"], retention_hours=None) == \
        {"topic": "t", "partitions": "3", "idempotent": "true", "read_acl": "a,b"}


def test_cli_durations() -> None:
    assert parse_duration("10s") == 10 and parse_duration("500ms") == 0.5 and parse_duration("2m") == 120
    assert parse_duration("1.5") == 1.5
    for bad in ("0", "ten", "5 parsecs"):
        with pytest.raises(Exception):  # noqa: B017 (argparse.ArgumentTypeError)
            parse_duration(bad)


def test_connect_failures_rotate_through_the_bootstrap_list() -> None:
    """One rotation rule for the blocking and the asyncio client (it used to be written twice)."""
    boot = [("a", 1), ("b", 2), ("c", 3)]
    options = ConnectionOptions(backoff=Backoff(initial_s=0.01, max_s=0.01, attempts_max=4, jitter=0))
    attempts = Attempts(boot[0], options, True, "T", rotation=boot)
    seen = [attempts.target]
    for _ in range(4):
        attempts.after_connect_failure(ConnectionRefusedError())
        seen.append(attempts.target)
    assert seen == [boot[0], boot[1], boot[2], boot[0], boot[1]]
    with pytest.raises(BrokerUnavailableError):
        attempts.after_connect_failure(ConnectionRefusedError())
    redirected = Attempts(("elsewhere", 9), options, True, "T", rotation=boot)
    redirected.after_connect_failure(ConnectionRefusedError())
    assert redirected.target == boot[0]
    pinned = Attempts(("a", 1), options, True, "T")
    pinned.after_connect_failure(ConnectionRefusedError())
    assert pinned.target == ("a", 1)
