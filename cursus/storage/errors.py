"""Typed errors of the storage layer, plus :func:`invariant` for programmer errors.

Operating errors (a corrupt file, a failed fsync, a locked directory) are exceptions a caller handles;
programmer errors (an append at the wrong offset, a malformed records section) are assertion failures
raised by :func:`invariant`, which, unlike ``assert``, survives ``python -O`` because a broken invariant in
this layer would put wrong bytes on disk.
"""

from __future__ import annotations

from pathlib import Path


def invariant(condition: bool, message: str) -> None:
    """Raise ``AssertionError(message)`` unless ``condition`` holds. Survives ``python -O``."""
    if not condition:
        raise AssertionError(message)


class StorageError(Exception):
    """Base class of every storage-layer error."""


class CorruptLogError(StorageError):
    """Data that must not be dropped is invalid: a bad chunk below the recovery point, a bad chunk followed
    by a valid one, a CRC mismatch on read, or a damaged checkpoint file.

    Attributes:
        path: the damaged file.
        position: byte position inside ``path`` (``None`` when not meaningful, e.g. a JSON file).
        offset: the log offset expected at ``position`` (``None`` when unknown).
        reason: a short human-readable cause.
    """

    def __init__(self, path: Path, position: int | None, offset: int | None, reason: str) -> None:
        self.path = path
        self.position = position
        self.offset = offset
        self.reason = reason
        where = f"{path}"
        if position is not None:
            where += f" at byte position {position}"
        if offset is not None:
            where += f" (offset {offset})"
        super().__init__(f"corrupt log data in {where}: {reason}")


class StorageFencedError(StorageError):
    """The log is fenced: an earlier write or fsync failed, so every later append/flush fails.

    A failed fsync is never retried (Linux may drop the dirty pages after reporting the error, so a retry
    could falsely succeed). The only way out is to reopen the log, which re-validates the unflushed tail.

    Attributes:
        cause: the original exception (usually an ``OSError``).
    """

    def __init__(self, cause: BaseException) -> None:
        self.cause = cause
        super().__init__(f"log fenced after a storage error: {cause!r}")


class LogDirLockedError(StorageError):
    """Another process (another broker) holds the exclusive lock on the log directory."""


class UnsupportedFormatError(StorageError):
    """The log directory's ``.cursus-format`` file (or a checkpoint) names a version we cannot read."""


class OffsetOutOfRange(StorageError):
    """A read asked for an offset outside ``[earliest, latest]``.

    Attributes:
        earliest: the log start offset at the time of the read.
        latest: the log end offset at the time of the read.

    The message is deliberately neutral: the broker builds the client-facing error text.
    """

    def __init__(self, earliest: int, latest: int, requested: int | None = None) -> None:
        self.earliest = earliest
        self.latest = latest
        self.requested = requested
        super().__init__(f"offset {requested} out of range [{earliest}, {latest}]")
