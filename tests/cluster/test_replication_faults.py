"""Replication fault paths on three real broker processes (mutual TLS), each checked end to end:

* ``_step_down``: a broker made leader whose local log ends below the committed HWM (its disk lost the
  partition while it was down; it is back before the session timeout, so the metadata makes it lead again
  in a new epoch) fails closed and hands the partition to another ISR member; no acknowledged record is
  lost, and it catches up as a follower and rejoins the ISR.
* the ISR dropping below min ISR while an acks=all write waits (a follower paused with SIGSTOP or killed
  with kill -9 after the append): the write is never acknowledged falsely; it answers
  ``replication_unavailable outcome=unknown`` and an idempotent retry after the ISR recovered is a
  duplicate with the original offsets.

The session timeout is long (20 s) so a restarted broker is never fenced first: the step-down path, not
the controller, must move leadership.
"""

from __future__ import annotations

import json
import shutil

import pytest

from cursus.wire import Status
from tests.cluster.clustersupport import Cluster, wait_for
from tests.cluster.replsupport import (
    AcksAllWriter,
    check_history,
    conn,
    leader_proc,
    make_topic,
    partition_state,
    publish_ok,
    read_partition,
    restored_cluster,
    wait_isr,
)
from tests.integration.helpers import error_of, publish_batch

cluster, all_brokers_running = restored_cluster("replication-faults", broker_session_timeout_ms=20000)


def test_a_leader_whose_log_ends_below_the_committed_hwm_hands_over(cluster: Cluster) -> None:
    topic = "step-down"
    row = make_topic(cluster, topic)
    writers = [AcksAllWriter(cluster, topic, f"s{i}") for i in range(2)]
    for w in writers:
        w.start()
    wait_for(lambda: all(len(w.acks) >= 10 for w in writers), 30, "writers acknowledged")
    for w in writers:
        w.stop()
    acks = [a for w in writers for a in w.acks]
    acked = sum(len(a.payloads) for a in acks)
    committed = wait_for(lambda: (h := partition_state(cluster, topic)["committed_hwm"]) >= acked and h, 10,
                         "every broker applied the committed HWM of the acknowledged records")
    old = cluster.by_id(row["leader"])
    old.kill()
    shutil.rmtree(old.log_dir / "topics" / topic / "0")  # the partition's storage is gone
    old.start(timeout_s=60)  # back long before the session timeout: the metadata makes it lead, epoch + 1

    def handed_over() -> dict | None:
        state = partition_state(cluster, topic)
        return state if state["leader"] not in (None, old.log_dir.name) else None

    after = wait_for(handed_over, 30, "another ISR member leads")
    assert after["leader_epoch"] >= row["leader_epoch"] + 2  # restart epoch, then the handover
    assert after["committed_hwm"] >= committed
    assert "handed leadership to" in old.output()
    check_history(acks, read_partition(cluster, topic))
    wait_isr(cluster, topic, 3, timeout=30)  # the old leader fetched everything back and rejoined
    new = leader_proc(cluster, topic)
    with conn(new) as c:
        publish_ok(c, topic, [b"after"])


@pytest.mark.parametrize("fault", ["pause", "kill"])
def test_acks_all_never_succeeds_falsely_when_the_isr_drops_below_min_isr_while_it_waits(
        cluster: Cluster, fault: str) -> None:
    topic = f"min-isr-wait-{fault}"
    row = make_topic(cluster, topic, min_in_sync_replicas="3")
    leader = cluster.by_id(row["leader"])
    producer = f"pw-{fault}"
    with conn(leader) as c:
        publish_ok(c, topic, [b"a"], producer=(producer, 0, 1), idempotent=True)
        follower = next(b for b in cluster.brokers if b is not leader)
        follower.pause() if fault == "pause" else follower.kill()
        # The ISR is still 3 (shrinking takes replica_lag_time_max_ms): accepted, appended, waiting. The
        # follower never gets it, the leader shrinks it out, and 2 < min ISR 3: no acknowledgement.
        answer = publish_batch(c, topic, 0, [b"b"], acks="all", producer=(producer, 0, 2), idempotent=True)
        assert answer.status != Status.OK, "acknowledged with fewer in-sync replicas than min ISR"
        err = error_of(answer)
        assert err.code == "replication_unavailable" and err.fields.get("outcome") == "unknown", err
        assert err.retryable
        shrunk = partition_state(cluster, topic, via=leader)
        assert len(shrunk["isr"]) == 2 and follower.log_dir.name not in shrunk["isr"]
    follower.resume() if fault == "pause" else follower.start(timeout_s=60)
    wait_isr(cluster, topic, 3, timeout=30)
    with conn(leader) as c:  # the unknown outcome resolves: the retry is a duplicate at the original offset
        again = wait_for(lambda: (f := publish_batch(c, topic, 0, [b"b"], acks="all", producer=(producer, 0, 2),
                                                     idempotent=True)).status == Status.OK and json.loads(f.payload),
                         20, "the retry is answered")
    assert again["last_offset"] == 1
    assert [bytes(r.payload) for r in read_partition(cluster, topic)] == [b"a", b"b"]


def test_a_restarted_leader_below_the_committed_hwm_answers_reads_with_retryable_storage_unavailable(
        cluster: Cluster) -> None:
    """Reads from a broker made leader again while its log ends below the committed HWM (its partition
    storage was lost while it was down): every answer is the retryable ``storage_unavailable`` (fail
    closed), then the redirect once it handed the partition over (``NOT_LEADER``) -- never records, never a
    non-retryable error. Once it re-fetched and leads again it serves everything."""
    topic = "reads-below-hwm"
    row = make_topic(cluster, topic)
    old = cluster.by_id(row["leader"])
    with conn(old) as c:
        publish_ok(c, topic, [f"r{i}".encode() for i in range(30)])
    wait_for(lambda: partition_state(cluster, topic)["committed_hwm"] == 30, 10, "the committed HWM everywhere")
    old.kill()
    shutil.rmtree(old.log_dir / "topics" / topic / "0")
    old.start(timeout_s=60)
    answers: list[tuple[str, bool, str]] = []

    def handed_over() -> bool:
        with conn(old) as c:
            while True:
                frame = c.command(f"CONSUME topic={topic} partition=0 offset=0")
                if frame.status == Status.OK:
                    answers.append(("OK", True, ""))
                    return True
                err = error_of(frame)
                answers.append((err.code, err.retryable, err.fields.get("reason", "")))
                if err.code == "NOT_LEADER":
                    return True

    wait_for(handed_over, 30, "the restarted broker hands the partition over")
    codes = {code for code, _, _ in answers}
    assert codes <= {"storage_unavailable", "leader_not_available", "NOT_LEADER"}, answers[:5]
    unavailable = [a for a in answers if a[0] == "storage_unavailable"]
    assert unavailable, answers[:5]
    assert all(retryable and "below the committed HWM 30" in reason for _, retryable, reason in unavailable)
    wait_isr(cluster, topic, 3, timeout=30)  # it re-fetched and rejoined
    with conn(old) as c:
        wait_for(lambda: c.command(f"ELECT_LEADER topic={topic} partition=0 broker={old.log_dir.name}"
                                   ).status == Status.OK, 20, "the restarted broker elected")
    wait_for(lambda: partition_state(cluster, topic)["leader"] == old.log_dir.name, 10, "it leads")
    expected = [f"r{i}".encode() for i in range(30)]
    # (a new leader exposes records once it applied the committed HWM in its epoch)
    wait_for(lambda: [bytes(r.payload) for r in read_partition(cluster, topic)] == expected, 20,
             "the restarted broker serves every committed record")
