"""Issue 11: a pipelined SDK producer (max_in_flight=5) sending continuously while an admin DELETEs and
re-CREATEs its topic on a 3-node Raft cluster. Every record future must resolve (acknowledged or a typed
error) within ``delivery_timeout_s`` of ``send``, ``flush`` must return, and no sender thread or task stays
stuck; records sent once the topic is back are delivered again.

One cluster for the module."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

import pytest

from cursus.client.admin import Admin, AsyncAdmin
from cursus.client.errors import CursusError, DeliveryFailedError
from cursus.client.producer import AsyncProducer, Producer
from tests.cluster.clustersupport import Cluster, wait_for, wait_topic_ready
from tests.cluster.replsupport import module_cluster

pytestmark = pytest.mark.timeout(240)

DELIVERY_TIMEOUT_S = 4.0
#: Slack on top of the delivery timeout for a future to be resolved (a loaded 2-core CI machine).
SLACK_S = 6.0
ROUNDS = 3


cluster = module_cluster("recreate")


def _bootstrap(cluster: Cluster) -> list[str]:
    return [f"127.0.0.1:{b.port}" for b in cluster.brokers]


def _recreate(admin: Admin, cluster: Cluster, topic: str, partitions: int) -> None:
    admin.delete_topic(topic)
    time.sleep(0.3)  # let the producer hit the missing topic for a moment
    admin.create_topic(topic, partitions, replication_factor=3)
    wait_topic_ready(cluster, topic, partitions, timeout=30)


def _check_resolved(sent: list[tuple[float, Future]]) -> tuple[int, int]:
    """Every future resolved in time; returns (acknowledged, failed)."""
    ok = failed = 0
    for started, future in sent:
        remaining = started + DELIVERY_TIMEOUT_S + SLACK_S - time.monotonic()
        try:
            future.result(timeout=max(0.1, remaining))
            ok += 1
        except CursusError:
            failed += 1
    return ok, failed


@pytest.mark.parametrize("idempotent", [True, False], ids=["idempotent", "acks1"])
def test_sync_producer_survives_delete_and_recreate(cluster: Cluster, idempotent: bool) -> None:
    topic = f"recreate-sync-{'idem' if idempotent else 'a1'}"
    admin = Admin(_bootstrap(cluster))
    admin.create_topic(topic, 3, replication_factor=3)
    wait_topic_ready(cluster, topic, 3, timeout=30)
    sent: list[tuple[float, Future]] = []
    stop = threading.Event()
    errors: list[BaseException] = []
    producer = Producer(_bootstrap(cluster), idempotent=idempotent, acks="all", max_in_flight=5,
                        batch_size=20, linger_ms=2, delivery_timeout_s=DELIVERY_TIMEOUT_S,
                        request_timeout_s=2.0)

    def run() -> None:
        i = 0
        while not stop.is_set():
            try:
                sent.append((time.monotonic(), producer.send(topic, f"v{i}".encode())))
            except CursusError as exc:  # topic_not_found while it is gone: a typed, immediate error
                errors.append(exc)
                time.sleep(0.01)
            i += 1
            if i % 50 == 0:
                time.sleep(0.005)

    sender = threading.Thread(target=run, name="test-sender", daemon=True)
    sender.start()
    try:
        for _ in range(ROUNDS):
            time.sleep(1.0)
            _recreate(admin, cluster, topic, 3)
        time.sleep(1.5)
    finally:
        stop.set()
        sender.join(10)
    assert not sender.is_alive()
    ok, failed = _check_resolved(sent)
    assert ok > 0
    started = time.monotonic()
    try:
        producer.flush(timeout_s=DELIVERY_TIMEOUT_S + SLACK_S)
    except DeliveryFailedError:
        pass
    assert time.monotonic() - started < DELIVERY_TIMEOUT_S + SLACK_S
    # the producer still works against the latest incarnation (whose leaders may have moved), also for
    # lone records awaited without flush
    assert producer.produce(topic, b"after", timeout_s=DELIVERY_TIMEOUT_S + SLACK_S).offset is not None
    for i in range(30):
        assert producer.send(topic, f"lone{i}".encode(), partition=i % 3).result(
            timeout=DELIVERY_TIMEOUT_S + SLACK_S).offset is not None
    producer.close(timeout_s=10)
    leftover = [t for t in threading.enumerate() if t.name.startswith("cursus-producer-") and t.is_alive()]
    assert wait_for(lambda: not [t for t in leftover if t.is_alive()], 10, "sender threads stopped")
    print(f"sync idempotent={idempotent}: {ok} acknowledged, {failed} failed, {len(errors)} refused at send")


def test_async_producer_survives_delete_and_recreate(cluster: Cluster) -> None:
    topic = "recreate-async"
    bootstrap = _bootstrap(cluster)

    async def scenario() -> tuple[int, int]:
        admin = AsyncAdmin(bootstrap)
        await admin.create_topic(topic, 3, replication_factor=3)
        await asyncio.to_thread(wait_topic_ready, cluster, topic, 3, 30)
        producer = AsyncProducer(bootstrap, idempotent=True, max_in_flight=5, batch_size=20, linger_ms=2,
                                 delivery_timeout_s=DELIVERY_TIMEOUT_S, request_timeout_s=2.0)
        sent: list[tuple[float, asyncio.Future]] = []
        stop = asyncio.Event()

        async def run() -> None:
            i = 0
            while not stop.is_set():
                try:
                    sent.append((time.monotonic(), await producer.send(topic, f"v{i}".encode())))
                except CursusError:
                    await asyncio.sleep(0.01)
                i += 1
                if i % 50 == 0:
                    await asyncio.sleep(0.005)

        task = asyncio.create_task(run())
        for _ in range(ROUNDS):
            await asyncio.sleep(1.0)
            await admin.delete_topic(topic)
            await asyncio.sleep(0.3)
            await admin.create_topic(topic, 3, replication_factor=3)
            await asyncio.to_thread(wait_topic_ready, cluster, topic, 3, 30)
        await asyncio.sleep(1.5)
        stop.set()
        await asyncio.wait_for(task, 10)
        ok = failed = 0
        for started, future in sent:
            remaining = started + DELIVERY_TIMEOUT_S + SLACK_S - time.monotonic()
            try:
                await asyncio.wait_for(asyncio.shield(future), max(0.1, remaining))
                ok += 1
            except CursusError:
                failed += 1
        try:
            await producer.flush(timeout_s=DELIVERY_TIMEOUT_S + SLACK_S)
        except DeliveryFailedError:
            pass
        assert (await producer.send_and_wait(topic, b"after")).offset is not None
        await asyncio.wait_for(producer.close(timeout_s=10), 20)
        assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()
                    and "_sender" in repr(t.get_coro())]
        await admin.close()
        return ok, failed

    ok, failed = asyncio.run(scenario())
    assert ok > 0
    print(f"async: {ok} acknowledged, {failed} failed")


def test_a_lone_record_is_sent_whichever_leader_it_goes_to(cluster: Cluster) -> None:
    """Root cause 1 of issue 11: sender threads of every leader waited on one condition and a due batch
    woke one arbitrary sender, often one of another leader, which went back to sleep: the record waited
    for an unrelated wake-up (or forever). Here partitions have different leaders and each record is sent
    alone, its future awaited without flush."""
    topic = "lone-records"
    admin = Admin(_bootstrap(cluster))
    admin.create_topic(topic, 3, replication_factor=3)  # RF 3 spreads the leaders
    wait_topic_ready(cluster, topic, 3, timeout=30)
    leaders = {leader for leader in admin.metadata(topic).leaders}
    assert len(leaders) >= 2, leaders  # else the test proves nothing
    with Producer(_bootstrap(cluster), acks="1", linger_ms=0, delivery_timeout_s=30) as producer:
        for i in range(60):
            future = producer.send(topic, f"r{i}".encode(), partition=i % 3)
            future.result(timeout=5)  # without the fix: TimeoutError here
