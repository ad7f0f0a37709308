"""Crash-safe replacement of one closed segment by its cleaned copy (the log cleaner's swap protocol).

Files beside segment ``<base:020d>.log`` (``<b>`` below)::

    <b>.log.cleaned   the cleaned copy being written (whole chunks, fsynced before the commit point)
    <b>.swap          commit point: JSON {"version": 1, "next_offset": N, "size_bytes": S}
    <b>.compacted     the segment is a cleaned one: JSON {"version": 1, "next_offset": N}

Steps of one swap (:func:`commit_swap`, after the caller wrote and fsynced ``.log.cleaned``):

1. ``atomic_write(<b>.swap)`` (temp file, fsync, rename, fsync dir): from here on the swap *will* happen;
2. ``rename(<b>.log.cleaned, <b>.log)`` (atomic: the directory entry names the old or the new inode);
3. the caller rewrites ``<b>.index`` for the new file (derived data);
4. ``rename(<b>.swap, <b>.compacted)`` and fsync the directory.

Recovery (:func:`finish_interrupted_swaps`, recovery pass 1) completes a swap whose ``.swap`` exists (rename
a remaining ``.log.cleaned``, drop the possibly stale index so it is rebuilt, rename the marker) and deletes a
``.log.cleaned`` without ``.swap`` (the old segment is intact). So a crash at any point leaves either the old
or the new segment, never neither and never a mix.

Pure path helpers plus small synchronous I/O; called from the writer thread and from recovery.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from cursus.storage.atomic import atomic_write, fsync_dir
from cursus.storage.errors import CorruptLogError
from cursus.storage.segment import (
    COMPACTED_SUFFIX,
    LOG_SUFFIX,
    OFFSET_DIGITS,
    compacted_file_name,
    index_file_name,
    log_file_name,
    parse_file_base_offset,
)

logger = logging.getLogger("cursus.storage")

CLEANED_SUFFIX = ".log.cleaned"
SWAP_SUFFIX = ".swap"
MARKER_VERSION = 1


def cleaned_file_name(base_offset: int) -> str:
    """``<base_offset:020d>.log.cleaned``."""
    return f"{base_offset:0{OFFSET_DIGITS}d}{CLEANED_SUFFIX}"


def swap_file_name(base_offset: int) -> str:
    """``<base_offset:020d>.swap``."""
    return f"{base_offset:0{OFFSET_DIGITS}d}{SWAP_SUFFIX}"


def _marker_bytes(next_offset: int, size_bytes: int | None = None) -> bytes:
    document: dict[str, int] = {"version": MARKER_VERSION, "next_offset": next_offset}
    if size_bytes is not None:
        document["size_bytes"] = size_bytes
    return json.dumps(document, sort_keys=True).encode() + b"\n"


def _read_marker(path: Path) -> dict[str, int]:
    try:
        document = json.loads(path.read_bytes())
        if document.get("version") != MARKER_VERSION or int(document["next_offset"]) < 0:
            raise ValueError(f"unsupported marker {document!r}")
        return {k: int(v) for k, v in document.items()}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CorruptLogError(path, None, None, f"invalid cleaner marker: {error}") from error


def read_compacted_next_offset(directory: Path, base_offset: int) -> int | None:
    """The ``next_offset`` recorded by ``<base>.compacted``, or ``None`` when the segment was never cleaned.

    Raises:
        CorruptLogError: the marker exists but cannot be parsed.
    """
    path = directory / compacted_file_name(base_offset)
    if not path.exists():
        return None
    return _read_marker(path)["next_offset"]


def write_compacted_marker(directory: Path, base_offset: int, next_offset: int) -> None:
    """Durably (re)write ``<base>.compacted`` (a truncation into a cleaned segment lowers its end).

    Raises:
        OSError: the write failed.
    """
    atomic_write(directory / compacted_file_name(base_offset), _marker_bytes(next_offset), mode=0o644)


def commit_swap(directory: Path, base_offset: int, next_offset: int, size_bytes: int,
                crash_hook: object = None) -> None:
    """Steps 1, 2 (commit point, rename) of the swap; :func:`finish_swap` does step 4 after the index.

    ``<base>.log.cleaned`` must hold ``size_bytes`` fsynced bytes. ``crash_hook(point)`` (tests) runs
    after each step.

    Raises:
        OSError: a step failed; the caller must fence the log (recovery completes or discards the swap).
    """
    atomic_write(directory / swap_file_name(base_offset), _marker_bytes(next_offset, size_bytes), mode=0o644)
    _hook(crash_hook, "after_swap_marker")
    os.replace(directory / cleaned_file_name(base_offset), directory / log_file_name(base_offset))
    _hook(crash_hook, "after_rename")


def finish_swap(directory: Path, base_offset: int) -> None:
    """Step 4: ``<base>.swap`` becomes ``<base>.compacted``; fsync the directory.

    Raises:
        OSError: the rename or the fsync failed.
    """
    os.replace(directory / swap_file_name(base_offset), directory / compacted_file_name(base_offset))
    fsync_dir(directory)


def _hook(crash_hook: object, point: str) -> None:
    if crash_hook is not None:
        crash_hook(point)  # type: ignore[operator]


def discard_cleaned(directory: Path, base_offset: int) -> None:
    """Remove an uncommitted ``<base>.log.cleaned`` (missing is fine)."""
    (directory / cleaned_file_name(base_offset)).unlink(missing_ok=True)


def finish_interrupted_swaps(directory: Path) -> int:
    """Recovery: complete every committed swap and delete uncommitted cleaned copies and orphan markers.

    Returns:
        how many files were completed or removed.

    Raises:
        CorruptLogError: a ``.swap`` marker is unreadable, or its cleaned copy has another size than the
            one recorded (the copy was fsynced before the marker, so that is corruption).
        OSError: an I/O error.
    """
    names = os.listdir(directory)
    logs = {b for b in (parse_file_base_offset(n, LOG_SUFFIX) for n in names) if b is not None}
    changed = 0
    for name in names:
        base = parse_file_base_offset(name, SWAP_SUFFIX)
        if base is None:
            continue
        marker = _read_marker(directory / name)
        cleaned = directory / cleaned_file_name(base)
        if cleaned.exists():
            if cleaned.stat().st_size != marker.get("size_bytes", -1):
                raise CorruptLogError(cleaned, None, base, "cleaned segment copy does not match its swap marker")
            os.replace(cleaned, directory / log_file_name(base))
            logs.add(base)
        (directory / index_file_name(base)).unlink(missing_ok=True)  # may describe the old file: rebuild
        logger.warning("%s: completing an interrupted cleaner swap of segment %d", directory, base)
        os.replace(directory / name, directory / compacted_file_name(base))
        changed += 1
    for name in os.listdir(directory):
        base = parse_file_base_offset(name, CLEANED_SUFFIX)
        if base is not None:
            logger.warning("%s: discarding an uncommitted cleaned copy of segment %d", directory, base)
            (directory / name).unlink()
            changed += 1
            continue
        base = parse_file_base_offset(name, COMPACTED_SUFFIX)
        if base is not None and base not in logs:
            (directory / name).unlink()
            changed += 1
    if changed:
        fsync_dir(directory)
    return changed

