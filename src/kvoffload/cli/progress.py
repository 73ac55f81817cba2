"""A one-line progress bar on stderr, redrawn at most ten times a second.

Written here rather than pulled in from a library to keep the package's
dependencies to numpy. It never writes to stdout, so JSON sent there stays clean.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 30


class ProgressBar:
    """Callable as ``bar(done, total)``; does nothing when disabled."""

    def __init__(self, label: str, enabled: bool, stream: TextIO | None = None) -> None:
        self.label = label
        self.enabled = enabled
        self.stream = sys.stderr if stream is None else stream
        self._started = time.monotonic()
        self._last_draw = 0.0
        self._drawn = False

    @staticmethod
    def wanted(requested: bool | None) -> bool:
        """Shown when asked for, or by default when stderr is a terminal."""
        return sys.stderr.isatty() if requested is None else requested

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        filled = WIDTH * done // total if total else WIDTH
        bar = "#" * filled + "-" * (WIDTH - filled)
        elapsed = now - self._started
        self.stream.write(f"\r{self.label} [{bar}] {done}/{total} {elapsed:.1f}s")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        """End the bar's line so later output starts on a fresh one."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
