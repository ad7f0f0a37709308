"""Chaos harness, finding G: a cluster ``corrupt`` fault damages only a replica whose partition has another
up in-sync member, prefers a follower, keeps the schedule's draw when it is safe, and is recorded as not
applicable (listed, not "not done") when no replica is safe."""

from __future__ import annotations

from typing import Any

from chaos import checkers, report
from chaos.faults import NOT_APPLICABLE, FaultLog
from chaos.history import Clock, History
from chaos.targets import choose_corrupt_target
from tests.unit.test_chaos_checkers import clean

IDS = {"node-0": 0, "node-1": 1, "node-2": 2}
KEYS = [("a", 0), ("a", 1), ("b", 0)]


def _view(**parts: tuple[str, list[int]]) -> dict[str, dict[str, Any]]:
    """``a0=("node-1", [0, 1])`` -> ``{"a/0": {"leader": "node-1", "isr": ["node-0", "node-1"]}}``."""
    return {f"{k[0]}/{k[1:]}": {"leader": leader, "isr": [f"node-{i}" for i in isr]}
            for k, (leader, isr) in parts.items()}


def test_the_drawn_replica_is_kept_when_it_is_a_safe_follower() -> None:
    view = _view(a0=("node-0", [0, 1, 2]), a1=("node-0", [0, 1, 2]), b0=("node-0", [0, 1, 2]))
    chosen = choose_corrupt_target(view, IDS, {0, 1, 2}, KEYS, drawn_node=2, drawn_target=1, nodes=3)
    assert chosen is not None
    assert (chosen.node, chosen.topic, chosen.partition, chosen.follower) == (2, "a", 1, True)


def test_the_sole_in_sync_copy_is_never_corrupted() -> None:
    # Finding G: the ISR of a/0 shrank to node 0 alone, and the schedule drew node 0, a/0. Node 0's a/0 is
    # the only in-sync copy: the fault moves to node 0's a/1 (ISR node 1 only, node 0 is an out-of-sync
    # follower of it, node 1 holds every committed offset).
    view = _view(a0=("node-0", [0]), a1=("node-1", [1]), b0=("node-2", [2]))
    chosen = choose_corrupt_target(view, IDS, {0, 1, 2}, KEYS, drawn_node=0, drawn_target=0, nodes=3)
    assert chosen is not None and (chosen.node, chosen.topic, chosen.partition) == (0, "a", 1)
    assert chosen.follower and chosen.isr == (1,)
    # Only node 0 up: every partition it could damage has no other up in-sync member (or none at all).
    assert choose_corrupt_target(view, IDS, {0}, KEYS, drawn_node=0, drawn_target=0, nodes=3) is None
    # Only a/0 may be damaged and node 0 alone is in sync: node 0 is skipped, a follower of a/0 is taken.
    chosen = choose_corrupt_target(view, IDS, {0, 1, 2}, [("a", 0)], drawn_node=0, drawn_target=0, nodes=3)
    assert chosen is not None and (chosen.node, chosen.partition) == (1, 0)
    # ... unless the followers are down.
    assert choose_corrupt_target(view, IDS, {0}, [("a", 0)], drawn_node=0, drawn_target=0, nodes=3) is None


def test_a_follower_is_preferred_to_a_leader_and_the_other_isr_member_must_be_up() -> None:
    keys = [("a", 0)]
    view = _view(a0=("node-1", [0, 1]))
    # Node 1 leads a/0 and was drawn; node 0 is an in-sync follower: node 0 is chosen.
    chosen = choose_corrupt_target(view, IDS, {0, 1}, keys, drawn_node=1, drawn_target=0, nodes=3)
    assert chosen is not None and (chosen.node, chosen.follower) == (0, True)
    # Node 0 down: node 2 (out of the ISR) is a follower that node 1 can repair; node 1 itself is not safe.
    chosen = choose_corrupt_target(view, IDS, {1, 2}, keys, drawn_node=1, drawn_target=0, nodes=3)
    assert chosen is not None and (chosen.node, chosen.follower) == (2, True)
    # Only the leader up: its other in-sync member is down, nothing is safe.
    assert choose_corrupt_target(view, IDS, {1}, keys, drawn_node=1, drawn_target=0, nodes=3) is None
    # A leader is taken only when no follower is safe; with the leader itself in sync that cannot happen
    # (its in-sync followers are safe), so only a view whose ISR lacks the leader gets there.
    view = _view(a0=("node-0", [1]))
    chosen = choose_corrupt_target(view, IDS, {0, 1}, keys, drawn_node=1, drawn_target=0, nodes=2)
    assert chosen is not None and (chosen.node, chosen.follower) == (0, False)


def test_the_choice_is_deterministic_and_ignores_unknown_partitions_and_brokers() -> None:
    view = _view(a0=("node-0", [0, 1, 2]), b0=("node-9", [1, 2]))  # a/1 missing from the view
    view["b/0"]["isr"].append("node-9")  # a broker the harness does not know
    picks = {choose_corrupt_target(view, IDS, {0, 1, 2}, KEYS, drawn_node=0, drawn_target=1, nodes=3)
             for _ in range(5)}
    assert len(picks) == 1
    [pick] = picks
    # a/1 has no ISR in the view (never safe); node 0 leads a/0; node 0 follows b/0 (leader unknown).
    assert pick is not None and (pick.node, pick.topic, pick.partition) == (0, "b", 0)
    assert choose_corrupt_target({}, IDS, {0, 1, 2}, KEYS, 0, 0, 3) is None
    assert choose_corrupt_target(view, IDS, {0, 1, 2}, [], 0, 0, 3) is None


def _doc(faults: list[dict[str, Any]], planned: int) -> dict[str, Any]:
    ops = clean().ops()
    return report.build({"seed": 1, "schedule_length": planned}, ops, checkers.run_all(ops), faults, workloads={},
                        errors=[], harness_errors=[])


def test_a_not_applicable_corrupt_is_listed_but_does_not_make_the_run_prove_nothing() -> None:
    clock = Clock()
    history = History(None, clock)
    log = FaultLog(None, clock, history)
    log.end(log.begin("kill", 1), {"exit_signal": 9})
    log.end(log.begin("corrupt", 0, {"schedule_index": 2}), {"up": [0, 1, 2]}, not_applicable="no safe replica")
    record = log.records[1]
    assert "error" not in record and record["not_applicable"] == "no safe replica"
    [nemesis_op] = [op for op in history.ops() if op.f == "corrupt"]
    assert nemesis_op.error == NOT_APPLICABLE + "no safe replica"
    doc = _doc(log.records, planned=2)
    assert doc["valid"] and report.exit_code(doc) == 0 and doc["faults"]["not_done"] == []
    assert doc["faults"]["not_applicable"] == ["fault #2 corrupt on node 0: no safe replica"]
    assert "FAULT NOT APPLICABLE: fault #2 corrupt on node 0: no safe replica" in report.summary(doc)
    # A schedule whose only fault was not applicable injected nothing: that run proves nothing.
    alone = _doc([log.records[1]], planned=1)
    assert not alone["valid"] and report.exit_code(alone) == 2
