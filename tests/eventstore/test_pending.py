"""The version check's view (:class:`PartitionEvents`): committed index plus this leader's appends in
flight; as the index catches up, pending appends hand over without the current version ever moving back."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from cursus.broker.eventstore import PartitionEvents, PendingAppend
from cursus.eventstore import SnapshotStore, StreamEntry, StreamIndex


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
