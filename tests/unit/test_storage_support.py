"""Helpers shared by the storage tests (no tests here): deterministic records and a log model."""

from __future__ import annotations

import os
import struct
import sys
from pathlib import Path

from cursus.storage import LogConfig, PartitionLog

REPO_ROOT = Path(__file__).resolve().parents[2]
_U32 = struct.Struct(">I")


def records_section(records: list[bytes]) -> bytes:
    """Encode records as a records section (u32 length + bytes, repeated)."""
    return b"".join(_U32.pack(len(r)) + r for r in records)


def split_section(section: bytes) -> list[bytes]:
    """Decode a records section back into records."""
    records = []
    position = 0
    while position < len(section):
        (length,) = _U32.unpack_from(section, position)
        records.append(section[position + 4:position + 4 + length])
        position += 4 + length
    assert position == len(section)
    return records


def record_for(offset: int, tag: str = "r", size_bytes: int | None = None) -> bytes:
    """A deterministic record for ``offset`` (content depends only on tag and offset)."""
    stem = f"{tag}:{offset}:".encode()
    size = size_bytes if size_bytes is not None else 1 + (offset * 7919) % 61
    return (stem * (size // len(stem) + 1))[:max(size, len(stem))]


def append_records(log: PartitionLog, counts: list[int], tag: str = "r",
                   append_time_ms: int | None = None, leader_epoch: int | None = None) -> list[bytes]:
    """Append one chunk per entry of ``counts`` with deterministic records; returns the records."""
    appended = []
    for count in counts:
        base = log.log_end_offset
        records = [record_for(base + i, tag) for i in range(count)]
        log.append_chunk(base, count, records_section(records), append_time_ms, leader_epoch=leader_epoch)
        appended.extend(records)
    return appended


def read_all(log: PartitionLog, start: int | None = None) -> list[bytes]:
    """Every durable record from ``start`` (default log start), read in one call."""
    offset = log.log_start_offset if start is None else start
    result = log.read(offset, max_offset=log.durable_end_offset, max_records=1 << 30, max_bytes=1 << 40)
    assert result.next_offset == log.durable_end_offset
    return split_section(result.records)


def small_config(**overrides: int) -> LogConfig:
    """A config with tiny segments and a dense index, so tests cross many boundaries."""
    values = dict(segment_bytes=1024, index_interval_bytes=128)
    values.update(overrides)
    return LogConfig(**values)


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a child Python that imports ``cursus`` from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("CURSUS_STORAGE_FAULTS", None)
    env.update(extra)
    return env


PYTHON = sys.executable
