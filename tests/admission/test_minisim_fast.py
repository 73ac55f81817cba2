"""The mini-simulation's fast paths against their definitions: the specialised LRU and
S3-FIFO mini-tiers against the generic tier over the policy objects, the sampling against
its mask rule, and the remembered key hashes against fresh ones."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvoffload import OffloadKey, block_id_key
from kvoffload.admission import MiniSimulation, MiniTier, key_hashes
from kvoffload.admission.minisim import LRUMiniTier, S3FIFOMiniTier, mini_tier
from kvoffload.admission.optimiser import CANDIDATES, WHATIF_FACTORS
from kvoffload.admission.sketch import _hashes
from kvoffload.policies.base import CachePolicy
from kvoffload.policies.lru import LRUCachePolicy
from kvoffload.policies.s3fifo import S3FIFOCachePolicy

SPECIALISED = [(LRUCachePolicy, LRUMiniTier), (S3FIFOCachePolicy, S3FIFOMiniTier)]


@pytest.mark.parametrize("pending", [True, False])
@pytest.mark.parametrize(("policy", "fast_class"), SPECIALISED)
def test_a_specialised_mini_tier_decides_as_the_generic_one(
    policy: type[CachePolicy], fast_class: type[MiniTier], pending: bool
) -> None:
    """Seeded streams of touches, hit runs and stores (with and without gaps) over a few
    keys, so that evictions choose among touched, revived and unreachable keys; with and
    without a store's blocks pending until the next touch."""
    for seed in range(30):
        rng = random.Random(seed)
        capacity = rng.randint(1, 8)
        fast = mini_tier(capacity, policy, pending=pending)
        generic = MiniTier(capacity, policy, pending)
        assert type(fast) is fast_class
        for _ in range(300):
            keys = [block_id_key(rng.randrange(16)) for _ in range(rng.randint(0, 6))]
            action = rng.random()
            if action < 0.35:
                fast.touch(keys)
                generic.touch(keys)
            elif action < 0.55:
                assert fast.hit_run(keys) == generic.hit_run(keys)
            else:
                behind = [rng.random() < 0.3 for _ in keys] if action < 0.8 else []
                assert fast.store(keys, behind) == generic.store(keys, behind)
            assert [block_id_key(i) in fast for i in range(16)] == [
                block_id_key(i) in generic for i in range(16)
            ]
        assert (fast.hits, fast.writes) == (generic.hits, generic.writes)
        assert fast.writes > capacity  # evictions happened


def test_an_lru_store_that_touches_its_request_after_orders_as_touch_store_touch() -> None:
    """``LRUMiniTier.store(..., request=r)`` followed by one touch of ``r`` leaves the
    held keys, their order and the counts of touching ``r``, storing and touching again
    on the generic tier (the worlds' one-touch path), through evictions where too few
    keys outside the request are held."""
    for seed in range(40):
        rng = random.Random(seed)
        capacity = rng.randint(1, 10)
        fast, generic = LRUMiniTier(capacity), MiniTier(capacity, LRUCachePolicy)
        for _ in range(300):
            request = [block_id_key(rng.randrange(20)) for _ in range(rng.randint(1, 7))]
            offered = list(dict.fromkeys(k for k in request if rng.random() < 0.7))
            generic.touch(request)
            written = generic.store(offered)
            if written:
                generic.touch(request)
            assert fast.store(offered, request=request) == written
            fast.touch(request)
            order = [key for key in generic.policy.coldest() or ()]
            assert list(fast._order) == order
        assert (fast.writes, fast.total_writes) == (generic.writes, generic.total_writes)
        assert fast.writes > capacity


def drive(simulation: MiniSimulation, seed: int) -> None:
    """A seeded stream of requests sharing prefixes, looked up past a GPU hit and offered
    with each candidate admitting its own part (some all, some a prefix, some scattered)."""
    rng = random.Random(seed)
    roots = [[block_id_key(rng.randrange(10**9)) for _ in range(rng.randint(1, 6))] for _ in "abc"]
    for _ in range(400):
        keys = [*rng.choice(roots), *(block_id_key(rng.randrange(400)) for _ in range(12))]
        del keys[rng.randint(2, len(keys)) :]
        simulation.on_request(keys, key_hashes(keys))
        rest = keys[rng.randint(0, len(keys) - 1) :]
        simulation.on_lookup(rest)
        if rng.random() < 0.1:
            simulation.on_full_hit(keys[-1])
            continue
        offered = rest[rng.randint(0, len(rest) - 1) :]
        admitted: dict[str, list[OffloadKey] | None] = {CANDIDATES[0]: None}
        for name in CANDIDATES[1:]:
            admitted[name] = [key for key in offered if rng.random() < 0.7]
        simulation.on_offer(offered, admitted)


@pytest.mark.parametrize("policy", [LRUCachePolicy, S3FIFOCachePolicy])
@pytest.mark.parametrize("bits", [0, 2])
def test_a_mini_simulation_over_specialised_tiers_gives_the_generic_figures(
    policy: type[CachePolicy], bits: int
) -> None:
    fast, generic = (
        MiniSimulation(300, policy, CANDIDATES, WHATIF_FACTORS, 0.5, bits, generic=flag)
        for flag in (False, True)
    )
    for simulation in (fast, generic):
        drive(simulation, seed=bits)
    assert fast.figures() == generic.figures()
    assert fast.figures(cumulative=True) == generic.figures(cumulative=True)
    assert fast.scores() == generic.scores() and fast.seen == generic.seen
    assert any(figure.hit_ratio > 0 for figure in fast.figures(cumulative=True))


def test_sampling_picks_the_keys_whose_low_hash_bits_are_zero_at_every_level() -> None:
    simulation = MiniSimulation(2**14, LRUCachePolicy, CANDIDATES, WHATIF_FACTORS)
    level_bits = [level.bits for level in simulation._levels]
    assert len(set(level_bits)) > 1 and min(level_bits) > 0
    hashes = key_hashes([block_id_key(i) for i in range(3000)])
    picked = simulation._sample(hashes)
    for bits, positions in zip(level_bits, picked, strict=True):
        mask = np.uint64((1 << bits) - 1)
        assert positions == np.flatnonzero((hashes & mask) == 0).tolist()
        assert positions  # every level samples some of 3,000 keys


def test_remembered_hashes_equal_fresh_ones_and_follow_a_list_changed_in_place() -> None:
    keys = [block_id_key(i) for i in range(40)]
    first = key_hashes(keys)
    assert key_hashes(keys) is first  # the same request asked again: not hashed again
    assert first.tolist() == _hashes(keys).tolist()
    with pytest.raises(ValueError, match="read-only"):
        first[0] = 1
    keys[5] = block_id_key(999)
    changed = key_hashes(keys)
    assert changed.tolist() == _hashes(keys).tolist() != first.tolist()
    assert key_hashes(tuple(keys)).tolist() == changed.tolist()
