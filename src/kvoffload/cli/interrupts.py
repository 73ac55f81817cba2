"""Ctrl-C and SIGTERM, for every command: the first stops it, a third quits at once.

A service manager, ``timeout`` or ``kill`` stops a command with SIGTERM, whose
default action ends the process on the spot: no ``finally`` runs, so a sweep's
worker processes were left running (and then waiting forever) and a benchmark's
scratch directories stayed. Raised as :class:`KeyboardInterrupt` instead, it
unwinds as Ctrl-C does: workers stopped, finished runs kept, one line, status 130.

A second Ctrl-C (an impatient user presses it twice) used to land in that
unwinding: it cut the cleanup short (a scratch directory stayed) or escaped as a
traceback after the ``interrupted`` line. The second now only says that the command is
cleaning up; a third quits at once (status 130), the way out of a cleanup that hangs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType

STOPPING = b"kvoffload: stopping, cleaning up; interrupt once more to quit at once\n"
"""Written on the second interrupt, straight to the descriptor: a handler may run while
the main thread is inside a write to ``sys.stderr``, which must not be re-entered."""

INTERRUPTS_TO_QUIT = 3
"""The interrupt that ends the process at once, cleanup or not."""
INTERRUPTED = "kvoffload: interrupted"
"""The one line an interrupted command ends with, on stderr."""
INTERRUPTED_STATUS = 130
"""Its exit status, as a shell gives a command that Ctrl-C ended."""


@contextlib.contextmanager
def one_interrupt() -> Iterator[None]:
    """Within the block, the first SIGTERM or Ctrl-C raises :class:`KeyboardInterrupt` in
    the main thread, the second only says so on stderr and the third quits at once. The
    caller's handlers come back as the block ends, interrupted or not: ``main`` is also
    called in-process (tests, a program that embeds it), whose next Ctrl-C must raise
    again, not say that a finished command is cleaning up. Ctrl-C is left alone where it
    is not Python's own (ignored in a background job, or handled by a program that embeds the
    command); off the main thread, signal handlers are not ours to set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = 0

    def interrupt(signum: int, frame: FrameType | None) -> None:
        nonlocal received
        received += 1
        if received == 1:
            raise KeyboardInterrupt
        if received >= INTERRUPTS_TO_QUIT:
            os._exit(INTERRUPTED_STATUS)
        os.write(2, STOPPING)

    signals = [signal.SIGTERM]
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signals.append(signal.SIGINT)
    previous = {signum: signal.signal(signum, interrupt) for signum in signals}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
