"""Replay speed: block references per second for the default mix and the Mooncake trace.

Run with ``python benchmarks/sim_replay.py [--repeat N]``; the Mooncake case
is skipped when ``../shared/data/traces/mooncake_synthetic_trace.jsonl`` (or
``$KVOFFLOAD_SHARED/data/traces/...``) is absent. Each case is one whole
``simulate`` run with its Belady bound, as ``kvoffload simulate`` runs it,
best of ``--repeat`` in wall seconds (on a shared machine, raise it); "engine
model" is a run less the manager's own time (the GPU prefix cache, the event
loop, the accounting and the bound), best of ``--repeat`` too. To
compare two versions in one session, run this script twice, once with
``PYTHONPATH`` pointing at the other version's ``src``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kvoffload.sim import SimConfig, WorkloadSource, blocks_for_gib, simulate

TRACE = "mooncake_synthetic_trace.jsonl"


def _trace_path() -> Path:
    shared = os.environ.get("KVOFFLOAD_SHARED")
    root = Path(shared) if shared else Path(__file__).resolve().parents[1] / ".." / "shared"
    return root / "data" / "traces" / TRACE


def _measure(name: str, source: WorkloadSource, config: SimConfig, repeat: int) -> None:
    workload = source.load()
    run = engine = float("inf")
    for _ in range(repeat):
        report = simulate(workload, config)
        manager = report.manager_us_per_block * report.refs / 1e6
        run = min(run, report.wall_seconds)
        engine = min(engine, report.wall_seconds - manager)
    print(
        f"{name:<30} run {run:5.2f} s  engine model {engine:4.2f} s  "
        f"{report.refs / run:>9,.0f} refs/s  {report.refs / engine:>9,.0f} refs/s (engine)  "
        f"hit {report.total_hit_ratio:.4f} (Belady {report.belady_total_hit_ratio:.4f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--repeat", type=int, default=5, help="best of N (default: 5)")
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
