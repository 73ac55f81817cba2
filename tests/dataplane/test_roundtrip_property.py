"""Random layouts, factors, copy paths and block ids: every byte stored comes back.

The fixed cases of ``test_roundtrip`` pick one scattering of blocks per
layout; here hypothesis draws the layout (1-byte fp8 to fp32, odd page
sizes), how the layers lie in memory (one allocation, one per layer, or K
and V pages alternating block by block as vLLM's worker hands them over),
the offloaded-block factor, the GPU and CPU ids, the copy path and its
chunk sizes, splits the store into jobs in flight together, scrambles the
GPU cache and loads into other GPU blocks, then compares every byte,
including those of the slots and GPU blocks no job named. Ids named twice
in one job are refused, with no byte touched.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

from dataplane_helpers import block_bytes, random_layers  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvoffload.core.layout import KVLayout  # noqa: E402
from kvoffload.core.specs import CPULoadStoreSpec, GPULoadStoreSpec, TransferSpec  # noqa: E402
from kvoffload.dataplane import CPUBlockStore, CPUGPUHandler, OffloadingWorker  # noqa: E402

PATHS = {
    "staged": (True, 0),
    "direct-runs": (False, 0),
    "direct-scratch": (False, 1 << 40),
    "direct-mixed": (False, 200),
}
"""``(staged, min_run_bytes)``; the mixed one sends short runs through the scratch."""


@dataclass(frozen=True)
class Case:
    layout: KVLayout
    factor: int
    num_gpu: int
    num_cpu: int
    slots: list[int]
    store_gpu: list[int]
    store_jobs: int
    skip: int
    load_gpu: list[int]
    implicit_skip: bool
    path: str
    separate: bool
    interleaved: bool
    chunk_bytes: int
    seed: int


@st.composite
def cases(draw: st.DrawFn) -> Case:
    layout = KVLayout(
        num_layers=draw(st.integers(1, 3)),
        kv_heads=draw(st.integers(1, 3)),
        head_dim=draw(st.integers(1, 9)),
        dtype=draw(st.sampled_from(["float8", "bfloat16", "float16", "float32"])),
        tokens_per_block=draw(st.integers(1, 5)),
    )
    factor = draw(st.integers(1, 4))
    num_cpu = draw(st.integers(1, 8))
    slots = draw(st.permutations(range(num_cpu)))[: draw(st.integers(0, num_cpu))]
    pages = len(slots) * factor
    num_gpu = draw(st.integers(max(1, pages), pages + 6))
    store_gpu = draw(st.permutations(range(num_gpu)))[:pages]
    skip = draw(st.integers(0, factor - 1)) if slots else 0
    load_gpu = draw(st.permutations(range(num_gpu)))[: pages - skip]
    return Case(
        layout=layout,
        factor=factor,
        num_gpu=num_gpu,
        num_cpu=num_cpu,
        slots=slots,
        store_gpu=store_gpu,
        store_jobs=draw(st.integers(1, 3)),
        skip=skip,
        load_gpu=load_gpu,
        # Without block_indices the load ends on an offloaded-block boundary.
        implicit_skip=skip == -len(load_gpu) % factor and draw(st.booleans()),
        path=draw(st.sampled_from(sorted(PATHS))),
        separate=draw(st.booleans()),
        interleaved=draw(st.booleans()),
        chunk_bytes=draw(st.integers(1, 4096)),
        seed=draw(st.integers(0, 2**16)),
    )


def make_worker(layers: list[torch.Tensor], store: CPUBlockStore, case: Case) -> OffloadingWorker:
    staged, min_run = PATHS[case.path]
    options = {
        "staged": staged,
        "min_run_bytes": min_run,
        "scratch_bytes": case.chunk_bytes,
        "staging_bytes": case.chunk_bytes,
    }
    return OffloadingWorker(
        [
            (GPULoadStoreSpec, CPULoadStoreSpec, CPUGPUHandler(layers, store, True, **options)),
            (CPULoadStoreSpec, GPULoadStoreSpec, CPUGPUHandler(layers, store, False, **options)),
        ]
    )


def run_together(worker: OffloadingWorker, jobs: dict[int, TransferSpec]) -> None:
    """Submit all ``jobs`` before waiting: each must be reported once, successful."""
    assert all(worker.transfer_async(job_id, spec) for job_id, spec in jobs.items())
    worker.wait(set(jobs))
    reported = [(result.job_id, result.success) for result in worker.get_finished()]
    assert sorted(reported) == [(job_id, True) for job_id in sorted(jobs)]


def random_bytes(shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)


def all_block_bytes(layers: list[torch.Tensor], num_blocks: int) -> list[torch.Tensor]:
    return [block_bytes(layers, b).clone() for b in range(num_blocks)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_every_stored_byte_loads_back_and_nothing_else_changes(case: Case) -> None:
    layers = random_layers(case.layout, case.num_gpu, case.seed, case.separate, case.interleaved)
    store = CPUBlockStore(case.layout, case.num_cpu, case.factor)
    generator = torch.Generator().manual_seed(case.seed + 1)
    store.data.copy_(random_bytes(store.data.shape, generator))
    worker = make_worker(layers, store, case)
    stored = all_block_bytes(layers, case.num_gpu)
    slots_before = store.data.clone()

    # The store, split into jobs of whole slots, all in flight at once.
    cuts = (len(case.slots) * i // case.store_jobs for i in range(1, case.store_jobs))
    bounds = sorted({0, len(case.slots), *cuts})
    store_jobs: dict[int, TransferSpec] = {}
    for first, end in itertools.pairwise(bounds):
        gpu = case.store_gpu[first * case.factor : end * case.factor]
        spec = (GPULoadStoreSpec(gpu, [len(gpu)]), CPULoadStoreSpec(case.slots[first:end]))
        store_jobs[len(store_jobs)] = spec
    run_together(worker, store_jobs)
    for i, slot in enumerate(case.slots):
        for j in range(case.factor):
            assert torch.equal(store.block(slot)[j], stored[case.store_gpu[i * case.factor + j]])
    for slot in sorted(set(range(case.num_cpu)) - set(case.slots)):
        assert torch.equal(store.block(slot), slots_before[slot])

    for layer in layers:
        raw = layer.view(torch.uint8)
        raw.copy_(random_bytes(raw.shape, generator))
    scrambled = all_block_bytes(layers, case.num_gpu)
    indices = None if case.implicit_skip else [case.skip]
    load = GPULoadStoreSpec(case.load_gpu, [len(case.load_gpu)], block_indices=indices)
    run_together(worker, {100: (CPULoadStoreSpec(case.slots), load)})
    for gpu_block, source in zip(case.load_gpu, case.store_gpu[case.skip :], strict=True):
        assert torch.equal(block_bytes(layers, gpu_block), stored[source])
    for gpu_block in sorted(set(range(case.num_gpu)) - set(case.load_gpu)):
        assert torch.equal(block_bytes(layers, gpu_block), scrambled[gpu_block])
    worker.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), data=st.data())
def test_an_id_named_twice_in_a_job_is_refused_and_no_byte_moves(
    case: Case, data: st.DataObject
) -> None:
    """Two pages of one job into one GPU block or CPU slot would leave whichever copy came
    last; two out of one would give one block twice. Neither is a transfer vLLM asks for."""
    if not case.slots:
        return
    layers = random_layers(case.layout, case.num_gpu, case.seed, case.separate, case.interleaved)
    store = CPUBlockStore(case.layout, case.num_cpu, case.factor)
    worker = make_worker(layers, store, case)
    gpu_before, slots_before = all_block_bytes(layers, case.num_gpu), store.data.clone()
    twice = data.draw(st.sampled_from(["store slots", "store GPU", "load slots", "load GPU"]))
    slots, gpu = list(case.slots), list(case.store_gpu if "store" in twice else case.load_gpu)
    ids = slots if twice.endswith("slots") else gpu
    if len(ids) < 2:
        return
    first, second = data.draw(st.permutations(range(len(ids))))[:2]
    ids[first] = ids[second]  # the counts stay right: only the repeat is wrong
    gpu_spec = GPULoadStoreSpec(gpu, [len(gpu)], block_indices=[case.skip])
    spec: TransferSpec = (
        (GPULoadStoreSpec(gpu, [len(gpu)]), CPULoadStoreSpec(slots))
        if "store" in twice
        else (CPULoadStoreSpec(slots), gpu_spec)
    )
    assert not worker.transfer_async(1, spec)
    worker.wait({1})
    assert worker.get_finished() == []
    assert torch.equal(store.data, slots_before)
    for block in range(case.num_gpu):
        assert torch.equal(block_bytes(layers, block), gpu_before[block]), block
    worker.close()
