"""The CUDA paths on a real GPU: dedicated streams, pinned stores, staged copies.

Every other data-plane test runs the same logic with CPU tensors; these need a
CUDA device and skip without one (CI has none). They exercise what CPU tensors
cannot: many jobs in flight on the copy streams at once, a store that must
wait for the model's work still queued on the compute stream, timings from
CUDA events, a shared region registered with CUDA (``cudaHostRegister``), and a
CPU store that locks exactly its own bytes.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (the CPU paths are tested elsewhere)", allow_module_level=True)

from dataplane_helpers import LAYOUTS, block_bytes, random_layers  # noqa: E402

from kvoffload.cli.main import main  # noqa: E402
from kvoffload.core.errors import InvalidArgumentError  # noqa: E402
from kvoffload.core.specs import CPULoadStoreSpec, GPULoadStoreSpec  # noqa: E402
from kvoffload.dataplane import CPUBlockStore, CPUGPUHandler, OffloadingWorker  # noqa: E402
from kvoffload.dataplane.allocation import resolve_device  # noqa: E402
from kvoffload.dataplane.runners import CudaStreamRunner  # noqa: E402
from kvoffload.dataplane.shared_region import (  # noqa: E402
    SharedRegion,
    default_directory,
    region_path,
)

NUM_GPU, NUM_CPU, JOBS = 96, 64, 16


def cuda_layers(layout_name: str, seed: int, separate: bool) -> list[torch.Tensor]:
    return [
        layer.to("cuda")
        for layer in random_layers(LAYOUTS[layout_name], NUM_GPU, seed=seed, separate=separate)
    ]


def filesystem_type(path: Path) -> str:
    """The type of the file system holding ``path``, from the longest mount point above it."""
    mount, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        _, point, point_kind, *_ = line.split()
        if f"{path}/".startswith(f"{point.rstrip('/')}/") and len(point) >= len(mount):
            mount, kind = point, point_kind
    return kind


def make_worker(
    layers: list[torch.Tensor], store: CPUBlockStore, staging_bytes: int
) -> OffloadingWorker:
    return OffloadingWorker(
        [
            (
                GPULoadStoreSpec,
                CPULoadStoreSpec,
                CPUGPUHandler(layers, store, True, staging_bytes=staging_bytes),
            ),
            (
                CPULoadStoreSpec,
                GPULoadStoreSpec,
                CPUGPUHandler(layers, store, False, staging_bytes=staging_bytes),
            ),
        ]
    )


def finish(worker: OffloadingWorker, job_ids: set[int]) -> None:
    worker.wait(job_ids)
    results = worker.get_finished()
    assert {r.job_id for r in results} == job_ids
    assert all(r.success for r in results)
    assert all(r.transfer_time is not None and r.transfer_time > 0 for r in results)


@pytest.mark.parametrize("staging_blocks", [1, 3, 1 << 10], ids=["1", "3", "all"])
@pytest.mark.parametrize("factor", [1, 4])
@pytest.mark.parametrize("layout_name", ["bf16", "fp8-odd"])
@pytest.mark.parametrize("separate", [False, True], ids=["one-alloc", "per-layer"])
def test_jobs_in_flight_together_round_trip_bit_exact(
    layout_name: str, factor: int, staging_blocks: int, separate: bool
) -> None:
    """``JOBS`` stores queued back to back, then as many loads, before any wait:
    a staging buffer or index tensor reused too early would corrupt some block."""
    layout = LAYOUTS[layout_name]
    layers = cuda_layers(layout_name, seed=factor, separate=separate)
    store = CPUBlockStore(layout, NUM_CPU, factor)
    assert store.data.is_pinned()
    worker = make_worker(layers, store, staging_blocks * layout.bytes_per_block)
    rng = np.random.default_rng(factor + staging_blocks)
    slots_per_job = NUM_CPU // JOBS
    slots = rng.permutation(NUM_CPU).reshape(JOBS, slots_per_job).tolist()
    sources = [rng.permutation(NUM_GPU)[: slots_per_job * factor].tolist() for _ in range(JOBS)]
    expected = [[block_bytes(layers, b).cpu() for b in job] for job in sources]
    for job in range(JOBS):
        spec = GPULoadStoreSpec(sources[job], [len(sources[job])])
        assert worker.transfer_async(job, (spec, CPULoadStoreSpec(slots[job])))
    finish(worker, set(range(JOBS)))
    for job in range(JOBS):
        for i, slot in enumerate(slots[job]):
            for j in range(factor):
                assert torch.equal(store.block(slot)[j], expected[job][i * factor + j])

    for layer in layers:
        layer.view(torch.uint8).fill_(0)
    order = rng.permutation(NUM_GPU).tolist()
    per_job = slots_per_job * factor
    # Consecutive jobs share half their GPU blocks: queue order decides what stays.
    targets = [
        [order[(job * per_job // 2 + i) % NUM_GPU] for i in range(per_job)] for job in range(JOBS)
    ]
    loaded: dict[int, torch.Tensor] = {}
    for job in range(JOBS):
        spec = GPULoadStoreSpec(targets[job], [len(targets[job])])
        assert worker.transfer_async(JOBS + job, (CPULoadStoreSpec(slots[job]), spec))
        for block, source in zip(targets[job], expected[job], strict=True):
            loaded[block] = source
    finish(worker, set(range(JOBS, 2 * JOBS)))
    for block in range(NUM_GPU):
        want = loaded.get(block)
        got = block_bytes(layers, block).cpu()
        assert torch.equal(got, want) if want is not None else not got.any()
    worker.close()


def test_a_store_waits_for_the_work_queued_before_it() -> None:
    """The model's last write to a block is still queued behind a long kernel on
    the compute stream when the store is submitted: the copy stream must wait."""
    layout = LAYOUTS["bf16"]
    layers = cuda_layers("bf16", seed=0, separate=False)
    store = CPUBlockStore(layout, 4)
    worker = make_worker(layers, store, 1 << 20)
    # Every kernel used below runs once first: CUDA loads a kernel lazily on first use, and
    # a load waits for the work queued before it, which would hide the race tested here.
    layers[0][:, 6].view(torch.uint8).fill_(0x5A)
    torch.cuda._sleep(1)
    assert worker.transfer_async(0, (GPULoadStoreSpec([6], [1]), CPULoadStoreSpec([1])))
    finish(worker, {0})
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # about 0.1 s of one SM's cycles
    for layer in layers:
        layer[:, 5].view(torch.uint8).fill_(0xA5)
    assert worker.transfer_async(1, (GPULoadStoreSpec([5], [1]), CPULoadStoreSpec([2])))
    finish(worker, {1})
    assert bool(store.block(2).eq(0xA5).all())
    worker.close()


def test_a_load_lands_after_the_work_queued_before_it() -> None:
    """vLLM zeroes a reallocated block on the compute stream; a load into it, submitted
    while that zeroing waits behind a long kernel, must land after it, not be wiped."""
    layout = LAYOUTS["bf16"]
    layers = cuda_layers("bf16", seed=1, separate=False)
    store = CPUBlockStore(layout, 4)
    worker = make_worker(layers, store, 1 << 20)
    for layer in layers:  # every kernel below runs once first (CUDA loads them lazily)
        layer[:, 5].view(torch.uint8).fill_(0x3C)
        layer[:, 8].zero_()
    torch.cuda._sleep(1)
    assert worker.transfer_async(0, (GPULoadStoreSpec([5], [1]), CPULoadStoreSpec([1])))
    finish(worker, {0})
    assert worker.transfer_async(1, (CPULoadStoreSpec([1]), GPULoadStoreSpec([8], [1])))
    finish(worker, {1})
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # about 0.1 s of one SM's cycles
    for layer in layers:
        layer[:, 7].zero_()
    assert worker.transfer_async(2, (CPULoadStoreSpec([1]), GPULoadStoreSpec([7], [1])))
    finish(worker, {2})
    torch.cuda.synchronize()
    assert torch.equal(block_bytes(layers, 7).cpu(), store.block(1))
    worker.close()


def test_a_pinned_shared_region_carries_a_round_trip() -> None:
    """In the directory workers use (``/dev/shm``): CUDA pins memory-backed files."""
    layout = LAYOUTS["tiny-f16"]
    size = 8 * layout.bytes_per_block
    region = SharedRegion(region_path(default_directory(), f"cuda-test-{os.getpid()}", 0), size)
    try:
        assert region.pinned and region.tensor is not None
        store = CPUBlockStore(layout, 8, buffer=region.tensor)
        layers = cuda_layers("tiny-f16", seed=3, separate=False)
        worker = make_worker(layers, store, 1 << 20)
        blocks = [40, 41, 7, 90]
        expected = [block_bytes(layers, b).cpu() for b in blocks]
        assert worker.transfer_async(
            1, (GPULoadStoreSpec(blocks, [4]), CPULoadStoreSpec([6, 0, 3, 1]))
        )
        finish(worker, {1})
        for layer in layers:
            layer.view(torch.uint8).fill_(0)
        targets = [1, 2, 3, 4]
        assert worker.transfer_async(
            2, (CPULoadStoreSpec([6, 0, 3, 1]), GPULoadStoreSpec(targets, [4]))
        )
        finish(worker, {2})
        for block, want in zip(targets, expected, strict=True):
            assert torch.equal(block_bytes(layers, block).cpu(), want)
        worker.close()
        del store
    finally:
        region.close()


def test_a_region_on_disk_stays_correct_when_cuda_cannot_pin_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """CUDA refuses to pin a file on a disk file system (seen on ext4): the copies
    turn synchronous, the bytes stay right, and the warning says why."""
    if filesystem_type(tmp_path) == "tmpfs":
        pytest.skip(f"{tmp_path} is memory-backed here, so CUDA pins it")
    layout = LAYOUTS["tiny-f16"]
    region = SharedRegion(region_path(tmp_path, "disk", 0), 4 * layout.bytes_per_block)
    try:
        assert not region.pinned and region.tensor is not None
        # The refused registration leaves no error behind for torch's next launch.
        assert int(torch.ones(4, device="cuda").sum()) == 4
        assert "cudaHostRegister error" in caplog.text and "/dev/shm" in caplog.text
        store = CPUBlockStore(layout, 4, buffer=region.tensor)
        layers = cuda_layers("tiny-f16", seed=4, separate=False)
        worker = make_worker(layers, store, 1 << 20)
        expected = block_bytes(layers, 11).cpu()
        assert worker.transfer_async(1, (GPULoadStoreSpec([11], [1]), CPULoadStoreSpec([3])))
        finish(worker, {1})
        assert torch.equal(store.block(3)[0], expected)
        worker.close()
        del store
    finally:
        region.close()


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line in /proc/self/status")


def test_a_cpu_store_locks_exactly_its_own_bytes() -> None:
    """torch's pinned allocator would lock 256 MiB for this 200 MiB store (it rounds up
    to a power of two); registered, the store is pinned and resident at its own size."""
    layout = LAYOUTS["tiny-f16"]
    before = resident_bytes()
    store = CPUBlockStore(layout, (200 << 20) // layout.bytes_per_block)
    grown = resident_bytes() - before
    size = store.data.numel()
    assert store.data.is_pinned()
    assert 0.9 * size <= grown <= 1.1 * size, (grown, size)


def test_a_closed_stream_runner_refuses_a_job_and_never_runs_it() -> None:
    """It queued one after ``close``, to copy into buffers the engine had freed."""
    ran: list[int] = []
    runner = CudaStreamRunner(torch.device("cuda"))
    runner.close()
    with pytest.raises(RuntimeError, match=r"^transfer job 3 refused: its runner is closed$"):
        runner.submit(3, lambda: ran.append(3), after_compute=True)
    runner.wait([3])
    assert (runner.poll(), ran) == ([], [])


def test_a_cuda_device_past_the_gpus_present_is_one_line_naming_their_count(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--device cuda:N`` past the GPUs was taken, and the first allocation there was
    reported as too little memory. Where CUDA_VISIBLE_DEVICES is set, the line names it."""
    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    note = (
        ""
        if visible is None
        else f"; CUDA_VISIBLE_DEVICES={visible!r} is set: torch sees only the GPUs it lists, "
        "numbered from cuda:0"
    )
    with pytest.raises(InvalidArgumentError, match=rf"^device 'cuda:{count}' asked for, but"):
        resolve_device(f"cuda:{count}")
    args = ["bench", "transfer", "--layout", "tiny", "--gpu-blocks", "8", "--cpu-blocks", "8"]
    assert main([*args, "--device", f"cuda:{count}", "--no-progress"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"kvoffload: error: --device cuda:{count}: device 'cuda:{count}' asked for, but torch "
        f"sees {count} CUDA device{'s' if count > 1 else ''} "
        f"({'cuda:0' if count == 1 else f'cuda:0 to cuda:{count - 1}'}){note}"
    ]
