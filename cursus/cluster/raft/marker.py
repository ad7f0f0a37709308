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


def ensure_format_marker(directory: Path) -> None:
    """Create ``directory`` and its marker when empty or absent; otherwise require marker version 9.

    Raises:
        UnsupportedRecoveryProtocol: non-empty without marker, or another version in the marker.
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
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, f"{FORMAT_VERSION}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(directory)
