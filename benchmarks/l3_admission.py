"""What admission into SGLang's L3 saves: pages written to disk or the server, hit ratio kept.

SGLang's HiCache is GPU -> host -> L3, and it backs every page up to L3 as
it enters the host tier. This replays the admission table's workloads
(benchmarks/admission_table.py) through that shape: a GPU prefix cache of
2% of the workload's unique blocks (or the largest request), a host tier of
``--host-share`` of them, both LRU, and under them the L3 of each of
``--shares``, through the SGLang backend's own tier path
(``kvoffload.integrations.sglang.paths.TierPath``: its admission layer sees
the lookups that reach L3 and the host tier's write-backs, as in SGLang),
over an LRU tier that keeps only keys. Per request: the GPU's leading run,
then the host's, then L3's (its pages are loaded into the host); the pages
the host did not hold before are offered to L3, the new ones admitted or not.
Rows compare ``none`` (SGLang's behaviour: every page written) with
``recommended``: L3 writes per block reference and their ratio, the total
and L3 hit ratios, and the hit ratio kept.

    python benchmarks/l3_admission.py [--jobs 2] [--shares 0.1,0.25] [--host-share 0.05]
                                      [--plot docs/img/l3_admission.png] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from admission_table import GPU_SHARE, TRACE, WORKLOADS, positive_int, unique_blocks
from kvoffload.core.keys import OffloadKey
from kvoffload.integrations.sglang.paths import L3_SPEC, TierPath
from kvoffload.managers.admit_all import admission_book
from kvoffload.sim.workload import Workload

ADMISSIONS = ("none", "recommended")


@dataclass
class KeyStats:
    """The counts a :class:`TierPath` reads from its tier."""

    stored_blocks: int = 0
    evicted: int = 0
    corrupt: int = 0
    rejected: int = 0


@dataclass
class KeyTier:
    """An LRU tier of ``capacity`` pages that keeps keys only (the model of a disk or server)."""

    capacity: int
    pages: OrderedDict[OffloadKey, None] = field(default_factory=OrderedDict)
    stats: KeyStats = field(default_factory=KeyStats)

    def present(self, keys: Sequence[OffloadKey]) -> int:
        run = 0
        for key in keys:
            if key not in self.pages:
                break
            run += 1
        return run

    def held(self, keys: Sequence[OffloadKey]) -> list[bool]:
        return [key in self.pages for key in keys]

    def read(self, keys: Sequence[OffloadKey], target: Any) -> Future[list[bool]]:
        for key in keys:
            self.pages.move_to_end(key)
        done: Future[list[bool]] = Future()
        done.set_result([True] * len(keys))
        return done

    def write(self, keys: Sequence[OffloadKey], payloads: Sequence[Any]) -> None:
        for key in keys:
            if key in self.pages:
                self.pages.move_to_end(key)
                continue
            self.pages[key] = None
            self.stats.stored_blocks += 1
            if len(self.pages) > self.capacity:
                self.pages.popitem(last=False)
                self.stats.evicted += 1

    def poll(self, wait: bool) -> None:
        return None

    def wait_written(self) -> None:
        return None

    def has_pending_work(self) -> bool:
        return False

    def take_events(self) -> list[Any]:
        return []

    def close(self) -> None:
        return None


class Lru:
    """The GPU or host tier: ``capacity`` pages, least recently used out first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.pages: OrderedDict[OffloadKey, None] = OrderedDict()

    def run(self, keys: Sequence[OffloadKey]) -> int:
        n = 0
        for key in keys:
            if key not in self.pages:
                break
            n += 1
        return n

    def put(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """Insert or touch ``keys``; the ones that were not held before."""
        new = []
        for key in keys:
            if key in self.pages:
                self.pages.move_to_end(key)
            else:
                new.append(key)
                self.pages[key] = None
        while len(self.pages) > self.capacity:
            self.pages.popitem(last=False)
        return new


def replay(workload: Workload, gpu: int, host: int, l3: int, admission: str) -> dict[str, float]:
    """One replay of ``workload`` through GPU -> host -> L3 (``admission`` into L3)."""
    tier = KeyTier(l3)
    path = TierPath("l3", lambda: tier, admission_book(admission, L3_SPEC, l3), page_bytes=1)
    gpu_cache, host_cache = Lru(gpu), Lru(host)
    refs = gpu_hits = host_hits = l3_hits = l3_lookups = 0
    for request in workload.requests:
        keys = request.keys
        if not keys:
            continue
        refs += len(keys)
        g = gpu_cache.run(keys)
        h = host_cache.run(keys[g:])
        rest = keys[g + h :]
        found = 0
        if rest:
            l3_lookups += len(rest)
            found = path.present(rest)
            path.sighted(keys, found > 0, held=g + h)
            if found:
                path.read(rest[:found], lambda i: memoryview(b""))
        gpu_hits, host_hits, l3_hits = gpu_hits + g, host_hits + h, l3_hits + found
        new = host_cache.put(keys[g:])  # host hits touched, L3 loads and computed pages added
        loaded = set(rest[:found])
        offered = [key for key in new if key not in loaded]
        if offered:
            path.write(offered, [b""] * len(offered))
        gpu_cache.put(keys)
    counters = path.counters()
    return {
        "total hit": (gpu_hits + host_hits + l3_hits) / refs,
        "l3 hit": l3_hits / l3_lookups if l3_lookups else 0.0,
        "l3 writes": counters.stores_completed / refs,
        "offers": counters.stores_offered / refs,
    }


def run_row(name: str, share: float, host_share: float) -> dict[str, Any]:
    workload = WORKLOADS[name].load()
    unique = unique_blocks(workload)
    gpu = max(int(GPU_SHARE * unique), max(len(r.keys) for r in workload.requests))
    host, l3 = max(1, int(host_share * unique)), max(1, int(share * unique))
    row: dict[str, Any] = {"workload": name, "share": share, "l3_blocks": l3, "host_blocks": host}
    for admission in ADMISSIONS:
        for figure, value in replay(workload, gpu, host, l3, admission).items():
            row[f"{admission} {figure}"] = value
    none_writes = row["none l3 writes"]
    row["writes ratio"] = row["recommended l3 writes"] / none_writes if none_writes else 0.0
    row["hit kept"] = row["recommended total hit"] - row["none total hit"]
    return row


def plot(rows: list[dict[str, Any]], path: Path, host_share: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shares = sorted({float(r["share"]) for r in rows})
    names = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(shares)
    for i, share in enumerate(shares):
        picked = {r["workload"]: r for r in rows if float(r["share"]) == share}
        xs = [j + (i - (len(shares) - 1) / 2) * width for j in range(len(names))]
        axes[0].bar(xs, [picked[n]["writes ratio"] for n in names], width, label=f"L3 {share:.0%}")
        axes[1].bar(xs, [picked[n]["hit kept"] for n in names], width, label=f"L3 {share:.0%}")
    axes[0].axhline(1.0, color="grey", linewidth=0.8)
    axes[0].set_ylabel("L3 writes, recommended / none")
    axes[1].axhline(0.0, color="grey", linewidth=0.8)
    axes[1].set_ylabel("total hit ratio, recommended - none")
    for ax in axes:
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.legend()
    fig.suptitle(
        f"Admission into SGLang's L3 (GPU {GPU_SHARE:.0%}, host {host_share:.0%} of unique "
        "blocks; LRU)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--jobs", type=positive_int, default=2)
    parser.add_argument("--shares", default="0.1,0.25", help="L3 capacity shares of unique blocks")
    parser.add_argument("--host-share", type=float, default=0.05, help="host tier share")
    parser.add_argument("--plot", type=Path, help="write the figure here (PNG)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    try:
        shares = [float(s) for s in args.shares.split(",")]
    except ValueError:
        parser.error(f"--shares takes comma-separated numbers, got {args.shares!r}")
    if not all(0 < s <= 1 for s in [*shares, args.host_share]):
        parser.error("capacity shares must lie in (0, 1]")
    names = [n for n in WORKLOADS if n != "mooncake" or TRACE.is_file()]
    if "mooncake" not in names:
        print(f"note: {TRACE} not found, Mooncake rows skipped", file=sys.stderr)
    tasks = [(n, s, args.host_share) for n in names for s in shares]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(run_row, *zip(*tasks, strict=True)))
    print(
        "| workload | L3 | none: hit / L3 hit / L3 writes | recommended: hit / L3 hit / "
        "L3 writes | L3 writes | hit kept |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        cells = [
            " / ".join(f"{r[f'{a} {f}']:.3f}" for f in ("total hit", "l3 hit", "l3 writes"))
            for a in ADMISSIONS
        ]
        print(
            f"| {r['workload']} | {float(r['share']):.0%} ({int(r['l3_blocks']):,}) "
            f"| {cells[0]} | {cells[1]} | {r['writes ratio']:.2f}x | {r['hit kept']:+.3f} |"
        )
    if args.plot:
        plot(rows, args.plot, args.host_share)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
