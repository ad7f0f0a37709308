"""Checkers: pure functions from a history (paired :class:`chaos.history.Op` list) to anomalies.

Each checker looks for one kind of anomaly and returns :class:`Anomaly` objects with the evidence (values,
offsets, operation ids and times). No I/O, no clocks: the unit tests feed them synthetic histories.

What the checkers rely on (see ``docs/chaos.md`` for the operation values):

* every value written is unique (``<process>:<n>``), so a value identifies its write;
* ``send`` ops name topic, partition, key and values; an ``ok`` send carries the offsets the broker
  acknowledged; ``fail`` means certainly not written, ``info`` unknown;
* ``read`` ops name topic, partition, requested offset and session; an ``ok`` read carries
  ``records`` ``[[offset, value, key], ...]``; the final drain's reads carry ``final: true`` and come from
  the process ``drain``;
* ``list-offsets`` ok results carry ``partitions: {"0": {earliest, latest, leo, hwm}}``;
* ``commit`` values carry group, topic, partition and the committed next offset; ``fetch-offset`` results
  carry ``offset``;
* group consumers' reads carry ``group``.

Every acknowledged write must survive (acks=1 and acks=all alike: this broker acknowledges both only
after fsync) -- standalone. In a cluster (a history with ``cluster-status`` operations) an acks=1
acknowledgement means "fsynced on the leader" only: a leader loss may drop it, so acks=1 losses are reported
separately (``acks1-losses``, informational, :data:`INFORMATIONAL`) and acks=1 acknowledged positions are
not evidence for ``inconsistent-offsets``.

Cluster-only operations:

* ``cluster-status`` (process ``status-<i>``): result ``{raft_leader, raft_term, applied, revision, partitions:
  {"topic/p": {leader, leader_epoch, committed_hwm, isr}}}`` (``revision``: the metadata revision of the
  partition view, which may trail ``applied``); ``value.final`` marks the polls after the heal;
* ``replica-log`` (process ``inspect``): value ``{topic, partition, replica, committed_hwm}``, result
  ``{chunks: [[base, count, digest], ...], end}`` read from each replica's files after the final stop.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from chaos.history import FAIL, OK, Op

DRAIN = "drain"


@dataclass(slots=True)
class Anomaly:
    """One violation found by a checker.

    Attributes:
        kind: the checker's name (``lost-writes`` ...).
        message: one line for humans.
        start, end: the time window the evidence comes from (used to list the faults active then).
        details: evidence (values, offsets, operation ids, times).
    """

    kind: str
    message: str
    start: float
    end: float
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (infinite times become None)."""
        return {"kind": self.kind, "message": self.message, "start": _finite(self.start),
                "end": _finite(self.end), "details": self.details}


def _finite(value: float) -> float | None:
    return None if math.isinf(value) else round(value, 6)


def _op_ref(op: Op) -> dict[str, Any]:
    return {"op": op.id, "process": op.process, "type": op.type, "start": _finite(op.start), "end": _finite(op.end)}


def ok_ops(ops: Iterable[Op], f: str) -> list[Op]:
    """The ``ok`` operations of kind ``f``."""
    return [op for op in ops if op.f == f and op.type == OK]


def read_records(op: Op) -> list[list[Any]]:
    """The ``[[offset, value, key], ...]`` of an ok read (empty otherwise)."""
    if op.f != "read" or op.type != OK:
        return []
    return list(op.result.get("records") or [])


def is_cluster(ops: Iterable[Op]) -> bool:
    """True for the history of a cluster run (it has ``cluster-status`` operations)."""
    return any(op.f == "cluster-status" for op in ops)


def durable_ack(op: Op, cluster: bool) -> bool:
    """True when an ok send's acknowledgement promises durability: always standalone, acks=all in a cluster."""
    return not cluster or op.value.get("acks") in ("all", "-1")


def ack_positions(op: Op) -> list[tuple[int, str]]:
    """``[(offset, value), ...]`` an ok send was acknowledged at."""
    if op.f != "send" or op.type != OK:
        return []
    offsets = op.result.get("offsets") or []
    values = op.value.get("values") or []
    return list(zip(offsets, values, strict=False))


# ------------------------------------------------------------------------------------------ writes


def check_lost_writes(ops: list[Op]) -> list[Anomaly]:
    """Acknowledged values that the final drain never saw.

    The final drain reads every partition from its log start to its HWM (process ``drain``). A value whose
    send was acknowledged (``ok``) must be there.
    """
    drained: set[str] = set()
    seen_earlier: dict[str, Op] = {}
    drained_partitions = {(op.value.get("topic"), op.value.get("partition")) for op in ops
                          if op.process == DRAIN and op.value.get("final") and op.f == "read" and op.type == OK}
    incomplete = {(op.value.get("topic"), op.value.get("partition")): op.value for op in ops
                  if op.process == DRAIN and op.f == "drain-incomplete"}  # chaos.workloads.drain gave up
    for op in ops:
        for record in read_records(op):
            if op.process == DRAIN and op.value.get("final"):
                drained.add(record[1])
            else:
                seen_earlier.setdefault(record[1], op)
    out = []
    cluster = is_cluster(ops)
    for op in ok_ops(ops, "send"):
        if not durable_ack(op, cluster):
            continue  # cluster acks=1: see check_acks1_losses
        for offset, value in ack_positions(op):
            if value in drained:
                continue
            details: dict[str, Any] = {"value": value, "topic": op.value.get("topic"),
                                       "partition": op.value.get("partition"), "acked_offset": offset,
                                       "acks": op.value.get("acks"), "send": _op_ref(op)}
            if value in seen_earlier:
                details["read_before_drain_by"] = _op_ref(seen_earlier[value])
            key = (op.value.get("topic"), op.value.get("partition"))
            cut = incomplete.get(key)
            undrained = key not in drained_partitions or (cut is not None and (
                cut.get("position") is None or offset >= cut["position"]))
            details["partition_drained"] = not undrained
            if cut is not None:
                details["drain_incomplete"] = {"position": cut.get("position"), "hwm": cut.get("hwm"),
                                               "reason": cut.get("reason")}
            out.append(Anomaly("lost-writes", f"acknowledged value {value} (offset {offset}) is missing from the "
                               f"final drain of {op.value.get('topic')}/{op.value.get('partition')}"
                               + (" (the drain could not read that partition)" if undrained else ""),
                               op.start, op.end, details))
    return out


def check_acks1_losses(ops: list[Op]) -> list[Anomaly]:
    """Cluster runs: acks=1 acknowledged values missing from the final drain (allowed under leader loss;
    informational, listed with the faults active around them). Empty for standalone histories."""
    if not is_cluster(ops):
        return []
    drained = {r[1] for op in ops if op.process == DRAIN and op.value.get("final") for r in read_records(op)}
    out = []
    for op in ok_ops(ops, "send"):
        if durable_ack(op, True):
            continue
        for offset, value in ack_positions(op):
            if value not in drained:
                out.append(Anomaly("acks1-losses", f"acks=1 value {value} (acknowledged at offset {offset}) is not in "
                                   f"the final drain of {op.value.get('topic')}/{op.value.get('partition')}",
                                   op.start, op.end, {"value": value, "acked_offset": offset, "send": _op_ref(op)}))
    return out


def check_duplicates(ops: list[Op]) -> list[Anomaly]:
    """Values stored at more than one (topic, partition, offset).

    Idempotent producers retry with the same sequence numbers, so a duplicate of their value is a broken
    de-duplication. acks=1 producers never resend, so any duplicate of theirs is a broken log.
    """
    sends = {v: op for op in ops if op.f == "send" for v in op.value.get("values") or []}
    positions: dict[str, dict[tuple[str, int, int], Op]] = defaultdict(dict)
    for op in ops:
        for record in read_records(op):
            positions[record[1]].setdefault((op.value.get("topic"), op.value.get("partition"), record[0]), op)
    out = []
    for value, where in positions.items():
        if len(where) < 2:
            continue
        send = sends.get(value)
        observers = list(where.values())
        out.append(Anomaly(
            "duplicates", f"value {value} is stored at {len(where)} positions: "
            + ", ".join(f"{t}/{p}@{o}" for t, p, o in sorted(where)),
            min(o.start for o in observers), max(o.end for o in observers),
            {"value": value, "positions": [list(k) for k in sorted(where)],
             "idempotent": bool(send.value.get("idempotent")) if send else None,
             "send": _op_ref(send) if send else None, "reads": [_op_ref(o) for o in observers[:4]]}))
    return out


def check_inconsistent_offsets(ops: list[Op]) -> list[Anomaly]:
    """Two observations of one (topic, partition, offset) that disagree on the value.

    Observations are read records and acknowledged offsets (an ack says "value v is at offset o").
    """
    seen: dict[tuple[str, int, int], tuple[str, Op, str]] = {}
    out = []

    def observe(key: tuple[str, int, int], value: str, op: Op, how: str) -> None:
        """Remember the first observation of ``key``; report any later one that differs."""
        first = seen.get(key)
        if first is None:
            seen[key] = (value, op, how)
            return
        if first[0] == value:
            return
        out.append(Anomaly(
            "inconsistent-offsets", f"{key[0]}/{key[1]}@{key[2]}: {first[2]} {first[0]!r} but {how} {value!r}",
            min(first[1].start, op.start), max(first[1].end, op.end),
            {"topic": key[0], "partition": key[1], "offset": key[2], "first": {"value": first[0], "how": first[2],
             **_op_ref(first[1])}, "second": {"value": value, "how": how, **_op_ref(op)}}))

    cluster = is_cluster(ops)
    for op in sorted(ops, key=lambda o: (o.end, o.id)):
        topic, partition = op.value.get("topic"), op.value.get("partition")
        for offset, value in ack_positions(op) if durable_ack(op, cluster) else []:
            observe((topic, partition, offset), value, op, "acknowledged")
        for record in read_records(op):
            observe((topic, partition, record[0]), record[1], op, "read")
    return out


# ------------------------------------------------------------------------------------------ reads


def check_session_order(ops: list[Op]) -> list[Anomaly]:
    """Within a read session, every ok read must return offsets from the requested one, consecutively.

    A session (``value.session``) reads one partition forward: each read asks for the offset after the last
    record of the previous read. Records going back is *non-monotonic*; a gap is a *skip*.
    """
    sessions: dict[tuple[str, str], list[Op]] = defaultdict(list)
    for op in ops:
        if op.f == "read" and op.type == OK and op.value.get("session"):
            sessions[(op.process, op.value["session"])].append(op)
    out = []
    for (process, session), reads in sessions.items():
        expected: int | None = None
        for op in sorted(reads, key=lambda o: (o.start, o.id)):
            requested = int(op.value.get("offset", 0))
            if expected is None or requested != expected:
                expected = requested
            for record in read_records(op):
                offset = int(record[0])
                if offset != expected:
                    what = "non-monotonic" if offset < expected else "skip"
                    out.append(Anomaly(
                        "session-order", f"{what} read in session {session}: expected offset {expected}, got "
                        f"{offset} ({op.value.get('topic')}/{op.value.get('partition')})",
                        op.start, op.end,
                        {"what": what, "session": session, "process": process, "topic": op.value.get("topic"),
                         "partition": op.value.get("partition"), "requested": requested, "expected": expected,
                         "got": offset, "read": _op_ref(op)}))
                expected = offset + 1
    return out


def check_unexpected_values(ops: list[Op]) -> list[Anomaly]:
    """Reads returning values nobody wrote, values of writes that failed, values in the wrong partition or
    under the wrong key, and replies that did not decode (wrong bytes served)."""
    sends = {v: op for op in ops if op.f == "send" for v in op.value.get("values") or []}
    out = []
    for op in ops:
        if op.f != "read" or op.type != OK:
            continue
        topic, partition = op.value.get("topic"), op.value.get("partition")
        if op.result.get("corrupt"):
            out.append(Anomaly("unexpected-values", f"undecodable CONSUME reply for {topic}/{partition}: "
                               f"{op.result['corrupt']}", op.start, op.end,
                               {"what": "corrupt reply", "topic": topic, "partition": partition, "read": _op_ref(op),
                                "payload_head": op.result.get("payload_head")}))
        for offset, value, *rest in read_records(op):
            key = rest[0] if rest else None
            send = sends.get(value)
            what = None
            if send is None:
                what = "value nobody wrote"
            elif send.type == FAIL:
                what = "value of a write that failed"
            elif (send.value.get("topic"), send.value.get("partition")) != (topic, partition):
                what = f"value written to {send.value.get('topic')}/{send.value.get('partition')}"
            elif send.value.get("key") != key:
                what = f"key {key!r} but written with key {send.value.get('key')!r}"
            if what is None:
                continue
            details = {"what": what, "value": value, "topic": topic, "partition": partition, "offset": offset,
                       "key": key, "read": _op_ref(op)}
            if send is not None:
                details["send"] = _op_ref(send)
            out.append(Anomaly("unexpected-values", f"{topic}/{partition}@{offset}: {value!r}: {what}",
                               op.start, op.end, details))
    return out


class PrefixMax:
    """The largest value among observations that completed strictly before a given time.

    Built once from ``(end, value, op)`` triples; :meth:`before` is a bisect. Used for real-time order:
    an observation bounds a later operation only if it completed before that operation was invoked.
    """

    def __init__(self, observations: Iterable[tuple[float, int, Op]]) -> None:
        ordered = sorted(observations, key=lambda o: o[0])
        self.ends = [o[0] for o in ordered]
        self.best: list[tuple[int, Op]] = []
        for _, value, op in ordered:
            if not self.best or value > self.best[-1][0]:
                self.best.append((value, op))
            else:
                self.best.append(self.best[-1])

    def before(self, time: float) -> tuple[int, Op] | None:
        """The largest ``(value, op)`` whose end is < ``time``, or None."""
        index = bisect.bisect_left(self.ends, time)
        return self.best[index - 1] if index > 0 else None


def check_offsets_monotonic(ops: list[Op]) -> list[Anomaly]:
    """HWM (``hwm``, ``latest``) and log start (``earliest``) must never go back in LIST_OFFSETS.

    Compared in real-time order: an observation counts against a later LIST_OFFSETS only if it completed
    before that LIST_OFFSETS was sent. Reads and acks=all acknowledgements are lower bounds on the HWM
    (acks=1 is not: in a cluster it completes before the HWM moves).
    """
    observations: dict[tuple[str, str, int], list[tuple[float, int, Op]]] = defaultdict(list)
    checks: list[tuple[tuple[str, int], Op, dict[str, int]]] = []
    for op in ops:
        if op.type != OK:
            continue
        topic = op.value.get("topic")
        if op.f == "list-offsets":
            for partition, entry in (op.result.get("partitions") or {}).items():
                checks.append(((topic, int(partition)), op, entry))
                observations[("hwm", topic, int(partition))].append((op.end, min(entry["hwm"], entry["latest"]), op))
                observations[("earliest", topic, int(partition))].append((op.end, entry["earliest"], op))
        elif op.f == "read" and read_records(op):
            last = int(read_records(op)[-1][0])
            observations[("hwm", topic, op.value.get("partition"))].append((op.end, last + 1, op))
        elif op.f == "send" and op.value.get("acks") in ("all", "-1") and op.result.get("offsets"):
            observations[("hwm", topic, op.value.get("partition"))].append((op.end, max(op.result["offsets"]) + 1, op))
    bounds = {key: PrefixMax(obs) for key, obs in observations.items()}
    out = []
    for (topic, partition), op, entry in checks:
        for field_name, bound_kind in (("hwm", "hwm"), ("latest", "hwm"), ("earliest", "earliest")):
            best = bounds[(bound_kind, topic, partition)].before(op.start)
            if best is None or entry[field_name] >= best[0]:
                continue
            out.append(Anomaly(
                "offsets-backwards", f"{topic}/{partition}: LIST_OFFSETS {field_name}={entry[field_name]} "
                f"after {best[1].f} op {best[1].id} showed {bound_kind} >= {best[0]}",
                best[1].start, op.end,
                {"topic": topic, "partition": partition, "field": field_name, "observed": entry[field_name],
                 "earlier_bound": best[0], "list_offsets": _op_ref(op), "earlier": _op_ref(best[1])}))
    return out


# ------------------------------------------------------------------------------------------ groups


def _group_key(op: Op) -> tuple[str, str, int]:
    return op.value.get("group"), op.value.get("topic"), int(op.value.get("partition", -1))


def check_committed_regressions(ops: list[Op]) -> list[Anomaly]:
    """A group's committed offset must never go back.

    After a commit of ``n`` is acknowledged, or a FETCH_OFFSET returned ``n``, every FETCH_OFFSET sent later
    must return at least ``n``.
    """
    bounds: dict[tuple[str, str, int], list[tuple[float, int, Op]]] = defaultdict(list)
    fetches: list[tuple[tuple[str, str, int], Op]] = []
    for op in ops:
        if op.type != OK:
            continue
        if op.f == "commit":
            bounds[_group_key(op)].append((op.end, int(op.value["offset"]), op))
        elif op.f == "fetch-offset":
            bounds[_group_key(op)].append((op.end, int(op.result["offset"]), op))
            fetches.append((_group_key(op), op))
    prefix = {key: PrefixMax(obs) for key, obs in bounds.items()}
    out = []
    for key, fetch in fetches:
        best = prefix[key].before(fetch.start)
        got = int(fetch.result["offset"])
        if best is not None and got < best[0]:
            out.append(Anomaly(
                "committed-offset-regressions", f"group {key[0]} {key[1]}/{key[2]}: FETCH_OFFSET returned {got} after "
                f"{best[1].f} op {best[1].id} established {best[0]}", best[1].start, fetch.end,
                {"group": key[0], "topic": key[1], "partition": key[2], "fetched": got, "earlier": best[0],
                 "fetch": _op_ref(fetch), "earlier_op": _op_ref(best[1])}))
    return out


def check_undelivered_committed(ops: list[Op]) -> list[Anomaly]:
    """Offsets below a group's committed offset that no member of the group was ever delivered.

    Members commit ``lastProcessedOffset + 1`` after processing, so every offset from the log start up to
    the committed offset must have been returned to some member (at-least-once).
    """
    committed: dict[tuple[str, str, int], tuple[int, Op]] = {}
    delivered: dict[tuple[str, str, int], set[int]] = defaultdict(set)
    earliest: dict[tuple[str, int], int] = {}
    for op in ops:
        if op.type != OK:
            continue
        if op.f == "commit":
            value = int(op.value["offset"])
        elif op.f == "fetch-offset":
            value = int(op.result["offset"])
        elif op.f == "read" and op.value.get("group"):
            delivered[_group_key(op)].update(int(r[0]) for r in read_records(op))
            continue
        elif op.f == "list-offsets" and op.process == DRAIN:
            for partition, entry in (op.result.get("partitions") or {}).items():
                earliest[(op.value.get("topic"), int(partition))] = int(entry["earliest"])
            continue
        else:
            continue
        key = _group_key(op)
        if key not in committed or value > committed[key][0]:
            committed[key] = (value, op)
    out = []
    for key, (value, source) in committed.items():
        start = earliest.get((key[1], key[2]), 0)
        missing = [o for o in range(start, value) if o not in delivered[key]]
        if not missing:
            continue
        out.append(Anomaly(
            "undelivered-committed", f"group {key[0]} committed {key[1]}/{key[2]} up to {value} but "
            f"{len(missing)} offsets below it were never delivered (first {missing[0]})",
            source.start, source.end,
            {"group": key[0], "topic": key[1], "partition": key[2], "committed": value, "missing_count": len(missing),
             "missing_first": missing[:20], "committed_by": _op_ref(source)}))
    return out


# ------------------------------------------------------------------------------------------ cluster


def status_freshness(result: dict[str, Any]) -> tuple[int, int]:
    """Sort key of a ``cluster-status`` result: its metadata ``revision`` first (the version of the partition
    view it reports; -1 when absent), then the Raft ``applied`` index (read live, so it may be ahead of that
    view)."""
    revision = result.get("revision")
    return (int(revision) if revision is not None else -1, int(result.get("applied") or 0))


def _final_status(ops: list[Op]) -> Op | None:
    finals = [op for op in ops if op.f == "cluster-status" and op.type == OK and op.value.get("final")]
    return max(finals, key=lambda o: (status_freshness(o.result), o.end)) if finals else None


def check_leaderless(ops: list[Op]) -> list[Anomaly]:
    """A partition still without a leader in the freshest CLUSTER_STATUS after the heal and settle.

    Also an anomaly: a cluster history whose final polls (``value.final``) never got an answer.
    """
    if not is_cluster(ops):
        return []
    final = _final_status(ops)
    if final is None:
        polls = [op for op in ops if op.f == "cluster-status" and op.value.get("final")]
        if not polls:
            return []
        return [Anomaly("leaderless", "no node answered CLUSTER_STATUS after the heal", polls[0].start,
                        polls[-1].end, {"polls": len(polls)})]
    out = []
    for key, entry in sorted((final.result.get("partitions") or {}).items()):
        if not entry.get("leader"):
            out.append(Anomaly("leaderless", f"{key} has no leader after the heal and settle", final.start, final.end,
                               {"partition": key, "status": entry, "poll": _op_ref(final),
                                "applied": final.result.get("applied")}))
    return out


def check_metadata_monotonic(ops: list[Op]) -> list[Anomaly]:
    """Committed HWM and leader epoch in CLUSTER_STATUS must never go back along the metadata history.

    Observations are ordered by the metadata ``revision`` the reply reports (:attr:`MetadataState.revision`):
    the state at revision ``r`` is the same on every node, so polls of all nodes are comparable. A higher
    revision with a lower ``committed_hwm`` (or ``leader_epoch``) than a lower revision is a regression, and
    two polls of the same revision with different values are a divergence (nodes applied different states).

    The Raft ``applied`` index is *not* an ordering key: the broker reads it live from the Raft thread while
    the partitions come from its event-loop view, which trails it (a restarted or busy node reports a high
    applied index next to an older state). Polls without a revision (a broker that does not report one) are
    therefore not compared.
    """
    series: dict[str, list[tuple[int, float, dict[str, Any], Op]]] = defaultdict(list)
    for op in ops:
        if op.f != "cluster-status" or op.type != OK or op.result.get("revision") is None:
            continue
        revision = int(op.result["revision"])
        for key, entry in (op.result.get("partitions") or {}).items():
            series[key].append((revision, op.end, entry, op))
    out = []
    for key, obs in series.items():
        obs.sort(key=lambda o: (o[0], o[1]))
        for field_name in ("committed_hwm", "leader_epoch"):
            best: tuple[int, int, Op] | None = None  # the highest value seen, at the lowest revision showing it
            same: tuple[int, int, Op] | None = None  # the first value seen at the current revision
            for revision, _, entry, op in obs:
                value = entry.get(field_name)
                if value is None:
                    continue
                value = int(value)
                if same is not None and same[1] == revision and same[0] != value:
                    out.append(Anomaly(
                        "metadata-backwards", f"{key}: {field_name}={value} at metadata revision {revision}, "
                        f"but {same[0]} at the same revision", same[2].start, op.end,
                        {"partition": key, "field": field_name, "observed": value, "revision": revision,
                         "earlier": same[0], "earlier_revision": revision, "applied": op.result.get("applied"),
                         "poll": _op_ref(op), "earlier_poll": _op_ref(same[2])}))
                elif best is not None and value < best[0] and revision > best[1]:
                    out.append(Anomaly(
                        "metadata-backwards", f"{key}: {field_name}={value} at metadata revision {revision} "
                        f"after {best[0]} at revision {best[1]}", best[2].start, op.end,
                        {"partition": key, "field": field_name, "observed": value, "revision": revision,
                         "earlier": best[0], "earlier_revision": best[1], "applied": op.result.get("applied"),
                         "poll": _op_ref(op), "earlier_poll": _op_ref(best[2])}))
                if same is None or same[1] != revision:
                    same = (value, revision, op)
                if best is None or value > best[0]:
                    best = (value, revision, op)
    return out


def check_replica_divergence(ops: list[Op]) -> list[Anomaly]:
    """Replicas whose log files differ below the committed HWM after the final settle.

    Compares the ``replica-log`` inspections: every replica in the final ISR must hold chunks covering
    ``[first base, committed_hwm)`` and, chunk by chunk, the same bytes (digest) as every other replica.
    """
    by_partition: dict[tuple[str, int], list[Op]] = defaultdict(list)
    unread: list[Op] = []  # inspections that found no log directory
    for op in ops:
        if op.f == "replica-log" and op.type == OK:
            by_partition[(str(op.value.get("topic")), int(op.value.get("partition", 0)))].append(op)
        elif op.f == "replica-log":
            unread.append(op)
    final = _final_status(ops)
    final_parts = (final.result.get("partitions") or {}) if final is not None else {}
    out = []
    for op in unread:  # a replica that is not assigned has no directory; one in the ISR must hold the data
        topic, partition = str(op.value.get("topic")), int(op.value.get("partition", 0))
        hwm = int(op.value.get("committed_hwm") or 0)
        isr = set(final_parts.get(f"{topic}/{partition}", {}).get("isr") or [])
        replica = int(op.value.get("replica", -1))
        if hwm > 0 and f"node-{replica}" in isr:
            out.append(Anomaly("replica-divergence", f"{topic}/{partition}: replica node-{replica} is in the final "
                               f"ISR but holds no log at all, below the committed HWM {hwm} ({op.error})",
                               op.start, op.end, {"topic": topic, "partition": partition, "replica": replica,
                                                  "covered": 0, "committed_hwm": hwm, "isr": sorted(isr)}))
    for (topic, partition), inspections in sorted(by_partition.items()):
        hwm = int(inspections[0].value.get("committed_hwm") or 0)
        isr = set(final_parts.get(f"{topic}/{partition}", {}).get("isr") or [])
        chunk_maps: dict[int, dict[int, tuple[int, str]]] = {}
        for op in inspections:
            replica = int(op.value["replica"])
            chunks = {int(c[0]): (int(c[1]), str(c[2])) for c in op.result.get("chunks") or []}
            chunk_maps[replica] = chunks
            covered = max(int(op.result.get("end") or 0), max((b + c for b, (c, _) in chunks.items()), default=0))
            if covered < hwm and (not isr or f"node-{replica}" in isr):
                out.append(Anomaly("replica-divergence", f"{topic}/{partition}: replica node-{replica} holds offsets "
                                   f"only up to {covered}, below the committed HWM {hwm}", op.start, op.end,
                                   {"topic": topic, "partition": partition, "replica": replica, "covered": covered,
                                    "committed_hwm": hwm, "isr": sorted(isr)}))
        replicas = sorted(chunk_maps)
        for i, a in enumerate(replicas):
            for b in replicas[i + 1:]:
                diff = [base for base in sorted(set(chunk_maps[a]) & set(chunk_maps[b]))
                        if chunk_maps[a][base] != chunk_maps[b][base]]
                only = sorted(set(chunk_maps[a]) ^ set(chunk_maps[b]))
                limit = min(max((x + c for x, (c, _) in chunk_maps[r].items()), default=0) for r in (a, b))
                only = [base for base in only if base < limit]  # boundaries differ inside both logs
                if diff or only:
                    first = (diff + only)[0]
                    out.append(Anomaly(
                        "replica-divergence", f"{topic}/{partition}: replicas node-{a} and node-{b} differ below the "
                        f"committed HWM {hwm} (first at offset {first})", 0.0, 0.0,
                        {"topic": topic, "partition": partition, "replicas": [a, b], "committed_hwm": hwm,
                         "differing_chunks": diff[:10], "unmatched_chunk_bases": only[:10]}))
    return out


# ------------------------------------------------------------------------------------------ all


#: Every checker, by the name used in reports.
def check_txn_reads(ops: list[Op]) -> list[Anomaly]:
    """The transactional workload (:mod:`chaos.txn`): read_committed must never return a value of an aborted
    transaction (an ``ok`` txn whose result is abort, or a ``fail`` one: refused before any decision), nor one
    of a transaction before its END_TXN was even sent (an uncommitted read), nor one value twice. In the final
    reads every value of an acknowledged commit is visible, and an unknown outcome (``info``) is all or
    nothing."""
    txns = {v: op for op in ops if op.f == "txn" for v in op.value.get("values") or []}
    reads = [op for op in ops if op.f == "txn-read" and op.type == OK]
    out: list[Anomaly] = []
    final_seen: dict[str, list[Op]] = defaultdict(list)
    for op in reads:
        positions: dict[str, int] = {}
        for offset, value, _key in op.result.get("records") or []:
            txn = txns.get(value)
            if op.value.get("final"):
                final_seen[value].append(op)
            if value in positions and positions[value] != offset:
                out.append(Anomaly("aborted-or-uncommitted-read", f"txn value {value} read twice in one reply",
                                   op.start, op.end, {"value": value, "offsets": [positions[value], offset],
                                                      "read": _op_ref(op)}))
            positions[value] = offset
            if txn is None:
                out.append(Anomaly("aborted-or-uncommitted-read", f"read_committed returned {value}, which no "
                                   "transaction wrote", op.start, op.end, {"value": value, "read": _op_ref(op)}))
                continue
            aborted = txn.type == FAIL or (txn.type == OK and (txn.result.get("state") == "aborted"
                                                               or txn.value.get("result") == "abort"))
            if aborted:
                out.append(Anomaly("aborted-or-uncommitted-read", f"read_committed returned {value} of an aborted "
                                   "transaction", min(txn.start, op.start), op.end,
                                   {"value": value, "txn": _op_ref(txn), "read": _op_ref(op), "what": "aborted"}))
            elif op.end < txn.start:
                out.append(Anomaly("aborted-or-uncommitted-read", f"read_committed returned {value} before its "
                                   "END_TXN was sent", op.start, txn.start,
                                   {"value": value, "txn": _op_ref(txn), "read": _op_ref(op), "what": "uncommitted"}))
    if any(op.value.get("final") for op in reads):
        for txn in {id(t): t for t in txns.values()}.values():
            values = txn.value.get("values") or []
            visible = [v for v in values if v in final_seen]
            committed = txn.type == OK and txn.result.get("state") == "committed"
            if committed and len(visible) != len(values):
                out.append(Anomaly("aborted-or-uncommitted-read", "an acknowledged commit is not fully visible in "
                                   "the final reads", txn.start, txn.end,
                                   {"txn": _op_ref(txn), "missing": sorted(set(values) - set(visible))}))
            elif txn.type not in (OK, FAIL) and visible and len(visible) != len(values):
                out.append(Anomaly("aborted-or-uncommitted-read", "a transaction of unknown outcome is partly "
                                   "visible", txn.start, txn.end,
                                   {"txn": _op_ref(txn), "visible": visible, "values": values}))
    return out


CHECKERS: dict[str, Callable[[list[Op]], list[Anomaly]]] = {
    "lost-writes": check_lost_writes,
    "duplicates": check_duplicates,
    "inconsistent-offsets": check_inconsistent_offsets,
    "session-order": check_session_order,
    "committed-offset-regressions": check_committed_regressions,
    "undelivered-committed": check_undelivered_committed,
    "unexpected-values": check_unexpected_values,
    "offsets-backwards": check_offsets_monotonic,
    "metadata-backwards": check_metadata_monotonic,
    "leaderless": check_leaderless,
    "replica-divergence": check_replica_divergence,
    "acks1-losses": check_acks1_losses,
    "aborted-or-uncommitted-read": check_txn_reads,
}
#: Checkers whose findings are reported but are not violations (cluster acks=1 losses under leader loss).
INFORMATIONAL = frozenset({"acks1-losses"})


def run_all(ops: list[Op]) -> dict[str, list[Anomaly]]:
    """Run every checker; returns anomalies by checker name (an empty list means clean)."""
    return {name: checker(ops) for name, checker in CHECKERS.items()}
