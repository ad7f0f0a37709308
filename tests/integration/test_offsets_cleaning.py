"""``__consumer_offsets`` is compacted by the broker's log cleaner (group-aware planner, issue 18) on a real
broker process: the log shrinks, kill -9 + restart answers the same FETCH_OFFSETs, a deleted group (its
tombstone) stays deleted, and kill -9 at every point of a segment swap leaves a consistent state."""

from __future__ import annotations

import time

import pytest

from cursus.coordinator.offsets import OFFSETS_TOPIC
from tests.integration.conftest import connect
from tests.integration.helpers import create_topic, error_of, ok_fields, publish_batch, wait_for

CLEANER = {"offsets_topic_segment_bytes": 4096, "log_cleanup_interval": 0.2, "log_min_cleanable_dirty_ratio": 0.01,
           "log_cleaner_delete_retention_ms": 600_000, "consumer_session_timeout_ms": 60_000}
GROUPS = ("billing", "audit", "search")
PARTITIONS = 3


def offsets_bytes(broker) -> int:
    directory = broker.log_dir / "topics" / OFFSETS_TOPIC / "0"
    return sum(p.stat().st_size for p in directory.glob("*.log"))


def join(conn, topic: str, group: str) -> tuple[str, str]:
    reply = ok_fields(conn.command(f"JOIN_GROUP topic={topic} group={group} member=m"))
    return reply["member"], reply["generation"]


def commit(conn, topic: str, group: str, member: str, generation: str, n: int) -> None:
    offsets = ",".join(f"P{p}:{n + p}" for p in range(PARTITIONS))
    reply = conn.command(f"BATCH_COMMIT topic={topic} group={group} member={member} generation={generation} "
                         f"offsets={offsets}")
    assert ok_fields(reply)["batched"] == str(PARTITIONS), reply


def fetch_all(conn, topic: str) -> dict[tuple[str, int], str]:
    return {(g, p): ok_fields(conn.command(f"FETCH_OFFSET topic={topic} partition={p} group={g}"))["offset"]
            for g in GROUPS for p in range(PARTITIONS)}


def setup(conn) -> dict[str, tuple[str, str]]:
    create_topic(conn, "orders", partitions=PARTITIONS)
    create_topic(conn, "doomed", partitions=1)
    for p in range(PARTITIONS):
        publish_batch(conn, "orders", p, [b"x"] * 700)
    publish_batch(conn, "doomed", 0, [b"x"] * 10)
    return {g: join(conn, "orders", g) for g in GROUPS}


def test_cleaner_bounds_offsets_log_and_restart_answers_the_same(broker_factory):
    broker = broker_factory(settings=CLEANER).start()
    commits = 600
    with connect(broker) as conn:
        members = setup(conn)
        # a group with offsets that is then deleted (topic DELETE tombstones one-topic groups)
        member, generation = join(conn, "doomed", "gone")
        ok_fields(conn.command(f"COMMIT_OFFSET topic=doomed partition=0 group=gone offset=7 member={member} "
                               f"generation={generation}"))
        ok_fields(conn.command(f"LEAVE_GROUP topic=doomed group=gone member={member}"))
        assert ok_fields(conn.command("DELETE topic=doomed"))["deleted"] == "true"
        for n in range(commits):
            group = GROUPS[n % len(GROUPS)]
            commit(conn, "orders", group, *members[group], n)
        before = fetch_all(conn, "orders")
        assert "gone" not in ok_fields(conn.command("LIST_GROUPS"))["groups"].split(",")
    wait_for(lambda: f"cleaned {OFFSETS_TOPIC}/0" in broker.output(), 30, "a cleaner pass on __consumer_offsets")
    # every commit is one ~300-byte record; after cleaning, closed segments hold about one per live key
    written = commits * 300
    wait_for(lambda: offsets_bytes(broker) < written / 3, 30, f"__consumer_offsets to shrink below {written // 3}")
    broker.kill()
    broker.start()
    code, body = broker.http_get("/ready")
    assert code == 200, body
    with connect(broker) as conn:
        assert fetch_all(conn, "orders") == before
        assert ok_fields(conn.command("LIST_GROUPS"))["groups"] == ",".join(sorted(GROUPS))
        assert error_of(conn.command("GROUP_STATUS group=gone")).code == "group_not_found"
        # the restored members still commit in their generation; offsets never go back
        group = GROUPS[0]
        commit(conn, "orders", group, *members[group], commits)
        assert error_of(conn.command(f"COMMIT_OFFSET topic=orders partition=0 group={group} offset=1 "
                                     f"member={members[group][0]} generation={members[group][1]}")).code == \
            "offset_regression"
    assert "no longer used" not in broker.output()


@pytest.mark.parametrize("point", ["after_cleaned_written", "after_swap_marker", "after_rename", "after_index"])
def test_kill_mid_clean_of_offsets_log_leaves_a_consistent_state(broker_factory, point):
    settings = {**CLEANER, "log_cleanup_interval": 0.5}
    broker = broker_factory(settings=settings, env={"CURSUS_STORAGE_FAULTS": f"cleaner_crash_at={point}"}).start()
    acked: dict[str, int] = {}
    attempted: dict[str, int] = {}
    try:
        with connect(broker) as conn:
            members = setup(conn)
            for n in range(400):
                group = GROUPS[n % len(GROUPS)]
                attempted[group] = n
                commit(conn, "orders", group, *members[group], n)
                acked[group] = n
    except (OSError, EOFError, ConnectionError):
        pass  # the cleaner killed the broker mid-run: the last commit's outcome is unknown
    assert broker.wait_exit(30) == -9  # the cleaner killed the broker at the armed point
    broker.env = {}
    broker.start()
    code, body = broker.http_get("/ready")
    assert code == 200, body
    with connect(broker) as conn:
        fetched = fetch_all(conn, "orders")
    for group in GROUPS:
        got = int(fetched[(group, 0)])
        assert got in {acked.get(group, 0), attempted.get(group, 0)}, (group, got, acked, attempted)
        assert [int(fetched[(group, p)]) - got for p in range(PARTITIONS)] == list(range(PARTITIONS))
    expected = ("discarding an uncommitted cleaned copy" if point == "after_cleaned_written"
                else "completing an interrupted cleaner swap")
    assert expected in broker.output()
    data = broker.log_dir / "topics" / OFFSETS_TOPIC / "0"
    assert not [p.name for p in data.iterdir() if p.name.endswith((".swap", ".cleaned"))]


def test_expired_group_tombstone_is_cleaned_and_the_group_stays_deleted(broker_factory):
    broker = broker_factory(settings={**CLEANER, "log_cleaner_delete_retention_ms": 1000}).start()
    directory = broker.log_dir / "topics" / OFFSETS_TOPIC / "0"

    def tombstones_in_log() -> int:
        return sum(p.read_bytes().count(b'"type":"group_tombstone"') for p in directory.glob("*.log"))

    with connect(broker) as conn:
        members = setup(conn)
        for p in range(PARTITIONS):  # room for the commits below: how many it takes depends on the machine's pace
            publish_batch(conn, "orders", p, [b"x"] * 9300)
        member, generation = join(conn, "doomed", "gone")
        ok_fields(conn.command(f"COMMIT_OFFSET topic=doomed partition=0 group=gone offset=7 member={member} "
                               f"generation={generation}"))
        ok_fields(conn.command(f"LEAVE_GROUP topic=doomed group=gone member={member}"))
        assert ok_fields(conn.command("DELETE topic=doomed"))["deleted"] == "true"
        assert tombstones_in_log() == 1
        n = 0
        deadline = time.monotonic() + 60
        while tombstones_in_log():  # keep writing: the tombstone's segment closes, expires and is cleaned
            assert time.monotonic() < deadline, "the expired tombstone was never cleaned"
            for _ in range(20):
                group = GROUPS[n % len(GROUPS)]
                commit(conn, "orders", group, *members[group], n)
                n += 1
        before = fetch_all(conn, "orders")
    broker.kill()
    broker.start()
    with connect(broker) as conn:
        assert fetch_all(conn, "orders") == before
        assert ok_fields(conn.command("LIST_GROUPS"))["groups"] == ",".join(sorted(GROUPS))
        assert error_of(conn.command("GROUP_STATUS group=gone")).code == "group_not_found"
        create_topic(conn, "doomed", partitions=1)
        # nothing of the old incarnation is left: the name starts afresh, without old offsets
        assert ok_fields(conn.command("REGISTER_GROUP group=gone topic=doomed"))["epoch"] == "1"
        assert ok_fields(conn.command("FETCH_OFFSET topic=doomed partition=0 group=gone"))["offset"] == "0"


def test_a_log_replay_refused_is_not_cleaned(broker_factory):
    """A ``__consumer_offsets`` record replay refuses keeps the broker not ready, and the cleaner leaves the
    log as it is (evidence), though it has dirty closed segments."""
    from cursus.broker.group_log import _chunk
    from cursus.coordinator.offsets import group_key
    from cursus.storage import LogConfig, PartitionLog

    broker = broker_factory(settings={**CLEANER, "log_cleanup_interval": 3600}).start()
    with connect(broker) as conn:
        members = setup(conn)
        for n in range(150):
            group = GROUPS[n % len(GROUPS)]
            commit(conn, "orders", group, *members[group], n)
    assert broker.terminate() == 0
    directory = broker.log_dir / "topics" / OFFSETS_TOPIC / "0"
    plog = PartitionLog.open(directory, LogConfig(), clean_shutdown=True)
    assert len(plog.segments_info()) > 3
    plog.append_chunk(plog.log_end_offset, 1, _chunk(0, plog.log_end_offset, [(group_key("billing"), b"{}")], 0))
    plog.flush()
    plog.close()
    before = {p.name: p.stat().st_size for p in directory.glob("*.log")}
    broker.settings["log_cleanup_interval"] = 0.1
    broker.start()
    code, _ = broker.http_get("/ready")
    assert code == 503
    time.sleep(1.0)  # an observation window of ten cleaner intervals: nothing may be cleaned
    assert f"cleaned {OFFSETS_TOPIC}/0" not in broker.output()
    assert {p.name: p.stat().st_size for p in directory.glob("*.log")} == before
