"""Stream index (sans-IO): ordering, truncation, checkpoint round trip and torn checkpoints."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cursus.eventstore import IndexCheckpointError, StreamEntry, StreamIndex

keys = st.sampled_from(["a", "b", "order-1", "ключ", "k with space"])
#: A log as a list of (key or None for a non-event record).
logs = st.lists(st.one_of(st.none(), keys), max_size=60)


def build(log: list[str | None], upto: int | None = None) -> tuple[StreamIndex, dict[str, list[int]]]:
    """Index ``log`` as the broker appends it (each key's versions 1, 2, ...); the model is key -> offsets."""
    index, model = StreamIndex(), {}
    versions: dict[str, int] = {}
    for offset, key in enumerate(log[:upto]):
        if key is not None:
            versions[key] = versions.get(key, 0) + 1
            index.apply(key, StreamEntry(versions[key], offset, f"id-{offset}" if offset % 2 else None))
            model.setdefault(key, []).append(offset)
    index.advance(len(log[:upto]))
    return index, model


@given(logs)
def test_versions_and_entries_follow_the_log(log: list[str | None]) -> None:
    index, model = build(log)
    assert index.indexed_offset == len(log)
    for key, offsets in model.items():
        assert index.version(key) == len(offsets)
        assert [e.offset for e in index.entries(key)] == offsets
        assert [e.version for e in index.entries(key, 2)] == list(range(2, len(offsets) + 1))
    assert index.version("absent") == 0 and index.entries("absent") == []
    assert index.event_count == sum(len(v) for v in model.values())


@given(logs, st.integers(min_value=0, max_value=70))
def test_truncate_equals_indexing_the_prefix(log: list[str | None], cut: int) -> None:
    index, _ = build(log)
    index.truncate(cut)
    prefix, _ = build(log, cut)
    if cut >= len(log):
        prefix.indexed_offset = index.indexed_offset
    assert index.encode() == prefix.encode()


@given(logs)
def test_checkpoint_round_trip(log: list[str | None]) -> None:
    index, _ = build(log)
    again = StreamIndex.decode(index.encode())
    assert again.encode() == index.encode()
    assert again.event_count == index.event_count
    for key in index.keys():
        assert again.entries(key) == index.entries(key)


@given(logs, st.data())
def test_torn_or_corrupt_checkpoint_is_refused(log: list[str | None], data: st.DataObject) -> None:
    blob = build(log)[0].encode()
    cut = data.draw(st.integers(min_value=0, max_value=len(blob) - 1))
    with pytest.raises(IndexCheckpointError):
        StreamIndex.decode(blob[:cut])
    pos = data.draw(st.integers(min_value=0, max_value=len(blob) - 1))
    flipped = bytearray(blob)
    flipped[pos] ^= 0x40
    with pytest.raises(IndexCheckpointError):
        StreamIndex.decode(bytes(flipped))


def test_apply_below_the_indexed_offset_is_refused() -> None:
    index = StreamIndex()
    index.advance(10)
    with pytest.raises(ValueError):
        index.apply("a", StreamEntry(1, 3))
