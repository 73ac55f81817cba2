"""The frequency sketch: fixed memory, saturating counters, doorkeeper, aging."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload import InvalidArgumentError, OffloadKey, block_id_key
from kvoffload.admission import FrequencySketch, key_hashes
from kvoffload.admission.sketch import MAX_COUNT


def hashes(*ids: int) -> np.ndarray:
    return key_hashes([block_id_key(i) for i in ids])


def test_hashes_are_deterministic_and_spread() -> None:
    a = hashes(*range(1000))
    assert np.array_equal(a, hashes(*range(1000)))
    assert len(set(a.tolist())) == 1000
    assert len(set((a >> np.uint64(50)).tolist())) > 940  # top bits index cells: ~970 expected


def test_first_sighting_counts_one_and_repeats_add_up() -> None:
    sketch = FrequencySketch(1024)
    h = hashes(7)
    assert sketch.estimate(h).tolist() == [0]
    sketch.increment(h)
    assert sketch.estimate(h).tolist() == [1]
    sketch.increment(h)
    sketch.increment(h)
    assert sketch.estimate(h).tolist() == [3]
    assert sketch.estimate(hashes(8)).tolist() == [0]


def test_counters_saturate_and_memory_is_fixed() -> None:
    sketch = FrequencySketch(4096)
    memory = sketch.memory_bytes
    h = hashes(1)
    for _ in range(40):
        sketch.increment(h)
    assert sketch.estimate(h).tolist() == [MAX_COUNT + 1]
    sketch.increment(hashes(*range(2, 3000)))
    assert sketch.memory_bytes == memory == 4 * 4096 + 16 * 4096


def test_aging_halves_counts_and_clears_the_doorkeeper() -> None:
    sketch = FrequencySketch(64)
    h = hashes(1)
    for _ in range(9):
        sketch.increment(h)
    assert sketch.estimate(h).tolist() == [9]
    sketch.increment(hashes(*range(100, 155)))  # 64 sightings in all: one aging
    assert sketch.resets == 1
    assert sketch.estimate(h).tolist() == [4]  # 8 counted sightings halved, doorkeeper cleared


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=400))
def test_never_underestimates_within_a_sample(ids: list[int]) -> None:
    sketch = FrequencySketch(1024)  # larger than any sample here: no aging
    for i in ids:
        sketch.increment(hashes(i))
    unique = sorted(set(ids))
    estimates = sketch.estimate(hashes(*unique)).tolist()
    for i, estimate in zip(unique, estimates, strict=True):
        assert estimate >= min(ids.count(i), MAX_COUNT + 1)


def test_few_first_sightings_look_like_second_ones() -> None:
    sketch = FrequencySketch(20_000)
    sketch.increment(hashes(*range(10_000)))
    fresh = sketch.estimate(hashes(*range(10_000, 20_000)))
    assert (fresh >= 2).mean() < 0.01
    assert (fresh >= 1).mean() < 0.1


def test_bad_size_is_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="sample_size"):
        FrequencySketch(0)


def test_the_vectorised_and_the_per_key_hashes_agree() -> None:
    keys = [block_id_key(i, group) for i in (0, 1, 2**40 + 7, 2**63) for group in (0, 3)]
    batch = key_hashes(keys).tolist()
    one_by_one = [key_hashes([key]).tolist()[0] for key in keys]
    mixed_lengths = key_hashes([OffloadKey(b"\x00" + keys[0]), *keys[1:]]).tolist()
    assert batch == one_by_one
    assert mixed_lengths[1:] == batch[1:]  # the per-key path, same formula
    assert mixed_lengths[0] == batch[0]  # a longer key with the same last 12 bytes
    short = key_hashes([OffloadKey(b"abc"), OffloadKey(b"abd")]).tolist()
    assert short[0] != short[1]


def test_request_hashes_reuse_the_request_for_its_offer_and_hash_anything_else() -> None:
    from kvoffload.admission.sketch import RequestHashes

    request = [block_id_key(i) for i in range(6)]
    cache = RequestHashes()
    full = cache.of_request(request)
    assert cache.of_offer(request[2:]).tolist() == full[2:].tolist()
    other = [block_id_key(i) for i in (9, 4, 5)]  # ends like the request, but differs
    assert cache.of_offer(other).tolist() == key_hashes(other).tolist()
    assert (
        cache.of_offer([*request, block_id_key(7)]).tolist()
        == key_hashes([*request, block_id_key(7)]).tolist()
    )
