"""Store and load throughput of the data plane, beside a plain copy of the same bytes.

Each round fills the CPU tier through the real manager and store handler
(GPU ids shuffled, as an engine's free list leaves them), loads every block
back through the load handler, then copies the same number of bytes from the
GPU cache into the tier's memory with one contiguous ``copy_`` per job, each
job's bytes after the last's: the plain copy walks as much distinct memory as
the jobs (a job-sized buffer copied over and over stays in the CPU's cache:
with 16 MiB jobs it ran twice as fast on a 2-core VM). Phases
alternate within each round, so the machine's drift hits all three alike;
each figure is the median over rounds. Every byte is checked after each
store and load phase, off the clock: each round gives the GPU cache new
content (every 8 bytes a value of their own) and clears it before the loads,
so a page left out, misplaced or not yet landed when a job reported done
fails the run instead of being timed.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np
import torch

from kvoffload.core.cpus import usable_cpus
from kvoffload.core.errors import InvalidArgumentError, KVOffloadError
from kvoffload.core.keys import OffloadKey, block_id_key
from kvoffload.core.layout import LAYOUT_PRESETS, layout_preset
from kvoffload.core.specs import CPULoadStoreSpec, GPULoadStoreSpec, TransferSpec
from kvoffload.dataplane.cpu_store import CPUBlockStore
from kvoffload.dataplane.handlers import cpu_gpu_handlers
from kvoffload.dataplane.kv_cache import PagedKVCache
from kvoffload.dataplane.worker import OffloadingWorker
from kvoffload.managers.cpu import CPUOffloadingManager

DEFAULTS: dict[str, Any] = {
    "layout": "llama-3.1-8b",
    "gpu_blocks": 512,
    "cpu_blocks": 512,
    "blocks_per_job": 64,
    "block_size_factor": 1,
    "rounds": 5,
    "device": "cpu",
    "threads": None,
    "seed": 0,
}
"""8B-class layout with 16-token blocks: 2 MiB per GPU block, 1 GiB per phase."""


def measure_transfer(
    layout: str = DEFAULTS["layout"],
    gpu_blocks: int = DEFAULTS["gpu_blocks"],
    cpu_blocks: int = DEFAULTS["cpu_blocks"],
    blocks_per_job: int = DEFAULTS["blocks_per_job"],
    block_size_factor: int = DEFAULTS["block_size_factor"],
    rounds: int = DEFAULTS["rounds"],
    device: str = DEFAULTS["device"],
    threads: int | None = DEFAULTS["threads"],
    seed: int = DEFAULTS["seed"],
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """GB/s of stores, loads and a plain copy; see the module docstring for the method.

    ``blocks_per_job`` counts offloaded blocks (of ``block_size_factor`` GPU
    blocks each), at most the tier's ``cpu_blocks``, which must fit in the
    ``gpu_blocks`` GPU blocks. On CUDA the plain copy is device-to-pinned-host (into the tier).
    Rates count the bytes each phase moved: a round's last job may be partial.
    ``progress(done, total)`` is told the rounds done (the warm-up's included) at the
    start and after each round.
    """
    kv_layout = layout_preset(layout)
    if rounds < 1 or blocks_per_job < 1:
        raise InvalidArgumentError("rounds and blocks_per_job must be >= 1")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise InvalidArgumentError(f"seed must be an integer >= 0, got {seed!r}")
    blocks_per_job = min(blocks_per_job, cpu_blocks)  # a job is a slice of the tier's blocks
    if threads is not None and not 1 <= threads <= usable_cpus():
        raise InvalidArgumentError(
            f"threads must be between 1 and {usable_cpus()} (the CPUs this process may use), "
            f"got {threads}"
        )
    if cpu_blocks * block_size_factor > gpu_blocks:
        raise InvalidArgumentError(
            f"{cpu_blocks} CPU blocks of {block_size_factor} GPU blocks do not fit "
            f"in {gpu_blocks} GPU blocks"
        )
    with _torch_threads(threads):
        rng = np.random.default_rng(seed)
        kv = PagedKVCache(kv_layout, gpu_blocks, device)
        store = CPUBlockStore(kv_layout, cpu_blocks, block_size_factor)
        store.data.fill_(0)  # fault the pages in now, not during the first store
        worker = OffloadingWorker(cpu_gpu_handlers(kv.layers, store))
        manager = CPUOffloadingManager(cpu_blocks)
        block_bytes = block_size_factor * kv_layout.bytes_per_block
        job_bytes = blocks_per_job * block_bytes
        gpu_bytes = kv.buffer.view(-1).view(torch.uint8)  # holds at least the tier's bytes
        tier_bytes = store.data.view(-1)
        samples: dict[str, list[float]] = {"store": [], "load": [], "copy": []}
        next_key = 0
        if progress is not None:
            progress(0, rounds + 1)
        try:
            for done in range(1, rounds + 2):  # the first round warms up
                keys = [block_id_key(next_key + i) for i in range(cpu_blocks)]
                next_key += cpu_blocks
                jobs = [keys[i : i + blocks_per_job] for i in range(0, cpu_blocks, blocks_per_job)]
                gpu_ids = [_gpu_ids(rng, gpu_blocks, len(job) * block_size_factor) for job in jobs]
                _fill(kv, done)
                stores = [_store(manager, *j) for j in zip(jobs, gpu_ids, strict=True)]
                store_seconds = _timed_jobs(worker, list(stores))
                _verify(kv, store, stores, "store")
                for job in jobs:
                    manager.complete_store(job)
                _fill(kv, None)
                loads = [_load(manager, *j) for j in zip(jobs, gpu_ids, strict=True)]
                load_seconds = _timed_jobs(worker, [(cpu, gpu) for gpu, cpu in loads])
                _verify(kv, store, loads, "load")
                # Overwrites the tier's slots, every one of which the next round stores anew.
                copy_seconds = _timed_copies(
                    tier_bytes, gpu_bytes, [len(job) * block_bytes for job in jobs]
                )
                for job in jobs:
                    manager.complete_load(job)
                moved = cpu_blocks * block_bytes / 1e9
                for name, seconds in (
                    ("store", store_seconds),
                    ("load", load_seconds),
                    ("copy", copy_seconds),
                ):
                    samples[name].append(moved / seconds)
                if progress is not None:
                    progress(done, rounds + 1)
        finally:
            worker.close()
        gbps = {name: statistics.median(values[1:]) for name, values in samples.items()}
        return {
            "layout": layout,
            "device": device,
            "threads": torch.get_num_threads(),
            "block_bytes": kv_layout.bytes_per_block,
            "block_size_factor": block_size_factor,
            "bytes_per_job": job_bytes,
            "jobs_per_round": -(-cpu_blocks // blocks_per_job),
            "rounds": rounds,
            "store_gbps": round(gbps["store"], 3),
            "load_gbps": round(gbps["load"], 3),
            "copy_gbps": round(gbps["copy"], 3),
            "store_vs_copy": round(gbps["store"] / gbps["copy"], 3),
            "load_vs_copy": round(gbps["load"] / gbps["copy"], 3),
        }


def add_cli_arguments(
    parser: argparse.ArgumentParser, integer: Callable[[int, int | None], Callable[[str], int]]
) -> None:
    """Options of ``kvoffload bench transfer`` (the CLI adds ``--json``);
    ``integer(minimum, maximum)`` is the CLI's argparse type of an integer in that range
    (``None``: unbounded)."""
    parser.add_argument(
        "--layout",
        default=DEFAULTS["layout"],
        help=f"KV layout preset, one of {', '.join(sorted(LAYOUT_PRESETS))} "
        f"(default: {DEFAULTS['layout']})",
    )
    for name, minimum, help_text in (
        ("gpu-blocks", 1, "GPU KV cache size in GPU blocks"),
        ("cpu-blocks", 1, "CPU tier size in offloaded blocks"),
        ("blocks-per-job", 1, "offloaded blocks per transfer job, at most --cpu-blocks"),
        ("block-size-factor", 1, "GPU blocks per offloaded block"),
        ("rounds", 1, "measured rounds, after one warm-up round"),
        ("seed", 0, "seed of the GPU block shuffle"),
    ):
        default = DEFAULTS[name.replace("-", "_")]
        parser.add_argument(
            f"--{name}",
            type=integer(minimum, None),
            default=default,
            help=f"{help_text} (default: {default})",
        )
    parser.add_argument(
        "--device",
        default=DEFAULTS["device"],
        help=f"device of the KV cache (default: {DEFAULTS['device']})",
    )
    parser.add_argument(
        "--threads",
        type=integer(1, usable_cpus()),
        default=None,
        help=f"torch CPU threads, from 1 to {usable_cpus()}, the CPUs this process may use "
        f"(default: torch's own, {torch.get_num_threads()} here)",
    )


def run_from_args(
    args: argparse.Namespace, progress: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    return measure_transfer(
        layout=args.layout,
        gpu_blocks=args.gpu_blocks,
        cpu_blocks=args.cpu_blocks,
        blocks_per_job=args.blocks_per_job,
        block_size_factor=args.block_size_factor,
        rounds=args.rounds,
        device=args.device,
        threads=args.threads,
        seed=args.seed,
        progress=progress,
    )


@contextlib.contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    """torch runs on ``threads`` threads (``None``: as it was) until the block ends, then
    on the caller's again: the setting is process-wide, and the caller's own work must
    not inherit ours."""
    callers = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(callers)


def _gpu_ids(rng: np.random.Generator, gpu_blocks: int, n: int) -> list[int]:
    return [int(i) for i in rng.permutation(gpu_blocks)[:n]]


def _store(
    manager: CPUOffloadingManager, keys: list[OffloadKey], gpu_ids: list[int]
) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
    output = manager.prepare_store(keys)
    if output is None or len(output.keys_to_store) != len(keys):
        raise InvalidArgumentError("the benchmark's CPU tier could not take a job")
    # The CPU manager's stores go to its slots.
    return GPULoadStoreSpec(gpu_ids, [len(gpu_ids)]), cast(CPULoadStoreSpec, output.store_spec)


def _load(
    manager: CPUOffloadingManager, keys: list[OffloadKey], gpu_ids: list[int]
) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
    """The GPU and CPU ends of a load, in the order :func:`_verify` takes them."""
    return GPULoadStoreSpec(gpu_ids, [len(gpu_ids)]), manager.prepare_load(keys)


def _timed_jobs(worker: OffloadingWorker, specs: list[TransferSpec]) -> float:
    """Seconds from submitting every job to the last one finishing."""
    start = time.perf_counter()
    for job_id, spec in enumerate(specs):
        if not worker.transfer_async(job_id, spec):
            raise InvalidArgumentError(f"benchmark job {job_id} was refused")
    worker.wait(set(range(len(specs))))
    seconds = time.perf_counter() - start
    failed = [r.job_id for r in worker.get_finished() if not r.success]
    if failed:
        raise InvalidArgumentError(f"benchmark jobs {failed} failed")
    return seconds


def _fill(kv: PagedKVCache, round_number: int | None) -> None:
    """Give every 8 bytes of the GPU cache a value of their own, different in each round
    (``None``: clear it), and wait for it, so that the fill is not timed as a copy."""
    raw = kv.buffer.view(-1).view(torch.uint8)
    words = raw[: raw.numel() // 8 * 8].view(torch.int64)
    if round_number is None:
        raw.zero_()
    else:
        first = round_number * words.numel()
        torch.arange(first, first + words.numel(), out=words)
    if raw.device.type == "cuda":
        torch.cuda.synchronize(raw.device)


def _verify(
    kv: PagedKVCache,
    store: CPUBlockStore,
    jobs: list[tuple[GPULoadStoreSpec, CPULoadStoreSpec]],
    phase: str,
) -> None:
    """Every page of every job is where the job put it: GPU block ``gpu_ids[i]``'s pages of
    all layers' K and V in CPU row ``i`` of the job's slots. Loads that write one GPU block
    twice bring it the same bytes (both slots were stored from that block)."""
    layout = kv.layout
    pages = kv.buffer.view(torch.uint8).view(2 * layout.num_layers, kv.num_blocks, -1)
    factor = store.block_size_factor
    for job_id, (gpu, cpu) in enumerate(jobs):
        rows = (cpu.block_ids[:, None] * factor + np.arange(factor)).ravel()
        ids = torch.from_numpy(gpu.block_ids).to(pages.device)
        on_gpu = pages.index_select(1, ids).transpose(0, 1).cpu()
        if not torch.equal(on_gpu, store.rows()[torch.from_numpy(rows)]):
            raise KVOffloadError(
                f"benchmark {phase} job {job_id} reported success but moved other bytes "
                "than its blocks'; the data plane is broken, its rates mean nothing"
            )


def _timed_copies(dst: torch.Tensor, src: torch.Tensor, sizes: list[int]) -> float:
    """Seconds to copy ``sizes`` bytes of ``src`` into ``dst``, one contiguous copy each (the
    jobs' sizes), each from where the last ended: as much distinct memory as the jobs."""
    start = time.perf_counter()
    offset = 0
    for size in sizes:
        dst[offset : offset + size].copy_(src[offset : offset + size], non_blocking=True)
        offset += size
    if src.device.type == "cuda":
        torch.cuda.synchronize(src.device)
    return time.perf_counter() - start
