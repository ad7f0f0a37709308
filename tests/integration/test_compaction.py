"""Log compaction on a real broker process: policy acceptance, the latest value per key after cleaning with
offsets unchanged, reads across cleaned ranges, tombstone expiry, read_committed with aborted records, and
kill -9 at every point of a segment swap followed by a restart (old or new segment, never neither)."""

from __future__ import annotations

import time

import pytest

from tests.integration.conftest import connect
from tests.integration.helpers import consume_all as _consume_all
from tests.integration.helpers import create_topic, error_of, ok_fields, publish_batch, wait_for
from tests.integration.txnsupport import Session, read_all

KEYS = [f"k{n}" for n in range(8)]
CLEANER = {"log_segment_bytes": 4096, "log_cleanup_interval": 0.1, "log_min_cleanable_dirty_ratio": 0.01,
           "log_cleaner_delete_retention_ms": 1500, "log_index_interval_bytes": 256}


def consume_all(conn, topic: str) -> list:
    return _consume_all(conn, topic, 0)


def publish_rounds(conn, topic: str, start: int, count: int, keys: list[str] = KEYS) -> dict[str, bytes]:
    """Publish ``count`` records from offset ``start`` (value ``<key>:<offset>``, padded); the latest per key."""
    latest: dict[str, bytes] = {}
    for first in range(start, start + count, 20):
        batch_keys = [keys[n % len(keys)] for n in range(first, min(first + 20, start + count))]
        values = [f"{k}:{first + i}:".encode() + b"x" * 60 for i, k in enumerate(batch_keys)]
        publish_batch(conn, topic, 0, values, keys=batch_keys)
        latest.update(zip(batch_keys, values, strict=True))
    return latest


def check_offsets(records: list) -> None:
    """Offsets strictly increase and every record still has the offset it was written at."""
    offsets = [r.offset for r in records]
    assert offsets == sorted(set(offsets))
    for r in records:
        if r.payload:
            assert int(r.payload.split(b":")[1]) == r.offset, r


def latest_of(records: list) -> dict[str, bytes]:
    return {r.key: r.payload for r in records}


def test_compaction_policy_acceptance(shared_broker, topic_name):
    with connect(shared_broker) as conn:
        assert create_topic(conn, topic_name, cleanup_policy="compact")["cleanup_policy"] == "compact"
        assert create_topic(conn, topic_name, cleanup_policy="delete,compact")["cleanup_policy"] == "delete,compact"
        es = f"{topic_name}-es"
        assert error_of(conn.command(f"CREATE topic={es} event_sourcing=true cleanup_policy=compact")).code == \
            "invalid_topic_policy"
        create_topic(conn, es, event_sourcing="true")
        for command in (f"CREATE topic={es} cleanup_policy=compact",
                        f"CREATE topic={es} event_sourcing=false cleanup_policy=delete,compact"):
            assert error_of(conn.command(command)).code == "invalid_topic_policy"


def test_cleaner_keeps_latest_per_key_and_expires_tombstones(broker_factory, topic_name):
    broker = broker_factory(settings=CLEANER).start()
    with connect(broker) as conn:
        create_topic(conn, topic_name, cleanup_policy="compact")
        latest = publish_rounds(conn, topic_name, 0, 300)
        publish_batch(conn, topic_name, 0, [b""], keys=["k3"])  # a tombstone at offset 300
        latest["k3"] = b""
        latest.update(publish_rounds(conn, topic_name, 301, 160, keys=[k for k in KEYS if k != "k3"]))
        wait_for(lambda: f"cleaned {topic_name}/0" in broker.output(), 20, "a cleaner pass")
        records = consume_all(conn, topic_name)
        check_offsets(records)
        assert len(records) < 461 and records[-1].offset == 460
        assert latest_of(records) == latest  # the tombstone is still there: inside its retention window
        # a record at an offset inside a cleaned gap: the read starts at the next stored one
        gap = next(o for o in range(461) if o not in {r.offset for r in records})
        after_gap = _consume_all(conn, topic_name, 0, gap)
        assert after_gap and after_gap[0].offset > gap and after_gap[-1].offset == 460
        check_offsets(after_gap)  # (a later pass may have removed more meanwhile, never added)
        assert {r.offset for r in after_gap} <= {r.offset for r in records if r.offset > gap}
        # once the window passed, the next pass (new closed segments make the log dirty again) drops it
        time.sleep(1.6)
        latest.update(publish_rounds(conn, topic_name, 461, 160, keys=[k for k in KEYS if k != "k3"]))

        def tombstone_gone() -> bool:
            return "k3" not in latest_of(consume_all(conn, topic_name))
        wait_for(tombstone_gone, 20, "the expired tombstone to be cleaned")
        records = consume_all(conn, topic_name)
        check_offsets(records)
        del latest["k3"]
        assert latest_of(records) == latest
    # a clean restart serves the same latest values (a later pass may have removed more superseded records)
    broker.restart(kill=False)
    with connect(broker) as conn:
        again = consume_all(conn, topic_name)
        check_offsets(again)
        assert latest_of(again) == latest and {r.offset for r in again} <= {r.offset for r in records}


def test_read_committed_after_cleaning_aborted_records(broker_factory, topic_name):
    broker = broker_factory(settings=CLEANER).start()
    with connect(broker) as conn:
        create_topic(conn, topic_name, cleanup_policy="compact")
        latest = publish_rounds(conn, topic_name, 0, 40)
        session = Session(conn, "tx-compact")
        session.init()
        session.begin()
        for n in range(5):
            session.publish(topic_name, f"aborted-{n}", partition=0, key="k1")
        session.end("abort")
        other = Session(conn, "tx-compact-2")
        other.init()
        other.begin()
        other.publish(topic_name, "committed", partition=0, key="k2")
        other.end("commit")
        offset = consume_all(conn, topic_name)[-1].offset + 1
        latest.update(publish_rounds(conn, topic_name, offset, 200, keys=[k for k in KEYS if k not in ("k1", "k2")]))
        committed = read_all(conn, topic_name, 0)
        values = latest_of(committed)
        assert values["k2"] == b"committed" and values["k1"] == latest["k1"]

        def aborted_gone() -> bool:
            raw = read_all(conn, topic_name, 0, isolation="read_uncommitted")
            return not any(r.payload.startswith(b"aborted-") for r in raw)
        wait_for(aborted_gone, 20, "the cleaner to drop the aborted records")
        committed = read_all(conn, topic_name, 0)
        check_offsets([r for r in committed if b":" in r.payload])
        assert latest_of(committed) == values  # read_committed sees the same values after cleaning
    broker.restart()  # the transaction index is rebuilt from the cleaned log
    with connect(broker) as conn:
        assert latest_of(read_all(conn, topic_name, 0)) == values


@pytest.mark.parametrize("point", ["after_cleaned_written", "after_swap_marker", "after_rename", "after_index"])
def test_kill_mid_clean_leaves_old_or_new_segment(broker_factory, topic_name, point):
    settings = {**CLEANER, "log_cleanup_interval": 1.0}  # all is published before the first check
    broker = broker_factory(settings=settings, env={"CURSUS_STORAGE_FAULTS": f"cleaner_crash_at={point}"}).start()
    with connect(broker) as conn:
        create_topic(conn, topic_name, cleanup_policy="compact")
        latest = publish_rounds(conn, topic_name, 0, 300)
    assert broker.wait_exit(20) == -9  # the cleaner killed the broker at the armed point
    broker.env = {}
    broker.start()
    with connect(broker) as conn:
        records = consume_all(conn, topic_name)
        check_offsets(records)
        assert latest_of(records) == latest and records[-1].offset == 299
    expected = ("discarding an uncommitted cleaned copy" if point == "after_cleaned_written"
                else "completing an interrupted cleaner swap")
    assert expected in broker.output()
    data = broker.log_dir / "topics" / topic_name / "0"
    assert not [p.name for p in data.iterdir() if p.name.endswith((".swap", ".cleaned"))]


def _earliest(conn, topic: str) -> int:
    text = ok_fields(conn.command(f"LIST_OFFSETS topic={topic} partition=0"))["offsets"]
    return {k: int(v) for k, _, v in (part.partition("=") for part in text.split(":")[1:])}["earliest"]


def test_retention_applies_to_delete_compact_and_never_to_compact(broker_factory, topic_name):
    settings = {**CLEANER, "log_retention_bytes": 12_000, "log_retention_check_interval_ms": 100}
    broker = broker_factory(settings=settings).start()
    both, only = f"{topic_name}-both", f"{topic_name}-only"
    with connect(broker) as conn:
        create_topic(conn, both, cleanup_policy="delete,compact")
        create_topic(conn, only, cleanup_policy="compact")
        latest = {}
        for topic in (both, only):
            latest[topic] = publish_rounds(conn, topic, 0, 400)
        wait_for(lambda: _earliest(conn, both) > 0, 20, "retention on the delete,compact topic")
        wait_for(lambda: f"cleaned {only}/0" in broker.output(), 20, "a cleaner pass on the compact topic")
        assert _earliest(conn, only) == 0  # compact alone: retention never deletes its segments
        records = consume_all(conn, only)
        check_offsets(records)
        assert latest_of(records) == latest[only]
        start = _earliest(conn, both)
        kept = _consume_all(conn, both, 0, start)
        check_offsets(kept)
        assert kept[-1].offset == 399 and all(latest[both][r.key] == r.payload for r in kept if r.offset >= 392)


def test_a_segment_active_during_a_pass_is_cleaned_once_it_closes(broker_factory, topic_name):
    """A pass covers only closed segments, but it used to record the whole cleanable end as clean: records
    below the HWM in the then active segment were never counted dirty again, so its superseded records
    (and expired tombstones) stayed on an idle partition. Here offsets [20, 24) hold four values of ``k0``
    in the active segment during the first pass; once a write closes that segment, a second pass cleans it."""
    broker = broker_factory(settings=CLEANER).start()
    with connect(broker) as conn:
        create_topic(conn, topic_name, cleanup_policy="compact")
        keys = [f"a{n % 10}" for n in range(20)]  # [0, 20): one segment, half of it superseded
        publish_batch(conn, topic_name, 0, [f"{k}:{n}:".encode() + b"v" * 140 for n, k in enumerate(keys)],
                      keys=keys)
        publish_batch(conn, topic_name, 0, [f"k0:{n}".encode() for n in range(20, 24)], keys=["k0"] * 4)  # rolls
        wait_for(lambda: f"cleaned {topic_name}/0 below offset 24" in broker.output(), 20,
                 "a pass while [20, 24) is the active segment")
        later = [f"c{n}" for n in range(20)]  # [24, 44): closes the segment of [20, 24)
        publish_batch(conn, topic_name, 0, [f"{k}:".encode() + b"u" * 150 for k in later], keys=later)
        wait_for(lambda: f"cleaned {topic_name}/0 below offset 44" in broker.output(), 20,
                 "a pass over the closed segment of [20, 24)")
        records = consume_all(conn, topic_name)
        assert [r.offset for r in records if r.key == "k0"] == [23]
