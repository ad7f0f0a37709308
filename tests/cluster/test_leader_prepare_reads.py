"""What clients read from a partition leader that is not ready yet (chaos finding, issue 13), fixed.

``test_restarted_leader_never_shows_a_stale_hwm``: the chaos harness (seed 5, faults kill,corrupt,restart)
saw LIST_OFFSETS answer HWM 400 and then 396: a leader killed with -9 and restarted at once (before
``broker_session_timeout_ms``, so it leads again, in a new leader epoch) served the HWM of its local
checkpoint -- written lazily, every ``log_recovery_point_interval_ms`` -- while it prepared to lead
(:meth:`cursus.broker.replica.Replica.become_leader`), below the committed HWM every client had already
seen; and CONSUME of a committed offset above that stale HWM answered OK with no records, as if it were the
end of the log. Issue 13: the HWM a client observes never decreases across failover, and no consumer is
told a committed record is not there.

Fixed: a replica that has no role yet (``OPENED``: metadata still replaying), or a cluster leader still
preparing, refuses reads (LIST_OFFSETS, CONSUME, STREAM, BROWSE) with ``leader_not_available``
(retryable, :meth:`Replica.check_readable`); once ready its HWM is the committed one.

The checkpoint interval is long here, so the restarted leader's checkpointed HWM is far below the committed
HWM, and ``CURSUS_LEADER_PREPARE_DELAY_MS`` widens the preparation so the polls land in it.

``test_a_follower_fetching_below_the_committed_hwm_leaves_the_isr_at_once``: the ISR rule of
:mod:`cursus.replication.isr` ("shrink at once a member whose last fetch in this epoch is below the
committed HWM"), on processes: a follower killed -9 whose segment is cut in half comes back (before the
session timeout, so it is never fenced) with its log ending below the committed HWM; its first fetch there
makes the leader propose an ISR without it long before ``replica_lag_time_max_ms`` (60 s here) could
(one chunk per fetch keeps it below the HWM for many ISR checks), then it fetches the rest, rejoins, and
ends byte-identical to the leader.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cursus.client.connection import Connection
from cursus.wire import Command, CommandPayload, Status, decode_batch, encode_crq2
from tests.cluster.clustersupport import Cluster, wait_for
from tests.cluster.replsupport import (
    _field,
    conn,
    leader_proc,
    make_topic,
    module_cluster,
    partition_state,
    publish_ok,
    restore_brokers,
    wait_isr,
)
from tests.integration.helpers import error_of

LAG_TIME_MAX_MS = 60_000
#: One chunk per replica fetch and an ISR check every 20 ms: a follower that lost 150 committed chunks is
#: below the committed HWM for 150 fetch rounds, many ISR checks.
cluster = module_cluster("leader-prepare-reads", log_recovery_point_interval_ms=600_000,
                         broker_session_timeout_ms=30_000, replica_lag_time_max_ms=LAG_TIME_MAX_MS,
                         replica_fetch_max_bytes=1, replica_isr_check_interval_ms=20)

PREPARE_DELAY_MS = 1500


def _answers(broker, asks) -> list[tuple[str, object]]:
    """Each ``(kind, ask, value)`` of ``asks`` once, in order, on one connection to ``broker``: ``ask(c)``
    sends a request and returns its answer frame; an OK answer is ``(kind, value(c, frame))``, any other
    ``("error", "code: reason")``."""
    out: list[tuple[str, object]] = []
    with Connection(*broker.address, timeout_s=5) as c:
        for kind, ask, value in asks:
            frame = ask(c)
            out.append((kind, value(c, frame)) if frame.status == Status.OK else ("error", _error(frame)))
    return out


def _command(text: str):
    return lambda c: c.command(text)


def _poll(broker, topic: str, below: int) -> list[tuple[str, object]]:
    """LIST_OFFSETS, DESCRIBE and CONSUME ``offset=below`` on ``broker``, once (:func:`_answers`: ``("hwm",
    n)``, ``("described_hwm", n)``, ``("records", n)``)."""
    return _answers(broker, [
        ("hwm", _command(f"LIST_OFFSETS topic={topic} partition=0"), lambda c, f: _field(f.payload.decode(), "hwm")),
        ("described_hwm", _command(f"DESCRIBE topic={topic}"),
         lambda c, f: json.loads(f.payload)["partitions"][0]["hwm"]),
        ("records", _command(f"CONSUME topic={topic} partition=0 offset={below} wait_ms=0"),
         lambda c, f: len(decode_batch(f.payload).records) if f.payload else 0)])


def _error(frame) -> str:
    err = error_of(frame)
    return f"{err.code}: {err.fields.get('reason', '')}"


def _restart_and_poll(cluster: Cluster, topic: str, leader, poll, done, what: str) -> list[tuple[str, object]]:
    """kill -9 ``leader`` and restart it at once (same port) with a slow preparation; call ``poll()`` on it
    from the moment it accepts until ``done(answers)`` holds and it logged "ready" (60 s). Returns every
    answer seen. Asserts the same broker leads again in a higher epoch, that it refused only with
    ``leader_not_available`` / ``NOT_LEADER``, and that the window was hit (a "preparing" refusal)."""
    before = partition_state(cluster, topic)
    leader.env["CURSUS_LEADER_PREPARE_DELAY_MS"] = str(PREPARE_DELAY_MS)
    leader.kill()
    leader.start(expect_ready=False)  # same port: poll it from the moment it accepts
    seen: list[tuple[str, object]] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            answers = poll()
        except OSError:  # not listening yet
            time.sleep(0.02)
            continue
        seen.extend(answers)
        if any(k == "error" and str(v).startswith("NOT_LEADER") for k, v in answers):
            moved = partition_state(cluster, topic)
            assert moved["leader"] == before["leader"], (
                f"leadership moved: the restart took longer than broker_session_timeout_ms ({moved})")
        if done(answers) and "ready" in leader.output():
            break
        time.sleep(0.01)
    else:
        raise AssertionError(f"the restarted leader never served {what}: {seen[-10:]}")
    after = partition_state(cluster, topic)
    assert after["leader"] == before["leader"] and after["leader_epoch"] > before["leader_epoch"], (before, after)
    errors = {str(v) for k, v in seen if k == "error"}
    assert {e.partition(":")[0] for e in errors} <= {"leader_not_available", "NOT_LEADER"}, errors
    # the window was hit: the restarted leader answered while preparing to lead (and refused then)
    assert any("preparing" in e for e in errors), errors
    return seen


@contextmanager
def _restoring(cluster: Cluster) -> Iterator[None]:
    """On exit: no broker keeps the slow-preparation hook, and every broker runs again."""
    try:
        yield
    finally:
        for broker in cluster.brokers:
            broker.env.pop("CURSUS_LEADER_PREPARE_DELAY_MS", None)
        restore_brokers(cluster)


def test_restarted_leader_never_shows_a_stale_hwm(cluster: Cluster) -> None:
    topic = "stale-hwm"
    with _restoring(cluster):
        make_topic(cluster, topic)
        leader = leader_proc(cluster, topic)
        with conn(leader) as c:
            for i in range(8):  # the first append checkpoints; the next ones only move the HWM in memory
                publish_ok(c, topic, [f"r{i}-{k}".encode() for k in range(5)])
        with conn(leader) as c:
            frame = c.command(f"LIST_OFFSETS topic={topic} partition=0")
        known = _field(frame.payload.decode(), "hwm")
        assert known == 40, frame.payload
        assert partition_state(cluster, topic)["committed_hwm"] == 40

        seen = _restart_and_poll(cluster, topic, leader, lambda: _poll(leader, topic, known - 5),
                                 lambda answers: ("hwm", known) in answers and ("records", 5) in answers,
                                 "the committed HWM")
        stale = [v for k, v in seen if k == "hwm" and v < known]  # type: ignore[operator]
        assert not stale, f"LIST_OFFSETS went back below {known}: {stale[:10]} (answers {seen[:20]})"
        stale = [v for k, v in seen if k == "described_hwm" and v < known]  # type: ignore[operator]
        assert not stale, f"DESCRIBE showed an HWM below {known}: {stale[:10]} (answers {seen[:20]})"
        empty = [v for k, v in seen if k == "records" and v == 0]
        assert not empty, f"CONSUME offset={known - 5} (committed) answered OK with no records: {seen[:20]}"


def _segment(broker, topic: str) -> Path:
    (only,) = sorted((broker.log_dir / "topics" / topic / "0").glob("*.log"))
    return only


def test_a_follower_fetching_below_the_committed_hwm_leaves_the_isr_at_once(cluster: Cluster) -> None:
    topic = "fetch-below-hwm"
    try:
        row = make_topic(cluster, topic)
        leader = cluster.by_id(row["leader"])
        follower = next(b for b in cluster.brokers if b is not leader)
        name = follower.log_dir.name
        chunks = 150
        with conn(leader) as c:
            for i in range(chunks - 1):
                publish_ok(c, topic, [f"r{i}".encode() * 200], acks="1")
            publish_ok(c, topic, [b"last"])  # acks=all: committed, on every member, with all before it
        wait_for(lambda: partition_state(cluster, topic)["committed_hwm"] == chunks, 10, "committed HWM applied")
        size = wait_for(lambda: (n := _segment(follower, topic).stat().st_size)
                        == _segment(leader, topic).stat().st_size and n, 10, "the follower holds every record")
        shrink_line = f"shrunk ['{name}']"
        lines_before = leader.output().count(shrink_line)
        logs_before = [len(b.output()) for b in cluster.brokers]
        follower.kill()
        killed_at = time.monotonic()
        with open(_segment(follower, topic), "r+b") as f:
            f.truncate(size // 2)  # a torn chunk: recovery cuts the log to the chunk before it
        follower.start(timeout_s=60)
        # its first fetch is below the committed HWM: out of the ISR at the next check, not after the lag time
        wait_for(lambda: leader.output().count(shrink_line) > lines_before, 30,
                 "the leader proposes an ISR without the follower")
        assert time.monotonic() - killed_at < LAG_TIME_MAX_MS / 1000.0
        assert partition_state(cluster, topic)["leader"] == leader.log_dir.name
        controller_logs = "".join(b.output()[n:] for b, n in zip(cluster.brokers, logs_before, strict=True))
        assert f"broker {name} missed its heartbeats" not in controller_logs  # never fenced: the rule did it
        wait_isr(cluster, topic, 3, timeout=30)  # fetched the rest and rejoined
        leader_bytes = _segment(leader, topic).read_bytes()
        wait_for(lambda: _segment(follower, topic).read_bytes() == leader_bytes, 20,
                 "the follower is byte-identical to the leader again")
    finally:
        restore_brokers(cluster)


def _poll_events(broker, topic: str, key: str) -> list[tuple[str, object]]:
    """STREAM_VERSION, READ_SNAPSHOT and READ_STREAM of ``key`` on ``broker``, once (:func:`_answers`:
    ``("version", n)``, ``("snapshot", text)``, ``("events", n)``)."""
    def read_stream(c):
        return c.receive(c.send(Command.READ_STREAM, encode_crq2(CommandPayload((), {"topic": topic, "key": key}))),
                         Command.READ_STREAM)
    return _answers(broker, [
        ("version", _command(f"STREAM_VERSION topic={topic} key={key}"),
         lambda c, f: _field(f.payload.decode(), "version")),
        ("snapshot", _command(f"READ_SNAPSHOT topic={topic} key={key}"), lambda c, f: f.payload.decode()),
        ("events", read_stream,
         lambda c, f: len(decode_batch(c.receive(f.request_id, Command.READ_STREAM).payload).records))])


def test_restarted_leader_never_serves_a_stale_event_stream(cluster: Cluster) -> None:
    """The event-store reads (STREAM_VERSION, READ_SNAPSHOT, READ_STREAM) of a restarted leader are gated like
    CONSUME: while it prepares they refuse with ``leader_not_available``, never answer a version below one an
    APPEND_STREAM already acknowledged (breakit finding: they answered from the stale local HWM)."""
    topic, key = "stale-events", "agg"
    with _restoring(cluster):
        make_topic(cluster, topic, event_sourcing="true")
        leader = leader_proc(cluster, topic)
        known = 12
        with conn(leader) as c:
            for v in range(1, known + 1):
                frame = wait_for(lambda v=v: (f := c.command(
                    f"APPEND_STREAM topic={topic} key={key} version={v} message=e{v}")).status == Status.OK and f,
                    20, f"APPEND_STREAM version {v}")
                assert _field(frame.payload.decode(), "version") == v, frame.payload
            frame = c.command(f"SAVE_SNAPSHOT topic={topic} key={key} version=3 message=s3")
            assert frame.status == Status.OK, _error(frame)
        before = partition_state(cluster, topic)
        assert before["committed_hwm"] == known, before

        seen = _restart_and_poll(cluster, topic, leader, lambda: _poll_events(leader, topic, key),
                                 lambda answers: ("version", known) in answers and ("events", known - 3) in answers,
                                 "the committed stream")
        stale = [v for k, v in seen if k == "version" and v != known]
        assert not stale, f"STREAM_VERSION answered below the acknowledged {known}: {stale[:10]} ({seen[:20]})"
        short = [v for k, v in seen if k == "events" and v != known - 3]
        assert not short, f"READ_STREAM served a stale stream: {short[:10]} ({seen[:20]})"
