"""The transaction coordinator's pure state machine (cursus.transactions.state), with hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as stn
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cursus.transactions import state as st
from cursus.wire.errors import BrokerError

TID = "tx"


def code(fn, *args, **kwargs) -> str:
    with pytest.raises(BrokerError) as info:
        fn(*args, **kwargs)
    return info.value.error.code


def test_lifecycle_and_errors():
    e = st.init_producer(None, TID, new_producer_id="7", now_ms=0)
    assert (e.producer_id, e.epoch, e.state) == ("7", 1, st.EMPTY)
    assert code(st.end, e, TID, "7", 1, "commit", now_ms=0) == "transaction_not_open"
    o = st.begin(e, TID, "7", 1, now_ms=10, timeout_ms=100)
    assert o.state == st.OPEN and o.deadline_ms == 110
    assert st.begin(o, TID, "7", 1, now_ms=20, timeout_ms=100) is o  # a retry
    assert code(st.begin, o, TID, "7", 0, now_ms=0, timeout_ms=1) == "producer_fenced"
    assert code(st.begin, o, TID, "8", 1, now_ms=0, timeout_ms=1) == "producer_fenced"
    assert code(st.begin, o, TID, "7", 2, now_ms=0, timeout_ms=1) == "invalid_epoch"
    staged = st.stage_offsets(o, TID, "7", 1, group="g", member="m", generation=3, topic="in", offsets={0: 5},
                              now_ms=0)
    assert code(st.stage_offsets, staged, TID, "7", 1, group="g", member="m", generation=3, topic="in",
                offsets={0: 4}, now_ms=0) == "offset_regression"
    assert code(st.stage_offsets, staged, TID, "7", 1, group="g", member="other", generation=3, topic="in",
                offsets={0: 6}, now_ms=0) == "invalid_txn_offsets"
    two = st.stage_offsets(staged, TID, "7", 1, group="g", member="m", generation=3, topic="in2", offsets={1: 1},
                           now_ms=0)
    assert two.offsets == (("in", 0, 5), ("in2", 1, 1))
    p = st.end(two, TID, "7", 1, "commit", now_ms=0)
    assert p.state == st.PREPARE_COMMIT
    assert st.end(p, TID, "7", 1, "commit", now_ms=0) is p
    assert code(st.end, p, TID, "7", 1, "abort", now_ms=0) == "transaction_not_abortable"
    assert code(st.init_producer, p, TID, new_producer_id="x", now_ms=0) == "transaction_not_abortable"
    c = st.complete(p, 0)
    assert c.state == st.COMMITTED
    assert code(st.end, c, TID, "7", 1, "abort", now_ms=0) == "transaction_already_committed"
    assert code(st.begin, c, TID, "7", 1, now_ms=0, timeout_ms=1) == "producer_reinitialization_required"
    n = st.init_producer(c, TID, new_producer_id="x", now_ms=0)
    assert (n.producer_id, n.epoch, n.state, n.offsets) == ("7", 2, st.EMPTY, ())


def test_expiry_and_json_round_trip():
    o = st.begin(st.init_producer(None, TID, new_producer_id="1", now_ms=0), TID, "1", 1, now_ms=0, timeout_ms=50)
    assert st.expire(o, 49) is None
    x = st.expire(o, 50)
    assert x is not None and x.state == st.PREPARE_ABORT
    assert code(st.end, x, TID, "1", 1, "commit", now_ms=0) == "transaction_aborted"
    o2 = st.add_partition(o, ("t", 3))
    assert st.TxnEntry.from_json(o2.to_json()) == o2


class Coordinator(RuleBasedStateMachine):
    """Random commands against one transactional id; a simple model checks what must always hold."""

    def __init__(self) -> None:
        super().__init__()
        self.entry: st.TxnEntry | None = None
        self.max_epoch = 0
        self.now = 0
        self.finished: dict[int, str] = {}  # epoch -> final state

    @rule()
    def init(self) -> None:
        entry = self.entry
        if entry is not None and st.needs_abort_before_init(entry):
            entry = st.complete(st.abort_for_reinit(entry, self.now), self.now)
            self.finished[entry.epoch] = entry.state
        try:
            new = st.init_producer(entry, TID, new_producer_id="1", now_ms=self.now)
        except BrokerError as exc:
            assert exc.error.code == "transaction_not_abortable" and entry is not None
            assert entry.state == st.PREPARE_COMMIT
            return
        assert new.epoch == self.max_epoch + 1
        self.max_epoch = new.epoch
        self.entry = new

    @precondition(lambda self: self.entry is not None)
    @rule(delta=stn.integers(-2, 1))
    def begin(self, delta: int) -> None:
        assert self.entry is not None
        epoch = self.entry.epoch + delta
        try:
            self.entry = st.begin(self.entry, TID, "1", epoch, now_ms=self.now, timeout_ms=10)
        except BrokerError as exc:
            assert delta != 0 or exc.error.code in ("producer_reinitialization_required", "transaction_not_open")
            if delta < 0:
                assert exc.error.code == "producer_fenced"

    @precondition(lambda self: self.entry is not None)
    @rule(result=stn.sampled_from(["commit", "abort"]), delta=stn.integers(-1, 0))
    def end(self, result: str, delta: int) -> None:
        assert self.entry is not None
        before = self.entry
        try:
            new = st.end(before, TID, "1", before.epoch + delta, result, now_ms=self.now)
        except BrokerError as exc:
            if delta < 0:
                assert exc.error.code == "producer_fenced"
            elif before.state in st.TERMINAL or before.state in st.PREPARED:
                assert (before.state in (st.COMMITTED, st.PREPARE_COMMIT)) == (result == "abort")
            return
        assert delta == 0
        if before.state in (*st.PREPARED, *st.TERMINAL):
            assert new is before  # a retry
        self.entry = new

    @precondition(lambda self: self.entry is not None and self.entry.state in st.PREPARED)
    @rule()
    def finish(self) -> None:
        assert self.entry is not None
        self.entry = st.complete(self.entry, self.now)
        assert self.finished.setdefault(self.entry.epoch, self.entry.state) == self.entry.state

    @rule(ms=stn.integers(0, 20))
    def tick(self, ms: int) -> None:
        self.now += ms
        if self.entry is not None:
            expired = st.expire(self.entry, self.now)
            if expired is not None:
                self.entry = expired

    @invariant()
    def one_transaction_per_epoch(self) -> None:
        if self.entry is not None:
            assert self.entry.epoch == self.max_epoch
            final = self.finished.get(self.entry.epoch)
            if final is not None:
                assert self.entry.state == final  # a decided epoch never changes its decision


TestCoordinator = Coordinator.TestCase
TestCoordinator.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_guarded_init_only_for_the_current_session() -> None:
    from cursus.transactions.state import check_guarded_init

    entry = st.TxnEntry("t", "7", 3, "committed")
    assert check_guarded_init(entry, "t", "7", 3) is entry
    for pid, epoch, code in (("7", 2, "producer_fenced"), ("8", 3, "producer_fenced"), ("7", 4, "invalid_epoch")):
        with pytest.raises(BrokerError) as info:
            check_guarded_init(entry, "t", pid, epoch)
        assert info.value.error.code == code
    with pytest.raises(BrokerError) as info:
        check_guarded_init(None, "t", "7", 1)
    assert info.value.error.code == "producer_fenced"


def test_a_guarded_init_retried_after_a_lost_reply_gets_its_own_bump() -> None:
    entry = st.TxnEntry("t", "7", 3, "committed")
    bumped = st.init_producer(entry, "t", new_producer_id="", now_ms=5, reinit_from=3)
    assert (bumped.epoch, bumped.reinit_from) == (4, 3)
    assert st.guarded_retry(bumped, "7", 3) and st.guard_admits(bumped, "7", 3) and st.guard_admits(bumped, "7", 4)
    assert st.TxnEntry.from_json(bumped.to_json()) == bumped
    assert "reinit_from" not in entry.to_json()  # old encoding kept
    # a plain re-init (another instance) clears it: the holder of epoch 3 is then a zombie
    plain = st.init_producer(entry, "t", new_producer_id="", now_ms=5)
    assert not st.guarded_retry(plain, "7", 3) and not st.guard_admits(plain, "7", 3)
    # once the epoch began a transaction the retry window is over
    opened = st.begin(bumped, "t", "7", 4, now_ms=6, timeout_ms=100)
    assert opened.reinit_from == 0 and not st.guarded_retry(opened, "7", 3)
    assert not st.guarded_retry(bumped, "8", 3) and not st.guarded_retry(bumped, "7", 2)
