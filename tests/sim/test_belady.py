"""The Belady bound: next uses, a hand-checked case, and never below LRU."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvoffload.sim.belady import belady_bound, next_uses
from kvoffload.sim.generators import generate
from kvoffload.sim.run import SimConfig, simulate
from kvoffload.sim.workload import Workload

MakeWorkload = Callable[..., Workload]


def test_next_uses(make_workload: MakeWorkload) -> None:
    workload = make_workload([1, 2], [3], [1, 4], [2])
    assert next_uses([r.keys for r in workload.requests]) == [[2, 3], [4], [4, 4], [4]]


def test_furthest_next_use_is_evicted_even_when_just_stored(make_workload: MakeWorkload) -> None:
    # One GPU block and one offload block: keeping block 1 (used again at request 3)
    # beats keeping 2 (request 4) or 3 (never); LRU keeps the latest and hits nothing.
    workload = make_workload([1], [2], [3], [1], [2])
    bound = belady_bound(workload.requests, gpu_blocks=1, offload_blocks=1)
    assert (bound.gpu_hit_blocks, bound.offload_hit_blocks) == (0, 1)
    lru = simulate(workload, SimConfig(gpu_blocks=1, cpu_blocks=1))
    assert lru.offload_hit_blocks == 0
    assert lru.belady_offload_hit_ratio == pytest.approx(1 / 5)


def test_without_a_tier_the_bound_is_the_gpu_cache(make_workload: MakeWorkload) -> None:
    workload = make_workload([1, 2], [1, 2, 3], [1, 2])
    bound = belady_bound(workload.requests, gpu_blocks=3, offload_blocks=0)
    assert (bound.refs, bound.gpu_hit_blocks, bound.offload_hit_blocks) == (7, 4, 0)


@pytest.fixture(scope="module")
def mixed() -> Workload:
    return generate(num_requests=400, seed=2)


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("cpu_blocks", [2000, 8000, 30000])
def test_bound_never_below_the_policy(mixed: Workload, policy: str, cpu_blocks: int) -> None:
    report = simulate(mixed, SimConfig(gpu_blocks=2000, cpu_blocks=cpu_blocks, policy=policy))
    assert report.belady_total_hit_ratio is not None
    assert report.belady_offload_hit_ratio is not None
    assert report.total_hit_ratio <= report.belady_total_hit_ratio
    assert report.offload_hit_ratio <= report.belady_offload_hit_ratio
