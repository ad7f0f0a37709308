"""Event-store durability with real broker processes: kill -9 and restart keep every acknowledged version
and the same replay; torn index checkpoints and snapshot tails; index entries above the committed log are
never visible (spec "Event Sourcing Commands": indexes rebuilt from the committed log on restart)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

from cursus.client.connection import Connection
from cursus.eventstore import Snapshot, StreamEntry, StreamIndex, encode_snapshot_record
from cursus.partitioning import partition_for_key
from cursus.wire import Command, CommandPayload, Status, decode_batch, encode_crq2
from tests.brokerproc import BrokerProcess
from tests.cluster.clustersupport import wait_for
from tests.integration.conftest import connect
from tests.integration.helpers import create_topic, error_of, ok_fields

TOPIC = "orders"
PARTITIONS = 4
AGGREGATES = 1000
EVENTS_PER_AGGREGATE = 10
THREADS = 8


def replay(conn: Connection, key: str) -> tuple[int, list[tuple[int, int, bytes]]]:
    """(STREAM_VERSION, [(version, offset, payload)] of READ_STREAM) of one aggregate."""
    version = int(ok_fields(conn.command(f"STREAM_VERSION topic={TOPIC} key={key}"))["version"])
    request_id = conn.send(Command.READ_STREAM, encode_crq2(CommandPayload((), {"topic": TOPIC, "key": key})))
    envelope = conn.receive(request_id, Command.READ_STREAM)
    assert envelope.status == Status.OK, error_of(envelope).render()
    batch = conn.receive(request_id, Command.READ_STREAM)
    records = decode_batch(batch.payload).records
    return version, [(r.aggregate_version or 0, r.offset, bytes(r.payload)) for r in records]


def all_replays(broker: BrokerProcess) -> dict[str, tuple[int, list[tuple[int, int, bytes]]]]:
    conn = connect(broker)
    try:
        return {f"agg-{i}": replay(conn, f"agg-{i}") for i in range(AGGREGATES)}
    finally:
        conn.close()


def fill(broker: BrokerProcess) -> None:
    """10,000 events over 1,000 aggregates from 8 connections (each owns its aggregates)."""
    errors: list[str] = []

    def run(worker: int) -> None:
        conn = connect(broker)
        try:
            mine = [f"agg-{i}" for i in range(worker, AGGREGATES, THREADS)]
            for version in range(1, EVENTS_PER_AGGREGATE + 1):
                for key in mine:
                    frame = conn.command(f"APPEND_STREAM topic={TOPIC} key={key} version={version} "
                                         f"event_type=E message={key}:{version}")
                    if frame.status != Status.OK:
                        errors.append(error_of(frame).render())
                        return
        finally:
            conn.close()

    threads = [threading.Thread(target=run, args=(w,)) for w in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors, errors[:3]


def partition_dir(broker: BrokerProcess, key: str) -> Path:
    return broker.log_dir / "topics" / TOPIC / str(partition_for_key(key, PARTITIONS))


def test_kill9_restart_keeps_versions_and_replay_with_torn_checkpoints(
        broker_factory: Callable[..., BrokerProcess]) -> None:
    broker = broker_factory(settings={"eventstore_checkpoint_interval_events": 500}).start()
    conn = connect(broker)
    create_topic(conn, TOPIC, PARTITIONS, event_sourcing="true")
    conn.close()
    fill(broker)
    before = all_replays(broker)
    assert all(v == EVENTS_PER_AGGREGATE and [e[0] for e in evs] == list(range(1, 11)) for v, evs in before.values())
    assert sum(len(evs) for _, evs in before.values()) == AGGREGATES * EVENTS_PER_AGGREGATE
    checkpoints = sorted((broker.log_dir / "topics" / TOPIC).glob("*/eventstore.index"))
    assert checkpoints, "the index wrote checkpoints while it caught up"

    broker.restart(kill=True)
    assert all_replays(broker) == before

    # a torn checkpoint on every partition: discarded, the index is rebuilt from the log
    broker.kill()
    for path in sorted((broker.log_dir / "topics" / TOPIC).glob("*/eventstore.index")):
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    broker.start()
    assert all_replays(broker) == before
    # appends after reopening go to the end and never overwrite
    conn = connect(broker)
    last = before["agg-7"][1][-1][1]
    added = ok_fields(conn.command(f"APPEND_STREAM topic={TOPIC} key=agg-7 version=11 message=after"))
    assert int(added["offset"]) > last
    assert error_of(conn.command(f"APPEND_STREAM topic={TOPIC} key=agg-7 version=11 message=again")).code == \
        "version_conflict"
    conn.close()


def test_index_entries_above_the_committed_log_are_never_visible(
        broker_factory: Callable[..., BrokerProcess]) -> None:
    """A checkpoint that claims events the log does not hold (written ahead of a lost tail) is cut back to
    the committed HWM at the first command: those versions never appear."""
    broker = broker_factory().start()
    conn = connect(broker)
    create_topic(conn, TOPIC, PARTITIONS, event_sourcing="true")
    for v in (1, 2):
        ok_fields(conn.command(f"APPEND_STREAM topic={TOPIC} key=real version={v} message=r{v}"))
    conn.close()
    broker.terminate()
    ghost_dir = partition_dir(broker, "real")
    ghost = next(f"ghost-{i}" for i in range(100)
                 if partition_for_key(f"ghost-{i}", PARTITIONS) == partition_for_key("real", PARTITIONS))
    index = StreamIndex()
    index.apply("real", StreamEntry(1, 0))
    index.apply("real", StreamEntry(2, 1))
    index.apply("real", StreamEntry(3, 1_000))  # not in the log
    index.apply(ghost, StreamEntry(1, 1_001))
    (ghost_dir / "eventstore.index").write_bytes(index.encode())
    broker.start()
    conn = connect(broker)
    version, events = replay(conn, "real")
    assert version == 2 and [e[2] for e in events] == [b"r1", b"r2"]
    assert replay(conn, ghost) == (0, [])
    assert ok_fields(conn.command(f"APPEND_STREAM topic={TOPIC} key=real version=3 message=r3"))["version"] == "3"
    conn.close()


def test_torn_snapshot_tail_keeps_earlier_snapshots(broker_factory: Callable[..., BrokerProcess]) -> None:
    broker = broker_factory().start()
    conn = connect(broker)
    create_topic(conn, TOPIC, PARTITIONS, event_sourcing="true")
    for v in range(1, 4):
        ok_fields(conn.command(f"APPEND_STREAM topic={TOPIC} key=s version={v} message=e{v}"))
    ok_fields(conn.command(f"SAVE_SNAPSHOT topic={TOPIC} key=s version=2 message=state-2"))
    conn.close()
    broker.kill()  # acknowledged snapshots are fsynced: kill -9 keeps them
    path = partition_dir(broker, "s") / "eventstore.snapshots"
    torn = encode_snapshot_record(Snapshot("s", 3, "state-3"))
    with open(path, "ab") as fh:
        fh.write(torn[: len(torn) - 3])  # a crash mid-write of a later snapshot
    broker.start()
    conn = connect(broker)
    text = conn.command(f"READ_SNAPSHOT topic={TOPIC} key=s").payload.decode()
    assert json.loads(text.removeprefix("OK snapshot=")) == {"version": 2, "payload": "state-2"}
    request_id = conn.send(Command.READ_STREAM, encode_crq2(CommandPayload((), {"topic": TOPIC, "key": "s"})))
    envelope = json.loads(conn.receive(request_id, Command.READ_STREAM).payload)
    events = decode_batch(conn.receive(request_id, Command.READ_STREAM).payload).records
    assert envelope["snapshot"] == {"version": 2, "payload": "state-2"} and [r.aggregate_version for r in events] == [3]
    # the torn tail was cut off: a new snapshot lands after the good records and survives a restart
    ok_fields(conn.command(f"SAVE_SNAPSHOT topic={TOPIC} key=s version=3 message=state-3b"))
    conn.close()
    broker.restart(kill=True)
    conn = connect(broker)
    text = conn.command(f"READ_SNAPSHOT topic={TOPIC} key=s").payload.decode()
    assert json.loads(text.removeprefix("OK snapshot=")) == {"version": 3, "payload": "state-3b"}
    conn.close()


def test_replay_proof_reports_a_retention_gap(broker_factory: Callable[..., BrokerProcess]) -> None:
    broker = broker_factory(settings={"log_segment_bytes": 4096, "log_retention_check_interval_ms": 100}).start()
    conn = connect(broker)
    create_topic(conn, "replay", 1, event_sourcing="true", aggregate_replay="true", idempotent="true",
                 retention_bytes="1")
    for v in range(1, 41):
        ok_fields(conn.command(f"APPEND_STREAM topic=replay key=m version={v} event_id=e{v} producerId=p "
                               f"seqNum={v} message={'x' * 400}"))

    def gap() -> bool:
        frame = conn.command("AGGREGATE_REPLAY_PROOF topic=replay match_id=m")
        return frame.status == Status.ERROR and error_of(frame).code == "aggregate_proof_retention_gap"

    wait_for(gap, 15, "retention removed the first events")
    proof = json.loads(error_of(conn.command("AGGREGATE_REPLAY_PROOF topic=replay match_id=m")).fields["proof"])
    assert proof["first_sequence"] > 1 and proof["last_sequence"] == 40 and proof["log_start_offset"] > 0
    # READ_STREAM never serves the gapped stream silently: a typed error, then the retained part on request
    request_id = conn.send(Command.READ_STREAM, encode_crq2(CommandPayload((), {"topic": "replay", "key": "m"})))
    refused = error_of(conn.receive(request_id, Command.READ_STREAM))
    assert refused.code == "stream_retention_gap" and refused.fields["missing_version"] == "1"
    first = proof["first_sequence"]
    request_id = conn.send(Command.READ_STREAM, encode_crq2(CommandPayload((), {
        "topic": "replay", "key": "m", "from_version": str(first)})))
    conn.receive(request_id, Command.READ_STREAM)
    records = decode_batch(conn.receive(request_id, Command.READ_STREAM).payload).records
    assert [r.aggregate_version for r in records] == list(range(first, 41))
    assert ok_fields(conn.command("STREAM_VERSION topic=replay key=m"))["version"] == "40"
    conn.close()


def replay_topic(conn: Connection, topic: str, key: str) -> tuple[int, list[tuple[int, int, bytes]]]:
    version = int(ok_fields(conn.command(f"STREAM_VERSION topic={topic} key={key}"))["version"])
    request_id = conn.send(Command.READ_STREAM, encode_crq2(CommandPayload((), {"topic": topic, "key": key})))
    conn.receive(request_id, Command.READ_STREAM)
    records = decode_batch(conn.receive(request_id, Command.READ_STREAM).payload).records
    return version, [(r.aggregate_version or 0, r.offset, bytes(r.payload)) for r in records]
