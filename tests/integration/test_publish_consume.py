"""PUBLISH and CONSUME against a real broker: batches, text, acks, routing, idempotence, long poll."""

from __future__ import annotations

import json
import threading
import time

import pytest

from cursus.partitioning import partition_for_key
from cursus.wire import Command, Status
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

#: The conformance payload: leading/trailing spaces, a NUL byte, multi-byte UTF-8 and a tab.
ODD_PAYLOAD = bytes.fromhex("20206f706171756500ed959ceab880097061796c6f61642020")


def test_create_reply_and_patch_semantics(shared_broker, topic_name):
    with connect(shared_broker) as conn:
        first = create_topic(conn, topic_name, partitions=2)
        for key in ("topic", "revision", "lifecycle_epoch", "partitions", "replication_factor", "idempotent",
                    "event_sourcing", "cleanup_policy", "retention_hours", "retention_bytes", "partitioner",
                    "auth_policy", "read_acl", "write_acl", "min_in_sync_replicas",
                    "effective_min_in_sync_replicas"):
            assert key in first, key
        assert first["revision"] == "1" and first["replication_factor"] == "1"
        assert first["min_in_sync_replicas"] == "default" and first["effective_min_in_sync_replicas"] == "1"
        # Restating is a no-op: same revision.
        assert create_topic(conn, topic_name, partitions=2, idempotent="false")["revision"] == "1"
        # An effective change bumps the revision; replication factor restated with any value is no change.
        grown = create_topic(conn, topic_name, partitions=3, replication_factor="3")
        assert grown["revision"] == "2" and grown["partitions"] == "3" and grown["replication_factor"] == "1"
        assert error_of(conn.command(f"CREATE topic={topic_name} partitions=1")).code == "invalid_partitions"
        assert error_of(conn.command(f"CREATE topic={topic_name} idempotent=true")).code == "invalid_idempotent"
        assert error_of(conn.command(f"CREATE topic={topic_name} cleanup_policy=sometimes")).code == \
            "invalid_topic_policy"
        assert error_of(conn.command(f"CREATE topic={topic_name} partitioner=random")).code == "invalid_topic_policy"
        assert error_of(conn.command(f"CREATE topic={topic_name} retention_hours=-1")).code == \
            "invalid_retention_hours"
        meta = ok_fields(conn.command(f"METADATA topic={topic_name}"))
        host, port = shared_broker.address
        assert meta["leaders"] == ",".join([f"{host}:{port}"] * 3)
        assert meta["epochs"] == "0,0,0" and meta["revision"] == "2"


def test_ten_thousand_records_over_four_partitions(shared_broker, topic_name):
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name, partitions=4)
        sent: dict[int, list[bytes]] = {p: [] for p in range(4)}
        for batch_no in range(20):
            for p in range(4):
                payloads = [f"p{p}-b{batch_no}-r{i}".encode() + ODD_PAYLOAD for i in range(125)]
                ack = ack_of(publish_batch(conn, topic_name, p, payloads))
                sent[p].extend(payloads)
                assert ack["last_offset"] == len(sent[p]) - 1
        for p in range(4):
            records = consume_all(conn, topic_name, p)
            assert [r.offset for r in records] == list(range(2500))
            assert [r.payload for r in records] == sent[p]
            assert all(r.topic == topic_name and r.partition == p for r in records)
        offsets = ok_fields(conn.command(f"LIST_OFFSETS topic={topic_name}"))["offsets"].split(",")
        assert offsets[0] == "P0:earliest=0:latest=2500:leo=2500:hwm=2500"


def test_consume_limits_and_range_errors(shared_broker, topic_name):
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name)
        ack_of(publish_batch(conn, topic_name, 0, [b"x" * 100] * 50))
        assert len(consume(conn, topic_name, 0, 10, batch=7)) == 7
        # max_bytes smaller than one record still returns one record.
        assert len(consume(conn, topic_name, 0, 10, max_bytes=1)) == 1
        assert consume(conn, topic_name, 0, 50) == []  # at the HWM: empty batch
        err = error_of(conn.command(f"CONSUME topic={topic_name} partition=0 offset=51"))
        assert err.code == "OFFSET_OUT_OF_RANGE"
        assert err.fields == {"requested": "51", "earliest": "0", "latest": "50"}
        assert error_of(conn.command(f"CONSUME topic={topic_name} partition=4 offset=0")).code == \
            "partition_not_found"
        assert error_of(conn.command(f"CONSUME topic={topic_name} partition=-1 offset=0")).code == \
            "invalid_partition"
        assert error_of(conn.command("CONSUME topic=t* partition=0 offset=0")).code == "invalid_topic_name"
        assert error_of(conn.command(f"CONSUME topic={topic_name} partition=0 offset=0 isolation=dirty")).code == \
            "invalid_isolation"


def test_long_poll_is_woken_by_append(shared_broker, topic_name):
    with connect(shared_broker) as conn, connect(shared_broker) as producer:
        create_topic(conn, topic_name)
        result: list[float] = []

        def poll() -> None:
            started = time.monotonic()
            records = consume(conn, topic_name, 0, 0, wait_ms=4000)
            result.append(time.monotonic() - started)
            result.append(len(records))

        t = threading.Thread(target=poll)
        t.start()
        time.sleep(0.2)  # let the poll park; the assertion below does not depend on this timing
        ack_of(publish_batch(producer, topic_name, 0, [b"wake"]))
        t.join(timeout=10)
        assert result[1] == 1
        assert result[0] < 3.0
        # Without data the poll returns empty after roughly wait_ms.
        started = time.monotonic()
        assert consume(conn, topic_name, 0, 1, wait_ms=300) == []
        assert 0.25 <= time.monotonic() - started < 3.0


def test_text_publish_and_key_routing(shared_broker, topic_name):
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name, partitions=4)
        for i in range(8):
            key = f"user-{i}"
            ack = json.loads(conn.command(
                f"PUBLISH topic={topic_name} acks=1 producerId=p1 key={key} message=hello {i} with spaces").payload)
            assert ack["status"] == "OK" and ack["producer_id"] == "p1"  # echoed even without a sequence
        for p in range(4):
            for rec in consume_all(conn, topic_name, p):
                assert partition_for_key(rec.key, 4) == p
                assert rec.payload.startswith(b"hello ")
        err = error_of(conn.command(f"PUBLISH topic={topic_name} acks=2 producerId=p message=x"))
        assert err.code == "invalid_acks"
        err = error_of(conn.command(f"PUBLISH topic={topic_name} message=x"))
        assert err.code == "missing_producer_id"
        err = error_of(conn.command(f"PUBLISH topic={topic_name} producerId=p transactional_id=t message=x"))
        assert err.code == "transaction_metadata_forbidden"


def test_acks_zero_gets_no_reply_even_on_error(shared_broker, topic_name):
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name)
        publish_batch(conn, topic_name, 0, [b"fire"] * 3, acks="0")
        publish_batch(conn, "no-such-topic-zero", 0, [b"lost"], acks="0")  # fails silently
        conn.send(*_text("PUBLISH topic=no-such-topic-zero acks=0 producerId=p message=lost"))
        conn.send(*_text(f"PUBLISH topic={topic_name} acks=none producerId=p message=fire"))
        # acks=0 records become durable with the next group commit; the HWM reaches 4 without any reply.
        # Every reply below must correlate with its own request: a stray acks=0 reply would break that.
        deadline = time.monotonic() + 10
        offsets = ""
        while time.monotonic() < deadline and "hwm=4" not in offsets:
            offsets = ok_fields(conn.command(f"LIST_OFFSETS topic={topic_name}"))["offsets"]
        assert offsets == "P0:earliest=0:latest=4:leo=4:hwm=4"


def _text(text: str) -> tuple[Command, bytes]:
    from cursus.wire import encode_crq2, parse_command_text

    command, payload = parse_command_text(text)
    return command, encode_crq2(payload)


def test_idempotent_producer_duplicates_gaps_and_fencing(shared_broker, topic_name):
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name, idempotent="true")
        ack1 = ack_of(publish_batch(conn, topic_name, 0, [b"a", b"b"], acks="all", producer=("prod-1", 5, 1),
                                    idempotent=True))
        assert ack1["last_offset"] == 1 and ack1["seq_start"] == 1 and ack1["seq_end"] == 2
        # An exact retry is answered with the original offsets and appends nothing.
        dup = ack_of(publish_batch(conn, topic_name, 0, [b"a", b"b"], acks="all", producer=("prod-1", 5, 1),
                                   idempotent=True))
        assert dup["last_offset"] == 1
        # acks=1 is not allowed for an idempotent batch.
        err = error_of(publish_batch(conn, topic_name, 0, [b"c"], acks="1", producer=("prod-1", 5, 3),
                                     idempotent=True))
        assert err.code == "invalid_acks"
        # A gap is refused.
        err = error_of(publish_batch(conn, topic_name, 0, [b"c"], acks="all", producer=("prod-1", 5, 9),
                                     idempotent=True))
        assert err.code == "idempotency_gap"
        ack_of(publish_batch(conn, topic_name, 0, [b"c"], acks="all", producer=("prod-1", 5, 3), idempotent=True))
        # A new producer session must start at 1.
        err = error_of(publish_batch(conn, topic_name, 0, [b"x"], acks="all", producer=("prod-2", 1, 4),
                                     idempotent=True))
        assert err.code == "idempotency_gap"
        # A higher epoch fences the old one; the old epoch is then stale.
        ack_of(publish_batch(conn, topic_name, 0, [b"d"], acks="all", producer=("prod-1", 6, 1), idempotent=True))
        err = error_of(publish_batch(conn, topic_name, 0, [b"e"], acks="all", producer=("prod-1", 5, 4),
                                     idempotent=True))
        assert err.code == "stale_producer_epoch"
        assert err.error_class.label == "fencing"
        assert [r.payload for r in consume_all(conn, topic_name, 0)] == [b"a", b"b", b"c", b"d"]


def test_idempotent_publish_with_a_negative_epoch_is_refused(shared_broker, topic_name):
    """An epoch is >= 0 (facts: u64 on disk): refused with ``invalid_epoch`` before anything is appended or
    any producer state changes; epoch 0 stays valid and the connection stays usable."""
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name, idempotent="true")
        err = error_of(publish_batch(conn, topic_name, 0, [b"a"], acks="all", producer=("p-neg", -5, 1),
                                     idempotent=True))
        assert (err.code, err.fields["value"]) == ("invalid_epoch", "-5")
        err = error_of(conn.command(f"PUBLISH topic={topic_name} producerId=p-neg isIdempotent=true acks=all "
                                    "seqNum=1 epoch=-5 message=a"))
        assert (err.code, err.fields["value"]) == ("invalid_epoch", "-5")
        # no state: the same producer's session starts at seq 1 with epoch 0
        ack = ack_of(publish_batch(conn, topic_name, 0, [b"b"], acks="all", producer=("p-neg", 0, 1),
                                   idempotent=True))
        assert (ack["last_offset"], ack["producer_epoch"], ack["seq_start"]) == (0, 0, 1)
        ack = ack_of(conn.command(f"PUBLISH topic={topic_name} producerId=p-neg isIdempotent=true acks=all "
                                  "seqNum=2 epoch=0 message=c"))
        assert ack["last_offset"] == 1
        assert [r.payload for r in consume_all(conn, topic_name, 0)] == [b"b", b"c"]


def test_batch_partition_validation(shared_broker, topic_name):
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name, partitions=2)
        assert error_of(publish_batch(conn, topic_name, 2, [b"x"])).code == "partition_not_found"
        assert error_of(publish_batch(conn, "missing-topic-x", 0, [b"x"])).code == "topic_not_found"
        frame = publish_batch(conn, topic_name, 1, [b"y" * 2_000_000])
        assert error_of(frame).code == "message_too_large"
        assert frame.status == Status.ERROR


def test_deny_write_policy_enforced(shared_broker, topic_name):
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name, auth_policy="deny_write")
        err = error_of(publish_batch(conn, topic_name, 0, [b"x"]))
        assert err.code == "NOT_AUTHORIZED_FOR_TOPIC" and err.fields["operation"] == "write"
        assert consume(conn, topic_name, 0, 0) == []
