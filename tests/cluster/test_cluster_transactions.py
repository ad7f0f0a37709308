"""Transactions on a 3-node Raft cluster (real processes, mutual TLS): coordinator state through TxnSync,
shard owners and epochs from the FSM, markers and records on other brokers' partitions through
``Replication.AppendTxnRecord``, offsets through the cluster's group records.

Cases: atomic visibility across two output partitions plus the offset commit (markers carry the shard
epoch; END_TXN retry idempotent); abort hides everything; kill -9 of the shard owner with the transaction
open (the new owner aborts it at its deadline; the zombie is fenced after re-init); the owner dies right
after durable prepare_commit (the new owner finishes the commit: output and offsets, one copy); a
partition leader dies between markers (its marker committed, its answer lost: the END_TXN retry completes,
the new leader's rebuilt index exposes the partition exactly once); a partition=-1 TXN_PUBLISH on a
round_robin topic retried through the new owner after the owner's kill -9 lands once; a zombie SDK
instance is fenced by the replicated epoch on a new shard owner (guarded re-init) while the instance that
replaced it keeps committing.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cursus.partitioning import partition_for_txn_record
from cursus.wire import TXN_CONTROL_MARKER_PAYLOAD, decode_batch
from tests.brokerproc import BrokerProcess
from tests.cluster.clustersupport import Cluster, wait_for
from tests.cluster.test_cluster_groups import RoutingConnection
from tests.integration.helpers import error_of, ok_fields, render
from tests.integration.txnsupport import Session, payloads, read_all

pytestmark = pytest.mark.timeout(240)

TIMEOUT_MS = 8000
CRASH = "after_prepare_commit@crashprep-"
#: Only this broker dies as a partition leader between markers (two deaths would leave Raft no quorum).
MARKER_VICTIM = "node-3"
#: Topics named so rebuild their transaction index slowly on a new leader (a pause after each marker).
SLOW_INDEX, SCAN_DELAY_MS = "slowidx", 1000
_names = itertools.count(1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, pki) -> Iterator[Cluster]:
    c = Cluster(Path(tmp_path_factory.mktemp("txcluster")), pki, transaction_timeout_ms=TIMEOUT_MS,
                consumer_session_timeout_ms=60000)
    for broker in c.brokers:
        broker.env["CURSUS_TXN_INDEX_SCAN_DELAY_MS"] = f"{SCAN_DELAY_MS}@{SLOW_INDEX}"
        broker.env["CURSUS_TXN_CRASH_AT"] = CRASH + (
            ",leader_after_marker@crashmark-" if broker.log_dir.name == MARKER_VICTIM else "")
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture
def conn(cluster: Cluster) -> Iterator[RoutingConnection]:
    routed = RoutingConnection([b.address for b in cluster.brokers])
    yield routed
    routed.close()


def _name(prefix: str) -> str:
    return f"{prefix}{next(_names)}-{int(time.time() * 1000) % 100000}"


def _topic(conn: RoutingConnection, partitions: int, prefix: str = "ctx") -> str:
    name = _name(prefix)
    frame = conn.command(f"CREATE topic={name} partitions={partitions} replication_factor=3")
    assert frame.status.name == "OK", render(frame)
    for p in range(partitions):  # every leader serves it
        wait_for(lambda p=p: conn.command(f"LIST_OFFSETS topic={name} partition={p}").status.name == "OK", 15,
                 f"{name}-{p} served")
    return name


def _fill(conn: RoutingConnection, topic: str, count: int) -> None:
    for i in range(count):
        frame = conn.command(f"PUBLISH topic={topic} partition=0 producerId=filler acks=all message=in{i}")
        assert frame.status.name == "OK", render(frame)


def _owner(cluster: Cluster, tid: str) -> BrokerProcess:
    for broker in cluster.brokers:
        if broker.proc is not None and broker.proc.poll() is None:
            routed = RoutingConnection([broker.address])
            try:
                found = ok_fields(routed.command(f"FIND_COORDINATOR transactional_id={tid}"))
            finally:
                routed.close()
            return cluster.by_id(found["coordinator_id"])
    raise AssertionError("no broker is running")


def _join(conn: RoutingConnection, topic: str, group: str) -> tuple[str, int]:
    joined = ok_fields(conn.command(f"JOIN_GROUP topic={topic} group={group} member=worker"))
    return joined["member"], int(joined["generation"])


def _offset(conn: RoutingConnection, topic: str, group: str) -> int:
    return int(ok_fields(conn.command(f"FETCH_OFFSET topic={topic} partition=0 group={group}"))["offset"])


def _visible(conn: RoutingConnection, topic: str, partition: int) -> list[bytes]:
    return payloads(read_all(conn, topic, partition))  # type: ignore[arg-type]


def _eventually(conn: RoutingConnection, topic: str, expected: list[list[bytes]]) -> None:
    """Every partition of ``topic`` shows exactly ``expected[p]`` to read_committed. A partition led by
    another broker than the coordinator resolves when the final TxnSync is applied there, a moment after
    END_TXN answers; nothing is ever visible before that."""
    try:
        wait_for(lambda: [_visible(conn, topic, p) for p in range(len(expected))] == expected, 10,
                 f"{topic} visible as {expected}")
    except AssertionError:
        for p in range(len(expected)):
            raw = read_all(conn, topic, p, isolation="read_uncommitted")  # type: ignore[arg-type]
            print("DEBUG", p, [(r.offset, r.payload[:12], r.transaction_marker) for r in raw], _visible(conn, topic, p))
        print("DEBUG", conn.command(f"METADATA topic={topic}").payload)
        raise


def _restart_dead(cluster: Cluster) -> None:
    for broker in cluster.brokers:
        if broker.proc is not None and broker.proc.poll() is not None:
            broker.start(timeout_s=60)


@contextlib.contextmanager
def _restarting_dead(cluster: Cluster) -> Iterator[None]:
    """Restart every broker that died inside the block (kill -9, a crash point), even when it fails."""
    try:
        yield
    finally:
        _restart_dead(cluster)


@contextlib.contextmanager
def _owner_killed(cluster: Cluster, tid: str) -> Iterator[BrokerProcess]:
    """kill -9 the coordinator shard owner of ``tid`` and wait until another broker owns the shard; yields
    the killed broker; every dead broker is restarted on the way out."""
    owner = _owner(cluster, tid)
    owner.kill()
    with _restarting_dead(cluster):
        wait_for(lambda: _owner(cluster, tid) is not owner, 20, "a new shard owner")
        yield owner


def _end_until_done(s: Session, result: str, deadline_s: float = 30.0) -> dict[str, str]:
    """END_TXN, retried (same epoch) while the answer is a retryable failure or the connection drops."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            frame = s.conn.command(f"END_TXN {s.ids} result={result}")
        except OSError:
            frame = None
        if frame is not None and frame.status.name == "OK":
            return ok_fields(frame)
        if time.monotonic() > deadline:
            raise AssertionError(f"END_TXN never completed: {render(frame) if frame else 'connection lost'}")
        if frame is not None:
            assert error_of(frame).code in ("transaction_commit_failed", "transaction_abort_marker_failed",
                                            "transaction_sync_failed", "replication_unavailable",
                                            "NOT_COORDINATOR", "coordinator_not_available"), render(frame)
        time.sleep(0.2)


def test_commit_is_atomic_across_partitions_and_offsets(cluster: Cluster, conn: RoutingConnection) -> None:
    out, inp, group = _topic(conn, 2), _topic(conn, 1), _name("cg")
    _fill(conn, inp, 8)
    member, generation = _join(conn, inp, group)
    s = Session(conn, _name("tx-"))  # type: ignore[arg-type]
    assert s.init()["epoch"] == "1"
    s.begin()
    s.publish(out, "a0", partition=0)
    s.publish(out, "a1", partition=1)
    s.publish(out, "a1", partition=1, seq=2)  # a publish retry appends nothing
    s.send_offsets(inp, group, member, generation, {0: 7})
    assert _visible(conn, out, 0) == [] and _visible(conn, out, 1) == []
    assert s.status()["state"] == "open"
    done = s.end("commit")
    assert done["state"] == "committed" and done["messages"] == "2" and done["offsets"] == "1"
    _eventually(conn, out, [[b"a0"], [b"a1"]])
    wait_for(lambda: _offset(conn, inp, group) == 7, 10, "the transaction's offset materialized")
    raw = read_all(conn, out, 0, isolation="read_uncommitted")  # type: ignore[arg-type]
    markers = [r for r in raw if r.payload == TXN_CONTROL_MARKER_PAYLOAD]
    assert len(markers) == 1 and markers[0].transaction_marker == "commit"
    assert markers[0].control_coordinator_epoch >= 1  # the shard epoch, not the standalone 0
    assert s.end("commit")["state"] == "committed"  # retry: idempotent
    assert s.end_error("abort") == "transaction_already_committed"
    assert error_of(conn.command(f"BEGIN_TXN {s.ids}")).code == "producer_reinitialization_required"
    owner = _owner(cluster, s.tid)
    other = next(b for b in cluster.brokers if b is not owner)
    single = RoutingConnection([other.address])
    try:  # a non-owner redirects to the owner
        frame = single._conn(other.address).command(f"TXN_STATUS transactional_id={s.tid}")
        err = error_of(frame)
        assert err.code == "NOT_COORDINATOR" and int(err.fields["port"]) == owner.port
    finally:
        single.close()


def test_abort_hides_everything(cluster: Cluster, conn: RoutingConnection) -> None:
    out, inp, group = _topic(conn, 2), _topic(conn, 1), _name("cg")
    _fill(conn, inp, 8)
    member, generation = _join(conn, inp, group)
    s = Session(conn, _name("tx-"))  # type: ignore[arg-type]
    s.init()
    s.begin()
    for i in range(3):
        s.publish(out, f"x{i}", partition=i % 2)
    s.send_offsets(inp, group, member, generation, {0: 5})
    assert s.end("abort")["state"] == "aborted"
    assert s.end_error("commit") == "transaction_aborted"
    assert _visible(conn, out, 0) == [] and _visible(conn, out, 1) == []
    assert _offset(conn, inp, group) == 0
    s.init()
    s.begin()
    s.publish(out, "y", partition=0)
    s.end("commit")
    _eventually(conn, out, [[b"y"], []])


def test_owner_killed_with_an_open_transaction_aborts_at_timeout_and_fences_the_zombie(
        cluster: Cluster, conn: RoutingConnection) -> None:
    out, inp, group = _topic(conn, 2), _topic(conn, 1), _name("cg")
    _fill(conn, inp, 4)
    member, generation = _join(conn, inp, group)
    s = Session(conn, _name("tx-"))  # type: ignore[arg-type]
    s.init()
    s.begin()
    s.publish(out, "lost0", partition=0)
    s.publish(out, "lost1", partition=1)
    s.send_offsets(inp, group, member, generation, {0: 4})
    with _owner_killed(cluster, s.tid) as owner:
        status = wait_for(lambda: s.status()["state"] == "aborted" and s.status(), TIMEOUT_MS / 1000 + 20,
                          "the open transaction aborted by the new owner at its deadline")
        assert status["epoch"] == "1"
        assert _visible(conn, out, 0) == [] and _visible(conn, out, 1) == []
        assert _offset(conn, inp, group) == 0  # nothing of it: output nor offsets
        zombie = Session(conn, s.tid, s.producer_id, s.epoch, s.seq)  # type: ignore[arg-type]
        s.init()  # the next epoch fences the old session
        assert s.epoch == 2
        frame = conn.command(f"TXN_PUBLISH {zombie.ids} topic={out} partition=0 seqNum=9 message=zombie")
        assert error_of(frame).code == "producer_fenced"
        s.begin()
        s.publish(out, "fresh", partition=0)
        assert s.end("commit")["state"] == "committed"
        _eventually(conn, out, [[b"fresh"], []])
    # ownership moves back to the restarted broker, which loads the shard from the metadata
    wait_for(lambda: _owner(cluster, s.tid) is owner, 20, "the shard back on its ring owner")
    assert wait_for(lambda: s.status()["state"] == "committed", 20, "status on the returned owner")


def _publish_until_done(s: Session, topic: str, message: str, seq: int, deadline_s: float = 30.0) -> dict[str, str]:
    """TXN_PUBLISH partition=-1 (same seqNum), retried while the answer is retryable or the connection drops."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            frame = s.conn.command(f"TXN_PUBLISH {s.ids} topic={topic} partition=-1 seqNum={seq} message={message}")
        except OSError:
            frame = None
        if frame is not None and frame.status.name == "OK":
            return ok_fields(frame)
        if time.monotonic() > deadline:
            raise AssertionError(f"TXN_PUBLISH never completed: {render(frame) if frame else 'connection lost'}")
        if frame is not None:
            assert error_of(frame).code in ("transaction_sync_failed", "replication_unavailable", "NOT_LEADER",
                                            "NOT_COORDINATOR", "coordinator_not_available",
                                            "transaction_manager_not_available"), render(frame)
        time.sleep(0.2)


def test_keyless_publish_retried_on_a_new_owner_lands_once(cluster: Cluster, conn: RoutingConnection) -> None:
    """A partition=-1 TXN_PUBLISH on a round_robin topic retried through the new shard owner after the
    owner died (its reply lost) picks the first copy's partition (a pure function of producerId, topic,
    seqNum), where the leader's index deduplicates the seqNum: one copy of each record after commit."""
    name = _name("ctxrr")
    frame = conn.command(f"CREATE topic={name} partitions=3 replication_factor=3 partitioner=round_robin")
    assert frame.status.name == "OK", render(frame)
    for p in range(3):
        wait_for(lambda p=p: conn.command(f"LIST_OFFSETS topic={name} partition={p}").status.name == "OK", 15,
                 f"{name}-{p} served")
    s = Session(conn, _name("txrr-"))  # type: ignore[arg-type]
    s.init()
    s.begin()
    first = {seq: int(s.publish(name, f"r{seq}", seq=seq)["partition"]) for seq in (1, 2, 3)}
    assert first == {seq: partition_for_txn_record(s.producer_id, name, seq, 3) for seq in (1, 2, 3)}
    with _owner_killed(cluster, s.tid):
        for seq in (3, 2, 1):  # the retries, in an order a fresh round-robin counter would place elsewhere
            assert int(_publish_until_done(s, name, f"r{seq}", seq)["partition"]) == first[seq]
        assert _end_until_done(s, "commit")["state"] == "committed"
        expected = [[f"r{seq}".encode() for seq in (1, 2, 3) if first[seq] == p] for p in range(3)]
        _eventually(conn, name, expected)
        for p in range(3):  # no second copy, not even an aborted/hidden one
            raw = read_all(conn, name, p, isolation="read_uncommitted")  # type: ignore[arg-type]
            assert [r.payload for r in raw if r.payload != TXN_CONTROL_MARKER_PAYLOAD] == expected[p]


def test_owner_crash_after_prepare_commit_is_finished_by_the_new_owner(
        cluster: Cluster, conn: RoutingConnection) -> None:
    out, inp, group = _topic(conn, 2), _topic(conn, 1), _name("cg")
    _fill(conn, inp, 8)
    member, generation = _join(conn, inp, group)
    s = Session(conn, _name("crashprep-"))  # type: ignore[arg-type]
    s.init()
    s.begin()
    s.publish(out, "c0", partition=0)
    s.publish(out, "c1", partition=1)
    s.send_offsets(inp, group, member, generation, {0: 3})
    owner = _owner(cluster, s.tid)
    with _restarting_dead(cluster):
        done = _end_until_done(s, "commit")  # the owner exits right after prepare_commit
        assert done["state"] == "committed"
        assert owner.proc is not None and owner.proc.poll() is not None  # it did crash
        assert _owner(cluster, s.tid) is not owner
        _eventually(conn, out, [[b"c0"], [b"c1"]])
        wait_for(lambda: _offset(conn, inp, group) == 3, 15, "the offsets committed with the output")
    assert _visible(conn, out, 0) == [b"c0"] and _visible(conn, out, 1) == [b"c1"]


def test_partition_leader_crash_between_markers(cluster: Cluster, conn: RoutingConnection) -> None:
    out = _topic(conn, 3)  # leaders spread over the three brokers: the victim leads one of them
    tid = next(t for t in (_name("crashmark-") for _ in range(100)) if _owner(cluster, t).log_dir.name != MARKER_VICTIM)
    s = Session(conn, tid)  # type: ignore[arg-type]
    s.init()
    s.begin()
    for p in range(3):
        s.publish(out, f"m{p}", partition=p)
    alive = {b.log_dir.name for b in cluster.brokers if b.proc is not None and b.proc.poll() is None}
    with _restarting_dead(cluster):
        done = _end_until_done(s, "commit")
        assert done["state"] == "committed"
        dead = {b.log_dir.name for b in cluster.brokers if b.proc is not None and b.proc.poll() is not None}
        assert dead == {MARKER_VICTIM} and dead <= alive  # a partition leader died after committing its marker
        _eventually(conn, out, [[f"m{p}".encode()] for p in range(3)])
    for p in range(3):
        assert _visible(conn, out, p) == [f"m{p}".encode()]


def _leader_port(conn: RoutingConnection, topic: str, partition: int) -> int:
    meta = ok_fields(conn.command(f"METADATA topic={topic}"))
    return int(meta["leaders"].split(",")[partition].rpartition(":")[2])


def test_lso_holds_on_a_follower_turned_leader(cluster: Cluster, conn: RoutingConnection) -> None:
    out = _topic(conn, 1)
    leader = next(b for b in cluster.brokers if b.port == _leader_port(conn, out, 0))
    tid = next(t for t in (_name("tx-") for _ in range(100)) if _owner(cluster, t) is not leader)
    s = Session(conn, tid)  # type: ignore[arg-type]
    s.init()
    s.begin()
    s.publish(out, "open0", partition=0)
    frame = conn.command(f"PUBLISH topic={out} partition=0 producerId=plain acks=all message=after")
    assert frame.status.name == "OK", render(frame)
    leader.kill()
    with _restarting_dead(cluster):
        wait_for(lambda: _leader_port(conn, out, 0) != leader.port, 20, "a new leader")
        # the new leader rebuilt its index from the log: the open transaction pins the LSO, so neither its
        # record nor the plain record after it is read_committed; read_uncommitted sees both
        raw = wait_for(lambda: read_all(conn, out, 0, isolation="read_uncommitted"), 20,  # type: ignore[arg-type]
                       "read_uncommitted on the new leader")
        assert [r.payload for r in raw] == [b"open0", b"after"]
        assert _visible(conn, out, 0) == []
        s.publish(out, "open1", partition=0)  # the same session goes on with the new leader
        assert s.end("commit")["state"] == "committed"
        _eventually(conn, out, [[b"open0", b"after", b"open1"]])


def test_read_committed_hides_aborted_records_while_a_new_leader_rebuilds_its_index(
        cluster: Cluster, conn: RoutingConnection) -> None:
    """Finding K (chaos seed 21): a new leader rebuilds its transaction index from its log on a blocking
    thread. read_committed must not use that index half-built: one that has passed the first commit marker
    but not yet the aborted records behind it would not hide them. Here each marker's scan pauses 1 s, so
    reads land inside the rebuild; every answer must be a prefix of the committed records, never an aborted
    one, and the window must really have been hit (an empty answer from the serving new leader)."""
    out = _topic(conn, 1, SLOW_INDEX)
    leader = next(b for b in cluster.brokers if b.port == _leader_port(conn, out, 0))
    tid = next(t for t in (_name("tx-") for _ in range(100)) if _owner(cluster, t) is not leader)
    s = Session(conn, tid)  # type: ignore[arg-type]
    for values, result in ((["c0"], "commit"), (["a0", "a1"], "abort"), (["c1"], "commit")):
        s.init()
        s.begin()
        for value in values:
            s.publish(out, value, partition=0)
        assert s.end(result)["state"] == ("committed" if result == "commit" else "aborted")
    _eventually(conn, out, [[b"c0", b"c1"]])
    leader.kill()
    with _restarting_dead(cluster):
        wait_for(lambda: _leader_port(conn, out, 0) != leader.port, 20, "a new leader")
        answers: list[list[bytes]] = []
        deadline = time.monotonic() + 30
        while not answers or answers[-1] != [b"c0", b"c1"]:
            assert time.monotonic() < deadline, f"read_committed never came back whole: {answers[-5:]}"
            frame = conn.command(f"CONSUME topic={out} partition=0 offset=0 isolation=read_committed")
            if frame.status.name == "OK":  # leader_not_available while it prepares: poll on
                records = decode_batch(frame.payload).records if frame.payload else []
                answers.append([r.payload for r in records if r.payload != TXN_CONTROL_MARKER_PAYLOAD])
                assert answers[-1] == [b"c0", b"c1"][:len(answers[-1])], answers[-1]
            time.sleep(0.02)
        assert [] in answers, f"no read landed while the index was rebuilt: {answers[:3]}"


def test_sdk_consume_transform_produce_on_the_cluster(cluster: Cluster, conn: RoutingConnection) -> None:
    from cursus.client import Consumer, GroupConsumer, Producer, TransactionalProducer

    bootstrap = [f"{h}:{p}" for h, p in (b.address for b in cluster.brokers)]
    source, sink, group = _topic(conn, 1), _topic(conn, 2), _name("cg")
    with Producer(bootstrap) as producer:
        for i in range(6):
            producer.send(source, f"v{i}".encode(), partition=0)
    with GroupConsumer(source, group, bootstrap, auto_commit=False, wait_ms=100) as consumer, \
            TransactionalProducer(bootstrap, _name("sdk-tx-")) as txn:
        seen, deadline = 0, time.monotonic() + 60
        while seen < 6 and time.monotonic() < deadline:
            records = consumer.poll(timeout_s=5)
            if not records:
                continue
            txn.begin()
            for record in records:
                txn.send(sink, record.value.upper(), key=record.value.decode())
            txn.send_consumer_offsets(consumer)
            assert txn.commit() == "committed"
            seen += len(records)
        assert seen == 6
    wait_for(lambda: _offset(conn, source, group) == 6, 15, "the transactional offsets")

    def committed() -> list[bytes]:
        with Consumer(sink, bootstrap, start="earliest", isolation_level="read_committed") as reader:
            return sorted(r.value for r in reader.records(until_end=True))
    wait_for(lambda: committed() == [f"V{i}".encode() for i in range(6)], 15, "the output, exactly once")


def test_markers_of_a_coordinator_not_owning_the_shard_epoch_are_refused(cluster: Cluster, conn: RoutingConnection,
                                                                        pki) -> None:
    """What a previous shard owner (or any other broker) sends a partition leader: refused, nothing appended."""
    import asyncio

    from cursus.internal.client import InternalClient
    from cursus.internal.v1 import replication_pb2 as pb
    from cursus.transactions.markers import marker_record

    out = _topic(conn, 1)
    s = Session(conn, _name("tx-"))  # type: ignore[arg-type]
    s.init()
    s.begin()
    s.publish(out, "z0", partition=0)
    owner = _owner(cluster, s.tid).log_dir.name
    leader = next(b for b in cluster.brokers if b.port == _leader_port(conn, out, 0)).log_dir.name
    other = next(b.log_dir.name for b in cluster.brokers if b.log_dir.name != owner)

    async def send(caller: str, coordinator_epoch: int) -> pb.TxnRecordResponse:
        client = InternalClient(caller, tls=pki.files(caller), token="test-token")
        try:
            record = marker_record(out, 0, transactional_id=s.tid, producer_id=s.producer_id, producer_epoch=s.epoch,
                                   commit=True, coordinator_epoch=coordinator_epoch,
                                   timestamp_ms=int(time.time() * 1000))
            request = pb.TxnRecordRequest(coordinator_id=caller, topic=out, partition=0, record=record,
                                          coordinator_epoch=coordinator_epoch, transactional_id=s.tid,
                                          producer_id=s.producer_id, producer_epoch=s.epoch, kind="commit")
            return await client.append_txn_record(cluster.internal[leader], request, 10.0)
        finally:
            await client.close()

    for caller, epoch in ((other, 1), (other, 2), (owner, 0)):  # not the owner; the owner at a stale epoch
        response = asyncio.run(send(caller, epoch))
        assert response.error.code == "NOT_COORDINATOR", (caller, epoch, response)
    raw = read_all(conn, out, 0, isolation="read_uncommitted")  # type: ignore[arg-type]
    assert [r.payload for r in raw] == [b"z0"]  # no marker got in
    assert _visible(conn, out, 0) == []
    assert s.end("abort")["state"] == "aborted"
    assert _visible(conn, out, 0) == []


def test_transactional_stream_appends_across_partition_leaders(cluster: Cluster, conn: RoutingConnection) -> None:
    """TXN_APPEND_STREAM on a 3-node cluster: aggregates on partitions led by other brokers than the
    coordinator (their version check runs on that leader, reached through AppendTxnRecord), invisible
    until the commit, then visible with the staged versions everywhere; an abort frees the version."""
    from cursus.partitioning import partition_for_key

    name = _name("ces")
    frame = conn.command(f"CREATE topic={name} partitions=3 replication_factor=3 event_sourcing=true")
    assert frame.status.name == "OK", render(frame)
    keys: dict[int, str] = {}
    for i in itertools.count():  # one aggregate per partition: three leaders take part
        keys.setdefault(partition_for_key(f"agg-{i}", 3), f"agg-{i}")
        if len(keys) == 3:
            break

    def version(key: str) -> int:
        return int(ok_fields(conn.command(f"STREAM_VERSION topic={name} key={key}"))["version"])

    def stage(s: Session, key: str, v: int):
        s.seq += 1
        return conn.command(f"TXN_APPEND_STREAM {s.ids} topic={name} key={key} expected_version={v} "
                            f"seqNum={s.seq} schema_version=1 event_type=E message={key}-{v}")

    for key in keys.values():
        wait_for(lambda key=key: conn.command(f"APPEND_STREAM topic={name} key={key} version=1 event_type=E "
                                              f"message={key}-1").status.name == "OK", 15, f"{key} appended")
    s = Session(conn, _name("txes-"))  # type: ignore[arg-type]
    s.init()
    s.begin()
    for key in keys.values():
        ok = ok_fields(stage(s, key, 2))
        assert ok["partition"] == str(partition_for_key(key, 3))
        ok_fields(stage(s, key, 3))  # the transaction's staged version counts, on every leader
    first = next(iter(keys.values()))
    err = error_of(stage(s, first, 3))
    assert err.code == "version_conflict" and err.fields.get("current") == "3"
    assert [version(k) for k in keys.values()] == [1, 1, 1]
    err = error_of(conn.command(f"APPEND_STREAM topic={name} key={first} version=4 event_type=E message=x"))
    assert err.code == "version_conflict" and err.fields.get("reason") == "transaction_in_progress"
    assert s.end("commit")["state"] == "committed"
    wait_for(lambda: [version(k) for k in keys.values()] == [3, 3, 3], 10, "committed versions visible")
    s.init()
    s.begin()
    ok_fields(stage(s, first, 4))
    assert s.end("abort")["state"] == "aborted"
    wait_for(lambda: conn.command(f"APPEND_STREAM topic={name} key={first} version=4 event_type=E "
                                  f"message=after-abort").status.name == "OK", 10, "version 4 free again")
    assert version(first) == 4


def test_sdk_producer_follows_a_new_shard_owner(cluster: Cluster, conn: RoutingConnection) -> None:
    """The SDK's TransactionalProducer forgets its cached coordinator when the shard owner is gone, so the
    same producer object finds the new owner (FIND_COORDINATOR) and keeps committing (break-it finding:
    every call after a kill -9 of the owner failed with broker_unavailable for the old address)."""
    from cursus.client import TransactionalProducer

    bootstrap = [f"{h}:{p}" for h, p in (b.address for b in cluster.brokers)]
    sink = _topic(conn, 1)
    tid = _name("sdk-owner-")
    with TransactionalProducer(bootstrap, tid) as txn:
        txn.begin()
        txn.send(sink, "before")
        assert txn.commit() == "committed"
        with _owner_killed(cluster, tid):
            _begin_on_new_owner(txn)
            txn.send(sink, "after")
            assert txn.commit() == "committed"
    _eventually(conn, sink, [[b"before", b"after"]])


def _begin_on_new_owner(txn, deadline_s: float = 30.0) -> None:
    """``txn.begin()``, retried while the new shard owner is not reachable yet (retryable errors only)."""
    from cursus.client.errors import CursusError

    deadline = time.monotonic() + deadline_s
    while True:
        try:
            txn.begin()
            return
        except CursusError as exc:
            if not (exc.retryable or exc.code == "broker_unavailable"):
                raise
            assert time.monotonic() < deadline, f"never reached the new owner: {exc}"
            time.sleep(0.2)


def test_zombie_is_fenced_by_the_replicated_epoch_after_an_owner_failover(
        cluster: Cluster, conn: RoutingConnection) -> None:
    """Zombie fencing the right way round on three brokers: the zombie (an instance paused after its
    commit) re-initializes in the guarded form after the new instance took the id over and the shard moved
    to another broker (kill -9 of the owner); the new owner evaluates the guard against the replicated
    epoch: the zombie is fenced, the new instance keeps committing."""
    from cursus.client import ProducerFencedError, TransactionalProducer

    bootstrap = [f"{h}:{p}" for h, p in (b.address for b in cluster.brokers)]
    sink = _topic(conn, 1)
    tid = _name("zombie-")
    with TransactionalProducer(bootstrap, tid) as zombie, TransactionalProducer(bootstrap, tid) as fresh:
        zombie.begin()
        zombie.send(sink, "z1", partition=0)
        assert zombie.commit() == "committed"
        fresh.begin()  # plain first init: fences the zombie's session
        fresh.send(sink, "f1", partition=0)
        assert fresh.commit() == "committed"
        with _owner_killed(cluster, tid):
            with pytest.raises(ProducerFencedError):
                _begin_on_new_owner(zombie)
            for i in (2, 3):
                _begin_on_new_owner(fresh)
                fresh.send(sink, f"f{i}", partition=0)
                assert fresh.commit() == "committed"
            assert _epoch(conn, tid) == fresh.session.epoch
    _eventually(conn, sink, [[b"z1", b"f1", b"f2", b"f3"]])


def _epoch(conn: RoutingConnection, tid: str) -> int:
    return int(ok_fields(conn.command(f"TXN_STATUS transactional_id={tid}"))["epoch"])


def test_message_count_survives_an_owner_failover(cluster: Cluster, conn: RoutingConnection) -> None:
    """END_TXN messages=N counts the records published through the previous shard owner: the count comes
    from the partition leaders' logs at marker time (it used to be the new owner's in-memory count, which
    only knew the records up to the last persisted transition)."""
    out = _topic(conn, 2)
    s = Session(conn, _name("txcount-"))  # type: ignore[arg-type]
    s.init()
    s.begin()
    for i in range(5):
        s.publish(out, f"c{i}", partition=i % 2)
    with _owner_killed(cluster, s.tid):
        s.seq += 1  # one more through the new owner (retried while it is not reachable yet)
        wait_for(lambda: s.conn.command(f"TXN_PUBLISH {s.ids} topic={out} partition=0 seqNum={s.seq} message=c5"
                                        ).status.name == "OK", 30, "a publish through the new owner")
        done = _end_until_done(s, "commit")
        assert done["state"] == "committed" and done["messages"] == "6", done
        assert s.status()["messages"] == "6"
        _eventually(conn, out, [[b"c0", b"c2", b"c4", b"c5"], [b"c1", b"c3"]])
