"""Crash-safe small-file replacement: write a temp file, fsync it, rename it over the target, fsync the dir.

After :func:`atomic_write` returns, a crash or power cut leaves either the old or the new content, never a
mix, and the new content survives. A crash midway can leave ``<name>.tmp`` behind; log recovery removes
such leftovers in its first pass (see :mod:`cursus.storage.recovery`).

Thread-safety: concurrent writers of the *same* path must be serialized by the caller (they share the
temp name); different paths are independent.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Suffix of the temp file used by :func:`atomic_write`; recovery deletes files with this suffix.
TEMP_SUFFIX = ".tmp"


def fsync_dir(path: Path) -> None:
    """fsync the directory ``path`` so that file creations, renames and unlinks in it are durable.

    Raises:
        OSError: opening or syncing the directory failed.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Durably replace ``path`` with ``data`` (temp file in the same dir, write, fsync, rename, fsync dir).

    Args:
        path: the target file; its parent directory must exist.
        data: the complete new content.
        mode: permission bits of a newly created file (default 0600).

    Raises:
        OSError: any step failed; the target then still holds its old content (a temp file may remain).
    """
    path = Path(path)
    temp_path = path.with_name(path.name + TEMP_SUFFIX)
    fd = os.open(temp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temp_path, path)
    fsync_dir(path.parent)
