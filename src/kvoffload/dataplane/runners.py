"""Where a handler's copies run: a background thread, or a dedicated CUDA stream.

Both run jobs strictly in submission order, time them, and turn an exception
raised by a job into a failed job instead of letting it reach the caller.
A job is a callable that performs (on CPU) or enqueues (on CUDA) its copies.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from kvoffload.core.errors import KVOffloadError

logger = logging.getLogger(__name__)

Job = Callable[[], None]


@dataclass(frozen=True)
class JobOutcome:
    job_id: int
    success: bool
    seconds: float


class JobRunner(Protocol):
    def submit(self, job_id: int, job: Job, after_compute: bool) -> None:
        """Start ``job``; with ``after_compute`` it first waits for queued compute."""

    def poll(self) -> list[JobOutcome]:
        """Jobs finished since the last call, in submission order."""

    def wait(self, job_ids: Collection[int]) -> None:
        """Block until these jobs (ids this runner never saw are ignored) are done."""

    def close(self) -> None:
        """Wait for every job, then release the thread or stream."""


def _run(job_id: int, job: Job) -> bool:
    try:
        job()
    except Exception:
        logger.warning("transfer job %d failed", job_id, exc_info=True)
        return False
    return True


class RunnerClosedError(KVOffloadError, RuntimeError):
    """A job submitted after its runner was closed (the worker was shut down): the
    caller's mistake, refused in one line, not a fault inside the data plane."""


class _ClosableRunner(ABC):
    """What both runners share: once closed, a job is refused before anything is queued.

    After ``close`` the engine may have freed the buffers a job would copy (a shared
    region's mapping, the KV cache): a CUDA stream would still run it into that memory.
    The check is here, in the ``submit`` both runners inherit, so the CPU tests run the
    code that guards the CUDA runner.
    """

    def __init__(self) -> None:
        self._closed = False

    def submit(self, job_id: int, job: Job, after_compute: bool) -> None:
        if self._closed:
            raise RunnerClosedError(f"transfer job {job_id} refused: its runner is closed")
        self._enqueue(job_id, job, after_compute)

    def close(self) -> None:
        self._closed = True
        self._release()

    @abstractmethod
    def _enqueue(self, job_id: int, job: Job, after_compute: bool) -> None:
        """Queue ``job`` (the runner is open)."""

    @abstractmethod
    def _release(self) -> None:
        """Wait for every job, then release the thread or stream."""


class ThreadRunner(_ClosableRunner):
    """Runs jobs one at a time on a single background thread (CPU tensors).

    The caller's CPU work is synchronous, so the queue needs no compute
    barrier. Torch releases the GIL inside its kernels, so copies overlap
    with the caller's Python.
    """

    def __init__(self, name: str = "kvoffload-transfer") -> None:
        super().__init__()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        # The pool starts its thread on its first submission, after queueing the job: a
        # thread that could not start there would refuse the job yet leave it queued, to
        # run behind the next one into blocks the engine has since given to another
        # request. Started here, a failure is the constructor's, and submit never starts one.
        self._pool.submit(lambda: None).result()
        self._pending: deque[tuple[int, Future[JobOutcome]]] = deque()

    def _enqueue(self, job_id: int, job: Job, after_compute: bool) -> None:
        self._pending.append((job_id, self._pool.submit(self._timed, job_id, job)))

    @staticmethod
    def _timed(job_id: int, job: Job) -> JobOutcome:
        start = time.perf_counter()
        try:
            success = _run(job_id, job)
        except BaseException:
            # Left in the future, it would re-raise in poll and wait, and the job, popped
            # by poll, would never be reported. On this thread nothing else can act on it.
            logger.warning("transfer job %d aborted", job_id, exc_info=True)
            success = False
        return JobOutcome(job_id, success, time.perf_counter() - start)

    def poll(self) -> list[JobOutcome]:
        done: list[JobOutcome] = []
        while self._pending and self._pending[0][1].done():
            done.append(self._pending.popleft()[1].result())
        return done

    def wait(self, job_ids: Collection[int]) -> None:
        for job_id, future in list(self._pending):
            if job_id in job_ids:
                future.result()

    def _release(self) -> None:
        self._pool.shutdown(wait=True)


class CudaStreamRunner(_ClosableRunner):
    """Enqueues jobs on one dedicated CUDA stream, bracketed by timing events.

    One stream per direction keeps its jobs in order without cross-stream
    waits. ``after_compute`` makes the stream wait for the work already
    queued on the caller's current stream, so a store never reads a block
    before the model has finished writing it, and a load never writes one
    before an earlier write to it (vLLM's zeroing of a reallocated block).
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self._device = device
        self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self._pending: deque[tuple[int, bool, torch.cuda.Event, torch.cuda.Event]] = deque()

    def _enqueue(self, job_id: int, job: Job, after_compute: bool) -> None:
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        if after_compute:
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._stream):
            start.record(self._stream)
            success = _run(job_id, job)
            end.record(self._stream)
        self._pending.append((job_id, success, start, end))

    def poll(self) -> list[JobOutcome]:
        done: list[JobOutcome] = []
        while self._pending and self._pending[0][3].query():  # type: ignore[no-untyped-call]
            job_id, success, start, end = self._pending.popleft()
            done.append(JobOutcome(job_id, success, start.elapsed_time(end) / 1000.0))
        return done

    def wait(self, job_ids: Collection[int]) -> None:
        for job_id, _, _, end in list(self._pending):
            if job_id in job_ids:
                end.synchronize()

    def _release(self) -> None:
        self._stream.synchronize()
