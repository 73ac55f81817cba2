"""Manager hot-path benchmark: replay the Mooncake trace through GPU cache + CPU tier.

For each request, in the order vLLM's connector uses: ``touch`` of all keys,
``lookup`` past the GPU prefix hit, ``prepare_load`` and ``complete_load`` of
the offload hit, ``prepare_store`` of the computed blocks and, when anything
is stored, ``touch`` of all keys again and an immediate ``complete_store``.
Only the manager calls are timed. Standard library only (plus kvoffload itself).

Each configuration also runs through ``seed_literal.py``, an unoptimised
rendering of the seed-era managers, in the same process, so the speed-up is a
ratio measured under the same machine load.

    python benchmarks/manager.py [--trace PATH] [--repeat N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import OrderedDict
from pathlib import Path

from kvoffload import OffloadingManager, OffloadKey, block_id_key, build_manager
from seed_literal import build_seed_manager

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1]
    / ".."
    / "shared"
    / "data"
    / "traces"
    / "mooncake_synthetic_trace.jsonl"
)
GPU_BLOCKS = 878
CPU_BLOCKS = 4392
CONFIGS = [("lru", 1), ("lru", 2), ("arc", 1), ("arc", 2)]


def load_requests(path: Path) -> list[list[OffloadKey]]:
    requests = []
    with path.open() as lines:
        for line in lines:
            ids = json.loads(line)["hash_ids"]
            requests.append([block_id_key(i) for i in ids])
    return requests


def replay(requests: list[list[OffloadKey]], manager: OffloadingManager) -> dict[str, float]:
    gpu: OrderedDict[OffloadKey, None] = OrderedDict()
    refs = gpu_hits = offload_hits = writes = 0
    manager_ns = 0
    clock = time.perf_counter_ns
    for keys in requests:
        refs += len(keys)
        gpu_hit = 0
        for key in keys:
            if key not in gpu:
                break
            gpu_hit += 1
        rest = keys[gpu_hit:]

        start = clock()
        manager.touch(keys)
        hit = manager.lookup(rest) or 0
        if hit:
            manager.prepare_load(rest[:hit])
            manager.complete_load(rest[:hit])
        out = manager.prepare_store(rest[hit:])
        if out is not None and out.keys_to_store:
            manager.touch(keys)
            manager.complete_store(out.keys_to_store)
            writes += len(out.keys_to_store)
        manager_ns += clock() - start

        gpu_hits += gpu_hit
        offload_hits += hit
        for key in reversed(keys):  # tail released first: the head ends up most recent
            gpu[key] = None
            gpu.move_to_end(key)
        while len(gpu) > GPU_BLOCKS:
            gpu.popitem(last=False)
    return {
        "total_hit_ratio": (gpu_hits + offload_hits) / refs,
        "offload_hit_ratio": offload_hits / refs,
        "writes_per_ref": writes / refs,
        "us_per_ref": manager_ns / 1000 / refs,
        "refs": refs,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--repeat", type=int, default=3, help="runs per config; the fastest counts")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if not args.trace.exists():
        print(f"trace not found: {args.trace} (pass --trace)", file=sys.stderr)
        return 1
    requests = load_requests(args.trace)
    results = {}
    print(
        f"{'policy':<6} {'thr':>3} {'total hit':>9} {'writes/ref':>10} {'us/ref':>7} "
        f"{'seed us/ref':>11} {'speed-up':>8}"
    )
    for policy, threshold in CONFIGS:
        ours, seed = [], []
        for _ in range(args.repeat):
            ours.append(
                replay(requests, build_manager(CPU_BLOCKS, policy, store_threshold=threshold))
            )
            seed.append(replay(requests, build_seed_manager(CPU_BLOCKS, policy, threshold)))
        best = min(ours, key=lambda r: r["us_per_ref"])
        best_seed = min(seed, key=lambda r: r["us_per_ref"])
        best["seed_us_per_ref"] = best_seed["us_per_ref"]
        best["seed_total_hit_ratio"] = best_seed["total_hit_ratio"]
        best["speedup"] = best_seed["us_per_ref"] / best["us_per_ref"]
        results[f"{policy}-t{threshold}"] = best
        print(
            f"{policy:<6} {threshold:>3} {best['total_hit_ratio']:>9.3f} "
            f"{best['writes_per_ref']:>10.3f} {best['us_per_ref']:>7.2f} "
            f"{best['seed_us_per_ref']:>11.2f} {best['speedup']:>7.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
