"""Manager hot-path benchmark: replay the Mooncake trace through GPU cache + CPU tier.

For each request, in the order vLLM's connector uses: ``touch`` of all keys,
``lookup`` past the GPU prefix hit, ``prepare_load`` and ``complete_load`` of
the offload hit, ``prepare_store`` of the computed blocks and, when anything
is stored, ``touch`` of all keys again and an immediate ``complete_store``.
Only the manager calls are timed. Standard library only (plus kvoffload itself).
Each replay starts after a full garbage collection with no other side's manager
alive: a manager of many Python objects left alive would slow the other side's
collections and flatter the ratio.

Each configuration also runs through ``seed_literal.py``, an unoptimised
rendering of the seed-era managers (LRU and ARC only), in the same process, so
the speed-up is a ratio measured under the same machine load. When vLLM is
importable, its own 0.33 ``CPUOffloadingManager`` (per-key ``lookup``, one
``ReqContext`` per request) replays the same trace too, with the same policy
where vLLM has it and LRU otherwise; ``vs vLLM`` is our time over vLLM's
(below 1: faster), both measured in the same repeats of the same
configuration, interleaved, so that a burst of load on a shared machine hits
both sides of the ratio. Every registered policy runs with and without the seed
filter and behind the recommended admission, and LRU also behind the sketch.

With ``--max-tracker-size N`` every side's store-threshold filter tracks at
most ``N`` keys (default 64,000, which this trace never fills): a smaller
table measures the filter when it is full and drops keys, as in a long run.

    python benchmarks/manager.py [--trace PATH] [--repeat N] [--no-vllm] [--policies P,...]
        [--max-tracker-size N] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from admission_table import check_outputs, positive_int, write_rows
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
POLICIES = ["lru", "arc", "s3fifo", "sieve", "slru"]
CONFIGS = [(p, t, "none") for p in POLICIES for t in (1, 2)]
CONFIGS += [("lru", 1, "sketch"), *((p, 1, "recommended") for p in POLICIES)]
SEED_POLICIES = {"lru", "arc"}
VLLM_POLICIES = {"lru", "arc"}
TRACKER_SIZE = 64_000


def load_requests(path: Path) -> list[list[OffloadKey]]:
    requests = []
    with path.open() as lines:
        for line in lines:
            ids = json.loads(line)["hash_ids"]
            requests.append([block_id_key(i) for i in ids])
    return requests


class GPUPrefixLRU:
    """The GPU prefix cache in front of the tier: an LRU of ``GPU_BLOCKS`` keys."""

    def __init__(self) -> None:
        self._keys: OrderedDict[OffloadKey, None] = OrderedDict()

    def match(self, keys: list[OffloadKey]) -> int:
        """Length of the leading run of ``keys`` the cache holds."""
        held = self._keys
        hit = 0
        for key in keys:
            if key not in held:
                break
            hit += 1
        return hit

    def release(self, keys: list[OffloadKey]) -> None:
        """Keep a finished request's blocks; tail released first, so the head is most recent."""
        held = self._keys
        for key in reversed(keys):
            held[key] = None
            held.move_to_end(key)
        while len(held) > GPU_BLOCKS:
            held.popitem(last=False)


def replay(requests: list[list[OffloadKey]], manager: OffloadingManager) -> dict[str, float]:
    gpu = GPUPrefixLRU()
    refs = gpu_hits = offload_hits = writes = 0
    manager_ns = 0
    clock = time.perf_counter_ns
    for keys in requests:
        refs += len(keys)
        gpu_hit = gpu.match(keys)
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
        gpu.release(keys)
    return {
        "total_hit_ratio": (gpu_hits + offload_hits) / refs,
        "offload_hit_ratio": offload_hits / refs,
        "writes_per_ref": writes / refs,
        "us_per_ref": manager_ns / 1000 / refs,
        "refs": refs,
    }


def replay_vllm(requests: list[list[OffloadKey]], manager: Any) -> dict[str, float]:
    """The same replay through vLLM 0.33's per-key manager API."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    gpu = GPUPrefixLRU()
    refs = gpu_hits = offload_hits = writes = 0
    manager_ns = 0
    clock = time.perf_counter_ns
    hit_result = LookupResult.HIT
    for index, keys in enumerate(requests):
        refs += len(keys)
        gpu_hit = gpu.match(keys)
        rest = keys[gpu_hit:]
        ctx = ReqContext(req_id=str(index))

        start = clock()
        manager.on_new_request(ctx)
        manager.touch(keys, ctx)
        hit = 0
        for key in rest:
            if manager.lookup(key, ctx) != hit_result:
                break
            hit += 1
        if hit:
            manager.prepare_load(rest[:hit], ctx)
            manager.complete_load(rest[:hit], ctx)
        out = manager.prepare_store(rest[hit:], ctx)
        if out is not None and out.keys_to_store:
            manager.touch(keys, ctx)
            manager.complete_store(out.keys_to_store, ctx)
            writes += len(out.keys_to_store)
        manager.on_request_finished(ctx)
        manager_ns += clock() - start

        gpu_hits += gpu_hit
        offload_hits += hit
        gpu.release(keys)
    return {
        "total_hit_ratio": (gpu_hits + offload_hits) / refs,
        "writes_per_ref": writes / refs,
        "us_per_ref": manager_ns / 1000 / refs,
    }


def vllm_factory(max_tracker_size: int) -> Callable[[str, int], Any] | None:
    """vLLM 0.33's CPU manager constructor, or ``None`` (with a note) if vLLM is absent."""
    try:
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    except ImportError as exc:
        print(f"note: vLLM not importable ({exc}); its column is skipped", file=sys.stderr)
        return None

    def build(policy: str, threshold: int) -> Any:
        return CPUOffloadingManager(
            num_chunks=CPU_BLOCKS,
            cache_policy=policy,
            store_threshold=threshold,
            max_tracker_size=max_tracker_size,
        )

    return build


def timed(
    run: Callable[[list[list[OffloadKey]], Any], dict[str, float]],
    requests: list[list[OffloadKey]],
    manager: Any,
) -> dict[str, float]:
    """``run`` of ``manager`` after a full collection, with only that manager alive: each
    side's collections then walk its own objects, not the other's."""
    gc.collect()
    return run(requests, manager)


def fastest(runs: list[dict[str, float]]) -> dict[str, float]:
    return min(runs, key=lambda r: r["us_per_ref"])


def policy_names(text: str) -> set[str]:
    """An argparse type: comma-separated names of :data:`POLICIES` (a typo would otherwise
    leave its policy out of the table without a word)."""
    names = set(text.split(","))
    unknown = sorted(names - set(POLICIES))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown policy {unknown[0]!r}; known: {', '.join(POLICIES)}"
        )
    return names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument(
        "--repeat", type=positive_int, default=3, help="runs per config; the fastest counts"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM's own manager")
    parser.add_argument(
        "--max-tracker-size",
        type=int,
        default=TRACKER_SIZE,
        help="keys each store-threshold filter tracks (smaller: the filter runs full)",
    )
    parser.add_argument(
        "--policies",
        type=policy_names,
        default=set(POLICIES),
        help="comma-separated policies to run (default: all, with the admission rows)",
    )
    args = parser.parse_args()
    check_outputs(parser, args)
    if not args.trace.exists():
        print(f"trace not found: {args.trace} (pass --trace)", file=sys.stderr)
        return 1
    requests = load_requests(args.trace)
    if args.max_tracker_size < 1:
        print(f"--max-tracker-size must be >= 1, got {args.max_tracker_size}", file=sys.stderr)
        return 1
    tracker = args.max_tracker_size
    build_vllm = None if args.no_vllm else vllm_factory(tracker)
    results: dict[str, dict[str, float]] = {}
    vllm_runs: dict[tuple[str, int], dict[str, float]] = {}
    print(
        f"{'policy':<6} {'thr':>3} {'admission':<11} {'total hit':>9} {'writes/ref':>10} "
        f"{'us/ref':>7} {'seed us/ref':>11} {'vLLM us/ref':>11} {'vs vLLM':>7}"
    )
    for policy, threshold, admission in CONFIGS:
        if policy not in args.policies:
            continue
        ours, seed = [], []
        vllm_policy = policy if policy in VLLM_POLICIES else "lru"
        vllm: list[dict[str, float]] = []
        for _ in range(args.repeat):
            manager = build_manager(
                CPU_BLOCKS,
                policy,
                store_threshold=threshold,
                max_tracker_size=tracker,
                admission=admission,
            )
            ours.append(timed(replay, requests, manager))
            del manager  # alive, its objects would slow the next side's garbage collection
            if policy in SEED_POLICIES and admission == "none":
                seed_manager = build_seed_manager(CPU_BLOCKS, policy, threshold, tracker)
                seed.append(timed(replay, requests, seed_manager))
                del seed_manager
            if build_vllm is not None:
                vllm.append(timed(replay_vllm, requests, build_vllm(vllm_policy, threshold)))
        reference = fastest(vllm) if vllm else None
        if reference is not None:
            earlier = vllm_runs.get((vllm_policy, threshold))
            vllm_runs[(vllm_policy, threshold)] = fastest(
                [reference, *([earlier] if earlier else [])]
            )
        best = fastest(ours)
        seed_text = vllm_text = ratio_text = "-"
        if seed:
            best["seed_us_per_ref"] = fastest(seed)["us_per_ref"]
            seed_text = f"{best['seed_us_per_ref']:.2f}"
        if reference is not None:
            best["vllm_us_per_ref"] = reference["us_per_ref"]
            best["vllm_total_hit_ratio"] = reference["total_hit_ratio"]
            best["vs_vllm"] = best["us_per_ref"] / reference["us_per_ref"]
            vllm_text = f"{reference['us_per_ref']:.2f}"
            ratio_text = f"{best['vs_vllm']:.2f}x"
        results[f"{policy}-t{threshold}-{admission}"] = best
        print(
            f"{policy:<6} {threshold:>3} {admission:<11} {best['total_hit_ratio']:>9.3f} "
            f"{best['writes_per_ref']:>10.3f} {best['us_per_ref']:>7.2f} {seed_text:>11} "
            f"{vllm_text:>11} {ratio_text:>7}"
        )
    for (policy, threshold), run in vllm_runs.items():
        print(
            f"vLLM 0.33 {policy} thr {threshold}: total hit {run['total_hit_ratio']:.3f}, "
            f"writes/ref {run['writes_per_ref']:.3f}"
        )
    return write_rows(args.json, results) if args.json else 0


if __name__ == "__main__":
    sys.exit(main())
