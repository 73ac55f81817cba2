from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence

import pytest

from kvoffload import (
    BlockStatus,
    CachePolicy,
    CPUOffloadingManager,
    InvalidArgumentError,
    OffloadKey,
    available_policies,
    make_offload_key,
    register_cache_policy,
)
from kvoffload.policies import create_cache_policy
from kvoffload.policies.base import Victims
from kvoffload.policies.registry import _POLICIES


class FIFOPolicy(CachePolicy):
    """Evicts in insertion order and ignores touches."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.order: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()

    def insert(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus]) -> None:
        self.order.update(zip(keys, blocks, strict=True))

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            self.order.pop(key, None)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        return None

    def evict(self, n: int, protected: Container[OffloadKey]) -> Victims | None:
        victims = [(k, b) for k, b in self.order.items() if b.ref_cnt == 0 and k not in protected]
        if len(victims) < n:
            return None
        for key, _ in victims[:n]:
            del self.order[key]
        return victims[:n]


def test_a_registered_policy_is_usable_by_name() -> None:
    register_cache_policy("test-fifo")(FIFOPolicy)
    try:
        assert "test-fifo" in available_policies()
        m = CPUOffloadingManager(2, cache_policy="test-fifo")
        k = [make_offload_key(bytes([i]), 0) for i in range(3)]
        m.prepare_store(k[:2])
        m.complete_store(k[:2])
        m.touch(k[:1])  # FIFO ignores it: 0 is still the oldest
        out = m.prepare_store(k[2:])
        assert out is not None and out.evicted_keys == [k[0]]
        with pytest.raises(InvalidArgumentError, match="already registered"):
            register_cache_policy("lru")(FIFOPolicy)
        # Registered, an alias's name was listed twice and still made the alias's policy.
        with pytest.raises(InvalidArgumentError, match="already registered"):
            register_cache_policy("recommended")(FIFOPolicy)
        assert "recommended" not in _POLICIES
    finally:
        _POLICIES.pop("test-fifo", None)


@pytest.mark.parametrize("name", ["bogus", ["lru"], {"lru": 1}, None])
def test_an_unknown_policy_name_of_any_type_is_refused_with_the_names(name: object) -> None:
    with pytest.raises(InvalidArgumentError, match="unknown cache policy") as error:
        CPUOffloadingManager(2, cache_policy=name)  # type: ignore[arg-type]
    assert all(known in str(error.value) for known in available_policies())


@pytest.mark.parametrize("name", [None, b"fifo", 3, ""])
def test_a_policy_name_that_is_no_string_is_refused_before_it_breaks_the_list(
    name: object,
) -> None:
    """Registered, ``None`` made every later ``available_policies()`` a ``TypeError``."""
    try:
        with pytest.raises(InvalidArgumentError, match="non-empty string"):
            register_cache_policy(name)(FIFOPolicy)  # type: ignore[arg-type]
        assert "lru" in available_policies()
    finally:
        _POLICIES.pop(name, None)  # type: ignore[call-overload]


@pytest.mark.parametrize("name", ["lru", "arc", "s3fifo", "sieve", "slru"])
@pytest.mark.parametrize("capacity", [-1, "2", 2.0, True, None])
def test_a_capacity_that_is_no_count_is_refused_when_the_policy_is_made(
    name: str, capacity: object
) -> None:
    """A negative capacity once failed only at the first eviction, with "dictionary is
    empty" (ARC and S3-FIFO trim their ghost lists to it); text failed in some policies."""
    with pytest.raises(InvalidArgumentError, match="capacity must be an integer >= 0"):
        create_cache_policy(name, capacity)  # type: ignore[arg-type]
    assert create_cache_policy(name, 0).capacity == 0
