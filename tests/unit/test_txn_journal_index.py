"""__transaction_state.journal (torn tails, corruption, compaction) and the partition transaction index."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as stn

from cursus.transactions import state as st
from cursus.transactions.index import PartitionTxnIndex, filter_records
from cursus.transactions.journal import JOURNAL_NAME, JournalCorruptError, TxnJournal


def _entry(tid: str, epoch: int, state: str = st.EMPTY) -> st.TxnEntry:
    return st.TxnEntry(tid, "1", epoch, state)


def _write(tmp_path, count: int) -> list[st.TxnEntry]:
    journal = TxnJournal.open(tmp_path, compact_min_superseded=10_000)
    entries = []
    for i in range(count):
        entry = _entry(f"t{i % 3}", i + 1)
        journal.append([{"kind": "entry", "entry": entry.to_json()}])
        entries.append(entry)
    journal.append([{"kind": "touched", "partitions": [["out", 0]]}])
    journal.close()
    return entries


def test_replay_restores_the_latest_per_id(tmp_path):
    entries = _write(tmp_path, 7)
    journal = TxnJournal.open(tmp_path)
    assert journal.state.entries == {e.transactional_id: e for e in entries}
    assert journal.state.touched == {("out", 0)}


def test_every_torn_tail_is_truncated(tmp_path):
    _write(tmp_path, 4)
    path = tmp_path / JOURNAL_NAME
    data = path.read_bytes()
    ends = []
    pos = 0
    while pos < len(data):
        pos += 4 + struct.unpack_from(">I", data, pos)[0] + 4
        ends.append(pos)
    for cut in range(len(data)):
        path.write_bytes(data[:cut])
        journal = TxnJournal.open(tmp_path)
        valid = max([e for e in ends if e <= cut], default=0)
        assert journal.size == valid and path.stat().st_size == valid
        journal.close()


def test_corruption_before_valid_records_refuses(tmp_path):
    _write(tmp_path, 3)
    path = tmp_path / JOURNAL_NAME
    data = bytearray(path.read_bytes())
    data[12] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(JournalCorruptError):
        TxnJournal.open(tmp_path)


def test_compaction_keeps_state_and_bounds_the_file(tmp_path):
    journal = TxnJournal.open(tmp_path, compact_min_superseded=50)
    for i in range(1000):
        journal.append([{"kind": "entry", "entry": _entry(f"t{i % 5}", i + 1).to_json()}])
    journal.state.next_producer_id = 42
    journal.compact()
    journal.close()
    again = TxnJournal.open(tmp_path)
    assert len(again.state.entries) == 5 and again.state.entries["t4"].epoch == 1000
    assert again.state.records <= 60 and again.state.next_producer_id == 42


def _section(n: int) -> bytes:
    return b"".join(struct.pack(">I", 3) + bytes([i % 256]) * 3 for i in range(n))


@settings(max_examples=300, deadline=None)
@given(n=stn.integers(0, 40), cuts=stn.lists(stn.tuples(stn.integers(0, 45), stn.integers(1, 5)), max_size=6),
       marker_picks=stn.sets(stn.integers(0, 50), max_size=8))
def test_filter_matches_a_naive_model(n, cuts, marker_picks):
    index = PartitionTxnIndex()
    hidden = set()
    for start, length in cuts:
        for o in range(start, start + length):
            if o not in hidden:
                index._hide(o, o + 1)
                hidden.add(o)
    first = 3
    markers = tuple(sorted(o for o in marker_picks if o in hidden))
    ranges = index.hidden_slice(first, first + n)
    out, kept = filter_records(_section(n), first, n, ranges, markers)
    last = first + n - 1
    expected = [i for i in range(n) if first + i not in hidden or (first + i == last and last in markers)]
    assert kept == len(expected)
    assert out == b"".join(struct.pack(">I", 3) + bytes([i % 256]) * 3 for i in expected)


def test_lso_and_resolution():
    index = PartitionTxnIndex()
    assert index.lso(10) == 10
    index.on_data("p1", 3, transactional_id="a", producer_epoch=1)
    index.on_data("p2", 5, transactional_id="b", producer_epoch=1)
    index.on_data("p1", 6, transactional_id="a", producer_epoch=1)
    assert index.lso(10) == 3
    index.on_marker("p1", 7, commit=False, final=False)
    assert index.lso(10) == 3 and index.is_hidden(7)  # pinned until the decision is final
    index.finalize("p1")
    assert index.lso(10) == 5
    assert index.hidden_ranges == [(3, 4), (6, 8)]
    index.on_marker("p2", 8, commit=True, final=True)
    assert index.lso(10) == 10 and index.hidden_ranges == [(3, 4), (6, 9)]


def test_a_reply_ending_on_a_marker_keeps_it():
    index = PartitionTxnIndex()
    index.on_data("p", 0, transactional_id="a", producer_epoch=1)
    index.on_marker("p", 1, commit=False, final=True)
    hidden, markers = index.hidden_slice(0, 2), index.markers_slice(0, 2)
    out, kept = filter_records(_section(2), 0, 2, hidden, markers)
    assert kept == 1 and out == struct.pack(">I", 3) + bytes([1]) * 3  # the marker: the client moves past it
    out, kept = filter_records(_section(1), 0, 1, hidden, markers)  # cut before the marker: nothing
    assert kept == 0 and out == b""


def test_published_seq_nums_of_the_open_transaction_only():
    index = PartitionTxnIndex()
    index.on_data("7", 10, transactional_id="t", producer_epoch=2, seq_num=1)
    index.on_data("7", 11, transactional_id="t", producer_epoch=2, seq_num=2)
    assert index.published("7", 2, 2) == 11 and index.published("7", 2, 3) is None
    assert index.published("7", 1, 1) is None  # another epoch: a new session's seqNums start over
    index.on_marker("7", 12, commit=True, final=False)
    assert index.published("7", 2, 1) is None  # decided: a publish after the marker is a new transaction
