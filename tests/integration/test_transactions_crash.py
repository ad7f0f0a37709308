"""Transactions across kill -9: a crash at each step of the commit order, then restart (all-or-nothing,
offsets included, exactly one visible copy); the journal's torn tail and non-tail corruption; consume-
transform-produce offsets."""

from __future__ import annotations

import pytest

from cursus.client.connection import ConnectionClosed
from cursus.transactions.journal import JOURNAL_NAME
from tests.integration.conftest import connect
from tests.integration.helpers import create_topic, error_of, ok_fields
from tests.integration.txnsupport import Session, payloads, read_all

pytestmark = pytest.mark.timeout(180)

GROUP = "txn-group"
MEMBER = "worker-1"


def _join(conn, topic: str) -> tuple[str, int]:
    joined = ok_fields(conn.command(f"JOIN_GROUP topic={topic} group={GROUP} member={MEMBER}"))
    return joined["member"], int(joined["generation"])


def _fetch_offset(conn, topic: str, partition: int) -> int:
    return int(ok_fields(conn.command(f"FETCH_OFFSET topic={topic} partition={partition} group={GROUP}"))["offset"])


def _transaction(conn, out: str, inp: str, member: str, generation: int) -> Session:
    s = Session(conn, "ctp")
    s.init()
    s.begin()
    s.publish(out, "r0", partition=0)
    s.publish(out, "r1", partition=1)
    s.send_offsets(inp, GROUP, member, generation, {0: 7})
    return s


def test_consume_transform_produce_commits_offsets_with_output(broker_factory):
    broker = broker_factory().start()
    with connect(broker) as conn:
        create_topic(conn, "in", partitions=1)
        create_topic(conn, "out", partitions=2)
        for i in range(7):
            conn.command(f"PUBLISH topic=in producerId=src acks=1 message=m{i}")
        member, generation = _join(conn, "in")
        s = _transaction(conn, "out", "in", member, generation)
        assert _fetch_offset(conn, "in", 0) == 0
        # a repeated partition may only keep or advance its offset
        assert error_of(conn.command(f"SEND_OFFSETS_TO_TXN {s.ids} topic=in group={GROUP} member={member} "
                                     f"generation={generation} offsets=P0:3")).code == "offset_regression"
        assert error_of(conn.command(f"SEND_OFFSETS_TO_TXN {s.ids} topic=in group={GROUP} member={member} "
                                     f"generation={generation + 5} offsets=P0:9")).code in (
            "invalid_txn_offsets", "GEN_MISMATCH")
        done = s.end("commit")
        assert done["offsets"] == "1" and done["messages"] == "2"
        assert _fetch_offset(conn, "in", 0) == 7
        assert payloads(read_all(conn, "out", 0)) == [b"r0"]
        # an aborted transaction does not move the offsets
        s.init()
        s.begin()
        s.publish("out", "lost", partition=0)
        s.send_offsets("in", GROUP, member, generation, {0: 7})
        s.end("abort")
        assert _fetch_offset(conn, "in", 0) == 7
        assert payloads(read_all(conn, "out", 0)) == [b"r0"]


@pytest.mark.parametrize(("point", "committed"), [
    ("after_prepare_commit", True),
    ("after_first_marker", True),
    ("after_markers", True),
    ("after_commit_decision", True),
    ("after_prepare_abort", False),
])
def test_kill_at_each_commit_step_then_restart(broker_factory, point, committed):
    broker = broker_factory(env={"CURSUS_TXN_CRASH_AT": point}).start()
    with connect(broker) as conn:
        create_topic(conn, "in", partitions=1)
        create_topic(conn, "out", partitions=2)
        for i in range(7):
            conn.command(f"PUBLISH topic=in producerId=src acks=1 message=m{i}")
        member, generation = _join(conn, "in")
        s = _transaction(conn, "out", "in", member, generation)
        with pytest.raises((ConnectionClosed, OSError)):
            conn.command(f"END_TXN {s.ids} result={'commit' if committed else 'abort'}")
    assert broker.wait_exit() != 0
    broker.env = {}
    broker.start()
    with connect(broker) as conn:
        out0, out1 = payloads(read_all(conn, "out", 0)), payloads(read_all(conn, "out", 1))
        offset = _fetch_offset(conn, "in", 0)
        status = ok_fields(conn.command("TXN_STATUS transactional_id=ctp"))
        if committed:
            assert (out0, out1, offset, status["state"]) == ([b"r0"], [b"r1"], 7, "committed")
            # the uncertain END_TXN is retried with the same epoch: idempotent
            retry = ok_fields(conn.command(f"END_TXN transactional_id=ctp producerId={s.producer_id} "
                                           f"epoch={s.epoch} result=commit"))
            assert retry["state"] == "committed"
        else:
            assert (out0, out1, offset, status["state"]) == ([], [], 0, "aborted")
        # exactly one marker per partition, records once
        raw0 = read_all(conn, "out", 0, isolation="read_uncommitted")
        assert [r.payload for r in raw0].count(b"r0") == 1
        assert sum(1 for r in raw0 if r.transaction_marker) == 1


def test_kill_while_open_then_reinit_aborts(broker_factory):
    broker = broker_factory().start()
    with connect(broker) as conn:
        create_topic(conn, "out", partitions=1)
        s = Session(conn, "open-crash")
        s.init()
        s.begin()
        s.publish("out", "pending", partition=0)
        conn.command("PUBLISH topic=out producerId=plain acks=1 message=plain")
    broker.restart(kill=True)
    with connect(broker) as conn:
        assert read_all(conn, "out", 0) == []  # still open after restart: pins the LSO
        assert ok_fields(conn.command("TXN_STATUS transactional_id=open-crash"))["state"] == "open"
        fresh = Session(conn, "open-crash")
        fresh.init()
        assert fresh.epoch == s.epoch + 1
        assert payloads(read_all(conn, "out", 0)) == [b"plain"]


def test_journal_torn_tail_is_truncated_and_mid_corruption_refuses_startup(broker_factory):
    broker = broker_factory().start()
    with connect(broker) as conn:
        create_topic(conn, "out", partitions=1)
        s = Session(conn, "j")
        s.init()
        s.begin()
        s.publish("out", "a", partition=0)
        s.end("commit")
    broker.kill()
    journal = broker.log_dir / JOURNAL_NAME
    good = journal.read_bytes()
    journal.write_bytes(good + b"\x00\x00\x01\x00{\"trunc")  # a torn final record
    broker.start()
    with connect(broker) as conn:
        assert ok_fields(conn.command("TXN_STATUS transactional_id=j"))["state"] == "committed"
        assert payloads(read_all(conn, "out", 0)) == [b"a"]
    broker.kill()
    data = bytearray(journal.read_bytes())
    assert len(data) == len(good)
    data[10] ^= 0xFF  # inside the first record, valid records follow
    journal.write_bytes(bytes(data))
    broker.start(expect_ready=False)
    assert broker.wait_exit() != 0
    assert "corrupt transaction journal" in broker.output()


def test_publish_retry_after_restart_appends_nothing(broker_factory):
    broker = broker_factory().start()
    with connect(broker) as conn:
        create_topic(conn, "out", partitions=1)
        s = Session(conn, "retry")
        s.init()
        s.begin()
        s.publish("out", "once", partition=0, seq=1)
    broker.restart(kill=True)
    with connect(broker) as conn:
        s.conn = conn
        assert s.publish("out", "once", partition=0, seq=1)["partition"] == "0"
        s.publish("out", "twice", partition=0, seq=2)
        s.end("commit")
        assert payloads(read_all(conn, "out", 0)) == [b"once", b"twice"]


def test_delete_blocked_by_open_transaction_and_metrics(broker_factory):
    broker = broker_factory(settings={"exporter_port": 0}).start()
    with connect(broker) as conn:
        create_topic(conn, "out", partitions=1)
        s = Session(conn, "del")
        s.init()
        s.begin()
        s.publish("out", "x", partition=0)
        assert error_of(conn.command("DELETE topic=out")).code == "topic_delete_blocked"
        status, body = broker.http_get("/metrics", port=broker.metrics_port)
        text = body.decode()
        assert status == 200 and "cursus_transaction_recovery_ready 1.0" in text
        assert 'cursus_transactions{state="open"} 1.0' in text
        assert 'cursus_partition_last_stable_offset_lag{partition="0",topic="out"} 1.0' in text
        s.end("abort")
        assert ok_fields(conn.command("DELETE topic=out"))["deleted"] == "true"
        assert ok_fields(conn.command("TXN_STATUS transactional_id=del"))["participants"] == "0"


def test_a_lost_group_fence_refuses_the_commit_and_keeps_it_open(broker_factory):
    broker = broker_factory().start()
    with connect(broker) as conn:
        create_topic(conn, "in", partitions=1)
        create_topic(conn, "out", partitions=2)
        for i in range(7):
            conn.command(f"PUBLISH topic=in producerId=src acks=1 message=m{i}")
        member, generation = _join(conn, "in")
        s = _transaction(conn, "out", "in", member, generation)
        ok_fields(conn.command(f"LEAVE_GROUP topic=in group={GROUP} member={member} generation={generation}"))
        assert s.end_error("commit") == "member_not_found"
        assert s.status()["state"] == "open"
        assert s.end("abort")["state"] == "aborted"
        assert read_all(conn, "out", 0) == [] and _fetch_offset(conn, "in", 0) == 0
