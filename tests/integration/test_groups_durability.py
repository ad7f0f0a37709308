"""Group registrations, generations and committed offsets survive kill -9 of the broker; replay stays
bounded by the log cleaner; a corrupt or unversioned ``__consumer_offsets`` record keeps the broker not ready."""

from __future__ import annotations

import json
import time

from cursus.broker.group_log import _chunk
from cursus.coordinator.offsets import OFFSETS_TOPIC, group_key
from cursus.storage import LogConfig, PartitionLog
from tests.integration.conftest import connect
from tests.integration.helpers import create_topic, error_of, ok_fields, publish_batch


def test_group_state_and_offsets_survive_kill_9(broker_factory):
    broker = broker_factory(settings={"consumer_session_timeout_ms": 20000, "offsets_topic_segment_bytes": 8192,
                                      "log_cleanup_interval": 0.2, "log_min_cleanable_dirty_ratio": 0.01}).start()
    with connect(broker) as conn:
        create_topic(conn, "orders", partitions=3)
        for p in range(3):
            publish_batch(conn, "orders", p, [b"x"] * 500)
        a = ok_fields(conn.command("JOIN_GROUP topic=orders group=billing member=a"))["member"]
        b = ok_fields(conn.command("JOIN_GROUP topic=orders group=billing member=b"))["member"]
        ok_fields(conn.command("REGISTER_GROUP group=audit pattern=ord*"))
        a = ok_fields(conn.command(f"JOIN_GROUP topic=orders group=billing member={a}"))["member"]
        b = ok_fields(conn.command(f"JOIN_GROUP topic=orders group=billing member={b}"))["member"]  # generation 3
        status = json.loads(conn.command("GROUP_STATUS group=billing").payload)
        owner = {o["partition"]: o["owner"] for o in status["offsets"]}
        # enough commits to fill several segments of __consumer_offsets for the cleaner
        for n in range(1, 401):
            p = n % 3
            reply = conn.command(f"COMMIT_OFFSET topic=orders partition={p} group=billing offset={n} "
                                 f"member={owner[p]} generation=3")
            assert ok_fields(reply) == {}
        before = {p: ok_fields(conn.command(f"FETCH_OFFSET topic=orders partition={p} group=billing"))["offset"]
                  for p in range(3)}
    assert before == {0: "399", 1: "400", 2: "398"}
    deadline = time.monotonic() + 30
    while "cleaned __consumer_offsets/0" not in broker.output():
        assert time.monotonic() < deadline, "no cleaner pass on __consumer_offsets"
        time.sleep(0.05)
    broker.kill()
    broker.start()
    code, body = broker.http_get("/ready")
    assert code == 200, body
    with connect(broker) as conn:
        after = {p: ok_fields(conn.command(f"FETCH_OFFSET topic=orders partition={p} group=billing"))["offset"]
                 for p in range(3)}
        assert after == before
        assert ok_fields(conn.command("LIST_GROUPS"))["groups"] == "audit,billing"
        status = json.loads(conn.command("GROUP_STATUS group=billing").payload)
        assert status["generation"] == 3 and {m["member_id"] for m in status["members"]} == {a, b}
        # members and generation were restored: the old session keeps working without a rejoin
        assert ok_fields(conn.command(f"HEARTBEAT topic=orders group=billing member={a} generation=3"))
        assert error_of(conn.command(f"COMMIT_OFFSET topic=orders partition=0 group=billing offset=3 "
                                     f"member={owner[0]} generation=3")).code == "offset_regression"
        assert json.loads(conn.command("GROUP_STATUS group=audit").payload)["topics"] == ["orders"]


def test_corrupt_record_keeps_broker_not_ready(broker_factory):
    broker = broker_factory().start()
    with connect(broker) as conn:
        create_topic(conn, "events", partitions=1)
        ok_fields(conn.command("JOIN_GROUP topic=events group=g member=m"))
    assert broker.terminate() == 0
    directory = broker.log_dir / "topics" / OFFSETS_TOPIC / "0"
    plog = PartitionLog.open(directory, LogConfig(), clean_shutdown=True)
    unversioned = json.dumps({"type": "group_registration", "group": "g"}).encode()
    body = _chunk(0, plog.log_end_offset, [(group_key("g"), unversioned)], 0)
    plog.append_chunk(plog.log_end_offset, 1, body)
    plog.flush()
    plog.close()
    broker.start()
    code, body = broker.http_get("/ready")
    assert code == 503
    reason = json.loads(body)["checks"]["coordinator"]
    assert "unversioned record" in reason and "__consumer_offsets/0" in reason
    with connect(broker) as conn:
        err = error_of(conn.command("JOIN_GROUP topic=events group=g member=m"))
        assert err.code == "coordinator_not_available" and err.retryable
        assert error_of(conn.command("FETCH_OFFSET topic=events partition=0 group=g")).code == \
            "coordinator_not_available"
        assert ok_fields(conn.command("LIST"))["topics"] == "events"  # the rest of the broker serves
