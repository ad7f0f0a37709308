"""The Raft directory's format marker ``.cursus-raft-format`` (content ``9``).

Created exclusively (O_EXCL, fsynced) only in an empty directory, and checked before Raft starts: a
non-empty directory without the marker, or a marker with another version, refuses startup with
:class:`~cursus.cluster.raft.errors.UnsupportedRecoveryProtocol`.
"""

from __future__ import annotations

import os
from pathlib import Path

from cursus.cluster.raft.errors import UnsupportedRecoveryProtocol
from cursus.storage.atomic import fsync_dir

MARKER_NAME = ".cursus-raft-format"
FORMAT_VERSION = 9


def ensure_format_marker(directory: Path, *, allow_new: bool = True) -> None:
    """Create ``directory`` and its marker when empty or absent (and ``allow_new``); otherwise require
    marker version 9.

    Raises:
        UnsupportedRecoveryProtocol: non-empty without marker, another version in the marker, or no Raft
            state where ``allow_new`` is False (the node would rejoin with its term and vote forgotten, and
            could vote twice in one term).
        OSError: the directory or marker cannot be created, read or synced.
    """
    directory.mkdir(parents=True, exist_ok=True)
    marker = directory / MARKER_NAME
    try:
        content = marker.read_bytes()
    except FileNotFoundError:
        content = None
    if content is not None:
        found = content.decode("ascii", "replace").strip()
        if found != str(FORMAT_VERSION):
            raise UnsupportedRecoveryProtocol(
                f"{marker} says format {found!r}, this version reads only {FORMAT_VERSION}")
        return
    leftovers = sorted(entry.name for entry in directory.iterdir())
    if leftovers:
        raise UnsupportedRecoveryProtocol(
            f"{directory} holds {', '.join(leftovers[:5])} but no {MARKER_NAME}")
    if not allow_new:
        raise UnsupportedRecoveryProtocol(
            f"{directory} has no Raft state but this broker already holds data: a member that lost its Raft "
            "state could vote twice in one term")
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, f"{FORMAT_VERSION}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(directory)
