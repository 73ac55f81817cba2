"""A circuit breaker: stop calling a server that keeps failing, and try it again later.

While open, calls are refused at once (the tier then misses or drops a store)
instead of each waiting for a timeout; after ``cooldown_s`` one trial call is
let through, and its success closes the breaker again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvoffload.core.errors import InvalidArgumentError


class Pass:
    """One call :meth:`CircuitBreaker.allow` let through: the state of the breaker it began
    in, so an outcome that comes back after the breaker opened or closed is known as late."""

    __slots__ = ("era",)

    def __init__(self, era: int) -> None:
        self.era = era


class CircuitBreaker:
    """Opens after ``threshold`` consecutive failures; half-opens after ``cooldown_s``.

    Thread-safe: the scheduler thread and the tier's I/O threads share it.
    ``clock`` is injectable so tests need not sleep. Each call's outcome is told with
    the :class:`Pass` it was let through with: a call that began before the breaker last
    opened or closed and fails (or is excused) after neither restamps the opening nor
    reopens it, nor ends the trial under way.
    """

    def __init__(
        self,
        threshold: int = 3,
        cooldown_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if threshold < 1:
            raise InvalidArgumentError(f"breaker threshold must be >= 1, got {threshold}")
        if cooldown_s < 0:
            raise InvalidArgumentError(f"breaker cooldown must be >= 0, got {cooldown_s}")
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at: float | None = None
        self._era = 0
        """Moves on each time the breaker opens or closes."""
        self._trial: Pass | None = None
        self.times_opened = 0

    @property
    def is_open(self) -> bool:
        return self._opened_at is not None

    @property
    def refuses(self) -> bool:
        """Whether :meth:`allow` would refuse a call now, asked without taking the trial:
        a caller can skip work done only for a call that would be refused."""
        with self._lock:
            return self._opened_at is not None and self._resting(self._opened_at)

    @property
    def failing(self) -> bool:
        """Whether the last call told ended in a failure (or the breaker is open): an
        operation over several servers asks such a one last."""
        with self._lock:
            return self._failures > 0 or self._opened_at is not None

    def allow(self) -> Pass | None:
        """The call's pass if it may go to the server now (at most one trial while
        half-open), else ``None``."""
        with self._lock:
            if self._opened_at is None:
                return Pass(self._era)
            if self._resting(self._opened_at):
                return None
            self._trial = Pass(self._era)
            return self._trial

    def _resting(self, opened_at: float) -> bool:
        """Whether the open breaker lets no call through now: cooling down, or its one trial
        under way. The one rule :meth:`allow` and :attr:`refuses` apply (under the lock)."""
        return self._trial is not None or self._clock() - opened_at < self.cooldown_s

    def success(self, granted: Pass) -> None:
        """The server answered: closed again, whenever the call began."""
        with self._lock:
            self._failures = 0
            if self._opened_at is not None:
                self._opened_at = None
                self._era += 1
            self._trial = None

    def failure(self, granted: Pass) -> None:
        """A failure counts, or reopens after a failed trial, only from a call that began
        in the breaker's present state."""
        with self._lock:
            if granted is self._trial:
                self._trial = None
            elif granted.era != self._era or self._opened_at is not None:
                return
            else:
                self._failures += 1
                if self._failures < self.threshold:
                    return
                self.times_opened += 1
            self._opened_at = self._clock()
            self._era += 1

    def excuse(self, granted: Pass) -> None:
        """A call that failed for want of time it was never given: no failure counted; if
        it was the trial, the next call is let through as the trial."""
        with self._lock:
            if granted is self._trial:
                self._trial = None

    def fresh(self) -> CircuitBreaker:
        """A closed breaker with these settings (one per Cluster node)."""
        return CircuitBreaker(self.threshold, self.cooldown_s, self._clock)
