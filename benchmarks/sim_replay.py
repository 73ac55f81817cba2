"""Replay speed: block references per second for the default mix and the Mooncake trace.

Run with ``python benchmarks/sim_replay.py``; the Mooncake case is skipped
when ``../shared/data/traces/mooncake_synthetic_trace.jsonl`` (or
``$KVOFFLOAD_SHARED/data/traces/...``) is absent.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from kvoffload.sim import SimConfig, WorkloadSource, blocks_for_gib, simulate

TRACE = "mooncake_synthetic_trace.jsonl"


def _trace_path() -> Path:
    shared = os.environ.get("KVOFFLOAD_SHARED")
    root = Path(shared) if shared else Path(__file__).resolve().parents[1] / ".." / "shared"
    return root / "data" / "traces" / TRACE


def _measure(name: str, source: WorkloadSource, config: SimConfig) -> None:
    started = time.perf_counter()
    workload = source.load()
    loaded = time.perf_counter() - started
    report = simulate(workload, config)
    print(
        f"{name:<40} load {loaded:5.2f} s  replay+bound {report.wall_seconds:5.2f} s  "
        f"{report.refs:>9,} refs  {report.refs_per_second:>9,.0f} refs/s  "
        f"hit {report.total_hit_ratio:.3f} (Belady {report.belady_total_hit_ratio:.3f})"
    )


def main() -> None:
    mix = WorkloadSource()
    gpu = blocks_for_gib(24, "llama-3.1-8b", 16)
    cpu = blocks_for_gib(96, "llama-3.1-8b", 16)
    for policy in ("lru", "arc"):
        _measure(f"default mix, {policy}", mix, SimConfig(gpu, cpu, policy=policy))
    trace = _trace_path()
    if not trace.is_file():
        print(f"skipping the Mooncake trace: {trace} not found")
        return
    for policy in ("lru", "arc"):
        for threshold in (1, 2):
            config = SimConfig(878, 4392, policy=policy, store_threshold=threshold)
            _measure(
                f"mooncake, {policy}, threshold {threshold}", WorkloadSource(str(trace)), config
            )


if __name__ == "__main__":
    main()
