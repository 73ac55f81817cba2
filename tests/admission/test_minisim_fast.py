"""The mini-simulation's fast paths against their definitions: the specialised LRU and
S3-FIFO mini-tiers against the generic tier over the policy objects, the sampling against
its mask rule, and the remembered key hashes against fresh ones."""

from __future__ import annotations

import random
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from compiled import NOT_BUILT, needs, python_and_compiled
from kvoffload import OffloadKey, block_id_key, build_manager
from kvoffload.admission import MiniSimulation, MiniTier, key_hashes, minisim
from kvoffload.admission.minisim import (
    BYTES_PER_MINI_KEY,
    CompiledARCMiniTier,
    CompiledLRUMiniTier,
    CompiledS3FIFOMiniTier,
    CompiledSIEVEMiniTier,
    CompiledSLRUMiniTier,
    LRUMiniTier,
    S3FIFOMiniTier,
    admitted_set,
    mini_tier,
)
from kvoffload.admission.optimiser import CANDIDATES, WHATIF_FACTORS
from kvoffload.admission.sketch import _hashes
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.policies.arc import ARCCachePolicy
from kvoffload.policies.base import CachePolicy
from kvoffload.policies.lru import LRUCachePolicy
from kvoffload.policies.s3fifo import S3FIFOCachePolicy
from kvoffload.policies.sieve import SIEVECachePolicy
from kvoffload.policies.slru import SLRUCachePolicy

SPECIALISED = [
    (LRUCachePolicy, CompiledLRUMiniTier or LRUMiniTier),
    (S3FIFOCachePolicy, CompiledS3FIFOMiniTier or S3FIFOMiniTier),
    pytest.param(ARCCachePolicy, CompiledARCMiniTier, marks=needs(CompiledARCMiniTier)),
    pytest.param(SIEVECachePolicy, CompiledSIEVEMiniTier, marks=needs(CompiledSIEVEMiniTier)),
    pytest.param(SLRUCachePolicy, CompiledSLRUMiniTier, marks=needs(CompiledSLRUMiniTier)),
]
LRU_TIERS = python_and_compiled(LRUMiniTier, CompiledLRUMiniTier)
needs_compiled = needs(CompiledLRUMiniTier)
needs_compiled_s3fifo = needs(CompiledS3FIFOMiniTier)
COMPILED_TOUCH_COUNTING = [
    pytest.param(CompiledS3FIFOMiniTier, marks=needs_compiled_s3fifo, id="s3fifo"),
    pytest.param(CompiledSIEVEMiniTier, marks=needs(CompiledSIEVEMiniTier), id="sieve"),
    pytest.param(CompiledARCMiniTier, marks=needs(CompiledARCMiniTier), id="arc"),
    pytest.param(CompiledSLRUMiniTier, marks=needs(CompiledSLRUMiniTier), id="slru"),
]


@pytest.mark.parametrize("pending", [True, False])
@pytest.mark.parametrize(("policy", "fast_class"), SPECIALISED)
def test_a_specialised_mini_tier_decides_as_the_generic_one(
    policy: type[CachePolicy], fast_class: type[MiniTier], pending: bool
) -> None:
    """Seeded streams of touches, hit runs, stores (with and without gaps, of admitted
    parts) and the prefix reads over a few keys, so that evictions choose among touched,
    revived and unreachable keys; with and without a store's blocks pending until the next
    touch. ARC's, SIEVE's and SLRU's specialised tiers are the compiled ones alone (their
    Python reference is the generic tier); ARC's adaptive target is compared after every
    step."""
    for seed in range(200):
        rng = random.Random(seed)
        capacity = rng.randint(1, 10)
        fast = mini_tier(capacity, policy, pending=pending)
        generic = MiniTier(capacity, policy, pending)
        assert type(fast) is fast_class
        arc = isinstance(generic.policy, ARCCachePolicy)
        same_decisions(generic, fast, rng, 300, 16, arc)
        assert fast.writes > capacity  # evictions happened


COLLIDING_KEYS: list[Any] = [-1, -2, 0, 2**61 - 1, 2 * (2**61 - 1), 2**64 - 1, -(2**63)]
"""Keys whose hashes collide in pairs and triples (-1 and -2; 0 and multiples of 2**61 - 1)
or sit at the 64-bit limits: they take the compiled tables' probe-past-an-equal-hash path,
which distinct block keys almost never do."""
KEY_POOL = [*COLLIDING_KEYS, block_id_key(1), block_id_key(2)]
STEPS = st.lists(
    st.tuples(
        st.sampled_from(["touch", "hit_run", "prefix", "store", "store_gaps", "admitted"]),
        st.lists(st.sampled_from(KEY_POOL), max_size=6),
        st.integers(0, 2**16),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    specialised=st.sampled_from(
        [
            (LRUCachePolicy, CompiledLRUMiniTier or LRUMiniTier),
            (S3FIFOCachePolicy, CompiledS3FIFOMiniTier or S3FIFOMiniTier),
            (ARCCachePolicy, CompiledARCMiniTier),
            (SIEVECachePolicy, CompiledSIEVEMiniTier),
            (SLRUCachePolicy, CompiledSLRUMiniTier),
        ]
    ),
    capacity=st.integers(1, 4),
    pending=st.booleans(),
    steps=STEPS,
)
def test_a_specialised_mini_tier_decides_as_the_generic_one_over_colliding_keys(
    specialised: tuple[type[CachePolicy], Any],
    capacity: int,
    pending: bool,
    steps: list[tuple[str, list[Any], int]],
) -> None:
    """Repeated keys in one call, and keys that share a hash: the same answers and held
    keys after every step as the generic tier (tiny tiers, so that most stores evict)."""
    policy, fast_class = specialised
    if fast_class is None:
        pytest.skip(NOT_BUILT)
    fast = mini_tier(capacity, policy, pending=pending)
    generic = MiniTier(capacity, policy, pending)
    for action, keys, bits in steps:
        gaps = [bool(bits >> i & 1) for i in range(len(keys))]
        if action == "touch":
            generic.touch(keys)
            fast.touch(keys)
        elif action == "hit_run":
            assert fast.hit_run(keys) == generic.hit_run(keys)
        elif action == "prefix":
            assert fast.held_among(keys) == generic.held_among(keys)
            assert fast.leading_held(keys) == generic.leading_held(keys)
        elif action.startswith("store"):
            behind = gaps if action == "store_gaps" else []
            assert fast.store(keys, behind) == generic.store(keys, behind)
        elif action == "admitted":
            at = [-1 if gap else i for i, gap in enumerate(gaps)]
            keep, gap = set(keys[bits % 3 :]), bits % 5
            assert fast.store_admitted(keys, at, keep, gap) == generic.store_admitted(
                keys, at, keep, gap
            )
        assert len(fast) == len(generic)
        assert [key in fast for key in KEY_POOL] == [key in generic for key in KEY_POOL]
    assert (fast.hits, fast.writes) == (generic.hits, generic.writes)


@pytest.mark.parametrize("lru_tier", LRU_TIERS)
def test_an_lru_store_that_touches_its_request_after_orders_as_touch_store_touch(
    lru_tier: type[LRUMiniTier],
) -> None:
    """``LRUMiniTier.store(..., request=r)`` followed by one touch of ``r`` leaves the
    held keys, their order and the counts of touching ``r``, storing and touching again
    on the generic tier (the worlds' one-touch path), through evictions where too few
    keys outside the request are held."""
    for seed in range(40):
        rng = random.Random(seed)
        capacity = rng.randint(1, 10)
        fast, generic = lru_tier(capacity), MiniTier(capacity, LRUCachePolicy)
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
            assert fast.in_order() == order
        assert (fast.writes, fast.total_writes) == (generic.writes, generic.total_writes)
        assert fast.writes > capacity


def some_keys(rng: random.Random) -> list[OffloadKey]:
    return [block_id_key(rng.randrange(20)) for _ in range(rng.randint(0, 8))]


def pick_admitted(rng: random.Random, offered: list[OffloadKey]) -> list[OffloadKey] | None:
    """What a candidate admits of ``offered``: all (``None``), an in-order part, or (no
    rule does it, but the gap's rule covers it) a part out of order, all of it counting
    as all."""
    choice = rng.random()
    if choice < 0.2:
        return None
    if choice < 0.4:
        return rng.sample(offered, rng.randint(0, len(offered)))
    return [key for key in offered if rng.random() < 0.6]


def same_decisions(
    reference: MiniTier,
    tier: MiniTier,
    rng: random.Random,
    steps: int,
    universe: int,
    arc_target: bool = False,
) -> None:
    """Drive both tiers with one seeded stream of what the worlds and mini-simulations do to
    a tier without a request to protect (touches, hit runs, stores with and without gaps,
    admitted parts with ``at`` and ``keep``, the held keys among a request and its held
    prefix) over ``universe`` keys: the same answers and held keys after every step (and
    ARC's adaptive target, with ``arc_target``), the same counts at the end."""
    keys_seen = [block_id_key(i) for i in range(universe)]
    for _ in range(steps):
        keys = [block_id_key(rng.randrange(universe)) for _ in range(rng.randint(0, 7))]
        action = rng.random()
        if action < 0.3:
            reference.touch(keys)
            tier.touch(keys)
        elif action < 0.45:
            assert reference.hit_run(keys) == tier.hit_run(keys)
        elif action < 0.5:
            request = some_keys(rng) + keys
            assert reference.held_among(request) == tier.held_among(request)
            assert reference.leading_held(request) == tier.leading_held(request)
        elif action < 0.8:
            behind = [rng.random() < 0.3 for _ in keys] if action < 0.7 else []
            assert reference.store(keys, behind) == tier.store(keys, behind)
        else:
            at = [rng.choice([-1, rng.randrange(10)]) for _ in keys]
            keep = None if rng.random() < 0.2 else {k for k in keys if rng.random() < 0.6}
            gap = rng.randrange(10)
            assert reference.store_admitted(keys, at, keep, gap) == tier.store_admitted(
                keys, at, keep, gap
            )
        assert len(reference) == len(tier)
        assert [key in reference for key in keys_seen] == [key in tier for key in keys_seen]
        if arc_target:
            policy = reference.policy
            assert tier.target_t1_size == policy.target_t1_size
    assert (reference.hits, reference.writes, reference.total_hits, reference.total_writes) == (
        tier.hits,
        tier.writes,
        tier.total_hits,
        tier.total_writes,
    )


@needs_compiled
def test_the_compiled_lru_tier_decides_as_the_pure_python_one() -> None:
    """Seeded streams of every operation the worlds, mini-simulations and the optimiser use
    (stores with gaps, admitted subsets and offers, a request to protect or to touch
    first, revivals, the held keys among a request and its held prefix), over few
    keys and small capacities so that evictions, protections and refusals are frequent:
    the same answers, order, unreachable marks and counts after every step."""
    assert CompiledLRUMiniTier is not None
    for seed in range(400):
        rng = random.Random(seed)
        capacity = rng.randint(1, 10)
        python, compiled = LRUMiniTier(capacity), CompiledLRUMiniTier(capacity)

        for _ in range(200):
            offered, action = some_keys(rng), rng.random()
            request = some_keys(rng) + (offered if rng.random() < 0.5 else [])
            if action < 0.2:
                python.touch(offered)
                compiled.touch(offered)
            elif action < 0.4:
                assert python.hit_run(offered) == compiled.hit_run(offered)
            elif action < 0.5:
                assert python.held_among(request) == compiled.held_among(request)
                assert python.leading_held(request) == compiled.leading_held(request)
                distinct = list(dict.fromkeys(offered))
                admitted = pick_admitted(rng, distinct)
                assert python.store_offer(distinct, admitted, request) == compiled.store_offer(
                    distinct, admitted, request
                )
            elif action < 0.7:
                gaps = [rng.random() < 0.3 for _ in offered] if rng.random() < 0.5 else []
                assert python.store(offered, gaps, request) == compiled.store(
                    offered, gaps, request
                )
            else:
                at = [rng.choice([-1, rng.randrange(10)]) for _ in offered]
                keep = None if rng.random() < 0.2 else {k for k in offered if rng.random() < 0.6}
                gap = rng.randrange(10)
                assert python.store_admitted(
                    offered, at, keep, gap, request
                ) == compiled.store_admitted(offered, at, keep, gap, request)
            assert python.in_order() == compiled.in_order() and len(python) == len(compiled)
            assert [python.unreachable(k) for k in python.in_order()] == [
                compiled.unreachable(k) for k in compiled.in_order()
            ]
        assert (python.hits, python.writes, python.total_hits, python.total_writes) == (
            compiled.hits,
            compiled.writes,
            compiled.total_hits,
            compiled.total_writes,
        )
        assert python.total_writes > capacity  # evictions happened


@needs_compiled
def test_the_compiled_lru_tier_decides_as_the_pure_python_one_between_long_offers() -> None:
    """Offers longer than the scratch space a compiled tier starts with (64 keys) among
    short ones: its scratch keeps the size of the longest call, each call indexes only its
    own keys, with the same answers and order as the pure-Python tier."""
    assert CompiledLRUMiniTier is not None
    for seed in range(20):
        rng = random.Random(seed)
        capacity = rng.randint(50, 400)
        python, compiled = LRUMiniTier(capacity), CompiledLRUMiniTier(capacity)
        for _ in range(60):
            length = rng.choice([rng.randint(65, 500), rng.randint(0, 8)])
            offered = list(dict.fromkeys(block_id_key(rng.randrange(800)) for _ in range(length)))
            admitted = pick_admitted(rng, offered)
            request = offered + some_keys(rng)
            assert python.store_offer(offered, admitted, request) == compiled.store_offer(
                offered, admitted, request
            )
            gaps = [rng.random() < 0.3 for _ in request]
            assert python.store(request, gaps) == compiled.store(request, gaps)
            assert python.hit_run(request) == compiled.hit_run(request)
            assert python.in_order() == compiled.in_order()
        assert python.total_writes > capacity  # evictions happened


@needs_compiled_s3fifo
@pytest.mark.parametrize("pending", [True, False])
def test_the_compiled_s3fifo_tier_decides_as_the_pure_python_one(pending: bool) -> None:
    """Seeded streams of every operation the worlds and mini-simulations use on an S3-FIFO
    tier (touches that count or skip the last store's pending keys, stores with gaps and
    revivals, admitted subsets, refused stores, the held keys among a request and its held
    prefix), over few keys and small capacities so that both queues, the ghost and the
    main queue's reinsertion are exercised: the same answers, held keys and counts after
    every step."""
    assert CompiledS3FIFOMiniTier is not None
    for seed in range(400):
        rng = random.Random(seed)
        capacity = rng.randint(1, 12)
        python = S3FIFOMiniTier(capacity, pending)
        compiled = CompiledS3FIFOMiniTier(capacity, pending)
        assert (compiled.small_target, compiled.pending) == (python.small_target, pending)
        same_decisions(python, compiled, rng, 200, 20)
        assert python.total_writes > capacity  # evictions happened


@pytest.mark.parametrize("compiled", COMPILED_TOUCH_COUNTING)
def test_the_compiled_touch_counting_tiers_refuse_bad_input_clearly(compiled: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="capacity must be >= 1"):
        compiled(0)
    tier = compiled(4)
    with pytest.raises(ValueError, match="differ in length"):
        tier.store([block_id_key(1), block_id_key(2)], [True])
    with pytest.raises(ValueError, match="differ in length"):
        tier.store_admitted([block_id_key(1)], [], set(), 0)
    with pytest.raises(TypeError, match="keys must be a sequence"):
        tier.touch(5)  # type: ignore[arg-type]
    assert len(tier) == 0 and tier.total_writes == 0


@pytest.mark.parametrize("compiled", COMPILED_TOUCH_COUNTING)
def test_the_compiled_touch_counting_tiers_report_their_own_bounded_arrays(
    compiled: Any,
) -> None:
    """Their tables (held keys, and S3-FIFO's ghost) are fixed at the start: the figure is
    their arrays, under the Python tiers' estimate, and does not grow with use."""
    tier = compiled(1000)
    before = tier.memory_bytes
    for start in range(0, 5000, 10):
        keys = [block_id_key(i) for i in range(start, start + 10)]
        tier.store(keys)
        tier.touch(keys[:3])
    assert len(tier) == 1000
    assert tier.memory_bytes == before
    assert 0 < before < BYTES_PER_MINI_KEY * 1000 / 2


@needs_compiled
def test_the_compiled_lru_tier_refuses_bad_input_clearly() -> None:
    assert CompiledLRUMiniTier is not None
    with pytest.raises(InvalidArgumentError, match="capacity must be >= 1"):
        CompiledLRUMiniTier(0)
    tier = CompiledLRUMiniTier(4)
    with pytest.raises(ValueError, match="differ in length"):
        tier.store([block_id_key(1), block_id_key(2)], [True])
    with pytest.raises(TypeError, match="keys must be a sequence"):
        tier.hit_run(5)  # type: ignore[arg-type]
    assert len(tier) == 0 and tier.total_writes == 0


@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo", "sieve", "slru"])
def test_the_optimiser_decides_the_same_over_compiled_and_pure_python_tiers(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole recommended stack, replayed twice: its choices, what-if figures and the
    real tier's hits do not depend on which tiers (compiled or Python) the worlds and
    mini-tiers run on."""
    results = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(minisim, "CompiledLRUMiniTier", None)
            monkeypatch.setattr(minisim, "CompiledS3FIFOMiniTier", None)
            monkeypatch.setattr(minisim, "CompiledSIEVEMiniTier", None)
            monkeypatch.setattr(minisim, "CompiledARCMiniTier", None)
            monkeypatch.setattr(minisim, "CompiledSLRUMiniTier", None)
        manager = build_manager(300, policy, admission="recommended")
        rng = random.Random(7)
        roots = [[block_id_key(10**6 + 10 * r + i) for i in range(4)] for r in range(5)]
        hits = stored = 0
        for _ in range(3000):
            keys = [*rng.choice(roots), *(block_id_key(rng.randrange(900)) for _ in range(8))]
            manager.touch(keys)
            hit = manager.lookup(keys) or 0
            if hit:
                manager.prepare_load(keys[:hit])
                manager.complete_load(keys[:hit])
            out = manager.prepare_store(keys[hit:])
            if out is not None and out.keys_to_store:
                manager.touch(keys)
                manager.complete_store(out.keys_to_store)
                stored += len(out.keys_to_store)
            hits += hit
        stats = manager.stats()
        results.append((hits, stored, stats.candidate, stats.whatif))
    assert results[0] == results[1]
    assert results[0][0] > 0 and results[0][3]


class Admitted:
    """A candidate that kept what it admitted of the last offer (a stand-in for a world)."""

    def __init__(self, admitted: list[OffloadKey] | None) -> None:
        self.admitted = admitted

    def kept_of(self, offered: list[OffloadKey]) -> tuple[set[OffloadKey] | None, int]:
        return admitted_set(offered, self.admitted)


def drive(simulation: MiniSimulation, seed: int) -> None:
    """A seeded stream of requests sharing prefixes, looked up past a GPU hit and offered
    with each candidate admitting its own part (some all, some a prefix, some scattered);
    now and then, as a lower tier sees them, a lookup with no offer of its own and blocks
    offered later on their own."""
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
        written_back = rng.random() < 0.2
        if written_back:
            simulation.forget(keys[-1])
            offered = [block_id_key(rng.randrange(400)) for _ in range(rng.randint(1, 9))]
        admitted: dict[str, list[OffloadKey] | None] = {CANDIDATES[0]: None}
        for name in CANDIDATES[1:]:
            admitted[name] = [key for key in offered if rng.random() < 0.7]
        if written_back:
            simulation.on_written_back(offered, key_hashes(offered), admitted)
        else:
            simulation.on_offer_ruled(offered, {n: Admitted(a) for n, a in admitted.items()})


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


@pytest.mark.parametrize("compiled", [True, False])
def test_sampling_picks_the_keys_whose_low_hash_bits_are_zero_at_every_level(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In C where built, and in Python."""
    if not compiled:
        monkeypatch.setattr(minisim, "sampled_positions", None)
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
