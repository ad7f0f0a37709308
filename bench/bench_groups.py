"""Consumer-group throughput, commit latency and coordinator startup (broker and client share this machine).

* ``group_consume_poll`` / ``group_consume_stream``: one :class:`~cursus.client.group.GroupConsumer` reads
  100-byte records from a 4-partition topic (CONSUME long polls, or one STREAM per partition) and commits
  ``lastProcessedOffset + 1`` every 1,000 records (COMMIT_OFFSET / BATCH_COMMIT, fsynced before OK);
* ``group_commit_latency``: single COMMIT_OFFSET round trips of a group member, p50/p99;
* ``coordinator_startup``: commits driven straight into an in-process broker's coordinator (the same code path
  as the commands, without the network), then the time a real broker process needs to replay
  ``__consumer_offsets`` and report ready. ``python -m bench.bench_groups --startup-commits 1000000``
  measures it for a million commits (a few minutes).
* ``offsets_cleaning_replay``: 200,000 commits over 1,000 groups (in-process, as above), then the replay
  time a real broker process reports for ``__consumer_offsets`` before and after one log cleaner pass
  (group-aware planner, 4 MiB segments), with the retained records and bytes of each.
  ``python -m bench.bench_groups --cleaning-commits N`` runs only this one.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from cursus.client.connection import Connection
from cursus.client.group import GroupConsumer
from cursus.wire import Batch, Command, Record, Status, encode_batch, encode_record

PARTITIONS = 4
RECORDS = int(os.environ.get("CURSUS_BENCH_GROUP_RECORDS", "100000"))
COMMIT_EVERY = 1000
LATENCY_SAMPLES = int(os.environ.get("CURSUS_BENCH_LATENCY_SAMPLES", "500"))
STARTUP_COMMITS = int(os.environ.get("CURSUS_BENCH_STARTUP_COMMITS", "100000"))
CLEANING_COMMITS = int(os.environ.get("CURSUS_BENCH_CLEANING_COMMITS", "200000"))
CLEANING_GROUPS = 1000
_REPLAYED = re.compile(r"replayed (\d+) records .* in (\d+) ms")


def _produce(port: int, topic: str) -> None:
    per_partition = RECORDS // PARTITIONS
    with Connection("127.0.0.1", port, timeout_s=60) as conn:
        conn.command(f"CREATE topic={topic} partitions={PARTITIONS}")
        for p in range(PARTITIONS):
            records = [Record(topic=topic, partition=p, payload=os.urandom(50).hex().encode())
                       for _ in range(1000)]
            payload = encode_batch(Batch(topic=topic, partition=p, acks="1", records=records))
            for _ in range(per_partition // 1000):
                assert conn.request(Command.PUBLISH, payload).status == Status.OK


def _consume(port: int, topic: str, mode: str) -> dict:
    done: dict[int, int] = {}
    count = commits = 0
    started = time.perf_counter()
    with GroupConsumer(topic, f"bench-{mode}", f"127.0.0.1:{port}", mode=mode, auto_commit=False,
                       batch_size=1000, wait_ms=200, timeout_s=30) as consumer:
        deadline = time.monotonic() + 120
        while count < RECORDS and time.monotonic() < deadline:
            for record in consumer.poll(0.5):
                done[record.partition] = record.offset + 1  # "processing"
                count += 1
                if count % COMMIT_EVERY == 0:
                    consumer.commit(done)
                    commits += 1
        consumer.commit(done)
    elapsed = time.perf_counter() - started
    return {"bench": f"group_consume_{mode}", "records": count, "partitions": PARTITIONS,
            "commit_every": COMMIT_EVERY, "commits": commits + 1, "seconds": round(elapsed, 3),
            "records_per_s": round(count / elapsed)}


def _commit_latency(port: int, topic: str) -> dict:
    latencies = []
    with Connection("127.0.0.1", port) as conn:
        reply = conn.command(f"JOIN_GROUP topic={topic} group=bench-latency member=lat").payload.decode()
        member = re.search(r"member=(\S+)", reply).group(1)  # type: ignore[union-attr]
        generation = re.search(r"generation=(\d+)", reply).group(1)  # type: ignore[union-attr]
        for n in range(1, LATENCY_SAMPLES + 1):
            text = (f"COMMIT_OFFSET topic={topic} partition={n % PARTITIONS} group=bench-latency offset={n} "
                    f"member={member} generation={generation}")
            t0 = time.perf_counter()
            frame = conn.command(text)
            latencies.append(time.perf_counter() - t0)
            assert frame.status == Status.OK
    latencies.sort()
    return {"bench": "group_commit_latency", "samples": len(latencies),
            "p50_ms": round(latencies[len(latencies) // 2] * 1000, 3),
            "p99_ms": round(latencies[int(len(latencies) * 0.99)] * 1000, 3)}


async def _drive_commits(log_dir: Path, commits: int, groups: int = 50) -> float:
    """Open a broker in-process, make ``groups`` one-member groups and commit ``commits`` times through the
    coordinator (fsynced like COMMIT_OFFSET), then shut it down cleanly. Returns commits per second."""
    from cursus.broker.config import load_config
    from cursus.broker.core import Broker
    from cursus.broker.metrics import BrokerMetrics
    from cursus.metadata.topics import TopicDefinition

    config = load_config(environ={}, overrides={"log_dir": str(log_dir), "consumer_session_timeout_ms": 3_600_000})
    broker = await Broker.open(config, BrokerMetrics())
    try:
        await broker.apply_definition(TopicDefinition("startup", PARTITIONS))
        per_partition = commits // groups // PARTITIONS + 1  # commits must stay within the log
        for p in range(PARTITIONS):
            replica = broker.replica("startup", p)
            while replica.leo < per_partition:
                count = min(1000, per_partition - replica.leo)
                encoded = [encode_record(Record("startup", p, b"x", offset=replica.leo + i)) for i in range(count)]
                replica.append(b"".join(len(e).to_bytes(4, "big") + e for e in encoded), count)
            await replica.wait_hwm(replica.leo)
        members = []
        for g in range(groups):
            result = await broker.coordinator.join(f"g{g}", "m", topic="startup", generation=None)
            members.append(result.member_id)
        coordinator = broker.coordinator
        started = time.perf_counter()
        step = 2000
        for base in range(0, commits, step):
            batch = []
            for n in range(base, min(commits, base + step)):
                g, k = n % groups, n // groups  # group g's k-th commit: COMMIT_OFFSET of one partition
                batch.append(coordinator.commit(f"g{g}", "startup", members[g], 1,
                                                {k % PARTITIONS: k // PARTITIONS + 1}))
            await asyncio.gather(*batch)
        rate = commits / (time.perf_counter() - started)
    finally:
        await broker.close()
    return rate


def startup_after_commits(commits: int) -> dict:
    """Commit ``commits`` times, then time a real broker process from launch to ready."""
    from tests.brokerproc import BrokerProcess

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        rate = asyncio.run(_drive_commits(data, commits))
        files = list((data / "topics" / "__consumer_offsets").rglob("*.log"))
        retained_bytes = sum(f.stat().st_size for f in files)
        broker = BrokerProcess(data, health=False)
        started = time.perf_counter()
        broker.start(timeout_s=600)
        ready_s = time.perf_counter() - started
        broker.stop()
        match = re.search(r"replayed (\d+) records .* in (\d+) ms", broker.output())
    return {"bench": "coordinator_startup", "commits": commits, "commit_rate_per_s": round(rate),
            "retained_records": int(match.group(1)) if match else None,
            "retained_bytes": retained_bytes, "replay_ms": int(match.group(2)) if match else None,
            "process_ready_s": round(ready_s, 2)}


def _replay_once(data: Path, settings: dict[str, object]) -> tuple[int, int, str]:
    """Start a broker process on ``data``, return (records replayed, replay ms, its output); stop it."""
    from tests.brokerproc import BrokerProcess

    broker = BrokerProcess(data, settings=settings, health=False)
    broker.start(timeout_s=600)
    output = broker.output()
    match = _REPLAYED.findall(output)
    broker.stop()
    return int(match[-1][0]), int(match[-1][1]), output


def _offsets_bytes(data: Path) -> int:
    return sum(f.stat().st_size for f in (data / "topics" / "__consumer_offsets").rglob("*.log"))


def offsets_cleaning_replay(commits: int, groups: int = CLEANING_GROUPS) -> dict:
    """``commits`` commits over ``groups`` groups, then replay before and after one cleaner pass."""
    from tests.brokerproc import BrokerProcess

    idle = {"log_cleanup_interval": 3600}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        rate = asyncio.run(_drive_commits(data, commits, groups=groups))
        bytes_before = _offsets_bytes(data)
        records_before, replay_before_ms, _ = _replay_once(data, idle)
        broker = BrokerProcess(data, settings={"log_cleanup_interval": 0.1, "log_min_cleanable_dirty_ratio": 0.01},
                               health=False)
        broker.start(timeout_s=600)
        deadline = time.monotonic() + 600
        while "cleaned __consumer_offsets/0" not in broker.output():
            assert time.monotonic() < deadline, "no cleaner pass"
            time.sleep(0.1)
        pass_line = next(line for line in broker.output().splitlines() if "cleaned __consumer_offsets/0" in line)
        pass_ms = int(re.search(r"in (\d+) ms", pass_line).group(1))  # type: ignore[union-attr]
        broker.stop()
        bytes_after = _offsets_bytes(data)
        records_after, replay_after_ms, _ = _replay_once(data, idle)
    return {"bench": "offsets_cleaning_replay", "commits": commits, "groups": groups,
            "commit_rate_per_s": round(rate), "records_before": records_before, "bytes_before": bytes_before,
            "replay_before_ms": replay_before_ms, "cleaner_pass_ms": pass_ms, "records_after": records_after,
            "bytes_after": bytes_after, "replay_after_ms": replay_after_ms}


def run() -> list[dict]:
    """The module's measurements, one dict each (``python -m bench groups``; a few minutes)."""
    from tests.brokerproc import BrokerProcess

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        broker = BrokerProcess(Path(tmp) / "data", health=False).start()
        try:
            _produce(broker.port, "bench-groups")
            results.append(_consume(broker.port, "bench-groups", "poll"))
            results.append(_consume(broker.port, "bench-groups", "stream"))
            results.append(_commit_latency(broker.port, "bench-groups"))
        finally:
            broker.stop()
    results.append(startup_after_commits(STARTUP_COMMITS))
    results.append(offsets_cleaning_replay(CLEANING_COMMITS))
    return results


if __name__ == "__main__":  # python -m bench.bench_groups [--startup-commits N]
    import json

    if len(sys.argv) == 3 and sys.argv[1] == "--startup-commits":
        print(json.dumps({"module": "bench_groups", **startup_after_commits(int(sys.argv[2]))}), flush=True)
    elif len(sys.argv) == 3 and sys.argv[1] == "--cleaning-commits":
        print(json.dumps({"module": "bench_groups", **offsets_cleaning_replay(int(sys.argv[2]))}), flush=True)
    else:
        for result in run():
            print(json.dumps({"module": "bench_groups", **result}), flush=True)
