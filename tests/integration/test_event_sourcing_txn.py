"""TXN_APPEND_STREAM with real broker processes (facts A6 "Transactions", spec "Event Sourcing Commands"):
staged events are invisible to READ_STREAM, STREAM_VERSION and read_committed until the transaction
commits, vanish on abort (the version is free again), count for the same transaction's next version, hold
the aggregate against other writers while undecided; kill -9 with an open transaction, then the timeout
abort, leaves the versions right."""

from __future__ import annotations

import asyncio

import pytest

from cursus.client import AsyncTransactionalProducer, EventStore, TransactionalProducer, VersionConflictError
from cursus.client.connection import Connection
from cursus.partitioning import partition_for_key
from cursus.wire import Command, CommandPayload, Status, decode_batch, encode_crq2
from tests.brokerproc import BrokerProcess
from tests.cluster.clustersupport import wait_for
from tests.integration.conftest import connect
from tests.integration.helpers import create_topic, error_of, ok_fields
from tests.integration.txnsupport import Session, read_all

pytestmark = pytest.mark.timeout(120)


def version_of(conn: Connection, topic: str, key: str) -> int:
    return int(ok_fields(conn.command(f"STREAM_VERSION topic={topic} key={key}"))["version"])


def events_of(conn: Connection, topic: str, key: str) -> list[tuple[int, bytes]]:
    """READ_STREAM: [(version, payload)]."""
    request_id = conn.send(Command.READ_STREAM, encode_crq2(CommandPayload((), {"topic": topic, "key": key})))
    envelope = conn.receive(request_id, Command.READ_STREAM)
    assert envelope.status == Status.OK, error_of(envelope).render()
    batch = conn.receive(request_id, Command.READ_STREAM)
    if not batch.payload:
        return []
    return [(r.aggregate_version or 0, bytes(r.payload)) for r in decode_batch(batch.payload).records]


def txn_append(s: Session, topic: str, key: str, version: int, message: str, *, event_type: str = "E"):
    s.seq += 1
    return s.conn.command(f"TXN_APPEND_STREAM {s.ids} topic={topic} key={key} expected_version={version} "
                          f"seqNum={s.seq} schema_version=1 event_type={event_type} message={message}")


def append(conn: Connection, topic: str, key: str, version: int, message: str):
    return conn.command(f"APPEND_STREAM topic={topic} key={key} version={version} event_type=E message={message}")


def test_commit_abort_visibility_and_versions(shared_broker: BrokerProcess, topic_name: str) -> None:
    topic = topic_name
    with connect(shared_broker) as conn, connect(shared_broker) as other:
        create_topic(conn, topic, partitions=2, event_sourcing="true")
        assert ok_fields(append(conn, topic, "order-1", 1, "created"))["version"] == "1"
        s = Session(conn, f"{topic}-tx")
        s.init()
        s.begin()
        ok = ok_fields(txn_append(s, topic, "order-1", 2, "paid"))
        assert ok["partition"] == str(partition_for_key("order-1", 2)) and ok["version"] == "2"
        # the transaction's own staged append counts for its next version
        assert error_of(txn_append(s, topic, "order-1", 2, "again")).code == "version_conflict"
        ok_fields(txn_append(s, topic, "order-1", 3, "shipped"))
        ok_fields(txn_append(s, topic, "order-2", 1, "other-aggregate"))
        # invisible before commit: READ_STREAM, STREAM_VERSION, read_committed
        assert version_of(other, topic, "order-1") == 1
        assert events_of(other, topic, "order-1") == [(1, b"created")]
        assert version_of(other, topic, "order-2") == 0
        part = partition_for_key("order-1", 2)
        assert [bytes(r.payload) for r in read_all(other, topic, part)] == [b"created"]
        # another writer cannot build on (or take) the staged versions while the transaction is open
        for v in (2, 4):
            err = error_of(append(other, topic, "order-1", v, "x"))
            assert err.code == "version_conflict", err.render()
        s2 = Session(other, f"{topic}-tx2")
        s2.init()
        s2.begin()
        err = error_of(txn_append(s2, topic, "order-1", 4, "competing"))
        assert err.code == "version_conflict" and err.fields.get("reason") == "transaction_in_progress"
        s2.end("abort")
        # commit: visible with the staged versions
        assert s.end("commit")["state"] == "committed"
        assert version_of(other, topic, "order-1") == 3
        assert events_of(other, topic, "order-1") == [(1, b"created"), (2, b"paid"), (3, b"shipped")]
        assert events_of(other, topic, "order-2") == [(1, b"other-aggregate")]
        assert [bytes(r.payload) for r in read_all(other, topic, part)] == [b"created", b"paid", b"shipped"]
        assert ok_fields(append(other, topic, "order-1", 4, "delivered"))["version"] == "4"
        # abort: the staged events vanish and their versions are free again
        s.init()
        s.begin()
        ok_fields(txn_append(s, topic, "order-1", 5, "refund-requested"))
        assert s.end("abort")["state"] == "aborted"
        assert version_of(other, topic, "order-1") == 4
        assert ok_fields(append(other, topic, "order-1", 5, "returned"))["version"] == "5"
        assert events_of(other, topic, "order-1")[-1] == (5, b"returned")
        # an aggregate-replay topic refuses it (its events need an event_id)
        replay = f"{topic}-replay"
        create_topic(conn, replay, partitions=1, event_sourcing="true", aggregate_replay="true", idempotent="true")
        s.init()
        s.begin()
        assert error_of(txn_append(s, replay, "m", 1, "x")).code == "transactional_append_unsupported"
        s.end("abort")
        # a non-event-sourcing topic refuses it
        plain = f"{topic}-plain"
        create_topic(conn, plain, partitions=1)
        s.init()
        s.begin()
        assert error_of(txn_append(s, plain, "k", 1, "x")).code == "event_sourcing_not_enabled"
        s.end("abort")


def test_plain_appends_after_an_open_transaction_still_count(shared_broker: BrokerProcess, topic_name: str) -> None:
    """An open transaction holds the index back at its first record (the LSO); appends of other
    aggregates after it are still checked against (pending) and become readable once it is decided."""
    topic = topic_name
    with connect(shared_broker) as conn, connect(shared_broker) as other:
        create_topic(conn, topic, partitions=1, event_sourcing="true")
        s = Session(conn, f"{topic}-tx")
        s.init()
        s.begin()
        ok_fields(txn_append(s, topic, "a", 1, "a1"))
        ok_fields(append(other, topic, "b", 1, "b1"))
        assert error_of(append(other, topic, "b", 1, "b1-again")).code == "version_conflict"
        ok_fields(append(other, topic, "b", 2, "b2"))
        s.end("abort")
        assert events_of(other, topic, "b") == [(1, b"b1"), (2, b"b2")]
        assert version_of(other, topic, "a") == 0
        assert ok_fields(append(other, topic, "a", 1, "a1-plain"))["version"] == "1"


def test_sdk_transactional_append_sync_and_async(shared_broker: BrokerProcess, topic_name: str) -> None:
    topic = topic_name
    bootstrap = "{}:{}".format(*shared_broker.address)
    with EventStore(bootstrap, topic) as store:
        store.create_topic(partitions=1)
        with TransactionalProducer(bootstrap, f"{topic}-sdk") as txn:
            txn.begin()
            txn.append_stream(topic, "acc-1", '{"opened":true}', expected_version=1, event_type="Opened")
            txn.append_stream(topic, "acc-1", '{"deposit":5}', expected_version=2, event_type="Deposited",
                              metadata={"by": "test"})
            with pytest.raises(VersionConflictError):
                txn.append_stream(topic, "acc-1", "{}", expected_version=2)
            assert store.version("acc-1") == 0
            txn.commit()
        assert store.version("acc-1") == 2
        agg = store.read("acc-1")
        assert [(e.version, e.event_type) for e in agg.events] == [(1, "Opened"), (2, "Deposited")]

    async def run() -> None:
        async with AsyncTransactionalProducer(bootstrap, f"{topic}-sdk-async") as txn:
            await txn.begin()
            await txn.append_stream(topic, "acc-1", '{"deposit":7}', expected_version=3)
            await txn.abort()
            await txn.begin()
            await txn.append_stream(topic, "acc-1", '{"deposit":9}', expected_version=3)
            await txn.commit()

    asyncio.run(run())
    with EventStore(bootstrap, topic) as store:
        assert [e.payload for e in store.read("acc-1").events][-1] in (b'{"deposit":9}', '{"deposit":9}')
        assert store.version("acc-1") == 3


def test_kill_with_an_open_transaction_then_timeout_abort(broker_factory) -> None:
    broker = broker_factory(settings={"transaction_timeout_ms": 1500}).start()
    topic = "es-txn-crash"
    with connect(broker) as conn:
        create_topic(conn, topic, partitions=1, event_sourcing="true")
        ok_fields(append(conn, topic, "k", 1, "v1"))
        committed = Session(conn, "crash-committed")
        committed.init()
        committed.begin()
        ok_fields(txn_append(committed, topic, "k", 2, "v2"))
        committed.end("commit")
        s = Session(conn, "crash-open")
        s.init()
        s.begin()
        ok_fields(txn_append(s, topic, "k", 3, "staged-v3"))
        ok_fields(append(conn, topic, "j", 1, "j1"))  # after the open transaction's record
    broker.restart()
    with connect(broker) as conn:
        assert version_of(conn, topic, "k") == 2
        # the open transaction still holds version 3 after the restart
        err = error_of(append(conn, topic, "k", 3, "too-early"))
        assert err.code == "version_conflict", err.render()
        assert error_of(append(conn, topic, "j", 1, "j1-again")).code == "version_conflict"
        # the timeout aborts it: version 3 is free again
        wait_for(lambda: append(conn, topic, "k", 3, "v3").status == Status.OK, timeout=20,
                 what="the timed-out transaction's version to be free")
        assert events_of(conn, topic, "k") == [(1, b"v1"), (2, b"v2"), (3, b"v3")]
        assert events_of(conn, topic, "j") == [(1, b"j1")]
    broker.restart()
    with connect(broker) as conn:
        assert version_of(conn, topic, "k") == 3
        assert events_of(conn, topic, "k") == [(1, b"v1"), (2, b"v2"), (3, b"v3")]


def test_an_open_transaction_continues_and_commits_after_kill(broker_factory) -> None:
    """After kill -9 the leader finds the open transaction's staged event in the log above the LSO: it
    still counts for that transaction's next version, blocks other writers, and commits with it."""
    broker = broker_factory().start()
    topic = "es-txn-continue"
    with connect(broker) as conn:
        create_topic(conn, topic, partitions=1, event_sourcing="true")
        ok_fields(append(conn, topic, "k", 1, "v1"))
        s = Session(conn, "continue-open")
        s.init()
        s.begin()
        ok_fields(txn_append(s, topic, "k", 2, "staged-v2"))
        seq, producer_id, epoch = s.seq, s.producer_id, s.epoch
    broker.restart()
    with connect(broker) as conn:
        s = Session(conn, "continue-open", producer_id=producer_id, epoch=epoch, seq=seq)
        assert error_of(append(conn, topic, "k", 2, "other")).code == "version_conflict"
        assert error_of(txn_append(s, topic, "k", 2, "dup-version")).code == "version_conflict"
        ok_fields(txn_append(s, topic, "k", 3, "staged-v3"))
        assert version_of(conn, topic, "k") == 1
        assert s.end("commit")["state"] == "committed"
        assert events_of(conn, topic, "k") == [(1, b"v1"), (2, b"staged-v2"), (3, b"staged-v3")]
        assert ok_fields(append(conn, topic, "k", 4, "v4"))["version"] == "4"
