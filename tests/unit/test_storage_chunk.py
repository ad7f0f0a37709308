"""Chunk codec, offset index and fault-spec parsing: pure or single-file units."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import crc32c
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cursus.storage import faults
from cursus.storage.chunk import (
    HEADER_SIZE,
    MAGIC,
    crc_matches,
    cut_records,
    decode_header,
    encode_header,
    records_walk_ok,
    skip_records,
)
from cursus.storage.offset_index import ENTRY_SIZE, OffsetIndex
from tests.unit.test_storage_support import records_section, split_section


def test_header_layout_is_big_endian_and_crc_chains_header_then_body() -> None:
    body = records_section([b"hello", b"", b"world!"])
    header = encode_header(1234, 3, body, 99, 7)
    assert len(header) == HEADER_SIZE == 36
    magic, base, count, length, time_ms, epoch, crc = struct.unpack(">IQIIqII", header)
    assert (magic, base, count, length, time_ms, epoch) == (MAGIC, 1234, 3, len(body), 99, 7)
    assert header[:4] == b"CCK2"
    assert crc == crc32c.crc32c(body, crc32c.crc32c(header[:32]))
    decoded = decode_header(header, 0)
    assert decoded is not None and decoded.leader_epoch == 7
    assert decoded.next_offset == 1237 and decoded.size_bytes == 36 + len(body)
    assert crc_matches(header + body, 0, decoded)


def test_crc_detects_any_single_byte_flip() -> None:
    body = records_section([b"abc", b"defg"])
    chunk = bytearray(encode_header(7, 2, body, 5, 3) + body)
    header = decode_header(chunk, 0)
    assert header is not None
    for position in range(len(chunk)):
        if 32 <= position < 36:
            continue  # the CRC field itself
        damaged = bytearray(chunk)
        damaged[position] ^= 0x01
        damaged_header = decode_header(damaged, 0)
        detected = (damaged_header is None or damaged_header.size_bytes > len(damaged)
                    or not crc_matches(damaged, 0, damaged_header))
        assert detected, position


@pytest.mark.parametrize("mutate", [
    lambda h: b"XXXX" + h[4:],                                    # bad magic
    lambda h: h[:12] + struct.pack(">I", 0) + h[16:],             # zero records
    lambda h: h[:16] + struct.pack(">I", 3) + h[20:],             # body shorter than 4 * count
    lambda h: h[:16] + struct.pack(">I", 1 << 30) + h[20:],       # body over the limit
    lambda h: h[:20],                                             # truncated
])
def test_decode_header_rejects_implausible_headers(mutate) -> None:
    header = encode_header(0, 1, records_section([b"x"]), 0, 0)
    assert decode_header(mutate(header), 0) is None


def test_records_walk() -> None:
    body = records_section([b"a", b"bb", b"ccc"])
    assert records_walk_ok(body, 3)
    assert not records_walk_ok(body, 2)
    assert not records_walk_ok(body, 4)
    assert not records_walk_ok(body + b"\0", 3)
    assert not records_walk_ok(body[:-1], 3)
    assert records_walk_ok(memoryview(body), 3)


def _walk_model(body: bytes, count: int) -> bool:
    position = 0
    for _ in range(count):
        if position + 4 > len(body):
            return False
        position += 4 + struct.unpack_from(">I", body, position)[0]
        if position > len(body):
            return False
    return position == len(body)


def test_records_walk_of_uniform_records() -> None:
    body = records_section([b"x" * 100] * 1000)
    assert records_walk_ok(body, 1000) and records_walk_ok(memoryview(body), 1000)
    assert not records_walk_ok(body, 999) and not records_walk_ok(body, 500)
    broken = bytearray(body)
    broken[104 * 7 + 3] ^= 1  # one length prefix of the run differs
    assert not records_walk_ok(bytes(broken), 1000)
    assert records_walk_ok(records_section([b"ab", b"cd", b"efgh", b""]), 4)  # same total, other lengths


@given(st.lists(st.sampled_from([b"", b"a", b"bb", b"cccc", b"x" * 9]), min_size=1, max_size=40),
       st.integers(-2, 2), st.binary(max_size=3))
def test_records_walk_agrees_with_a_walk(records: list[bytes], count_delta: int, extra: bytes) -> None:
    body = records_section(records) + extra
    count = max(0, len(records) + count_delta)
    assert records_walk_ok(body, count) == _walk_model(body, count)
    uniform = records_section([records[0]] * len(records)) + extra
    assert records_walk_ok(uniform, count) == _walk_model(uniform, count)


@given(st.lists(st.binary(max_size=40), min_size=1, max_size=30), st.data())
def test_cut_and_skip_agree_with_a_simple_model(records: list[bytes], data: st.DataObject) -> None:
    body = records_section(records)
    skip = data.draw(st.integers(0, len(records) - 1))
    max_records = data.draw(st.integers(1, len(records)))
    max_bytes = data.draw(st.integers(0, len(body)))
    start = skip_records(body, 0, skip)
    assert start == len(records_section(records[:skip]))
    end, count = cut_records(body, start, max_records, max_bytes, at_least_one=True)
    expected: list[bytes] = []
    used = 0
    for record in records[skip:skip + max_records]:
        if expected and used + 4 + len(record) > max_bytes:
            break
        if not expected and used + 4 + len(record) > max_bytes:
            expected.append(record)  # at least one
            break
        expected.append(record)
        used += 4 + len(record)
    assert split_section(body[start:end]) == expected
    assert count == len(expected)


def test_offset_index_append_lookup_truncate(tmp_path: Path) -> None:
    path = tmp_path / "00000000000000000100.index"
    index = OffsetIndex(path, 100, interval_bytes=100)
    assert index.lookup(100) == (100, 0) and index.lookup(10**6) == (100, 0)
    assert not index.maybe_append(101, 50)        # under one interval since position 0
    assert index.maybe_append(105, 150)
    assert not index.maybe_append(107, 200)
    assert index.maybe_append(110, 260)
    assert index.entries() == [(5, 150), (10, 260)]
    assert path.stat().st_size == 0  # written in batches
    index.write_pending()
    assert path.stat().st_size == 2 * ENTRY_SIZE
    assert [index.lookup(o)[1] for o in (100, 104, 105, 109, 110, 500)] == [0, 0, 150, 150, 260, 260]
    assert index.lookup(109) == (105, 150)
    assert OffsetIndex.read_entries(path, 1000) == [(5, 150), (10, 260)]
    index.truncate_to_position(260)
    assert index.entries() == [(5, 150)] and path.stat().st_size == ENTRY_SIZE
    index.close()


@pytest.mark.parametrize("content, segment_size", [
    (struct.pack(">II", 5, 150) + b"\0\0\0", 1000),                  # partial entry
    (struct.pack(">IIII", 5, 150, 4, 200), 1000),                   # offsets not increasing
    (struct.pack(">IIII", 5, 150, 6, 150), 1000),                   # positions not increasing
    (struct.pack(">II", 5, 150) + b"\0" * 8, 1000),                 # zero-filled tail
    (struct.pack(">II", 5, 1500), 1000),                            # points past the segment end
])
def test_offset_index_sanity_check_rejects_damage(tmp_path: Path, content: bytes, segment_size: int) -> None:
    path = tmp_path / "x.index"
    path.write_bytes(content)
    assert OffsetIndex.read_entries(path, segment_size) is None


def test_fault_spec_parsing(tmp_path: Path) -> None:
    assert faults.parse(None) is None and faults.parse("  ") is None
    parsed = faults.parse(f"lose_unsynced=1, fsync_delay_ms=3,fsync_fail_file={tmp_path}/x,fsync_fail_match=p1")
    assert parsed == faults.Faults(tmp_path / "x", "p1", True, 3)
    with pytest.raises(ValueError, match="unknown"):
        faults.parse("lose_unsyncd=1")
    with pytest.raises(ValueError):
        faults.parse("lose_unsynced")
    trigger = tmp_path / "x"
    parsed.before_segment_fsync(tmp_path / "p0" / "a.log")  # trigger absent
    trigger.touch()
    parsed.before_segment_fsync(tmp_path / "p0" / "a.log")  # does not match
    with pytest.raises(OSError, match="injected fsync failure"):
        parsed.before_segment_fsync(tmp_path / "p1" / "a.log")


@pytest.mark.skipif(bool(os.environ.get(faults.ENVIRONMENT_VARIABLE)), reason="faults enabled on purpose")
def test_faults_are_off_by_default() -> None:
    assert faults.ACTIVE is None
