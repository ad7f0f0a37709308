"""The blocking producer's intake (records handed to the core in bulk, issue 11) on a real broker: records
sent from several threads keep each thread's order and land exactly once; a record left in the intake with
no further send still leaves within ``linger_ms`` (no flush); ``close`` racing ``send`` leaves no future
pending."""

from __future__ import annotations

import threading
import time

import pytest

from cursus.client import Admin, ClientClosedError, Producer
from tests.integration.helpers import read_values, sdk_address

pytestmark = pytest.mark.timeout(60)


def test_threads_keep_their_order_and_every_record_lands_once(shared_broker, topic_name):
    threads_n, per_thread = 4, 3000
    with Admin(sdk_address(shared_broker)) as admin:
        admin.create_topic(topic_name, 1)
    futures: dict[int, list] = {}
    with Producer(sdk_address(shared_broker), batch_size=200, linger_ms=2) as producer:
        start = threading.Barrier(threads_n)

        def body(index: int) -> None:
            start.wait()
            futures[index] = [producer.send(topic_name, b"%d-%d" % (index, n)) for n in range(per_thread)]

        workers = [threading.Thread(target=body, args=(i,)) for i in range(threads_n)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        producer.flush()
    values = read_values(shared_broker, topic_name, threads_n * per_thread)
    assert len(values) == threads_n * per_thread
    assert len(set(values)) == len(values)
    for index in range(threads_n):
        mine = [v for v in values if v.startswith(b"%d-" % index)]
        assert mine == [b"%d-%d" % (index, n) for n in range(per_thread)]
        offsets = [f.result().offset for f in futures[index]]
        assert offsets == sorted(offsets)
        assert [values[o] for o in offsets] == mine  # each future names where its record is


def test_a_record_without_followers_leaves_within_linger(shared_broker, topic_name):
    with Admin(sdk_address(shared_broker)) as admin:
        admin.create_topic(topic_name, 2)
    with Producer(sdk_address(shared_broker), batch_size=1000, linger_ms=30) as producer:
        for round_ in range(3):  # again after the senders went idle (asleep with nothing due)
            futures = [producer.send(topic_name, b"r%d-%d" % (round_, n)) for n in range(5)]
            for future in futures:
                assert future.result(timeout=10).offset is not None  # no flush: linger sends them
            time.sleep(0.1)


def test_close_racing_send_leaves_no_future_pending(shared_broker, topic_name):
    with Admin(sdk_address(shared_broker)) as admin:
        admin.create_topic(topic_name, 2)
    producer = Producer(sdk_address(shared_broker), batch_size=100, linger_ms=1)
    futures: list = []
    refused = threading.Event()

    def body() -> None:
        try:
            while True:
                futures.append(producer.send(topic_name, b"x"))
        except ClientClosedError:
            refused.set()

    worker = threading.Thread(target=body)
    worker.start()
    while len(futures) < 2000:
        time.sleep(0.005)
    producer.close(timeout_s=20)
    worker.join(timeout=20)
    assert refused.is_set()
    for future in futures:
        assert future.done()
        assert future.exception() is None or isinstance(future.exception(), ClientClosedError)
    assert sum(1 for f in futures if f.exception() is None) >= 2000
