"""Fault execution: the nemesis thread, the torn-tail damage, and the fault log (``faults.jsonl``).

Every fault is recorded twice: as one line of ``faults.jsonl`` with its start and end time (written when
it ends) and as a ``nemesis`` operation in the history (invoke at the start, ``info`` at the end), so the
history alone shows what was going on. Times share the run clock (:class:`chaos.history.Clock`).

Torn tails (:func:`tear_tail`) damage only bytes past the last position the broker could have fsynced
*as far as anyone can tell*: the tear starts at the first chunk of the partition's last segment whose base
offset is at or above the *safe offset*, the maximum of

* every offset a client saw acknowledged, read, or reported as HWM (``observed``), and
* the recovery point and HWM in the partition's ``checkpoints.json``.

A chunk above that was never acknowledged, never served and is not claimed durable by the broker's own
checkpoint, so losing it is indistinguishable from a crash before its fsync. Cutting below it would be
corruption of acknowledged data, which is a separate scenario (``python -m chaos corrupt``), not a
torn tail.

The on-disk chunk format is parsed here from ``docs/storage.md`` (36-byte big-endian header: magic
``CCK2``, base offset, record count, body length, append time, leader epoch, CRC32C), independently of
``cursus.storage`` so that a bug there cannot hide from the harness.
"""

from __future__ import annotations

import json
import os
import random
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import crc32c

from chaos.history import INFO, OK, Clock, History, Pending
from chaos.nodes import Cluster, NodeStartError
from chaos.schedule import FaultSpec

CHUNK_MAGIC = 0x43434B32
CHUNK_HEADER = struct.Struct(">IQIIqII")
CHUNK_HEADER_SIZE = CHUNK_HEADER.size
CHUNK_CRC_COVERED = 32
CHUNK_BODY_MAX = 256 * 1024 * 1024
#: Prefix of a fault's ``error`` when the fault verifiably did nothing (no packet dropped, the process never
#: stopped or died, no byte damaged): such a run proves nothing and is never valid (:mod:`chaos.report`).
INEFFECTIVE = "ineffective: "
#: Prefix of a nemesis operation's ``error`` in the history when the fault was deliberately not injected.
NOT_APPLICABLE = "not applicable: "
#: A kill's torn tail waits this long for in-flight operations to resolve before computing the safe offset.
QUIESCE_TIMEOUT_S = 10.0


# ------------------------------------------------------------------------------------------ fault log


@dataclass(slots=True)
class ActiveFault:
    """A fault that has started (returned by :meth:`FaultLog.begin`)."""

    id: int
    kind: str
    node: int | None
    start: float
    details: dict[str, Any]
    pending: Pending | None


class FaultLog:
    """Writes ``faults.jsonl`` (one line per fault, with start and end) and mirrors faults into the history.

    Args:
        path: the file to write (truncated), or None to keep records in memory only.
        clock: the run clock.
        history: the run history (nemesis operations are recorded there too), or None.
    """

    def __init__(self, path: Path | None, clock: Clock, history: History | None = None) -> None:
        self.clock = clock
        self.history = history
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._next_id = 1
        self._file: TextIO | None = open(path, "w", encoding="utf-8") if path is not None else None  # noqa: SIM115

    def begin(self, kind: str, node: int | None, details: dict[str, Any] | None = None) -> ActiveFault:
        """Record the start of a fault now."""
        with self._lock:
            fault_id = self._next_id
            self._next_id += 1
        details = dict(details or {})
        pending = None
        if self.history is not None:
            pending = self.history.invoke("nemesis", kind, {"fault": fault_id, "node": node, **details})
        return ActiveFault(fault_id, kind, node, self.clock.now(), details, pending)

    def end(self, active: ActiveFault, details: dict[str, Any] | None = None, error: str | None = None,
            *, not_applicable: str | None = None) -> None:
        """Record the end of ``active`` now, with extra ``details`` and an ``error`` if it went wrong.

        ``not_applicable``: the fault was deliberately not injected because the cluster's state made it
        unsafe (a ``corrupt`` with no replica but the only in-sync copy); recorded as the record's
        ``not_applicable`` reason instead of an ``error`` (see :func:`chaos.report.faults_not_done`).
        """
        record: dict[str, Any] = {"id": active.id, "fault": active.kind, "node": active.node,
                                  "start": round(active.start, 6), "end": round(self.clock.now(), 6),
                                  "details": {**active.details, **(details or {})}}
        if error is not None:
            record["error"] = error
        if not_applicable is not None:
            record["not_applicable"] = not_applicable
        with self._lock:
            self.records.append(record)
            if self._file is not None:
                self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
                self._file.flush()
        if self.history is not None and active.pending is not None:
            self.history.complete(active.pending, INFO, record["details"],
                                  error=error or (NOT_APPLICABLE + not_applicable if not_applicable else "fault ended"))

    def close(self) -> None:
        """Close the file (idempotent)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def load_faults(path: Path) -> list[dict[str, Any]]:
    """The records of a ``faults.jsonl`` file."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line))
    return out


# ------------------------------------------------------------------------------------------ observed


class ObservedEnds:
    """The highest end offset any client observed per (topic, partition), kept up to date from the history.

    Counts acknowledged sends (last offset + 1), records read (last offset + 1) and LIST_OFFSETS HWMs: what
    the outside world knows to be durable. Register :meth:`on_complete` as a history listener.
    """

    def __init__(self) -> None:
        self._ends: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    def on_complete(self, pending: Pending, kind: str, result: dict[str, Any]) -> None:
        """History listener: fold one completion in."""
        if kind != OK:
            return
        topic = pending.value.get("topic")
        partition = pending.value.get("partition")
        if pending.f == "send" and result.get("offsets"):
            self._raise(topic, partition, max(result["offsets"]) + 1)
        elif pending.f == "read" and result.get("records"):
            self._raise(topic, partition, int(result["records"][-1][0]) + 1)
        elif pending.f == "list-offsets":
            for key, entry in (result.get("partitions") or {}).items():
                self._raise(topic, int(key), int(entry["hwm"]))

    def _raise(self, topic: str, partition: int, end: int) -> None:
        with self._lock:
            if end > self._ends.get((topic, partition), 0):
                self._ends[(topic, partition)] = end

    def end(self, topic: str, partition: int) -> int:
        """The highest observed end offset of the partition (0 if nothing was observed)."""
        with self._lock:
            return self._ends.get((topic, partition), 0)


# ------------------------------------------------------------------------------------------ chunks


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk found in a segment file: byte ``position``, ``length`` (header + body), offsets."""

    position: int
    length: int
    base_offset: int
    record_count: int
    crc_ok: bool

    @property
    def end_offset(self) -> int:
        """The offset after this chunk's last record."""
        return self.base_offset + self.record_count


def walk_chunks(data: bytes) -> tuple[list[Chunk], int]:
    """Walk the chunks of a segment's bytes from position 0.

    Stops at the first implausible header or a chunk that does not fit. Returns the chunks and the byte
    position where the walk stopped (the end of the last plausible chunk).
    """
    chunks: list[Chunk] = []
    position = 0
    size = len(data)
    while position + CHUNK_HEADER_SIZE <= size:
        magic, base, count, body_length, _, _, crc = CHUNK_HEADER.unpack_from(data, position)
        if magic != CHUNK_MAGIC or count < 1 or body_length < 4 * count or body_length > CHUNK_BODY_MAX:
            break
        end = position + CHUNK_HEADER_SIZE + body_length
        if end > size:
            break
        covered = data[position:position + CHUNK_CRC_COVERED] + data[position + CHUNK_HEADER_SIZE:end]
        chunks.append(Chunk(position, end - position, base, count, crc32c.crc32c(covered) == crc))
        position = end
    return chunks, position


def segment_files(partition_dir: Path) -> list[Path]:
    """The ``.log`` segment files of a partition directory, in offset order."""
    return sorted(partition_dir.glob("*.log"))


def read_checkpoint(partition_dir: Path) -> dict[str, Any]:
    """The partition's ``checkpoints.json`` (empty dict when missing or unreadable)."""
    try:
        return json.loads((partition_dir / "checkpoints.json").read_text())
    except (OSError, ValueError):
        return {}


def partition_dir(data_dir: Path, topic: str, partition: int) -> Path:
    """``<log_dir>/topics/<topic>/<partition>`` (docs/storage.md)."""
    return Path(data_dir) / "topics" / topic / str(partition)


def _rewrite(path: Path, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(0)
        f.write(data)
        f.truncate(len(data))
        f.flush()
        os.fsync(f.fileno())


def tear_tail(part_dir: Path, observed_end: int, mode: str, seed: int) -> dict[str, Any]:
    """Damage the tail of the partition's last segment past its last fsynced position (the node is down).

    Args:
        part_dir: the partition directory.
        observed_end: the highest end offset any client observed (acks, reads, HWM).
        mode: ``cut-chunk`` (cut inside the first unsafe chunk), ``garble-chunk`` (flip bytes in it),
            ``zero-fill`` (zero its tail, as a file system may after a crash) or ``append-garbage``
            (drop the unsafe chunks, append garbage). Without an unsafe chunk every mode appends garbage.
        seed: seed for the positions and bytes.

    Returns:
        What was done: file, sizes, the safe offset and where the tear starts, the offsets dropped.
    """
    rng = random.Random(seed)
    segments = segment_files(part_dir)
    if not segments:
        return {"skipped": "no segment file"}
    checkpoint = read_checkpoint(part_dir)
    safe = max(observed_end, int(checkpoint.get("recovery_point", 0)), int(checkpoint.get("hwm", 0)))
    path = segments[-1]
    data = path.read_bytes()
    chunks, walk_end = walk_chunks(data)
    victims = [c for c in chunks if c.base_offset >= safe]
    victim = victims[0] if victims else None
    effective = mode if victim is not None else "append-garbage"
    cut = victim.position if victim is not None else walk_end
    if effective == "cut-chunk":
        assert victim is not None
        new = data[:victim.position + rng.randint(1, victim.length - 1)]
    elif effective == "garble-chunk":
        assert victim is not None
        chunk = bytearray(data[victim.position:victim.position + victim.length])
        for _ in range(rng.randint(1, 8)):
            chunk[rng.randrange(len(chunk))] ^= rng.randint(1, 255)
        new = data[:victim.position] + bytes(chunk)
    elif effective == "zero-fill":
        assert victim is not None
        keep = rng.randint(0, victim.length - 1)
        new = data[:victim.position + keep] + bytes(victim.length - keep)
    else:
        garbage = bytes(rng.randrange(256) for _ in range(rng.randint(1, 300)))
        if rng.random() < 0.5:  # a torn header that looks like the start of a chunk
            garbage = struct.pack(">IQ", CHUNK_MAGIC, safe) + garbage[:rng.randint(0, 19)]
        new = data[:cut] + garbage
    _rewrite(path, new)
    dropped = [victims[0].base_offset, victims[-1].end_offset] if victims else None
    return {"file": str(path), "mode": effective, "requested_mode": mode, "size_before": len(data),
            "size_after": len(new), "safe_offset": safe, "observed_end": observed_end,
            "recovery_point": checkpoint.get("recovery_point"), "tear_position": cut,
            "dropped_offsets": dropped, "chunks_past_safe": len(victims)}


# ------------------------------------------------------------------------------------------ nemesis


class Nemesis(threading.Thread):
    """Runs the fault schedule against the cluster, one fault at a time.

    Args:
        schedule: the planned faults.
        cluster: the nodes.
        log: the fault log.
        clock: the run clock.
        start_at: clock time the schedule's ``at_s`` counts from (when the workloads started).
        tear_targets: per node index, the (topic, partition) list a torn tail picks from.
        observed_end: ``(topic, partition) -> int``, the highest offset any client observed as durable.
        quiesce: ``(t) -> bool``, waits until no operation invoked before ``t`` is still in flight.
        power_cut: kills lose unsynced bytes (the brokers run with ``lose_unsynced=1``), for the record.
    """

    def __init__(self, schedule: list[FaultSpec], cluster: Cluster, log: FaultLog, clock: Clock, start_at: float,
                 tear_targets: dict[int, list[tuple[str, int]]],
                 observed_end: Callable[[str, int], int], quiesce: Callable[[float], bool],
                 *, power_cut: bool = False, network: Any = None, leaders: Any = None) -> None:
        super().__init__(name="nemesis", daemon=True)
        #: Cluster runs: the :class:`chaos.netns.Network` (partitions) and the
        #: :class:`chaos.cluster.LeaderTracker` (leader kills).
        self.network = network
        self.leaders = leaders
        self.schedule = schedule
        self.cluster = cluster
        self.log = log
        self.clock = clock
        self.start_at = start_at
        self.tear_targets = tear_targets
        self.observed_end = observed_end
        self.quiesce = quiesce
        self.power_cut = power_cut
        self.stop_event = threading.Event()
        #: Problems that make the run invalid (a node that would not restart), as report entries.
        self.errors: list[dict[str, Any]] = []
        self.executed = 0
        #: Cluster ``corrupt``: the safe replica :meth:`_corrupt_target` chose for the next ``_corrupt``.
        self._corrupt_choice: Any = None

    def stop(self) -> None:
        """Ask the nemesis to stop after the current fault (a fault in progress always heals itself)."""
        self.stop_event.set()

    def run(self) -> None:
        """Execute the schedule until it ends, :meth:`stop` is called, or a node fails to restart."""
        for spec in self.schedule:
            delay = self.start_at + spec.at_s - self.clock.now()
            if delay > 0 and self.stop_event.wait(delay):
                return
            if self.stop_event.is_set():
                return
            self.execute(spec)
            self.executed += 1
            if self.errors:
                return

    def resolve(self, spec: FaultSpec) -> tuple[int, dict[str, Any]]:
        """The node a fault hits now: the drawn one, or the current Raft / partition leader for leader kills."""
        if spec.kind != "kill" or spec.target is None:
            return spec.node, {}
        if spec.target == "random" or self.leaders is None:
            return spec.node, {"target": spec.target}
        if spec.target == "raft-leader":
            leader = self.leaders.raft_leader()
            return (spec.node, {"target": "raft-leader", "unknown": True}) if leader is None else (
                leader, {"target": "raft-leader"})
        targets = self.tear_targets.get(spec.node) or []
        if not targets or spec.tear is None:
            return spec.node, {"target": "partition-leader", "unknown": True}
        topic, partition = targets[spec.tear["target"] % len(targets)]
        leader = self.leaders.leader_of(topic, partition)
        info = {"target": "partition-leader", "topic": topic, "partition": partition}
        return (spec.node, {**info, "unknown": True}) if leader is None else (leader, info)

    def execute(self, spec: FaultSpec) -> None:
        """Run one fault now."""
        if spec.kind == "partition":
            self._partition(spec)
            return
        index, why = self.resolve(spec)
        if spec.kind == "corrupt" and self.leaders is not None:
            chosen = self._corrupt_target(spec)
            if chosen is None:
                return
            index, why = chosen
        if index != spec.node:
            spec = FaultSpec(spec.index, spec.at_s, spec.kind, index, spec.hold_s, spec.tear, spec.target, spec.cut)
        self._why = why
        node = self.cluster.nodes[spec.node]
        if node.state == "up" and not node.alive():
            self.errors.append({"fault": spec.kind, "node": spec.node, "schedule_index": spec.index,
                                "time": round(self.clock.now(), 3),
                                "error": f"{node.name} exited on its own before fault {spec.index}",
                                "output": node.tail(40)})
            node.state = "down"
        if node.state != "up":
            active = self.log.begin(spec.kind, spec.node, {"schedule_index": spec.index})
            self.log.end(active, {"skipped": f"{node.name} is {node.state}"}, error="skipped")
            return
        if spec.kind == "pause":
            self._pause(spec)
        elif spec.kind == "restart":
            self._restart(spec)
        elif spec.kind == "corrupt":
            self._corrupt(spec)
        else:
            self._kill(spec)

    def _corrupt_target(self, spec: FaultSpec) -> tuple[int, dict[str, Any]] | None:
        """Cluster ``corrupt``: a fresh CLUSTER_STATUS of every up node, then a replica that is not its
        partition's only in-sync copy (:func:`chaos.targets.choose_corrupt_target`). Returns the node and the
        choice (``details["target"]``), or None after recording the fault as not applicable."""
        from chaos.targets import choose_corrupt_target

        assert spec.tear is not None
        up = {n.index for n in self.cluster.nodes if n.state == "up" and n.alive()}
        for index in sorted(up):  # the freshest view right before the kill (the tracker keeps the freshest)
            self.leaders.poll(index)
        keys = self.tear_targets.get(spec.node) or []
        chosen = choose_corrupt_target(self.leaders.partitions(), self.leaders.ids, up, keys, spec.node,
                                       spec.tear["target"], len(self.cluster))
        drawn = keys[spec.tear["target"] % len(keys)] if keys else None
        if chosen is None:
            active = self.log.begin("corrupt", spec.node, {"schedule_index": spec.index})
            self.log.end(active, {"drawn": list(drawn) if drawn else None, "up": sorted(up)},
                         not_applicable="no replica is safe to corrupt: every partition's ISR holds no up node "
                                        "besides the candidate (corrupting the only in-sync copy proves nothing)")
            return None
        self._corrupt_choice = chosen
        return chosen.node, {"target": {"isr": list(chosen.isr), "leader": chosen.leader,
                                        "follower": chosen.follower,
                                        "drawn": {"node": spec.node, "topic": drawn[0], "partition": drawn[1]}
                                        if drawn else None}}

    def _pause(self, spec: FaultSpec) -> None:
        node = self.cluster.nodes[spec.node]
        pid = node.pid
        active = self.log.begin("pause", spec.node, {"schedule_index": spec.index, "hold_s": spec.hold_s,
                                                     "pid": pid})
        node.pause()
        stopped = False
        try:
            stopped = wait_process_state(pid, "T", 2.0) if pid is not None else False
            time.sleep(spec.hold_s)
        finally:
            node.resume()
        self.log.end(active, {"stopped_verified": stopped},
                     error=None if stopped else INEFFECTIVE + f"{node.name} (pid {pid}) never showed state T")

    def _restart(self, spec: FaultSpec) -> None:
        node = self.cluster.nodes[spec.node]
        old_pid = node.pid
        active = self.log.begin("restart", spec.node, {"schedule_index": spec.index, "pid": old_pid})
        code = node.stop()
        details: dict[str, Any] = {"exit_code": code}
        error = self._start(node, spec, details) or _new_process(node, old_pid, details)
        self.log.end(active, details, error=error)

    def _kill(self, spec: FaultSpec) -> None:
        node = self.cluster.nodes[spec.node]
        details: dict[str, Any] = {"schedule_index": spec.index, "hold_s": spec.hold_s, "pid": node.pid,
                                   "power_cut": self.power_cut and "CURSUS_STORAGE_FAULTS" in node.env,
                                   **getattr(self, "_why", {})}
        old_pid = node.pid
        if details["power_cut"] and old_pid is not None:
            details["power_cut_verified"] = "CURSUS_STORAGE_FAULTS=" in process_environ(old_pid)
        active = self.log.begin(spec.kind, spec.node, details)
        killed_at = self.clock.now()
        proc = node.proc
        node.kill()
        extra: dict[str, Any] = {"exit_signal": -proc.returncode if proc is not None and proc.returncode else None}
        if spec.kind == "torn-tail":
            assert spec.tear is not None
            extra["tear"] = self._tear(spec, killed_at)
        time.sleep(spec.hold_s)
        error = self._start(node, spec, extra)
        if error is None and extra["exit_signal"] != 9:
            error = INEFFECTIVE + f"{node.name} (pid {old_pid}) did not die of SIGKILL (returncode {proc and proc.returncode})"
        if error is None and details.get("power_cut_verified") is False:
            error = INEFFECTIVE + f"{node.name} ran without CURSUS_STORAGE_FAULTS: the kill was no power cut"
        if error is None and "skipped" in (extra.get("tear") or {}):
            error = INEFFECTIVE + f"the tail was not torn: {extra['tear']['skipped']}"
        self.log.end(active, extra, error=error or _new_process(node, old_pid, extra))

    def _partition(self, spec: FaultSpec) -> None:
        """Drop traffic between brokers for ``hold_s`` (nftables rules by address pair), then heal."""
        from chaos.netns import isolate, split

        assert spec.cut is not None
        nodes = len(self.cluster)
        mode, side = spec.cut["mode"], list(spec.cut["side"])
        if mode == "one-way":
            pairs = {(side[0], side[1])}
        elif mode == "split":
            pairs = split(set(side), nodes)
        else:
            pairs = isolate(side[0], nodes)
        details = {"schedule_index": spec.index, "mode": mode, "side": side, "hold_s": spec.hold_s,
                   "drops": sorted([list(p) for p in pairs])}
        active = self.log.begin("partition", side[0], details)
        error = None
        before: dict[tuple[int, int], int] = {}
        try:
            if self.network is None:
                raise RuntimeError("no private network (not a cluster run)")
            before = self.network.dropped()
            if mode == "flap":
                flaps = max(1, int(spec.cut.get("flaps") or 1))
                step = spec.hold_s / (2 * flaps)
                for _ in range(flaps):
                    self.network.set_cuts(pairs)
                    time.sleep(step)
                    self.network.heal()
                    time.sleep(step)
            else:
                self.network.set_cuts(pairs)
                time.sleep(spec.hold_s)
        except Exception as exc:  # noqa: BLE001 - recorded; the run goes on healed
            error = f"{type(exc).__name__}: {exc}"
        finally:
            if self.network is not None:
                try:
                    self.network.heal()
                except Exception as exc:  # noqa: BLE001
                    error = f"heal failed: {exc}"
                    self.errors.append({"fault": "partition", "schedule_index": spec.index, "error": error})
        extra: dict[str, Any] = {}
        if error is None and self.network is not None:
            after = self.network.dropped()
            packets = {f"{a}->{b}": after.get((a, b), 0) - before.get((a, b), 0) for a, b in sorted(pairs)}
            extra["packets_dropped"] = packets
            if not any(packets.values()):
                error = INEFFECTIVE + "no packet was dropped"
        self.log.end(active, extra, error=error)

    def _corrupt(self, spec: FaultSpec) -> None:
        """kill -9 a node, flip bytes in one replica's segment tail, restart: repair or refuse, never serve."""
        import shutil

        assert spec.tear is not None
        node = self.cluster.nodes[spec.node]
        choice = getattr(self, "_corrupt_choice", None)
        self._corrupt_choice = None
        if choice is not None:  # cluster: the safe replica chosen right before this kill
            topic, partition = choice.topic, choice.partition
        else:
            targets = self.tear_targets.get(spec.node) or []
            topic, partition = targets[spec.tear["target"] % len(targets)]
        details: dict[str, Any] = {"schedule_index": spec.index, "pid": node.pid, "topic": topic,
                                   "partition": partition, **getattr(self, "_why", {})}
        active = self.log.begin("corrupt", spec.node, details)
        node.kill()
        part = partition_dir(node.data_dir, topic, partition)
        extra: dict[str, Any] = {"damage": flip_tail(part, spec.tear["seed"])}
        if "skipped" in extra["damage"]:  # nothing damaged: restart, but the fault did not happen
            self.log.end(active, extra, error=self._start(node, spec, extra)
                         or INEFFECTIVE + str(extra["damage"]["skipped"]))
            return
        quarantine = part / "quarantine"  # the broker's repair moves damaged bytes there (cluster)
        before = set(quarantine.iterdir()) if quarantine.is_dir() else set()
        time.sleep(spec.hold_s)
        code, output = node.start_expecting_ready()
        error = None
        if code is None:
            extra["outcome"] = "started (repaired or truncated the damaged tail)"
            repaired = sorted(p.name for p in (set(quarantine.iterdir()) if quarantine.is_dir() else set()) - before)
            extra["repaired"] = repaired[-1] if repaired else None  # None: recovery cut it as a torn tail
        elif code == -1 and "corrupt log data" not in output:
            extra["outcome"] = "neither ready nor exited in time"
            error = f"{node.name} hung on startup after corrupt"
            self.errors.append({"fault": "corrupt", "node": spec.node, "schedule_index": spec.index,
                                "error": error, "output": output[-4000:]})
        else:
            named = bool(extra["damage"].get("file")) and Path(extra["damage"]["file"]).name in output
            extra["outcome"] = (f"refused to start ({'exit ' + str(code) if code != -1 else 'reported the corruption, then hung'})"
                                f"{'' if named else ' without naming the file'}")
            extra["output_tail"] = output.strip().splitlines()[-3:]
            shutil.rmtree(part, ignore_errors=True)  # the operator's repair: drop the bad replica, refetch it
            error = self._start(node, spec, extra)
        self.log.end(active, extra, error=error)

    def _tear(self, spec: FaultSpec, killed_at: float) -> dict[str, Any]:
        assert spec.tear is not None
        targets = self.tear_targets.get(spec.node) or []
        if not targets:
            return {"skipped": "node hosts no partition"}
        topic, partition = targets[spec.tear["target"] % len(targets)]
        if not self.quiesce(killed_at):
            return {"skipped": "operations still in flight; the safe offset is unknown", "topic": topic,
                    "partition": partition}
        node = self.cluster.nodes[spec.node]
        observed = self.observed_end(topic, partition)
        result = tear_tail(partition_dir(node.data_dir, topic, partition), observed, spec.tear["mode"],
                           spec.tear["seed"])
        return {"topic": topic, "partition": partition, **result}

    def _start(self, node: Any, spec: FaultSpec, details: dict[str, Any]) -> str | None:
        started = self.clock.now()
        try:
            node.start()
        except NodeStartError as exc:
            error = f"{node.name} failed to restart after {spec.kind}: {exc}"
            self.errors.append({"fault": spec.kind, "node": spec.node, "schedule_index": spec.index,
                                "time": round(started, 3), "error": error,
                                "output": exc.output[-4000:], "details": details})
            return error
        details["restart_s"] = round(self.clock.now() - started, 3)
        return None


def flip_tail(part_dir: Path, seed: int) -> dict[str, Any]:
    """Flip one bit in one of the last three chunks of a partition's last segment (acknowledged bytes too).

    Returns what was done: ``file``, ``flipped_byte``, ``chunk_base_offset``, ``chunk_records`` (or
    ``skipped`` when there is no chunk).
    """
    rng = random.Random(seed)
    segments = [s for s in segment_files(part_dir) if s.stat().st_size > 0]
    if not segments:
        return {"skipped": f"no segment data in {part_dir}"}
    target = segments[-1]
    data = bytearray(target.read_bytes())
    chunks, _ = walk_chunks(bytes(data))
    if not chunks:
        return {"skipped": f"no chunk in {target}"}
    chunk = rng.choice(chunks[-3:])
    position = chunk.position + CHUNK_HEADER_SIZE + rng.randrange(chunk.length - CHUNK_HEADER_SIZE)
    original = data[position]
    data[position] ^= 1 << rng.randrange(8)
    _rewrite(target, bytes(data))
    with open(target, "rb") as f:  # read back: the damage is on disk
        f.seek(position)
        if f.read(1) == bytes([original]):
            return {"skipped": f"the flip of byte {position} of {target} did not reach the file"}
    return {"file": str(target), "flipped_byte": position, "chunk_base_offset": chunk.base_offset,
            "chunk_records": chunk.record_count}


def wait_process_state(pid: int, states: str, timeout_s: float) -> bool:
    """True once ``/proc/<pid>/stat`` shows one of ``states`` (``T``: stopped) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        if state in states:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def process_environ(pid: int) -> str:
    """The environment of a running process as ``NAME=value`` lines ('' when unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().replace(b"\0", b"\n").decode("utf-8", "replace")
    except OSError:
        return ""


def _new_process(node: Any, old_pid: int | None, details: dict[str, Any]) -> str | None:
    """An ineffective-fault error when a restarted node still runs the old process."""
    details["new_pid"] = node.pid
    if old_pid is not None and node.pid == old_pid:
        return INEFFECTIVE + f"{node.name} still runs pid {old_pid}"
    return None
