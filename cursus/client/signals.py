"""SIGTERM as a clean exit: the shutdown path of the SDK's ``with`` blocks and of ``cursusctl``.

Python's default SIGTERM action ends the process at once, without running ``finally`` blocks or ``__exit__``,
so a group member killed by ``kill`` or a container stop would not leave its group (the group keeps it for
the session timeout and topic deletion is refused meanwhile). :func:`sigterm_exits` turns SIGTERM into
``SystemExit(143)`` (128 + 15, the shell's convention) raised in the main thread, so the code unwinds as it
does for Ctrl-C.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["SIGTERM_EXIT_CODE", "sigterm_exits"]

#: The exit status after SIGTERM (128 + 15).
SIGTERM_EXIT_CODE = 128 + signal.SIGTERM


def _exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(SIGTERM_EXIT_CODE)


@contextmanager
def sigterm_exits() -> Iterator[None]:
    """While the block runs, SIGTERM raises ``SystemExit(143)`` in the main thread.

    Does nothing outside the main thread (signal handlers can only be set there) or when the application
    already installed its own SIGTERM handler (that one stays in charge). The previous handler is restored
    when the block ends.
    """
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
