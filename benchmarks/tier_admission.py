"""What the disk tier's own admission saves: blocks written to disk and the hit ratio kept,
``--disk-admission none`` and ``filter`` (the seed filter, store threshold 2) against
``recommended`` (and with a disk write budget), per workload.

Capacities are shares of each workload's unique blocks, as in ``admission_table.py``: the
GPU cache 2% (at least the largest request), the CPU tier ``--cpu-share`` (5%), the disk
tier ``--disk-share`` (25%). The CPU tier stores everything in every row, so the rows differ
only in what reaches the disk. Disk tiers live in a temporary directory, removed after.

    python benchmarks/tier_admission.py [--workloads mooncake,rag,oneshot] [--budget 0.05]
                                        [--cpu-share 0.05] [--disk-share 0.25] [--json PATH]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from admission_table import (
    GPU_SHARE,
    WORKLOADS,
    capacity_shares,
    check_outputs,
    unique_blocks,
    write_rows,
)
from kvoffload.sim.run import SimConfig, simulate


def rows(name: str, cpu_share: float, disk_share: float, budget: float) -> list[dict[str, object]]:
    """The workload ``name`` under each disk admission; one row per configuration."""
    workload = WORKLOADS[name].load()
    unique = unique_blocks(workload)
    gpu = max(int(GPU_SHARE * unique), max(len(r.keys) for r in workload.requests))
    configs = {
        "none": {},
        "filter": {"disk_admission": "filter"},
        "recommended": {"disk_admission": "recommended"},
        f"recommended, budget {budget:g}": {
            "disk_admission": "recommended",
            "disk_write_budget": budget,
        },
    }
    found = []
    with tempfile.TemporaryDirectory() as scratch:
        for index, (label, changes) in enumerate(configs.items()):
            config = SimConfig(
                gpu_blocks=gpu,
                cpu_blocks=int(cpu_share * unique),
                bound=False,
                disk_dir=str(Path(scratch) / str(index)),
                disk_blocks=int(disk_share * unique),
                **changes,  # type: ignore[arg-type]
            )
            report = simulate(workload, config)
            disk = report.tiers["disk"]
            found.append(
                {
                    "workload": name,
                    "disk admission": label,
                    "gpu/cpu/disk blocks": f"{gpu}/{config.cpu_blocks}/{config.disk_blocks}",
                    "total hit": report.total_hit_ratio,
                    "offload hit": report.offload_hit_ratio,
                    "disk hit blocks": disk["hit_blocks"],
                    "disk stored blocks": disk["stored_blocks"],
                    "disk written bytes": disk["written_bytes"],
                    "disk offered": disk["offered_blocks"],
                    "disk admitted": disk["admitted_blocks"],
                }
            )
    return found


def workload_names(text: str) -> list[str]:
    """An argparse type: comma-separated names of ``admission_table.WORKLOADS``."""
    names = text.split(",")
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown workload {unknown[0]!r}; known: {', '.join(WORKLOADS)}"
        )
    return names


def share(text: str) -> float:
    """An argparse type: a capacity share of unique blocks, one of ``--shares`` there."""
    shares = capacity_shares(text)
    if len(shares) != 1:
        raise argparse.ArgumentTypeError(f"one share, got {text}")
    return shares[0]


def disk_budget(text: str) -> float:
    """An argparse type: disk writes per block reference, a number >= 0 (as the library takes)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--workloads", type=workload_names, default="mooncake,rag,oneshot")
    parser.add_argument("--cpu-share", type=share, default=0.05)
    parser.add_argument("--disk-share", type=share, default=0.25)
    parser.add_argument(
        "--budget", type=disk_budget, default=0.05, help="disk writes per reference"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    check_outputs(parser, args)
    table = []
    for name in args.workloads:
        for row in rows(name, args.cpu_share, args.disk_share, args.budget):
            table.append(row)
            print(
                f"{row['workload']:>10} | {row['disk admission']:<26} | "
                f"{row['gpu/cpu/disk blocks']:>18} | hit {row['total hit']:.4f} "
                f"(offload {row['offload hit']:.4f}) | disk hits {row['disk hit blocks']:>7,} | "
                f"disk stored {row['disk stored blocks']:>8,} "
                f"({row['disk written bytes'] / 2**30:.1f} GiB) | "
                f"admitted {row['disk admitted']:,} of {row['disk offered']:,}",
                flush=True,
            )
    return write_rows(args.json, table) if args.json else 0


if __name__ == "__main__":
    raise SystemExit(main())
