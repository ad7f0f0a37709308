"""Chaos harness: each checker catches its anomaly in a synthetic history and passes a clean one; the
schedule is a pure function of the seed; torn tails damage only bytes recovery may legitimately drop."""

from __future__ import annotations

import math
import random
import struct
import time
from pathlib import Path
from typing import Any

import crc32c
import pytest

from chaos import checkers, report, schedule
from chaos.faults import CHUNK_HEADER, CHUNK_MAGIC, ObservedEnds, tear_tail, walk_chunks
from chaos.history import FAIL, INFO, OK, Clock, History, pair
from chaos.nodes import Cluster
from chaos.workloads import (
    Context,
    GroupConsumer,
    GroupGate,
    TopicPlan,
    parse_assignments,
    parse_join,
    parse_list_offsets,
)
from cursus.storage import LogConfig, PartitionLog

T = "t"


class Builder:
    """Synthetic histories: each ``op`` is an invoke at ``start`` and a completion at ``end``."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.next_id = 1
        self.clock = 0.0

    def op(self, process: str, f: str, value: dict[str, Any], result: dict[str, Any] | None = None, *,
           kind: str = OK, start: float | None = None, end: float | None = None, error: str | None = None) -> int:
        if start is None:
            self.clock += 1.0
            start = self.clock
        if end is None:
            self.clock += 1.0
            end = self.clock
        op_id = self.next_id
        self.next_id += 1
        self.events.append({"op": op_id, "type": "invoke", "process": process, "f": f, "time": start,
                            "value": value})
        completion: dict[str, Any] = {"op": op_id, "type": kind, "process": process, "f": f, "time": end,
                                      "value": result or {}}
        if kind != OK:
            completion["error"] = error or "boom"
        self.events.append(completion)
        return op_id

    def send(self, process: str, partition: int, values: list[str], offsets: list[int] | None, *,
             kind: str = OK, idempotent: bool = True, key: str | None = None, **times: float) -> int:
        value = {"topic": T, "partition": partition, "key": key, "values": values,
                 "acks": "all" if idempotent else "1", "idempotent": idempotent}
        return self.op(process, "send", value, {"offsets": offsets} if kind == OK else {}, kind=kind, **times)

    def read(self, process: str, partition: int, offset: int, records: list[tuple[int, str]], *,
             session: str = "s1", group: str | None = None, final: bool = False, **times: float) -> int:
        value: dict[str, Any] = {"topic": T, "partition": partition, "offset": offset, "session": session}
        if group:
            value["group"] = group
        if final:
            value["final"] = True
        return self.op(process, "read", value, {"records": [[o, v, None] for o, v in records]}, **times)

    def list_offsets(self, process: str, partition: int, *, earliest: int = 0, hwm: int, **times: float) -> int:
        entry = {"earliest": earliest, "latest": hwm, "leo": hwm, "hwm": hwm}
        return self.op(process, "list-offsets", {"topic": T}, {"partitions": {str(partition): entry}}, **times)

    def commit(self, process: str, partition: int, offset: int, *, kind: str = OK, **times: float) -> int:
        return self.op(process, "commit", {"group": "g", "topic": T, "partition": partition, "offset": offset},
                       kind=kind, **times)

    def fetch(self, process: str, partition: int, offset: int, **times: float) -> int:
        return self.op(process, "fetch-offset", {"group": "g", "topic": T, "partition": partition},
                       {"offset": offset}, **times)

    def ops(self) -> list[checkers.Op]:
        return pair(self.events)


def clean() -> Builder:
    """A history every checker accepts: writes, reads, a group that processes then commits, a drain."""
    h = Builder()
    h.send("idem-0", 0, ["idem-0:0", "idem-0:1"], [0, 1])
    h.send("plain-0", 0, ["plain-0:0"], [2], idempotent=False)
    h.send("plain-0", 0, ["plain-0:1"], None, kind=INFO, idempotent=False)  # unknown: may or may not exist
    h.send("plain-0", 0, ["plain-0:2"], None, kind=FAIL, idempotent=False)
    h.read("reader-0", 0, 0, [(0, "idem-0:0"), (1, "idem-0:1")], session="r/1")
    h.read("reader-0", 0, 2, [(2, "plain-0:0")], session="r/1")
    h.list_offsets("offsets-0", 0, hwm=3)
    h.fetch("consumer-0", 0, 0)
    h.read("consumer-0", 0, 0, [(0, "idem-0:0"), (1, "idem-0:1")], session="c/1", group="g")
    h.commit("consumer-0", 0, 2)
    h.fetch("consumer-1", 0, 2)
    h.read("consumer-1", 0, 2, [(2, "plain-0:0")], session="c/2", group="g")
    h.commit("consumer-1", 0, 3)
    h.list_offsets("drain", 0, hwm=3)
    h.read("drain", 0, 0, [(0, "idem-0:0"), (1, "idem-0:1"), (2, "plain-0:0")], session="drain/0", final=True)
    h.fetch("drain", 0, 3)
    return h


def found(h: Builder, name: str) -> list[checkers.Anomaly]:
    return checkers.CHECKERS[name](h.ops())


def test_clean_history_passes_every_checker() -> None:
    results = checkers.run_all(clean().ops())
    assert results == {name: [] for name in checkers.CHECKERS}


# ------------------------------------------------------------------------------------------ writes


def test_lost_write_is_an_acked_value_missing_from_the_drain() -> None:
    h = clean()
    h.send("idem-1", 0, ["idem-1:0"], [3])
    h.read("reader-1", 0, 3, [(3, "idem-1:0")], session="r/2")  # seen before the drain, then lost
    [lost] = found(h, "lost-writes")
    assert lost.details["value"] == "idem-1:0" and lost.details["acked_offset"] == 3
    assert lost.details["read_before_drain_by"]["process"] == "reader-1"


def test_unacknowledged_writes_may_be_missing() -> None:
    h = clean()
    h.send("idem-1", 0, ["idem-1:0"], None, kind=INFO)
    h.send("idem-1", 0, ["idem-1:1"], None, kind=FAIL)
    assert found(h, "lost-writes") == []


def test_duplicate_is_one_value_at_two_offsets() -> None:
    h = clean()
    h.read("drain", 0, 3, [(3, "idem-0:1")], session="drain/0", final=True)
    [dup] = found(h, "duplicates")
    assert dup.details["value"] == "idem-0:1" and dup.details["idempotent"] is True
    assert dup.details["positions"] == [[T, 0, 1], [T, 0, 3]]


def test_inconsistent_offset_is_two_reads_disagreeing() -> None:
    h = clean()
    h.read("reader-1", 0, 1, [(1, "plain-0:0")], session="r/9")
    anomalies = found(h, "inconsistent-offsets")
    assert anomalies and anomalies[0].details["offset"] == 1
    assert {anomalies[0].details["first"]["value"], anomalies[0].details["second"]["value"]} == {
        "idem-0:1", "plain-0:0"}


def test_inconsistent_offset_includes_the_acknowledged_position() -> None:
    h = Builder()
    h.send("idem-0", 0, ["idem-0:0"], [0])
    h.send("idem-0", 0, ["idem-0:1"], [1])
    h.read("drain", 0, 0, [(0, "idem-0:1"), (1, "idem-0:0")], session="d", final=True)
    anomalies = found(h, "inconsistent-offsets")
    assert {a.details["offset"] for a in anomalies} == {0, 1}
    assert anomalies[0].details["first"]["how"] == "acknowledged"


# ------------------------------------------------------------------------------------------ reads


def test_skipping_read_within_a_session() -> None:
    h = clean()
    h.read("reader-1", 0, 0, [(0, "idem-0:0")], session="r/5")
    h.read("reader-1", 0, 1, [(2, "plain-0:0")], session="r/5")  # asked for 1, got 2
    [anomaly] = found(h, "session-order")
    assert anomaly.details["what"] == "skip" and anomaly.details["expected"] == 1


def test_gap_inside_one_read_is_a_skip_and_going_back_is_non_monotonic() -> None:
    h = clean()
    h.read("reader-1", 0, 0, [(0, "idem-0:0"), (2, "plain-0:0")], session="r/6")
    h.read("reader-2", 0, 2, [(1, "idem-0:1")], session="r/7")
    whats = sorted(a.details["what"] for a in found(h, "session-order"))
    assert whats == ["non-monotonic", "skip"]


def test_sessions_are_independent() -> None:
    h = clean()
    h.read("reader-1", 0, 2, [(2, "plain-0:0")], session="r/8")
    h.read("reader-1", 0, 0, [(0, "idem-0:0")], session="r/9")  # a new session may start anywhere
    assert found(h, "session-order") == []


def test_unexpected_values() -> None:
    h = clean()
    h.read("reader-1", 0, 3, [(3, "nobody:1")], session="a")
    h.read("reader-1", 0, 4, [(4, "plain-0:2")], session="a")  # the write failed definitively
    h.read("reader-1", 1, 0, [(0, "idem-0:0")], session="b")  # written to partition 0
    h.op("reader-1", "read", {"topic": T, "partition": 0, "offset": 0, "session": "c"},
         {"records": [], "corrupt": "InvalidFrame: bad magic"})
    whats = [a.details["what"] for a in found(h, "unexpected-values")]
    assert whats == ["value nobody wrote", "value of a write that failed", "value written to t/0", "corrupt reply"]


def test_wrong_key_is_unexpected() -> None:
    h = Builder()
    h.send("idem-0", 0, ["idem-0:0"], [0], key="k1")
    h.op("drain", "read", {"topic": T, "partition": 0, "offset": 0, "session": "d", "final": True},
         {"records": [[0, "idem-0:0", "k2"]]})
    [anomaly] = found(h, "unexpected-values")
    assert "key" in anomaly.details["what"]


def test_hwm_and_log_start_going_back() -> None:
    h = clean()
    h.list_offsets("offsets-0", 0, hwm=2)  # after hwm=3 was observed
    h.list_offsets("offsets-0", 0, earliest=1, hwm=3)
    h.list_offsets("offsets-0", 0, earliest=0, hwm=3)
    anomalies = found(h, "offsets-backwards")
    fields = sorted({a.details["field"] for a in anomalies})
    assert fields == ["earliest", "hwm", "latest"]


def test_hwm_below_an_earlier_read_or_ack_is_backwards_but_overlap_is_not() -> None:
    h = Builder()
    h.send("idem-0", 0, ["idem-0:0", "idem-0:1"], [0, 1], start=1, end=2)
    h.list_offsets("offsets-0", 0, hwm=0, start=1.5, end=3)  # concurrent with the ack: allowed
    assert found(h, "offsets-backwards") == []
    h.list_offsets("offsets-0", 0, hwm=1, start=4, end=5)  # after the ack of offset 1
    [anomaly] = [a for a in found(h, "offsets-backwards") if a.details["field"] == "hwm"]
    assert anomaly.details["earlier_bound"] == 2
    h2 = Builder()
    h2.read("reader-0", 0, 0, [(0, "x"), (1, "y"), (2, "z")], start=1, end=2)
    h2.list_offsets("offsets-0", 0, hwm=2, start=3, end=4)
    assert {a.details["field"] for a in found(h2, "offsets-backwards")} == {"hwm", "latest"}


# ------------------------------------------------------------------------------------------ groups


def test_committed_offset_regression() -> None:
    h = clean()
    h.fetch("consumer-2", 0, 2)  # after commit 3 was acknowledged
    [anomaly] = found(h, "committed-offset-regressions")
    assert anomaly.details["fetched"] == 2 and anomaly.details["earlier"] == 3


def test_fetch_concurrent_with_a_commit_may_see_the_old_offset() -> None:
    h = Builder()
    h.commit("consumer-0", 0, 5, start=1, end=3)
    h.fetch("consumer-1", 0, 0, start=2, end=4)
    h.commit("consumer-0", 0, 4, kind=FAIL, start=5, end=6)  # refused (offset_regression): no bound
    h.fetch("consumer-1", 0, 5, start=7, end=8)
    assert found(h, "committed-offset-regressions") == []


def test_committed_but_never_delivered() -> None:
    h = clean()
    h.commit("consumer-1", 0, 5)  # offsets 3 and 4 were never delivered to the group
    [anomaly] = found(h, "undelivered-committed")
    assert anomaly.details["missing_first"] == [3, 4] and anomaly.details["committed"] == 5


def test_delivery_to_readers_outside_the_group_does_not_count() -> None:
    h = Builder()
    h.read("reader-0", 0, 0, [(0, "a")])
    h.commit("consumer-0", 0, 1)
    assert [a.details["missing_first"] for a in found(h, "undelivered-committed")] == [[0]]


# ------------------------------------------------------------------------------------------ history, report


def test_pairing_turns_an_unfinished_invoke_into_info() -> None:
    events = [{"op": 1, "type": "invoke", "process": "p", "f": "send", "time": 1.0, "value": {"values": ["v"]}}]
    [op] = pair(events)
    assert op.type == INFO and math.isinf(op.end)
    with pytest.raises(ValueError):
        pair([{"op": 9, "type": "ok", "process": "p", "f": "send", "time": 1.0, "value": {}}])


def test_history_records_and_writes_jsonl(tmp_path: Path) -> None:
    history = History(tmp_path / "h.jsonl", Clock())
    pending = history.invoke("p", "send", {"values": ["v"]})
    history.complete(pending, OK, {"offsets": [0]})
    history.close()
    lines = (tmp_path / "h.jsonl").read_text().splitlines()
    assert len(lines) == 2 and '"type":"invoke"' in lines[0] and '"type":"ok"' in lines[1]
    [op] = history.ops()
    assert op.ok and op.result == {"offsets": [0]}


def test_report_lists_faults_active_and_exit_code() -> None:
    h = clean()
    h.read("drain", 0, 3, [(3, "idem-0:1")], session="drain/0", final=True)
    ops = h.ops()
    fault_records = [{"id": 1, "fault": "kill", "node": 0, "start": 1.0, "end": 100.0, "details": {}},
                     {"id": 2, "fault": "pause", "node": 0, "start": 500.0, "end": 501.0, "details": {}}]
    doc = report.build({"seed": 1}, ops, checkers.run_all(ops), fault_records, workloads={}, errors=[],
                       harness_errors=[])
    assert not doc["valid"] and report.exit_code(doc) == 1
    example = doc["checkers"]["duplicates"]["examples"][0]
    assert [f["fault"] for f in example["faults_active"]] == ["kill"]
    assert "duplicates" in report.summary(doc)
    clean_doc = report.build({"seed": 1}, clean().ops(), checkers.run_all(clean().ops()), [], workloads={},
                             errors=[], harness_errors=[])
    assert clean_doc["valid"] and report.exit_code(clean_doc) == 0


# ------------------------------------------------------------------------------------------ schedule


def test_same_seed_same_schedule() -> None:
    kinds = schedule.parse_kinds("kill,pause,restart,lose-unsynced,torn-tail")
    first = schedule.build_schedule(42, 60, kinds, 1, 6)
    assert first == schedule.build_schedule(42, 60, kinds, 1, 6)
    assert first != schedule.build_schedule(43, 60, kinds, 1, 6)
    assert first and all(schedule.WARMUP_S <= s.at_s < 60 - schedule.QUIET_TAIL_S for s in first)
    assert {s.kind for s in first} <= set(schedule.SCHEDULED_KINDS)
    assert [s.at_s for s in first] == sorted(s.at_s for s in first)


def test_schedule_kinds() -> None:
    with pytest.raises(ValueError):
        schedule.parse_kinds("kill,partition")  # a cluster kind on one node
    with pytest.raises(ValueError):
        schedule.parse_kinds("kill,partitions", 3)
    assert schedule.build_schedule(1, 60, ("lose-unsynced",), 1) == []
    tears = [s for s in schedule.build_schedule(7, 120, ("torn-tail",), 3, 4)]
    assert tears and all(s.tear is not None and s.tear["mode"] in schedule.TEAR_MODES for s in tears)
    assert all(0 <= s.node < 3 and 0 <= s.tear["target"] < 4 for s in tears if s.tear)


# ------------------------------------------------------------------------------------------ torn tails


def _chunk(base: int, records: list[bytes]) -> bytes:
    body = b"".join(struct.pack(">I", len(r)) + r for r in records)
    prefix = struct.pack(">IQIIqI", CHUNK_MAGIC, base, len(records), len(body), int(time.time() * 1000), 0)
    return prefix + struct.pack(">I", crc32c.crc32c(prefix + body)) + body


@pytest.mark.parametrize("mode", schedule.TEAR_MODES)
def test_torn_tail_spares_observed_data_and_recovers(tmp_path: Path, mode: str) -> None:
    part = tmp_path / "p"
    part.mkdir()
    segment = part / f"{0:020d}.log"
    data = b"".join(_chunk(base, [f"r{base + i}".encode() * 9 for i in range(3)]) for base in (0, 3, 6, 9))
    segment.write_bytes(data)
    chunks, end = walk_chunks(data)
    assert [c.base_offset for c in chunks] == [0, 3, 6, 9] and end == len(data) and all(c.crc_ok for c in chunks)
    assert CHUNK_HEADER.size == 36
    result = tear_tail(part, observed_end=5, mode=mode, seed=random.randrange(1 << 30))
    assert result["safe_offset"] == 5 and result["dropped_offsets"] == [6, 12]
    torn = segment.read_bytes()
    assert torn[:chunks[2].position] == data[:chunks[2].position]  # offsets 0-5 untouched
    assert torn != data
    log = PartitionLog.open(part, LogConfig(), clean_shutdown=False)  # a torn tail, not corruption
    try:
        assert log.log_end_offset == 6
    finally:
        log.close()


def test_torn_tail_without_unsafe_chunks_appends_garbage(tmp_path: Path) -> None:
    part = tmp_path / "p"
    part.mkdir()
    segment = part / f"{0:020d}.log"
    data = _chunk(0, [b"a", b"b"])
    segment.write_bytes(data)
    result = tear_tail(part, observed_end=2, mode="cut-chunk", seed=1)
    assert result["mode"] == "append-garbage" and result["dropped_offsets"] is None
    assert segment.read_bytes().startswith(data) and len(segment.read_bytes()) > len(data)
    log = PartitionLog.open(part, LogConfig(), clean_shutdown=False)
    try:
        assert log.log_end_offset == 2
    finally:
        log.close()


def test_observed_ends_follow_acks_reads_and_hwm() -> None:
    history = History(None, Clock())
    observed = ObservedEnds()
    history.listeners.append(observed.on_complete)
    send = history.invoke("p", "send", {"topic": T, "partition": 1, "values": ["a", "b"]})
    history.complete(send, OK, {"offsets": [4, 5]})
    lost = history.invoke("p", "send", {"topic": T, "partition": 1, "values": ["c"]})
    history.complete(lost, INFO, error="timeout")
    read = history.invoke("r", "read", {"topic": T, "partition": 2, "offset": 0})
    history.complete(read, OK, {"records": [[0, "x", None], [1, "y", None]]})
    listed = history.invoke("o", "list-offsets", {"topic": T})
    history.complete(listed, OK, {"partitions": {"2": {"earliest": 0, "latest": 9, "leo": 12, "hwm": 9}}})
    assert (observed.end(T, 1), observed.end(T, 2), observed.end(T, 3)) == (6, 9, 0)


# ------------------------------------------------------------------------------------------ workloads


def test_reply_parsers() -> None:
    assert parse_join("OK generation=3 member=c-0-i0-1234 assignments=[0, 2]") == {
        "generation": 3, "member": "c-0-i0-1234", "assignments": [0, 2]}
    assert parse_join("OK assignments=[]")["assignments"] == []
    assert parse_assignments("OK generation=1") is None
    assert parse_list_offsets("OK topic=t partitions=2 offsets=P0:earliest=0:latest=5:leo=6:hwm=5,"
                              "P1:earliest=1:latest=2:leo=2:hwm=2") == {
        "partitions": {"0": {"earliest": 0, "latest": 5, "leo": 6, "hwm": 5},
                       "1": {"earliest": 1, "latest": 2, "leo": 2, "hwm": 2}}}
    with pytest.raises(ValueError):
        parse_list_offsets("OK offsets=P0:earliest=0")


def test_group_workload_skips_itself_while_groups_are_unsupported(tmp_path: Path) -> None:
    history = History(None, Clock())
    ctx = Context(history, Cluster(tmp_path, 1), [TopicPlan("t", 3, 0)], seed=1)
    gate = GroupGate()

    class Unsupported(GroupConsumer):
        def text(self, *args: Any, **kwargs: Any) -> tuple[str, dict[str, Any], str | None]:
            return FAIL, {}, "UNSUPPORTED_FEATURE"

    leader = Unsupported("consumer-0", ctx, ctx.topics[0], "g", gate, leader=True)
    follower = Unsupported("consumer-1", ctx, ctx.topics[0], "g", gate, leader=False)
    leader.step()
    assert gate.available is False and "groups unavailable" in gate.reason
    leader.step()
    follower.step()
    assert leader.done and follower.done


# ------------------------------------------------------------------------------------------ cluster


def _status(h: Builder, node: int, applied: int, parts: dict[str, dict[str, Any]], *, final: bool = False,
            revision: int | None = None) -> int:
    """A CLUSTER_STATUS poll; ``revision`` defaults to ``applied`` (a view that does not trail)."""
    full = {k: {"leader": "node-0", "leader_epoch": 1, "committed_hwm": 0, "isr": ["node-0", "node-1", "node-2"],
                **v} for k, v in parts.items()}
    return h.op(f"status-{node}", "cluster-status", {"node": node, "final": final},
                {"raft_leader": "node-0", "raft_term": 1, "applied": applied,
                 "revision": applied if revision is None else revision, "partitions": full})


def clustered() -> Builder:
    """The clean history plus CLUSTER_STATUS polls and identical replica inspections: a clean cluster run."""
    h = clean()
    _status(h, 0, 10, {f"{T}/0": {"committed_hwm": 2}})
    _status(h, 1, 12, {f"{T}/0": {"committed_hwm": 3}}, final=True)
    for replica in range(3):
        h.op("inspect", "replica-log", {"topic": T, "partition": 0, "replica": replica, "committed_hwm": 3},
             {"chunks": [[0, 2, "aa"], [2, 1, "bb"]], "end": 3})
    return h


def test_clean_cluster_history_passes_every_checker() -> None:
    results = checkers.run_all(clustered().ops())
    assert all(not found for found in results.values()), {k: v for k, v in results.items() if v}


def test_cluster_acks1_loss_is_informational_but_acks_all_loss_is_not() -> None:
    h = clustered()
    h.send("plain-1", 0, ["plain-1:0"], [3], idempotent=False)  # acks=1, acknowledged, then lost
    h.send("idem-1", 0, ["idem-1:0"], [4])  # acks=all, acknowledged, then lost
    ops = h.ops()
    assert [a.details["value"] for a in checkers.check_acks1_losses(ops)] == ["plain-1:0"]
    assert [a.details["value"] for a in checkers.check_lost_writes(ops)] == ["idem-1:0"]
    doc = report.build({"seed": 1}, ops, checkers.run_all(ops), [], workloads={}, errors=[], harness_errors=[])
    assert doc["violations"] == 1 and doc["checkers"]["acks1-losses"]["informational"]
    # standalone (no cluster-status ops): acks=1 is durable, its loss is a lost write
    standalone = clean()
    standalone.send("plain-1", 0, ["plain-1:0"], [3], idempotent=False)
    assert [a.details["value"] for a in checkers.check_lost_writes(standalone.ops())] == ["plain-1:0"]
    assert checkers.check_acks1_losses(standalone.ops()) == []


def test_cluster_acks1_ack_overwritten_is_not_inconsistent_but_a_read_is() -> None:
    h = clustered()
    h.send("plain-1", 0, ["plain-1:0"], [2], idempotent=False)  # truncated by a new leader: allowed
    assert checkers.check_inconsistent_offsets(h.ops()) == []
    h.read("reader-1", 0, 2, [(2, "plain-1:0")], session="r/9")  # but a read of it is evidence
    assert len(checkers.check_inconsistent_offsets(h.ops())) == 1


def test_leaderless_after_heal() -> None:
    h = clustered()
    _status(h, 2, 20, {f"{T}/0": {"committed_hwm": 3, "leader": ""}}, final=True)
    (anomaly,) = checkers.check_leaderless(h.ops())
    assert anomaly.details["partition"] == f"{T}/0"
    h2 = clustered()
    _status(h2, 2, 20, {f"{T}/0": {"committed_hwm": 3, "leader": ""}})  # leaderless during faults is fine
    _status(h2, 2, 21, {f"{T}/0": {"committed_hwm": 3}}, final=True)
    assert checkers.check_leaderless(h2.ops()) == []


def test_no_final_status_answer_is_leaderless() -> None:
    h = clean()
    _status(h, 0, 10, {f"{T}/0": {"committed_hwm": 2}})
    h.op("status-0", "cluster-status", {"node": 0, "final": True}, kind=INFO)
    assert [a.kind for a in checkers.check_leaderless(h.ops())] == ["leaderless"]


def test_committed_hwm_and_leader_epoch_going_back_in_metadata() -> None:
    h = clustered()
    _status(h, 2, 30, {f"{T}/0": {"committed_hwm": 9, "leader_epoch": 3}})
    _status(h, 0, 25, {f"{T}/0": {"committed_hwm": 5, "leader_epoch": 2}})  # older revision, seen later: fine
    assert checkers.check_metadata_monotonic(h.ops()) == []
    _status(h, 1, 31, {f"{T}/0": {"committed_hwm": 8, "leader_epoch": 2}})  # newer revision, lower: regression
    found = checkers.check_metadata_monotonic(h.ops())
    assert sorted(a.details["field"] for a in found) == ["committed_hwm", "leader_epoch"]
    assert {(a.details["revision"], a.details["earlier_revision"]) for a in found} == {(31, 30)}


def test_a_view_trailing_its_applied_index_is_not_a_regression() -> None:
    """Finding B (issue 14): a node's partition view trails the Raft applied index it reports (the index is
    read live from the Raft thread, the view is the event loop's). Node 0, just restarted, reports applied
    16437 with the state of revision 5000 (HWM 7479); node 1 reported applied 16353 with revision 5010 (HWM
    7485). Ordered by applied index that looked like the HWM going back; ordered by revision it does not."""
    h = clustered()
    _status(h, 1, 16353, {f"{T}/0": {"committed_hwm": 7485, "leader_epoch": 4}}, revision=5010)
    _status(h, 0, 16437, {f"{T}/0": {"committed_hwm": 7479, "leader_epoch": 4}}, revision=5000)
    _status(h, 0, 16500, {f"{T}/0": {"committed_hwm": 7490, "leader_epoch": 4}}, revision=5020)
    assert checkers.check_metadata_monotonic(h.ops()) == []
    # a real regression is still flagged: a higher revision with a lower HWM, whatever the applied index says
    _status(h, 2, 16400, {f"{T}/0": {"committed_hwm": 7480, "leader_epoch": 4}}, revision=5021)
    (anomaly,) = checkers.check_metadata_monotonic(h.ops())
    assert anomaly.details["field"] == "committed_hwm"
    assert (anomaly.details["observed"], anomaly.details["revision"]) == (7480, 5021)
    assert (anomaly.details["earlier"], anomaly.details["earlier_revision"]) == (7490, 5020)


def test_two_nodes_disagreeing_at_one_revision_is_a_divergence() -> None:
    h = clustered()
    _status(h, 0, 40, {f"{T}/0": {"committed_hwm": 9}}, revision=20)
    _status(h, 1, 41, {f"{T}/0": {"committed_hwm": 9}}, revision=20)  # same state: fine
    assert checkers.check_metadata_monotonic(h.ops()) == []
    _status(h, 2, 45, {f"{T}/0": {"committed_hwm": 10}}, revision=20)  # same revision, another HWM: diverged
    (anomaly,) = checkers.check_metadata_monotonic(h.ops())
    assert "same revision" in anomaly.message and anomaly.details["observed"] == 10


def test_polls_without_a_revision_are_not_ordered_by_applied_index() -> None:
    h = clustered()
    for node, applied, hwm in ((1, 100, 9), (0, 120, 5)):  # an old broker: no revision reported
        h.op(f"status-{node}", "cluster-status", {"node": node, "final": False},
             {"raft_leader": "node-0", "raft_term": 1, "applied": applied,
              "partitions": {f"{T}/0": {"leader": "node-0", "leader_epoch": 1, "committed_hwm": hwm, "isr": []}}})
    assert checkers.check_metadata_monotonic(h.ops()) == []


def test_status_freshness_prefers_the_revision_over_the_applied_index() -> None:
    assert checkers.status_freshness({"revision": 10, "applied": 5}) > checkers.status_freshness(
        {"revision": 9, "applied": 500})
    assert checkers.status_freshness({"applied": 500}) < checkers.status_freshness({"revision": 0, "applied": 1})


def test_replicas_differing_below_the_committed_hwm() -> None:
    h = clustered()
    h.events = [e for e in h.events if e.get("f") != "replica-log"]
    for replica, digest in ((0, "bb"), (1, "bb"), (2, "XX")):
        h.op("inspect", "replica-log", {"topic": T, "partition": 0, "replica": replica, "committed_hwm": 3},
             {"chunks": [[0, 2, "aa"], [2, 1, digest]], "end": 3})
    found_pairs = sorted(tuple(a.details["replicas"]) for a in checkers.check_replica_divergence(h.ops()))
    assert found_pairs == [(0, 2), (1, 2)]


def test_replica_behind_the_committed_hwm_or_with_other_chunk_boundaries() -> None:
    h = clustered()
    h.events = [e for e in h.events if e.get("f") != "replica-log"]
    layouts = {0: [[0, 2, "aa"], [2, 1, "bb"]], 1: [[0, 2, "aa"]], 2: [[0, 1, "cc"], [1, 2, "dd"]]}
    for replica, chunks in layouts.items():
        h.op("inspect", "replica-log", {"topic": T, "partition": 0, "replica": replica, "committed_hwm": 3},
             {"chunks": chunks, "end": max(c[0] + c[1] for c in chunks)})
    messages = [a.message for a in checkers.check_replica_divergence(h.ops())]
    assert any("node-1 holds offsets only up to 2" in m for m in messages)
    assert any("node-0 and node-2 differ" in m for m in messages)


def test_cluster_schedule_is_seeded_and_draws_cluster_faults() -> None:
    kinds = schedule.parse_kinds("kill,pause,partition,restart,lose-unsynced,corrupt", 3)
    plan = schedule.build_schedule(5, 300, kinds, 3, 6)
    assert plan == schedule.build_schedule(5, 300, kinds, 3, 6)
    assert {s.kind for s in plan} == {"kill", "pause", "partition", "restart", "corrupt"}
    assert {s.target for s in plan if s.kind == "kill"} == set(schedule.KILL_TARGETS)
    assert {s.cut["mode"] for s in plan if s.cut} == set(schedule.CUT_MODES)
    for s in plan:
        if s.kind == "pause":
            assert s.hold_s >= schedule.CLUSTER_PAUSE_S_MIN  # longer than the election timeout
        if s.cut and s.cut["mode"] == "split":
            assert len(s.cut["side"]) == 1  # the minority of three
        if s.kind == "corrupt":
            assert s.tear is not None and s.tear["mode"] == "flip-tail"
    # a one-node schedule is unchanged by the cluster kinds (stage 1 seeds replay as before)
    single = schedule.parse_kinds("kill,pause,restart,lose-unsynced,torn-tail")
    assert all(s.target is None and s.cut is None for s in schedule.build_schedule(42, 60, single, 1, 6))


def test_partition_rules_by_address_pair() -> None:
    from chaos import netns

    assert netns.isolate(1, 3) == {(1, 0), (0, 1), (1, 2), (2, 1)}
    assert netns.split({0}, 3) == netns.isolate(0, 3)
    assert netns.node_address(0) != netns.node_address(1)


def test_flip_tail_damages_one_of_the_last_chunks(tmp_path: Path) -> None:
    from chaos.faults import flip_tail

    part = tmp_path / "p"
    part.mkdir()
    data = b"".join(_chunk(i * 2, [b"a" * 20, b"b" * 20]) for i in range(5))
    (part / "00000000000000000000.log").write_bytes(data)
    damage = flip_tail(part, 1)
    after = (part / "00000000000000000000.log").read_bytes()
    assert len(after) == len(data) and after != data
    assert damage["chunk_base_offset"] >= 4
    chunks, _ = walk_chunks(after)
    assert [c.crc_ok for c in chunks].count(False) == 1
    assert flip_tail(tmp_path / "missing", 1)["skipped"]


def test_parse_cluster_status() -> None:
    import json

    from chaos.cluster import parse_status

    doc = {"raft_leader": "node-1", "raft_term": 4, "raft_applied_index": 77, "metadata_revision": 70,
           "partitions": [{"topic": "t", "partition": 0, "leader": "node-2", "leader_epoch": 3, "committed_hwm": 12,
                           "isr": ["node-2", "node-0"]}],
           "brokers": [{"id": "node-2", "status": "active"}, {"id": "node-1", "status": "inactive"},
                       {"id": "node-0", "status": "active"}]}
    parsed = parse_status("OK cluster=" + json.dumps(doc))
    assert parsed == {"raft_leader": "node-1", "raft_term": 4, "applied": 77, "revision": 70,
                      "active": ["node-0", "node-2"],
                      "partitions": {"t/0": {"leader": "node-2", "leader_epoch": 3, "committed_hwm": 12,
                                             "isr": ["node-2", "node-0"]}}}
    with pytest.raises(ValueError):
        parse_status("ERROR nope")


def test_cluster_status_reports_the_revision_of_its_partition_view() -> None:
    """The broker's CLUSTER_STATUS carries ``metadata_revision`` (the state it reports the partitions from),
    and the harness parses it: the checker orders polls by it, not by the live Raft applied index."""
    import json

    from chaos.cluster import parse_status
    from cursus.cluster.status import cluster_status
    from cursus.metadata.state import MetadataState

    doc = cluster_status(MetadataState(revision=41, cluster=True), {"leader_id": "node-0", "applied_index": 90}, 1)
    assert (doc["metadata_revision"], doc["raft_applied_index"]) == (41, 90)
    parsed = parse_status("OK cluster=" + json.dumps(doc))
    assert (parsed["revision"], parsed["applied"]) == (41, 90)


# ------------------------------------------------------------------------------------------ transactions


def _txn_history() -> Builder:
    """A clean transactional history: one commit, one abort, one unknown outcome (nothing visible), reads."""
    h = Builder()
    h.op("txn-0", "txn", {"tid": "x", "epoch": 1, "topic": "chaos-txn", "values": ["txn-0:1", "txn-0:2"],
                          "result": "commit"}, {"state": "committed"})
    h.op("txn-0", "txn", {"tid": "x", "epoch": 2, "topic": "chaos-txn", "values": ["txn-0:3"], "result": "abort"},
         {"state": "aborted"})
    h.op("txn-0", "txn", {"tid": "x", "epoch": 3, "topic": "chaos-txn", "values": ["txn-0:4", "txn-0:5"],
                          "result": "commit"}, kind=INFO)
    h.op("txn-0", "txn-read", {"topic": "chaos-txn", "partition": 0, "offset": 0, "final": False},
         {"records": [[0, "txn-0:1", None]]})
    h.op("txn-0", "txn-read", {"topic": "chaos-txn", "partition": 0, "offset": 0, "final": True},
         {"records": [[0, "txn-0:1", None], [1, "txn-0:2", None]]})
    return h


def _txn_anomalies(h: Builder) -> list[checkers.Anomaly]:
    return found(h, "aborted-or-uncommitted-read")


def test_txn_checker_accepts_a_clean_history() -> None:
    assert _txn_anomalies(_txn_history()) == []


def test_txn_checker_finds_an_aborted_read() -> None:
    h = _txn_history()
    h.op("txn-0", "txn-read", {"topic": "chaos-txn", "partition": 1, "offset": 0, "final": False},
         {"records": [[0, "txn-0:3", None]]})
    [anomaly] = _txn_anomalies(h)
    assert anomaly.details["what"] == "aborted" and anomaly.details["value"] == "txn-0:3"


def test_txn_checker_finds_a_read_before_end_txn_was_sent() -> None:
    h = Builder()
    h.op("txn-0", "txn-read", {"topic": "chaos-txn", "partition": 0, "offset": 0, "final": False},
         {"records": [[0, "txn-0:1", None]]}, start=1.0, end=2.0)
    h.op("txn-0", "txn", {"tid": "x", "epoch": 1, "topic": "chaos-txn", "values": ["txn-0:1"],
                          "result": "commit"}, {"state": "committed"}, start=3.0, end=4.0)
    [anomaly] = _txn_anomalies(h)
    assert anomaly.details["what"] == "uncommitted"


def test_txn_checker_finds_missing_committed_and_partial_unknown() -> None:
    h = _txn_history()
    h.op("txn-0", "txn-read", {"topic": "chaos-txn", "partition": 1, "offset": 0, "final": True},
         {"records": [[0, "txn-0:4", None]]})  # half of the unknown transaction
    kinds = sorted(a.message for a in _txn_anomalies(h))
    assert kinds == ["a transaction of unknown outcome is partly visible"]
    h = Builder()
    h.op("txn-0", "txn", {"tid": "x", "epoch": 1, "topic": "chaos-txn", "values": ["txn-0:1", "txn-0:2"],
                          "result": "commit"}, {"state": "committed"})
    h.op("txn-0", "txn-read", {"topic": "chaos-txn", "partition": 0, "offset": 0, "final": True},
         {"records": [[0, "txn-0:1", None]]})
    [anomaly] = _txn_anomalies(h)
    assert anomaly.details["missing"] == ["txn-0:2"]


def test_a_replica_in_the_final_isr_without_any_log_directory_is_a_divergence() -> None:
    h = clustered()
    h.events = [e for e in h.events if e.get("f") != "replica-log"]
    for replica in range(2):
        h.op("inspect", "replica-log", {"topic": T, "partition": 0, "replica": replica, "committed_hwm": 3},
             {"chunks": [[0, 2, "aa"], [2, 1, "bb"]], "end": 3})
    h.op("inspect", "replica-log", {"topic": T, "partition": 0, "replica": 2, "committed_hwm": 3}, kind=INFO,
         error="no directory node-2/data/topics/t/0")
    [found] = checkers.check_replica_divergence(h.ops())
    assert "node-2 is in the final ISR but holds no log" in found.message
    # not a replica of the partition (not in the ISR), or nothing committed: no directory is fine
    h = clustered()
    h.op("inspect", "replica-log", {"topic": "meta", "partition": 1, "replica": 1, "committed_hwm": 5}, kind=INFO,
         error="no directory")
    h.op("inspect", "replica-log", {"topic": T, "partition": 0, "replica": 2, "committed_hwm": 0}, kind=INFO,
         error="no directory")
    assert checkers.check_replica_divergence(h.ops()) == []
