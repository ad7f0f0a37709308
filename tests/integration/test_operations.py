"""Operator-facing behaviour: TLS, metrics after a known workload, SIGTERM under load, policies."""

from __future__ import annotations

import socket
import ssl
import threading
import time

import pytest

from cursus.client import TlsError
from cursus.client.connection import ConnectionClosed
from tests.certs import make_pki
from tests.integration.conftest import connect
from tests.integration.helpers import (
    ack_of,
    consume,
    consume_all,
    create_topic,
    error_of,
    ok_fields,
    publish_batch,
)

pytestmark = pytest.mark.timeout(90)


def _client_context(ca, cert=None, key=None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


def test_tls_round_trip_plaintext_and_wrong_ca_refused(broker_factory, tmp_path):
    pki = make_pki(tmp_path / "pki")
    other = make_pki(tmp_path / "other", name="other")
    broker = broker_factory(settings={
        "use_tls": "true", "tls_cert_path": pki.server_cert, "tls_key_path": pki.server_key,
        "tls_ca_path": pki.ca,
    }).start()
    with connect(broker, ssl_context=_client_context(pki.ca, pki.client_cert, pki.client_key)) as conn:
        create_topic(conn, "secure")
        ack_of(publish_batch(conn, "secure", 0, [b"over tls"]))
        assert [r.payload for r in consume_all(conn, "secure", 0)] == [b"over tls"]
        # A plaintext client on the TLS listener is refused; the TLS connection keeps working.
        with pytest.raises(TlsError, match="the server requires TLS"):
            connect(broker, timeout_s=5)
        # A client that does not trust the broker's CA refuses the broker (a typed, non-retryable error).
        with pytest.raises(TlsError, match="tls_certificate_verify_failed"):
            connect(broker, ssl_context=_client_context(other.ca, pki.client_cert, pki.client_key))
        # A client without a certificate is refused by the broker (mutual TLS).
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            c = connect(broker, ssl_context=_client_context(pki.ca))
            c.command("LIST")
        assert ok_fields(conn.command("LIST"))["topics"] == "secure"


def test_tls_misconfiguration_fails_startup(broker_factory, tmp_path):
    broker = broker_factory(settings={"use_tls": "true"})
    broker.start(expect_ready=False)
    assert broker.wait_exit(30) == 1
    assert "tls_cert_path" in broker.output()


def test_metrics_after_known_workload(broker_factory):
    broker = broker_factory(settings={"exporter_port": 0}).start()
    with connect(broker) as conn:
        create_topic(conn, "metered", partitions=2)
        for _ in range(3):
            ack_of(publish_batch(conn, "metered", 1, [b"m"] * 10))
        assert len(consume(conn, "metered", 1, 0, batch=5)) == 5
        error_of(conn.command("METADATA topic=unknown-topic"))
        joined = ok_fields(conn.command("JOIN_GROUP topic=metered group=g1 member=m"))
        ok_fields(conn.command(f"COMMIT_OFFSET topic=metered partition=1 group=g1 offset=12 "
                               f"member={joined['member']} generation={joined['generation']}"))
    bad = socket.create_connection(broker.address)
    bad.sendall(b"\xde\xad" * 40)
    bad.recv(1)
    bad.close()
    deadline = time.monotonic() + 10
    text = ""
    while time.monotonic() < deadline:
        status, body = broker.http_get("/metrics", port=broker.metrics_port)
        text = body.decode()
        if 'cursus_wire_protocol_failures_total{reason="invalid_frame"} 1.0' in text:
            break
    assert status == 200
    assert 'cursus_wire_protocol_failures_total{reason="invalid_frame"} 1.0' in text
    assert 'cursus_partition_high_watermark{partition="1",topic="metered"} 30.0' in text
    assert 'cursus_partition_log_end_offset{partition="1",topic="metered"} 30.0' in text
    assert 'cursus_broker_publish_acknowledgements_total{ack_mode="leader",result="ok"} 3.0' in text
    assert 'cursus_broker_commands_total{command="PUBLISH",result="ok"} 3.0' in text
    assert 'cursus_broker_command_errors_total{code="topic_not_found",command="METADATA"} 1.0' in text
    assert "cursus_broker_ready 1.0" in text
    assert 'cursus_consumer_group_members{group="g1",topic="metered"} 1.0' in text
    assert 'cursus_consumer_group_committed_offset{group="g1",partition="1",topic="metered"} 12.0' in text
    assert 'cursus_consumer_group_lag{group="g1",partition="1",topic="metered"} 18.0' in text
    assert "cursus_streams_active 0.0" in text
    assert 'cursus_broker_topic_records_in_total{topic="metered"} 30.0' in text
    assert 'cursus_broker_topic_records_out_total{topic="metered"} 5.0' in text
    assert "cursus_broker_topic_bytes_in_total" in text and "cursus_broker_topic_bytes_out_total" in text
    assert "process_cpu_seconds_total" in text and "process_open_fds" in text  # the standard process collector
    assert "_created" not in text  # no creation-time series next to every counter


def test_sigterm_during_publish_stream_loses_no_acked_record(broker_factory):
    broker = broker_factory().start()
    with connect(broker) as conn:
        create_topic(conn, "term")
    acked: list[bytes] = []
    done = threading.Event()

    def produce() -> None:
        i = 0
        try:
            with connect(broker) as conn:
                while True:
                    payloads = [f"v{i + j}".encode() for j in range(20)]
                    i += 20
                    ack_of(publish_batch(conn, "term", 0, payloads))
                    acked.extend(payloads)
        except (ConnectionClosed, ConnectionError, OSError, AssertionError):
            pass
        finally:
            done.set()

    t = threading.Thread(target=produce)
    t.start()
    deadline = time.monotonic() + 20
    while len(acked) < 2000 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert broker.terminate() == 0
    done.wait(10)
    t.join(10)
    broker.start()
    with connect(broker) as conn:
        stored = [r.payload for r in consume_all(conn, "term", 0)]
    assert len(set(stored)) == len(stored)
    assert set(acked) <= set(stored)
    assert stored[: len(acked)] == acked


def test_deny_read_policy(shared_broker, topic_name):
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name, auth_policy="deny_read")
        ack_of(publish_batch(conn, topic_name, 0, [b"x"]))
        err = error_of(conn.command(f"CONSUME topic={topic_name} partition=0 offset=0"))
        assert err.code == "NOT_AUTHORIZED_FOR_TOPIC" and err.fields["operation"] == "read"
        # acl without enable_sasl: nobody is authenticated, so nobody passes the ACL (fail closed)
        assert ok_fields(conn.command(f"CREATE topic={topic_name} auth_policy=acl read_acl=*"))["auth_policy"] == "acl"
        err = error_of(conn.command(f"CONSUME topic={topic_name} partition=0 offset=0"))
        assert err.code == "NOT_AUTHORIZED_FOR_TOPIC" and err.fields["operation"] == "read"
        assert error_of(publish_batch(conn, topic_name, 0, [b"y"])).code == "NOT_AUTHORIZED_FOR_TOPIC"
        assert consume is not None
