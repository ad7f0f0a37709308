"""A compacted topic whose leader's log ends in a gap (issue 18): a follower rebuilt from an empty disk copies
the last stored chunk, finds no chunk between it and the leader's log end, and must still reach the
leader's LEO (the fetch reply's ``skip_to``) to rejoin the ISR of an idle topic.

How the leader's log comes to end in a gap: its first segment ends with tombstones (expired at once:
``log_cleaner_delete_retention_ms=0``), it appends one more chunk that rolls a second segment while both
followers are paused (acks=1: never committed), and cleans the first segment (the tombstones become a
gap at its end). Killed, it comes back as a follower of a new leader, truncates the uncommitted chunk
(the second segment goes, the cleaned one is last again) and is elected again."""

from __future__ import annotations

from cursus.client.connection import Connection
from tests.cluster.clustersupport import Cluster, wait_for
from tests.cluster.replsupport import leader_proc, module_cluster, partition_state, wait_isr
from tests.cluster.test_cluster_compaction import (
    _cleaned_ends,
    _elect,
    _hwm,
    _offsets,
    _rebuild_a_follower_from_an_empty_disk,
    _topic_with_records,
)
from tests.integration.helpers import consume_all, publish_batch

#: Slower failure detection than the other cluster modules: both followers stay paused (and in the ISR,
#: active) while the leader cleans, which can take seconds on a loaded machine (the pause must stay
#: below both timeouts, or the leader shrinks them out of the ISR as soon as they resume).
SETTINGS = {"log_segment_bytes": 4096, "log_cleanup_interval": 0.1, "log_min_cleanable_dirty_ratio": 0.01,
            "log_index_interval_bytes": 256, "log_cleaner_delete_retention_ms": 0,
            "replica_lag_time_max_ms": 12000, "broker_session_timeout_ms": 12000}


cluster = module_cluster("tailgap", **SETTINGS)


def _send(broker, topic: str, keys: list[str], values: list[bytes], acks: str) -> None:
    with Connection(*broker.address, timeout_s=10) as c:
        frame = publish_batch(c, topic, 0, values, keys=keys, acks=acks)
    assert frame.status.name == "OK", frame


def test_a_rebuilt_follower_skips_a_gap_at_the_end_of_the_leaders_log(cluster: Cluster) -> None:
    topic = "compacted-tail-gap"
    first, _ = _topic_with_records(cluster, topic, 0, cleanup_policy="compact")
    followers = [b for b in cluster.brokers if b is not first]
    kept = [f"a{n}" for n in range(20)]
    values = {k: f"{k}:".encode() + b"v" * 140 for k in kept}
    _send(first, topic, kept, [values[k] for k in kept], "all")  # [0, 20): survives every cleaning
    _send(first, topic, [f"t{n}" for n in range(4)], [b""] * 4, "all")  # [20, 24): tombstones
    # the cleaner stops at the FSM's committed HWM, which Raft cannot move once both followers are paused:
    # wait until the leader's coalesced HWM commit has landed, or the cleaner is gated below 24
    wait_for(lambda: partition_state(cluster, topic, via=first)["committed_hwm"] == 24, 15,
             "the committed HWM reaches 24 before the followers pause")
    for follower in followers:
        follower.pause()
    try:
        _send(first, topic, [f"u{n}" for n in range(20)], [b"u" * 150] * 20, "1")  # [24, 44): rolls, uncommitted
        wait_for(lambda: 24 in _cleaned_ends(first, topic), 10, "the leader cleans its first segment")
        first.kill()
    finally:
        for follower in followers:
            follower.resume()
    second = wait_for(lambda: (p := leader_proc(cluster, topic, via=followers[0])) and p is not first and p,
                      45, "a new leader")
    wait_for(lambda: _hwm(second, topic) == 24, 10, "the new leader serves the committed HWM")  # [24, 44) is lost
    first.start(timeout_s=60)
    wait_isr(cluster, topic, 3, via=second, timeout=30)  # it truncated [24, 44) and caught up
    _elect(cluster, topic, first, 24)
    assert _offsets(first, topic)["leo"] == 24  # its log: [0, 20) and a gap to 24 (its cleaned segment is the last)

    # no append comes: only the leader's skip_to hint takes the follower from 20 over the gap to 24
    victim = _rebuild_a_follower_from_an_empty_disk(cluster, topic, first)
    assert partition_state(cluster, topic, via=first)["committed_hwm"] == 24
    _elect(cluster, topic, victim, 24)
    assert _offsets(victim, topic)["leo"] == 24
    with Connection(*victim.address, timeout_s=10) as c:
        records = consume_all(c, topic, 0, 0)
    assert [(r.offset, r.key, r.payload) for r in records] == [(n, k, values[k]) for n, k in enumerate(kept)]
    assert "stopped replicating" not in victim.output()
