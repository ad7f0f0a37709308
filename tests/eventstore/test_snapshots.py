"""Snapshot store (sans-IO): latest per key, torn final record discarded, earlier ones kept."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cursus.eventstore import Snapshot, SnapshotStore, decode_snapshot_log, encode_snapshot_record

snapshots = st.lists(st.builds(Snapshot, st.sampled_from(["a", "b", "c"]), st.integers(1, 1000),
                               st.text(max_size=30)), max_size=20)


def latest(snaps: list[Snapshot]) -> dict[str, Snapshot]:
    out: dict[str, Snapshot] = {}
    for s in snaps:
        if s.key not in out or out[s.key].version <= s.version:
            out[s.key] = s
    return out


@given(snapshots)
def test_store_keeps_the_highest_version_per_key(snaps: list[Snapshot]) -> None:
    store = SnapshotStore(snaps)
    assert {s.key: s for s in store} == latest(snaps)


@given(snapshots)
def test_file_round_trip(snaps: list[Snapshot]) -> None:
    blob = b"".join(encode_snapshot_record(s) for s in snaps)
    decoded, valid = decode_snapshot_log(blob)
    assert decoded == snaps and valid == len(blob)


@given(snapshots.filter(bool), st.data())
def test_torn_tail_keeps_every_earlier_record(snaps: list[Snapshot], data: st.DataObject) -> None:
    records = [encode_snapshot_record(s) for s in snaps]
    whole = b"".join(records[:-1])
    cut = data.draw(st.integers(min_value=0, max_value=len(records[-1]) - 1))
    torn = whole + records[-1][:cut]
    decoded, valid = decode_snapshot_log(torn)
    assert decoded == snaps[:-1] and valid == len(whole)
    # a corrupt (not torn) final record too
    bad = bytearray(whole + records[-1])
    bad[-1] ^= 0x01
    decoded, valid = decode_snapshot_log(bytes(bad))
    assert decoded == snaps[:-1] and valid == len(whole)


def test_drop_above() -> None:
    store = SnapshotStore([Snapshot("a", 5, "x")])
    store.drop_above("a", 5)
    assert store.get("a") is not None
    store.drop_above("a", 4)
    assert store.get("a") is None
