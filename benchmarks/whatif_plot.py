"""A live what-if curve: what each admission rule would give at other tier sizes, right now.

Replays a workload through ``--admission recommended --policy recommended`` and
plots, at the end, the optimiser's recent (windowed) what-if figures, hit
ratio against the tier's capacity factor, one line per candidate rule, with
full runs of store-everything and the seed filter at the same sizes as
crosses (the check that the miniature simulations tell the truth).

    python benchmarks/whatif_plot.py [--workload longchat|mooncake] [--share 0.1]
                                     [--out docs/img/whatif.png]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from admission_table import GPU_SHARE, TRACE, WORKLOADS, unique_blocks
from kvoffload.admission import find_admission
from kvoffload.observe import ObservedManager, Observers
from kvoffload.sim.run import SimConfig, simulate

FACTORS = (0.5, 1.0, 2.0, 4.0)
FULL_RUNS = {"store-all": {"store_threshold": 0}, "filter": {"store_threshold": 2}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--workload", default="longchat", choices=sorted(WORKLOADS))
    parser.add_argument("--share", type=float, default=0.1, help="tier share of unique blocks")
    parser.add_argument("--out", type=Path, default=Path("docs/img/whatif.png"))
    args = parser.parse_args()
    if args.workload == "mooncake" and not TRACE.is_file():
        print(f"error: {TRACE} not found", file=sys.stderr)
        return 1
    workload = WORKLOADS[args.workload].load()
    unique = unique_blocks(workload)
    gpu = max(int(GPU_SHARE * unique), max(len(r.keys) for r in workload.requests))
    cpu = int(args.share * unique)
    observed: list[ObservedManager] = []
    config = SimConfig(
        gpu_blocks=gpu, cpu_blocks=cpu, admission="recommended", policy="recommended"
    )
    report = simulate(workload, config, observers=Observers(on_manager=(observed.append,)))
    layer = find_admission(observed[0])
    if layer is None:
        print("error: no admission layer was built", file=sys.stderr)
        return 1
    stats = layer.stats()
    full = {
        name: [
            simulate(workload, SimConfig(gpu_blocks=gpu, cpu_blocks=int(cpu * f), **changes))
            for f in FACTORS
        ]
        for name, changes in FULL_RUNS.items()
    }

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2))
    for name in dict.fromkeys(f.candidate for f in stats.whatif):
        points = sorted(
            (f.capacity_factor, f.hit_ratio) for f in stats.whatif if f.candidate == name
        )
        label = f"{name} (what-if, recent)" + (" - followed" if name == stats.candidate else "")
        axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    for name, runs in full.items():
        axes.scatter(
            FACTORS,
            [r.total_hit_ratio for r in runs],
            marker="x",
            s=60,
            label=f"{name} (full runs, whole trace)",
        )
    axes.scatter(
        [1.0],
        [report.total_hit_ratio],
        marker="*",
        s=160,
        color="black",
        label="recommended (this run)",
        zorder=5,
    )
    axes.set_xscale("log", base=2)
    axes.set_xticks(FACTORS, [f"{f:g}x" for f in FACTORS])
    axes.set_xlabel(f"offload tier capacity (1x = {cpu:,} blocks, {args.share:.0%} of unique)")
    axes.set_ylabel("total hit ratio")
    axes.set_title(f"Live what-if on {args.workload}: hit ratio by rule and tier size")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    try:
        figure.savefig(args.out, dpi=110)
    except OSError as exc:
        print(f"error: cannot write {args.out}: {exc.strerror}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}; following {stats.candidate}")
    for f in stats.whatif:
        print(
            f"  {f.candidate:9s} {f.capacity_factor:g}x: hit {f.hit_ratio:.4f}, "
            f"writes {f.writes_per_ref:.3f}, sampled 1 in {round(1 / f.sampling_rate)}"
        )
    for name, runs in full.items():
        cells = ", ".join(
            f"{f:g}x {r.total_hit_ratio:.4f}" for f, r in zip(FACTORS, runs, strict=True)
        )
        print(f"  full runs {name}: {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
