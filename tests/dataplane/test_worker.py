"""The worker routes by media, registers each pair once, and turns errors into False."""

from __future__ import annotations

from collections.abc import Collection

import pytest

pytest.importorskip("torch")

from dataplane_helpers import LAYOUTS, block_bytes, random_layers

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.specs import CPULoadStoreSpec, GPULoadStoreSpec, TransferSpec
from kvoffload.dataplane import (
    CPUBlockStore,
    CPUGPUHandler,
    OffloadingHandler,
    OffloadingWorker,
    TransferResult,
    cpu_gpu_handlers,
)


class Recorder(OffloadingHandler):
    """Accepts everything and finishes at once; raises when asked to."""

    def __init__(self, fail: bool = False) -> None:
        self.submitted: list[int] = []
        self.waited: list[set[int]] = []
        self.fail = fail

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        if self.fail:
            raise RuntimeError("boom")
        self.submitted.append(job_id)
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self.submitted = self.submitted, []
        return [TransferResult(job_id, True) for job_id in done]

    def wait(self, job_ids: Collection[int]) -> None:
        self.waited.append(set(job_ids))


def test_routes_by_source_and_destination_medium() -> None:
    store, load = Recorder(), Recorder()
    worker = OffloadingWorker(
        [(GPULoadStoreSpec, CPULoadStoreSpec, store), (CPULoadStoreSpec, GPULoadStoreSpec, load)]
    )
    assert worker.transfer_async(1, (GPULoadStoreSpec([0], [1]), CPULoadStoreSpec([0])))
    assert worker.transfer_async(2, (CPULoadStoreSpec([0]), GPULoadStoreSpec([0], [1])))
    assert (store.submitted, load.submitted) == ([1], [2])
    worker.wait({1, 2})
    assert store.waited == load.waited == [{1, 2}]
    assert sorted(r.job_id for r in worker.get_finished()) == [1, 2]


def test_each_pair_registers_once() -> None:
    worker = OffloadingWorker([(GPULoadStoreSpec, CPULoadStoreSpec, Recorder())])
    with pytest.raises(InvalidArgumentError, match="GPU->CPU"):
        worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, Recorder())


def test_unroutable_and_raising_transfers_are_false(caplog: pytest.LogCaptureFixture) -> None:
    worker = OffloadingWorker([(GPULoadStoreSpec, CPULoadStoreSpec, Recorder(fail=True))])
    assert not worker.transfer_async(1, (CPULoadStoreSpec([0]), GPULoadStoreSpec([0], [1])))
    assert not worker.transfer_async(2, (GPULoadStoreSpec([0], [1]), CPULoadStoreSpec([0])))
    assert "no handler" in caplog.text and "boom" in caplog.text
    assert worker.get_finished() == []


def test_bad_specs_and_duplicate_jobs_are_refused_not_raised() -> None:
    layout = LAYOUTS["tiny-f16"]
    layers = random_layers(layout, 8, 0, separate=False)
    worker = OffloadingWorker(cpu_gpu_handlers(layers, CPUBlockStore(layout, 4)))
    good = (GPULoadStoreSpec([1], [1]), CPULoadStoreSpec([0]))
    assert not worker.transfer_async(1, (GPULoadStoreSpec([1, 2], [2]), CPULoadStoreSpec([0])))
    assert not worker.transfer_async(2, (GPULoadStoreSpec([9], [1]), CPULoadStoreSpec([0])))
    assert worker.transfer_async(3, good)
    assert not worker.transfer_async(3, good)  # refused until its result is collected
    worker.wait({3})
    assert [r.job_id for r in worker.get_finished()] == [3]
    worker.close()


def test_a_spec_refused_as_bad_input_is_logged_as_one_line_naming_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The warning said only "transfer refused", the reason buried at the foot of a
    traceback from deep inside the handler, for a spec that was merely out of range."""
    layout = LAYOUTS["tiny-f16"]
    worker = OffloadingWorker(
        cpu_gpu_handlers(random_layers(layout, 8, 0, separate=False), CPUBlockStore(layout, 4))
    )
    with caplog.at_level("WARNING", logger="kvoffload.dataplane.worker"):
        assert not worker.transfer_async(1, (GPULoadStoreSpec([9], [1]), CPULoadStoreSpec([0])))
    worker.close()
    [record] = caplog.records
    assert record.getMessage() == (
        "job 1: GPU->CPU transfer refused: GPU block ids must lie in [0, 8), got [9]"
    )
    assert record.exc_info is None


def test_a_job_after_close_is_logged_as_one_line_naming_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A job after shutdown is the caller's mistake, like a bad spec: its warning carried a
    traceback from deep inside the runner."""
    layout = LAYOUTS["tiny-f16"]
    worker = OffloadingWorker(
        cpu_gpu_handlers(random_layers(layout, 8, 0, separate=False), CPUBlockStore(layout, 4))
    )
    worker.close()
    with caplog.at_level("WARNING", logger="kvoffload.dataplane.worker"):
        assert not worker.transfer_async(1, (GPULoadStoreSpec([1], [1]), CPULoadStoreSpec([0])))
    [record] = caplog.records
    assert record.getMessage() == (
        "job 1: GPU->CPU transfer refused: transfer job 1 refused: its runner is closed"
    )
    assert record.exc_info is None


def test_handler_rejects_a_store_of_another_shape() -> None:
    layers = random_layers(LAYOUTS["tiny-f16"], 8, 0, separate=False)
    with pytest.raises(InvalidArgumentError, match="pages of"):
        cpu_gpu_handlers(layers, CPUBlockStore(LAYOUTS["bf16"], 4))


def test_a_submission_the_runner_refuses_leaves_no_job_in_flight() -> None:
    layout = LAYOUTS["tiny-f16"]
    handler = CPUGPUHandler(
        random_layers(layout, 8, 0, separate=False), CPUBlockStore(layout, 4), to_cpu=True
    )
    handler.close()
    spec = (GPULoadStoreSpec([1], [1]), CPULoadStoreSpec([0]))
    for _ in range(2):  # the second time too: the id was never taken, so not "in flight"
        with pytest.raises(RuntimeError, match="its runner is closed"):
            handler.transfer_async(3, spec)
    assert handler.get_finished() == []


def test_a_job_id_in_flight_is_refused_in_the_other_direction_too() -> None:
    """Each handler only knows its own ids: a load reusing a stored job's id would
    report that id finished twice, once while the other job may still run."""
    import torch

    layout = LAYOUTS["tiny-f16"]
    layers = random_layers(layout, 8, 0, separate=False)
    worker = OffloadingWorker(cpu_gpu_handlers(layers, CPUBlockStore(layout, 4)))
    assert worker.transfer_async(1, (GPULoadStoreSpec([1], [1]), CPULoadStoreSpec([0])))
    assert not worker.transfer_async(1, (CPULoadStoreSpec([2]), GPULoadStoreSpec([5], [1])))
    worker.wait({1})
    assert [r.job_id for r in worker.get_finished()] == [1]
    # Collected, the id is free again.
    assert worker.transfer_async(1, (CPULoadStoreSpec([0]), GPULoadStoreSpec([5], [1])))
    worker.wait({1})
    assert [r.job_id for r in worker.get_finished()] == [1]
    assert torch.equal(block_bytes(layers, 5), block_bytes(layers, 1))
    worker.close()


@pytest.mark.parametrize(
    "spec",
    [None, (CPULoadStoreSpec([0]),), (None, None), (CPULoadStoreSpec([0]), 5)],
    ids=["none", "one-spec", "no-specs", "not-a-spec"],
)
def test_a_spec_that_is_no_pair_of_specs_is_refused_not_raised(
    spec: object, caplog: pytest.LogCaptureFixture
) -> None:
    """transfer_async promises never to raise into the engine's loop, but unpacking or
    routing a malformed spec raised ValueError, TypeError or AttributeError."""
    worker = OffloadingWorker([(GPULoadStoreSpec, CPULoadStoreSpec, Recorder())])
    assert not worker.transfer_async(1, spec)  # type: ignore[arg-type]
    assert "no (source, destination) pair of load/store specs" in caplog.text
    assert worker.get_finished() == []
