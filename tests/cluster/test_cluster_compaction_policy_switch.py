"""A topic switched from compact back to delete (``CREATE topic= cleanup_policy=delete``, a presence-aware
patch; ALTER_TOPIC_CONFIG only sets min_in_sync_replicas) keeps the offset gaps its cleaner left (issue 18): a follower
rebuilt from an empty disk must copy them (gaps included) although the topic no longer compacts. The
permission to replicate a gap follows the leader's log (the fetch reply's ``cleaned_gaps``), not the topic's
current cleanup policy; before that the follower refused the first chunk after a gap and stopped
replicating the partition, which never got a third in-sync replica back."""

from __future__ import annotations

from cursus.client.connection import Connection
from tests.cluster.clustersupport import Cluster, wait_for
from tests.cluster.replsupport import module_cluster, read_partition, wait_isr
from tests.cluster.test_cluster_compaction import (
    CLEANER,
    _cleaned_ends,
    _elect,
    _offsets,
    _publish,
    _rebuild_a_follower_from_an_empty_disk,
    _topic_with_records,
)
from tests.integration.helpers import consume_all, ok_fields

cluster = module_cluster("policyswitch", **CLEANER)


def _policy(broker, topic: str) -> str:
    with Connection(*broker.address, timeout_s=10) as c:
        return ok_fields(c.command(f"METADATA topic={topic}"))["cleanup_policy"]


def test_a_follower_rebuilt_after_compact_was_switched_to_delete_copies_the_gaps(cluster: Cluster) -> None:
    topic = "compact-then-delete"
    leader, latest = _topic_with_records(cluster, topic, 400, cleanup_policy="compact")
    wait_for(lambda: _cleaned_ends(leader, topic), 30, "the leader cleans")
    with Connection(*leader.address, timeout_s=10) as c:
        fields = ok_fields(c.command(f"CREATE topic={topic} cleanup_policy=delete"))  # a patch of the topic
        assert fields["cleanup_policy"] == "delete"
    wait_for(lambda: all(_policy(b, topic) == "delete" for b in cluster.brokers), 10, "every broker applied delete")
    with Connection(*leader.address, timeout_s=10) as c:
        latest.update(_publish(c, topic, 400, 20, acks="all"))  # [400, 420): contiguous, after the gaps
    victim = _rebuild_a_follower_from_an_empty_disk(cluster, topic, leader)  # rejoins the ISR (fails closed before)
    wait_isr(cluster, topic, 3, via=leader, timeout=30)
    # the old leader's records now (a cleaner pass begun before the switch may have ended after it; none
    # starts since): what the rebuilt replica copied
    before = read_partition(cluster, topic)
    offsets = [r.offset for r in before]
    assert offsets != list(range(len(offsets))) and offsets[-20:] == list(range(400, 420))  # gaps below 400
    _elect(cluster, topic, victim, 420)
    assert _offsets(victim, topic)["leo"] == 420
    with Connection(*victim.address, timeout_s=10) as c:
        after = consume_all(c, topic, 0, 0)
    # the delete policy cleans no more: the rebuilt replica serves exactly the old leader's records and offsets
    assert [(r.offset, r.key, r.payload) for r in after] == [(r.offset, r.key, r.payload) for r in before]
    assert {r.key: r.payload for r in after} == latest
    assert "stopped replicating" not in victim.output()
