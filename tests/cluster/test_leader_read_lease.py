"""Chaos finding F: a deposed leader resumed from SIGSTOP never shows an HWM below the new committed one.

A partition leader paused past ``broker_session_timeout_ms`` is fenced; another broker leads and commits
more acks=all records. Right after SIGCONT the paused node still believes it leads (it has not applied the
new metadata yet); without a read lease it answered LIST_OFFSETS with its old, lower HWM. With the lease
(:meth:`cursus.cluster.controller.Controller.lease_valid`) it refuses reads with ``leader_not_available``
until a fresh own heartbeat is applied, and by then it applied the leadership change too.
"""

from __future__ import annotations

import time

from cursus.client.connection import Connection
from cursus.wire import Status, decode_batch
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
