"""Replication benchmarks on three real broker processes (loopback, mutual TLS on the Raft and internal
listeners, every append fsynced on every replica, committed HWMs through Raft), 100-byte records:

- ``replication_capacity``: pre-encoded CBV2 batches of 1,000, acks=all, 4 connections (one process and
  one partition each, leaders spread over the brokers), each keeping ``CURSUS_BENCH_REPL_IN_FLIGHT``
  requests (default 5) written ahead of their replies (step ``capacity``), and one at a time (step
  ``capacity_serial``): records/s, broker and client CPU seconds.
- ``replication_sdk_producer``: the SDK ``Producer``, acks=all, idempotent, one partition: records/s.
- ``replication_latency``: single-record acks=all PUBLISH round trips on the leader, p50/p99 (ms).
- ``replication_failover``: kill -9 of a partition leader (not the Raft leader) until the first
  acks=all record is acknowledged by the new leader, median and max over 5 runs (s), with the timers
  below (broker session 600 ms, heartbeats 100 ms).

Run: ``python -m bench replication``. All three brokers and the load generators share this machine.
Environment: ``CURSUS_BENCH_REPL_STEPS`` (comma-separated subset of
``capacity,capacity_serial,sdk_producer,latency,failover``),
``CURSUS_BENCH_REPL_FAILOVERS`` (runs of the failover case, default 5), ``CURSUS_BENCH_REPL_KEEP_DIR`` (a
directory kept after the run for the brokers' data and logs, ``nodes/node-N.broker.log``, and
``failover-trace.json``: per run, the kill's wall-clock time and every probe's outcome, seconds after it).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.support import proc_cpu_s, publisher
from cursus.client.connection import Connection
from cursus.wire import Batch, Command, Record, Status, encode_batch

RECORDS_PER_BATCH = 1000
PAYLOAD_BYTES = 100
CONNECTIONS = 4
BATCHES_PER_CONNECTION = int(os.environ.get("CURSUS_BENCH_REPL_BATCHES", "60"))
#: PUBLISH requests each capacity connection keeps written ahead of their replies (the broker's default
#: ``max_in_flight_requests_per_connection`` is 5, Kafka's producer default too); 1 is measured as well.
IN_FLIGHT = int(os.environ.get("CURSUS_BENCH_REPL_IN_FLIGHT", "5"))
SDK_RECORDS = int(os.environ.get("CURSUS_BENCH_REPL_SDK_RECORDS", "100000"))
LATENCY_SAMPLES = int(os.environ.get("CURSUS_BENCH_REPL_LATENCY_SAMPLES", "500"))
FAILOVERS = int(os.environ.get("CURSUS_BENCH_REPL_FAILOVERS", "5"))
STEPS = [s for s in os.environ.get("CURSUS_BENCH_REPL_STEPS", "capacity,capacity_serial,sdk_producer,latency,failover")
         .split(",") if s]
KEEP_DIR = os.environ.get("CURSUS_BENCH_REPL_KEEP_DIR", "")
TIMERS = {"broker_heartbeat_interval_ms": 100, "broker_session_timeout_ms": 600, "replica_lag_time_max_ms": 2000,
          "replica_fetch_wait_max_ms": 200, "replica_ack_timeout_ms": 10000}


def _status(broker) -> dict:
    with Connection(*broker.address, timeout_s=10) as conn:
        return json.loads(conn.command("CLUSTER_STATUS").payload.decode()[len("OK cluster="):])


def _row(broker, topic: str, partition: int = 0) -> dict:
    return next(p for p in _status(broker)["partitions"] if p["topic"] == topic and p["partition"] == partition)


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception:
            value = None
        if value:
            return value
        time.sleep(0.02)
    raise TimeoutError(what)


def _capacity(cluster, in_flight: int) -> dict:
    topic = f"cap{in_flight}"
    with Connection(*cluster.brokers[0].address, timeout_s=30) as conn:
        assert conn.command(f"CREATE topic={topic} partitions={CONNECTIONS} replication_factor=3").status == Status.OK
    rows = [_wait(lambda p=p: (r := _row(cluster.brokers[0], topic, p)) and len(r["isr"]) == 3 and r, 30, "isr")
            for p in range(CONNECTIONS)]
    ports = [cluster.by_id(r["leader"]).port for r in rows]
    pids = [b.proc.pid for b in cluster.brokers]
    cpu0 = [proc_cpu_s(pid) for pid in pids]
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=publisher, args=(ports[p], topic, p, BATCHES_PER_CONNECTION, out),
                         kwargs={"acks": "all", "in_flight": in_flight})
             for p in range(CONNECTIONS)]
    started = time.perf_counter()
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
        assert proc.exitcode == 0
    elapsed = time.perf_counter() - started
    total = CONNECTIONS * BATCHES_PER_CONNECTION * RECORDS_PER_BATCH
    return {"bench": "replication_capacity", "records": total, "record_bytes": PAYLOAD_BYTES,
            "batch_records": RECORDS_PER_BATCH, "connections": CONNECTIONS, "in_flight": in_flight, "acks": "all",
            "replicas": 3,
            "seconds": round(elapsed, 3), "records_per_s": round(total / elapsed),
            "broker_cpu_s": [round(proc_cpu_s(pid) - c, 2) for pid, c in zip(pids, cpu0, strict=True)],
            "client_cpu_s": round(sum(out.get() for _ in procs), 2)}


def _sdk_producer(cluster) -> dict:
    from cursus.client.producer import Producer

    with Connection(*cluster.brokers[0].address, timeout_s=30) as conn:
        assert conn.command("CREATE topic=sdk partitions=1 replication_factor=3").status == Status.OK
    _wait(lambda: len(_row(cluster.brokers[0], "sdk")["isr"]) == 3, 30, "isr")
    value = b"x" * PAYLOAD_BYTES
    pids = [b.proc.pid for b in cluster.brokers]
    cpu0 = [proc_cpu_s(pid) for pid in pids]
    client0 = time.process_time()
    started = time.perf_counter()
    with Producer(f"127.0.0.1:{cluster.brokers[0].port}", acks="all", idempotent=True) as producer:
        for _ in range(SDK_RECORDS):
            producer.send("sdk", value, partition=0)
        producer.flush(timeout_s=120)
    elapsed = time.perf_counter() - started
    return {"bench": "replication_sdk_producer", "records": SDK_RECORDS, "acks": "all", "idempotent": True,
            "seconds": round(elapsed, 3), "records_per_s": round(SDK_RECORDS / elapsed),
            "broker_cpu_s": [round(proc_cpu_s(pid) - c, 2) for pid, c in zip(pids, cpu0, strict=True)],
            "client_cpu_s": round(time.process_time() - client0, 2)}


def _latency(cluster) -> dict:
    with Connection(*cluster.brokers[0].address, timeout_s=30) as conn:
        assert conn.command("CREATE topic=lat partitions=1 replication_factor=3").status == Status.OK
    row = _wait(lambda: (r := _row(cluster.brokers[0], "lat")) and len(r["isr"]) == 3 and r, 30, "isr")
    leader = cluster.by_id(row["leader"])
    payload = encode_batch(Batch(topic="lat", partition=0, acks="all",
                                 records=[Record(topic="lat", partition=0, payload=b"x" * PAYLOAD_BYTES)]))
    latencies = []
    with Connection(*leader.address, timeout_s=30) as conn:
        # the leader may still be opening the new partition (leader_not_available): wait for a first OK
        _wait(lambda: conn.request(Command.PUBLISH, payload).status == Status.OK, 30, "the leader accepts")
        for _ in range(LATENCY_SAMPLES):
            started = time.perf_counter()
            frame = conn.request(Command.PUBLISH, payload)
            latencies.append(time.perf_counter() - started)
            assert frame.status == Status.OK, frame.payload[:200]
    latencies.sort()
    return {"bench": "replication_latency", "samples": len(latencies), "acks": "all",
            "p50_ms": round(latencies[len(latencies) // 2] * 1000, 3),
            "p99_ms": round(latencies[int(len(latencies) * 0.99) - 1] * 1000, 3)}


def _probe(broker, payload: bytes) -> tuple[bool, str]:
    """One acks=all PUBLISH on a fresh connection: (acknowledged, outcome text for the trace)."""
    try:
        with Connection(*broker.address, timeout_s=2) as conn:
            frame = conn.request(Command.PUBLISH, payload)
    except OSError as exc:
        return False, f"{type(exc).__name__}: {exc}"[:120]
    return frame.status == Status.OK, frame.payload[:120].decode(errors="replace")


def _failover(cluster, trace_path: Path | None = None) -> dict:
    times = []
    traces = []
    for run in range(FAILOVERS):
        topic = f"fo-{run}"
        with Connection(*cluster.brokers[0].address, timeout_s=30) as conn:
            assert conn.command(f"CREATE topic={topic} partitions=6 replication_factor=3").status == Status.OK
        raft_leader = _status(cluster.brokers[0])["raft_leader"]
        rows = [_wait(lambda p=p, t=topic: (r := _row(cluster.brokers[0], t, p)) and len(r["isr"]) == 3 and r, 30, "isr")
                for p in range(6)]
        # a partition led by a broker that is not the Raft leader (else the kill also costs an election)
        partition, row = next(((p, r) for p, r in enumerate(rows) if r["leader"] != raft_leader),
                              (0, rows[0]))
        victim = cluster.by_id(row["leader"])
        others = [b for b in cluster.brokers if b is not victim]
        payload = encode_batch(Batch(topic=topic, partition=partition, acks="all",
                                     records=[Record(topic=topic, partition=partition, payload=b"fo")]))
        trace: dict = {"run": run, "topic": topic, "partition": partition, "victim": row["leader"],
                       "raft_leader": raft_leader, "kill_wall": time.time(), "probes": []}
        killed = time.perf_counter()
        victim.kill()
        done = False
        while not done:
            for broker in others:
                sent = time.perf_counter() - killed
                done, outcome = _probe(broker, payload)
                trace["probes"].append([round(sent, 4), round(time.perf_counter() - killed, 4),
                                        cluster.brokers.index(broker) + 1, outcome])
                if done:
                    break
            time.sleep(0.002)
        times.append(time.perf_counter() - killed)
        trace["seconds"] = times[-1]
        traces.append(trace)
        if trace_path is not None:
            trace_path.write_text(json.dumps(traces, indent=1))
        victim.start(timeout_s=60)
        _wait(lambda o=others[0]: _status(o)["inactive_brokers"] == 0, 30, "victim back")
    return {"bench": "replication_failover", "runs": FAILOVERS, "median_s": round(statistics.median(times), 3),
            "max_s": round(max(times), 3), "all_s": [round(t, 3) for t in times],
            "broker_session_timeout_ms": TIMERS["broker_session_timeout_ms"]}


def run() -> list[dict]:
    from tests.cluster.clustersupport import Cluster
    from tests.cluster.raftsupport import make_test_pki

    results = []
    steps = {"capacity": lambda c: _capacity(c, IN_FLIGHT), "capacity_serial": lambda c: _capacity(c, 1),
             "sdk_producer": _sdk_producer, "latency": _latency,
             "failover": lambda c: _failover(c, root / "failover-trace.json" if KEEP_DIR else None)}
    with tempfile.TemporaryDirectory(prefix="bench-replication-") as tmp:
        root = Path(KEEP_DIR or tmp)
        (root / "nodes").mkdir(parents=True)
        cluster = Cluster(root / "nodes", make_test_pki(root / "pki"), **TIMERS)
        try:
            cluster.start()
            for name in STEPS:
                step = steps[name]
                try:
                    results.append(step(cluster))
                except Exception as exc:  # one broken step must not hide the others' numbers
                    results.append({"bench": f"replication_{name}", "error": f"{type(exc).__name__}: {exc}"})
        finally:
            cluster.stop()
    return results
