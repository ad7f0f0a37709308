"""``checkpoints.json``: a partition's durable bookkeeping, replaced atomically.

Format (version 1)::

    {"version":1,"recovery_point":N,"log_start_offset":N,"hwm":N,"leader_epochs":[[epoch,start_offset],...]}

* ``recovery_point``: every offset below it was fsynced when the file was written (recovery validates
  only from the segment containing it);
* ``log_start_offset``: first retained offset (retention and TRUNCATE advance it);
* ``hwm``: last high-water mark the broker reported;
* ``leader_epochs``: KIP-101 leader-epoch history, epochs strictly increasing, start offsets
  non-decreasing.

A missing file is normal for a new partition; a present but unparseable file is corruption (the file is
only ever replaced atomically, so garbage means damage) and raises :class:`CorruptLogError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cursus.storage.atomic import atomic_write
from cursus.storage.errors import CorruptLogError, UnsupportedFormatError

CHECKPOINT_FILE_NAME = "checkpoints.json"
CHECKPOINT_VERSION = 1


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """One ``checkpoints.json`` document; offsets are log offsets (ints >= 0)."""

    recovery_point: int
    log_start_offset: int
    hwm: int
    leader_epochs: tuple[tuple[int, int], ...] = ()

    def encode(self) -> bytes:
        """Compact JSON with a trailing newline."""
        document = {
            "version": CHECKPOINT_VERSION,
            "recovery_point": self.recovery_point,
            "log_start_offset": self.log_start_offset,
            "hwm": self.hwm,
            "leader_epochs": [[epoch, start] for epoch, start in self.leader_epochs],
        }
        return json.dumps(document, separators=(",", ":")).encode("ascii") + b"\n"


def _offset(document: dict[str, object], key: str) -> int:
    value = document.get(key)
    if type(value) is not int or value < 0:
        raise ValueError(f"{key} must be an integer >= 0, got {value!r}")
    return value


def _epochs(value: object) -> tuple[tuple[int, int], ...]:
    if not isinstance(value, list):
        raise ValueError("leader_epochs must be a list")
    epochs: list[tuple[int, int]] = []
    for item in value:
        if (not isinstance(item, list) or len(item) != 2
                or any(type(v) is not int or v < 0 for v in item)):
            raise ValueError(f"bad leader epoch entry {item!r}")
        if epochs and (item[0] <= epochs[-1][0] or item[1] < epochs[-1][1]):
            raise ValueError(f"leader epochs not increasing at {item!r}")
        epochs.append((item[0], item[1]))
    return tuple(epochs)


def decode_checkpoint(data: bytes, path: Path) -> Checkpoint:
    """Parse a ``checkpoints.json`` document.

    Raises:
        UnsupportedFormatError: a version other than 1.
        CorruptLogError: anything else that is not a valid document.
    """
    try:
        document = json.loads(data.decode("utf-8"))
        if not isinstance(document, dict):
            raise ValueError("not a JSON object")
        version = document.get("version")
        if version != CHECKPOINT_VERSION:
            raise UnsupportedFormatError(f"{path}: checkpoint version {version!r} is not supported "
                                         f"(expected {CHECKPOINT_VERSION})")
        return Checkpoint(
            recovery_point=_offset(document, "recovery_point"),
            log_start_offset=_offset(document, "log_start_offset"),
            hwm=_offset(document, "hwm"),
            leader_epochs=_epochs(document.get("leader_epochs", [])),
        )
    except (ValueError, UnicodeDecodeError) as error:
        raise CorruptLogError(path, None, None, f"invalid checkpoint file: {error}") from error


def read_checkpoint(directory: Path) -> Checkpoint | None:
    """Read ``<directory>/checkpoints.json``; ``None`` when it does not exist.

    Raises:
        CorruptLogError, UnsupportedFormatError: see :func:`decode_checkpoint`.
    """
    path = directory / CHECKPOINT_FILE_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    return decode_checkpoint(data, path)


def write_checkpoint(directory: Path, checkpoint: Checkpoint) -> None:
    """Durably replace ``<directory>/checkpoints.json`` (temp file, fsync, rename, dir fsync).

    Raises:
        OSError: the write failed; the previous checkpoint stays in place.
    """
    assert checkpoint.log_start_offset >= 0 and checkpoint.recovery_point >= 0
    atomic_write(directory / CHECKPOINT_FILE_NAME, checkpoint.encode(), mode=0o644)
