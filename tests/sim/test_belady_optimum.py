"""The Belady bound against the offline optimum, found by trying every tier a run could keep.

A sequential run's tier, after each request, holds some of the blocks it held and of the
blocks the request computed, at most its capacity; a tier hit counts only in the leading run
past the GPU hit. Trying every such choice gives the most any admission and eviction could
hit: no registered rule may pass it, and the bound (furthest-next-use, one such schedule)
never does either. The bound is not that optimum: under the prefix rule, furthest-next-use
can drop a parent whose child it then keeps for nothing (docs/simulate.md, The Belady bound).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import cache

from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload import block_id_key
from kvoffload.admission import available_admissions, resolve_admission
from kvoffload.core.keys import OffloadKey
from kvoffload.policies import available_policies, resolve_policy
from kvoffload.sim.belady import belady_bound, gpu_prefix_hits
from kvoffload.sim.run import SimConfig, simulate
from kvoffload.sim.workload import Request, Workload, cacheable_keys, max_gpu_hit

POLICIES = sorted({resolve_policy(name) for name in available_policies()})
ADMISSIONS = sorted({resolve_admission(name) for name in available_admissions()})


def optimum_offload_hits(
    requests: Sequence[Sequence[OffloadKey]], gpu_hits: Sequence[int], capacity: int
) -> int:
    """The most tier hits of any choice of what the tier keeps after each request.

    A tier that keeps more never hits less (its leading runs only grow, and what it may keep
    next only widens), so each choice keeps as many blocks as fit, of those a later request
    could still take from the tier.
    """
    wanted_after = [
        {
            key
            for later, hit in zip(requests[index + 1 :], gpu_hits[index + 1 :], strict=True)
            for key in later[hit:]
        }
        for index in range(len(requests))
    ]

    @cache
    def best(index: int, tier: frozenset[OffloadKey]) -> int:
        if index == len(requests):
            return 0
        keys, hit = requests[index], gpu_hits[index]
        found = hit
        while found < len(keys) and keys[found] in tier:
            found += 1
        keepable = sorted((tier | set(keys[found:])) & wanted_after[index])
        size = min(capacity, len(keepable))
        return (found - hit) + max(
            best(index + 1, frozenset(kept)) for kept in itertools.combinations(keepable, size)
        )

    return best(0, frozenset())


def sequential_gpu_hits(
    workload: Workload, drop_partial: bool, gpu_blocks: int
) -> tuple[list[list[OffloadKey]], list[int]]:
    """Each request's cacheable keys and GPU prefix hit in a sequential replay."""
    block_tokens = workload.block_tokens
    cacheable = [cacheable_keys(req, block_tokens, drop_partial) for req in workload.requests]
    most = [max_gpu_hit(req, block_tokens, drop_partial) for req in workload.requests]
    return cacheable, gpu_prefix_hits(workload.requests, cacheable, gpu_blocks, most)


@st.composite
def small_tree_workloads(draw: st.DrawFn) -> Workload:
    """A few requests walking a binary prefix tree (a key names its whole prefix), some with
    a partial last block: few enough for the optimum to try every choice."""
    ids: dict[tuple[int, ...], int] = {}
    requests = []
    for index in range(draw(st.integers(1, 8))):
        path = tuple(draw(st.lists(st.integers(0, 1), min_size=1, max_size=4)))
        keys = [block_id_key(ids.setdefault(path[:depth], len(ids))) for depth in range(1, 5)]
        keys = keys[: len(path)]
        tokens = 16 * len(keys) - draw(st.integers(0, 15))
        requests.append(Request(float(index), tokens, 1, keys))
    return Workload("small tree", 16, requests)


@settings(max_examples=400, deadline=None)
@given(
    workload=small_tree_workloads(),
    policy=st.sampled_from(POLICIES),
    admission=st.sampled_from(ADMISSIONS),
    spare_gpu=st.integers(0, 2),
    offload_blocks=st.integers(1, 3),
    partial_block=st.sampled_from(["cache", "drop"]),
)
def test_no_rule_and_no_bound_passes_the_optimum(
    workload: Workload,
    policy: str,
    admission: str,
    spare_gpu: int,
    offload_blocks: int,
    partial_block: str,
) -> None:
    gpu_blocks = max(len(req.keys) for req in workload.requests) + spare_gpu
    config = SimConfig(
        gpu_blocks,
        offload_blocks,
        policy=policy,
        admission=admission,
        partial_block=partial_block,
        layout="tiny",
    )
    report = simulate(workload, config)
    drop = partial_block == "drop"
    cacheable, gpu_hits = sequential_gpu_hits(workload, drop, gpu_blocks)
    assert sum(gpu_hits) == report.gpu_hit_blocks  # the optimum starts from the run's GPU hits
    optimum = optimum_offload_hits(cacheable, gpu_hits, offload_blocks)
    assert report.offload_hit_blocks <= optimum
    bound = belady_bound(workload.requests, gpu_blocks, offload_blocks, 16 if drop else None)
    assert bound.offload_hit_blocks <= optimum
    assert report.offload_hit_blocks <= bound.offload_hit_blocks


def test_the_bound_is_below_the_optimum_under_the_prefix_rule() -> None:
    """GPU 3 blocks, tier 2. After [2, 3, 4] the tier holds 0 (next needed by [0]), 1 (by
    [0, 1, 6], past its GPU hit 0) and 2 (by the last [2, 5]): furthest-next-use drops 2, and
    later keeps 5 for the last request, where 5 needs 2 before it. Keeping 2 instead loses 1's
    hit and wins 2 and 5 there: 3 hits, not 2. No registered rule finds that schedule."""
    ids = [[0, 1], [2, 3, 4], [0], [2, 5], [0, 1, 6], [2, 5]]
    requests = [
        Request(float(i), 16 * len(b), 1, [block_id_key(x) for x in b]) for i, b in enumerate(ids)
    ]
    workload = Workload("fnu below the optimum", 16, requests)
    cacheable, gpu_hits = sequential_gpu_hits(workload, False, 3)
    assert gpu_hits == [0, 0, 0, 1, 1, 0]
    assert optimum_offload_hits(cacheable, gpu_hits, 2) == 3
    assert belady_bound(requests, 3, 2).offload_hit_blocks == 2
    best = max(
        simulate(workload, SimConfig(3, 2, policy=p, admission=a, layout="tiny")).offload_hit_blocks
        for p in POLICIES
        for a in ADMISSIONS
    )
    assert best <= 2
