"""Our spec's manager against vLLM 0.33's own CPUOffloadingManager, through vLLM's per-key API.

Replays the Mooncake trace one request after another with
``kvoffload.integrations.vllm.replay`` (the driver the tests use) and prints,
per policy and store threshold, hit ratio and writes per block reference for
both managers, and the microseconds per block reference each spent, measured
in the same process (best of ``--repeat``), so the speed ratio holds under the
machine's load. ``--admission NAME`` puts that admission layer in front of
our tier only (vLLM has none), to show what it saves against vLLM's manager.
Needs vLLM installed (see the README's set-up).

    python benchmarks/vllm_replay.py [--trace PATH] [--blocks N] [--repeat N] [--json PATH]
        [--admission NAME]
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2] / "shared/data/traces/mooncake_synthetic_trace.jsonl"
)
CONFIGS = [("lru", 0), ("lru", 2), ("arc", 0), ("arc", 2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--blocks", type=int, default=4392, help="tier size (default: 4392)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--admission", default="none", help="our admission layer (default: none)")
    args = parser.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        from kvoffload.integrations.vllm.adapter import VLLMManagerAdapter
        from kvoffload.integrations.vllm.offer_filter import OfferCountFilter
        from kvoffload.integrations.vllm.replay import replay
        from kvoffload.managers import StackConfig, build_cpu_stack
        from kvoffload.sim.traces import read_trace

    workload = read_trace(args.trace)
    n = args.blocks

    def ours(policy: str, threshold: int) -> Any:
        def build() -> Any:
            return build_cpu_stack(StackConfig(n, policy, admission=args.admission))

        return VLLMManagerAdapter(build, OfferCountFilter(threshold) if threshold >= 2 else None)

    def theirs(policy: str, threshold: int) -> Any:
        return CPUOffloadingManager(n, policy, store_threshold=threshold)

    def best(make: Callable[[], Any]) -> tuple[Any, float]:
        runs = []
        for _ in range(args.repeat):
            manager = make()
            started = time.perf_counter()
            result = replay(manager, workload.requests, workload.block_tokens)
            runs.append((time.perf_counter() - started, result))
        seconds, result = min(runs, key=lambda run: run[0])
        return result, seconds * 1e6 / result.refs

    rows = []
    print(
        "policy thr  hit vLLM  hit ours  wr/ref vLLM  wr/ref ours  "
        "us/ref vLLM  us/ref ours  speed-up"
    )
    for policy, threshold in CONFIGS:
        v, v_us = best(lambda: theirs(policy, threshold))  # noqa: B023 - called at once
        o, o_us = best(lambda: ours(policy, threshold))  # noqa: B023
        rows.append(
            {
                "policy": policy,
                "store_threshold": threshold,
                "ours_admission": args.admission,
                "vllm_hit_ratio": v.hit_ratio,
                "ours_hit_ratio": o.hit_ratio,
                "vllm_writes_per_ref": v.writes_per_ref,
                "ours_writes_per_ref": o.writes_per_ref,
                "vllm_us_per_ref": v_us,
                "ours_us_per_ref": o_us,
            }
        )
        print(
            f"{policy:<6} {threshold:>3}  {v.hit_ratio:8.4f}  {o.hit_ratio:8.4f}  "
            f"{v.writes_per_ref:11.4f}  {o.writes_per_ref:11.4f}  {v_us:11.2f}  {o_us:11.2f}  "
            f"{v_us / o_us:7.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
