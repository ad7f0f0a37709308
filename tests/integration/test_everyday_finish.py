"""Issue 19, the last pieces of everyday use, each against a real standalone broker: idle connections, topic
alter, produce progress, TLS messages, group lag from partition leaders, producer sequences after a delivery
timeout, multi-topic and pattern group consumers."""

from __future__ import annotations

import asyncio
import json
import os
import select
import subprocess
import sys
import time

import pytest

from cursus.client import (
    Admin,
    AsyncAdmin,
    AsyncGroupConsumer,
    AsyncProducer,
    Client,
    ConflictError,
    Consumer,
    DeliveryFailedError,
    DeliveryUnknownError,
    GroupConsumer,
    Producer,
    TlsError,
)
from cursus.client.connection import Backoff, make_ssl_context
from cursus.wire import Command
from tests.certs import make_pki
from tests.integration.conftest import connect
from tests.integration.helpers import create_topic

pytestmark = pytest.mark.timeout(90)


def _create(broker, topic: str, partitions: int = 1) -> None:
    with connect(broker) as conn:
        create_topic(conn, topic, partitions=partitions)


def _wait_closed_by_broker(broker, timeout_s: float = 10.0) -> None:
    """Open a sentinel connection now and wait until the broker closes it for idleness: every connection
    idle since before this call is closed by then too."""
    with connect(broker) as sentinel:
        readable, _, _ = select.select([sentinel.sock], [], [], timeout_s)
        assert readable and sentinel.sock.recv(1) == b"", "the broker did not close the idle connection"


# ------------------------------------------------------------------------------ idle connections


def test_idle_timeout_default_is_ten_minutes():
    from cursus.broker.config import load_config
    assert load_config(environ={}).client_idle_timeout_ms == 600_000


def test_sdk_reopens_connections_the_broker_closed_for_idleness(broker_factory, topic_name):
    broker = broker_factory(settings={"client_idle_timeout_ms": 300}).start()
    _create(broker, topic_name)
    with Client(broker.bootstrap) as client, \
            Producer(broker.bootstrap, acks=1) as producer:
        client.call(Command.LIST)
        producer.send(topic_name, b"before").result(timeout=10)
        _wait_closed_by_broker(broker)
        # not retry-safe: on the closed connection it would fail as DeliveryUnknownError
        client.call(Command.CREATE, {"topic": f"{topic_name}-2", "partitions": "1"}, retry_safe=False)
        assert producer.send(topic_name, b"after").result(timeout=10).offset == 1

    async def run() -> None:
        async with AsyncProducer(broker.bootstrap, acks=1) as aproducer:
            await (await aproducer.send(topic_name, b"async-before"))
            await asyncio.to_thread(_wait_closed_by_broker, broker)
            assert (await (await aproducer.send(topic_name, b"async-after"))).offset == 3

    asyncio.run(run())


# ------------------------------------------------------------------------------ idempotent sequence after a timeout


def test_idempotent_producer_restarts_sequence_after_unknown_outcome(broker_factory, topic_name):
    """Break-it 5b: a batch that times out with an unknown outcome must not leave a sequence gap. The broker is
    paused (the batch sits unread in its socket buffer), the delivery times out, the broker is killed (the
    batch is lost) and restarted: the next record is accepted (new epoch, sequence 1), never refused as a gap."""
    broker = broker_factory().start()
    _create(broker, topic_name)
    with Producer(broker.bootstrap, idempotent=True, linger_ms=0, delivery_timeout_s=1.5,
                  request_timeout_s=0.3, timeout_s=0.3) as producer:
        first = producer.send(topic_name, b"r1").result(timeout=10)
        assert first.seq_num == 1
        broker.pause()
        try:
            lost = producer.send(topic_name, b"r2")
            with pytest.raises(DeliveryUnknownError):
                lost.result(timeout=20)
            with pytest.raises(DeliveryFailedError):
                producer.flush()  # reports (and clears) the failure
        finally:
            broker.kill()
        broker.start()
        after = producer.send(topic_name, b"r3").result(timeout=20)
        assert (after.producer_epoch, after.seq_num) == (first.producer_epoch + 1, 1)
        assert producer.send(topic_name, b"r4").result(timeout=10).seq_num == 2
    with Consumer(topic_name, broker.bootstrap) as consumer:
        values = [r.value for r in consumer.records(until_end=True)]
    assert values == [b"r1", b"r3", b"r4"]


# ------------------------------------------------------------------------------ cursusctl topic alter, produce progress


def ctl(broker, *args: str, stdin=None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CURSUS_BROKER": broker.bootstrap}
    return subprocess.run([sys.executable, "-m", "cursus.cli.ctl", *args], stdin=stdin, capture_output=True,
                          text=True, env=env, timeout=60)


def test_topic_alter_covers_every_mutable_setting(shared_broker, topic_name):
    broker = shared_broker
    assert ctl(broker, "topic", "create", topic_name, "--partitions", "1").returncode == 0
    done = ctl(broker, "--json", "topic", "alter", topic_name, "--partitions", "3", "--retention-hours", "5",
               "--retention-bytes", "4096", "--cleanup-policy", "delete", "--partitioner", "round_robin",
               "--min-isr", "1")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["result"] == "updated"
    assert (doc["partitions"], doc["retention_hours"], doc["retention_bytes"], doc["partitioner"],
            doc["cleanup_policy"], doc["min_in_sync_replicas"]) == (3, 5, 4096, "round_robin", "delete", 1)
    again = json.loads(ctl(broker, "--json", "topic", "alter", topic_name, "--partitions", "3").stdout)
    assert again["result"] == "unchanged" and again["revision"] == doc["revision"]
    reset = json.loads(ctl(broker, "--json", "topic", "alter", topic_name, "--min-isr", "default").stdout)
    assert reset["min_in_sync_replicas"] is None and reset["partitions"] == 3
    shrink = ctl(broker, "topic", "alter", topic_name, "--partitions", "2")
    assert shrink.returncode != 0 and "partitions" in shrink.stderr
    missing = ctl(broker, "topic", "alter", f"{topic_name}-missing", "--retention-hours", "1")
    assert missing.returncode != 0 and "topic_not_found" in missing.stderr
    with Admin(broker.bootstrap) as admin:
        assert f"{topic_name}-missing" not in admin.list_topics()  # alter never creates
        assert admin.alter_topic(topic_name, retention_hours=0).retention_hours == 0
        with pytest.raises(TypeError):
            admin.alter_topic(topic_name, idempotent=True)  # type: ignore[call-arg]
    nothing = ctl(broker, "topic", "alter", topic_name)
    assert nothing.returncode == 2 and "at least one setting" in nothing.stderr


def test_produce_progress_shows_total_and_percentage_when_the_size_is_known(shared_broker, topic_name, tmp_path):
    broker = shared_broker
    path = tmp_path / "lines.txt"
    path.write_text("".join(f"record-{i}\n" for i in range(2500)))
    size = path.stat().st_size
    assert ctl(broker, "topic", "create", topic_name, "--partitions", "2").returncode == 0
    by_file = ctl(broker, "--json", "produce", topic_name, "--file", str(path), "--progress", "lines")
    assert by_file.returncode == 0, by_file.stderr
    last = by_file.stderr.strip().splitlines()[-1]
    assert "2,500 records" in last and "(100%)" in last and " of " in last, by_file.stderr
    summary = json.loads(by_file.stdout)
    assert (summary["records"], summary["failed"], summary["input_bytes"], summary["input_size"]) == \
        (2500, 0, size, size)
    with open(path, "rb") as sized_stdin:  # stdin redirected from a file: its size is known too
        by_stdin = ctl(broker, "produce", topic_name, "--progress", "lines", stdin=sized_stdin)
    assert by_stdin.returncode == 0 and "(100%)" in by_stdin.stderr
    assert "records" in by_stdin.stdout and "2500" in by_stdin.stdout.replace(",", "")  # the summary line
    piped = subprocess.run(
        [sys.executable, "-m", "cursus.cli.ctl", "--json", "produce", topic_name, "--progress", "lines"],
        input="a\nb\n", capture_output=True, text=True, timeout=60,
        env={**os.environ, "CURSUS_BROKER": broker.bootstrap})
    assert piped.returncode == 0 and "2 records" in piped.stderr and "%" not in piped.stderr
    assert "input_size" not in json.loads(piped.stdout)


# ------------------------------------------------------------------------------ group lag from the partition leaders


def test_group_offsets_use_the_partition_leaders_list_offsets(shared_broker, topic_name):
    broker = shared_broker
    group = f"g-{topic_name}"
    with connect(broker) as conn:
        create_topic(conn, topic_name, partitions=2)
    with Producer(broker.bootstrap, acks=1) as producer:
        for i in range(12):
            producer.send(topic_name, f"v{i}".encode(), partition=i % 2)
    with GroupConsumer(topic_name, group, broker.bootstrap, auto_commit=False) as consumer:
        got = []
        while len(got) < 12:
            got.extend(consumer.poll(5))
        consumer.commit({0: 2, 1: 6})
        with Admin(broker.bootstrap) as admin:
            bounds = {b.partition: b for b in admin.list_offsets(topic_name)}
            rows = {o.partition: o for o in admin.group_offsets(group)}
            assert {p: (o.committed, o.log_end, o.lag) for p, o in rows.items()} == \
                {0: (2, bounds[0].hwm, bounds[0].hwm - 2), 1: (6, bounds[1].hwm, 0)}
            assert admin.group_lag(group) == 4
        shown = ctl(broker, "--json", "group", "offsets", group)
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    assert doc["total_lag"] == 4 and [o["log_end_offset"] for o in doc["offsets"]] == [6, 6]


# ------------------------------------------------------------------------------ TLS messages, no retries, broker log


def _log_lines(broker, needle: str) -> list[str]:
    return [line for line in broker.output().splitlines() if needle in line]


def test_tls_failures_are_specific_not_retried_and_logged_by_the_broker(broker_factory, tmp_path):
    pki = make_pki(tmp_path / "pki")
    other = make_pki(tmp_path / "other", name="other")
    broker = broker_factory(settings={"use_tls": "true", "tls_cert_path": pki.server_cert,
                                      "tls_key_path": pki.server_key, "tls_ca_path": pki.ca}).start()
    address = broker.bootstrap
    plain_broker = broker_factory("plain").start()
    mtls = make_ssl_context(str(pki.ca), str(pki.client_cert), str(pki.client_key))
    with Admin(address, ssl_context=mtls) as admin:
        admin.list_topics()  # the right configuration works

    cases = [
        ({}, "tls_required", "the server requires TLS"),
        ({"ssl_context": make_ssl_context(str(pki.ca))}, "tls_client_certificate_required",
         "client certificate required"),
        ({"ssl_context": make_ssl_context(str(other.ca), str(pki.client_cert), str(pki.client_key))},
         "tls_certificate_verify_failed", "failed verification"),
        # a client certificate another CA signed (TLS 1.3: the server's alert comes after the handshake)
        ({"ssl_context": make_ssl_context(str(pki.ca), str(other.client_cert), str(other.client_key))},
         "tls_client_certificate_refused", "refused the client certificate"),
    ]
    for overrides, code, text in cases:
        started = time.monotonic()
        with Admin(address, backoff=Backoff(initial_s=0.5, attempts_max=8), **overrides) as admin, \
                pytest.raises(TlsError) as caught:
            admin.list_topics()
        assert caught.value.code == code and text in str(caught.value) and not caught.value.retryable
        assert time.monotonic() - started < 2.0, f"{code} was retried"  # 8 retries would take > 4 s

    async def async_case() -> str:
        async with AsyncAdmin(address, backoff=Backoff(initial_s=0.5, attempts_max=8)) as admin:
            try:
                await admin.list_topics()
            except TlsError as exc:
                return exc.code
        return "no error"
    assert asyncio.run(async_case()) == "tls_required"

    # cursusctl: the message says what to do; a missing file is named
    tls_ctl = ctl(broker, "topic", "list")
    assert tls_ctl.returncode == 1 and "the server requires TLS" in tls_ctl.stderr and "--tls" in tls_ctl.stderr
    no_cert = ctl(broker, "--tls-ca", str(pki.ca), "topic", "list")
    assert no_cert.returncode == 1 and "client certificate required" in no_cert.stderr
    missing = ctl(broker, "--tls-ca", str(tmp_path / "nowhere" / "ca.crt"), "topic", "list")
    assert missing.returncode == 2 and "TLS CA file not found" in missing.stderr and "nowhere/ca.crt" in missing.stderr
    plain = ctl(plain_broker, "--tls-insecure", "--timeout", "2", "topic", "list")
    assert plain.returncode == 1 and "may not use TLS on this port" in plain.stderr

    # the broker logged each kind of failure, once per reason however often it happened
    wait_lines = [("WRONG_VERSION_NUMBER", "plaintext client"),
                  ("PEER_DID_NOT_RETURN_A_CERTIFICATE", "no certificate"),
                  ("TLSV1_ALERT_UNKNOWN_CA", "does not trust")]
    deadline = time.monotonic() + 10
    while not all(_log_lines(broker, reason) for reason, _ in wait_lines):
        assert time.monotonic() < deadline, broker.output()[-2000:]
        time.sleep(0.05)
    for reason, meaning in wait_lines:
        lines = _log_lines(broker, reason)
        assert len(lines) == 1 and "TLS handshake failed" in lines[0] and meaning in lines[0], lines


# ------------------------------------------------------------------------------ group consumers on topic lists and patterns


def _fill(broker, topics: dict[str, int], per_partition: int = 3) -> set[tuple[str, int, bytes]]:
    """Create the topics and write ``per_partition`` records to each partition; returns what was written."""
    written = set()
    with connect(broker) as conn:
        for topic, partitions in topics.items():
            create_topic(conn, topic, partitions=partitions)
    with Producer(broker.bootstrap, acks=1) as producer:
        for topic, partitions in topics.items():
            for p in range(partitions):
                for i in range(per_partition):
                    value = f"{topic}/{p}/{i}".encode()
                    producer.send(topic, value, partition=p)
                    written.add((topic, p, value))
    return written


def _drain(consumer, want: int, timeout_s: float = 20.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        got.extend(consumer.poll(0.5))
    return got


@pytest.mark.parametrize("mode", ["poll", "stream"])
def test_group_consumer_reads_a_topic_list(shared_broker, topic_name, mode):
    broker = shared_broker
    a, b = f"{topic_name}-a", f"{topic_name}-b"
    written = _fill(broker, {a: 2, b: 1})
    group = f"g-{topic_name}"
    assigned: list = []
    with GroupConsumer([a, b], group, broker.bootstrap, mode=mode, auto_commit=False,
                       on_assigned=assigned.append, heartbeat_interval_s=0.5) as consumer:
        assert consumer.assignment() == [(a, 0), (a, 1), (b, 0)]
        assert assigned == [[(a, 0), (a, 1), (b, 0)]]
        got = _drain(consumer, len(written))
        assert {(r.topic, r.partition, r.value) for r in got} == written and len(got) == len(written)
        assert consumer.positions() == {(a, 0): 3, (a, 1): 3, (b, 0): 3}
        assert consumer.commit() == {(a, 0): 3, (a, 1): 3, (b, 0): 3}  # one request per topic
        with pytest.raises(ConflictError):
            consumer.commit({(a, 0): 1})  # offset_regression, typed
    with Admin(broker.bootstrap) as admin:
        status = admin.describe_group(group)
        assert status["subscription"] == {"type": "topics", "topics": [a, b]}
        assert {(o.topic, o.partition): o.committed for o in admin.group_offsets(group)} == \
            {(a, 0): 3, (a, 1): 3, (b, 0): 3}
    with GroupConsumer([a, b], group, broker.bootstrap, auto_commit=False) as again:
        assert _drain(again, 1, timeout_s=1.0) == []  # resumes at the committed offsets


def test_group_consumer_pattern_follows_new_topics_and_async(shared_broker, topic_name):
    broker = shared_broker
    prefix = f"{topic_name}-pat"
    first = _fill(broker, {f"{prefix}-1": 1})
    _fill(broker, {f"{topic_name}-other": 1})  # does not match
    group = f"g-{topic_name}"
    with GroupConsumer(None, group, broker.bootstrap, pattern=f"{prefix}-*", auto_commit=True,
                       auto_commit_interval_s=0, heartbeat_interval_s=0.3) as consumer:
        got = _drain(consumer, len(first))
        assert {(r.topic, r.partition, r.value) for r in got} == first
        second = _fill(broker, {f"{prefix}-2": 2})  # a new matching topic: the group rebalances to it
        got = _drain(consumer, len(second))
        assert {(r.topic, r.partition, r.value) for r in got} == second
        assert consumer.assignment() == [(f"{prefix}-1", 0), (f"{prefix}-2", 0), (f"{prefix}-2", 1)]
    with Admin(broker.bootstrap) as admin:
        assert admin.describe_group(group)["subscription"] == {"type": "pattern", "pattern": f"{prefix}-*"}
        assert admin.group_lag(group) == 0  # everything read was committed on close

    async def read_async() -> set:
        third = _fill(broker, {f"{prefix}-3": 1})
        async with AsyncGroupConsumer(None, group, broker.bootstrap, pattern=f"{prefix}-*",
                                      auto_commit=False) as aconsumer:
            assert (f"{prefix}-3", 0) in await aconsumer.assignment()
            got: list = []
            deadline = time.monotonic() + 20
            while len(got) < len(third) and time.monotonic() < deadline:
                got.extend(await aconsumer.poll(0.5))
            assert await aconsumer.commit() == {(f"{prefix}-3", 0): 3}
        return {(r.topic, r.partition, r.value) for r in got} ^ third

    assert asyncio.run(read_async()) == set()  # only the new topic's records: the others were committed


def test_group_consumer_subscription_arguments_are_checked():
    with pytest.raises(ValueError):
        GroupConsumer(None, "g")
    with pytest.raises(ValueError):
        GroupConsumer("t", "g", pattern="t-*")
    with pytest.raises(ValueError):
        GroupConsumer([], "g")


def test_broker_names_a_missing_tls_file(broker_factory, tmp_path):
    pki = make_pki(tmp_path / "pki")
    missing = tmp_path / "nowhere" / "server.crt"
    broker = broker_factory(settings={"use_tls": "true", "tls_cert_path": missing, "tls_key_path": pki.server_key})
    broker.start(expect_ready=False)
    assert broker.wait_exit(30) == 1
    assert f"tls_cert_path: file not found: {missing}" in broker.output()
