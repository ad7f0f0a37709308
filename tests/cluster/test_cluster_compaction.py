"""Log compaction in a three-broker cluster: each replica cleans its own log, only below the committed HWM and
only while every replica is in the ISR (spec "ALTER_TOPIC_CONFIG"); a paused follower closes the gate."""

from __future__ import annotations

import json
import re
import shutil
import time

from cursus.client.connection import Connection
from tests.cluster.clustersupport import Cluster, wait_for
from tests.cluster.replsupport import leader_proc, module_cluster, read_partition, wait_isr
from tests.integration.helpers import consume, consume_all, create_topic, ok_fields, publish_batch

CLEANER = {"log_segment_bytes": 4096, "log_cleanup_interval": 0.1, "log_min_cleanable_dirty_ratio": 0.01,
           "log_index_interval_bytes": 256, "log_retention_check_interval_ms": 200}
KEYS = [f"k{n}" for n in range(8)]


cluster = module_cluster("compaction", **CLEANER)


def _publish(c: Connection, topic: str, start: int, count: int, acks: str) -> dict[str, bytes]:
    latest = {}
    for first in range(start, start + count, 20):
        keys = [KEYS[n % len(KEYS)] for n in range(first, first + 20)]
        values = [f"{k}:{first + i}:".encode() + b"x" * 60 for i, k in enumerate(keys)]
        frame = publish_batch(c, topic, 0, values, keys=keys, acks=acks)
        assert frame.status.name == "OK", frame
        latest.update(zip(keys, values, strict=True))
    return latest


def _cleaned_ends(broker, topic: str) -> list[int]:
    return [int(m) for m in re.findall(rf"cleaned {re.escape(topic)}/0 below offset (\d+)", broker.output())]


def _offsets(broker, topic: str) -> dict[str, int]:
    """Partition 0's LIST_OFFSETS answer of ``broker``: ``earliest``, ``latest``, ``leo``, ``hwm``."""
    with Connection(*broker.address, timeout_s=10) as c:
        text = ok_fields(c.command(f"LIST_OFFSETS topic={topic} partition=0"))["offsets"]
    return {k: int(v) for k, _, v in (part.partition("=") for part in text.split(":")[1:])}


def _hwm(broker, topic: str) -> int:
    """The HWM ``broker`` answers LIST_OFFSETS with (a cluster leader's is the committed one)."""
    return _offsets(broker, topic)["hwm"]


def _topic_with_records(cluster: Cluster, topic: str, count: int, **fields: str) -> tuple:
    """Create a one-partition topic of replication factor 3 with ``fields``, wait for its full ISR and
    publish ``count`` records (acks=all) to its leader; ``(leader, {key: latest value})``."""
    with Connection(*cluster.brokers[0].address, timeout_s=10) as c:
        create_topic(c, topic, 1, replication_factor="3", **fields)
    wait_isr(cluster, topic, 3)
    leader = leader_proc(cluster, topic)
    with Connection(*leader.address, timeout_s=10) as c:
        # the ISR is metadata; the leader opens its replica a moment later (leader_not_available until then)
        wait_for(lambda: c.command(f"LIST_OFFSETS topic={topic} partition=0").status.name == "OK", 20,
                 "the leader's replica ready")
        return leader, _publish(c, topic, 0, count, acks="all")


def _rebuild_a_follower_from_an_empty_disk(cluster: Cluster, topic: str, leader):
    """kill -9 a follower of ``topic``, wipe the topic's folder, restart it, and wait until it is back in
    the ISR; the follower (a :class:`BrokerProcess`).

    Both ISR waits ask the leader: a restarted broker's own CLUSTER_STATUS trails the metadata for a
    while (it may still show the ISR from before the kill). And the rejoin is waited for only after the
    leader shrank the dead follower out of the ISR: a restart within ``replica_lag_time_max_ms`` would
    otherwise find the ISR of 3 from before the kill, while the follower had fetched nothing yet. An ISR
    of 3 after the shrink is an expansion, which the leader proposes only once the follower fetched up to
    the committed HWM."""
    victim = next(b for b in cluster.brokers if b is not leader)
    victim.kill()
    wait_isr(cluster, topic, 2, via=leader, timeout=30)
    shutil.rmtree(victim.log_dir / "topics" / topic)
    victim.start(timeout_s=60)
    wait_isr(cluster, topic, 3, via=leader, timeout=30)
    return victim


def test_replicas_clean_only_below_the_committed_hwm_with_a_full_isr(cluster: Cluster) -> None:
    topic = "compacted-cluster"
    leader, _ = _topic_with_records(cluster, topic, 0, cleanup_policy="compact")
    follower = next(b for b in cluster.brokers if b is not leader)
    follower.pause()  # the ISR shrinks: no replica may clean
    try:
        with Connection(*leader.address, timeout_s=10) as c:
            latest = _publish(c, topic, 0, 300, acks="1")
        wait_isr(cluster, topic, 2, via=leader)
        time.sleep(1.0)  # an observation window of ten cleaner intervals: nothing may be cleaned
        assert all(not _cleaned_ends(b, topic) for b in cluster.brokers if b is not follower)
    finally:
        follower.resume()
    wait_isr(cluster, topic, 3, timeout=30)
    with Connection(*leader.address, timeout_s=10) as c:
        latest.update(_publish(c, topic, 300, 40, acks="all"))
    # every replica cleans its own log, below the committed HWM it knew
    for broker in cluster.brokers:
        wait_for(lambda b=broker: _cleaned_ends(b, topic), 30, f"{broker.log_dir.name} cleans")
    committed = _hwm(leader, topic)  # a cluster leader's HWM is the committed one
    assert committed == 340
    for broker in cluster.brokers:
        assert all(end <= committed for end in _cleaned_ends(broker, topic))
    records = read_partition(cluster, topic)
    offsets = [r.offset for r in records]
    assert offsets == sorted(set(offsets)) and len(records) < 340
    assert {r.key: r.payload for r in records} == latest


def _elect(cluster: Cluster, topic: str, broker, committed: int) -> None:
    """Make ``broker`` the leader, wait until every broker's view says so, and until it serves up to the
    ``committed`` HWM (a new leader makes the committed HWM visible once its preparation on the writer
    thread is done)."""
    with Connection(*broker.address, timeout_s=10) as c:
        wait_for(lambda: c.command(f"ELECT_LEADER topic={topic} partition=0 broker={broker.log_dir.name}"
                                   ).status.name == "OK", 20, f"{broker.log_dir.name} elected")
    wait_for(lambda: all(leader_proc(cluster, topic, via=b) is broker for b in cluster.brokers), 10,
             f"{broker.log_dir.name} leads")
    wait_for(lambda: _hwm(broker, topic) >= committed, 10, f"{broker.log_dir.name} serves up to {committed}")


def test_a_follower_rebuilt_from_an_empty_disk_copies_the_leaders_cleaned_log_gaps_included(cluster: Cluster) -> None:
    """A follower whose storage of a compacted topic is lost (kill -9, folder wiped) fetches from offset 0 a
    log the leader's cleaner left with offset gaps: it stores the leader's chunks as they are (gaps
    included), rejoins the ISR, and serves the same records once it leads (issue 18)."""
    topic = "compacted-rebuilt"
    leader, latest = _topic_with_records(cluster, topic, 400, cleanup_policy="compact")
    wait_for(lambda: _cleaned_ends(leader, topic), 30, "the leader cleans")
    before = read_partition(cluster, topic)
    assert len(before) < 400 and [r.offset for r in before] != list(range(len(before)))  # gaps
    # it fetches everything back, gaps included, and rejoins
    victim = _rebuild_a_follower_from_an_empty_disk(cluster, topic, leader)
    with Connection(*leader.address, timeout_s=10) as c:
        latest.update(_publish(c, topic, 400, 20, acks="all"))
    wait_isr(cluster, topic, 3, via=leader, timeout=30)
    _elect(cluster, topic, victim, 420)
    after = read_partition(cluster, topic)
    written = {r.offset: (r.key, r.payload) for r in before}
    # what it serves is the leader's records at the leader's offsets (its own cleaner may have gone further)
    assert all(written[r.offset] == (r.key, r.payload) for r in after if r.offset in written)
    assert {r.key: r.payload for r in after} == latest
    offsets = [r.offset for r in after]
    assert offsets == sorted(set(offsets))
    assert "stopped replicating" not in victim.output()


def _log_start(broker, topic: str) -> int:
    with Connection(*broker.address, timeout_s=10) as c:
        doc = json.loads(c.command(f"DESCRIBE topic={topic}").payload)
    return int(doc["partitions"][0]["log_start_offset"])


_RESTARTED = r"{topic}/0: the log of leader \S+ starts at (\d+), above our log end 0: restarting our log there"


def test_a_follower_rebuilt_from_an_empty_disk_restarts_its_log_at_the_leaders_log_start(cluster: Cluster) -> None:
    """Retention moved the leader's log start past 0; a follower whose storage is lost (kill -9, folder
    wiped) fetches from 0 and gets OFFSET_OUT_OF_RANGE: it starts its log empty at the leader's log start
    (Kafka's follower handling), copies the rest, rejoins the ISR and serves the same records once it leads."""
    topic = "retained-rebuilt"
    leader, _ = _topic_with_records(cluster, topic, 400, retention_bytes="8192")
    start = wait_for(lambda: _log_start(leader, topic), 30, "retention deletes the oldest segments")
    victim = _rebuild_a_follower_from_an_empty_disk(cluster, topic, leader)
    # Its rejoin needed a fetch up to the committed HWM, so it restarted its log before: at the log start
    # the leader answered (retention had long converged: nothing was written since the last pass).
    restarts = [int(m) for m in re.findall(_RESTARTED.format(topic=re.escape(topic)), victim.output())]
    leader_start = _log_start(leader, topic)
    assert restarts == [leader_start] and leader_start >= start
    with Connection(*leader.address, timeout_s=10) as c:
        before = consume_all(c, topic, 0, leader_start)
    _elect(cluster, topic, victim, 400)
    assert _log_start(victim, topic) == leader_start  # its own log starts where the leader's did
    with Connection(*victim.address, timeout_s=10) as c:
        after = consume_all(c, topic, 0, leader_start)
    assert [(r.offset, r.payload) for r in after] == [(r.offset, r.payload) for r in before]
    assert [r.offset for r in after] == list(range(leader_start, 400))


def test_group_offsets_survive_a_cleaner_pass_and_a_leader_kill(cluster: Cluster) -> None:
    """In a cluster the group records live in the Raft metadata log (no ``__consumer_offsets``); a committed
    offset into a range the cleaner rewrote (now a gap) survives the pass and a kill -9 of the partition
    leader, and the group resumes at or after it with the latest value of every key (each replica cleans its
    own log, so the new leader may have removed more than the old one had)."""
    from tests.cluster.test_cluster_groups import RoutingConnection

    topic = "compacted-grouped"
    committed = 101  # inside the cleaned range: offset 101 itself is gone (key k5 is written again later)
    leader, latest = _topic_with_records(cluster, topic, 300, cleanup_policy="compact")
    # A first pass may end below the committed offset (the cleaner runs while the records arrive); offset 101
    # is gone once a pass ends above the next write of its key (eight keys in turn: offset 109).
    superseded_by = committed + len(KEYS)
    for broker in cluster.brokers:
        wait_for(lambda b=broker: max(_cleaned_ends(b, topic), default=0) > superseded_by, 30,
                 f"{broker.log_dir.name} cleans past offset {superseded_by}")
    routed = RoutingConnection([b.address for b in cluster.brokers])
    try:
        joined = ok_fields(routed.command(f"JOIN_GROUP topic={topic} group=cg member=m"))
        frame = routed.command(f"COMMIT_OFFSET topic={topic} partition=0 group=cg offset={committed} "
                               f"member={joined['member']} generation={joined['generation']}")
        assert frame.status.name == "OK", frame
        assert committed not in [r.offset for r in read_partition(cluster, topic)]
        leader.kill()
        try:
            wait_for(lambda: (p := leader_proc(cluster, topic, via=next(b for b in cluster.brokers
                                                                         if b is not leader)))
                     and p is not leader, 30, "a new leader")
            fetched = wait_for(lambda: ok_fields(routed.command(f"FETCH_OFFSET topic={topic} partition=0 group=cg")),
                               20, "FETCH_OFFSET after the kill")
            assert fetched == {"offset": str(committed)}
            new_leader = leader_proc(cluster, topic, via=next(b for b in cluster.brokers if b is not leader))
            with Connection(*new_leader.address, timeout_s=10) as c:
                records = consume(c, topic, 0, 0, group="cg")
                assert records and records[0].offset > committed
                while batch := consume(c, topic, 0, records[-1].offset + 1):
                    records.extend(batch)
            assert {r.key: r.payload for r in records} == latest
        finally:
            leader.start(timeout_s=60)
        wait_isr(cluster, topic, 3, timeout=30)
        assert ok_fields(routed.command(f"FETCH_OFFSET topic={topic} partition=0 group=cg")) == \
            {"offset": str(committed)}
    finally:
        routed.close()


def _committed_values(broker, topic: str) -> dict[str, bytes] | None:
    """Key -> latest value of ``topic``-0 read with read_committed from ``broker`` (its leader), None while
    that leader serves nothing yet (its transaction index is being rebuilt from its log)."""
    from cursus.wire import TXN_CONTROL_MARKER_PAYLOAD

    out: list = []
    with Connection(*broker.address, timeout_s=10) as c:
        while batch := consume(c, topic, 0, out[-1].offset + 1 if out else 0, isolation="read_committed"):
            out.extend(batch)
    values = {r.key: r.payload for r in out if r.payload != TXN_CONTROL_MARKER_PAYLOAD}
    return values or None


def test_a_follower_never_cleans_a_transactional_partition_without_its_transaction_state(cluster: Cluster) -> None:
    """Finding L (review): a cluster follower keeps no transaction index (only a leader does), so its
    cleaner knew neither the LSO nor the aborted ranges: an aborted (or still open) transactional record
    superseded the committed record of its key on the follower, and once that follower led, the key's
    committed value was gone. Now a replica of a partition that ever took transactional records cleans
    only with its index (a leader's, rebuilt from its log): the follower waits, the new leader keeps ``t``."""
    from tests.cluster.test_cluster_groups import RoutingConnection
    from tests.integration.txnsupport import Session

    topic = "compacted-txn"
    leader, _ = _topic_with_records(cluster, topic, 0, cleanup_policy="compact")
    routed = RoutingConnection([b.address for b in cluster.brokers])
    try:
        s = Session(routed, "cleaner-tx")  # type: ignore[arg-type]
        s.init()
        s.begin()
        s.publish(topic, "v1", partition=0, key="t")
        assert s.end("commit")["state"] == "committed"
        s.init()  # a new epoch per transaction (as the raw-command sessions of the transaction tests do)
        s.begin()
        s.publish(topic, "v2", partition=0, key="t")  # offset 2: aborted below
        with Connection(*leader.address, timeout_s=10) as c:
            latest = _publish(c, topic, 0, 200, acks="all")  # closed segments above the open transaction
        assert s.end("abort")["state"] == "aborted"
    finally:
        routed.close()
    # the leader cleans with its index: past the aborted record (dropped), keeping v1 (offset 0)
    wait_for(lambda: max(_cleaned_ends(leader, topic), default=0) > 3, 30, "the leader cleans past offset 3")
    follower = next(b for b in cluster.brokers if b is not leader)
    time.sleep(1.0)  # an observation window of ten cleaner intervals for the followers' cleaners
    _elect(cluster, topic, follower, 204)
    values = wait_for(lambda: _committed_values(follower, topic), 30, "read_committed on the new leader")
    assert values == {**latest, "t": b"v1"}
