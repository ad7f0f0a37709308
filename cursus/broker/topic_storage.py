"""Node-local topic storage across the topic lifecycle: the lifecycle-epoch marker and the storage reset.

A topic folder ``topics/<name>/`` holds one folder per partition and the marker file ``lifecycle_epoch``:
``<lifecycle epoch>[ <incarnation>]`` in decimal text, the *generation* of the topic whose storage the
folder holds. The incarnation (a cluster's :attr:`~cursus.metadata.state.MetadataState.incarnations`, 0
standalone) tells a topic deleted and created again apart; the lifecycle epoch grows with every TRUNCATE.
A folder without a marker holds generation ``(0, 0)``; a marker is written only for another generation.
Generations compare as ``(incarnation, lifecycle epoch)``.

Spec "TRUNCATE": the new epoch is committed in the metadata first; a node whose folder is of an older
generation must not serve it. :func:`reset_topic_storage` replaces the folder (old folder renamed into the
trash, both parents fsynced; a fresh folder; the marker written with
:func:`~cursus.storage.atomic.atomic_write`, last). Every step is idempotent, so a crash anywhere is finished
by running it again (startup does, :class:`cursus.broker.reconciler.Reconciler`).

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


#: A topic generation: (incarnation, lifecycle epoch); tuples compare in that order.
Generation = tuple[int, int]


def read_marker(topic_dir: Path) -> Generation:
    """The generation the topic folder holds (``(0, 0)`` without a folder or marker). Raises OSError,
    ValueError (a malformed marker: the folder must not be served)."""
    try:
        text = (topic_dir / MARKER_NAME).read_text("ascii").strip()
    except FileNotFoundError:
        return (0, 0)
    parts = text.split(" ")
    if not 1 <= len(parts) <= 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"bad lifecycle epoch marker in {topic_dir}: {text[:40]!r}")
    return (int(parts[1]) if len(parts) == 2 else 0, int(parts[0]))


def write_marker(topic_dir: Path, generation: Generation) -> None:
    """Durably record ``generation`` in ``topic_dir`` (which exists). Raises OSError."""
    incarnation, epoch = generation
    text = f"{epoch} {incarnation}\n" if incarnation else f"{epoch}\n"
    atomic_write(topic_dir / MARKER_NAME, text.encode("ascii"), mode=0o644)


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


def reset_topic_storage(topics_dir: Path, trash_dir: Path, name: str, generation: Generation) -> None:
    """Blocking: make ``topics_dir/name`` an empty folder of ``generation`` (see the module docstring). The
    caller closed every log of the topic. Raises OSError (nothing is served from the folder until a retry
    succeeds)."""
    move_to_trash(topics_dir, trash_dir, name)
    crash_point("truncate_after_trash")
    create_topic_dir(topics_dir, name, generation)


def create_topic_dir(topics_dir: Path, name: str, generation: Generation) -> None:
    """Blocking: create ``topics_dir/name`` (parent fsynced) with its marker unless ``generation`` is
    ``(0, 0)``. Raises OSError."""
    topic_dir = topics_dir / name
    topic_dir.mkdir(exist_ok=True)
    fsync_dir(topics_dir)
    if generation != (0, 0):
        write_marker(topic_dir, generation)
