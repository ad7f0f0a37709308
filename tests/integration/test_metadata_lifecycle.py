"""Topic lifecycle through the metadata seam against real brokers: deletion that cannot bring data back,
broker identity, describable assignment, and health during parallel startup recovery."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.conftest import connect
from tests.integration.helpers import ack_of, consume_all, create_topic, error_of, ok_fields, publish_batch

pytestmark = pytest.mark.timeout(120)


def _chattr(flag: str, path: Path) -> bool:
    if shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0


@pytest.fixture
def immutable(tmp_path):
    """``make(path)`` sets the immutable attribute (even root cannot rename or unlink entries of the
    folder); every folder made immutable is released at teardown. Skips where the fs does not support it."""
    locked: list[Path] = []

    def make(path: Path) -> None:
        if not _chattr("+i", path):
            pytest.skip("chattr +i is not supported here")
        locked.append(path)

    def release(path: Path) -> None:
        _chattr("-i", path)
        locked.remove(path)

    make.release = release  # type: ignore[attr-defined]
    yield make
    for path in list(locked):
        _chattr("-i", path)


def test_deleted_data_never_comes_back_while_cleanup_is_pending(broker_factory, immutable):
    """Regression: DELETE committed the manifest, rmtree failed (cleanup_pending), and a CREATE of the same
    name reopened the old folder, so recovery served the deleted records again."""
    broker = broker_factory(settings={"exporter_port": 0}).start()
    topics = broker.log_dir / "topics"

    def orphans_metric() -> str:
        text = broker.http_get("/metrics", port=broker.metrics_port)[1].decode()
        return next(line for line in text.splitlines() if line.startswith("cursus_topic_metadata_orphan_topics "))

    with connect(broker) as conn:
        create_topic(conn, "t", partitions=1)
        ack_of(publish_batch(conn, "t", 0, [b"old"] * 5))
        immutable(topics)  # nothing under topics/ can be renamed or removed now
        assert ok_fields(conn.command("DELETE topic=t")) == {"topic": "t", "deleted": "true", "cleanup_pending": "true"}
        assert orphans_metric().endswith(" 1.0")
        err = error_of(conn.command("CREATE topic=t partitions=1"))
        assert err.code == "create_topic_failed" and err.fields.get("cleanup_pending") == "true"
        assert error_of(publish_batch(conn, "t", 0, [b"x"])).code == "topic_not_found"
    # a crash and restart cannot move it either: still refused, and the broker serves
    broker.restart(kill=True)
    with connect(broker) as conn:
        assert ok_fields(conn.command("LIST"))["count"] == "0"
        assert error_of(conn.command("CREATE topic=t partitions=1")).code == "create_topic_failed"
        assert ok_fields(conn.command("DELETE topic=t if_exists=true")) == \
            {"topic": "t", "deleted": "false", "cleanup_pending": "true"}
        immutable.release(topics)  # type: ignore[attr-defined]
        assert ok_fields(conn.command("DELETE topic=t if_exists=true")) == {"topic": "t", "deleted": "false"}
        assert orphans_metric().endswith(" 0.0")
        fresh = create_topic(conn, "t", partitions=1)
        assert fresh["revision"] == "1"
        assert consume_all(conn, "t", 0) == []
    assert not any((broker.log_dir / "trash").iterdir())


def test_create_retries_the_cleanup_itself(broker_factory, immutable):
    broker = broker_factory().start()
    topics = broker.log_dir / "topics"
    with connect(broker) as conn:
        create_topic(conn, "t", partitions=2)
        ack_of(publish_batch(conn, "t", 1, [b"old"] * 3))
        immutable(topics)
        assert ok_fields(conn.command("DELETE topic=t"))["cleanup_pending"] == "true"
        immutable.release(topics)  # type: ignore[attr-defined]
        create_topic(conn, "t", partitions=2)
        assert consume_all(conn, "t", 1) == []


def test_leftover_storage_of_a_deleted_topic_is_moved_away_at_startup(broker_factory):
    broker = broker_factory().start()
    with connect(broker) as conn:
        create_topic(conn, "t", partitions=1)
        ack_of(publish_batch(conn, "t", 0, [b"old"] * 4))
    broker.terminate()
    # the state a crash between the manifest commit and the folder rename leaves behind
    manifest = broker.log_dir / "__topic_metadata.json"
    doc = json.loads(manifest.read_text())
    doc["topics"] = [t for t in doc["topics"] if t["name"] != "t"]
    manifest.write_text(json.dumps(doc))
    (broker.log_dir / "trash").mkdir(exist_ok=True)
    (broker.log_dir / "trash" / "stale").mkdir()
    broker.start()
    assert not (broker.log_dir / "topics" / "t").exists()
    assert not any((broker.log_dir / "trash").iterdir())
    with connect(broker) as conn:
        create_topic(conn, "t", partitions=1)
        assert consume_all(conn, "t", 0) == []


def test_broker_id_and_describe_come_from_the_metadata_registry(broker_factory):
    broker = broker_factory(settings={"broker_id": "node-a"}).start()
    with connect(broker) as conn:
        create_topic(conn, "t", partitions=2)
        doc = json.loads(conn.command("DESCRIBE topic=t").payload)
        for p in doc["partitions"]:
            assert p["replicas"] == ["node-a"] and p["isr"] == ["node-a"] and p["leader_epoch"] == 0
            assert p["leader"] == f"127.0.0.1:{broker.port}"
        meta = ok_fields(conn.command("METADATA topic=t"))
        assert meta["leaders"] == f"127.0.0.1:{broker.port},127.0.0.1:{broker.port}" and meta["epochs"] == "0,0"
        assert ok_fields(conn.command("FIND_COORDINATOR group=g"))["coordinator_id"] == "node-a"


def _get(port: int, path: str) -> tuple[int, float]:
    started = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            status = resp.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    return status, time.monotonic() - started


def test_live_answers_while_recovery_runs_and_ready_waits_for_it(broker_factory):
    """Startup recovery runs off the loop: /live answers 200 throughout, /ready is 503 until done."""
    broker = broker_factory(settings={"health_check_port": 0}).start()
    with connect(broker) as conn:
        for i in range(6):
            create_topic(conn, f"t{i}", partitions=50)
        ack_of(publish_batch(conn, "t0", 0, [b"x"] * 3))
    broker.kill()
    # a fixed health port so we can probe before the broker logs its ports
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        health_port = s.getsockname()[1]
    broker.settings.update(health_check_port=health_port, recovery_threads=1)
    broker.health = False  # the port comes from the settings above
    broker.start(expect_ready=False)
    statuses: list[tuple[int, int]] = []
    latencies: list[float] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            live, seconds = _get(health_port, "/live")
            ready, _ = _get(health_port, "/ready")
        except OSError:
            continue  # not listening yet
        statuses.append((live, ready))
        latencies.append(seconds)
        if ready == 200:
            break
    assert statuses and statuses[-1] == (200, 200)
    assert all(live == 200 for live, _ in statuses)
    assert (200, 503) in statuses, statuses  # observed recovery in progress
    assert max(latencies) < 2.0, max(latencies)  # the loop is never blocked by partition recovery


def test_a_partition_that_failed_to_open_is_retryable_and_opens_on_the_next_create(broker_factory, immutable):
    broker = broker_factory().start()
    topics = broker.log_dir / "topics"
    with connect(broker) as conn:
        immutable(topics)  # the partition folder cannot be created
        err = error_of(conn.command("CREATE topic=u partitions=1"))
        assert err.code == "create_topic_failed"
        # committed but not served here: a retryable typed error, and the connection stays usable
        publish_err = error_of(publish_batch(conn, "u", 0, [b"x"]))
        assert publish_err.code == "leader_not_available" and publish_err.retryable
        assert ok_fields(conn.command("METADATA topic=u"))["leaders"] == f"127.0.0.1:{broker.port}"
        immutable.release(topics)  # type: ignore[attr-defined]
        create_topic(conn, "u", partitions=1)
        ack_of(publish_batch(conn, "u", 0, [b"x"]))
        assert [r.payload for r in consume_all(conn, "u", 0)] == [b"x"]
