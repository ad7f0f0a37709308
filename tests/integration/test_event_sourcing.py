"""Event sourcing against real broker processes: every command with good and bad arguments, concurrency,
snapshots, BROWSE_MESSAGES, aggregate replay proofs (spec "Event Sourcing Commands", "Aggregate replay
proof"; facts A6, B3.6)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import Iterator

import pytest

from cursus.client.connection import Connection
from cursus.client.errors import ValidationError, VersionConflictError
from cursus.client.events import AsyncEventStore, EventStore
from cursus.partitioning import partition_for_key
from cursus.wire import Command, CommandPayload, Frame, Status, decode_batch, encode_crq2
from tests.brokerproc import BrokerProcess
from tests.integration.conftest import connect
from tests.integration.helpers import create_topic, error_of, ok_fields


def two_frames(conn: Connection, command: Command, fields: dict[str, str]) -> tuple[Frame, Frame | None]:
    """Send one READ_STREAM / BROWSE_MESSAGES; the envelope and (unless it is an error) the batch frame."""
    request_id = conn.send(command, encode_crq2(CommandPayload((), fields)))
    first = conn.receive(request_id, command)
    if first.status == Status.ERROR:
        return first, None
    return first, conn.receive(request_id, command)


@pytest.fixture
def conn(shared_broker: BrokerProcess) -> Iterator[Connection]:
    c = connect(shared_broker)
    yield c
    c.close()


@pytest.fixture
def es_topic(conn: Connection, topic_name: str) -> str:
    create_topic(conn, topic_name, 3, event_sourcing="true")
    return topic_name


def test_append_read_version_and_snapshot(conn: Connection, es_topic: str) -> None:
    t = es_topic
    first = ok_fields(conn.command(f"APPEND_STREAM topic={t} key=order-1 version=1 event_type=OrderCreated "
                                   f"schema_version=2 metadata={{\"by\":\"me\"}} message=created order"))
    assert first["version"] == "1" and int(first["partition"]) == partition_for_key("order-1", 3)
    # camelCase aliases (facts decision 8)
    second = ok_fields(conn.command(f"APPEND_STREAM topic={t} key=order-1 expectedVersion=2 eventType=ItemAdded "
                                    f"schemaVersion=1 message=item"))
    assert second["version"] == "2" and int(second["offset"]) > int(first["offset"])
    assert ok_fields(conn.command(f"STREAM_VERSION topic={t} key=order-1")) == {"version": "2"}
    assert ok_fields(conn.command(f"STREAM_VERSION topic={t} key=nobody")) == {"version": "0"}
    envelope, batch = two_frames(conn, Command.READ_STREAM, {"topic": t, "key": "order-1"})
    assert envelope.status == Status.OK and batch is not None and batch.request_id == envelope.request_id
    doc = json.loads(envelope.payload)
    assert doc == {"status": "OK", "topic": t, "key": "order-1", "partition": int(first["partition"]), "count": 2}
    records = decode_batch(batch.payload).records
    assert [(r.aggregate_version, r.event_type, r.schema_version, r.payload) for r in records] == [
        (1, "OrderCreated", 2, b"created order"), (2, "ItemAdded", 1, b"item")]
    assert records[0].metadata == '{"by":"me"}' and records[0].key == "order-1"
    # snapshots
    assert conn.command(f"READ_SNAPSHOT topic={t} key=order-1").payload == b"OK snapshot=null"
    assert ok_fields(conn.command(f"SAVE_SNAPSHOT topic={t} key=order-1 version=2 message={{\"items\": 1}}"))[
        "version"] == "2"
    text = conn.command(f"READ_SNAPSHOT topic={t} key=order-1").payload.decode()
    assert json.loads(text.removeprefix("OK snapshot=")) == {"version": 2, "payload": '{"items": 1}'}


def test_bad_arguments_get_typed_errors_and_the_connection_stays(conn: Connection, es_topic: str,
                                                                 topic_name: str) -> None:
    t = es_topic
    create_topic(conn, f"{topic_name}-plain", 1)
    cases = {
        f"APPEND_STREAM topic={t} version=1 message=x": "missing_key",
        f"APPEND_STREAM topic={t} key=k message=x": "missing_version",
        f"APPEND_STREAM topic={t} key=k version=zero message=x": "invalid_version",
        f"APPEND_STREAM topic={t} key=k version=0 message=x": "invalid_version",
        f"APPEND_STREAM topic={t} key=k version=+1 message=x": "invalid_version",
        f"APPEND_STREAM topic={t} key=k version={1 << 63} message=x": "invalid_version",
        f"APPEND_STREAM topic={t} key=k version=1 schema_version=-1 message=x": "invalid_schema_version",
        f"APPEND_STREAM topic={t} key=k version=1": "missing_message",
        f"APPEND_STREAM topic={t} key=k version=1 producerId=p seqNum=1 epoch=-5 message=x": "invalid_epoch",
        f"APPEND_STREAM topic={t} key=k version=2 message=x": "version_conflict",
        f"APPEND_STREAM topic={topic_name}-plain key=k version=1 message=x": "event_sourcing_not_enabled",
        f"APPEND_STREAM topic={topic_name}-absent key=k version=1 message=x": "topic_not_found",
        "APPEND_STREAM topic=bad/name key=k version=1 message=x": "invalid_topic_name",
        f"STREAM_VERSION topic={t}": "missing_key",
        f"STREAM_VERSION topic={topic_name}-plain key=k": "event_sourcing_not_enabled",
        f"SAVE_SNAPSHOT topic={t} key=k version=1 message=s": "snapshot_version_exceeds_stream",
        f"SAVE_SNAPSHOT topic={t} key=k version=x message=s": "invalid_version",
        f"READ_SNAPSHOT topic={t}": "missing_key",
        f"READ_STREAM topic={t} key=k from_version=0": "invalid_from_version",
        f"READ_STREAM topic={t} key=k from_version=abc": "invalid_from_version",
        f"AGGREGATE_REPLAY_PROOF topic={t} match_id=k": "invalid_topic_policy",
        f"BROWSE_MESSAGES topic={t} partition=7": "partition_not_found",
    }
    for text, code in cases.items():
        err = error_of(conn.command(text))
        assert err.code == code, (text, err.render())
    ok_fields(conn.command(f"APPEND_STREAM topic={t} key=big-snap version=1 message=x"))
    too_big = conn.call(Command.SAVE_SNAPSHOT, {"topic": t, "key": "big-snap", "version": "1",
                                                "message": "s" * (2 * 1024 * 1024)})
    assert error_of(too_big).code == "message_too_large"
    long_key = conn.call(Command.APPEND_STREAM, {"topic": t, "key": "k" * (2 * 1024 * 1024), "version": "1",
                                                 "message": "x"})
    assert error_of(long_key).code == "message_too_large"  # the key counts toward max_message_bytes
    version_conflict = error_of(conn.command(f"APPEND_STREAM topic={t} key=k version=2 message=x"))
    assert version_conflict.fields["current"] == "0" and version_conflict.fields["expected"] == "2"
    snap = error_of(conn.command(f"SAVE_SNAPSHOT topic={t} key=k version=3 message=s"))
    assert snap.fields == {"version": "3", "current": "0"}
    # still usable, and nothing was written by the refused requests
    assert ok_fields(conn.command(f"STREAM_VERSION topic={t} key=k")) == {"version": "0"}
    assert ok_fields(conn.command(f"APPEND_STREAM topic={t} key=k version=1 message=x"))["version"] == "1"


def test_read_stream_of_an_unknown_key_is_an_ok_envelope_and_an_empty_batch(conn: Connection, es_topic: str) -> None:
    envelope, batch = two_frames(conn, Command.READ_STREAM, {"topic": es_topic, "key": "ghost"})
    assert json.loads(envelope.payload)["count"] == 0 and "snapshot" not in json.loads(envelope.payload)
    assert batch is not None and decode_batch(batch.payload).records == []


def test_concurrent_appends_with_one_expected_version_exactly_one_wins(shared_broker: BrokerProcess,
                                                                        es_topic: str) -> None:
    rounds = 40
    conns = [connect(shared_broker), connect(shared_broker)]
    barrier = threading.Barrier(2)
    outcomes: list[list[str]] = [[], []]

    def run(i: int) -> None:
        for version in range(1, rounds + 1):
            barrier.wait()
            frame = conns[i].command(f"APPEND_STREAM topic={es_topic} key=hot version={version} message=w{i}")
            outcomes[i].append("ok" if frame.status == Status.OK else error_of(frame).code)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    for c in conns:
        c.close()
    for version in range(rounds):
        pair = sorted((outcomes[0][version], outcomes[1][version]))
        assert pair == ["ok", "version_conflict"], (version, pair)
    with EventStore(f"127.0.0.1:{shared_broker.port}", es_topic) as store:
        agg = store.read("hot")
    assert [e.version for e in agg.events] == list(range(1, rounds + 1))


def test_snapshot_plus_tail_replay_and_sdk(shared_broker: BrokerProcess, topic_name: str) -> None:
    address = f"127.0.0.1:{shared_broker.port}"
    with EventStore(address, topic_name, snapshot_every=5) as store:
        store.create_topic(partitions=2)
        store.create_topic(partitions=2)  # repeated CREATE ... event_sourcing=true answers OK
        state = []
        for v in range(1, 9):
            state.append(v)
            store.append("agg", f"e{v}".encode(), expected_version=v, event_type="Added",
                         snapshot=lambda: json.dumps(state))
        with pytest.raises(VersionConflictError) as info:
            store.append("agg", b"late", expected_version=3)
        assert (info.value.current, info.value.expected) == (8, 3)
        agg = store.read("agg")
        assert agg.snapshot is not None and agg.snapshot.version == 5 and json.loads(agg.snapshot.payload) == [1, 2, 3,
                                                                                                               4, 5]
        assert [e.version for e in agg.events] == [6, 7, 8] and agg.version == 8
        assert [e.payload for e in agg.events] == [b"e6", b"e7", b"e8"]
        later = store.read("agg", from_version=7)  # the snapshot (5) is before from_version: not used
        assert later.snapshot is None and [e.version for e in later.events] == [7, 8]
        assert store.version("agg") == 8
        snap = store.read_snapshot("agg")
        assert snap is not None and snap.version == 5
        with pytest.raises(ValidationError):
            store.save_snapshot("agg", 0, "x")

    async def run_async() -> None:
        async with AsyncEventStore(address, topic_name) as astore:
            await astore.append("agg", b"e9", expected_version=9)
            assert await astore.version("agg") == 9
            agg = await astore.read("agg")
            assert agg.snapshot is not None and [e.version for e in agg.events] == [6, 7, 8, 9]
            await astore.save_snapshot("agg", 9, "nine")
            assert (await astore.read_snapshot("agg")) is not None
            with pytest.raises(VersionConflictError):
                await astore.append("agg", b"x", expected_version=9)

    asyncio.run(run_async())


def test_create_rules(conn: Connection, topic_name: str) -> None:
    t = topic_name
    assert error_of(conn.command(f"CREATE topic={t} event_sourcing=true cleanup_policy=compact")).code == \
        "invalid_topic_policy"
    create_topic(conn, t, 2, event_sourcing="true")
    assert ok_fields(conn.command(f"CREATE topic={t} partitions=2 event_sourcing=true"))["event_sourcing"] == "true"
    assert error_of(conn.command(f"CREATE topic={t} event_sourcing=false")).code == "invalid_event_sourcing"
    assert error_of(conn.command(f"CREATE topic={t} cleanup_policy=compact")).code == "invalid_topic_policy"
    assert ok_fields(conn.command(f"CREATE topic={t}"))["event_sourcing"] == "true"
    assert error_of(conn.command(f"CREATE topic={t}-r event_sourcing=true aggregate_replay=true")).code == \
        "invalid_topic_policy"


def test_the_partition_count_of_an_event_sourcing_topic_never_changes(conn: Connection, topic_name: str) -> None:
    t = topic_name
    create_topic(conn, t, 1, event_sourcing="true")
    ok_fields(conn.command(f"APPEND_STREAM topic={t} key=order-a version=1 message=created"))
    refused = error_of(conn.command(f"CREATE topic={t} partitions=4"))
    assert (refused.code, refused.fields["field"]) == ("invalid_topic_policy", "partitions")
    assert error_of(conn.command(f"CREATE topic={t} partitions=4 event_sourcing=true")).code == \
        "invalid_topic_policy"
    assert ok_fields(conn.command(f"STREAM_VERSION topic={t} key=order-a"))["version"] == "1"
    assert ok_fields(conn.command(f"CREATE topic={t} partitions=1"))["partitions"] == "1"


def test_browse_messages(conn: Connection, topic_name: str) -> None:
    create_topic(conn, topic_name, 1)
    for i in range(5):
        assert conn.command(f"PUBLISH topic={topic_name} producerId=p message=m{i}").status == Status.OK
    envelope, batch = two_frames(conn, Command.BROWSE_MESSAGES, {"topic": topic_name, "offset": "1", "limit": "3"})
    assert json.loads(envelope.payload) == {"status": "OK", "next_offset": 4}
    assert batch is not None and [r.payload for r in decode_batch(batch.payload).records] == [b"m1", b"m2", b"m3"]
    envelope, batch = two_frames(conn, Command.BROWSE_MESSAGES, {"topic": topic_name, "offset": "5"})
    assert json.loads(envelope.payload)["next_offset"] == 5 and batch is not None
    assert decode_batch(batch.payload).records == []


# ---------------------------------------------------------------------------------------- aggregate replay


def _replay_append(conn: Connection, t: str, match: str, version: int, event_id: str, payload: str,
                   seq: int) -> Frame:
    return conn.command(f"APPEND_STREAM topic={t} key={match} version={version} event_id={event_id} "
                        f"producerId=p1 seqNum={seq} event_type=Goal message={payload}")


def test_aggregate_replay_proof(conn: Connection, topic_name: str) -> None:
    t = topic_name
    create_topic(conn, t, 2, event_sourcing="true", aggregate_replay="true", idempotent="true")
    assert error_of(conn.command(f"PUBLISH topic={t} producerId=p message=x")).code == "invalid_topic_policy"
    assert error_of(conn.command(f"CREATE topic={t} partitions=3")).code == "invalid_topic_policy"
    assert error_of(conn.command(f"APPEND_STREAM topic={t} key=m version=1 message=x")).code == "missing_event_id"
    offsets = []
    for v in range(1, 4):
        offsets.append(int(ok_fields(_replay_append(conn, t, "match-1", v, f"ev{v}", f"p{v}", v))["offset"]))
    # an exact retry answers OK with the original offset and appends nothing
    retry = ok_fields(_replay_append(conn, t, "match-1", 2, "ev2", "p2", 2))
    assert int(retry["offset"]) == offsets[1]
    # the same version with another identity is a conflict
    assert error_of(_replay_append(conn, t, "match-1", 2, "other", "p2", 9)).code == "version_conflict"
    assert error_of(_replay_append(conn, t, "match-1", 3, "ev3", "changed", 9)).code == "version_conflict"
    proof_text = conn.command(f"AGGREGATE_REPLAY_PROOF topic={t} match_id=match-1 expected_last_sequence=3")
    assert proof_text.status == Status.OK, error_of(proof_text).render()
    proof = json.loads(proof_text.payload.decode().removeprefix("OK proof="))
    assert (proof["first_sequence"], proof["last_sequence"], proof["event_count"]) == (1, 3, 3)
    assert (proof["first_offset"], proof["last_offset"]) == (offsets[0], offsets[2])
    assert (proof["first_event_id"], proof["last_event_id"]) == ("ev1", "ev3")
    assert proof["proof_hwm"] > offsets[2]
    gap = error_of(conn.command(f"AGGREGATE_REPLAY_PROOF topic={t} match_id=match-1 expected_last_sequence=4"))
    assert gap.code == "aggregate_proof_sequence_gap" and json.loads(gap.fields["proof"])["last_sequence"] == 3
    none = error_of(conn.command(f"AGGREGATE_REPLAY_PROOF topic={t} match_id=nobody"))
    assert none.code == "aggregate_proof_proof_unavailable"
    rng = conn.command(f"AGGREGATE_EVENT_RANGE_READ topic={t} match_id=match-1 from_sequence=2 to_sequence=3 "
                       f"max_records=10")
    doc = json.loads(rng.payload)
    assert doc["status"] == "OK" and doc["proof"]["last_sequence"] == 3
    assert [(e["sequence"], e["event_id"], e["payload_base64"]) for e in doc["events"]] == [
        (2, "ev2", "cDI="), (3, "ev3", "cDM=")]
    assert doc["events"][0]["payload_digest"] == hashlib.sha256(b"p2").hexdigest()
    assert error_of(conn.command(f"AGGREGATE_EVENT_RANGE_READ topic={t} match_id=match-1 from_sequence=3 "
                                 f"to_sequence=2")).code == "invalid_to_sequence"


def test_the_documented_order_example_runs(shared_broker: BrokerProcess, topic_name: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "event-sourcing.md").read_text()
    match = re.search(r"```python\n(.*?)```", doc, re.S)
    assert match is not None
    code = match.group(1).replace("127.0.0.1:9000", f"127.0.0.1:{shared_broker.port}").replace(
        '"orders"', repr(topic_name))
    exec(compile(code, "docs/event-sourcing.md", "exec"), {})
    assert "'items': ['book']" in capsys.readouterr().out


def test_read_stream_frames_then_a_pipelined_request(conn: Connection, es_topic: str) -> None:
    """A client may send its next request before reading both READ_STREAM frames (facts B1.4)."""
    for v in range(1, 301):
        ok_fields(conn.command(f"APPEND_STREAM topic={es_topic} key=big version={v} message={'z' * 2000}"))
    read_id = conn.send(Command.READ_STREAM, encode_crq2(CommandPayload((), {"topic": es_topic, "key": "big"})))
    version_id = conn.send(Command.STREAM_VERSION, encode_crq2(CommandPayload((), {"topic": es_topic, "key": "big"})))
    envelope = conn.receive(read_id, Command.READ_STREAM)
    batch = conn.receive(read_id, Command.READ_STREAM)
    assert json.loads(envelope.payload)["count"] == 300 and len(decode_batch(batch.payload).records) == 300
    assert ok_fields(conn.receive(version_id, Command.STREAM_VERSION)) == {"version": "300"}


def test_cursusctl_events_and_browse(shared_broker: BrokerProcess, es_topic: str) -> None:
    from tests.integration.test_cursusctl import ctl

    t = es_topic
    appended = ctl(shared_broker, "--json", "events", "append", t, "o1", '{"a":1}', "--version", "1", "--type",
                   "Created")
    assert appended.returncode == 0, appended.stderr
    assert json.loads(appended.stdout)["version"] == 1
    conflict = ctl(shared_broker, "events", "append", t, "o1", "x", "--version", "1")
    assert conflict.returncode == 1 and "version_conflict" in conflict.stderr
    ctl(shared_broker, "events", "append", t, "o1", "second", "--version", "2")
    assert json.loads(ctl(shared_broker, "--json", "events", "version", t, "o1").stdout)["version"] == 2
    saved = ctl(shared_broker, "--json", "events", "snapshot", t, "o1", "--save", "state", "--version", "1")
    assert json.loads(saved.stdout) == {"key": "o1", "version": 1, "payload": "state"}
    read = json.loads(ctl(shared_broker, "--json", "events", "read", t, "o1").stdout)
    assert read["snapshot"] == {"version": 1, "payload": "state"} and [e["payload"] for e in read["events"]] == [
        "second"]
    partition = read["partition"]
    browsed = json.loads(ctl(shared_broker, "--json", "browse", t, "--partition", str(partition)).stdout)
    assert [r["version"] for r in browsed["records"]] == [1, 2] and browsed["next_offset"] == 2
    plain = ctl(shared_broker, "browse", t, "--partition", str(partition))
    assert plain.returncode == 0 and "next_offset=2" in plain.stdout


def test_a_deleted_and_recreated_topic_starts_empty(conn: Connection, topic_name: str) -> None:
    create_topic(conn, topic_name, 1, event_sourcing="true")
    ok_fields(conn.command(f"APPEND_STREAM topic={topic_name} key=k version=1 message=old"))
    ok_fields(conn.command(f"SAVE_SNAPSHOT topic={topic_name} key=k version=1 message=old-state"))
    ok_fields(conn.command(f"DELETE topic={topic_name}"))
    assert error_of(conn.command(f"STREAM_VERSION topic={topic_name} key=k")).code == "topic_not_found"
    create_topic(conn, topic_name, 1, event_sourcing="true")
    assert ok_fields(conn.command(f"STREAM_VERSION topic={topic_name} key=k")) == {"version": "0"}
    assert conn.command(f"READ_SNAPSHOT topic={topic_name} key=k").payload == b"OK snapshot=null"
    assert ok_fields(conn.command(f"APPEND_STREAM topic={topic_name} key=k version=1 message=new"))["offset"] == "0"


def test_a_truncated_topic_forgets_its_streams_and_snapshots(conn: Connection, topic_name: str) -> None:
    """TRUNCATE (spec "TRUNCATE") keeps the definition but drops the event-sourcing indexes and snapshots."""
    create_topic(conn, topic_name, 1, event_sourcing="true")
    ok_fields(conn.command(f"APPEND_STREAM topic={topic_name} key=k version=1 message=old"))
    ok_fields(conn.command(f"APPEND_STREAM topic={topic_name} key=k version=2 message=old"))
    ok_fields(conn.command(f"SAVE_SNAPSHOT topic={topic_name} key=k version=2 message=old-state"))
    assert ok_fields(conn.command(f"TRUNCATE topic={topic_name} expected_revision=1"))["truncated"] == "true"
    assert ok_fields(conn.command(f"STREAM_VERSION topic={topic_name} key=k")) == {"version": "0"}
    assert conn.command(f"READ_SNAPSHOT topic={topic_name} key=k").payload == b"OK snapshot=null"
    assert error_of(conn.command(f"APPEND_STREAM topic={topic_name} key=k version=3 message=x")).code == \
        "version_conflict"
    appended = ok_fields(conn.command(f"APPEND_STREAM topic={topic_name} key=k version=1 message=new"))
    assert (appended["version"], appended["offset"]) == ("1", "0")


def test_publish_of_event_records_to_an_event_sourcing_topic_is_refused(conn: Connection, topic_name: str) -> None:
    from cursus.wire import Batch, Record, encode_batch

    t = topic_name
    create_topic(conn, t, 1, event_sourcing="true")
    ok_fields(conn.command(f"APPEND_STREAM topic={t} key=a version=1 message=real1"))

    def publish(records: list[Record]) -> Frame:
        return conn.request(Command.PUBLISH, encode_batch(Batch(topic=t, partition=0, acks="1", records=records)))

    for forged in (Record(topic=t, partition=0, payload=b"dup", key="a", aggregate_version=1),
                   Record(topic=t, partition=0, payload=b"v7", key="a", aggregate_version=7, event_type="X")):
        refused = error_of(publish([Record(topic=t, partition=0, payload=b"plain", key="a"), forged]))
        assert (refused.code, refused.fields["field"]) == ("invalid_topic_policy", "aggregate_version")
    # ordinary records (a key, no event fields) are still published, and the stream is untouched
    assert publish([Record(topic=t, partition=0, payload=b"plain", key="a")]).status == Status.OK
    assert ok_fields(conn.command(f"STREAM_VERSION topic={t} key=a"))["version"] == "1"
    ok_fields(conn.command(f"APPEND_STREAM topic={t} key=a version=2 message=real2"))
    envelope, batch = two_frames(conn, Command.READ_STREAM, {"topic": t, "key": "a"})
    assert batch is not None
    assert [(r.aggregate_version, r.payload) for r in decode_batch(batch.payload).records] == [
        (1, b"real1"), (2, b"real2")]
