"""The thread runner's ``poll`` never waits (the engine's loop asks it every step), and once
closed it takes no job, as the CUDA runner, which shares that code."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("torch")

from kvoffload.dataplane.runners import CudaStreamRunner, ThreadRunner


def test_poll_returns_at_once_while_a_job_runs() -> None:
    release = threading.Event()

    def blocked() -> None:
        release.wait()

    runner = ThreadRunner()
    # A blocking poll would only return once the timer frees the job, holding it.
    timer = threading.Timer(5.0, release.set)
    timer.start()
    try:
        runner.submit(1, blocked, after_compute=False)
        runner.submit(2, lambda: None, after_compute=False)
        assert runner.poll() == []
        release.set()
        runner.wait([1, 2])
        outcomes = runner.poll()
        assert [(o.job_id, o.success) for o in outcomes] == [(1, True), (2, True)]
        assert runner.poll() == []
    finally:
        release.set()
        timer.cancel()
        runner.close()


def refuse_start(self: threading.Thread) -> None:
    """``Thread.start`` of a process that has no thread left to start."""
    raise RuntimeError("can't start new thread")


def test_a_runner_whose_thread_cannot_start_fails_when_it_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(threading.Thread, "start", refuse_start)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        ThreadRunner()


def test_a_job_is_either_refused_and_never_run_or_run_and_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pool once started its thread at the first submission, after queueing the job:
    when the thread could not start the job was refused, then ran behind the next one."""
    ran: list[int] = []
    runner = ThreadRunner()
    try:
        with monkeypatch.context() as patch:
            patch.setattr(threading.Thread, "start", refuse_start)
            try:
                runner.submit(1, lambda: ran.append(1), after_compute=False)
                accepted = True
            except RuntimeError:
                accepted = False
        runner.submit(2, lambda: ran.append(2), after_compute=False)
        runner.wait([1, 2])
        reported = [outcome.job_id for outcome in runner.poll()]
        assert ran == reported == ([1, 2] if accepted else [2])
    finally:
        runner.close()


def test_a_closed_runner_refuses_a_job_and_never_runs_it() -> None:
    ran: list[int] = []
    runner = ThreadRunner()
    runner.close()
    with pytest.raises(RuntimeError, match=r"^transfer job 7 refused: its runner is closed$"):
        runner.submit(7, lambda: ran.append(7), after_compute=False)
    runner.wait([7])
    assert (runner.poll(), ran) == ([], [])


def test_the_cuda_runner_refuses_a_job_after_close_as_the_thread_runner_does() -> None:
    """The CUDA runner queued a job after ``close`` on its stream, which then copied into
    buffers the engine had freed (the CPU runner's pool refused it). Both now take
    ``submit`` and ``close`` from one base, whose refusal the test above runs on the CPU."""
    for method in ("submit", "close"):
        assert getattr(CudaStreamRunner, method) is getattr(ThreadRunner, method)
