"""I/O jobs that end by a deadline, on single-threaded stripes, behind a circuit breaker.

A file system that stops answering (an NFS server gone, a dying disk) leaves
a thread inside ``pread`` for as long as it likes. The caller must not wait
with it: every job's future is resolved by the job or by its deadline,
whichever comes first. Past the deadline the job is *abandoned*: its future
holds the failure value, the breaker counts a failure (and, after a few,
refuses new jobs at once until a trial job gets through), and whatever the
stuck thread does later is ignored. Jobs check :attr:`Job.abandoned` before
each step that has an effect outside the file (delivering bytes into a
caller's buffer), under :attr:`Job.lock`, so nothing lands after the caller
was told it failed. A job whose result holds something open (the start-up's
files) settles itself with :meth:`Job.claim` before handing it over, and
releases it if the deadline came first. Stripe threads are daemons: Python
does not wait for a stuck one at exit, though a call the kernel waits on
uninterruptibly (a frozen file system) delays the process's end until it returns.

Errors that come back (``EIO``, ``ENOSPC``) are the job's own result, not a
breaker failure: they cost no time, and a full disk still serves reads.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, Protocol, TypeVar

from kvoffload.tiers.breaker import CircuitBreaker, Pass

T = TypeVar("T")


class Job(Generic[T]):
    """One job on a stripe: its future, its deadline, and whether it was given up on."""

    __slots__ = (
        "_breaker",
        "_pass",
        "_settled",
        "abandoned",
        "deadline",
        "failed",
        "future",
        "lock",
        "on_expire",
    )

    def __init__(
        self,
        deadline: float,
        failed: T,
        breaker: CircuitBreaker,
        granted: Pass,
        on_expire: Callable[[], None],
    ) -> None:
        self.future: Future[T] = Future()
        self.deadline = deadline
        self.failed = failed
        self.abandoned = False
        self._settled = False
        self.lock = threading.Lock()
        self.on_expire = on_expire
        self._breaker = breaker
        self._pass = granted

    def finish(self, result: T) -> None:
        if not self.claim():
            return
        self._breaker.success(self._pass)  # before the caller hears: it finds the breaker closed
        self.future.set_result(result)  # outside the lock: callbacks run here

    def claim(self) -> bool:
        """Settle the job unless its deadline gave it up first: whether its result will
        reach the caller. Past this, the deadline no longer fails it, so a job whose
        result holds something open keeps it only when this says the caller gets it."""
        with self.lock:
            if self.abandoned:
                return False
            self._settled = True
            return True

    def expire(self) -> None:
        """The deadline passed: fail the job now, whatever its thread is doing."""
        with self.lock:
            if self._settled or self.abandoned:
                return
            self.abandoned = True
        self._breaker.failure(self._pass)  # counted before the caller hears of it
        self.on_expire()
        self.future.set_result(self.failed)


class Expiring(Protocol):
    """What a :class:`Watchdog` watches: a future it expires unless done by its deadline."""

    @property
    def deadline(self) -> float:
        """When to expire it (``time.monotonic``)."""
        ...

    @property
    def future(self) -> Future[Any]: ...

    def expire(self) -> None: ...


class Watchdog:
    """One daemon thread that expires the jobs whose deadline passed."""

    def __init__(self, name: str) -> None:
        self._heap: list[tuple[float, int, Expiring]] = []
        self._order = itertools.count()
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, job: Expiring) -> None:
        with self._wake:
            heapq.heappush(self._heap, (job.deadline, next(self._order), job))
            self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            due: list[Expiring] = []
            with self._wake:
                if self._closed:
                    return
                now = time.monotonic()
                heap = self._heap
                while heap and (heap[0][2].future.done() or heap[0][0] <= now):
                    due.append(heapq.heappop(heap)[2])
                if not due:
                    self._wake.wait(heap[0][0] - now if heap else None)
            for job in due:  # outside the lock: the futures' callbacks run here
                job.expire()


class _Stripe:
    """One daemon thread running its jobs in submission order."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Job[object], Callable[[Job[object]], object]] | None]
        self._jobs = queue.SimpleQueue()
        self.busy = False
        """Whether the thread is inside a job now (a stuck one stays so)."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, job: Job[T], work: Callable[[Job[T]], T]) -> None:
        self._jobs.put((job, work))  # type: ignore[arg-type]

    def stop(self, wait: bool) -> None:
        self._jobs.put(None)
        if wait:
            self.join()

    def join(self) -> None:
        """Wait for the thread to end (after :meth:`stop`)."""
        self._thread.join()

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, work = item
            if job.abandoned:
                continue
            self.busy = True
            try:
                result = work(job)
            except Exception:  # the funnel: a job that raises is a failed job, never a hang
                result = job.failed
            finally:
                self.busy = False
            job.finish(result)


class DeadlineStripes:
    """``count`` stripes whose jobs each get ``deadline_s`` plus time for their bytes.

    ``bytes_per_s`` is the slowest rate taken for a working device: a job
    moving ``n`` bytes may take ``deadline_s + n / bytes_per_s``.
    """

    def __init__(
        self,
        count: int,
        name: str,
        deadline_s: float,
        breaker: CircuitBreaker,
        bytes_per_s: float,
    ) -> None:
        self.deadline_s = deadline_s
        self.breaker = breaker
        self.expired = 0
        """Jobs failed by their deadline."""
        self._bytes_per_s = bytes_per_s
        self._count_lock = threading.Lock()
        self._open: set[Future[object]] = set()
        self._stopping = False
        """Set by :meth:`close`: later jobs fail at once, where no thread would ever run
        them and no watchdog expire them."""
        self._stripes = [_Stripe(f"{name}-{i}") for i in range(count)]
        self._watchdog = Watchdog(f"{name}-deadline")

    def __len__(self) -> int:
        return len(self._stripes)

    def submit(self, stripe: int, work: Callable[[Job[T]], T], failed: T, nbytes: int) -> Future[T]:
        """Run ``work`` on ``stripe``; its future holds ``failed`` if refused, raising, late
        or submitted after :meth:`close` began."""
        granted = self.breaker.allow()
        if granted is None:
            return done_future(failed)
        deadline = time.monotonic() + self.deadline_s + nbytes / self._bytes_per_s
        job = Job(deadline, failed, self.breaker, granted, self._count_expired)
        with self._count_lock:
            if self._stopping:
                self.breaker.excuse(granted)  # a trial that never runs is handed back
                return done_future(failed)
            self._open.add(job.future)  # type: ignore[arg-type]
        job.future.add_done_callback(self._closed)  # type: ignore[arg-type]
        self._watchdog.watch(job)
        self._stripes[stripe].put(job, work)
        return job.future

    @property
    def stuck(self) -> bool:
        """Whether a stripe thread is still inside a job (after a deadline: a hung file)."""
        return any(stripe.busy for stripe in self._stripes)

    def close(self, release: Callable[[], None]) -> None:
        """Wait for every job to finish or expire, stop the threads, then ``release`` what
        the jobs use: at once, or, when a thread is stuck past its deadline, on a daemon
        thread once every stripe thread has ended.

        Closing a file under a stuck call would let the call land in whatever file
        reuses the descriptor; keeping it open for good would keep its lock for the
        life of the process, long after the file system answers again.
        """
        with self._count_lock:
            self._stopping = True
            waiting = list(self._open)
        for future in waiting:
            future.result()
        stopped = not self.stuck
        for stripe in self._stripes:
            stripe.stop(wait=stopped)
        self._watchdog.close()
        if stopped:
            release()
            return
        stripes = self._stripes

        def release_when_stopped() -> None:
            for stripe in stripes:
                stripe.join()
            release()

        threading.Thread(target=release_when_stopped, name="kvoffload-release", daemon=True).start()

    def _closed(self, future: Future[object]) -> None:
        with self._count_lock:
            self._open.discard(future)

    def _count_expired(self) -> None:
        with self._count_lock:
            self.expired += 1


def done_future(result: T) -> Future[T]:
    """A future that already holds ``result``."""
    future: Future[T] = Future()
    future.set_result(result)
    return future
