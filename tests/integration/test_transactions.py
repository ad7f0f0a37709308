"""Transactions against a real standalone broker: visibility, abort, fencing, retries, LSO, timeouts."""

from __future__ import annotations

import struct
import time

import pytest

from cursus.partitioning import partition_for_txn_record
from cursus.wire import TXN_CONTROL_MARKER_PAYLOAD, decode_batch
from tests.integration.conftest import connect
from tests.integration.helpers import create_topic, error_of, ok_fields
from tests.integration.txnsupport import Session, payloads, read, read_all

pytestmark = pytest.mark.timeout(120)


def test_commit_makes_two_partitions_visible_together(shared_broker, topic_name):
    with connect(shared_broker) as conn, connect(shared_broker) as reader:
        create_topic(conn, topic_name, partitions=2)
        s = Session(conn, f"{topic_name}-tx")
        init = s.init()
        assert set(init) >= {"transactional_id", "producerId", "epoch"} and init["epoch"] == "1"
        assert s.begin()["state"] == "open"
        assert s.publish(topic_name, "a0", partition=0)["appended"] == "true"
        s.publish(topic_name, "a1", partition=1)
        # open: read_committed sees nothing, read_uncommitted sees the records
        assert read(reader, topic_name, 0) == [] and read(reader, topic_name, 1) == []
        assert payloads(read(reader, topic_name, 0, isolation="read_uncommitted")) == [b"a0"]
        assert s.status()["state"] == "open"
        done = s.end("commit")
        assert done["state"] == "committed" and done["messages"] == "2" and done["offsets"] == "0"
        assert payloads(read_all(reader, topic_name, 0)) == [b"a0"]
        assert payloads(read_all(reader, topic_name, 1)) == [b"a1"]
        raw = read_all(reader, topic_name, 0, isolation="read_uncommitted")
        assert [r.payload for r in raw] == [b"a0", TXN_CONTROL_MARKER_PAYLOAD]
        marker = raw[1]
        assert marker.transaction_marker == "commit" and marker.control_type == "transaction"
        assert marker.control_version == 2 and marker.transactional_id == s.tid
        assert marker.control_key == struct.pack(">hh", 0, 1)
        assert marker.control_value == struct.pack(">hi", 0, marker.control_coordinator_epoch)
        # the epoch ran its transaction; a retry of END_TXN is idempotent
        assert s.end("commit")["state"] == "committed"
        assert s.end_error("abort") == "transaction_already_committed"
        assert error_of(conn.command(f"BEGIN_TXN {s.ids}")).code == "producer_reinitialization_required"


def test_abort_hides_everything_and_later_records_flow(shared_broker, topic_name):
    with connect(shared_broker) as conn, connect(shared_broker) as reader:
        create_topic(conn, topic_name, partitions=1)
        conn.command(f"PUBLISH topic={topic_name} producerId=plain acks=1 message=before")
        s = Session(conn, f"{topic_name}-tx")
        s.init()
        s.begin()
        for i in range(5):
            s.publish(topic_name, f"x{i}", partition=0)
        conn.command(f"PUBLISH topic={topic_name} producerId=plain acks=1 message=between")
        assert s.end("abort")["state"] == "aborted"
        assert s.end("abort")["state"] == "aborted"
        assert s.end_error("commit") == "transaction_aborted"
        conn.command(f"PUBLISH topic={topic_name} producerId=plain acks=1 message=after")
        assert payloads(read_all(reader, topic_name, 0)) == [b"before", b"between", b"after"]
        assert len(read_all(reader, topic_name, 0, isolation="read_uncommitted")) == 9
        # a new epoch commits
        s.init()
        assert s.epoch == 2
        s.begin()
        s.publish(topic_name, "y", partition=0)
        s.end("commit")
        assert payloads(read_all(reader, topic_name, 0)) == [b"before", b"between", b"after", b"y"]


def test_open_transaction_pins_the_lso(shared_broker, topic_name):
    with connect(shared_broker) as conn, connect(shared_broker) as reader:
        create_topic(conn, topic_name, partitions=1)
        s = Session(conn, f"{topic_name}-tx")
        s.init()
        s.begin()
        s.publish(topic_name, "t0", partition=0)
        conn.command(f"PUBLISH topic={topic_name} producerId=plain acks=1 message=p1")
        # the plain record after the open transaction is not readable committed yet
        assert read(reader, topic_name, 0) == []
        assert payloads(read_all(reader, topic_name, 0, isolation="read_uncommitted")) == [b"t0", b"p1"]
        started = time.monotonic()
        assert read(reader, topic_name, 0, wait_ms=200) == []
        assert time.monotonic() - started >= 0.15
        s.end("commit")
        assert payloads(read_all(reader, topic_name, 0)) == [b"t0", b"p1"]


def test_epoch_fencing_of_a_zombie(shared_broker, topic_name):
    with connect(shared_broker) as conn, connect(shared_broker) as other:
        create_topic(conn, topic_name, partitions=1)
        zombie = Session(conn, f"{topic_name}-tx")
        zombie.init()
        zombie.begin()
        zombie.publish(topic_name, "zombie", partition=0)
        fresh = Session(other, zombie.tid)
        fresh.init()  # aborts the zombie's open transaction and fences its epoch
        assert fresh.producer_id == zombie.producer_id and fresh.epoch == zombie.epoch + 1
        err = error_of(conn.command(f"TXN_PUBLISH {zombie.ids} topic={topic_name} partition=0 seqNum=9 message=z"))
        assert err.code == "producer_fenced"
        assert zombie.end_error("commit") == "producer_fenced"
        fresh.begin()
        fresh.publish(topic_name, "fresh", partition=0)
        fresh.end("commit")
        assert payloads(read_all(conn, topic_name, 0)) == [b"fresh"]


def test_publish_retry_is_idempotent_and_partition_choice(shared_broker, topic_name):
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name, partitions=3)
        s = Session(conn, f"{topic_name}-tx")
        s.init()
        s.begin()
        first = s.publish(topic_name, "k", key="user-1", seq=1)
        again = s.publish(topic_name, "k", key="user-1", seq=1)
        assert first == again
        partition = int(first["partition"])
        # round-robin topic: a retry that the broker would route elsewhere answers the first partition
        rr = s.publish(topic_name, "rr", seq=2)
        assert s.publish(topic_name, "rr", seq=2) == rr
        err = error_of(conn.command(f"TXN_PUBLISH {s.ids} topic={topic_name} seqNum=0 message=m"))
        assert err.code == "invalid_seq_num"
        s.end("commit")
        assert b"k" in payloads(read_all(conn, topic_name, partition))
        assert sum(len(read_all(conn, topic_name, p)) for p in range(3)) == 2
        # PUBLISH may not carry transaction metadata
        err = error_of(conn.command(f"PUBLISH topic={topic_name} producerId=p transactional_id=x message=m"))
        assert err.code == "transaction_metadata_forbidden"


@pytest.mark.parametrize("partitioner", ["round_robin", "hash_key"])
def test_broker_placed_publish_is_pinned_by_seqnum(shared_broker, topic_name, partitioner):
    """partition=-1 and no key (or any record of a round_robin topic): the partition is a pure function of
    (producerId, topic, seqNum), not the broker's round-robin counter, so the same TXN_PUBLISH sent twice (a
    retry after a lost reply, or through another coordinator) lands once, on the first copy's partition."""
    partitions = 4
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name, partitions=partitions, partitioner=partitioner)
        s = Session(conn, f"{topic_name}-tx")
        s.init()
        s.begin()
        first: dict[int, dict[str, str]] = {}
        for seq in range(1, 7):  # plain publishes in between move the round-robin counter on
            assert conn.command(f"PUBLISH topic={topic_name} producerId=plain message=plain{seq}").status.name == "OK"
            first[seq] = s.publish(topic_name, f"m{seq}", seq=seq)
            expected = partition_for_txn_record(s.producer_id, topic_name, seq, partitions)
            assert int(first[seq]["partition"]) == expected
        for seq in range(1, 7):
            assert conn.command(f"PUBLISH topic={topic_name} producerId=plain message=again{seq}").status.name == "OK"
            assert s.publish(topic_name, f"m{seq}", seq=seq) == first[seq]  # same partition, nothing appended
        assert s.end("commit")["messages"] == "6"
        for p in range(partitions):
            mine = [r.payload for r in read_all(conn, topic_name, p, isolation="read_uncommitted")
                    if r.payload.startswith(b"m")]
            assert sorted(mine) == sorted(f"m{seq}".encode() for seq in first if int(first[seq]["partition"]) == p)


def test_find_coordinator_and_status_errors(shared_broker, topic_name):
    with connect(shared_broker) as conn:
        found = ok_fields(conn.command(f"FIND_COORDINATOR transactional_id={topic_name}"))
        assert found["coordinator_type"] == "transaction"
        assert (found["host"], int(found["port"])) == shared_broker.address
        assert error_of(conn.command(f"TXN_STATUS transactional_id={topic_name}-none")).code == \
            "transaction_not_found"
        assert error_of(conn.command(f"BEGIN_TXN transactional_id={topic_name}-none producerId=1 epoch=1")).code \
            == "transaction_not_found"
        s = Session(conn, f"{topic_name}-tx")
        s.init()
        assert s.end_error("commit") == "transaction_not_open"
        status = s.status()
        assert status["mode"] == "exactly_once" and status["messages"] == "0"


def test_timeout_aborts(broker_factory, topic_name):
    broker = broker_factory(settings={"transaction_timeout_ms": 300}).start()
    with connect(broker) as conn:
        create_topic(conn, topic_name, partitions=1)
        s = Session(conn, "slow")
        s.init()
        s.begin()
        s.publish(topic_name, "late", partition=0)
        deadline = time.monotonic() + 10
        while s.status()["state"] != "aborted":
            assert time.monotonic() < deadline, s.status()
            time.sleep(0.05)
        assert s.end_error("commit") == "transaction_aborted"
        assert read_all(conn, topic_name, 0) == []
        assert len(read_all(conn, topic_name, 0, isolation="read_uncommitted")) == 2


def test_stream_read_committed_waits_for_the_decision(shared_broker, topic_name):
    from tests.integration.test_stream import frames_until_data, open_stream

    with connect(shared_broker) as conn, connect(shared_broker) as streamer:
        create_topic(conn, topic_name, partitions=1)
        s = Session(conn, f"{topic_name}-tx")
        s.init()
        s.begin()
        s.publish(topic_name, "t0", partition=0)
        s.publish(topic_name, "t1", partition=0)
        rid = open_stream(streamer, f"STREAM topic={topic_name} partition=0 group=sg member=m isolation=read_committed")
        started = time.monotonic()
        s.end("commit")
        frame = frames_until_data(streamer, rid)
        records = [r for r in decode_batch(frame.payload).records if r.payload != TXN_CONTROL_MARKER_PAYLOAD]
        assert [r.payload for r in records] == [b"t0", b"t1"]
        assert time.monotonic() - started < 5
        s.init()
        s.begin()
        s.publish(topic_name, "gone", partition=0)
        s.end("abort")
        conn.command(f"PUBLISH topic={topic_name} producerId=plain acks=1 message=after")
        seen: list[bytes] = []
        while b"after" not in seen:
            frame = frames_until_data(streamer, rid)
            seen += [r.payload for r in decode_batch(frame.payload).records]
        assert b"gone" not in seen


def test_expired_ids_keep_an_epoch_tombstone(broker_factory, topic_name):
    broker = broker_factory(settings={"transactional_id_expiration_ms": 200}).start()
    with connect(broker) as conn:
        create_topic(conn, topic_name, partitions=1)
        s = Session(conn, "expiring")
        s.init()
        s.begin()
        s.publish(topic_name, "kept", partition=0)
        s.end("commit")
        deadline = time.monotonic() + 10
        while s.status()["participants"] != "0":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert s.status()["state"] == "committed"
        epoch = s.epoch
        s.init()
        assert s.epoch == epoch + 1
        assert payloads(read_all(conn, topic_name, 0)) == [b"kept"]
