"""Open-file budget: every segment keeps its log and index files open (as Kafka's do), so partitions cost
file descriptors. The broker raises its soft ``RLIMIT_NOFILE`` to the hard limit at startup and refuses a
CREATE whose new partitions would not fit, *before* anything is committed, instead of committing a topic it
cannot open (and then failing every restart with ``EMFILE``).
"""

from __future__ import annotations

import logging
import os
import resource

from cursus.wire.errors import BrokerError

log = logging.getLogger("cursus.broker")

#: Descriptors a newly created partition needs: its first segment's log and index files, plus room for the
#: checkpoint and snapshot files it writes and replaces.
FDS_PER_NEW_PARTITION = 4
#: Never raise the soft limit past this (a huge hard limit would only make the number meaningless).
SOFT_LIMIT_CAP = 1 << 20


def raise_open_file_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (capped); return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = SOFT_LIMIT_CAP if hard == resource.RLIM_INFINITY else min(hard, SOFT_LIMIT_CAP)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # not permitted here: keep the old limit, say so
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft


def open_fd_count() -> int:
    """Descriptors this process has open (``/proc/self/fd``; 0 where that is unavailable)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def check_partition_headroom(new_partitions: int, *, reserve: int) -> None:
    """Refuse to add ``new_partitions`` when their files would not fit under the open-file limit, keeping
    ``reserve`` descriptors free (client connections, sockets, temp files).

    Raises:
        BrokerError: ``resource_exhausted`` (retryable once partitions are deleted or the limit raised).
    """
    if new_partitions <= 0:
        return
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    needed = new_partitions * FDS_PER_NEW_PARTITION
    available = soft - open_fd_count() - reserve
    if needed > available:
        raise BrokerError.of("resource_exhausted", resource="open_files", needed=needed,
                             available=max(available, 0), limit=soft,
                             reason="not enough file descriptors for the new partitions; raise the broker's "
                                    "open-file limit (ulimit -n) or delete topics")
