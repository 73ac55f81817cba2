"""How close the optimiser's what-if figures are to full runs of the same size.

One ``--admission recommended`` run per workload gives the whole-run what-if
figures of store-everything and the seed filter at 0.5x-4x the tier; each is
compared with a separate full run of that rule at that size (LRU, GPU cache
2% of unique blocks, as in the admission table). Prints the error (mini minus
full) of the hit ratio and of the writes per block reference, with the
sampling rate of each mini-tier.

    python benchmarks/whatif_accuracy.py [--share 0.1] [WORKLOAD ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from admission_table import GPU_SHARE, TRACE, WORKLOADS, unique_blocks
from kvoffload.sim.run import SimConfig, simulate

RULES = {"store-all": {"store_threshold": 0}, "filter": {"store_threshold": 2}}
FACTORS = ("0.5", "1", "2", "4")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("workloads", nargs="*", default=["mooncake", "chat"])
    parser.add_argument("--share", type=float, default=0.1, help="tier share of unique blocks")
    args = parser.parse_args()
    unknown = [name for name in args.workloads if name not in WORKLOADS]
    if unknown:
        print(f"error: unknown workload {unknown[0]!r}; known: {', '.join(WORKLOADS)}")
        return 1
    print("| workload | rule | factor | sampled | mini hit / writes | full hit / writes | error |")
    print("|---|---|---|---|---|---|---|")
    for name in args.workloads:
        if name == "mooncake" and not TRACE.is_file():
            print(f"note: {TRACE} not found, skipped", file=sys.stderr)
            continue
        workload = WORKLOADS[name].load()
        unique = unique_blocks(workload)
        gpu = max(int(GPU_SHARE * unique), max(len(r.keys) for r in workload.requests))
        cpu = int(args.share * unique)
        base = {"gpu_blocks": gpu, "bound": False}
        ours = simulate(workload, SimConfig(cpu_blocks=cpu, admission="recommended", **base))
        for rule, changes in RULES.items():
            for factor in FACTORS:
                size = int(cpu * float(factor))
                full = simulate(workload, SimConfig(cpu_blocks=size, **base, **changes))
                mini = ours.whatif[rule][factor]
                print(
                    f"| {name} | {rule} | {factor}x | 1 in {round(1 / mini['sampling_rate'])} "
                    f"| {mini['hit_ratio']:.4f} / {mini['writes_per_ref']:.3f} "
                    f"| {full.total_hit_ratio:.4f} / {full.writes_per_ref:.3f} "
                    f"| {mini['hit_ratio'] - full.total_hit_ratio:+.4f} / "
                    f"{mini['writes_per_ref'] - full.writes_per_ref:+.3f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
