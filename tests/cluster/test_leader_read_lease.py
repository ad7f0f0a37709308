"""Chaos findings F and I: a deposed leader resumed from SIGSTOP never shows an HWM below the new committed
one, and a STREAM open on it ends instead of going on as a follower.

A partition leader paused past ``broker_session_timeout_ms`` is fenced; another broker leads and commits
more acks=all records. Right after SIGCONT the paused node still believes it leads (it has not applied the
new metadata yet); without a read lease it answered LIST_OFFSETS with its old, lower HWM. With the lease
(:meth:`cursus.cluster.controller.Controller.lease_valid`) it refuses reads with ``leader_not_available``
until a fresh own heartbeat is applied, and by then it applied the leadership change too. A STREAM opened
while it led kept pushing after it became a follower (finding I, chaos seed 13: up to an HWM its FSM had
applied before the new leader's had, so LIST_OFFSETS on the leader then showed less); it now ends with
``NOT_LEADER``/``leader_not_available``.
"""

from __future__ import annotations

import threading
import time

from cursus.client.connection import Connection
from cursus.wire import Command, CommandPayload, Status, decode_batch, encode_crq2
from tests.cluster.clustersupport import Cluster, wait_for
from tests.cluster.replsupport import (
    _field,
    conn,
    leader_proc,
    make_topic,
    partition_state,
    publish_ok,
    restored_cluster,
)
from tests.integration.helpers import error_of

cluster, all_brokers_running = restored_cluster("leader-read-lease", broker_session_timeout_ms=1500,
                                                broker_heartbeat_interval_ms=200)


def _poll(broker, topic: str, offset: int) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    with Connection(*broker.address, timeout_s=5) as c:
        frame = c.command(f"LIST_OFFSETS topic={topic} partition=0")
        out.append(("hwm", _field(frame.payload.decode(), "hwm")) if frame.status == Status.OK
                   else ("error", error_of(frame).code))
        frame = c.command(f"CONSUME topic={topic} partition=0 offset={offset} wait_ms=0")
        if frame.status == Status.OK:
            out.append(("records", len(decode_batch(frame.payload).records) if frame.payload else 0))
        else:
            out.append(("error", error_of(frame).code))
    return out


def test_resumed_deposed_leader_never_shows_an_older_hwm(cluster: Cluster) -> None:
    topic = "read-lease"
    make_topic(cluster, topic)
    old = leader_proc(cluster, topic)
    with conn(old) as c:
        for i in range(10):
            publish_ok(c, topic, [f"a{i}-{k}".encode() for k in range(5)])
    old_hwm = wait_for(lambda: partition_state(cluster, topic)["committed_hwm"] == 50 and 50, 10,
                       "the committed HWM applied")
    others = [b for b in cluster.brokers if b is not old]
    old.pause()
    new = wait_for(lambda: (p := leader_proc(cluster, topic, via=others[0])) is not None and p is not old and p,
                   30, "another broker leads")
    with conn(new) as c:
        for i in range(10):
            publish_ok(c, topic, [f"b{i}-{k}".encode() for k in range(5)])
    committed = wait_for(lambda: (h := partition_state(cluster, topic, via=others[0])["committed_hwm"]) >= 100
                         and h, 10, "the new committed HWM")
    old.resume()
    seen: list[tuple[str, object]] = []
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        try:
            seen.extend(_poll(old, topic, old_hwm))
        except OSError:
            time.sleep(0.01)
    stale = [v for k, v in seen if k == "hwm" and v < committed]  # type: ignore[operator]
    assert not stale, f"the resumed node showed HWM {stale[:5]} < committed {committed}: {seen[:10]}"
    empty = [v for k, v in seen if k == "records" and v == 0]
    assert not empty, f"CONSUME offset={old_hwm} (committed) answered OK with no records: {seen[:10]}"
    errors = {v for k, v in seen if k == "error"}
    assert errors <= {"leader_not_available", "NOT_LEADER"}, errors
    assert seen, "no answer from the resumed node"


def test_a_stream_on_a_deposed_leader_ends_instead_of_serving_as_a_follower(cluster: Cluster) -> None:
    topic = "stream-deposed"
    make_topic(cluster, topic)
    old = leader_proc(cluster, topic)
    with conn(old) as c:
        publish_ok(c, topic, [f"a{k}".encode() for k in range(10)])
    wait_for(lambda: partition_state(cluster, topic)["committed_hwm"] == 10, 10, "the committed HWM applied")
    frames: list[tuple[str, object]] = []
    ended = threading.Event()

    def read_stream() -> None:  # the stream's frames, until it ends (or the connection does)
        payload = encode_crq2(CommandPayload((), {"topic": topic, "partition": "0", "offset": "0"}))
        try:
            with Connection(*old.address, timeout_s=30) as c:
                for frame in c.stream(Command.STREAM, payload):
                    if frame.status == Status.ERROR:
                        frames.append(("error", error_of(frame).code))
                    elif frame.status == Status.OK and frame.payload:
                        frames.append(("records", [r.offset for r in decode_batch(frame.payload).records]))
                    else:
                        frames.append(("other", bytes(frame.payload[:40])))
        except OSError as exc:
            frames.append(("closed", repr(exc)))
        finally:
            ended.set()

    reader = threading.Thread(target=read_stream, daemon=True)
    reader.start()
    wait_for(lambda: ("records", list(range(10))) in frames, 10, "the stream delivered the first records")
    others = [b for b in cluster.brokers if b is not old]
    old.pause()
    new = wait_for(lambda: (p := leader_proc(cluster, topic, via=others[0])) is not None and p is not old and p,
                   30, "another broker leads")
    with conn(new) as c:
        publish_ok(c, topic, [f"b{k}".encode() for k in range(10)])
    wait_for(lambda: partition_state(cluster, topic, via=others[0])["committed_hwm"] >= 20, 10,
             "the new committed HWM")
    old.resume()
    assert ended.wait(20), f"the stream on the deposed leader went on after it resumed: {frames}"
    after = frames[frames.index(("records", list(range(10)))) + 1:]
    served = [v for k, v in after if k == "records"]
    assert not served, f"the deposed leader pushed records it no longer leads: {served}"
    assert after[-1][0] == "error" and after[-1][1] in {"NOT_LEADER", "leader_not_available"}, after
