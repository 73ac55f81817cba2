"""Ctrl-C and SIGTERM, for every command: the first stops the command, a later one is ignored.

A service manager, ``timeout`` or ``kill`` stops a command with SIGTERM, whose
default action ends the process on the spot: no ``finally`` runs, so a sweep's
worker processes were left running (and then waiting forever) and a benchmark's
scratch directories stayed. Raised as :class:`KeyboardInterrupt` instead, it
unwinds as Ctrl-C does: workers stopped, finished runs kept, one line, status 130.

A second Ctrl-C (an impatient user presses it twice) used to land in that
unwinding: it cut the cleanup short (a scratch directory stayed) or escaped as a
traceback after the ``interrupted`` line. After the first, later ones are ignored.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType


@contextlib.contextmanager
def one_interrupt() -> Iterator[None]:
    """Within the block, the first SIGTERM or Ctrl-C raises :class:`KeyboardInterrupt` in
    the main thread and later ones are ignored, up to the process's exit once one came.
    Ctrl-C is left alone where it is not Python's own (ignored in a background job, or
    handled by a program that embeds the command); off the main thread, signal handlers
    are not ours to set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = False

    def interrupt(signum: int, frame: FrameType | None) -> None:
        nonlocal received
        if not received:
            received = True
            raise KeyboardInterrupt

    signals = [signal.SIGTERM]
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signals.append(signal.SIGINT)
    previous = {signum: signal.signal(signum, interrupt) for signum in signals}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            # After an interrupt the process is ending: its exit is not cut short either.
            signal.signal(signum, signal.SIG_IGN if received else handler)
