"""Progress on stderr with rate and time left, fit for a terminal of any width and for log files.

In a terminal it is one line redrawn at most ten times a second, drawn with
``rich`` when the ``cli`` extra is installed and by hand otherwise; in a log
file (stderr not a terminal) it is a plain line every tenth of the way, never
a carriage return. It never writes to stdout, so JSON sent there stays clean.
"""

from __future__ import annotations

import io
import shutil
import sys
import time
from typing import Any, TextIO

BAR_WIDTH = 30
LOG_STEPS = 10
"""Lines written to a log file over a whole run."""


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def _rate(rate: float) -> str:
    """Steps per second, whole from 10 on, else two significant digits: a sweep of long
    runs read "0/s", as if stalled, all the way through."""
    return f"{rate:,.0f}/s" if rate >= 10 else f"{rate:.2g}/s"


RATE_AFTER_SECONDS = 1.0
"""Time a piece of work runs before its rate and time left are shown: its first step,
start-up costs included, put ``1/20,000 9.4/s ETA 35:31`` on a 12-second replay's first
line (in a log file, for good)."""


def status_line(label: str, done: int, total: int, elapsed: float, width: int) -> str:
    """``label [####----] done/total  rate/s  ETA m:ss``, dropping the bar, then the counts,
    until it fits in ``width`` columns; ``-/s ETA -`` for the first
    :data:`RATE_AFTER_SECONDS`."""
    rate = done / elapsed if elapsed > 0 else 0.0
    early = elapsed < RATE_AFTER_SECONDS and done < total
    if done >= total:
        timing = f"{_clock(elapsed)} elapsed"
    else:
        timing = f"ETA {_clock((total - done) / rate)}" if rate > 0 and not early else "ETA -"
    counts = f"{done:,}/{total:,}"
    speed = "-/s" if early else _rate(rate)
    filled = BAR_WIDTH * done // total if total else BAR_WIDTH
    bar = "[" + "#" * filled + "-" * (BAR_WIDTH - filled) + "]"
    percent = f"{100 * done // total if total else 100}%"
    for parts in (
        (label, bar, counts, speed, timing),
        (label, percent, counts, speed, timing),
        (label, percent, speed, timing),
        (label, percent, timing),
        (percent,),
    ):
        line = " ".join(parts)
        if len(line) <= width:
            return line
    return percent[:width]


class ProgressBar:
    """Callable as ``bar(done, total)``; does nothing when disabled."""

    def __init__(self, label: str, enabled: bool, stream: TextIO | None = None) -> None:
        self.label = label
        chosen: TextIO | None = sys.stderr if stream is None else stream
        # Started with stderr closed (``2>&-``) there is nowhere to draw: no bar, no failure.
        self.enabled = enabled and chosen is not None
        self.stream: TextIO = io.StringIO() if chosen is None else chosen
        self._started = time.monotonic()
        self._last_draw = 0.0
        self._drawn = False
        self._logged_step = -1
        self._terminal = enabled and _isatty(self.stream)
        self._rich = _RichBar(label, self.stream) if self._terminal else None

    @staticmethod
    def wanted(requested: bool | None) -> bool:
        """Shown when asked for, or by default when stderr is a terminal."""
        if requested is None:
            return sys.stderr is not None and sys.stderr.isatty()
        return requested

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self._rich is not None and self._rich.active:
            self._rich.update(done, total)
            return
        if not self._terminal:
            self._log(done, total, now)
            return
        if done < total and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        width = shutil.get_terminal_size((80, 24)).columns - 1
        line = status_line(self.label, done, total, now - self._started, width)
        self.stream.write("\r" + line.ljust(width))
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        """End the bar's line so later output starts on a fresh one."""
        if self._rich is not None:
            self._rich.close()
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False

    def _log(self, done: int, total: int, now: float) -> None:
        step = LOG_STEPS * done // total if total else LOG_STEPS
        if step == self._logged_step:
            return
        self._logged_step = step
        line = status_line(self.label, done, total, now - self._started, 10_000)
        self.stream.write(line + "\n")
        self.stream.flush()


class FollowingBar:
    """The bar of work that follows ``before``'s (a simulation's Belady bound after its
    replay): made at its first report, when ``before`` is closed, so its rate and time left
    count from there and the two never draw over each other. Work that never reports
    (no bound to compute) leaves no bar."""

    def __init__(self, label: str, enabled: bool, before: ProgressBar) -> None:
        self._label = label
        self._enabled = enabled
        self._before = before
        self._bar: ProgressBar | None = None

    def __call__(self, done: int, total: int) -> None:
        if self._bar is None:
            self._before.close()
            self._bar = ProgressBar(self._label, self._enabled, self._before.stream)
        self._bar(done, total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _isatty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class _RichBar:
    """rich's bar with rate and time left, when the ``cli`` extra is installed; drawn from
    its first update, so a bar never told anything (a trace read from a pipe, of unknown
    size) leaves no empty bar behind."""

    def __init__(self, label: str, stream: TextIO) -> None:
        self.active = False
        self._drawing = False
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TaskProgressColumn,
                TextColumn,
                TimeRemainingColumn,
            )
        except ModuleNotFoundError:
            return
        self._progress: Any = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=None),
            TaskProgressColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(),
            console=Console(file=stream),
            transient=False,
        )
        self._task = self._progress.add_task(label, total=None, rate="")
        self._started = time.monotonic()
        self.active = True

    def update(self, done: int, total: int) -> None:
        if not self._drawing:
            self._progress.start()
            self._drawing = True
        elapsed = time.monotonic() - self._started
        rate = _rate(done / elapsed) if elapsed >= RATE_AFTER_SECONDS or done >= total else ""
        self._progress.update(self._task, completed=done, total=total, rate=rate)

    def close(self) -> None:
        if self._drawing:
            self._progress.stop()
            self._drawing = False
        self.active = False
