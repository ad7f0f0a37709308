"""Test-only fault injection for segment files, enabled by the environment variable ``CURSUS_STORAGE_FAULTS``.

The variable is parsed once, at import. When it is unset, :data:`ACTIVE` is ``None`` and the only cost on
the write path is one attribute check. Format: comma-separated ``key=value`` pairs, e.g.
``CURSUS_STORAGE_FAULTS=lose_unsynced=1,fsync_delay_ms=5``. Keys:

``fsync_fail_file=<path>``
    While ``<path>`` exists, every fsync of a segment raises ``OSError(EIO, "injected fsync failure")``.
    The buffered bytes of that segment are dropped first (``lose_unsynced``), as Linux may drop dirty
    pages after a failed writeback.
``fsync_fail_match=<substring>``
    Restricts ``fsync_fail_file`` to segments whose path contains ``<substring>`` (to fail one log only).
``lose_unsynced=1``
    Power-cut emulation: bytes appended to a segment stay in an in-memory buffer and are written to the
    file only immediately before its fsync, so a ``kill -9`` between write and fsync loses them, as a power
    cut loses the page cache.
``fsync_delay_ms=<n>``
    Sleep ``n`` ms before every segment fsync (widens crash windows for chaos tests).
``cleaner_crash_at=<point>``
    The log cleaner kills its own process (``SIGKILL``, like ``kill -9``) at ``<point>`` of its first
    segment swap: ``after_cleaned_written`` (copy fsynced, no commit yet), ``after_swap_marker`` (commit
    point written), ``after_rename`` (new file in place, old index), ``after_index`` (index rewritten,
    marker not final). See :mod:`cursus.storage.swap`.

Tests running in-process may replace :data:`ACTIVE` with :func:`parse` output (``monkeypatch.setattr``);
production code never does.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

ENVIRONMENT_VARIABLE = "CURSUS_STORAGE_FAULTS"


@dataclass(frozen=True, slots=True)
class Faults:
    """Parsed fault settings; see the module docstring for their meaning."""

    fsync_fail_file: Path | None = None
    fsync_fail_match: str | None = None
    lose_unsynced: bool = False
    fsync_delay_ms: int = 0
    cleaner_crash_at: str | None = None

    def cleaner_point(self, point: str) -> None:
        """Kill this process with ``SIGKILL`` when ``point`` is the armed cleaner crash point."""
        if self.cleaner_crash_at == point:
            os.kill(os.getpid(), signal.SIGKILL)

    def before_segment_fsync(self, segment_path: Path) -> None:
        """Apply the delay, then raise the injected fsync failure if it is armed for ``segment_path``.

        Raises:
            OSError: ``EIO`` when ``fsync_fail_file`` exists (and ``fsync_fail_match`` matches).
        """
        if self.fsync_delay_ms > 0:
            time.sleep(self.fsync_delay_ms / 1000.0)
        if self.fsync_fail_file is None or not self.fsync_fail_file.exists():
            return
        if self.fsync_fail_match is not None and self.fsync_fail_match not in str(segment_path):
            return
        raise OSError(errno.EIO, "injected fsync failure")


def parse(text: str | None) -> Faults | None:
    """Parse a ``CURSUS_STORAGE_FAULTS`` value; ``None`` or blank means no faults.

    Raises:
        ValueError: an unknown key or a malformed value (a typo must not silently disable a fault).
    """
    if text is None or not text.strip():
        return None
    values: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{ENVIRONMENT_VARIABLE}: expected key=value, got {item!r}")
        values[key.strip()] = value.strip()
    known = {"fsync_fail_file", "fsync_fail_match", "lose_unsynced", "fsync_delay_ms", "cleaner_crash_at"}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"{ENVIRONMENT_VARIABLE}: unknown keys {sorted(unknown)}")
    fail_file = values.get("fsync_fail_file")
    return Faults(
        fsync_fail_file=Path(fail_file) if fail_file else None,
        fsync_fail_match=values.get("fsync_fail_match") or None,
        lose_unsynced=values.get("lose_unsynced", "0") not in ("", "0", "false", "no"),
        fsync_delay_ms=int(values.get("fsync_delay_ms", "0")),
        cleaner_crash_at=values.get("cleaner_crash_at") or None,
    )


#: The faults in force for this process, or ``None`` (the normal case).
ACTIVE: Faults | None = parse(os.environ.get(ENVIRONMENT_VARIABLE))
