"""The frequency sketch: fixed memory, saturating counters, doorkeeper, aging."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled import needs
from kvoffload import InvalidArgumentError, OffloadKey, block_id_key
from kvoffload.admission import FrequencySketch, key_hashes
from kvoffload.admission import sketch as sketch_module
from kvoffload.admission.sketch import MAX_COUNT
from kvoffload.core.errors import InsufficientMemoryError


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


def test_a_sketch_beyond_the_machine_is_refused_before_any_allocation() -> None:
    # 10**17 sightings: 2**57 cells a row, far beyond any machine's memory and numpy's limit.
    with pytest.raises(InsufficientMemoryError, match="admission frequency sketch of 100,000"):
        FrequencySketch(10**17)


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


@pytest.mark.parametrize("width", [12, 13, 16, 32, 37])
def test_the_strided_hashes_of_any_key_width_agree_with_the_per_key_path(width: int) -> None:
    rng = random.Random(width)
    keys = [OffloadKey(rng.randbytes(width)) for _ in range(20)]
    vectorised = key_hashes(keys).tolist()
    # A key of another length sends the whole batch down the per-key path.
    per_key = key_hashes([*keys, OffloadKey(rng.randbytes(width + 1))]).tolist()[:-1]
    assert vectorised == per_key
    assert len(set(vectorised)) == len(keys)


def test_keys_of_other_lengths_that_join_to_a_whole_width_are_hashed_key_by_key() -> None:
    """Lengths 16, 15 and 17 join to 3 x 16 bytes, as three 16-byte keys would: the
    strided read took the second key's last 12 bytes from the bytes after it (and the
    compiled hashes, key by key, disagreed with the pure-Python ones)."""
    rng = random.Random(7)
    keys = [OffloadKey(rng.randbytes(length)) for length in (16, 15, 17)]
    one_by_one = [sketch_module.numpy_hashes([key]).tolist()[0] for key in keys]
    assert sketch_module.numpy_hashes(keys).tolist() == one_by_one


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


class ReferenceSketch:
    """The sketch's definition, key by key on Python ints: what the vectorised one must equal."""

    MASK = (1 << 64) - 1

    def __init__(self, sample_size: int) -> None:
        self.bits = max(4, (sample_size - 1).bit_length())
        self.sample_size = sample_size
        self.counts = [[0] * (1 << self.bits) for _ in range(4)]
        self.door = [False] * (1 << (self.bits + 4))
        self.added = 0

    def hash(self, key: bytes) -> int:
        value = int.from_bytes(key[-12:], "big")
        h = (value ^ (value >> 64)) & self.MASK
        h ^= h >> 30
        h = h * 0xBF58476D1CE4E5B9 & self.MASK
        h ^= h >> 27
        h = h * 0x94D049BB133111EB & self.MASK
        return h ^ (h >> 31)

    def door_cells(self, h: int) -> tuple[int, int]:
        shift = 64 - self.bits - 4
        return h >> shift, (h * 0x2545F4914F6CDD1D & self.MASK) >> shift

    def row_cells(self, h: int) -> list[int]:
        seeds = (0x9E3779B97F4A7C15, 0xD6E8FEB86659FD93, 0xC2B2AE3D27D4EB4F, 0xFF51AFD7ED558CCD)
        return [(h * seed & self.MASK) >> (64 - self.bits) for seed in seeds]

    def increment(self, keys: list[OffloadKey]) -> None:
        hashes = [self.hash(key) for key in keys]
        seen = [all(self.door[c] for c in self.door_cells(h)) for h in hashes]
        for h in hashes:
            for cell in self.door_cells(h):
                self.door[cell] = True
        # Every counter is read before any is written: a cell shared in one batch counts once.
        updates = [
            (row, cell, min(self.counts[row][cell] + 1, MAX_COUNT))
            for h, was_seen in zip(hashes, seen, strict=True)
            if was_seen
            for row, cell in enumerate(self.row_cells(h))
        ]
        for row, cell, value in updates:
            self.counts[row][cell] = value
        self.added += len(keys)
        if self.added >= self.sample_size:
            self.counts = [[c >> 1 for c in row] for row in self.counts]
            self.door = [False] * len(self.door)
            self.added = 0

    def estimate(self, keys: list[OffloadKey]) -> list[int]:
        result = []
        for key in keys:
            h = self.hash(key)
            rows = min(self.counts[row][cell] for row, cell in enumerate(self.row_cells(h)))
            result.append(rows + all(self.door[c] for c in self.door_cells(h)))
        return result


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 120), min_size=1, max_size=40), min_size=1, max_size=25),
    st.sampled_from([16, 64, 300]),
)
def test_the_sketch_equals_its_key_by_key_definition(batches: list[list[int]], size: int) -> None:
    """Small tables, so that cells collide within a batch, and enough sightings to age."""
    sketch, reference = FrequencySketch(size), ReferenceSketch(size)
    probe = [block_id_key(i, i % 3) for i in range(121)]
    for batch in batches:
        keys = [block_id_key(i, i % 3) for i in batch]
        assert key_hashes(keys).tolist() == [reference.hash(key) for key in keys]
        sketch.increment(key_hashes(keys))
        reference.increment(keys)
        assert sketch.estimate(key_hashes(probe)).tolist() == reference.estimate(probe)


def test_request_hashes_give_an_offer_the_cells_of_its_hashes() -> None:
    from kvoffload.admission.sketch import RequestHashes

    sketch = FrequencySketch(1024, use_compiled=False)
    request = [block_id_key(i) for i in range(6)]
    cache = RequestHashes()
    sketch.increment(cache.of_request(request), cache.cells(sketch))
    for offered in (request[2:], [block_id_key(i) for i in (9, 4, 5)]):
        hashes, cells = cache.offer(offered, sketch)
        assert hashes.tolist() == key_hashes(offered).tolist()
        assert cells is not None
        assert cells.tolist() == sketch.cells(key_hashes(offered)).tolist()
        assert sketch.estimate(hashes, cells).tolist() == sketch.estimate(hashes).tolist()
    if sketch_module.compiled is not None:  # the compiled sketch finds its cells itself
        assert cache.offer(request[2:], FrequencySketch(1024))[1] is None


needs_compiled = needs(sketch_module.compiled)


@needs_compiled
def test_the_compiled_hashes_equal_numpys_for_every_key_length() -> None:
    rng = random.Random(3)
    for length in (*range(0, 20), 24, 40):
        keys = [OffloadKey(rng.randbytes(length)) for _ in range(50)]
        compiled = np.frombuffer(sketch_module.compiled.hash_keys(keys), np.uint64)
        assert compiled.tolist() == sketch_module.numpy_hashes(keys).tolist()
    with pytest.raises(TypeError, match="keys must be bytes"):
        sketch_module.compiled.hash_keys(["not bytes"])


@needs_compiled
@pytest.mark.parametrize("sample_size", [16, 300, 5000])
def test_the_compiled_sketch_counts_as_the_numpy_one(sample_size: int) -> None:
    """Batches with repeated keys and, in a small sketch, keys that share cells (where
    the order of reads and writes decides the counts): the same table after every batch,
    through agings, and the same estimates."""
    rng = random.Random(sample_size)
    fast, slow = FrequencySketch(sample_size), FrequencySketch(sample_size, use_compiled=False)
    assert fast.compiled and not slow.compiled
    for _ in range(400):
        batch = hashes(*(rng.randrange(3 * sample_size) for _ in range(rng.randint(0, 40))))
        fast.increment(batch)
        slow.increment(batch)
        assert np.array_equal(fast._table, slow._table)
        assert fast.estimate(batch).tolist() == slow.estimate(batch).tolist()
        for threshold in (1, 2, 3):
            flags = fast.seen_at_least(batch, threshold)
            assert flags == slow.seen_at_least(batch, threshold)
            assert flags == (slow.estimate(batch) >= threshold).tolist()
    assert fast.resets == slow.resets > 0
    assert fast._table.any()


def misaligned(hashes: np.ndarray) -> np.ndarray:
    """A copy of ``hashes``' bytes that starts one byte past an 8-byte boundary."""
    raw = hashes.view(np.uint8)
    room = np.zeros(len(raw) + 8, np.uint8)
    start = (1 - room.ctypes.data) % 8
    copy = room[start : start + len(raw)]
    copy[:] = raw
    assert copy.ctypes.data % 8 == 1
    return copy


@needs_compiled
def test_the_compiled_sketch_reads_hashes_at_any_alignment() -> None:
    """A buffer of hashes need not be 8-byte aligned (a slice, a memoryview at an odd
    offset). Each hash was read as a ``uint64_t``, undefined behaviour there (a build with
    ``-fsanitize=alignment`` says "load of misaligned address"); x86 happens to read it
    right, so only such a build fails this test without the fix. Each hash is copied out
    now: a misaligned copy gives the results of the aligned hashes."""
    compiled = sketch_module.compiled
    aligned = hashes(*range(200), 3, 3, 7)
    assert aligned.ctypes.data % 8 == 0
    shifted = misaligned(aligned)
    bits = 5
    tables = [np.zeros(4 * 2**bits + (2**bits << 4), np.uint8) for _ in range(2)]
    for _ in range(3):
        compiled.increment(tables[0], aligned, bits)
        compiled.increment(tables[1], shifted, bits)
        assert np.array_equal(*tables)
    table = tables[0]
    assert compiled.estimate(table, shifted, bits) == compiled.estimate(table, aligned, bits)
    for threshold in (1, 2, 4):
        assert compiled.seen_at_least(table, shifted, bits, threshold) == (
            compiled.seen_at_least(table, aligned, bits, threshold)
        )
    masks = (0, 1, 3, 15)
    assert compiled.sampled_positions(shifted, masks) == (
        compiled.sampled_positions(aligned, masks)
    )
