"""IsrTracker: examples of Kafka's caught-up rule, and a hypothesis state machine for its invariants."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cursus.replication.isr import IsrTracker

KEY = ("t", 0)
REPLICAS = ("a", "b", "c", "d")
LAG = 1000
#: The brokers active in the applied metadata in the model ("d" is fenced but may still fetch).
ACTIVE = frozenset({"a", "b", "c"})


def test_a_fetch_at_the_leo_is_caught_up_now_and_one_at_the_previous_leo_was_caught_up_then() -> None:
    tracker = IsrTracker("a")
    tracker.on_fetch(KEY, "b", 10, 10, 100, leader_epoch=1)
    assert tracker.last_caught_up_ms(KEY, "b") == 100
    tracker.on_fetch(KEY, "b", 10, 20, 200, leader_epoch=1)   # traffic arrived: behind now
    assert tracker.last_caught_up_ms(KEY, "b") == 100
    tracker.on_fetch(KEY, "b", 20, 30, 300, leader_epoch=1)   # reached the LEO of its previous fetch
    assert tracker.last_caught_up_ms(KEY, "b") == 200
    tracker.on_fetch(KEY, "b", 25, 40, 400, leader_epoch=1)   # not even that
    assert tracker.last_caught_up_ms(KEY, "b") == 200
    tracker.on_fetch(KEY, "a", 0, 40, 500, leader_epoch=1)    # the leader itself is not tracked
    assert tracker.fetch_offset(KEY, "a") is None
    tracker.on_fetch(KEY, "b", 40, 40, 600, leader_epoch=2)   # a new epoch starts over
    assert tracker.last_caught_up_ms(KEY, "b") == 600 and tracker.fetch_offset(KEY, "b") == 40


def test_decide_shrinks_after_the_lag_and_grace_and_expands_only_at_the_committed_hwm() -> None:
    tracker = IsrTracker("a")
    isr = ("a", "b", "c")
    assert tracker.decide(KEY, isr, REPLICAS, 0, 0, LAG, leader_epoch=1) is None  # the epoch starts: grace
    tracker.on_fetch(KEY, "b", 5, 5, 500, leader_epoch=1)
    change = tracker.decide(KEY, isr, REPLICAS, 0, 1001, LAG, leader_epoch=1)
    assert change is not None and change.isr == ("a", "b") and change.shrunk == ("c",)
    tracker.on_fetch(KEY, "d", 4, 5, 1100, leader_epoch=1)
    tracker.on_fetch(KEY, "d", 5, 5, 1200, leader_epoch=1)
    tracker.on_fetch(KEY, "b", 6, 6, 1250, leader_epoch=1)
    assert tracker.decide(KEY, ("a", "b"), REPLICAS, 6, 1300, LAG, leader_epoch=1) is None  # below the HWM
    change = tracker.decide(KEY, ("a", "b"), REPLICAS, 5, 1300, LAG, leader_epoch=1)
    assert change is not None and change.isr == ("a", "b", "d") and change.expanded == ("d",)
    # The leader is always kept (and restored when missing).
    change = tracker.decide(KEY, ("b", "d"), REPLICAS, 5, 1300, LAG, leader_epoch=1)
    assert change is not None and "a" in change.isr


def test_only_active_brokers_are_expanded_while_shrinks_still_happen() -> None:
    tracker = IsrTracker("a")
    assert tracker.decide(KEY, ("a", "b"), REPLICAS, 0, 0, LAG, leader_epoch=1) is None
    tracker.on_fetch(KEY, "c", 5, 5, 100, leader_epoch=1)  # caught up, but fenced in the applied metadata
    tracker.on_fetch(KEY, "d", 5, 5, 100, leader_epoch=1)
    change = tracker.decide(KEY, ("a", "b"), REPLICAS, 5, 200, LAG, leader_epoch=1, active={"a", "b", "d"})
    assert change is not None and change.expanded == ("d",) and change.isr == ("a", "b", "d")
    assert tracker.decide(KEY, ("a", "b"), REPLICAS, 5, 200, LAG, leader_epoch=1, active={"a", "b"}) is None
    # b stops fetching: it is shrunk whether or not c could have been added
    change = tracker.decide(KEY, ("a", "b"), REPLICAS, 5, 1500, LAG, leader_epoch=1, active={"a"})
    assert change is not None and change.isr == ("a",) and change.shrunk == ("b",) and change.expanded == ()


def test_a_member_fetching_below_the_committed_hwm_is_shrunk_at_once() -> None:
    """A repaired replica (cut to its last valid chunk after corruption) lost committed records: it leaves
    the ISR at its first fetch, without waiting for the lag time, and rejoins once it is back at the HWM."""
    tracker = IsrTracker("a")
    isr = ("a", "b", "c")
    tracker.on_fetch(KEY, "b", 50, 50, 100, leader_epoch=1)
    tracker.on_fetch(KEY, "c", 50, 50, 100, leader_epoch=1)
    assert tracker.decide(KEY, isr, REPLICAS, 50, 110, LAG, leader_epoch=1) is None
    tracker.on_fetch(KEY, "c", 20, 50, 120, leader_epoch=1)  # restarted after a repair: its log ends at 20
    change = tracker.decide(KEY, isr, REPLICAS, 50, 130, LAG, leader_epoch=1)
    assert change is not None and change.isr == ("a", "b") and change.shrunk == ("c",)
    tracker.on_fetch(KEY, "c", 50, 50, 200, leader_epoch=1)  # re-fetched everything
    change = tracker.decide(KEY, ("a", "b"), REPLICAS, 50, 210, LAG, leader_epoch=1)
    assert change is not None and change.isr == isr and change.expanded == ("c",)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(("fetch", "append", "tick", "decide", "epoch", "repair")),
                          st.sampled_from(REPLICAS[1:]), st.integers(0, 3), st.integers(1, 1500)),
                max_size=60))
def test_invariants_hold_for_any_history(steps: list[tuple[str, str, int, int]]) -> None:
    """A model: the leader's LEO grows, followers fetch at some offset behind it, time passes, and the ISR
    follows every decision (as if every ChangeIsr committed)."""
    tracker = IsrTracker("a")
    epoch, now, leo, committed_hwm = 1, 0, 0, 0
    isr: tuple[str, ...] = REPLICAS
    epoch_started = 0
    last_caught_up: dict[str, int] = {}  # the model's own Kafka rule: fetch at the LEO shown last time
    shown: dict[str, tuple[int, int]] = {}
    position: dict[str, int] = {}  # each follower's durable end: only a repair moves it back
    fetched: dict[str, int] = {}  # last fetch offset in this epoch
    assert tracker.decide(KEY, isr, REPLICAS, committed_hwm, now, LAG, leader_epoch=epoch) is None  # elected
    for action, follower, behind, amount in steps:
        if action == "repair":  # corruption repaired: the follower's log is cut, maybe below the HWM
            position[follower] = max(0, position.get(follower, 0) - amount)
            continue
        if action == "fetch":
            offset = position[follower] = max(position.get(follower, 0), leo - behind)
            fetched[follower] = offset
            previous = shown.get(follower)
            if offset >= leo:
                last_caught_up[follower] = now
            elif previous is not None and offset >= previous[1]:
                last_caught_up[follower] = max(last_caught_up.get(follower, 0), previous[0])
            shown[follower] = (now, leo)
            tracker.on_fetch(KEY, follower, offset, leo, now, leader_epoch=epoch)
        elif action == "append":
            leo += amount
        elif action == "tick":
            now += amount
        elif action == "epoch":
            epoch += 1
            epoch_started = now
            last_caught_up.clear()
            shown.clear()
            fetched.clear()
            assert tracker.decide(KEY, isr, REPLICAS, committed_hwm, now, LAG, leader_epoch=epoch) is None
        else:
            # the leader's rule: the minimum durable end over the ISR (never moving back)
            ends = [leo] + [fetched.get(member, -1) for member in isr if member != "a"]
            committed_hwm = max(committed_hwm, min(min(ends), committed_hwm + amount))
            change = tracker.decide(KEY, isr, REPLICAS, committed_hwm, now, LAG, leader_epoch=epoch, active=ACTIVE)
            if change is None:  # every member in sync (or in the election grace), no candidate to add
                for member in set(isr) - {"a"}:
                    assert now - last_caught_up.get(member, epoch_started) <= LAG or now - epoch_started <= LAG
                for replica in set(REPLICAS) - set(isr):
                    offset = tracker.fetch_offset(KEY, replica)
                    assert (replica not in last_caught_up or now - last_caught_up[replica] > LAG
                            or offset is None or offset < committed_hwm or replica not in ACTIVE)
                continue
            assert "a" in change.isr and set(change.isr) <= set(REPLICAS)
            assert list(change.isr) == [r for r in REPLICAS if r in change.isr]
            assert set(change.isr) != set(isr)
            for member in change.shrunk:
                since = last_caught_up.get(member, epoch_started)
                assert member != "a"
                assert now - since > LAG or fetched.get(member, committed_hwm) < committed_hwm
            for member in change.expanded:
                assert member in ACTIVE  # an inactive broker is never proposed (the FSM would refuse it)
                assert now - last_caught_up[member] <= LAG
                offset = tracker.fetch_offset(KEY, member)
                assert offset is not None and offset >= committed_hwm
            for member in set(isr) - set(change.shrunk) - {"a"}:
                assert now - last_caught_up.get(member, epoch_started) <= LAG  # kept members are in sync
            for member in change.isr:  # no member that lost committed records stays electable
                assert member == "a" or fetched.get(member, committed_hwm) >= committed_hwm
            isr = change.isr
