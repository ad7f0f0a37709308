"""The SDK producer (acks=all, idempotent) and consumer across kill -9 and SIGSTOP of partition leaders
(break-it session).

``test_sdk_rides_through_leader_kill_and_pause``: while a producer sends and a consumer follows two
partitions, one leader is killed -9 and restarted, another paused (SIGSTOP) past the session timeout and
resumed, and a leader killed and restarted at once (it leads again in a new epoch while preparing): every
acknowledged record is in the log exactly once at its acknowledged offset, each partition holds the records
in send order, and the consumer's offsets never go back or repeat.

``test_consumer_rides_through_a_long_leader_preparation``: a restarted leader that prepares (refusing
reads with ``leader_not_available``) longer than the client's backoff budget made ``Consumer.poll`` raise
it to the application (finding, fixed in ``ConsumerCore.consume_steps``); the consumer now waits it out,
without spinning, and reads on.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import pytest

from cursus.client import Consumer, CursusError, DeliveryFailedError, Producer
from tests.cluster.clustersupport import Cluster, wait_for
from tests.cluster.replsupport import (
    conn,
    leader_proc,
    module_cluster,
    read_partition,
    restore_brokers,
    wait_isr,
)
from tests.integration.helpers import create_topic

cluster = module_cluster("breakit-sdk-failover", broker_session_timeout_ms=3000, replica_lag_time_max_ms=3000)
TOPIC = "bk"
PARTS = 2


@pytest.mark.parametrize("idempotent", [True, False], ids=["idempotent", "plain"])
def test_sdk_rides_through_leader_kill_and_pause(cluster: Cluster, idempotent: bool) -> None:
    topic = f"{TOPIC}-{'idem' if idempotent else 'plain'}"
    with conn(cluster.brokers[0]) as c:
        create_topic(c, topic, PARTS, replication_factor="3")
    for p in range(PARTS):
        wait_isr(cluster, topic, 3, partition=p)
    bootstrap = [b.bootstrap for b in cluster.brokers]
    acked: dict[int, list[tuple[int, int]]] = defaultdict(list)  # partition -> (i, offset)
    failed: list[tuple[int, str]] = []
    stop = threading.Event()
    seen: dict[int, list[tuple[int, bytes]]] = defaultdict(list)
    consumer_errors: list[str] = []

    def produce() -> None:
        # small batches: up to max_in_flight (5) of them pipelined per partition
        pr = Producer(bootstrap, idempotent=idempotent, acks="all", linger_ms=2, batch_size=10,
                      delivery_timeout_s=60)
        try:
            i = 0
            while not stop.is_set():
                futs = []
                for _ in range(200):
                    futs.append((i, pr.send(topic, f"m{i}".encode(), partition=i % PARTS)))
                    i += 1
                for n, f in futs:
                    try:
                        md = f.result(timeout=90)
                        acked[md.partition].append((n, md.offset))
                    except CursusError as exc:
                        failed.append((n, exc.code))
                time.sleep(0.01)
        finally:
            try:
                pr.close()
            except DeliveryFailedError:
                pass  # the failures were taken from the futures

    def consume() -> None:
        try:
            with Consumer(topic, bootstrap, start="earliest", wait_ms=200) as cons:
                while not stop.is_set():
                    for r in cons.poll():
                        seen[r.partition].append((r.offset, bytes(r.value)))
        except Exception as exc:  # noqa: BLE001
            consumer_errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=produce, daemon=True), threading.Thread(target=consume, daemon=True)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(acked[0]) > 100 and len(seen[0]) > 50, 30, "records flowing")
        victim = leader_proc(cluster, topic, 0)
        victim.kill()
        time.sleep(1.0)  # traffic meanwhile goes to nothing: the producer retries, the consumer waits
        victim.start(timeout_s=60)
        time.sleep(2)
        victim = leader_proc(cluster, topic, 1)
        victim.pause()
        time.sleep(4)  # past broker_session_timeout_ms: the partition fails over
        victim.resume()
        time.sleep(2)
        victim = leader_proc(cluster, topic, 0)
        victim.kill()
        victim.start(timeout_s=60)  # at once: leads again in a new epoch while preparing
        n = len(acked[0])
        wait_for(lambda: len(acked[0]) > n + 100, 60, "records acknowledged after the last restart")
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    restore_brokers(cluster)
    assert not consumer_errors, consumer_errors
    if idempotent:
        assert not failed, failed[:5]  # 60 s delivery timeout: every record is delivered
    else:  # never resent once written: a record whose connection dropped is unknown, never silently lost
        assert {code for _, code in failed} <= {"delivery_unknown", "leader_not_available", "NOT_LEADER"}, failed[:5]
    for p in range(PARTS):
        log = [bytes(r.payload) for r in read_partition(cluster, topic, p)]
        acked_p = acked[p]
        assert acked_p, p
        payloads = [f"m{n}".encode() for n, _ in acked_p]
        for n, off in acked_p:
            assert log[off] == f"m{n}".encode(), (p, n, off, log[off])
        dups = [x for x in set(log) if log.count(x) > 1]
        assert not dups, (p, dups[:10])
        ordered = [int(x[1:]) for x in log]
        assert ordered == sorted(ordered), (p, "log out of send order")
        offs = [o for o, _ in seen[p]]
        assert offs == sorted(set(offs)), (p, "consumer offsets went back or repeated")
        for o, v in seen[p]:
            assert log[o] == v, (p, o)
        assert set(payloads) <= set(log)


def test_consumer_rides_through_a_long_leader_preparation(cluster: Cluster) -> None:
    topic = "bk-prep"
    with conn(cluster.brokers[0]) as c:
        create_topic(c, topic, 1, replication_factor="3")
    wait_isr(cluster, topic, 3)
    bootstrap = [b.bootstrap for b in cluster.brokers]
    with Producer(bootstrap, idempotent=True, acks="all") as pr:
        for i in range(50):
            pr.send(topic, f"m{i}".encode(), partition=0)
        pr.flush()
    errors: list[str] = []
    seen: list[int] = []
    polls = [0]
    stop = threading.Event()

    def consume() -> None:
        try:
            with Consumer(topic, bootstrap, start="earliest", wait_ms=200) as cons:
                while not stop.is_set():
                    polls[0] += 1
                    seen.extend(r.offset for r in cons.poll())
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{type(exc).__name__}: {exc}")

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    wait_for(lambda: len(seen) == 50, 20, "consumed the first 50")
    leader = leader_proc(cluster, topic)
    leader.env["CURSUS_LEADER_PREPARE_DELAY_MS"] = "12000"
    try:
        leader.kill()
        leader.start(timeout_s=60)
        with Producer(bootstrap, idempotent=True, acks="all") as pr:
            for i in range(50, 60):
                pr.send(topic, f"m{i}".encode(), partition=0)
            pr.flush()
        wait_for(lambda: len(seen) == 60 or errors, 60, "consumed the next 10")
    finally:
        stop.set()
        t.join(30)
        leader.env.pop("CURSUS_LEADER_PREPARE_DELAY_MS", None)
        restore_brokers(cluster)
    assert not errors, errors
    assert seen == list(range(60)), seen
    assert polls[0] < 200, f"{polls[0]} polls in the preparation: spinning"
