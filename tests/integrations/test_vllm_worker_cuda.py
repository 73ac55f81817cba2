"""vLLM's worker side on a real GPU: our ``OffloadingWorker`` over CUDA canonical KV caches.

``test_vllm_worker.py`` runs the same contract with CPU tensors; this needs a CUDA
device and vLLM's offloading base module, and skips without either (CI has no
GPU). It covers what CPU tensors cannot: vLLM's canonical caches on the GPU,
stores and loads in flight together on the copy streams, the expedited load
path, slots in a shared region registered with CUDA (the worker's layout when
lower tiers run in the scheduler process), and a store that must wait for the
model's last write to its block, still queued on the compute stream.
"""

from __future__ import annotations

import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip(
        "needs a CUDA device (test_vllm_worker.py runs the CPU path)", allow_module_level=True
    )
with warnings.catch_warnings():  # torch's deprecation warnings from vLLM's import are not ours
    warnings.filterwarnings(
        "ignore", message=r".*torch\.jit\.script_method.*", category=DeprecationWarning
    )
    base = pytest.importorskip("vllm.v1.kv_offload.base")

from vllm_helpers import canonical_caches, finish  # noqa: E402

from kvoffload.dataplane.shared_region import default_directory, region_path  # noqa: E402
from kvoffload.integrations.vllm.worker import KVOffloadWorker  # noqa: E402

NUM_GPU_BLOCKS, NUM_CPU_BLOCKS, TENSORS = 64, 48, 4
PAGE_BYTES = 2 * 8 * 128 * 2 * 16
"""K and V of 8 heads of 128 bf16 elements for 16 tokens, in bytes: an even page, as
vLLM's are."""


def gpu_spec(blocks: list[int]) -> Any:
    return base.GPULoadStoreSpec(blocks, [len(blocks)], [0])


def cpu_spec(slots: list[int]) -> Any:
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    return CPULoadStoreSpec(slots)


@pytest.fixture(params=["private", "shared-region"])
def worker(request: pytest.FixtureRequest) -> Iterator[tuple[KVOffloadWorker, Any]]:
    caches = canonical_caches(TENSORS, NUM_GPU_BLOCKS, PAGE_BYTES, seed=1, device="cuda")
    region = None
    if request.param == "shared-region":
        region = region_path(default_directory(), f"cuda-{uuid.uuid4().hex[:8]}", 0)
    made = KVOffloadWorker(caches, NUM_CPU_BLOCKS, 1, region, TENSORS * PAGE_BYTES)
    yield made, caches
    made.shutdown()
    assert region is None or not region.exists()


def test_jobs_in_flight_together_round_trip_through_vllms_worker(
    worker: tuple[KVOffloadWorker, Any],
) -> None:
    """Eight stores submitted back to back, then eight loads (half expedited) into other
    GPU blocks before any wait; every byte comes back."""
    offload, caches = worker
    assert offload.store.data.is_pinned()
    gpu = [t.tensor for t in caches.tensors]
    sources = [[4 * job + i for i in range(4)] for job in range(8)]
    slots = [[40 - 4 * job + i for i in range(4)] for job in range(8)]
    expected = [[t[blocks].clone() for t in gpu] for blocks in sources]
    for job, (blocks, where) in enumerate(zip(sources, slots, strict=True)):
        assert offload.submit_store(job, gpu_spec(blocks), cpu_spec(where))
    stored = finish(offload, set(range(8)))
    assert len(stored) == 8
    assert all(result.success for result in stored.values())
    assert all(result.transfer_size == 4 * TENSORS * PAGE_BYTES for result in stored.values())
    targets = [[NUM_GPU_BLOCKS - 1 - 4 * job - i for i in range(4)] for job in range(8)]
    for job, (where, blocks) in enumerate(zip(slots, targets, strict=True)):
        assert offload.submit_load(100 + job, cpu_spec(where), gpu_spec(blocks), job % 2 == 1)
    loaded = finish(offload, {100 + job for job in range(8)})
    assert len(loaded) == 8
    assert all(result.success for result in loaded.values())
    torch.cuda.synchronize()
    for want, blocks in zip(expected, targets, strict=True):
        for tensor, block_bytes in zip(gpu, want, strict=True):
            assert torch.equal(tensor[blocks], block_bytes)


def test_a_store_waits_for_the_models_last_write(worker: tuple[KVOffloadWorker, Any]) -> None:
    """The model writes a block on the compute stream behind a long kernel; a store
    submitted at once must copy what it wrote, not what the block held before."""
    offload, caches = worker
    gpu = caches.tensors[0].tensor
    # Every kernel used below runs once first: CUDA loads a kernel lazily on first use, and
    # a load waits for the work queued before it, which would hide the race tested here.
    gpu[9].fill_(1)
    torch.cuda._sleep(1)
    assert offload.submit_store(0, gpu_spec([9]), cpu_spec([1]))
    assert finish(offload, {0})[0].success
    assert offload.submit_load(3, cpu_spec([1]), gpu_spec([10]))
    assert finish(offload, {3})[3].success
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # about 0.1 s of one SM's cycles, on the compute stream
    gpu[7].fill_(3)
    assert offload.submit_store(1, gpu_spec([7]), cpu_spec([0]))
    assert finish(offload, {1})[1].success
    assert offload.submit_load(2, cpu_spec([0]), gpu_spec([8]))
    assert finish(offload, {2})[2].success
    torch.cuda.synchronize()
    assert bool((gpu[8] == 3).all())
