"""``python -m chaos``: run the chaos harness.

Commands:

``run``
    ``python -m chaos run --nodes 1 --duration 60 --faults kill,pause,restart,lose-unsynced,torn-tail
    --seed N --out DIR``: start brokers, run the workloads and the seeded fault schedule, heal, settle,
    drain, check, write ``history.jsonl``, ``faults.jsonl``, ``schedule.json``, broker logs
    (``node-<i>/broker.log``), ``report.json`` and ``summary.txt``. Exit 0 valid, 1 violation, 2 harness
    error.
``corrupt``
    The corruption-detection scenario: corrupt acknowledged data below the recovery point and check that
    the broker refuses to start with a clear message (or, where startup cannot see the damage, never
    serves the wrong bytes).
``check DIR``
    Re-run the checkers on a finished run's ``history.jsonl`` and ``faults.jsonl``.
``schedule``
    Print the fault schedule a seed gives, without running anything.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chaos import checkers, faults, report, schedule
from chaos.history import Clock, History
from chaos.history import load as load_history
from chaos.nodes import Cluster, Node, NodeStartError
from chaos.txn import TxnWorker
from chaos.workloads import (
    Context,
    DirectReader,
    GroupConsumer,
    GroupGate,
    IdempotentProducer,
    MetadataWorker,
    OffsetsPoller,
    PlainProducer,
    StreamConsumer,
    TopicPlan,
    create_topics,
    drain,
)

DEFAULT_FAULTS = "kill,pause,restart,lose-unsynced,torn-tail"
#: Broker settings for chaos runs: small segments (rolls happen), frequent checkpoints (recovery points
#: move, so torn tails and recovery paths are exercised).
#: Crashed group members expire after a few seconds (not the default 30), so their partitions move on.
BROKER_SETTINGS: dict[str, object] = {"log_segment_bytes": 256 * 1024, "log_recovery_point_interval_ms": 200,
                                      "consumer_session_timeout_ms": 5000, "transaction_timeout_ms": 5000}
#: ``CURSUS_STORAGE_FAULTS`` for lose-unsynced: power-cut kills, with fsyncs slowed to widen the window.
LOSE_UNSYNCED_ENV = "lose_unsynced=1,fsync_delay_ms=2"
PARTITIONS = 3
GROUP = "chaos-group"


@dataclass(frozen=True, slots=True)
class RunOptions:
    """Options of ``python -m chaos run`` (see ``--help``)."""

    nodes: int
    duration_s: float
    faults: tuple[str, ...]
    seed: int
    out: Path
    settle_s: float = 3.0
    keep_data: bool = False
    groups: bool = True
    #: Cluster runs: how long to wait after the heal for a leader and a full ISR on every partition.
    settle_timeout_s: float = 30.0


def plan_topics(nodes: int) -> list[TopicPlan]:
    """Two topics per node: one for idempotent producers, one for acks=1 producers and the group."""
    topics = []
    for node in range(nodes):
        topics.append(TopicPlan(f"chaos-idem-{node}", PARTITIONS, node, idempotent=True))
        topics.append(TopicPlan(f"chaos-plain-{node}", PARTITIONS, node, idempotent=False))
    return topics


def reproduce_command(options: RunOptions) -> str:
    """The command line that replays this run's schedule."""
    return (f"python -m chaos run --nodes {options.nodes} --duration {options.duration_s:g} "
            f"--faults {','.join(options.faults) or 'none'} --seed {options.seed} --out {options.out}")


def run(options: RunOptions) -> int:
    """One chaos run; returns the exit code (see :func:`chaos.report.exit_code`)."""
    out = options.out
    if out.exists() and any(out.iterdir()):
        print(f"chaos: output dir {out} is not empty (a run needs fresh broker data)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    print(f"chaos: seed={options.seed} out={out}", flush=True)
    if options.nodes > 1:
        return run_cluster(options)
    topics = plan_topics(options.nodes)
    tear_targets = {n: [(t.name, p) for t in topics if t.node == n for p in range(t.partitions)]
                    for n in range(options.nodes)}
    plan = schedule.build_schedule(options.seed, options.duration_s, options.faults, options.nodes,
                                   max(len(v) for v in tear_targets.values()))
    (out / "schedule.json").write_text(json.dumps([s.to_json() for s in plan], indent=1) + "\n")
    power_cut = "lose-unsynced" in options.faults
    env = {"CURSUS_STORAGE_FAULTS": LOSE_UNSYNCED_ENV} if power_cut else {}
    cluster = Cluster(out, options.nodes, settings=BROKER_SETTINGS, env=env)
    clock = Clock()
    history = History(out / "history.jsonl", clock, keep_events=False)
    fault_log = faults.FaultLog(out / "faults.jsonl", clock, history)
    observed = faults.ObservedEnds()
    history.listeners.append(observed.on_complete)
    ctx = Context(history, cluster, topics, options.seed)
    errors: list[dict[str, Any]] = []
    workloads: dict[str, str] = {}
    gate = GroupGate()
    mode_fault = None
    mode_error: str | None = None
    try:
        cluster.start()
        create_topics(ctx)
        if power_cut:
            mode_fault = fault_log.begin("lose-unsynced", None, {"env": LOSE_UNSYNCED_ENV})
            mode_error = _mode_env_error(cluster, range(len(cluster)))
        workers = _workers(ctx, topics, gate, options.groups)
        ctx.workers.extend(workers)
        started = clock.now()
        for worker in workers:
            worker.start()
        nemesis = faults.Nemesis(plan, cluster, fault_log, clock, started, tear_targets, observed.end, ctx.quiesce,
                                 power_cut=power_cut)
        nemesis.start()
        _sleep_until(clock, started + options.duration_s, nemesis)
        nemesis.stop()
        nemesis.join()
        errors.extend(nemesis.errors)
        for action in cluster.heal():
            if "failed" in action or "exited" in action:  # a broker that died by itself is a finding
                errors.append({"error": f"heal: {action}"})
        time.sleep(options.settle_s)  # workloads keep running, fault-free: unknown outcomes resolve
        ctx.stop.set()
        for worker in workers:
            worker.join(timeout=30)
        workloads = _workload_states(workers, gate, options.groups)
        if mode_fault is not None:
            fault_log.end(mode_fault, error=mode_error)
            mode_fault = None
        group_topics = [(GROUP, topics[1])] if gate.available else []
        for problem in drain(ctx, group_topics):
            errors.append({"error": problem})
    except NodeStartError as exc:
        errors.append({"error": f"broker failed to start: {exc}", "output": exc.output[-4000:]})
    finally:
        ctx.stop.set()
        if mode_fault is not None:
            fault_log.end(mode_fault)
        cluster.stop()
        history.close()
        fault_log.close()
    ops = history.ops()
    anomalies = checkers.run_all(ops)
    meta = {"seed": options.seed, "nodes": options.nodes, "duration_s": options.duration_s,
            "faults_enabled": list(options.faults), "schedule_length": len(plan), "out": str(out),
            "reproduce": reproduce_command(options), "started_at_unix": round(clock.wall_origin, 3),
            "elapsed_s": round(clock.now(), 3), "broker_settings": BROKER_SETTINGS, "broker_env": env}
    doc = report.build(meta, ops, anomalies, fault_log.records, workloads=workloads, errors=errors,
                       harness_errors=ctx.harness_errors)
    print(report.write(out, doc), flush=True)
    code = report.exit_code(doc)
    if code == 0 and not options.keep_data:
        cluster.remove_data()
    if code != 0:
        print(f"chaos: FAILED with seed={options.seed}", flush=True)
    return code


def run_cluster(options: RunOptions) -> int:
    """One chaos run against an N-node Raft cluster in a private network (see :mod:`chaos.netns`)."""
    from chaos.cluster import LeaderTracker, inspect_replicas, make_cluster, wait_settled
    from chaos.netns import Network, NetworkUnavailable

    out = options.out
    topics = plan_topics(1)  # two topics, every partition replicated on every node
    keys = [(t.name, p) for t in topics for p in range(t.partitions)]
    tear_targets = {n: list(keys) for n in range(options.nodes)}
    plan = schedule.build_schedule(options.seed, options.duration_s, options.faults, options.nodes, len(keys))
    (out / "schedule.json").write_text(json.dumps([s.to_json() for s in plan], indent=1) + "\n")
    power_cut = "lose-unsynced" in options.faults
    network = Network(options.nodes)
    try:
        network.setup()
    except NetworkUnavailable as exc:
        print(f"chaos: cannot build the private network: {exc}", file=sys.stderr)
        return 2
    cluster = make_cluster(out, options.nodes, network, settings=BROKER_SETTINGS, env={})
    if power_cut:  # a minority only: node 0
        cluster.nodes[0].env["CURSUS_STORAGE_FAULTS"] = LOSE_UNSYNCED_ENV
    clock = Clock()
    history = History(out / "history.jsonl", clock, keep_events=False)
    fault_log = faults.FaultLog(out / "faults.jsonl", clock, history)
    observed = faults.ObservedEnds()
    history.listeners.append(observed.on_complete)
    ctx = Context(history, cluster, topics, options.seed)
    tracker_stop = threading.Event()
    tracker = LeaderTracker(cluster, history, tracker_stop)
    ctx.leaders = tracker
    errors: list[dict[str, Any]] = []
    workloads: dict[str, str] = {}
    gate = GroupGate()
    mode_fault = None
    mode_error: str | None = None
    final_status: dict[str, Any] = {}
    try:
        cluster.start()
        tracker.start()
        create_topics(ctx)
        settled = wait_settled(tracker, keys, 60.0)
        if not _all_led(settled, keys, len(cluster)):
            errors.append({"error": "the cluster never settled before the workloads started"})
            raise _Abort()
        if power_cut:
            mode_fault = fault_log.begin("lose-unsynced", 0, {"env": LOSE_UNSYNCED_ENV, "nodes": [0]})
            mode_error = _mode_env_error(cluster, [0])
        workers = _workers(ctx, topics, gate, options.groups)
        ctx.workers.extend(workers)
        started = clock.now()
        for worker in workers:
            worker.start()
        nemesis = faults.Nemesis(plan, cluster, fault_log, clock, started, tear_targets, observed.end, ctx.quiesce,
                                 power_cut=power_cut, network=network, leaders=tracker)
        nemesis.start()
        _sleep_until(clock, started + options.duration_s, nemesis)
        nemesis.stop()
        nemesis.join()
        errors.extend(nemesis.errors)
        network.heal()
        for action in cluster.heal():
            if "failed" in action or "exited" in action:
                errors.append({"error": f"heal: {action}"})
        heal_pending = history.invoke("nemesis", "heal", {"cuts": [], "nodes": "all up"})
        history.complete(heal_pending, "info", error="healed (nemesis ops always end as info)")
        settled = wait_settled(tracker, keys, options.settle_timeout_s)
        time.sleep(options.settle_s)  # workloads keep running, fault-free: unknown outcomes resolve
        ctx.stop.set()
        for worker in workers:
            worker.join(timeout=30)
        workloads = _workload_states(workers, gate, options.groups)
        workloads["metadata-ops"] = "ran"
        workloads["stream-consumers"] = "ran"
        workloads["transactions"] = "ran"
        if mode_fault is not None:
            fault_log.end(mode_fault, error=mode_error)
            mode_fault = None
        group_topics = [(GROUP, topics[1])] if gate.available else []
        for problem in drain(ctx, group_topics):
            errors.append({"error": problem})
        final_status = wait_settled(tracker, keys, min(10.0, options.settle_timeout_s))
    except NodeStartError as exc:
        errors.append({"error": f"broker failed to start: {exc}", "output": exc.output[-4000:]})
    except _Abort:
        pass
    finally:
        ctx.stop.set()
        tracker_stop.set()
        if mode_fault is not None:
            fault_log.end(mode_fault)
        try:
            network.heal()
        except NetworkUnavailable as exc:
            errors.append({"error": f"network heal failed: {exc}"})
        cluster.stop()
        if tracker.is_alive():
            tracker.join(timeout=10)
        if final_status:
            inspect_replicas(cluster, final_status, history)
        history.close()
        fault_log.close()
    ops = history.ops()
    anomalies = checkers.run_all(ops)
    meta = {"seed": options.seed, "nodes": options.nodes, "duration_s": options.duration_s,
            "faults_enabled": list(options.faults), "schedule_length": len(plan), "out": str(out),
            "reproduce": reproduce_command(options), "started_at_unix": round(clock.wall_origin, 3),
            "elapsed_s": round(clock.now(), 3), "broker_settings": BROKER_SETTINGS,
            "broker_env": {"node-0": LOSE_UNSYNCED_ENV} if power_cut else {},
            "network": "private namespaces, nftables drops by address pair (chaos/netns.py)"}
    doc = report.build(meta, ops, anomalies, fault_log.records, workloads=workloads, errors=errors,
                       harness_errors=ctx.harness_errors)
    print(report.write(out, doc), flush=True)
    code = report.exit_code(doc)
    if code == 0 and not options.keep_data:
        cluster.remove_data()
    if code != 0:
        print(f"chaos: FAILED with seed={options.seed}", flush=True)
    return code


def _mode_env_error(cluster: Any, nodes: Any) -> str | None:
    """The ``lose-unsynced`` mode's proof of effect: every node in ``nodes`` runs with
    ``CURSUS_STORAGE_FAULTS`` in its process environment (``/proc/<pid>/environ``); else an ineffective error."""
    missing = [cluster.nodes[i].name for i in nodes
               if cluster.nodes[i].pid is None
               or "CURSUS_STORAGE_FAULTS=" not in faults.process_environ(cluster.nodes[i].pid)]
    return f"{faults.INEFFECTIVE}no CURSUS_STORAGE_FAULTS in the process of {', '.join(missing)}" if missing else None


class _Abort(Exception):
    """Stop a run early (the reason is already in the errors)."""


def _all_led(view: dict[str, Any], keys: list[tuple[str, int]], replicas: int) -> bool:
    parts = view.get("partitions") or {}
    return all(parts.get(f"{t}/{p}", {}).get("leader") for t, p in keys)


def _workers(ctx: Context, topics: list[TopicPlan], gate: GroupGate, groups: bool) -> list[Any]:
    idem = [t for t in topics if t.idempotent]
    plain = [t for t in topics if not t.idempotent]
    workers: list[Any] = [
        IdempotentProducer("idem-0", ctx, idem, keyed=True),
        IdempotentProducer("idem-1", ctx, idem, keyed=False),
        PlainProducer("plain-0", ctx, plain, keyed=True),
        PlainProducer("plain-1", ctx, plain, keyed=False),
        DirectReader("reader-0", ctx, topics),
        DirectReader("reader-1", ctx, topics),
    ]
    if ctx.clustered:
        workers += [OffsetsPoller("offsets-0", ctx, 0), MetadataWorker("meta-0", ctx),
                    StreamConsumer("stream-0", ctx, topics), TxnWorker("txn-0", ctx)]
    else:
        workers += [OffsetsPoller(f"offsets-{n}", ctx, n) for n in range(len(ctx.cluster))]
    if groups:
        workers += [GroupConsumer(f"consumer-{i}", ctx, plain[0], GROUP, gate, leader=i == 0) for i in range(2)]
    return workers


def _workload_states(workers: list[Any], gate: GroupGate, groups: bool) -> dict[str, str]:
    states = {"idempotent-producers": "ran", "acks1-producers": "ran", "direct-readers": "ran",
              "list-offsets": "ran"}
    if not groups:
        states["group-consumers"] = "skipped: disabled (--no-groups)"
    elif gate.available:
        states["group-consumers"] = "ran"
    elif gate.available is False:
        states["group-consumers"] = "skipped: groups unavailable"
    else:
        states["group-consumers"] = "skipped: groups unavailable (no JOIN_GROUP ever answered)"
    return states


def _sleep_until(clock: Clock, deadline: float, nemesis: faults.Nemesis) -> None:
    while clock.now() < deadline:
        if nemesis.errors:
            return  # a node would not restart: stop early, the run is already a failure
        time.sleep(min(0.2, max(0.0, deadline - clock.now())))


# ------------------------------------------------------------------------------------------ corrupt


CORRUPTION_CASES = ("body-flip", "header-flip", "truncate-acked", "old-segment-flip")


def run_corruption(seed: int, out: Path) -> int:
    """The corruption-detection scenario; returns 0 when the broker detected every case, else 1."""
    if out.exists() and any(out.iterdir()):
        print(f"chaos: output dir {out} is not empty", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    print(f"chaos corrupt: seed={seed} out={out}", flush=True)
    rng = random.Random(f"cursus-chaos-corrupt:{seed}")
    results = []
    for index, case in enumerate(CORRUPTION_CASES):
        node = Node(index, out / case, settings={"log_segment_bytes": 16 * 1024,
                                                 "log_recovery_point_interval_ms": 50})
        try:
            results.append(_corruption_case(case, node, rng))
        except Exception as exc:  # noqa: BLE001 - report and go on with the other cases
            results.append({"case": case, "passed": False, "error": f"{type(exc).__name__}: {exc}"})
        finally:
            node.stop()
    passed = all(r["passed"] for r in results)
    doc = {"scenario": "corruption", "seed": seed, "valid": passed, "cases": results,
           "reproduce": f"python -m chaos corrupt --seed {seed} --out {out}"}
    (out / "report.json").write_text(json.dumps(doc, indent=2) + "\n")
    lines = [f"chaos corrupt: {'VALID' if passed else 'VIOLATIONS FOUND'} seed={seed}"]
    for r in results:
        lines.append(f"  {r['case']:18s} {'ok' if r['passed'] else 'FAILED'}: {r.get('outcome') or r.get('error')}")
    text = "\n".join(lines)
    (out / "summary.txt").write_text(text + "\n")
    print(text, flush=True)
    return 0 if passed else 1


def _corruption_case(case: str, node: Node, rng: random.Random) -> dict[str, Any]:
    from cursus.client.connection import Connection
    from cursus.wire import Batch, Command, Record, encode_batch

    node.start()
    topic = "rot"
    acked: dict[int, bytes] = {}
    with Connection(*node.address, timeout_s=10) as conn:
        reply = conn.command(f"CREATE topic={topic} partitions=1")
        assert reply.payload.startswith(b"OK"), reply.payload[:200]
        for batch_index in range(40):
            values = [f"v{batch_index}-{i}-".encode() + b"x" * rng.randint(50, 400) for i in range(5)]
            records = [Record(topic=topic, partition=0, payload=v) for v in values]
            frame = conn.request(Command.PUBLISH, encode_batch(Batch(topic, 0, "all", records)))
            last = json.loads(frame.payload)["last_offset"]
            for i, value in enumerate(values):
                acked[last - len(values) + 1 + i] = value
    end = max(acked) + 1
    part = faults.partition_dir(node.data_dir, topic, 0)
    deadline = time.monotonic() + 15
    while int(faults.read_checkpoint(part).get("recovery_point", 0)) < end:
        if time.monotonic() > deadline:
            raise AssertionError(f"recovery point never reached {end}")
        time.sleep(0.05)
    if case == "old-segment-flip":
        node.stop()
    else:
        node.kill()
    damage = corrupt(case, part, rng)
    code, output = node.start_expecting_exit()
    result: dict[str, Any] = {"case": case, "damage": damage, "exit_code": code,
                              "output_tail": output.strip().splitlines()[-3:]}
    named = Path(damage["file"]).name in output
    refused_start = code not in (None, 0)
    if refused_start:
        result["passed"] = named
        result["outcome"] = ("refused to start, naming the damaged file" if named else
                             "refused to start but the message does not name the damaged file")
        return result
    if case != "old-segment-flip":
        result["passed"] = False
        result["outcome"] = "started on corrupt acknowledged data below the recovery point"
        return result
    wrong, refused = _read_back(node, topic, acked)
    damaged = list(range(damage["chunk_base_offset"], damage["chunk_base_offset"] + damage["chunk_records"]))
    result.update({"refused_offsets": refused, "damaged_offsets": damaged, "wrong_offsets": wrong})
    result["passed"] = not wrong and refused == damaged
    result["outcome"] = (f"started (the clean shutdown is trusted); reads of offsets {refused} refused "
                         f"(damaged chunk: {damaged}); {len(wrong)} wrong records served"
                         + (f": {wrong[:5]}" if wrong else ""))
    return result


def _read_back(node: Node, topic: str, acked: dict[int, bytes]) -> tuple[list[int], list[int]]:
    """Read every acknowledged offset; return (offsets served with wrong bytes, offsets refused).

    A read whose range covers a damaged chunk fails as a whole, so after an error the offset is read
    again alone: only offsets that fail by themselves count as refused.
    """
    from cursus.client.connection import Connection
    from cursus.wire import Status, decode_batch

    wrong: list[int] = []
    refused: list[int] = []
    conn = Connection(*node.address, timeout_s=10)
    try:
        offset = 0
        batch = 500
        while offset < max(acked) + 1:
            frame = conn.command(f"CONSUME topic={topic} partition=0 offset={offset} batch={batch}")
            if frame.status == Status.ERROR:
                if batch == 1:
                    refused.append(offset)
                    offset += 1
                batch = 1
                continue
            batch = 500
            records = decode_batch(frame.payload).records if frame.payload else []
            if not records:
                break
            for r in records:
                if acked.get(r.offset) != r.payload:
                    wrong.append(r.offset)
            offset = records[-1].offset + 1
    finally:
        conn.close()
    return wrong, refused


def corrupt(case: str, part: Path, rng: random.Random) -> dict[str, Any]:
    """Damage acknowledged (fsynced, below the recovery point) data of a partition for ``case``."""
    segments = faults.segment_files(part)
    target = segments[0] if case == "old-segment-flip" else segments[-1]
    if case == "old-segment-flip" and len(segments) < 2:
        raise AssertionError("the scenario needs at least two segments")
    data = bytearray(target.read_bytes())
    chunks, _ = faults.walk_chunks(bytes(data))
    assert chunks, f"no chunk in {target}"
    chunk = rng.choice(chunks)
    if case == "header-flip":
        position = chunk.position + rng.choice((0, 5, 13, 17, 29, 33))  # magic, offset, count, length, epoch, crc
    elif case == "truncate-acked":
        position = chunk.position + rng.randint(1, chunk.length - 1)
        target.write_bytes(bytes(data[:position]))
        return {"file": str(target), "truncated_at": position, "chunk_base_offset": chunk.base_offset,
                "chunk_records": chunk.record_count}
    else:
        position = chunk.position + faults.CHUNK_HEADER_SIZE + rng.randrange(chunk.length - faults.CHUNK_HEADER_SIZE)
    data[position] ^= 1 << rng.randrange(8)
    target.write_bytes(bytes(data))
    return {"file": str(target), "flipped_byte": position, "chunk_base_offset": chunk.base_offset,
            "chunk_records": chunk.record_count}


# ------------------------------------------------------------------------------------------ check


def recheck(out: Path) -> int:
    """Re-run the checkers on a finished run directory; print the summary; return the exit code."""
    ops = load_history(out / "history.jsonl")
    fault_records = faults.load_faults(out / "faults.jsonl") if (out / "faults.jsonl").exists() else []
    previous = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    meta = {k: previous.get(k) for k in ("seed", "nodes", "duration_s", "faults_enabled", "reproduce",
                                         "schedule_length")}
    meta["out"] = str(out)
    doc = report.build(meta, ops, checkers.run_all(ops), fault_records, workloads=previous.get("workloads", {}),
                       errors=previous.get("errors", []), harness_errors=previous.get("harness_errors", []))
    print(report.summary(doc))
    return report.exit_code(doc)


# ------------------------------------------------------------------------------------------ cli


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m chaos`` argument parser."""
    parser = argparse.ArgumentParser(prog="python -m chaos", description="Cursus-py chaos harness")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run workloads under a seeded fault schedule and check the history")
    p.add_argument("--nodes", type=int, default=1, help="broker nodes (default 1)")
    p.add_argument("--duration", type=float, default=60.0, help="workload seconds (default 60)")
    p.add_argument("--faults", default=DEFAULT_FAULTS, help=f"comma-separated fault kinds (default {DEFAULT_FAULTS})")
    p.add_argument("--seed", type=int, default=None, help="schedule seed (default: random, printed)")
    p.add_argument("--out", type=Path, default=None, help="output dir (default chaos-out/<time>-run-seed<N>)")
    p.add_argument("--settle", type=float, default=3.0, help="fault-free seconds before the drain (default 3)")
    p.add_argument("--keep-data", action="store_true", help="keep broker data dirs after a valid run")
    p.add_argument("--no-groups", action="store_true", help="do not run the group-consumer workload")
    p.add_argument("--settle-timeout", type=float, default=30.0,
                   help="cluster: max seconds to wait after the heal for leaders and full ISRs (default 30)")
    c = sub.add_parser("corrupt", help="corruption-detection scenario")
    c.add_argument("--seed", type=int, default=None)
    c.add_argument("--out", type=Path, default=None)
    k = sub.add_parser("check", help="re-run the checkers on a run directory")
    k.add_argument("dir", type=Path)
    s = sub.add_parser("schedule", help="print the fault schedule of a seed")
    s.add_argument("--seed", type=int, required=True)
    s.add_argument("--duration", type=float, default=60.0)
    s.add_argument("--faults", default=DEFAULT_FAULTS)
    s.add_argument("--nodes", type=int, default=1)
    return parser


def _default_out(kind: str, seed: int) -> Path:
    return Path("chaos-out") / f"{time.strftime('%Y%m%d-%H%M%S')}-{kind}-seed{seed}"


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through run()'s finally: brokers are stopped, files closed


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    if args.command == "schedule":
        kinds = schedule.parse_kinds(args.faults, args.nodes)
        targets = 2 * PARTITIONS
        for spec in schedule.build_schedule(args.seed, args.duration, kinds, args.nodes, targets):
            print(json.dumps(spec.to_json()))
        return 0
    if args.command == "check":
        return recheck(args.dir)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 1 << 31)
    if args.command == "corrupt":
        return run_corruption(seed, args.out or _default_out("corrupt", seed))
    try:
        kinds = schedule.parse_kinds(args.faults, args.nodes) if args.faults != "none" else ()
    except ValueError as exc:
        print(f"chaos: {exc}", file=sys.stderr)
        return 2
    if args.nodes < 1 or args.duration <= 0:
        print("chaos: --nodes must be >= 1 and --duration > 0", file=sys.stderr)
        return 2
    if args.nodes > 1:
        from chaos.netns import NetworkUnavailable, reexec_in_namespace

        try:
            fixed = ["--seed", str(seed), "--out", str(args.out or _default_out("run", seed))]
            reexec_in_namespace([*(argv if argv is not None else sys.argv[1:]), *fixed])  # returns only inside
        except NetworkUnavailable as exc:
            print(f"chaos: {exc}", file=sys.stderr)
            return 2
    options = RunOptions(nodes=args.nodes, duration_s=args.duration, faults=kinds, seed=seed,
                         out=args.out or _default_out("run", seed), settle_s=args.settle, keep_data=args.keep_data,
                         groups=not args.no_groups, settle_timeout_s=args.settle_timeout)
    return run(options)


if __name__ == "__main__":
    sys.exit(main())
