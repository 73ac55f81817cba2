"""H2D and D2H GB/s through the data plane's handlers, beside torch's own pinned copies.

Run on a CUDA machine with ``python benchmarks/transfer_cuda.py [--json PATH]``.
The handlers' figures come from ``kvoffload.dataplane.bench`` with the KV
cache on the GPU (stores are D2H, loads H2D); the reference is one
``copy_(non_blocking=True)`` per job between a GPU buffer and pinned host
memory of the same size. Exits with status 2 where CUDA is not available.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from kvoffload.cli import options
from kvoffload.dataplane import bench


def pinned_copy_gbps(job_bytes: int, jobs: int, rounds: int) -> dict[str, float]:
    """Median GB/s of ``jobs`` back-to-back pinned copies in each direction."""
    device_buffer = torch.ones(job_bytes, dtype=torch.uint8, device="cuda")
    host_buffer = torch.zeros(job_bytes, dtype=torch.uint8, pin_memory=True)
    rates: dict[str, list[float]] = {"d2h": [], "h2d": []}
    for _ in range(rounds + 1):  # the first round warms up
        for name, dst, src in (
            ("d2h", host_buffer, device_buffer),
            ("h2d", device_buffer, host_buffer),
        ):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(jobs):
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            rates[name].append(jobs * job_bytes / (time.perf_counter() - start) / 1e9)
    return {f"torch_{name}_gbps": round(statistics.median(v[1:]), 3) for name, v in rates.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    bench.add_cli_arguments(parser, options.integer)
    parser.set_defaults(device="cuda", gpu_blocks=2048, cpu_blocks=2048)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "transfer_cuda: CUDA is not available here; run it on a GPU machine.", file=sys.stderr
        )
        return 2
    results = bench.run_from_args(args)
    jobs = results["jobs_per_round"]
    results.update(pinned_copy_gbps(results["bytes_per_job"], jobs, args.rounds))
    results["store_vs_torch_d2h"] = round(results["store_gbps"] / results["torch_d2h_gbps"], 3)
    results["load_vs_torch_h2d"] = round(results["load_gbps"] / results["torch_h2d_gbps"], 3)
    results["gpu"] = torch.cuda.get_device_name()
    for name, value in results.items():
        print(f"{name:>20}  {value}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(results, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
