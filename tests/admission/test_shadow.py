from __future__ import annotations

import numpy as np
import pytest

from kvoffload.admission.shadow import (
    MAX_BITS,
    MIN_DISAGREEMENTS,
    TARGET_SAMPLED,
    ShadowTiers,
    sampling_bits,
)
from kvoffload.admission.sketch import key_hashes
from kvoffload.core.errors import InvalidArgumentError


def _keys(n: int, salt: int = 0) -> list[bytes]:
    return [(salt * 1_000_003 + i).to_bytes(16, "big") for i in range(n)]


def _ref(shadow: ShadowTiers, keys: list[int], a: bool, b: bool) -> None:
    """Reference ``keys`` (already sampled), both shadows admitting misses per ``a``/``b``."""
    n = len(keys)
    shadow.reference(np.array(keys, dtype=np.uint64), np.full(n, a), np.full(n, b))


def test_sampling_rate_grows_with_the_tier_and_is_bounded() -> None:
    assert sampling_bits(1) == 0
    assert sampling_bits(2 * TARGET_SAMPLED - 1) == 0
    assert sampling_bits(2 * TARGET_SAMPLED) == 1
    assert sampling_bits(4392) == 4
    assert sampling_bits(10**9) == MAX_BITS
    with pytest.raises(InvalidArgumentError, match="0"):
        sampling_bits(0)
    for capacity in (1, 300, 4392, 100_000):
        shadow = ShadowTiers(capacity)
        assert shadow.capacity == max(1, capacity >> shadow.bits)
        assert shadow.capacity >= min(capacity, TARGET_SAMPLED)


def test_sampling_is_deterministic_and_at_the_stated_rate() -> None:
    shadow = ShadowTiers(4392)
    hashes = key_hashes(_keys(64_000))
    picked = shadow.sample(hashes)
    assert np.array_equal(picked, ShadowTiers(4392).sample(key_hashes(_keys(64_000))))
    assert np.all(hashes[picked] % (1 << shadow.bits) == 0)
    share = len(picked) / len(hashes)
    assert shadow.rate == 1 / 16
    assert abs(share - shadow.rate) < 0.1 * shadow.rate
    everything = ShadowTiers(100)
    assert np.array_equal(everything.sample(hashes[:10]), np.arange(10))


def test_hits_are_counted_on_a_hand_made_sequence() -> None:
    shadow = ShadowTiers(3)
    assert shadow.capacity == 3
    # 1, 2 miss in both (A inserts, B does not); 1 then hits in A only.
    shadow.reference(
        np.array([1, 2, 1], dtype=np.uint64), np.array([True] * 3), np.array([False] * 3)
    )
    assert (shadow.hits_a, shadow.hits_b) == (1, 0)
    # Three references are a shadow-full: the decayed count is halved.
    assert (shadow.only_a, shadow.only_b) == (0.5, 0.0)
    # 3, 4 enter A: 2 is its least recent and is evicted; 1 stays (it was touched).
    _ref(shadow, [3, 4], True, True)
    _ref(shadow, [2], False, False)
    assert shadow.hits_a == 1
    _ref(shadow, [1, 3], False, False)
    assert (shadow.hits_a, shadow.hits_b) == (3, 1)
    assert shadow.references == 8


def test_capacity_bounds_both_shadows() -> None:
    shadow = ShadowTiers(40)
    _ref(shadow, list(range(1000)), True, True)
    assert len(shadow) == shadow.capacity == 40
    assert shadow.memory_bytes > 0


def test_the_choice_flips_when_one_rule_wins_and_flips_back() -> None:
    shadow = ShadowTiers(TARGET_SAMPLED)
    assert shadow.first_sight
    # Only B keeps keys that are then hit: B wins, first-seen writes stop.
    hot = list(range(10))
    _ref(shadow, hot, False, True)
    for _ in range(3):
        _ref(shadow, hot, False, False)
    assert not shadow.first_sight and shadow.flips == 1
    # Now only A keeps the new hot keys: once A catches up, first-seen writes resume.
    hot = list(range(100, 110))
    _ref(shadow, hot, True, False)
    _ref(shadow, hot, False, False)
    assert not shadow.first_sight
    for _ in range(3):
        _ref(shadow, hot, False, False)
    assert shadow.first_sight and shadow.flips == 2


def test_a_little_evidence_changes_nothing() -> None:
    shadow = ShadowTiers(TARGET_SAMPLED)
    few = list(range(int(MIN_DISAGREEMENTS) - 1))
    _ref(shadow, few, False, True)
    _ref(shadow, few, False, False)
    assert shadow.only_b == len(few) and shadow.first_sight


def test_counts_are_halved_every_shadow_full_of_references() -> None:
    shadow = ShadowTiers(30)
    hot = list(range(10))
    _ref(shadow, hot, False, True)
    _ref(shadow, hot, False, False)
    assert shadow.only_b == 10.0
    _ref(shadow, hot, False, False)
    # The thirtieth reference halves the decayed counts: 20 / 2.
    assert shadow.only_b == 10.0
    assert shadow.hits_b == 20
