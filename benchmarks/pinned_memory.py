"""Does registered host memory copy as fast as torch's own pinned memory?

``CPUBlockStore`` allocates its bytes unpinned and page-locks exactly them with
``cudaHostRegister`` (``kvoffload.dataplane.pinning``), because torch's pinned
allocator rounds up to a power of two. This measures what that costs in
bandwidth: three host buffers of the same size in one process, torch's
``pin_memory=True``, ``torch.empty`` then :func:`~kvoffload.dataplane.pinning.register`,
and an anonymous mapping advised ``MADV_HUGEPAGE`` then registered; jobs of random
blocks copied one by one on a copy stream in each direction (the data plane's
pattern), timed with CUDA events, the buffers' order rotated every round after a
warm-up. Ratios are against torch's pinned buffer in the same run.

    python benchmarks/pinned_memory.py [--gib 4] [--rounds 5] [--json PATH]

Exits with status 2 where CUDA is not available.
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from kvoffload.dataplane.pinning import register

BLOCK_BYTES = 2 << 20
BLOCKS_PER_JOB = 64
JOBS_PER_ROUND = 16


def torch_pinned(size: int) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8, pin_memory=True)


def registered(size: int) -> torch.Tensor:
    host = torch.empty(size, dtype=torch.uint8)
    host.fill_(1)  # resident before it is locked, as a written tier is
    if not register(host, "the benchmark's buffer"):
        raise SystemExit("pinned_memory: cudaHostRegister refused the buffer")
    return host


def registered_huge_pages(size: int) -> torch.Tensor:
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    host = torch.frombuffer(mapping, dtype=torch.uint8)
    host.fill_(1)
    if not register(host, "the benchmark's huge-page buffer"):
        raise SystemExit("pinned_memory: cudaHostRegister refused the huge-page buffer")
    return host


BUFFERS: dict[str, Callable[[int], torch.Tensor]] = {
    "torch_pinned": torch_pinned,
    "registered": registered,
    "registered_huge_pages": registered_huge_pages,
}


def anon_huge_gib() -> float:
    """This process's anonymous memory in transparent huge pages."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def copy_gbps(host: torch.Tensor, gpu: torch.Tensor, to_gpu: bool, jobs: list[list[int]]) -> float:
    """GB/s of ``jobs`` (lists of block indices), each block copied on its own."""
    stream = torch.cuda.Stream()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        start.record()
        for job in jobs:
            for block in job:
                if to_gpu:
                    gpu[block].copy_(host[block], non_blocking=True)
                else:
                    host[block].copy_(gpu[block], non_blocking=True)
        end.record()
    end.synchronize()
    copied = sum(len(job) for job in jobs) * BLOCK_BYTES
    return copied / (start.elapsed_time(end) / 1000) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--gib", type=int, default=4, help="each buffer's size in GiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    for name in ("gib", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not torch.cuda.is_available():
        print(
            "pinned_memory: CUDA is not available here; run it on a GPU machine.", file=sys.stderr
        )
        return 2
    size = args.gib << 30
    blocks = size // BLOCK_BYTES
    gpu = torch.empty((blocks, BLOCK_BYTES), dtype=torch.uint8, device="cuda")
    hosts = {}
    for name, make in BUFFERS.items():
        before = anon_huge_gib()
        hosts[name] = make(size).view(blocks, BLOCK_BYTES)
        print(
            f"{name}: pinned {hosts[name].is_pinned()}, huge pages "
            f"+{anon_huge_gib() - before:.2f} GiB",
            flush=True,
        )
    generator = torch.Generator().manual_seed(0)

    def draw_jobs() -> list[list[int]]:
        return [
            torch.randperm(blocks, generator=generator)[:BLOCKS_PER_JOB].tolist()
            for _ in range(JOBS_PER_ROUND)
        ]

    rates: dict[str, dict[str, list[float]]] = {n: {"h2d": [], "d2h": []} for n in hosts}
    names = list(hosts)
    for round_index in range(args.rounds + 1):  # the first round warms up
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            for direction, to_gpu in (("h2d", True), ("d2h", False)):
                rate = copy_gbps(hosts[name], gpu, to_gpu, draw_jobs())
                if round_index:
                    rates[name][direction].append(rate)
    medians = {n: {d: statistics.median(v) for d, v in r.items()} for n, r in rates.items()}
    base = medians["torch_pinned"]
    for name, median in medians.items():
        print(
            f"{name:>22}  h2d {median['h2d']:6.2f} GB/s ({median['h2d'] / base['h2d']:.3f}x)"
            f"  d2h {median['d2h']:6.2f} GB/s ({median['d2h'] / base['d2h']:.3f}x)"
        )
    if args.json:
        result = {"gpu": torch.cuda.get_device_name(), "rates": rates, "medians": medians}
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
