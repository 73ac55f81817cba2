"""The lower-bound construction of ``benchmarks/admission_lower_bound.py``: the baselines tie
until the branch and each wins one continuation by a tier-full, so a rule whose tier holds
the same blocks at the branch in both runs misses half a tier-full in one of them."""

from __future__ import annotations

from benchmark_scripts import load_benchmark

from kvoffload.managers import build_manager
from kvoffload.sim.engine import EngineConfig, ServingEngine

bound = load_benchmark("admission_lower_bound")
CAPACITY = 40


def _hits(requests: list, threshold: int) -> list[int]:
    """The tier's cumulative hits after each request."""
    manager = build_manager(CAPACITY, "lru", store_threshold=threshold)
    engine = ServingEngine(EngineConfig(1, 1, bound.BLOCK_TOKENS), manager)
    hits = []
    for request in requests:
        hits.append(engine.run([request]).offload_hit_blocks)
    return hits


def test_the_baselines_tie_at_the_branch_and_each_wins_one_continuation() -> None:
    (name_a, run_a), (name_b, run_b) = bound.workloads(CAPACITY).items()
    branch = 9 * CAPACITY - CAPACITY
    assert len(run_a) == len(run_b) == 9 * CAPACITY
    assert [r.keys for r in run_a[:branch]] == [r.keys for r in run_b[:branch]]
    everything_a, filtered_a = _hits(run_a, 0), _hits(run_a, 2)
    everything_b, filtered_b = _hits(run_b, 0), _hits(run_b, 2)
    assert everything_a[branch - 1] == filtered_a[branch - 1] == CAPACITY
    assert everything_a[-1] - filtered_a[-1] == CAPACITY  # A: store-everything's blocks
    assert filtered_b[-1] - everything_b[-1] == CAPACITY  # B: the filter's blocks
    assert "one-shot" in name_a and "popular" in name_b


def test_the_recommended_rule_misses_a_tier_full_in_one_continuation() -> None:
    margins = []
    for requests in bound.workloads(CAPACITY).values():
        better = max(bound.hit_ratio(requests, CAPACITY, c) for c in ({}, {"store_threshold": 2}))
        ours = bound.hit_ratio(requests, CAPACITY, {"admission": "recommended"})
        margins.append(ours - better)
    assert min(margins) <= -1 / 18 + 1e-9  # at least half a tier-full of 9: the bound
    assert max(margins) >= -1e-9
