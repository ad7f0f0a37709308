"""Node-local topic storage across the topic lifecycle: the lifecycle-epoch marker and the storage reset.

A topic folder ``topics/<name>/`` holds one folder per partition and, once the topic was truncated, the
marker file ``lifecycle_epoch`` (decimal text): the lifecycle epoch whose storage the folder holds (absent =
0, a topic never truncated). Spec "TRUNCATE": the new epoch is committed in the metadata first; a node
whose marker is behind the committed epoch must not serve the folder. :func:`reset_topic_storage` replaces
the folder (old folder renamed into the trash, both parents fsynced; a fresh folder; the marker written
with :func:`~cursus.storage.atomic.atomic_write`). Every step is idempotent, so a crash anywhere is
finished by running it again (startup does, :class:`cursus.broker.reconciler.Reconciler`).

Test-only crash points (``CURSUS_LIFECYCLE_CRASH_AT=<point>``, the process exits at once like kill -9):
:data:`CRASH_POINTS`.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

from cursus.storage import atomic_write, fsync_dir

log = logging.getLogger("cursus.reconciler")

MARKER_NAME = "lifecycle_epoch"
#: ``truncate_after_commit``: the new epoch is committed, storage untouched; ``truncate_after_trash``: the
#: old folder is in the trash, the marker not yet written; ``delete_after_commit``: the DELETE is
#: committed, groups, transactions and storage untouched.
CRASH_POINTS = ("truncate_after_commit", "truncate_after_trash", "delete_after_commit")
_CRASH_AT = os.environ.get("CURSUS_LIFECYCLE_CRASH_AT", "")


def crash_point(name: str) -> None:
    """Exit the process at once (status 137, like kill -9) when ``CURSUS_LIFECYCLE_CRASH_AT`` is ``name``."""
    assert name in CRASH_POINTS, name
    if _CRASH_AT == name:
        log.error("CURSUS_LIFECYCLE_CRASH_AT=%s: exiting now", name)
        os._exit(137)


def read_marker(topic_dir: Path) -> int:
    """The lifecycle epoch the topic folder holds (0 without a folder or marker). Raises OSError, ValueError
    (a marker that is not a non-negative decimal: the folder must not be served)."""
    try:
        text = (topic_dir / MARKER_NAME).read_text("ascii").strip()
    except FileNotFoundError:
        return 0
    if not text.isdigit():
        raise ValueError(f"bad lifecycle epoch marker in {topic_dir}: {text[:20]!r}")
    return int(text)


def move_to_trash(topics_dir: Path, trash_dir: Path, name: str) -> None:
    """Atomically rename ``topics_dir/name`` into ``trash_dir`` (both parents fsynced). Raises OSError."""
    source = topics_dir / name
    if not source.exists():
        return
    if not trash_dir.is_dir():
        trash_dir.mkdir()
        fsync_dir(trash_dir.parent)
    os.rename(source, trash_dir / uuid.uuid4().hex)
    fsync_dir(topics_dir)
    fsync_dir(trash_dir)


def empty_trash(trash_dir: Path) -> None:
    """Delete everything in the trash; failures are logged (the next startup tries again)."""
    if not trash_dir.is_dir():
        return
    for entry in trash_dir.iterdir():
        try:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        except OSError as exc:
            log.warning("cannot empty trash entry %s: %s", entry, exc)


def reset_topic_storage(topics_dir: Path, trash_dir: Path, name: str, epoch: int) -> None:
    """Blocking: make ``topics_dir/name`` an empty folder of lifecycle epoch ``epoch`` (see the module
    docstring). The caller closed every log of the topic. Raises OSError (nothing is served from the folder
    until a retry succeeds)."""
    move_to_trash(topics_dir, trash_dir, name)
    crash_point("truncate_after_trash")
    topic_dir = topics_dir / name
    topic_dir.mkdir(exist_ok=True)
    fsync_dir(topics_dir)
    atomic_write(topic_dir / MARKER_NAME, f"{epoch}\n".encode("ascii"), mode=0o644)
