"""Record replication across three real broker processes (mutual TLS on the Raft and internal listeners):
acks=all under leader kill -9 and SIGSTOP, follower catch-up, min-ISR refusal, truncation of an
unacknowledged tail over a double failover, idempotent retries across failover, HWM monotonicity.

One cluster for the module; every test leaves all three brokers running."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

from cursus.wire import Batch, Command, Record, Status, encode_batch
from tests.cluster.clustersupport import Cluster, wait_for
from tests.cluster.raftsupport import closed_by_peer
from tests.cluster.replsupport import (
    AcksAllWriter,
    HwmObserver,
    check_history,
    conn,
    leader_proc,
    make_topic,
    partition_state,
    publish_ok,
    read_partition,
    restored_cluster,
    status,
    wait_isr,
)
from tests.integration.helpers import error_of, ok_fields, publish_batch

# replica lag above the broker session timeout, as with the defaults (10 s vs 3 s): a dead follower is
# fenced (out of the ISR) while it still counts as recently caught up
cluster, all_brokers_running = restored_cluster("replication", replica_lag_time_max_ms=4000)


def offsets(broker, topic: str) -> dict[str, int]:
    with conn(broker) as c:
        text = ok_fields(c.command(f"LIST_OFFSETS topic={topic} partition=0"))["offsets"]
    return {k: int(v) for k, _, v in (part.partition("=") for part in text.split(":")[1:])}


def test_acks_all_completes_on_a_full_isr_and_the_cluster_is_healthy(cluster: Cluster) -> None:
    row = make_topic(cluster, "replicated")
    assert row["isr"] == row["replicas"] and len(row["replicas"]) == 3
    leader = cluster.by_id(row["leader"])
    with conn(leader) as c:
        for i in range(20):
            publish_ok(c, "replicated", [f"r{i}".encode()])
    assert offsets(leader, "replicated")["hwm"] == 20
    # every follower holds the same bytes: elect each in turn and read everything back from it
    for target in (b for b in cluster.brokers if b is not leader):
        with conn(cluster.brokers[0]) as c:
            ok_fields(c.command(f"ELECT_LEADER topic=replicated partition=0 broker={target.log_dir.name}"))
        wait_for(lambda t=target: leader_proc(cluster, "replicated") is t, 10, "elected")
        records = wait_for(lambda: (r := read_partition(cluster, "replicated")) and len(r) == 20 and r, 10,
                           "twenty records on the new leader")
        assert [bytes(r.payload) for r in records] == [f"r{i}".encode() for i in range(20)]
    wait_for(lambda: status(cluster.brokers[1])["healthy"], 15, "a healthy cluster")
    # cursusctl asks every leader for its followers' lag, whichever broker it starts from
    non_leader = next(b for b in cluster.brokers if b is not leader_proc(cluster, "replicated"))

    def ctl_lag() -> dict | None:
        done = subprocess.run([sys.executable, "-m", "cursus.cli.ctl", "cluster-status", "--json", "--broker",
                               f"127.0.0.1:{non_leader.port}"], capture_output=True, text=True, timeout=60)
        (row,) = [p for p in json.loads(done.stdout)["partitions"] if p["key"] == "replicated-0"]
        lag = row.get("replica_lag", {})
        return lag if len(lag) == 2 and all(v["records"] == 0 for v in lag.values()) else None

    assert wait_for(ctl_lag, 20, "both followers caught up, as cursusctl shows")


def test_leader_kill_loses_no_acknowledged_record(cluster: Cluster) -> None:
    make_topic(cluster, "kill-leader")
    writers = [AcksAllWriter(cluster, "kill-leader", f"w{i}") for i in range(3)]
    observer = HwmObserver(cluster, "kill-leader")
    for thread in (*writers, observer):
        thread.start()
    wait_for(lambda: all(len(w.acks) >= 5 for w in writers), 20, "writers acknowledged")
    old = leader_proc(cluster, "kill-leader")
    old.kill()
    before = [len(w.acks) for w in writers]
    wait_for(lambda: all(len(w.acks) >= n + 5 for w, n in zip(writers, before, strict=True)), 30,
             "writers acknowledged by the new leader")
    for writer in writers:
        writer.stop()
    seen = observer.stop()
    assert leader_proc(cluster, "kill-leader") is not old
    check_history([a for w in writers for a in w.acks], read_partition(cluster, "kill-leader"))
    assert seen and seen == sorted(seen), "an HWM was observed to decrease"
    old.start(timeout_s=60)
    wait_isr(cluster, "kill-leader", 3, timeout=30)  # the old leader catches up and rejoins


def test_paused_leader_cannot_acknowledge_and_is_fenced_after_resuming(cluster: Cluster) -> None:
    row = make_topic(cluster, "paused-leader")
    old = cluster.by_id(row["leader"])
    with conn(old) as c:
        publish_ok(c, "paused-leader", [b"before"])
    stale = conn(old)  # negotiated before the pause; its next request waits in the kernel while paused
    old.pause()
    try:
        survivor = next(b for b in cluster.brokers if b is not old)
        wait_for(lambda: (r := partition_state(cluster, "paused-leader", via=survivor))["leader"]
                 and r["leader"] != old.log_dir.name and r, 20, "a new leader while the old one is paused")
        new = leader_proc(cluster, "paused-leader", via=survivor)
        with conn(new) as c:
            publish_ok(c, "paused-leader", [b"after"])
        # a request that reaches the paused (deposed) leader is answered, once it resumes, never with OK
        body = encode_batch(Batch(topic="paused-leader", partition=0, acks="all",
                                  records=[Record(topic="paused-leader", partition=0, payload=b"stale")]))
        request_id = stale.send(Command.PUBLISH, body)
        old.resume()
        reply = stale.receive(request_id, Command.PUBLISH, timeout_s=30)
        assert reply.status != Status.OK, reply.payload
    finally:
        old.resume()
        stale.close()
    wait_isr(cluster, "paused-leader", 3, timeout=30)
    values = [bytes(r.payload) for r in read_partition(cluster, "paused-leader")]
    assert values == [b"before", b"after"], values


def test_follower_restart_catches_up_and_rejoins_the_isr(cluster: Cluster) -> None:
    row = make_topic(cluster, "follower-restart")
    leader = cluster.by_id(row["leader"])
    follower = next(b for b in cluster.brokers if b.log_dir.name in row["isr"] and b is not leader)
    follower.kill()
    wait_isr(cluster, "follower-restart", 2, timeout=20, via=leader)
    with conn(leader) as c:
        for i in range(50):
            publish_ok(c, "follower-restart", [f"m{i}".encode()] * 10)
    lag = partition_state(cluster, "follower-restart", via=leader)["replica_lag"][follower.log_dir.name]
    assert lag["records"] >= 500 and lag["seconds"] > 0, lag  # only the leader knows it
    follower.start(timeout_s=60)
    wait_isr(cluster, "follower-restart", 3, timeout=30)
    with conn(cluster.brokers[0]) as c:
        ok_fields(c.command(f"ELECT_LEADER topic=follower-restart partition=0 broker={follower.log_dir.name}"))
    wait_for(lambda: leader_proc(cluster, "follower-restart") is follower, 10, "the restarted follower leads")
    assert len(read_partition(cluster, "follower-restart")) == 500


def test_a_dead_follower_of_an_idle_partition_does_not_stall_acks_all(cluster: Cluster) -> None:
    """Break-it finding: a caught-up follower killed while its partition is idle was proposed for ISR
    expansion again and again (refused: inactive), and the pending expansion pinned the HWM, so acks=all
    timed out although the ISR met the minimum. Writes in flight while it dies complete once the ISR
    drops it."""
    row = make_topic(cluster, "idle-follower")
    leader = cluster.by_id(row["leader"])
    with conn(leader) as c:
        publish_ok(c, "idle-follower", [b"warm"])
    follower = next(b for b in cluster.brokers if b is not leader)
    follower.kill()
    wait_isr(cluster, "idle-follower", 2, timeout=20, via=leader)
    # Not synchronisation: let the leader's ISR check (every 1 s) run a few times while the dead follower
    # still counts as recently caught up; it must not propose (and pin the HWM on) an inactive broker.
    time.sleep(2.5)
    with conn(leader) as c:
        started = time.monotonic()
        for i in range(5):
            publish_ok(c, "idle-follower", [f"after-{i}".encode()])
        assert time.monotonic() - started < 4.0  # well below replica_ack_timeout_ms (5 s in these tests)
    follower.start(timeout_s=60)
    wait_isr(cluster, "idle-follower", 3, timeout=30)


def test_a_consumer_follows_the_new_leader_when_its_leader_dies(cluster: Cluster) -> None:
    """Break-it finding: the SDK consumer retried the dead leader's address until its budget ran out and
    raised BrokerUnavailableError; it re-reads metadata and continues on the new leader."""
    from cursus.client.consumer import Consumer

    row = make_topic(cluster, "consume-failover")
    old = cluster.by_id(row["leader"])
    with conn(old) as c:
        publish_ok(c, "consume-failover", [f"a{i}".encode() for i in range(50)])
    bootstrap = [f"127.0.0.1:{b.port}" for b in cluster.brokers]
    got: list[bytes] = []
    with Consumer("consume-failover", bootstrap, start="earliest", wait_ms=100) as consumer:
        wait_for(lambda: got.extend(r.value for r in consumer.poll(1.0)) or len(got) >= 50, 20, "first 50")
        old.kill()
        survivor = next(b for b in cluster.brokers if b is not old)
        new = wait_for(lambda: (p := leader_proc(cluster, "consume-failover", via=survivor)) and p is not old
                       and p, 20, "a new leader")
        with conn(new) as c:
            publish_ok(c, "consume-failover", [f"b{i}".encode() for i in range(50)])
        wait_for(lambda: got.extend(r.value for r in consumer.poll(1.0)) or len(got) >= 100, 30,
                 "the rest from the new leader")
    assert got == [f"a{i}".encode() for i in range(50)] + [f"b{i}".encode() for i in range(50)]
    old.start(timeout_s=60)


def test_an_async_consumer_follows_the_new_leader_when_its_leader_dies(cluster: Cluster) -> None:
    """The asyncio twin of the test above: the failover decision lives in ConsumerCore.consume_steps, so
    AsyncConsumer re-reads metadata too instead of retrying the dead leader until its budget runs out."""
    import asyncio

    from cursus.client.consumer import AsyncConsumer

    row = make_topic(cluster, "consume-failover-async")
    old = cluster.by_id(row["leader"])
    with conn(old) as c:
        publish_ok(c, "consume-failover-async", [f"a{i}".encode() for i in range(20)])
    bootstrap = [f"127.0.0.1:{b.port}" for b in cluster.brokers]
    survivor = next(b for b in cluster.brokers if b is not old)

    async def read_until(consumer: AsyncConsumer, got: list[bytes], count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(got) < count:
            assert time.monotonic() < deadline, f"read {len(got)} of {count}"
            got.extend(r.value for r in await consumer.poll(1.0))

    async def run() -> list[bytes]:
        got: list[bytes] = []
        async with AsyncConsumer("consume-failover-async", bootstrap, start="earliest", wait_ms=100) as consumer:
            await read_until(consumer, got, 20, 20)
            old.kill()
            new = await asyncio.to_thread(
                wait_for, lambda: (p := leader_proc(cluster, "consume-failover-async", via=survivor))
                and p is not old and p, 20, "a new leader")
            with conn(new) as c:
                publish_ok(c, "consume-failover-async", [f"b{i}".encode() for i in range(20)])
            await read_until(consumer, got, 40, 30)
        return got

    assert asyncio.run(run()) == [f"a{i}".encode() for i in range(20)] + [f"b{i}".encode() for i in range(20)]
    old.start(timeout_s=60)


def test_min_isr_refuses_before_append_and_keeps_sequence_state(cluster: Cluster) -> None:
    row = make_topic(cluster, "min-isr", min_in_sync_replicas="3")
    leader = cluster.by_id(row["leader"])
    with conn(leader) as c:
        publish_ok(c, "min-isr", [b"a"], producer=("pm", 0, 1), idempotent=True)
    follower = next(b for b in cluster.brokers if b is not leader)
    follower.kill()
    wait_isr(cluster, "min-isr", 2, timeout=20, via=leader)
    before = offsets(leader, "min-isr")
    with conn(leader) as c:
        err = error_of(publish_batch(c, "min-isr", 0, [b"b"], acks="all", producer=("pm", 0, 2), idempotent=True))
    assert err.code == "insufficient_in_sync_replicas" and err.retryable
    assert offsets(leader, "min-isr") == before  # nothing appended
    follower.start(timeout_s=60)
    wait_isr(cluster, "min-isr", 3, timeout=30)
    with conn(leader) as c:  # the refused sequence was not consumed: seq 2 is new, not a duplicate or a gap
        doc = publish_ok(c, "min-isr", [b"b"], producer=("pm", 0, 2), idempotent=True)
    assert doc["last_offset"] == 1 and not doc.get("duplicate")


def test_idempotent_retry_across_failover_is_a_duplicate(cluster: Cluster) -> None:
    row = make_topic(cluster, "retry-failover")
    old = cluster.by_id(row["leader"])
    payloads = [f"p{i}".encode() for i in range(5)]
    with conn(old) as c:
        first = publish_ok(c, "retry-failover", payloads, producer=("pr", 0, 1), idempotent=True)
    old.kill()
    survivor = next(b for b in cluster.brokers if b is not old)
    new = wait_for(lambda: (p := leader_proc(cluster, "retry-failover", via=survivor)) and p is not old and p, 20,
                   "a new leader")
    with conn(new) as c:
        again = wait_for(lambda: (f := publish_batch(c, "retry-failover", 0, payloads, acks="all",
                                                     producer=("pr", 0, 1), idempotent=True)).status == Status.OK
                         and json.loads(f.payload), 20, "the retry answered")
    assert again["last_offset"] == first["last_offset"]
    assert [bytes(r.payload) for r in read_partition(cluster, "retry-failover")] == payloads
    old.start(timeout_s=60)


def test_unacknowledged_tail_is_truncated_over_a_double_failover(cluster: Cluster) -> None:
    row = make_topic(cluster, "tail")
    old = cluster.by_id(row["leader"])
    followers = [b for b in cluster.brokers if b is not old]
    with conn(old) as c:
        publish_ok(c, "tail", [b"committed"])
        for follower in followers:
            follower.pause()
        try:  # acks=1: durable on the old leader only; a leader loss before commit may lose it
            for i in range(3):
                assert publish_batch(c, "tail", 0, [f"tail{i}".encode()], acks="1").status == Status.OK
        finally:
            old.kill()
            for follower in followers:
                follower.resume()
    new = wait_for(lambda: (p := leader_proc(cluster, "tail", via=followers[0])) and p is not old and p, 30,
                   "a follower leads")
    wait_isr(cluster, "tail", 2, timeout=20, via=new)  # the other follower may have been shrunk while paused
    with conn(new) as c:
        publish_ok(c, "tail", [b"new-epoch"])
    old.start(timeout_s=60)
    wait_isr(cluster, "tail", 3, timeout=30)
    with conn(cluster.brokers[0]) as c:  # second failover: the old leader leads again, with the new history
        ok_fields(c.command(f"ELECT_LEADER topic=tail partition=0 broker={old.log_dir.name}"))
    wait_for(lambda: leader_proc(cluster, "tail") is old, 10, "the old leader leads again")
    assert [bytes(r.payload) for r in read_partition(cluster, "tail")] == [b"committed", b"new-epoch"]


def test_internal_listener_refuses_plaintext(cluster: Cluster) -> None:
    target = cluster.brokers[0]
    host, _, port = cluster.internal[target.log_dir.name].rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00" * 64)
        assert closed_by_peer(sock)
    time.sleep(0)  # the cluster is unaffected:
    make_topic(cluster, "after-plaintext")


def _fetch_once(address: str, tls, token: str, follower: str = "node-2") -> str:
    """One Fetch on a broker's internal listener; the gRPC status name it ends with ("OK" if answered)."""
    import asyncio

    from cursus.internal.client import InternalClient, InternalRpcError
    from cursus.internal.v1 import replication_pb2 as pb

    async def run() -> str:
        client = InternalClient(follower, tls=tls, token=token)
        try:
            stream = client.fetch_stream(address)
            await stream.write(pb.FetchRequest(follower_id=follower, max_wait_ms=10))
            await stream.read()
            stream.cancel()
            return "OK"
        except InternalRpcError as exc:
            return exc.code.name
        finally:
            await client.close()

    return asyncio.run(run())


def test_internal_listener_refuses_foreign_ca_and_wrong_token(cluster: Cluster, pki) -> None:
    target = cluster.brokers[0]
    address = cluster.internal[target.log_dir.name]
    before = status(target)["internal_rejected_calls"]
    assert _fetch_once(address, pki.files("node-2"), "test-token") == "OK"  # a member with the token
    assert _fetch_once(address, pki.foreign, "test-token") == "UNAVAILABLE"  # TLS refuses another CA
    # refused and counted (the status is UNAUTHENTICATED / PERMISSION_DENIED; gRPC may surface an abort that
    # races the first write as INTERNAL, so the counters are the check)
    assert _fetch_once(address, pki.files("node-2"), "wrong-token") != "OK"
    assert _fetch_once(address, pki.files("node-2"), "test-token", follower="node-3") != "OK"
    refused = status(target)["internal_rejected_calls"]
    assert refused["wrong_token"] >= before["wrong_token"] + 1, (before, refused)
    assert refused["follower_mismatch"] >= before["follower_mismatch"] + 1, (before, refused)

