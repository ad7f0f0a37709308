"""The log directory: exclusive lock, format version, clean-shutdown marker, partition paths.

Layout::

    <log_dir>/.lock                      flock'ed exclusively by the one broker process using the dir
    <log_dir>/.cursus-format             "2\\n": version of this storage format
    <log_dir>/.clean-shutdown            present only between a clean shutdown and the next start
    <log_dir>/topics/<topic>/<partition>/  one partition log (see cursus.storage.log)

Broker-level files the spec names (``__topic_metadata.json`` and friends) live directly in ``<log_dir>``;
topic data lives under ``topics/`` so no topic name can collide with them.

Thread-safety: open and close from one thread; the path helpers are pure.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from cursus.storage.atomic import atomic_write, fsync_dir
from cursus.storage.errors import LogDirLockedError, UnsupportedFormatError

#: Version 2: chunk headers carry the leader epoch (36 bytes, magic "CCK2"), producer-state snapshots.
FORMAT_VERSION = 2
LOCK_FILE_NAME = ".lock"
FORMAT_FILE_NAME = ".cursus-format"
CLEAN_SHUTDOWN_FILE_NAME = ".clean-shutdown"
TOPICS_DIR_NAME = "topics"


class LogDir:
    """An opened, locked log directory. Create with :func:`open_log_dir`; call :meth:`close` at the end.

    Attributes:
        path: the log directory.
        topics_dir: ``<path>/topics``.
        clean_shutdown: True when the previous process shut down cleanly (the marker was present; it has
            been removed durably, so a crash from now on is seen as unclean).
    """

    def __init__(self, path: Path, lock_fd: int, clean_shutdown: bool) -> None:
        self.path = path
        self.topics_dir = path / TOPICS_DIR_NAME
        self.clean_shutdown = clean_shutdown
        self._lock_fd = lock_fd

    def partition_dir(self, topic: str, partition: int) -> Path:
        """``topics/<topic>/<partition>/`` (not created). The topic name was validated by the broker."""
        assert topic and topic not in (".", "..") and "/" not in topic and "\0" not in topic, topic
        assert partition >= 0, partition
        return self.topics_dir / topic / str(partition)

    def list_partitions(self) -> list[tuple[str, int]]:
        """Every ``(topic, partition)`` that has a directory under ``topics/``, sorted."""
        found: list[tuple[str, int]] = []
        if not self.topics_dir.is_dir():
            return found
        for topic_dir in self.topics_dir.iterdir():
            if not topic_dir.is_dir():
                continue
            for partition_dir in topic_dir.iterdir():
                if partition_dir.is_dir() and partition_dir.name.isdigit():
                    found.append((topic_dir.name, int(partition_dir.name)))
        return sorted(found)

    def mark_clean_shutdown(self) -> None:
        """Durably write the clean-shutdown marker. Call last, after every log was closed cleanly.

        Raises:
            OSError: the marker could not be written (the next start then validates logs fully).
        """
        assert self._lock_fd >= 0, "log dir already closed"
        atomic_write(self.path / CLEAN_SHUTDOWN_FILE_NAME, b"clean\n", mode=0o644)

    def close(self) -> None:
        """Release the directory lock (idempotent)."""
        if self._lock_fd >= 0:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> LogDir:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _lock(path: Path) -> int:
    lock_path = path / LOCK_FILE_NAME
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(fd)
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            holder = ""
            try:
                pid = lock_path.read_text().strip()
                holder = f" (pid {pid})" if pid.isdigit() else ""
            except OSError:
                pass
            raise LogDirLockedError(
                f"log dir {path} is locked: another broker process{holder} holds {lock_path}; "
                f"each log dir can be used by one broker at a time"
            ) from error
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _check_format(path: Path) -> None:
    format_path = path / FORMAT_FILE_NAME
    if not format_path.exists() and not format_path.is_symlink():
        atomic_write(format_path, f"{FORMAT_VERSION}\n".encode(), mode=0o644)
        return
    try:
        text = format_path.read_bytes().decode("ascii")
    except (OSError, UnicodeDecodeError) as error:
        raise UnsupportedFormatError(f"log dir {path}: cannot read {format_path}: {error}") from error
    version = text.strip()
    if version != str(FORMAT_VERSION) or not text.endswith("\n"):
        older = version.isdigit() and int(version) < FORMAT_VERSION
        advice = (f"there is no migration from format {version}: move {path} aside (or delete it) and start "
                  f"with an empty log dir" if older else "use the broker version that wrote it")
        raise UnsupportedFormatError(
            f"log dir {path}: storage format {version[:40]!r} in {format_path} is not supported "
            f"(this broker reads format {FORMAT_VERSION} only); {advice}"
        )


def open_log_dir(path: Path) -> LogDir:
    """Create (if needed), lock and check the log directory; consume the clean-shutdown marker.

    Steps: mkdir -p; exclusive non-blocking ``flock`` on ``.lock``; check or create ``.cursus-format``;
    read and durably remove ``.clean-shutdown``.

    Raises:
        LogDirLockedError: another process holds the lock.
        UnsupportedFormatError: ``.cursus-format`` holds another version or cannot be read.
        OSError: the directory cannot be created or written.
    """
    path = Path(path)
    if not path.is_dir():
        path.mkdir(parents=True)
        fsync_dir(path.parent)
    lock_fd = _lock(path)
    try:
        _check_format(path)
        marker = path / CLEAN_SHUTDOWN_FILE_NAME
        clean_shutdown = marker.exists()
        if clean_shutdown:
            marker.unlink()
            fsync_dir(path)
        if not path.joinpath(TOPICS_DIR_NAME).is_dir():
            path.joinpath(TOPICS_DIR_NAME).mkdir()
            fsync_dir(path)
    except BaseException:
        fcntl.flock(lock_fd, fcntl.LOCK_UN)
        os.close(lock_fd)
        raise
    return LogDir(path, lock_fd, clean_shutdown)
