"""Replay speed: block references per second for the default mix and the Mooncake trace.

Run with ``python benchmarks/sim_replay.py [--repeat N]``; the Mooncake case
is skipped when ``../shared/data/traces/mooncake_synthetic_trace.jsonl`` (or
``$KVOFFLOAD_SHARED/data/traces/...``) is absent. Each case is timed in three
parts (best of ``--repeat``, in CPU seconds: the machine may be shared): the
replay without the bound, the manager's share of it, and the Belady bound.
"engine" is the replay less the manager: the engine model's own cost. To
compare two versions in one session, run this script twice, once with
``PYTHONPATH`` pointing at the other version's ``src``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

from kvoffload.sim import SimConfig, WorkloadSource, belady_bound, blocks_for_gib, simulate

TRACE = "mooncake_synthetic_trace.jsonl"


def _trace_path() -> Path:
    shared = os.environ.get("KVOFFLOAD_SHARED")
    root = Path(shared) if shared else Path(__file__).resolve().parents[1] / ".." / "shared"
    return root / "data" / "traces" / TRACE


def _measure(name: str, source: WorkloadSource, config: SimConfig, repeat: int) -> None:
    workload = source.load()
    replay = manager = bound = float("inf")
    for _ in range(repeat):
        started = time.process_time()
        report = simulate(workload, dataclasses.replace(config, bound=False))
        replay = min(replay, time.process_time() - started)
        manager = min(manager, report.manager_us_per_block * report.refs / 1e6)
        started = time.process_time()
        belady_bound(workload.requests, config.gpu_blocks, config.cpu_blocks)
        bound = min(bound, time.process_time() - started)
    engine = replay - manager
    total = replay + bound
    print(
        f"{name:<30} replay {replay:5.2f} s (manager {manager:4.2f}, engine {engine:4.2f})  "
        f"bound {bound:5.2f} s  engine+bound {engine + bound:5.2f} s  "
        f"{report.refs / total:>9,.0f} refs/s with bound  hit {report.total_hit_ratio:.4f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3, help="best of N (default: 3)")
    repeat = parser.parse_args().repeat
    mix = WorkloadSource()
    gpu = blocks_for_gib(24, "llama-3.1-8b", 16)
    cpu = blocks_for_gib(96, "llama-3.1-8b", 16)
    for policy in ("lru", "arc"):
        _measure(f"default mix, {policy}", mix, SimConfig(gpu, cpu, policy=policy), repeat)
    trace = _trace_path()
    if not trace.is_file():
        print(f"skipping the Mooncake trace: {trace} not found")
        return
    for policy in ("lru", "arc"):
        for threshold in (1, 2):
            config = SimConfig(878, 4392, policy=policy, store_threshold=threshold)
            _measure(
                f"mooncake, {policy}, threshold {threshold}",
                WorkloadSource(str(trace)),
                config,
                repeat,
            )


if __name__ == "__main__":
    main()
