"""Event sourcing at the broker's limits, against a real broker with small limits: a READ_STREAM or
AGGREGATE_EVENT_RANGE_READ cut by ``eventstore_max_read_events``/``consume_max_bytes_limit`` says so
(``more``/``next_from_version``), the SDK reads on until the stream is whole, and the documented
load+append loop works on a long stream (docs/event-sourcing.md "Reading long streams")."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from cursus.client.connection import Backoff, Connection
from cursus.client.errors import CursusError, DeliveryUnknownError
from cursus.client.events import AsyncEventStore, EventStore
from cursus.wire import Command, Status, decode_batch
from tests.brokerproc import BrokerProcess
from tests.integration.conftest import connect
from tests.integration.helpers import create_topic, ok_fields
from tests.integration.test_event_sourcing import two_frames

MAX_EVENTS = 4
MAX_BYTES = 600


@pytest.fixture(scope="module")
def small_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    broker = BrokerProcess(tmp_path_factory.mktemp("eslimits") / "data", settings={
        "eventstore_max_read_events": MAX_EVENTS, "consume_max_bytes_limit": MAX_BYTES}).start()
    yield broker
    broker.stop()


@pytest.fixture
def conn(small_broker: BrokerProcess) -> Iterator[Connection]:
    c = connect(small_broker)
    yield c
    c.close()


def test_a_read_cut_by_the_event_limit_says_where_to_continue(conn: Connection, topic_name: str) -> None:
    t = topic_name
    create_topic(conn, t, 1, event_sourcing="true")
    for v in range(1, 11):
        ok_fields(conn.command(f"APPEND_STREAM topic={t} key=k version={v} message=e{v}"))
    envelope, batch = two_frames(conn, Command.READ_STREAM, {"topic": t, "key": "k"})
    doc = json.loads(envelope.payload)
    assert batch is not None
    versions = [r.aggregate_version for r in decode_batch(batch.payload).records]
    assert doc["count"] == len(versions) == MAX_EVENTS and versions == [1, 2, 3, 4]
    assert doc["more"] is True and doc["next_from_version"] == 5
    tail = json.loads(two_frames(conn, Command.READ_STREAM, {"topic": t, "key": "k", "from_version": "9"})[0].payload)
    assert tail["count"] == 2 and "more" not in tail


def test_the_sdk_reads_a_long_stream_whole_and_the_load_append_loop_works(small_broker: BrokerProcess,
                                                                          conn: Connection, topic_name: str) -> None:
    t = topic_name
    create_topic(conn, t, 1, event_sourcing="true")
    big = "x" * 200  # three of these pass the byte limit: the reply is cut by bytes as well as by count
    with EventStore(small_broker.bootstrap, t) as store:
        for v in range(1, 15):
            store.append("order", big if v % 3 == 0 else f"e{v}", expected_version=v)
        aggregate = store.read("order")
        assert [e.version for e in aggregate.events] == list(range(1, 15)) and aggregate.version == 14
        # the documented loop: load, then append at version + 1
        store.append("order", "next", expected_version=store.read("order").version + 1)
        store.save_snapshot("order", 5, "state@5")
        from_snapshot = store.read("order")
        assert from_snapshot.snapshot is not None and from_snapshot.snapshot.version == 5
        assert [e.version for e in from_snapshot.events] == list(range(6, 16)) and from_snapshot.version == 15
        assert store.read("order", from_version=12).version == 15

    async def run_async() -> None:
        async with AsyncEventStore(small_broker.bootstrap, t) as store:
            aggregate = await store.read("order")
            assert [e.version for e in aggregate.events] == list(range(6, 16)) and aggregate.version == 15

    asyncio.run(run_async())


def test_a_range_read_cut_by_a_limit_says_where_to_continue(conn: Connection, topic_name: str) -> None:
    t = topic_name
    create_topic(conn, t, 1, event_sourcing="true", aggregate_replay="true", idempotent="true")
    for v in range(1, 8):
        ok_fields(conn.command(f"APPEND_STREAM topic={t} key=m version={v} event_id=ev{v} producerId=p1 "
                               f"seqNum={v} message=p{v}"))
    got: list[int] = []
    start = 2
    for _ in range(7):
        doc = json.loads(conn.command(f"AGGREGATE_EVENT_RANGE_READ topic={t} match_id=m from_sequence={start} "
                                      f"to_sequence=7 max_records=100").payload)
        page = [e["sequence"] for e in doc["events"]]
        assert 1 <= len(page) <= MAX_EVENTS
        got += page
        if not doc.get("more"):
            break
        assert doc["next_from_sequence"] == page[-1] + 1
        start = doc["next_from_sequence"]
    assert got == [2, 3, 4, 5, 6, 7]
    capped = json.loads(conn.command(f"AGGREGATE_EVENT_RANGE_READ topic={t} match_id=m from_sequence=6 to_sequence=7 "
                                     f"max_records=1").payload)
    assert [e["sequence"] for e in capped["events"]] == [6] and capped["next_from_sequence"] == 7


def test_cursusctl_events_read_shows_the_whole_stream(small_broker: BrokerProcess, conn: Connection,
                                                      topic_name: str) -> None:
    from tests.integration.test_cursusctl import ctl

    t = topic_name
    create_topic(conn, t, 1, event_sourcing="true")
    for v in range(1, 10):
        ok_fields(conn.command(f"APPEND_STREAM topic={t} key=k version={v} message=e{v}"))
    read = json.loads(ctl(small_broker, "--json", "events", "read", t, "k").stdout)
    assert [e["version"] for e in read["events"]] == list(range(1, 10))


def _earliest(conn: Connection, topic: str) -> int:
    offsets = ok_fields(conn.command(f"LIST_OFFSETS topic={topic} partition=0"))["offsets"]
    return int(offsets.split(":")[1].removeprefix("earliest="))


def test_retention_never_cuts_a_stream_silently(broker_factory: Callable[..., BrokerProcess]) -> None:
    """Broker-default retention skips event-sourcing topics; a topic's own retention may delete events, and
    READ_STREAM then answers stream_retention_gap unless a snapshot covers the deleted events."""
    broker = broker_factory(settings={"log_retention_ms": 0, "log_retention_check_interval_ms": 50,
                                      "log_segment_bytes": 4096}).start()
    conn = connect(broker)
    try:
        create_topic(conn, "plain", 1)
        create_topic(conn, "es", 1, event_sourcing="true")
        create_topic(conn, "esr", 1, event_sourcing="true", retention_bytes="4096")
        body = "x" * 500
        for v in range(1, 41):
            assert conn.command(f"PUBLISH topic=plain partition=0 acks=1 producerId=p message={body}").status == Status.OK
            for t in ("es", "esr"):
                ok_fields(conn.command(f"APPEND_STREAM topic={t} key=k version={v} message={body}"))
        deadline = time.monotonic() + 10
        while (_earliest(conn, "plain") == 0 or _earliest(conn, "esr") == 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _earliest(conn, "plain") > 0 and _earliest(conn, "esr") > 0  # the retention task ran
        assert _earliest(conn, "es") == 0
        with EventStore(broker.bootstrap, "es") as store:
            assert [e.version for e in store.read("k").events] == list(range(1, 41))
        with EventStore(broker.bootstrap, "esr") as store:
            with pytest.raises(CursusError) as gap:
                store.read("k")
            assert gap.value.code == "stream_retention_gap" and gap.value.fields["missing_version"] == "1"
            store.save_snapshot("k", 39, "state@39")
            covered = store.read("k")
            assert covered.snapshot is not None and [e.version for e in covered.events] == [40]
            assert covered.version == 40
    finally:
        conn.close()


def test_a_timed_out_append_is_an_unknown_outcome_and_reads_keep_retrying(
        broker_factory: Callable[..., BrokerProcess]) -> None:
    """APPEND_STREAM with no reply in time may have been applied: DeliveryUnknownError (not retryable), never
    a retryable timeout; a read (retry-safe) rides out the same pause."""
    broker = broker_factory().start()
    with EventStore(broker.bootstrap, "orders", timeout_s=0.3,
                    backoff=Backoff(initial_s=0.05, max_s=0.2, attempts_max=30)) as store:
        store.create_topic(partitions=1)
        store.append("o", "created", expected_version=1)
        broker.pause()
        try:
            with pytest.raises(DeliveryUnknownError) as unknown:
                store.append("o", "paid", expected_version=2)
            assert not unknown.value.retryable
            resumer = threading.Timer(0.6, broker.resume)
            resumer.start()
            assert store.version("o") in (1, 2)  # retried across the pause
            resumer.join()
        finally:
            broker.resume()
        # the paused append may still commit after the pause: its outcome settles, and reads agree on it
        deadline = time.monotonic() + 10
        while store.read("o").version != store.version("o") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.read("o").version in (1, 2)
