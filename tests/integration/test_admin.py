"""DESCRIBE, HELP, ALTER_TOPIC_CONFIG, DELETE, retention, health and metrics against a real broker."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.conftest import connect
from tests.integration.helpers import ack_of, consume_all, create_topic, error_of, ok_fields, publish_batch

pytestmark = pytest.mark.timeout(90)


def test_describe_and_help(shared_broker, topic_name):
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name, partitions=2)
        ack_of(publish_batch(conn, topic_name, 1, [b"a", b"b"]))
        doc = json.loads(conn.command(f"DESCRIBE topic={topic_name}").payload)
        assert doc["status"] == "OK" and doc["topic"] == topic_name
        assert doc["definition"]["partitions"] == 2 and doc["definition"]["policy"]["partitioner"] == "hash_key"
        assert [p["id"] for p in doc["partitions"]] == [0, 1]
        assert doc["partitions"][1]["leo"] == 2 and doc["partitions"][1]["hwm"] == 2
        commands = ok_fields(conn.command("HELP"))["commands"].split(",")
        assert {"CREATE", "PUBLISH", "CONSUME", "DESCRIBE", "DELETE"} <= set(commands)
        assert error_of(conn.command("DESCRIBE topic=nope-nope")).code == "topic_not_found"


def test_alter_topic_config_min_isr(shared_broker, topic_name):
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name, replication_factor="3", min_in_sync_replicas="1")
        fields = ok_fields(conn.command(f"ALTER_TOPIC_CONFIG topic={topic_name} min_in_sync_replicas=default"))
        assert fields["min_in_sync_replicas"] == "default" and fields["effective_min_in_sync_replicas"] == "1"
        ack_of(publish_batch(conn, topic_name, 0, [b"x"], acks="all"))
        assert error_of(conn.command(f"ALTER_TOPIC_CONFIG topic={topic_name} min_in_sync_replicas=5")).code == \
            "invalid_min_in_sync_replicas"
        assert error_of(conn.command(f"ALTER_TOPIC_CONFIG topic={topic_name} partitions=9")).code == "invalid_field"


def test_min_isr_is_checked_against_the_stored_replication_factor(shared_broker, topic_name):
    """Regression: CREATE replication_factor=3 min_in_sync_replicas=2 used to store RF 1 with an effective
    min ISR of 2 (no acks=all producer could write) while ALTER refused the same value."""
    with connect(shared_broker) as conn:
        err = error_of(conn.command(f"CREATE topic={topic_name} replication_factor=3 min_in_sync_replicas=2"))
        assert err.code == "invalid_min_in_sync_replicas" and "replication factor 1" in err.fields["reason"]
        assert error_of(conn.command(f"DESCRIBE topic={topic_name}")).code == "topic_not_found"
        fields = create_topic(conn, topic_name, replication_factor="3")
        assert fields["replication_factor"] == "1"
        for raw in ("2", "3"):  # CREATE patch and ALTER agree
            assert error_of(conn.command(f"CREATE topic={topic_name} min_in_sync_replicas={raw}")).code == \
                "invalid_min_in_sync_replicas"
            assert error_of(conn.command(f"ALTER_TOPIC_CONFIG topic={topic_name} min_in_sync_replicas={raw}")
                            ).code == "invalid_min_in_sync_replicas"
        ack_of(publish_batch(conn, topic_name, 0, [b"x"], acks="all"))


def test_delete_and_recreate_starts_fresh(shared_broker, topic_name):
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name, partitions=2)
        ack_of(publish_batch(conn, topic_name, 0, [b"old"] * 5))
        assert ok_fields(conn.command(f"DELETE topic={topic_name}")) == {"topic": topic_name, "deleted": "true"}
        assert error_of(conn.command(f"DELETE topic={topic_name}")).code == "topic_not_found"
        assert ok_fields(conn.command(f"DELETE topic={topic_name} if_exists=true"))["deleted"] == "false"
        assert error_of(conn.command(f"DELETE topic={topic_name} if_exists=maybe")).code == "invalid_if_exists"
        assert error_of(publish_batch(conn, topic_name, 0, [b"x"])).code == "topic_not_found"
        fresh = create_topic(conn, topic_name, partitions=1)
        assert fresh["revision"] == "1" and fresh["partitions"] == "1"
        assert consume_all(conn, topic_name, 0) == []
        assert error_of(conn.command("DELETE topic=__consumer_offsets")).code == "internal_topic_delete_forbidden"


def test_delete_survives_restart(broker_factory):
    broker = broker_factory().start()
    with connect(broker) as conn:
        create_topic(conn, "gone")
        create_topic(conn, "kept")
        ack_of(publish_batch(conn, "gone", 0, [b"x"]))
        ok_fields(conn.command("DELETE topic=gone"))
    broker.restart(kill=True)
    with connect(broker) as conn:
        assert ok_fields(conn.command("LIST"))["topics"] == "kept"
    assert not (broker.log_dir / "topics" / "gone").exists()


def test_retention_by_time_and_size(broker_factory):
    broker = broker_factory(settings={
        "log_segment_bytes": 4096, "log_retention_check_interval_ms": 100, "log_retention_ms": 300,
    }).start()
    with connect(broker) as conn:
        create_topic(conn, "aged")
        create_topic(conn, "sized", retention_bytes="10000")
        for i in range(30):
            ack_of(publish_batch(conn, "aged", 0, [f"{i}".encode() * 100] * 3))
            ack_of(publish_batch(conn, "sized", 0, [f"{i}".encode() * 100] * 3))
        # Time retention: every closed segment expires; the active one stays.
        deadline = time.monotonic() + 15
        earliest = 0
        while time.monotonic() < deadline and earliest == 0:
            earliest = int(ok_fields(conn.command("LIST_OFFSETS topic=aged"))["offsets"].split(":")[1].split("=")[1])
        assert earliest > 0
        err = error_of(conn.command("CONSUME topic=aged partition=0 offset=0"))
        assert err.code == "OFFSET_OUT_OF_RANGE" and int(err.fields["earliest"]) == earliest
        records = consume_all(conn, "aged", 0, earliest)
        assert records and records[-1].offset == 89
        # Size retention keeps the partition near its byte limit (time retention applies too).
        size_after = _segment_bytes(broker.log_dir / "topics" / "sized" / "0")
        assert size_after <= 10000 + 4096


def test_health_and_metrics(broker_factory):
    broker = broker_factory().start()
    assert broker.http_get("/live") == (200, b'{"status": "live"}')
    status, body = broker.http_get("/ready")
    assert status == 200 and json.loads(body)["status"] == "ready"
    assert broker.http_get("/nope")[0] == 404
    req = urllib.request.Request(f"http://127.0.0.1:{broker.health_port}/live", method="POST")
    try:
        urllib.request.urlopen(req, timeout=5)
        code = 200
    except urllib.error.HTTPError as exc:
        code = exc.code
    assert code == 405


def _segment_bytes(folder: Path) -> int:
    """Bytes in ``folder``'s segment files; a segment retention deletes between the listing and its stat
    counts as gone (the broker's cleanup runs while the test reads)."""
    total = 0
    for segment in folder.glob("*.log"):
        try:
            total += segment.stat().st_size
        except FileNotFoundError:
            pass
    return total
