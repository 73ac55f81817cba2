"""Stores then loads through the handlers give back the exact bytes, on every copy path."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dataplane_helpers import LAYOUTS, block_bytes, random_layers  # noqa: E402

from kvoffload.core.errors import InvalidArgumentError  # noqa: E402
from kvoffload.core.specs import CPULoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec  # noqa: E402
from kvoffload.dataplane import CPUBlockStore, CPUGPUHandler, OffloadingWorker  # noqa: E402
from kvoffload.dataplane.kv_cache import page_groups  # noqa: E402

NUM_GPU, NUM_CPU = 48, 10

# (staged, min_run_bytes): staged path, direct runs only, scratch path only.
PATHS = {"staged": (True, 0), "direct-runs": (False, 0), "direct-scratch": (False, 1 << 40)}


def make_worker(layers: list[torch.Tensor], store: CPUBlockStore, path: str) -> OffloadingWorker:
    staged, min_run = PATHS[path]
    options = {"staged": staged, "min_run_bytes": min_run, "scratch_bytes": 3000}
    return OffloadingWorker(
        [
            (GPULoadStoreSpec, CPULoadStoreSpec, CPUGPUHandler(layers, store, True, **options)),
            (CPULoadStoreSpec, GPULoadStoreSpec, CPUGPUHandler(layers, store, False, **options)),
        ]
    )


def run(worker: OffloadingWorker, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
    assert worker.transfer_async(job_id, (src, dst))
    worker.wait({job_id})
    (result,) = worker.get_finished()
    assert (result.job_id, result.success) == (job_id, True)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("factor", [1, 2, 4])
@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("separate", [False, True], ids=["one-alloc", "per-layer"])
def test_store_then_unaligned_load_is_bit_exact(
    layout_name: str, factor: int, path: str, separate: bool
) -> None:
    layout = LAYOUTS[layout_name]
    rng = np.random.default_rng(factor)
    layers = random_layers(layout, NUM_GPU, seed=factor, separate=separate)
    store = CPUBlockStore(layout, NUM_CPU, factor)
    worker = make_worker(layers, store, path)
    slots = [7, 2, 3, 9, 0]  # a run (2, 3) among scattered slots
    src = rng.permutation(NUM_GPU)[: len(slots) * factor].tolist()
    expected = {b: block_bytes(layers, b).clone() for b in src}
    run(worker, 1, GPULoadStoreSpec(src, [len(src)]), CPULoadStoreSpec(slots))

    # The CPU slot holds its factor GPU blocks in order, every layer's K and V.
    for i, slot in enumerate(slots):
        for j in range(factor):
            assert torch.equal(store.block(slot)[j], expected[src[i * factor + j]])

    for layer in layers:
        layer.view(torch.uint8).fill_(0)
    skip = factor - 1  # the GPU already holds the first factor-1 blocks of the request
    dst = rng.permutation(NUM_GPU)[: len(src) - skip].tolist()
    spec = GPULoadStoreSpec(dst, [len(dst)], block_indices=[skip])
    run(worker, 2, CPULoadStoreSpec(slots), spec)
    for gpu_block, source in zip(dst, src[skip:], strict=True):
        assert torch.equal(block_bytes(layers, gpu_block), expected[source])
    untouched = sorted(set(range(NUM_GPU)) - set(dst))
    assert all(not block_bytes(layers, b).any() for b in untouched)
    worker.close()


def test_one_allocation_is_one_group_and_separate_layers_are_not() -> None:
    layout = LAYOUTS["bf16"]
    assert len(page_groups(random_layers(layout, 4, 0, separate=False))) == 1
    assert len(page_groups(random_layers(layout, 4, 0, separate=True))) == 2 * layout.num_layers


def test_result_reports_bytes_time_and_type() -> None:
    layout = LAYOUTS["tiny-f16"]
    layers = random_layers(layout, 8, 0, separate=False)
    worker = make_worker(layers, CPUBlockStore(layout, 4, 2), "direct-runs")
    assert worker.transfer_async(5, (GPULoadStoreSpec([1, 2, 3, 4], [4]), CPULoadStoreSpec([0, 3])))
    worker.wait({5})
    (result,) = worker.get_finished()
    assert result.transfer_size == 4 * layout.bytes_per_block
    assert result.transfer_time is not None and result.transfer_time >= 0
    assert result.transfer_type == ("GPU", "CPU")
    assert worker.get_finished() == []
    worker.close()


def test_a_permuted_layer_is_refused_not_copied_into_a_copy() -> None:
    # Heads before tokens in memory, viewed as [2, blocks, tokens, heads, dim]: flattening a
    # block needs a copy, and loads into that copy used to report success, changing nothing.
    layout = LAYOUTS["tiny-f16"]
    shape = (2, 6, layout.kv_heads, layout.tokens_per_block, layout.head_dim)
    layers = [torch.zeros(shape, dtype=torch.float16).transpose(2, 3) for _ in range(2)]
    with pytest.raises(InvalidArgumentError, match="contiguous in memory"):
        CPUGPUHandler(layers, CPUBlockStore(layout, 4), to_cpu=False)


def test_a_layer_without_blocks_is_refused_as_such() -> None:
    """It was refused as "not contiguous in memory", which named the wrong cause."""
    layout = LAYOUTS["tiny-f16"]
    shape = (2, 0, layout.tokens_per_block, layout.kv_heads, layout.head_dim)
    layers = [torch.zeros(shape, dtype=torch.float16) for _ in range(2)]
    with pytest.raises(InvalidArgumentError, match="at least one block, got \\(2, 0, 4, 2, 16\\)"):
        CPUGPUHandler(layers, CPUBlockStore(layout, 4), to_cpu=True)


@pytest.mark.parametrize("block_stride", [0, 64], ids=["expanded", "half-overlapping"])
def test_layers_whose_blocks_overlap_are_refused(block_stride: int) -> None:
    """A load into block 5 rewrote half of blocks 4 and 6 and reported success."""
    layout = LAYOUTS["tiny-f16"]  # 128 elements per page
    shape = (2, 8, layout.tokens_per_block, layout.kv_heads, layout.head_dim)
    strides = (8 * 128, block_stride, 32, 16, 1)
    layers = [torch.as_strided(torch.zeros(3000, dtype=torch.float16), shape, strides)] * 2
    with pytest.raises(InvalidArgumentError, match=r"must not overlap.* 128 elements and the next"):
        CPUGPUHandler(layers, CPUBlockStore(layout, 4), to_cpu=False)


@pytest.mark.parametrize("value_offset", [0, 64], ids=["expanded", "half-overlapping"])
def test_a_layer_whose_k_and_v_share_memory_is_refused(value_offset: int) -> None:
    """An expanded layer (K and V one and the same memory) was accepted: a load of V
    rewrote K, reporting success. Pages of K and V interleaved block by block (FlashInfer's
    [num_blocks, 2, ...] seen as [2, num_blocks, ...]) share none and stay accepted."""
    layout = LAYOUTS["tiny-f16"]  # 128 elements per page
    shape = (2, 8, layout.tokens_per_block, layout.kv_heads, layout.head_dim)
    memory = torch.zeros(3000, dtype=torch.float16)
    interleaved = torch.as_strided(memory, shape, (128, 256, 32, 16, 1))
    plain = torch.zeros(shape, dtype=torch.float16)
    CPUGPUHandler([interleaved, plain], CPUBlockStore(layout, 4), to_cpu=False)
    aliased = torch.as_strided(memory, shape, (value_offset, 128, 32, 16, 1))
    with pytest.raises(
        InvalidArgumentError,
        match=f"K and V must not share memory, but V starts {value_offset} elements after K",
    ):
        CPUGPUHandler([aliased, plain], CPUBlockStore(layout, 4), to_cpu=False)


@pytest.mark.parametrize(
    ("devices", "error"),
    [(["cpu", "meta"], "got cpu, meta"), (["meta", "meta"], "got meta")],
    ids=["mixed", "meta"],
)
def test_layers_off_one_cpu_or_cuda_device_are_refused(devices: list[str], error: str) -> None:
    """Mixed devices failed every job; on the meta device loads reported success."""
    layout = LAYOUTS["tiny-f16"]
    shape = (2, 8, layout.tokens_per_block, layout.kv_heads, layout.head_dim)
    layers = [torch.zeros(shape, dtype=torch.float16, device=device) for device in devices]
    with pytest.raises(InvalidArgumentError, match=f"one CPU or CUDA device, {error}$"):
        CPUGPUHandler(layers, CPUBlockStore(layout, 4), to_cpu=False)


def test_layers_that_are_not_dense_tensors_are_refused_as_such() -> None:
    """A sparse layer was refused as "not contiguous", which named the wrong cause."""
    layout = LAYOUTS["tiny-f16"]
    shape = (2, 8, layout.tokens_per_block, layout.kv_heads, layout.head_dim)
    sparse = [torch.zeros(shape, dtype=torch.float16).to_sparse()] * 2
    with pytest.raises(InvalidArgumentError, match=r"dense torch tensors, got torch\.sparse_coo"):
        CPUGPUHandler(sparse, CPUBlockStore(layout, 4), to_cpu=True)
    arrays = [np.zeros(shape, dtype=np.float16)] * 2
    with pytest.raises(InvalidArgumentError, match="dense torch tensors, got ndarray"):
        CPUGPUHandler(arrays, CPUBlockStore(layout, 4), to_cpu=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("value_offset", [150, 250])
def test_a_v_page_overlapping_the_next_blocks_k_page_is_refused(value_offset: int) -> None:
    """Blocks 192 elements apart, pages of 128: V starting 150 elements after K (past K of
    its own block, over the start of K of the next) was accepted, and a load of V rewrote
    the next block's K, reporting success. 250 (over the end of it) was already refused."""
    layout = LAYOUTS["tiny-f16"]  # 128 elements per page
    shape = (2, 8, layout.tokens_per_block, layout.kv_heads, layout.head_dim)
    memory = torch.zeros(3000, dtype=torch.float16)
    plain = torch.zeros(shape, dtype=torch.float16)
    aliased = torch.as_strided(memory, shape, (value_offset, 128 + 64, 32, 16, 1))
    with pytest.raises(
        InvalidArgumentError,
        match=f"K and V must not share memory, but V starts {value_offset} elements after K",
    ):
        CPUGPUHandler([aliased, plain], CPUBlockStore(layout, 4), to_cpu=False)
