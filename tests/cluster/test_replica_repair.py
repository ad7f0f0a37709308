"""A corrupted replica repairs itself from the leader (issue 14, finding A), on three real broker processes.

* A follower killed with kill -9 whose segment gets a flipped byte *below its recovery point* (plain recovery
  cannot cut a torn tail there: it refuses to open) restarts and becomes ready: the damaged bytes are in a
  quarantine folder, the log is cut to its last valid chunk, it re-fetches the rest from the leader, rejoins
  the ISR, and its log ends byte-identical to the leader's; elected, it serves every acknowledged record and
  never the flipped bytes.
* Fail closed: when the repaired replica is the only in-sync candidate left (the leader dead, the third
  replica out of the ISR), it is elected but never serves (``storage_unavailable ... below the committed
  HWM``), and the out-of-sync replica is never elected.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from cursus.client.connection import Connection
from cursus.storage.chunk import HEADER_SIZE
from tests.cluster.clustersupport import Cluster, wait_for
from tests.cluster.replsupport import (
    AcksAllWriter,
    check_history,
    leader_proc,
    module_cluster,
    partition_state,
    read_partition,
    restore_brokers,
    wait_isr,
)
from tests.integration.helpers import consume, create_topic, error_of, publish_batch

cluster = module_cluster("replica-repair", log_recovery_point_interval_ms=100)


@pytest.fixture(autouse=True)
def all_brokers_running(cluster: Cluster):
    yield
    restore_brokers(cluster)


def part_dir(broker, topic: str) -> Path:
    return broker.log_dir / "topics" / topic / "0"


def segment(broker, topic: str) -> Path:
    (only,) = sorted(part_dir(broker, topic).glob("*.log"))  # default segments: one per partition here
    return only


def chunks(data: bytes) -> list[tuple[int, int, int]]:
    """(position, base offset, size) of every chunk of a segment file."""
    found, position = [], 0
    while position + HEADER_SIZE <= len(data):
        base = int.from_bytes(data[position + 4:position + 12], "big")
        size = HEADER_SIZE + int.from_bytes(data[position + 16:position + 20], "big")
        found.append((position, base, size))
        position += size
    return found


def recovery_point(broker, topic: str) -> int:
    try:
        return json.loads((part_dir(broker, topic) / "checkpoints.json").read_text())["recovery_point"]
    except (OSError, ValueError):
        return -1


def write_acked(cluster: Cluster, topic: str, count: int) -> list:
    writers = [AcksAllWriter(cluster, topic, f"{topic}-w{i}") for i in range(2)]
    for w in writers:
        w.start()
    wait_for(lambda: all(len(w.acks) >= count for w in writers), 60, "writers acknowledged")
    for w in writers:
        w.stop()
    return [a for w in writers for a in w.acks]


def flip_below_recovery_point(broker, topic: str, acked: int) -> tuple[int, int]:
    """Flip one byte in the body of a chunk in the middle of the log (every offset of it acknowledged and
    below the replica's recovery point). Returns (byte position of the chunk, its base offset)."""
    path = segment(broker, topic)
    data = bytearray(path.read_bytes())
    found = chunks(bytes(data))
    position, base, size = next(c for c in found if c[1] >= acked // 2)
    assert base < recovery_point(broker, topic)
    data[position + HEADER_SIZE + (size - HEADER_SIZE) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    return position, base


def quarantine_reports(broker, topic: str) -> list[dict]:
    root = part_dir(broker, topic) / "quarantine"
    return [json.loads((d / "repair.json").read_text()) for d in sorted(root.iterdir())] if root.exists() else []


def test_a_corrupted_follower_repairs_from_the_leader_and_rejoins(cluster: Cluster) -> None:
    topic = "repair-follower"
    with Connection(*cluster.brokers[0].address, timeout_s=10) as c:
        create_topic(c, topic, 1, replication_factor="3")
    row = wait_isr(cluster, topic, 3)
    acks = write_acked(cluster, topic, 20)
    acked = sum(len(a.payloads) for a in acks)
    leader = cluster.by_id(row["leader"])
    follower = next(b for b in cluster.brokers if b is not leader)
    wait_for(lambda: recovery_point(follower, topic) >= acked, 20, "the follower checkpointed its records")
    follower.kill()
    original = leader_bytes = segment(leader, topic).read_bytes()
    position, base = flip_below_recovery_point(follower, topic, acked)
    flipped = segment(follower, topic).read_bytes()
    assert flipped != original[:len(flipped)]
    follower.start(timeout_s=60)  # ready: repaired instead of refusing to open

    (report,) = quarantine_reports(follower, topic)
    assert report["position"] == position and report["offset"] == base and "CRC" in report["reason"]
    quarantined = part_dir(follower, topic) / "quarantine"
    (folder,) = quarantined.iterdir()
    assert (folder / segment(follower, topic).name).read_bytes() == flipped  # evidence kept as found
    output = follower.output()
    assert "REPAIRED replica" in output and segment(follower, topic).name in output

    wait_isr(cluster, topic, 3, timeout=30)  # re-fetched up to the leader and rejoined the ISR
    leader_bytes = segment(leader, topic).read_bytes()
    wait_for(lambda: segment(follower, topic).read_bytes() == leader_bytes, 20,
             "the repaired replica is byte-identical to the leader")
    assert len(leader_bytes) >= len(flipped) and leader_bytes[:len(original)] == original

    # Elected, the repaired replica serves every acknowledged record, never the flipped bytes.
    with Connection(*cluster.brokers[0].address, timeout_s=10) as c:
        c.command(f"ELECT_LEADER topic={topic} partition=0 broker={follower.log_dir.name}")
    wait_for(lambda: leader_proc(cluster, topic) is follower, 20, "the repaired replica leads")
    records = wait_for(lambda: (r := read_partition(cluster, topic)) and len(r) >= acked and r, 20,
                       "the repaired replica serves everything")
    check_history(acks, records)
    payloads = {bytes(r.payload) for r in records}
    assert all(p in payloads for a in acks for p in a.payloads)


def test_a_repaired_replica_that_is_the_only_isr_candidate_fails_closed(cluster: Cluster) -> None:
    topic = "repair-fail-closed"
    with Connection(*cluster.brokers[0].address, timeout_s=10) as c:
        create_topic(c, topic, 1, replication_factor="3")
    row = wait_isr(cluster, topic, 3)
    leader = cluster.by_id(row["leader"])
    repaired, other = [b for b in cluster.brokers if b is not leader]
    other.kill()  # fenced after the session timeout: out of the ISR, which stays {leader, repaired}
    wait_for(lambda: len(partition_state(cluster, topic, via=leader)["isr"]) == 2, 30, "the ISR shrinks to 2")
    acks = write_acked(cluster, topic, 10)
    acked = sum(len(a.payloads) for a in acks)
    committed = wait_for(lambda: (h := partition_state(cluster, topic, via=leader)["committed_hwm"]) >= acked
                         and h, 10, "the committed HWM covers the acknowledged records")
    wait_for(lambda: recovery_point(repaired, topic) >= acked, 20, "the replica checkpointed its records")
    repaired.kill()
    leader.kill()
    flip_below_recovery_point(repaired, topic, acked)
    cluster.start([repaired, other])  # a Raft quorum again; the dead leader is fenced

    def elected() -> dict | None:
        state = partition_state(cluster, topic, via=repaired)
        return state if state["leader"] == repaired.log_dir.name else None

    state = wait_for(elected, 30, "the only ISR candidate is elected")
    assert other.log_dir.name not in state["isr"] and state["committed_hwm"] >= committed
    assert quarantine_reports(repaired, topic)
    with Connection(*repaired.address, timeout_s=10) as c:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # it never serves: not a write, not a read below the HWM
            frame = publish_batch(c, topic, 0, [b"never"], acks="1")
            err = error_of(frame)
            assert err.code == "storage_unavailable" and "below the committed HWM" in err.fields["reason"], err
            assert err.retryable
            try:
                got = consume(c, topic, 0, 0)
            except AssertionError as exc:  # an error answer
                assert "storage_unavailable" in str(exc), exc
            else:
                raise AssertionError(f"a fail-closed replica served {len(got)} records")
            assert partition_state(cluster, topic, via=repaired)["leader"] != other.log_dir.name
            time.sleep(0.2)
    assert "no other in-sync replica to take over" in repaired.output()


def test_a_corrupted_leader_repairs_and_never_serves_what_it_lost(cluster: Cluster) -> None:
    """The leader itself is killed and corrupted: whether it is back before or after it is fenced, it never
    serves from its cut log (it fails closed and hands over, or it follows), every acknowledged record stays
    readable, and all three replicas end byte-identical."""
    topic = "repair-leader"
    with Connection(*cluster.brokers[0].address, timeout_s=10) as c:
        create_topic(c, topic, 1, replication_factor="3")
    row = wait_isr(cluster, topic, 3)
    acks = write_acked(cluster, topic, 20)
    acked = sum(len(a.payloads) for a in acks)
    leader = cluster.by_id(row["leader"])
    wait_for(lambda: recovery_point(leader, topic) >= acked, 20, "the leader checkpointed its records")
    leader.kill()
    flip_below_recovery_point(leader, topic, acked)
    leader.start(timeout_s=60)
    assert quarantine_reports(leader, topic) and "REPAIRED replica" in leader.output()
    wait_isr(cluster, topic, 3, timeout=30)
    records = wait_for(lambda: (r := read_partition(cluster, topic)) and len(r) >= acked and r, 30,
                       "a leader serves every acknowledged record")  # a repaired leader fails closed first
    check_history(acks, records)
    files = [segment(b, topic) for b in cluster.brokers]
    wait_for(lambda: len({f.read_bytes() for f in files}) == 1, 20, "every replica byte-identical")
