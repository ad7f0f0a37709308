"""Durable storage: partition logs of checksummed chunks, group-committed by one writer thread.

Public names are re-exported here; see ``docs/storage.md`` for the on-disk format and recovery rules.
"""

from cursus.storage.atomic import atomic_write, fsync_dir
from cursus.storage.checkpoint import Checkpoint
from cursus.storage.errors import (
    CorruptLogError,
    LogDirLockedError,
    OffsetOutOfRange,
    StorageError,
    StorageFencedError,
    UnsupportedFormatError,
)
from cursus.storage.layout import LogDir, open_log_dir
from cursus.storage.log import LogConfig, PartitionLog, ReadResult, SegmentInfo
from cursus.storage.recovery import RecoveryStats
from cursus.storage.writer import Completion, GroupCommitWriter

__all__ = [
    "Checkpoint",
    "Completion",
    "CorruptLogError",
    "GroupCommitWriter",
    "LogConfig",
    "LogDir",
    "LogDirLockedError",
    "OffsetOutOfRange",
    "PartitionLog",
    "ReadResult",
    "RecoveryStats",
    "SegmentInfo",
    "StorageError",
    "StorageFencedError",
    "UnsupportedFormatError",
    "atomic_write",
    "fsync_dir",
    "open_log_dir",
]
