"""Event sourcing on three brokers: event commands run on the aggregate partition's leader (``NOT_LEADER
leader=`` elsewhere), a new leader serves the same versions from its committed log after a kill -9, and
snapshots survive the leader change (spec "Event Sourcing Commands", distributed mode)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from cursus.client.connection import Backoff, Connection
from cursus.client.errors import CursusError, VersionConflictError
from cursus.client.events import EventStore
from cursus.eventstore import StreamIndex
from cursus.wire import Command, CommandPayload, Status, decode_batch, encode_crq2
from tests.cluster.clustersupport import Cluster, wait_for, wait_topic_ready
from tests.cluster.replsupport import leader_proc, read_partition, status, wait_isr
from tests.integration.helpers import create_topic, error_of, ok_fields

TOPIC = "es-cluster"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, pki) -> Cluster:
    c = Cluster(Path(tmp_path_factory.mktemp("es-cluster")), pki, replica_lag_time_max_ms=4000,
                eventstore_index_interval_ms=100, eventstore_checkpoint_interval_events=1)
    try:
        c.start()
        with Connection(*c.brokers[0].address, timeout_s=10) as conn:
            create_topic(conn, TOPIC, 1, replication_factor="3", event_sourcing="true")
        wait_topic_ready(c, TOPIC, 1)
        wait_isr(c, TOPIC, 3)
        yield c
    finally:
        c.stop()


def addresses(cluster: Cluster, skip: object = None) -> list[str]:
    return [f"127.0.0.1:{b.port}" for b in cluster.brokers if b is not skip]


def read_versions(cluster: Cluster, key: str) -> list[tuple[int, bytes]]:
    leader = wait_for(lambda: leader_proc(cluster, TOPIC), 20, "a leader")
    with Connection(*leader.address, timeout_s=10) as conn:
        request_id = conn.send(Command.READ_STREAM, encode_crq2(CommandPayload((), {"topic": TOPIC, "key": key})))
        envelope = conn.receive(request_id, Command.READ_STREAM)
        assert envelope.status == Status.OK, error_of(envelope).render()
        batch = conn.receive(request_id, Command.READ_STREAM)
    return [(r.aggregate_version or 0, bytes(r.payload)) for r in decode_batch(batch.payload).records]


def append_until_done(cluster: Cluster, key: str, version: int, payload: str, skip: object = None) -> bool:
    """Append ``version``; across a failover an unknown outcome is resolved by reading the version.

    Returns True when this call's append is the one stored at ``version``.
    """
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        try:
            with EventStore(addresses(cluster, skip), TOPIC, timeout_s=5, backoff=Backoff(attempts_max=3)) as store:
                try:
                    store.append(key, payload, expected_version=version)
                    return True
                except VersionConflictError as exc:
                    assert exc.current is not None and exc.current >= version, exc
                    return False  # an earlier attempt with an unknown outcome was committed
        except CursusError:
            time.sleep(0.2)
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"version {version} never appended")


def test_event_commands_run_on_the_leader(cluster: Cluster) -> None:
    leader = leader_proc(cluster, TOPIC)
    follower = next(b for b in cluster.brokers if b is not leader)
    with Connection(*follower.address, timeout_s=10) as conn:
        err = error_of(conn.command(f"STREAM_VERSION topic={TOPIC} key=k"))
        assert err.code == "NOT_LEADER" and err.fields["leader"] == f"127.0.0.1:{leader.port}"
        assert error_of(conn.command(f"APPEND_STREAM topic={TOPIC} key=k version=1 message=x")).code == "NOT_LEADER"
    with EventStore(addresses(cluster), TOPIC) as store:  # the SDK follows the redirect
        assert store.version("k") == 0


def test_leader_kill_between_appends_loses_and_duplicates_no_version(cluster: Cluster) -> None:
    key = "order-7"
    with EventStore(addresses(cluster), TOPIC) as store:
        for v in range(1, 11):
            store.append(key, f"e{v}", expected_version=v)
        store.save_snapshot(key, 10, "state-10")
    old = leader_proc(cluster, TOPIC)
    old.kill()
    # the SDK rides out the failover itself (NOT_LEADER to the dead leader, leader_not_available, ...)
    with EventStore(addresses(cluster, old), TOPIC, timeout_s=2, failover_timeout_s=30,
                    backoff=Backoff(initial_s=0.05, max_s=0.2, attempts_max=2)) as store:
        assert store.version(key) == 10 and store.read(key).version == 10
    acknowledged = {v: f"e{v}" for v in range(1, 11)}
    for v in range(11, 21):
        if append_until_done(cluster, key, v, f"e{v}", skip=old):
            acknowledged[v] = f"e{v}"
    new = wait_for(lambda: leader_proc(cluster, TOPIC, via=next(b for b in cluster.brokers if b is not old)),
                   20, "a new leader")
    assert new is not old
    # the committed log itself: every version once, in order, with the acknowledged payloads
    logged = [(r.aggregate_version, bytes(r.payload)) for r in read_partition(cluster, TOPIC) if r.key == key]
    assert [v for v, _ in logged] == list(range(1, 21)), "versions lost or duplicated"
    for v, payload in logged:
        assert payload == acknowledged.get(v, payload.decode()).encode()
    # READ_STREAM: the snapshot replaces versions 1..10
    assert [v for v, _ in read_versions(cluster, key)] == list(range(11, 21))
    with EventStore(addresses(cluster, old), TOPIC) as store:
        assert store.version(key) == 20
        snapshot = store.read_snapshot(key)
        assert snapshot is not None and (snapshot.version, snapshot.payload) == (10, "state-10")
        agg = store.read(key)
        assert agg.snapshot is not None and agg.snapshot.version == 10
        assert [e.version for e in agg.events] == list(range(11, 21))
    # followers index committed events in the background (their checkpoints show it)
    follower = next(b for b in cluster.brokers if b is not old and b is not new)

    def follower_indexed() -> bool:
        path = follower.log_dir / "topics" / TOPIC / "0" / "eventstore.index"
        return path.exists() and StreamIndex.decode(path.read_bytes()).version(key) == 20

    wait_for(follower_indexed, 15, "the follower's stream index at version 20")
    old.start(timeout_s=60)
    wait_for(lambda: status(cluster.brokers[0])["inactive_brokers"] == 0, 30, "every broker active")
    wait_isr(cluster, TOPIC, 3, timeout=30)
    # the restarted broker indexes its committed log when it leads again
    with Connection(*cluster.brokers[0].address, timeout_s=10) as conn:
        ok_fields(conn.command(f"ELECT_LEADER topic={TOPIC} partition=0 broker={old.log_dir.name}"))
    wait_for(lambda: leader_proc(cluster, TOPIC) is old, 15, "the restarted broker leads")
    with Connection(*old.address, timeout_s=10) as conn:
        def version_on_old() -> bool:
            frame = conn.command(f"STREAM_VERSION topic={TOPIC} key={key}")
            return frame.status == Status.OK and ok_fields(frame)["version"] == "20"
        wait_for(version_on_old, 15, "the old leader serves version 20")
        text = conn.command(f"READ_SNAPSHOT topic={TOPIC} key={key}").payload.decode()
        assert json.loads(text.removeprefix("OK snapshot="))["version"] == 10


def test_appends_in_flight_across_a_leader_kill(cluster: Cluster) -> None:
    """A writer appends continuously while the leader is killed: the committed log holds every version
    once, in order, and every acknowledged append with its own payload."""
    import threading

    key = "live"
    acked: dict[int, str] = {}
    stop = threading.Event()
    errors: list[str] = []

    def writer() -> None:
        version, attempt = 1, 0
        while not stop.is_set():
            attempt += 1
            payload = f"v{version}-a{attempt}"
            try:
                with EventStore(addresses(cluster), TOPIC, timeout_s=3, backoff=Backoff(attempts_max=2)) as store:
                    while not stop.is_set():
                        try:
                            store.append(key, payload, expected_version=version)
                            acked[version] = payload
                        except VersionConflictError as exc:
                            if exc.current is None or exc.current < version - 1:
                                errors.append(f"version {version}: {exc}")
                                return
                            # an earlier attempt of this version (unknown outcome) was committed
                        version += 1
                        attempt += 1
                        payload = f"v{version}-a{attempt}"
            except CursusError:
                time.sleep(0.1)  # unknown outcome or no leader: the next attempt decides by the version

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    wait_for(lambda: len(acked) >= 10, 20, "ten acknowledged appends")
    old = leader_proc(cluster, TOPIC)
    old.kill()
    before = len(acked)
    wait_for(lambda: len(acked) >= before + 10, 40, "ten more appends on the new leader")
    stop.set()
    thread.join(timeout=30)
    assert not errors, errors
    logged = [(r.aggregate_version, bytes(r.payload).decode()) for r in read_partition(cluster, TOPIC)
              if r.key == key]
    versions = [v for v, _ in logged]
    assert versions == list(range(1, len(versions) + 1)), "a version lost or duplicated"
    stored = dict(logged)
    for version, payload in acked.items():
        assert stored[version] == payload, (version, payload, stored.get(version))
    old.start(timeout_s=60)
    wait_isr(cluster, TOPIC, 3, timeout=30)


def test_save_snapshot_fails_when_an_in_sync_replica_cannot_store_it(cluster: Cluster) -> None:
    wait_isr(cluster, TOPIC, 3, timeout=30)
    leader = leader_proc(cluster, TOPIC)
    follower = next(b for b in cluster.brokers if b is not leader)
    with EventStore(addresses(cluster), TOPIC) as store:
        store.append("paused", "e1", expected_version=1)
    follower.pause()  # still in the ISR for replica_lag_time_max_ms: the snapshot must reach it
    try:
        with Connection(*leader.address, timeout_s=20) as conn:
            err = error_of(conn.command(f"SAVE_SNAPSHOT topic={TOPIC} key=paused version=1 message=s1"))
        assert err.code == "snapshot_replicate_failed" and err.fields["outcome"] == "unknown", err.render()
        assert follower.log_dir.name in err.fields["reason"], err.render()
    finally:
        follower.resume()
    wait_isr(cluster, TOPIC, 3, timeout=30)
    with EventStore(addresses(cluster), TOPIC) as store:  # a retry once the ISR is healthy succeeds
        store.save_snapshot("paused", 1, "s1")
        snapshot = store.read_snapshot("paused")
        assert snapshot is not None and snapshot.payload == "s1"
