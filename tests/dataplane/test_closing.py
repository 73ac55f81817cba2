"""A close that fails midway still closes the rest: the other handlers, which then take
no job, and a shared region's file."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

torch = pytest.importorskip("torch")

from dataplane_helpers import LAYOUTS, random_layers  # noqa: E402

from kvoffload.core.specs import CPULoadStoreSpec, GPULoadStoreSpec  # noqa: E402
from kvoffload.dataplane import (  # noqa: E402
    CPUBlockStore,
    FaultHook,
    OffloadingWorker,
    cpu_gpu_handlers,
)
from kvoffload.dataplane.shared_region import SharedRegion, region_path  # noqa: E402
from kvoffload.dataplane.worker import close_all  # noqa: E402

LAYOUT = LAYOUTS["tiny-f16"]
NUM_GPU, NUM_CPU = 8, 4
STORE = (GPULoadStoreSpec([1], [1]), CPULoadStoreSpec([0]))
LOAD = (CPULoadStoreSpec([0]), GPULoadStoreSpec([2], [1]))


def _in_a_thread_join(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "join":
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def interrupted_while_closing(job_id: int) -> Iterator[FaultHook]:
    """A fault hook that holds job ``job_id`` and sends this process SIGINT until the main
    thread, waiting for that job in a runner's close, is interrupted there: Ctrl-C
    during shutdown. A SIGINT that finds the main thread anywhere else is ignored."""
    interrupted, hook_done = threading.Event(), threading.Event()

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        if not interrupted.is_set() and _in_a_thread_join(frame):
            interrupted.set()
            raise KeyboardInterrupt

    def hold_until_interrupted(job: int, step: int) -> None:
        if job != job_id or step != 0:
            return
        try:
            for _ in range(2000):  # a join no signal interrupts fails the test, not hangs it
                if interrupted.wait(0.005):
                    return
                os.kill(os.getpid(), signal.SIGINT)
        finally:
            hook_done.set()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield hold_until_interrupted
    finally:
        hook_done.wait(30)  # its last SIGINT is handled here, by on_sigint, before restoring
        signal.signal(signal.SIGINT, previous)


def test_a_close_interrupted_while_a_copy_runs_still_closes_the_other_handlers() -> None:
    """The worker closed its handlers one after the other: an interrupt in the first
    close left the second one's thread running and taking jobs."""
    layers = random_layers(LAYOUT, NUM_GPU, seed=0, separate=False)
    store = CPUBlockStore(LAYOUT, NUM_CPU, pin_memory=False)
    with interrupted_while_closing(1) as hook:
        handlers = cpu_gpu_handlers(layers, store, fault_hook=hook)
        worker = OffloadingWorker(handlers)
        assert worker.transfer_async(1, STORE)
        with pytest.raises(KeyboardInterrupt):
            worker.close()
    (_, _, load) = handlers[1]
    with pytest.raises(RuntimeError, match="its runner is closed"):
        load.transfer_async(2, LOAD)


def test_a_region_is_released_when_a_handler_close_before_it_is_interrupted(
    tmp_path: Path,
) -> None:
    """What vLLM's worker shuts down: its handlers, then its shared region. The region's
    file outlived an interrupted handler close, holding its memory in /dev/shm until the
    next launch's sweep."""
    layers = random_layers(LAYOUT, NUM_GPU, seed=0, separate=False)
    path = region_path(tmp_path, "interrupted", 0)
    region = SharedRegion(path, NUM_CPU * LAYOUT.bytes_per_block, pin=False)
    store = CPUBlockStore(LAYOUT, NUM_CPU, buffer=region.tensor)
    with interrupted_while_closing(1) as hook:
        (_, _, store_handler), (_, _, load_handler) = cpu_gpu_handlers(
            layers, store, fault_hook=hook
        )
        assert store_handler.transfer_async(1, STORE)
        with pytest.raises(KeyboardInterrupt):
            close_all([store_handler, load_handler, region])
    assert not path.exists()
    with pytest.raises(RuntimeError, match="its runner is closed"):
        load_handler.transfer_async(2, LOAD)
