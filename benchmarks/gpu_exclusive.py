"""The eviction half of SGLang's exclusive ``boundary_l1_l2`` policy, as vLLM's connector
could run it: the offload tier does not make blocks recent while the GPU holds them.

vLLM's connector is told of every block of a request (``touch``) and looks up from the
GPU prefix hit on, so it knows which of a request's blocks the GPU held, though not the
GPU cache's contents nor its evictions (no call reaches it when the GPU frees a block).
What it can do is leave the GPU-held prefix's tier copies where they are in the eviction
order, so that copies of blocks the GPU holds age out first. This script replays the
admission table's workloads (GPU cache 2% of unique blocks, LRU, store-everything)
through the plain tier and through :class:`GPUExclusiveTouch`, and prints total hit
ratio and writes per block reference of both.

    python benchmarks/gpu_exclusive.py [ROW ...]    # rows: workload:share, e.g. mooncake:0.1
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from admission_table import GPU_SHARE, TRACE, WORKLOADS, unique_blocks
from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import OffloadingManager, PrepareStoreOutput
from kvoffload.core.specs import LoadStoreSpec
from kvoffload.managers import build_manager
from kvoffload.sim.engine import EngineConfig, ServingEngine

ROWS = ("mooncake:0.05", "mooncake:0.1", "mooncake:0.25", "chat:0.1", "rag:0.1")


class GPUExclusiveTouch(OffloadingManager):
    """A tier whose ``touch`` makes recent only the blocks past the GPU prefix hit.

    The engine touches a request's keys before its lookup; the touch waits for the lookup,
    which starts past the GPU hit, and then touches only what the lookup covers. A request
    the GPU held whole is never looked up, and its touch is dropped at the next one. The
    touch after a store is cut at the same place.
    """

    def __init__(self, tier: OffloadingManager) -> None:
        self.tier = tier
        self._request: list[OffloadKey] = []
        self._gpu_held: int | None = None

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        keys = list(keys)
        if self._gpu_held is not None and self._request[-1:] == keys[-1:]:
            self.tier.touch(keys[self._gpu_held :])
            return
        self._request, self._gpu_held = keys, None

    def lookup(self, keys: Iterable[OffloadKey]) -> int | None:
        keys = list(keys)
        self._gpu_held = max(0, len(self._request) - len(keys))
        self.tier.touch(self._request[self._gpu_held :])
        return self.tier.lookup(keys)

    def prepare_load(self, keys: Iterable[OffloadKey]) -> LoadStoreSpec:
        return self.tier.prepare_load(keys)

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        self.tier.complete_load(keys)

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        return self.tier.prepare_store(keys)

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        self.tier.complete_store(keys, success)


def run_row(row: str) -> str:
    name, _, text = row.partition(":")
    if name not in WORKLOADS:
        raise SystemExit(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)}")
    try:
        share = float(text)
    except ValueError:
        share = math.nan
    if not 0 < share <= 1:
        raise SystemExit(f"row {row!r}: the tier share must be a number in (0, 1], got {text!r}")
    workload = WORKLOADS[name].load()
    unique = unique_blocks(workload)
    gpu = max(int(GPU_SHARE * unique), max(len(r.keys) for r in workload.requests))
    cpu = int(share * unique)
    figures = []
    for exclusive in (False, True):
        manager: OffloadingManager = build_manager(cpu, "lru")
        if exclusive:
            manager = GPUExclusiveTouch(manager)
        stats = ServingEngine(EngineConfig(gpu, 1, workload.block_tokens), manager).run(
            workload.requests
        )
        hit = (stats.gpu_hit_blocks + stats.offload_hit_blocks) / stats.refs
        figures.append(f"{hit:.4f} / {stats.stored_blocks / stats.refs:.3f}")
    return f"| {name} | {share:.0%} ({cpu:,}) | {gpu:,} | {figures[0]} | {figures[1]} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("rows", nargs="*", default=list(ROWS), help="workload:share rows")
    args = parser.parse_args()
    print("| workload | tier | GPU | plain hit / writes | GPU-exclusive touch hit / writes |")
    print("|---|---|---|---|---|")
    for row in args.rows:
        if row.startswith("mooncake") and not TRACE.is_file():
            print(f"note: {TRACE} not found, {row} skipped", file=sys.stderr)
            continue
        print(run_row(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
