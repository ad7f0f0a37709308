"""SDK throughput and client CPU against a real broker (broker and client share this machine's cores).

Each phase only produces or only consumes, through the public SDK (``cursus.client``), so the client's own
CPU cost per record can be told apart from the broker's:

* ``sdk_produce_acks1``: :class:`~cursus.client.Producer`, 100-byte records, acks=1, unkeyed (sticky),
  batches of up to 1,000 records, 2 connections, 4 partitions;
* ``sdk_produce_idempotent``: the same with ``idempotent=True`` (acks=all) and keyed records;
* ``sdk_produce_async``: :class:`~cursus.client.AsyncProducer`, acks=1;
* ``sdk_consume``: :class:`~cursus.client.Consumer` reading every partition from the start, records decoded
  into :class:`~cursus.client.ConsumerRecord` objects;
* ``sdk_consume_async``: :class:`~cursus.client.AsyncConsumer`, the same records.

``client_cpu_s`` is this process's CPU time during the phase (all threads); ``broker_cpu_s`` the broker
process's. Sizes are environment-tunable (``CURSUS_BENCH_SDK_RECORDS``).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.support import proc_cpu_s
from cursus.client import Admin, AsyncConsumer, AsyncProducer, Consumer, Producer

RECORDS = int(os.environ.get("CURSUS_BENCH_SDK_RECORDS", "300000"))
PAYLOAD_BYTES = 100
PARTITIONS = 4


def _measure(name: str, pid: int, records: int, body: Callable[[], int], **extra: object) -> dict:
    broker_cpu0 = proc_cpu_s(pid)
    cpu0 = time.process_time()
    started = time.perf_counter()
    count = body()
    elapsed = time.perf_counter() - started
    client_cpu = time.process_time() - cpu0
    assert count == records, (name, count, records)
    return {
        "bench": name, "records": records, "record_bytes": PAYLOAD_BYTES, **extra, "seconds": round(elapsed, 3),
        "records_per_s": round(records / elapsed), "mb_per_s": round(records * PAYLOAD_BYTES / elapsed / 1e6, 1),
        "client_cpu_s": round(client_cpu, 2), "client_cpu_us_per_record": round(client_cpu / records * 1e6, 2),
        "broker_cpu_s": round(proc_cpu_s(pid) - broker_cpu0, 2),
    }


def _produce(address: str, topic: str, count: int, **settings: object) -> int:
    payload = os.urandom(PAYLOAD_BYTES // 2).hex().encode()
    keyed = bool(settings.pop("keyed", False))
    with Producer(address, batch_size=1000, linger_ms=5, connections_per_broker=2, **settings) as producer:
        send = producer.send
        if keyed:
            for i in range(count):
                send(topic, payload, key=str(i % 1024))
        else:
            for _ in range(count):
                send(topic, payload)
        producer.flush()
    return count


def _produce_async(address: str, topic: str, count: int) -> int:
    payload = os.urandom(PAYLOAD_BYTES // 2).hex().encode()

    async def main() -> int:
        async with AsyncProducer(address, batch_size=1000, linger_ms=5, connections_per_broker=2) as producer:
            for _ in range(count):
                await producer.send(topic, payload)
            await producer.flush()
        return count

    return asyncio.run(main())


def _consume(address: str, topic: str) -> int:
    with Consumer(topic, address, batch_size=5000, start="earliest") as consumer:
        return sum(1 for _ in consumer.records(until_end=True))


def _consume_async(address: str, topic: str) -> int:
    async def main() -> int:
        count = 0
        async with AsyncConsumer(topic, address, batch_size=5000, start="earliest") as consumer:
            async for _ in consumer.records(until_end=True):
                count += 1
        return count

    return asyncio.run(main())


def run() -> list[dict]:
    """Start a broker, run the phases, return one dict per phase."""
    from tests.brokerproc import BrokerProcess

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        broker = BrokerProcess(Path(tmp) / "data", health=False).start()
        try:
            address = f"127.0.0.1:{broker.port}"
            assert broker.proc is not None
            pid = broker.proc.pid
            with Admin(address) as admin:
                admin.create_topic("sdk-bench", PARTITIONS)
                admin.create_topic("sdk-bench-idem", PARTITIONS, idempotent=True)
                admin.create_topic("sdk-bench-async", PARTITIONS)
            common = {"partitions": PARTITIONS}
            results.append(_measure("sdk_produce_acks1", pid, RECORDS,
                                    lambda: _produce(address, "sdk-bench", RECORDS), **common, acks="1"))
            half = RECORDS // 2
            results.append(_measure("sdk_produce_idempotent", pid, half,
                                    lambda: _produce(address, "sdk-bench-idem", half, idempotent=True, keyed=True),
                                    **common, acks="all"))
            results.append(_measure("sdk_produce_async", pid, half,
                                    lambda: _produce_async(address, "sdk-bench-async", half), **common, acks="1"))
            results.append(_measure("sdk_consume", pid, RECORDS, lambda: _consume(address, "sdk-bench"), **common))
            results.append(_measure("sdk_consume_async", pid, RECORDS,
                                    lambda: _consume_async(address, "sdk-bench"), **common))
        finally:
            broker.stop()
    return results
