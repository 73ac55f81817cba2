"""A failing copy is a failed result; the manager drops the half-written block."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dataplane_helpers import LAYOUTS, block_bytes, random_layers  # noqa: E402

from kvoffload.core.errors import BlockNotFoundError  # noqa: E402
from kvoffload.core.keys import OffloadKey, make_offload_key  # noqa: E402
from kvoffload.core.specs import CPULoadStoreSpec, GPULoadStoreSpec  # noqa: E402
from kvoffload.dataplane import (  # noqa: E402
    CPUBlockStore,
    CPUGPUHandler,
    OffloadingWorker,
    cpu_gpu_handlers,
)
from kvoffload.dataplane.runners import Job, ThreadRunner  # noqa: E402
from kvoffload.managers import CPUOffloadingManager  # noqa: E402


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(4, "big"), 0)


class FailOn:
    """Fault hook: raise at ``step`` of the jobs in ``jobs``."""

    def __init__(self, jobs: set[int], step: int) -> None:
        self.jobs, self.step = jobs, step

    def __call__(self, job_id: int, step: int) -> None:
        if job_id in self.jobs and step == self.step:
            raise OSError("injected copy failure")


@pytest.mark.parametrize("staged", [False, True])
def test_failed_store_frees_its_slots_and_is_never_loadable(staged: bool) -> None:
    layout = LAYOUTS["bf16"]
    layers = random_layers(layout, 16, 0, separate=True)  # one op per layer: fail midway
    store = CPUBlockStore(layout, 4)
    worker = OffloadingWorker(
        cpu_gpu_handlers(layers, store, staged=staged, fault_hook=FailOn({1}, step=1))
    )
    manager = CPUOffloadingManager(4)
    keys = [key(0), key(1)]
    output = manager.prepare_store(keys)
    assert output is not None
    assert worker.transfer_async(1, (GPULoadStoreSpec([3, 4], [2]), output.store_spec))
    worker.wait({1})
    (result,) = worker.get_finished()
    assert (result.job_id, result.success) == (1, False)
    manager.complete_store(keys, success=False)
    assert manager.lookup(keys) == 0
    assert manager.num_free_blocks == 4
    with pytest.raises(BlockNotFoundError):
        manager.prepare_load(keys)

    # The freed slots take the next store, which succeeds and loads back intact.
    retry = manager.prepare_store(keys)
    assert retry is not None
    assert worker.transfer_async(2, (GPULoadStoreSpec([3, 4], [2]), retry.store_spec))
    worker.wait({2})
    assert [r.success for r in worker.get_finished()] == [True]
    manager.complete_store(keys)
    expected = [block_bytes(layers, b).clone() for b in (3, 4)]
    assert worker.transfer_async(3, (manager.prepare_load(keys), GPULoadStoreSpec([9, 10], [2])))
    worker.wait({3})
    assert [r.success for r in worker.get_finished()] == [True]
    manager.complete_load(keys)
    assert all(
        torch.equal(block_bytes(layers, b), e) for b, e in zip((9, 10), expected, strict=True)
    )
    worker.close()


def test_a_failing_job_does_not_stop_the_jobs_queued_behind_it() -> None:
    layout = LAYOUTS["tiny-f16"]
    layers = random_layers(layout, 16, 0, separate=False)
    worker = OffloadingWorker(
        cpu_gpu_handlers(layers, CPUBlockStore(layout, 8), fault_hook=FailOn({2, 4}, step=0))
    )
    manager = CPUOffloadingManager(8)
    for job in range(1, 6):
        output = manager.prepare_store([key(job)])
        assert output is not None
        assert worker.transfer_async(job, (GPULoadStoreSpec([job], [1]), output.store_spec))
    worker.wait(set(range(1, 6)))
    results = {r.job_id: r.success for r in worker.get_finished()}
    assert results == {1: True, 2: False, 3: True, 4: False, 5: True}
    worker.close()


class Abort(BaseException):
    """Not an ``Exception``: what a hook calling ``sys.exit`` would raise."""


def test_a_job_aborted_by_a_base_exception_is_still_reported_failed() -> None:
    def abort_job_1(job_id: int, step: int) -> None:
        if job_id == 1:
            raise Abort

    layout = LAYOUTS["tiny-f16"]
    layers = random_layers(layout, 8, 0, separate=False)
    worker = OffloadingWorker(
        cpu_gpu_handlers(layers, CPUBlockStore(layout, 4), fault_hook=abort_job_1)
    )
    for job in (1, 2):
        assert worker.transfer_async(job, (GPULoadStoreSpec([job], [1]), CPULoadStoreSpec([job])))
    worker.wait({1, 2})
    assert {r.job_id: r.success for r in worker.get_finished()} == {1: False, 2: True}
    worker.close()


class _Recording(ThreadRunner):
    """A thread runner that notes what each submission asks of the compute stream."""

    def __init__(self) -> None:
        super().__init__()
        self.after_compute: list[bool] = []

    def submit(self, job_id: int, job: Job, after_compute: bool) -> None:
        self.after_compute.append(after_compute)
        super().submit(job_id, job, after_compute)


def test_loads_and_stores_both_wait_for_the_compute_stream() -> None:
    """A store reads blocks the model may still be writing; a load writes blocks that
    vLLM may still be zeroing (a reallocated block). On a GPU both copy streams wait for
    the compute stream, as vLLM 0.33's own worker does (tests/dataplane/test_cuda.py
    checks the bytes there)."""
    layout = LAYOUTS["bf16"]
    layers = random_layers(layout, 8, seed=5, separate=False)
    store = CPUBlockStore(layout, 4)
    runners = {to_cpu: _Recording() for to_cpu in (True, False)}
    handlers = {
        to_cpu: CPUGPUHandler(layers, store, to_cpu, runner=runner)
        for to_cpu, runner in runners.items()
    }
    assert handlers[True].transfer_async(1, (GPULoadStoreSpec([2], [1]), CPULoadStoreSpec([0])))
    handlers[True].wait({1})
    assert handlers[False].transfer_async(2, (CPULoadStoreSpec([0]), GPULoadStoreSpec([3], [1])))
    handlers[False].wait({2})
    assert [r.after_compute for r in runners.values()] == [[True], [True]]
    assert torch.equal(block_bytes(layers, 3), block_bytes(layers, 2))
    for handler in handlers.values():
        assert [result.success for result in handler.get_finished()] == [True]
        handler.close()
