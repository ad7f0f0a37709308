"""The version check's view (:class:`PartitionEvents`): committed index plus this leader's appends in
flight; as the index catches up, pending appends hand over without the current version ever moving back."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from cursus.broker.eventstore import PartitionEvents, PendingAppend
from cursus.eventstore import SnapshotStore, StreamEntry, StreamIndex
from cursus.wire.errors import BrokerError


@given(st.lists(st.sampled_from("abc"), min_size=1, max_size=40), st.data())
def test_current_version_counts_appends_in_flight_and_never_moves_back(keys: list[str], data: st.DataObject) -> None:
    events = PartitionEvents("t", 0, Path("."), StreamIndex(), SnapshotStore())
    events.start_epoch(1, 0)
    log: list[tuple[str, int]] = []
    expected: dict[str, int] = {}
    for key in keys:
        version = events.current_version(key) + 1
        expected[key] = version
        events.reserve(key, PendingAppend(version, len(log)))
        log.append((key, version))
        # the committed HWM moves forward by some amount: the index catches up to it
        hwm = data.draw(st.integers(events.index.indexed_offset, len(log)))
        for offset in range(events.index.indexed_offset, hwm):
            k, v = log[offset]
            events.index.apply(k, StreamEntry(v, offset))
        events.index.advance(hwm)
        events.prune_pending()
        for k, v in expected.items():
            assert events.current_version(k) == v
            assert events.index.version(k) <= v
    assert all(p.offset >= events.index.indexed_offset for ps in events.pending.values() for p in ps)


def test_a_new_epoch_forgets_pending_appends() -> None:
    events = PartitionEvents("t", 0, Path("."), StreamIndex(), SnapshotStore())
    events.start_epoch(1, 0)
    events.reserve("a", PendingAppend(1, 0))
    assert events.current_version("a") == 1 and events.find("a", 1) is not None
    events.start_epoch(2, 0)
    assert events.current_version("a") == 0 and events.find("a", 1) is None


@given(st.lists(st.tuples(st.sampled_from(["append", "append", "append", "commit", "abort", "index"]),
                          st.sampled_from([None, "T1", "T2"]), st.sampled_from("ab"), st.integers(0, 2)),
                min_size=1, max_size=60))
def test_transactional_appends_keep_every_aggregate_contiguous(ops: list[tuple[str, str | None, str, int]]) -> None:
    """Staged appends (TXN_APPEND_STREAM) of open transactions, plain appends and commit/abort in any order,
    the index caught up to the LSO (first record of an undecided transaction) now and then, aborted staged
    appends pruned before every check (each command catches up first): an append is
    accepted iff it is the model's current + 1 and no other undecided transaction holds the key; the
    index's versions of every key are always 1..n, and the current version never counts aborted ones."""
    events = PartitionEvents("t", 0, Path("."), StreamIndex(), SnapshotStore())
    events.start_epoch(1, 0)
    log: list[tuple[str, int, tuple[str, int] | None]] = []
    status: dict[tuple[str, int], str] = {}
    epochs = {"T1": 1, "T2": 1}

    def undecided(p: PendingAppend) -> bool:
        return p.producer is not None and status.get(p.producer) == "open"

    def aborted(offset: int) -> bool:
        producer = log[offset][2]
        return producer is not None and status.get(producer) == "aborted"

    def catch_up() -> None:
        lso = next((o for o, (_, _, p) in enumerate(log) if p is not None and status[p] == "open"), len(log))
        for offset in range(events.index.indexed_offset, lso):
            key, version, producer = log[offset]
            if not aborted(offset):
                events.index.apply(key, StreamEntry(version, offset))
        events.index.advance(max(events.index.indexed_offset, lso))
        events.prune_pending(aborted)

    for op, writer, key, delta in ops:
        producer = (writer, epochs[writer]) if writer is not None else None
        if op == "append":
            events.prune_pending(aborted)  # every command catches up first (at least this much)
            live = [(v, p) for k, v, p in log if k == key and (p is None or status[p] != "aborted")]
            current = max((v for v, _ in live), default=0)
            held = any(p is not None and p != producer and status[p] == "open" for _, p in live)
            version = current + 1 if delta == 0 else max(1, current + delta - 1)
            try:
                events.check_version(key, version, producer, undecided)
                accepted = True
            except BrokerError:
                accepted = False
            assert accepted == (version == current + 1 and not held)
            if accepted:
                events.reserve(key, PendingAppend(version, len(log), producer=producer))
                log.append((key, version, producer))
                if producer is not None:
                    status[producer] = "open"
        elif op in ("commit", "abort") and producer is not None:
            if status.get(producer) == "open":
                status[producer] = "committed" if op == "commit" else "aborted"
            epochs[writer] += 1  # one transaction per epoch
        if op == "index":
            catch_up()
        for k in "ab":
            versions = [e.version for e in events.index.entries(k)]
            assert versions == list(range(1, len(versions) + 1))
