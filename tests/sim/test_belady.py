"""The Belady bound: next uses, a hand-checked case, and never below LRU."""

from __future__ import annotations

import heapq
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload import block_id_key
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import OffloadKey
from kvoffload.sim.belady import BeladyResult, belady_bound, next_uses
from kvoffload.sim.engine import EngineConfig, ServingEngine
from kvoffload.sim.generators import generate
from kvoffload.sim.gpu_cache import GPUPrefixCache
from kvoffload.sim.run import SimConfig, simulate
from kvoffload.sim.workload import Request, Workload

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


def reference_bound(workload: Workload, gpu_blocks: int, offload_blocks: int) -> tuple[int, int]:
    """The bound the plain way: every block enters the tier, a heap of (-next use, key)."""
    gpu = GPUPrefixCache(gpu_blocks)
    uses = next_uses([r.keys for r in workload.requests])
    tier: dict[OffloadKey, int] = {}
    heap: list[tuple[int, OffloadKey]] = []
    gpu_hits = offload_hits = 0
    for index, req in enumerate(workload.requests):
        keys = req.keys
        hit = gpu.match(keys)
        slots = gpu.acquire(keys[:hit], len(keys) - hit)
        gpu_hits += hit
        found = hit
        while found < len(keys) and keys[found] in tier:
            found += 1
        offload_hits += found - hit
        for position, key in enumerate(keys):
            if key in tier or position >= found:
                tier[key] = uses[index][position]
                heapq.heappush(heap, (-uses[index][position], key))
        while len(tier) > offload_blocks:
            negative_use, key = heapq.heappop(heap)
            if tier.get(key) == -negative_use:
                del tier[key]
        gpu.register(keys[hit:], slots[hit:])
        gpu.release(slots)
    return gpu_hits, offload_hits


# Few distinct keys and a small tier: many blocks share a next use, so the tie order counts.
requests = st.lists(st.lists(st.integers(0, 15), max_size=6), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(ids=requests, gpu_blocks=st.integers(6, 8), offload_blocks=st.integers(1, 6))
def test_bound_matches_the_plain_heap_rendering(
    ids: list[list[int]], gpu_blocks: int, offload_blocks: int
) -> None:
    workload = Workload(
        "random",
        16,
        [Request(i, 16 * len(b), 1, [block_id_key(x) for x in b]) for i, b in enumerate(ids)],
    )
    expected = reference_bound(workload, gpu_blocks, offload_blocks)
    bound = belady_bound(workload.requests, gpu_blocks, offload_blocks)
    assert (bound.gpu_hit_blocks, bound.offload_hit_blocks) == expected
    known = ServingEngine(EngineConfig(gpu_blocks, 1, 16), None).run(workload.requests)
    assert known.gpu_hit_blocks == expected[0]


def test_bound_from_known_gpu_hits_is_the_same(mixed: Workload) -> None:
    engine = ServingEngine(EngineConfig(2000, 1, 16), None)
    engine.run(mixed.requests)
    bound = belady_bound(mixed.requests, 2000, 6000)
    reused = belady_bound(mixed.requests, 2000, 6000, gpu_hits=engine.gpu_hits_by_start)
    assert bound == reused
    assert bound == BeladyResult(mixed.num_refs, *reference_bound(mixed, 2000, 6000))
    with pytest.raises(InvalidArgumentError, match="3 GPU hit counts for 400 requests"):
        belady_bound(mixed.requests, 2000, 6000, gpu_hits=[0, 0, 0])
