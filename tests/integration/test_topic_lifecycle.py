"""TRUNCATE and DELETE lifecycles of a standalone broker (spec "DELETE", "TRUNCATE"): what is reset or removed,
the preflight refusals, kill -9 at each step of both with restart, and recreation starting empty."""

from __future__ import annotations

import json
import threading
import time

import pytest

from cursus.client.connection import ConnectionClosed
from cursus.wire import Command, Status
from tests.integration import test_metadata_lifecycle
from tests.integration.conftest import connect
from tests.integration.helpers import ack_of, consume_all, create_topic, error_of, ok_fields, publish_batch
from tests.integration.txnsupport import Session

pytestmark = pytest.mark.timeout(120)
#: ``immutable(path)``: chattr +i (released at teardown), shared with the metadata lifecycle tests.
immutable = test_metadata_lifecycle.immutable


def _describe(conn, topic: str) -> dict:
    return json.loads(conn.command(f"DESCRIBE topic={topic}").payload)


def _fill(conn, topic: str, partitions: int = 2) -> None:
    """Records on every partition, and an inactive one-topic group with committed offsets."""
    for p in range(partitions):
        ack_of(publish_batch(conn, topic, p, [f"old-{p}-{i}".encode() for i in range(5)]))
    joined = ok_fields(conn.command(f"JOIN_GROUP topic={topic} group=g member=m"))
    member, generation = joined["member"], joined["generation"]
    for p in range(partitions):
        ok_fields(conn.command(f"COMMIT_OFFSET topic={topic} partition={p} group=g offset=3 member={member} "
                               f"generation={generation}"))
    ok_fields(conn.command(f"LEAVE_GROUP topic={topic} group=g member={member}"))


def _assert_reset(conn, topic: str, partitions: int = 2, *, revision: int = 2, epoch: int = 1) -> None:
    doc = _describe(conn, topic)
    assert (doc["definition"]["revision"], doc["definition"]["lifecycle_epoch"]) == (revision, epoch)
    assert [(p["leo"], p["hwm"], p["log_start_offset"]) for p in doc["partitions"]] == [(0, 0, 0)] * partitions
    for p in range(partitions):
        assert consume_all(conn, topic, p) == []
    # the group and its offsets are gone: a new member starts from the beginning
    assert error_of(conn.command("GROUP_STATUS group=g")).code == "group_not_found"


def test_truncate_resets_every_partition_and_keeps_the_definition(broker_factory):
    broker = broker_factory().start()
    with connect(broker) as conn:
        created = create_topic(conn, "t", partitions=2, retention_hours="5")
        assert created["revision"] == "1" and created["lifecycle_epoch"] == "0"
        _fill(conn, "t")
        assert error_of(conn.command("TRUNCATE topic=t")).code == "missing_expected_revision"
        assert error_of(conn.command("TRUNCATE topic=t expected_revision=x")).code == "invalid_expected_revision"
        conflict = error_of(conn.command("TRUNCATE topic=t expected_revision=7"))
        assert conflict.code == "version_conflict" and conflict.fields["revision"] == "1"
        assert error_of(conn.command("TRUNCATE topic=nope expected_revision=1")).code == "topic_not_found"
        assert error_of(conn.command("TRUNCATE topic=__consumer_offsets expected_revision=1")).code == \
            "internal_topic_delete_forbidden"
        assert ok_fields(conn.command("TRUNCATE topic=t expected_revision=1")) == {
            "topic": "t", "truncated": "true", "revision": "2", "lifecycle_epoch": "1", "leo": "0", "hwm": "0"}
        _assert_reset(conn, "t")
        assert _describe(conn, "t")["definition"]["policy"]["retention_hours"] == 5  # the definition stays
        assert ack_of(publish_batch(conn, "t", 0, [b"new"]))["last_offset"] == 0
        # the compare-and-set uses the new revision
        assert error_of(conn.command("TRUNCATE topic=t expected_revision=1")).code == "version_conflict"
    broker.restart(kill=True)
    with connect(broker) as conn:
        doc = _describe(conn, "t")
        assert (doc["definition"]["revision"], doc["definition"]["lifecycle_epoch"]) == (2, 1)
        assert [r.payload for r in consume_all(conn, "t", 0)] == [b"new"]
        assert consume_all(conn, "t", 1) == []
        assert ok_fields(conn.command("TRUNCATE topic=t expected_revision=2"))["lifecycle_epoch"] == "2"
        assert consume_all(conn, "t", 0) == []
    assert (broker.log_dir / "topics" / "t" / "lifecycle_epoch").read_text().strip() == "2"


def test_truncate_and_delete_are_refused_while_a_group_is_active_or_a_transaction_is_open(broker_factory):
    broker = broker_factory().start()
    with connect(broker) as conn:
        create_topic(conn, "t", partitions=1)
        ack_of(publish_batch(conn, "t", 0, [b"kept"]))
        joined = ok_fields(conn.command("JOIN_GROUP topic=t group=live member=m"))
        blocked = error_of(conn.command("TRUNCATE topic=t expected_revision=1"))
        assert blocked.code == "topic_truncate_blocked" and blocked.fields["group"] == "live"
        assert error_of(conn.command("DELETE topic=t")).code == "topic_delete_blocked"
        ok_fields(conn.command(f"LEAVE_GROUP topic=t group=live member={joined['member']}"))

        s = Session(conn, "tx")
        s.init()
        s.begin()
        s.publish("t", "pending", partition=0)
        blocked = error_of(conn.command("TRUNCATE topic=t expected_revision=1"))
        assert blocked.code == "topic_truncate_blocked" and blocked.fields["transactional_id"] == "tx"
        assert error_of(conn.command("DELETE topic=t")).code == "topic_delete_blocked"
        # nothing changed
        assert _describe(conn, "t")["definition"]["revision"] == 1
        assert [r.payload for r in consume_all(conn, "t", 0)] == [b"kept"]
        s.end("commit")
        # a terminal transaction does not block; its reference to the topic goes
        assert ok_fields(conn.command("TRUNCATE topic=t expected_revision=1"))["truncated"] == "true"
        assert consume_all(conn, "t", 0) == []
        assert ok_fields(conn.command("TXN_STATUS transactional_id=tx"))["state"] == "committed"


@pytest.mark.parametrize("point", ["truncate_after_commit", "truncate_after_trash"])
def test_kill_during_truncate_then_restart_resumes_the_reset(broker_factory, point):
    broker = broker_factory(env={"CURSUS_LIFECYCLE_CRASH_AT": point}).start()
    with connect(broker) as conn:
        create_topic(conn, "t", partitions=2)
        _fill(conn, "t")
        with pytest.raises((ConnectionClosed, OSError)):
            conn.command("TRUNCATE topic=t expected_revision=1")
    assert broker.wait_exit() != 0
    broker.env = {}
    broker.start()
    with connect(broker) as conn:
        _assert_reset(conn, "t")  # never the old generation
        assert ack_of(publish_batch(conn, "t", 1, [b"new"]))["last_offset"] == 0
    assert (broker.log_dir / "topics" / "t" / "lifecycle_epoch").read_text().strip() == "1"


def test_kill_after_the_delete_commit_then_restart_and_recreate_starts_empty(broker_factory):
    broker = broker_factory(env={"CURSUS_LIFECYCLE_CRASH_AT": "delete_after_commit"}).start()
    with connect(broker) as conn:
        create_topic(conn, "t", partitions=2)
        _fill(conn, "t")
        with pytest.raises((ConnectionClosed, OSError)):
            conn.command("DELETE topic=t")
    assert broker.wait_exit() != 0
    broker.env = {}
    broker.start()
    with connect(broker) as conn:
        assert ok_fields(conn.command("LIST"))["count"] == "0"
        assert error_of(conn.command("GROUP_STATUS group=g")).code == "group_not_found"
        fresh = create_topic(conn, "t", partitions=2)
        assert (fresh["revision"], fresh["lifecycle_epoch"]) == ("1", "0")
        assert consume_all(conn, "t", 0) == [] and consume_all(conn, "t", 1) == []
        assert error_of(conn.command("GROUP_STATUS group=g")).code == "group_not_found"
        joined = ok_fields(conn.command("JOIN_GROUP topic=t group=g member=m2"))
        assert ok_fields(conn.command("FETCH_OFFSET topic=t partition=0 group=g")) == {"offset": "0"}
        ok_fields(conn.command(f"LEAVE_GROUP topic=t group=g member={joined['member']}"))


def _metric(broker, name: str) -> float:
    text = broker.http_get("/metrics", port=broker.metrics_port)[1].decode()
    return float(next(line for line in text.splitlines() if line.startswith(f"{name} ")).split()[1])


def test_a_failed_manifest_commit_leaves_the_topic_and_its_groups_live(broker_factory, immutable):
    broker = broker_factory().start()
    with connect(broker) as conn:
        create_topic(conn, "t", partitions=2)
        _fill(conn, "t")
        immutable(broker.log_dir)  # the manifest cannot be replaced now
        assert error_of(conn.command("DELETE topic=t")).code == "delete_topic_failed"
        assert error_of(conn.command("TRUNCATE topic=t expected_revision=1")).code == "truncate_topic_failed"
        immutable.release(broker.log_dir)  # type: ignore[attr-defined]
        assert _describe(conn, "t")["definition"]["revision"] == 1
        assert len(consume_all(conn, "t", 0)) == 5
        assert ok_fields(conn.command("FETCH_OFFSET topic=t partition=0 group=g")) == {"offset": "3"}
        # and the topic is not fenced afterwards: new subscriptions are accepted again
        joined = ok_fields(conn.command("JOIN_GROUP topic=t group=g2 member=m"))
        ok_fields(conn.command(f"LEAVE_GROUP topic=t group=g2 member={joined['member']}"))


def test_a_failed_storage_reset_answers_cleanup_pending_fences_the_topic_and_is_retried(broker_factory, immutable):
    broker = broker_factory(settings={"exporter_port": 0, "topic_cleanup_retry_interval_ms": 100}).start()
    topics = broker.log_dir / "topics"
    with connect(broker) as conn:
        create_topic(conn, "t", partitions=1)
        ack_of(publish_batch(conn, "t", 0, [b"old"] * 3))
        immutable(topics)  # the topic folder cannot be moved to the trash now
        reply = ok_fields(conn.command("TRUNCATE topic=t expected_revision=1"))
        assert reply["cleanup_pending"] == "true" and reply["lifecycle_epoch"] == "1"
        # fenced: neither the old generation nor anything else is served meanwhile
        assert error_of(conn.command("CONSUME topic=t partition=0 offset=0")).code == "leader_not_available"
        assert error_of(publish_batch(conn, "t", 0, [b"x"])).code == "leader_not_available"
        deadline = time.monotonic() + 30
        while _metric(broker, "cursus_topic_cleanup_pending") != 1.0:
            assert time.monotonic() < deadline, "the pending cleanup is not reported"
            time.sleep(0.05)
        assert _metric(broker, "cursus_topic_cleanup_retries_total") >= 1
    # a crash meanwhile: startup keeps it fenced (the marker is behind the committed epoch)
    broker.restart(kill=True)
    with connect(broker) as conn:
        assert error_of(conn.command("CONSUME topic=t partition=0 offset=0")).code == "leader_not_available"
        immutable.release(topics)  # type: ignore[attr-defined]
        deadline = time.monotonic() + 30
        while conn.command("CONSUME topic=t partition=0 offset=0").status != Status.OK:
            assert time.monotonic() < deadline, "the reset was not retried"
            time.sleep(0.05)
        assert consume_all(conn, "t", 0) == []
        assert ack_of(publish_batch(conn, "t", 0, [b"new"]))["last_offset"] == 0
        deadline = time.monotonic() + 30
        while _metric(broker, "cursus_topic_cleanup_pending") != 0.0:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_truncate_keeps_a_multi_topic_group_and_only_drops_the_truncated_topics_offsets(broker_factory):
    broker = broker_factory().start()
    with connect(broker) as conn:
        create_topic(conn, "t", partitions=1)
        create_topic(conn, "u", partitions=1)
        for topic in ("t", "u"):
            ack_of(publish_batch(conn, topic, 0, [b"r"] * 4))
        ok_fields(conn.command("REGISTER_GROUP group=mg topics=t,u"))
        joined = ok_fields(conn.command("JOIN_GROUP group=mg member=m"))
        for topic in ("t", "u"):
            ok_fields(conn.command(f"COMMIT_OFFSET topic={topic} partition=0 group=mg offset=4 "
                                   f"member={joined['member']} generation={joined['generation']}"))
        ok_fields(conn.command(f"LEAVE_GROUP group=mg member={joined['member']}"))
        ok_fields(conn.command("TRUNCATE topic=t expected_revision=1"))
        doc = json.loads(conn.command("GROUP_STATUS group=mg").payload)
        assert sorted(doc["topics"]) == ["t", "u"]
        assert ok_fields(conn.command("FETCH_OFFSET topic=t partition=0 group=mg")) == {"offset": "0"}
        assert ok_fields(conn.command("FETCH_OFFSET topic=u partition=0 group=mg")) == {"offset": "4"}
    broker.restart(kill=True)
    with connect(broker) as conn:
        assert ok_fields(conn.command("FETCH_OFFSET topic=t partition=0 group=mg")) == {"offset": "0"}
        assert ok_fields(conn.command("FETCH_OFFSET topic=u partition=0 group=mg")) == {"offset": "4"}


def _publish_until(conn, topic: str, prefix: str, stop: threading.Event, filler: bytes) -> list[bytes]:
    """Pipeline one-record acks=1 batches on ``conn`` (raw frames, 20 per write) until ``stop``; returns
    the payloads in request order (request ids ``1 + n`` after the connection's earlier requests)."""
    from tests.integration.test_pipelining import _batch, _send_all

    sent: list[bytes] = []
    while not stop.is_set():
        payloads = [f"{prefix}-{len(sent) + i}".encode() + filler for i in range(20)]
        _send_all(conn, [(Command.PUBLISH, _batch(topic, 0, [p])) for p in payloads])
        sent += payloads
    return sent


def test_publishes_in_flight_during_truncate_answer_a_retryable_error_never_topic_not_found(broker_factory):
    """Pipelined PUBLISH requests racing a TRUNCATE (issue 18): each answers OK (durable before the reset,
    or appended to the new generation) or the retryable ``leader_not_available`` -- ``outcome=unknown`` when
    it was appended to the old generation and waited for its fsync when the reset replaced the replica. Never
    ``topic_not_found`` (the topic exists), and no record with an error answer is in the new generation."""
    from concurrent.futures import ThreadPoolExecutor

    broker = broker_factory(settings={"max_in_flight_requests_per_connection": 5000}).start()
    unknown_seen = 0
    filler = b"x" * 4096  # fsyncs take a while: the TRUNCATE lands among appends still waiting
    with connect(broker) as admin, connect(broker) as conn, ThreadPoolExecutor(1) as pool:
        conn.sock.settimeout(30)
        create_topic(admin, "race", partitions=1)
        for round_ in range(8):
            stop = threading.Event()
            first_id = conn.next_request_id
            sending = pool.submit(_publish_until, conn, "race", str(round_), stop, filler)
            answers = [conn.read_frame() for _ in range(50)]  # the broker is appending
            try:
                assert ok_fields(admin.command(f"TRUNCATE topic=race expected_revision={round_ + 1}"))[
                    "truncated"] == "true"
            finally:
                stop.set()
            while not sending.done() or len(answers) < len(sending.result()):
                answers.append(conn.read_frame())
            sent = sending.result()
            assert [f.request_id for f in answers] == list(range(first_id, first_id + len(sent)))
            errors = [error_of(f) for f in answers if f.status != Status.OK]
            for err in errors:
                assert err.code == "leader_not_available" and err.retryable, err
            unknown_seen += sum(1 for e in errors if e.fields.get("outcome") == "unknown")
            acked = {sent[n]: json.loads(f.payload)["last_offset"] for n, f in enumerate(answers)
                     if f.status == Status.OK}
            # the new generation holds only acknowledged records, at their acknowledged offsets
            stored = consume_all(admin, "race", 0)
            assert all(acked.get(bytes(r.payload)) == r.offset for r in stored), stored[:5]
            # every answer after the first error is of the new generation (offsets from 0, all stored)
            first_error = next((n for n, f in enumerate(answers) if f.status != Status.OK), len(sent))
            later = [sent[n] for n in range(first_error, len(sent)) if answers[n].status == Status.OK]
            assert [bytes(r.payload) for r in stored] == later
            if unknown_seen:
                break
    assert unknown_seen, "no PUBLISH was waiting for its fsync when the TRUNCATE replaced the replica"
