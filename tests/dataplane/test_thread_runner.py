"""The thread runner's ``poll`` never waits: the engine's loop asks it every step."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("torch")

from kvoffload.dataplane.runners import ThreadRunner


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
