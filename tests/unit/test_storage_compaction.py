"""Log compaction: the planner against a model (hypothesis), and cleaner passes on real PartitionLogs
(latest value per key, tombstone window, offsets unchanged, reads across gaps, swap crash points, recovery,
readers holding the old segment)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cursus.storage import PartitionLog
from cursus.storage.cleaner import PassAborted, Throttle, clean_pass
from cursus.storage.compaction import (
    RecordInfo,
    describe_record,
    describe_record_strict,
    latest_offsets,
    plan,
    runs,
)
from cursus.storage.swap import cleaned_file_name, swap_file_name
from cursus.wire.batch import TXN_CONTROL_MARKER_PAYLOAD, Record, decode_record, encode_record
from tests.unit.test_storage_support import records_section, small_config, split_section

KEYS = ["a", "b", "c", "d", "e"]
RETENTION_MS = 1_000

# ------------------------------------------------------------------------------------------- planner

# One record: (key or None, tombstone?, age in ms, aborted?, marker?)
_record = st.tuples(st.sampled_from([*KEYS, None]), st.booleans(), st.integers(0, 2 * RETENTION_MS),
                    st.booleans(), st.booleans())


def _model(records: list[tuple[str | None, bool, int, bool, bool]]) -> set[int]:
    """Survivors by the rules stated in cursus.storage.compaction, computed the naive way."""
    survivors = set()
    for offset, (key, tombstone, age, aborted, marker) in enumerate(records):
        if marker:
            survivors.add(offset)
            continue
        if aborted:
            continue
        if key is None:
            survivors.add(offset)
            continue
        later = [o for o, r in enumerate(records) if o > offset and r[0] == key and not r[3] and not r[4]]
        if later:
            continue
        if tombstone and age >= RETENTION_MS:
            continue
        survivors.add(offset)
    return survivors


def _infos(records: list[tuple[str | None, bool, int, bool, bool]], now_ms: int) -> tuple[list[RecordInfo], list]:
    infos = [RecordInfo(o, k, t, m, now_ms - age) for o, (k, t, age, _, m) in enumerate(records)]
    aborted = runs([o for o, r in enumerate(records) if r[3] and not r[4]])
    return infos, [(first, first + count) for first, count in aborted]


@given(st.lists(_record, max_size=60))
def test_planner_agrees_with_the_model(records: list[tuple[str | None, bool, int, bool, bool]]) -> None:
    now_ms = 10_000_000
    infos, aborted = _infos(records, now_ms)
    kept = plan(infos, now_ms=now_ms, delete_retention_ms=RETENTION_MS, aborted=aborted)
    assert kept == sorted(_model(records))
    # the latest value of every key is what a reader of the survivors sees (unless its tombstone expired)
    visible: dict[str, int] = {}
    for offset in kept:
        key = records[offset][0]
        if key is not None and not records[offset][4]:
            visible[key] = offset
    latest = latest_offsets(infos, aborted)
    for key, offset in latest.items():
        expired = records[offset][1] and records[offset][2] >= RETENTION_MS
        assert visible.get(key) == (None if expired else offset)
    # a second pass over the survivors changes nothing (idempotent)
    again = plan([infos[o] for o in kept], now_ms=now_ms, delete_retention_ms=RETENTION_MS, aborted=aborted)
    assert again == kept


_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)


@given(key=st.none() | _text, payload=st.sampled_from([b"", b"v", TXN_CONTROL_MARKER_PAYLOAD, b"x" * 300]),
       timestamp=st.none() | st.integers(0, 2**62), producer=st.none() | _text, marker=st.none() | st.just("abort"),
       event_id=st.none() | _text, version=st.sampled_from([2, 3]))
def test_fast_record_description_matches_the_strict_decoder(key, payload, timestamp, producer, marker,
                                                            event_id, version) -> None:
    record = Record("topic", 3, payload, 77, version=version, key=key, timestamp=timestamp, producer_id=producer,
                    seq_num=5 if producer is not None else 0, producer_epoch=1 if producer is not None else 0,
                    transactional_id="tx" if marker else None,
                    transaction_marker=marker, event_id=event_id if version == 3 else None)
    raw = encode_record(record)
    assert describe_record(raw, 77, 9) == describe_record_strict(raw, 77, 9)
    assert describe_record(memoryview(raw), 77, 9).key == key


@given(st.lists(st.integers(0, 200), unique=True))
def test_runs_are_maximal_contiguous(offsets: list[int]) -> None:
    offsets.sort()
    found = runs(offsets)
    assert [o for first, count in found for o in range(first, first + count)] == offsets
    assert all(a[0] + a[1] < b[0] for a, b in zip(found, found[1:], strict=False))


# ------------------------------------------------------------------------------------------ the log

def _record_bytes(offset: int, key: str | None, value: bytes) -> bytes:
    return encode_record(Record("t", 0, value, offset, key=key, timestamp=offset))


def _append(log: PartitionLog, items: list[tuple[str | None, bytes]], chunk: int, time_ms: int) -> None:
    """Append ``items`` (key, value) as chunks of up to ``chunk`` records; flush."""
    for start in range(0, len(items), chunk):
        part = items[start:start + chunk]
        base = log.log_end_offset
        body = records_section([_record_bytes(base + i, k, v) for i, (k, v) in enumerate(part)])
        log.append_chunk(base, len(part), body, time_ms)
    log.flush()


def _read_everything(log: PartitionLog, max_records: int = 7) -> list[tuple[int, bytes]]:
    """(offset, record bytes) of every durable record, read in small contiguous runs as a consumer would."""
    out: list[tuple[int, bytes]] = []
    offset = log.log_start_offset
    while offset < log.durable_end_offset:
        result = log.read(offset, max_offset=log.durable_end_offset, max_records=max_records, max_bytes=1 << 20)
        assert result.first_offset >= offset
        records = split_section(result.records)
        assert len(records) == result.record_count
        for number, record in enumerate(records):
            assert decode_record(record).offset == result.first_offset + number
            out.append((result.first_offset + number, record))
        assert result.next_offset == result.first_offset + result.record_count
        assert result.next_offset > offset or result.record_count == 0
        if result.record_count == 0:
            assert result.next_offset >= log.durable_end_offset or result.next_offset > offset
            if result.next_offset == offset:
                break
        offset = result.next_offset
    return out


def _swap_all(log: PartitionLog, stats, crash_hook=None) -> None:
    for copy in stats.copies:
        assert log.replace_with_cleaned(copy.base_offset, copy.old_size_bytes, copy.next_offset, copy.size_bytes,
                                        copy.index_entries, crash_hook)


_item = st.tuples(st.sampled_from([*KEYS, None]), st.sampled_from([b"", b"v1", b"value-2", b"x" * 40]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_item, min_size=1, max_size=120), st.integers(1, 6), st.integers(64, 400))
def test_cleaned_log_keeps_latest_per_key_with_offsets_unchanged(items: list[tuple[str | None, bytes]],
                                                                 chunk: int, interval: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "p"
        config = small_config(segment_bytes=600, index_interval_bytes=interval)
        log = PartitionLog.open(directory, config)
        now_ms = 5_000_000
        _append(log, items, chunk, now_ms - 10 * RETENTION_MS)  # tombstones are old: they expire
        before = dict(_read_everything(log, max_records=1 << 20))
        active_base = log.segments_info()[-1].base_offset
        stats = clean_pass(log, log.log_end_offset, now_ms=now_ms, delete_retention_ms=RETENTION_MS)
        _swap_all(log, stats)
        after = _read_everything(log)
        # expected: every record of the active segment; below it the model's survivors
        closed = [(k, v == b"", 10 * RETENTION_MS, False, False) for k, v in items[:active_base]]
        expected = sorted(_model(closed) | set(range(active_base, len(items))))
        assert [o for o, _ in after] == expected
        assert all(before[o] == record for o, record in after)  # bytes and offsets unchanged
        assert log.log_end_offset == len(items)
        # recovery (clean and unclean) serves the same, and a second pass is a no-op
        log.close()
        for clean in (True, False):
            log = PartitionLog.open(directory, config, clean_shutdown=clean)
            assert _read_everything(log) == after
            again = clean_pass(log, log.log_end_offset, now_ms=now_ms, delete_retention_ms=RETENTION_MS)
            assert again.copies == []
            log.close()


def _fill(directory: Path) -> tuple[PartitionLog, dict[str, bytes]]:
    log = PartitionLog.open(directory, small_config(segment_bytes=400, index_interval_bytes=64))
    latest: dict[str, bytes] = {}
    items = []
    for n in range(80):
        key = KEYS[n % len(KEYS)]
        value = f"{key}-{n}".encode()
        latest[key] = value
        items.append((key, value))
    _append(log, items, 3, 1_000)
    return log, latest


def _latest_seen(log: PartitionLog) -> dict[str, bytes]:
    seen: dict[str, bytes] = {}
    for _, record in _read_everything(log):
        r = decode_record(record)
        assert r.key is not None
        seen[r.key] = r.payload
    return seen


def test_tombstones_stay_for_the_retention_window_then_go(tmp_path: Path) -> None:
    log = PartitionLog.open(tmp_path / "p", small_config(segment_bytes=300, index_interval_bytes=64))
    _append(log, [("a", b"1"), ("b", b"1"), ("a", b""), ("c", b"1")] * 3, 2, 1_000)
    _append(log, [("z", b"pad")] * 10, 5, 1_000)
    inside = clean_pass(log, log.log_end_offset, now_ms=1_000 + RETENTION_MS - 1, delete_retention_ms=RETENTION_MS)
    _swap_all(log, inside)
    values = {decode_record(r).key: decode_record(r).payload for _, r in _read_everything(log)}
    assert values["a"] == b""  # the delete is still visible
    later = clean_pass(log, log.log_end_offset, now_ms=1_000 + RETENTION_MS, delete_retention_ms=RETENTION_MS)
    _swap_all(log, later)
    keys = [decode_record(r).key for _, r in _read_everything(log)]
    assert "a" not in keys and "b" in keys and "c" in keys
    log.close()


def test_aborted_records_are_dropped_and_never_supersede(tmp_path: Path) -> None:
    log = PartitionLog.open(tmp_path / "p", small_config(segment_bytes=300, index_interval_bytes=64))
    _append(log, [("a", b"good")] + [("a", b"aborted")] * 3 + [("b", b"1")] * 2, 2, 1_000)
    _append(log, [("z", b"pad")] * 10, 5, 1_000)
    stats = clean_pass(log, log.log_end_offset, now_ms=2_000, delete_retention_ms=RETENTION_MS, aborted=[(1, 4)])
    _swap_all(log, stats)
    seen = [(o, decode_record(r).key, decode_record(r).payload) for o, r in _read_everything(log)]
    assert (0, "a", b"good") in seen and not any(p == b"aborted" for _, _, p in seen)
    log.close()


def test_a_reader_holding_the_old_segment_keeps_reading_it(tmp_path: Path) -> None:
    log, latest = _fill(tmp_path / "p")
    chunks = log.iter_stored_chunks(0)
    first = next(chunks)  # pins segment 0
    stats = clean_pass(log, log.log_end_offset, now_ms=2_000, delete_retention_ms=RETENTION_MS)
    _swap_all(log, stats)
    rest = list(chunks)  # the old segment's chunks, intact, then the new segments
    assert first[0].base_offset == 0 and rest
    assert _latest_seen(log) == latest
    log.close()


def test_clean_below_the_cleanable_end_only(tmp_path: Path) -> None:
    log, _ = _fill(tmp_path / "p")
    segments = log.segments_info()
    end = segments[2].next_offset
    stats = clean_pass(log, end, now_ms=2_000, delete_retention_ms=RETENTION_MS)
    assert stats.copies and all(c.next_offset <= end for c in stats.copies)
    log.close()


def test_throttle_sleeps_when_ahead() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    throttle = Throttle(1000, clock=lambda: now[0], sleep=sleep)
    throttle.consume(500)
    throttle.consume(1500)
    assert abs(sum(slept) - 2.0) < 1e-6  # 2000 bytes at 1000 B/s
    now[0] += 10.0
    slept.clear()
    throttle.consume(100)
    assert slept == []  # behind the budget: no sleep


class _Crash(Exception):
    pass


@pytest.mark.parametrize("point", ["after_cleaned_written", "after_swap_marker", "after_rename", "after_index"])
def test_a_crash_at_any_swap_point_leaves_old_or_new(tmp_path: Path, point: str) -> None:
    directory = tmp_path / "p"
    log, latest = _fill(directory)
    before = _read_everything(log)

    def hook(where: str) -> None:
        if where == point:
            raise _Crash(where)

    with pytest.raises(_Crash):
        stats = clean_pass(log, log.log_end_offset, now_ms=2_000, delete_retention_ms=RETENTION_MS, crash_hook=hook)
        _swap_all(log, stats, hook)
    # the process "dies": the log object is abandoned unclosed; recovery runs on the files as they are
    reopened = PartitionLog.open(directory, small_config(segment_bytes=400, index_interval_bytes=64))
    after = _read_everything(reopened)
    assert _latest_seen(reopened) == latest
    assert set(after) <= set(before)  # offsets and bytes unchanged
    names = {p.name for p in directory.iterdir()}
    assert not any(n.endswith((".swap", ".cleaned")) for n in names), names
    assert cleaned_file_name(0) not in names and swap_file_name(0) not in names
    if point == "after_cleaned_written":
        assert after == before  # no commit point: the old segment stays
    else:
        assert len(after) < len(before)  # committed: the swap was completed
    reopened.close()


@pytest.mark.parametrize("where", ["gap", "record"])
def test_truncation_into_a_cleaned_segment_then_appends_survive_recovery(tmp_path: Path, where: str) -> None:
    directory = tmp_path / "p"
    config = small_config(segment_bytes=400, index_interval_bytes=64)
    log, _ = _fill(directory)
    stats = clean_pass(log, log.log_end_offset, now_ms=2_000, delete_retention_ms=RETENTION_MS)
    _swap_all(log, stats)
    stored = [o for o, _ in _read_everything(log)]
    segment = next(s for s in log.segments_info() if s.is_compacted and s.next_offset - s.base_offset > 2)
    inside = [o for o in stored if segment.base_offset < o < segment.next_offset]
    gaps = [o for o in range(segment.base_offset + 1, segment.next_offset) if o not in stored]
    cut = gaps[0] if where == "gap" and gaps else inside[0] if inside else gaps[0]
    log.truncate_to(cut)
    assert log.log_end_offset == cut
    assert [o for o, _ in _read_everything(log)] == [o for o in stored if o < cut]
    _append(log, [("new", b"after-cut")] * 3, 2, 3_000)
    expected = [o for o in stored if o < cut] + [cut, cut + 1, cut + 2]
    assert [o for o, _ in _read_everything(log)] == expected
    log.close()
    for clean in (True, False):
        reopened = PartitionLog.open(directory, config, clean_shutdown=clean)
        assert reopened.log_end_offset == cut + 3
        assert [o for o, _ in _read_everything(reopened)] == expected
        reopened.close()


def test_a_stopped_pass_aborts_and_leaves_no_copy(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    log, latest = _fill(directory)
    consumed = [0]

    def stopped() -> bool:
        consumed[0] += 1
        return consumed[0] > 40  # stop midway through the copies

    with pytest.raises(PassAborted):
        clean_pass(log, log.log_end_offset, now_ms=2_000, delete_retention_ms=RETENTION_MS,
                   throttle=Throttle(0, stopped=stopped))
    assert not [p.name for p in directory.iterdir() if p.name.endswith(".cleaned")]
    assert _latest_seen(log) == latest
    log.close()
