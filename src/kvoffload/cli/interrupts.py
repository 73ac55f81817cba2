"""SIGTERM handled as Ctrl-C, for every command.

A service manager, ``timeout`` or ``kill`` stops a command with SIGTERM, whose
default action ends the process on the spot: no ``finally`` runs, so a sweep's
worker processes were left running (and then waiting forever) and a benchmark's
scratch directories stayed. Raised as :class:`KeyboardInterrupt` instead, it
unwinds as Ctrl-C does: workers stopped, finished runs kept, one line, status 130.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`KeyboardInterrupt` in the main thread
    (signal handlers belong to it alone: elsewhere this does nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
