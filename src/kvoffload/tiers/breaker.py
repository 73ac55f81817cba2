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


class CircuitBreaker:
    """Opens after ``threshold`` consecutive failures; half-opens after ``cooldown_s``.

    Thread-safe: the scheduler thread and the tier's I/O threads share it.
    ``clock`` is injectable so tests need not sleep.
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
        self._trial_running = False
        self.times_opened = 0

    @property
    def is_open(self) -> bool:
        return self._opened_at is not None

    def allow(self) -> bool:
        """Whether a call may go to the server now (at most one trial while half-open)."""
        with self._lock:
            if self._opened_at is None:
                return True
            if self._trial_running or self._clock() - self._opened_at < self.cooldown_s:
                return False
            self._trial_running = True
            return True

    def success(self) -> None:
        with self._lock:
            self._failures = 0
            self._opened_at = None
            self._trial_running = False

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._trial_running or self._failures >= self.threshold:
                if self._opened_at is None:
                    self.times_opened += 1
                self._opened_at = self._clock()
            self._trial_running = False

    def excuse(self) -> None:
        """A call that failed for want of time it was never given: no failure counted; if
        it was the trial, the next call is let through as the trial."""
        with self._lock:
            self._trial_running = False

    def fresh(self) -> CircuitBreaker:
        """A closed breaker with these settings (one per Cluster node)."""
        return CircuitBreaker(self.threshold, self.cooldown_s, self._clock)
