"""An idempotent retry that reaches a new leader while it truncates the very batch retried (chaos seed 8).

The run: the leader of a partition appended an idempotent batch (acks=all) that no follower fetched, was
killed -9 and restarted at once (before ``broker_session_timeout_ms``, so it leads again, in a new leader
epoch). Its producer table, rebuilt from the log at open, still held that batch while its preparation cut the
uncommitted tail. The producer's retry arrived then: the dedup check ran before the writability check,
matched the batch about to be cut, and waited for the committed HWM to pass its old offsets; other producers'
records filled those offsets and committed, and the retry was acknowledged with offsets holding another
producer's records (``lost-writes`` and ``inconsistent-offsets`` in the chaos report).

Fixed: a PUBLISH is checked for writability (role, readiness) before the dedup check, so a retry in the
window gets the retryable ``leader_not_available``; once ready, the table is the one rebuilt from the
truncated log and the retry appends at new offsets.
"""

from __future__ import annotations

import json
import threading
import time

from cursus.client.connection import Connection
from cursus.wire import Batch, Command, Record, Status, encode_batch
from tests.cluster.clustersupport import Cluster, wait_for
from tests.cluster.replsupport import (
    conn,
    make_topic,
    module_cluster,
    partition_state,
    publish_ok,
    read_partition,
    restore_brokers,
)
from tests.integration.helpers import error_of

cluster = module_cluster("idempotent-retry-truncated-tail", broker_session_timeout_ms=30_000,
                         replica_lag_time_max_ms=60_000)

PREPARE_DELAY_MS = 1500
PRODUCER = ("p-retry", 7)


def _batch(topic: str, first_seq: int, count: int) -> bytes:
    records = [Record(topic=topic, partition=0, payload=f"p:{first_seq + i}".encode(), producer_id=PRODUCER[0],
                      producer_epoch=PRODUCER[1], seq_num=first_seq + i) for i in range(count)]
    return encode_batch(Batch(topic=topic, partition=0, acks="all", records=records, idempotent=True))


def _accepts(broker) -> bool:
    try:
        conn(broker).close()
    except OSError:
        return False
    return True


def _segment_size(broker, topic: str) -> int:
    return sum(p.stat().st_size for p in (broker.log_dir / "topics" / topic / "0").glob("*.log"))


def test_a_retry_during_the_truncation_of_its_batch_is_never_acknowledged_at_other_records(cluster: Cluster) -> None:
    topic = "idem-retry-tail"
    try:
        row = make_topic(cluster, topic)
        leader = cluster.by_id(row["leader"])
        followers = [b for b in cluster.brokers if b is not leader]
        with conn(leader) as c:
            frame = c.request(Command.PUBLISH, _batch(topic, 1, 5))
            assert frame.status == Status.OK, frame
        wait_for(lambda: partition_state(cluster, topic)["committed_hwm"] == 5, 10, "seq 1-5 committed")

        # seq 6-7 reaches the leader's disk only: both followers are stopped, so it is never committed
        size = _segment_size(leader, topic)
        for f in followers:
            f.pause()
        orphan = Connection(*leader.address, timeout_s=10)
        orphan.send(Command.PUBLISH, _batch(topic, 6, 2))
        wait_for(lambda: _segment_size(leader, topic) > size, 10, "seq 6-7 written on the leader")
        leader.env["CURSUS_LEADER_PREPARE_DELAY_MS"] = str(PREPARE_DELAY_MS)
        leader.kill()
        orphan.close()
        for f in followers:
            f.resume()
        leader.start(expect_ready=False)  # same port; it leads again in a new epoch and cuts seq 6-7

        answers: list[tuple[str, object]] = []

        def retry() -> None:  # the producer's retry of seq 6-7, from the moment the leader accepts
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    with Connection(*leader.address, timeout_s=30) as c:
                        frame = c.request(Command.PUBLISH, _batch(topic, 6, 2))
                except OSError:
                    time.sleep(0.02)
                    continue
                if frame.status == Status.OK:
                    answers.append(("ok", json.loads(frame.payload)))
                    return
                err = error_of(frame)
                answers.append(("error", f"{err.code}: {err.fields.get('reason', '')}"))
                assert err.code in ("leader_not_available", "NOT_LEADER"), answers[-1]
                time.sleep(0.02)

        retrier = threading.Thread(target=retry, daemon=True)
        retrier.start()
        wait_for(lambda: "truncates its uncommitted tail" in leader.output(), 30, "the new leader cuts seq 6-7")
        # another producer's records take the offsets seq 6-7 had, and commit
        wait_for(lambda: _accepts(leader), 30, "the restarted leader accepts connections")
        with conn(leader) as c:
            publish_ok(c, topic, [b"q:0", b"q:1", b"q:2"])
        retrier.join(60)
        assert answers and answers[-1][0] == "ok", answers[-10:]
        ack = answers[-1][1]
        assert isinstance(ack, dict)
        records = read_partition(cluster, topic)
        by_offset = {r.offset: r.payload for r in records}
        last = int(ack["last_offset"])
        assert [by_offset.get(last - 1), by_offset.get(last)] == [b"p:6", b"p:7"], (ack, by_offset)
        payloads = [r.payload for r in records]
        assert sorted(payloads) == sorted([f"p:{n}".encode() for n in range(1, 8)] + [b"q:0", b"q:1", b"q:2"])
        # the window was hit: the retry reached the leader while it prepared (and was refused then)
        assert any(k == "error" and "truncating" in str(v) for k, v in answers), answers[:10]
    finally:
        leader_env_cleanup(cluster)
        restore_brokers(cluster)


def leader_env_cleanup(cluster: Cluster) -> None:
    for broker in cluster.brokers:
        broker.env.pop("CURSUS_LEADER_PREPARE_DELAY_MS", None)
