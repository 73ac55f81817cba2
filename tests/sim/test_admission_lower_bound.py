"""The lower-bound construction of ``benchmarks/admission_lower_bound.py``: the baselines tie
until the branch and each wins one continuation by a tier-full, so a rule whose tier holds
the same blocks at the branch in both runs misses half a tier-full in one of them, which a
rule with no more hits than the baselines before the branch cannot make up."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from benchmark_scripts import load_benchmark

from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import PrepareStoreOutput
from kvoffload.managers import build_manager
from kvoffload.managers.cpu import CPUOffloadingManager
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


class _FillOnce(CPUOffloadingManager):
    """An online rule no baseline follows: store while the tier has room, never evict."""

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        new = [key for key in dict.fromkeys(keys) if not self.holds(key)]
        return super().prepare_store(new[: self.num_free_blocks])


def test_a_rule_that_beats_the_baselines_before_the_branch_need_not_lose() -> None:
    """The construction binds a rule that makes no more hits than the baselines before the
    branch (one following either baseline's world, as the optimiser does): a rule that
    keeps P from its first sighting hits it twice there, and so ends level with
    store-everything in A and a tier-full ahead of the filter in B. That every online
    rule can be made to lose is not what these two runs show."""
    margins = []
    for requests in bound.workloads(CAPACITY).values():
        better = max(bound.hit_ratio(requests, CAPACITY, c) for c in ({}, {"store_threshold": 2}))
        engine = ServingEngine(EngineConfig(1, 1, bound.BLOCK_TOKENS), _FillOnce(CAPACITY))
        stats = engine.run(requests)
        margins.append((stats.gpu_hit_blocks + stats.offload_hit_blocks) / stats.refs - better)
    assert margins == pytest.approx([0.0, 1 / 9])
