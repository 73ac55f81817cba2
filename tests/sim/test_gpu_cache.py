"""The GPU prefix cache: slot accounting, sharing, and tail-first LRU release."""

from __future__ import annotations

import pytest

from kvoffload import block_id_key as key
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.sim.gpu_cache import GPUPrefixCache


def test_tail_first_release_evicts_tails_before_heads() -> None:
    gpu = GPUPrefixCache(4)
    request = [key(1), key(2), key(3)]
    slots = gpu.acquire([], 3)
    gpu.register(request, slots)
    gpu.release(slots)
    other = gpu.acquire([], 3)  # one free slot, then two evictions: tail (3) then 2
    assert set(other) == set(range(4)) - {slots[0]}
    assert gpu.match(request) == 1
    assert gpu.evictions == 2


def test_shared_blocks_are_referenced_not_evicted() -> None:
    gpu = GPUPrefixCache(3)
    first = gpu.acquire([], 2)
    gpu.register([key(1), key(2)], first)
    second = gpu.acquire([key(1)], 1)  # shares block 1 while the first still holds both
    assert second[0] == first[0]
    assert not gpu.fits([], 1)
    with pytest.raises(InvalidArgumentError):
        gpu.acquire([], 1)
    gpu.release(first)
    assert gpu.fits([], 1)  # block 2 is cached and reclaimable; block 1 is still in use
    assert not gpu.fits([], 2)


def test_shared_idle_block_is_not_reclaimable_for_the_same_request() -> None:
    gpu = GPUPrefixCache(2)
    slots = gpu.acquire([], 2)
    gpu.register([key(1), key(2)], slots)
    gpu.release(slots)
    assert gpu.fits([key(1)], 1)
    assert not gpu.fits([key(1)], 2)


def test_duplicate_block_keeps_first_slot_and_frees_the_copy() -> None:
    gpu = GPUPrefixCache(2)
    a, b = gpu.acquire([], 1), gpu.acquire([], 1)
    gpu.register([key(9)], a)
    gpu.register([key(9)], b)
    gpu.release(b)
    gpu.release(a)
    assert gpu.match([key(9)]) == 1
    assert gpu.acquire([], 1) == b  # the copy went back to the free list, not the cache
    assert gpu.evictions == 0
