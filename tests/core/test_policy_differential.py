"""Differential test: the optimised policies against naive, literal versions.

The naive versions follow the reference text step by step (ARC rescans T1
from its least recent end for every victim); the real ones pick victims in
one pass. Driven through two managers with the same random calls, every
output and every internal order must agree. SIEVE is checked against the
textbook form (one list and a hand index) instead of its split at the hand.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence

import hypothesis.strategies as st
from hypothesis import given, settings

from kvoffload import CPUOffloadingManager, make_offload_key
from kvoffload.core.keys import OffloadKey
from kvoffload.policies.arc import ARCCachePolicy
from kvoffload.policies.base import BlockStatus, CachePolicy, ParkingOrder, Victims
from kvoffload.policies.lru import LRUCachePolicy
from kvoffload.policies.registry import register_cache_policy
from kvoffload.policies.sieve import SIEVECachePolicy
from kvoffload.policies.slru import SLRUCachePolicy


def first_evictable(
    table: OrderedDict[OffloadKey, BlockStatus] | ParkingOrder,
    protected: Container[OffloadKey],
    chosen: list[OffloadKey],
) -> tuple[OffloadKey, BlockStatus] | None:
    for key, block in table.items():
        if block.ref_cnt == 0 and key not in protected and key not in chosen:
            return key, block
    return None


@register_cache_policy("naive-arc")
class NaiveARC(ARCCachePolicy):
    def evict(self, n: int, protected: Container[OffloadKey]) -> Victims | None:
        chosen: Victims = []
        sources: list[int] = []
        virtual_t1 = len(self.t1)
        for _ in range(n):
            taken = [key for key, _ in chosen]
            victim = None
            if virtual_t1 >= int(self.target_t1_size):
                victim = first_evictable(self.t1, protected, taken)
                source = 1
            if victim is None:
                victim = first_evictable(self.t2, protected, taken)
                source = 2
            if victim is None:
                victim = first_evictable(self.t1, protected, taken)
                source = 1
            if victim is None:
                return None
            if source == 1:
                virtual_t1 -= 1
            chosen.append(victim)
            sources.append(source)
        for (key, _), source in zip(chosen, sources, strict=True):
            if source == 1:
                self.t1.pop(key)
                self.b1[key] = None
            else:
                self.t2.pop(key)
                self.b2[key] = None
        while len(self.b1) > self.capacity:
            self.b1.popitem(last=False)
        while len(self.b2) > self.capacity:
            self.b2.popitem(last=False)
        return chosen


@register_cache_policy("naive-lru")
class NaiveLRU(LRUCachePolicy):
    def evict(self, n: int, protected: Container[OffloadKey]) -> Victims | None:
        chosen: Victims = []
        for _ in range(n):
            victim = first_evictable(self._order, protected, [key for key, _ in chosen])
            if victim is None:
                return None
            chosen.append(victim)
        for key, _ in chosen:
            del self._order[key]
        return chosen


@register_cache_policy("naive-slru")
class NaiveSLRU(SLRUCachePolicy):
    def evict(self, n: int, protected: Container[OffloadKey]) -> Victims | None:
        chosen: Victims = []
        for _ in range(n):
            taken = [key for key, _ in chosen]
            victim = first_evictable(self.probation, protected, taken)
            if victim is None:
                victim = first_evictable(self.protected, protected, taken)
            if victim is None:
                return None
            chosen.append(victim)
        for key, _ in chosen:
            if self.probation.pop(key) is None:
                self.protected.pop(key)
        return chosen


@register_cache_policy("naive-sieve")
class TextbookSIEVE(CachePolicy):
    """One list, oldest first, and a hand index that walks towards the newest block."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.queue: list[tuple[OffloadKey, BlockStatus]] = []
        self.hand = 0
        self.visited: set[OffloadKey] = set()

    def insert(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus]) -> None:
        self.queue += zip(keys, blocks, strict=True)

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            index = next((i for i, (k, _) in enumerate(self.queue) if k == key), None)
            if index is not None:
                del self.queue[index]
                self.hand -= index < self.hand
                self.visited.discard(key)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            if any(k == key and b.ref_cnt >= 0 for k, b in self.queue):
                self.visited.add(key)

    def evict(self, n: int, protected: Container[OffloadKey]) -> Victims | None:
        if sum(b.ref_cnt == 0 and k not in protected for k, b in self.queue) < n:
            return None
        chosen: Victims = []
        while len(chosen) < n:
            if self.hand >= len(self.queue):
                self.hand = 0
            key, block = self.queue[self.hand]
            if block.ref_cnt != 0 or key in protected:
                self.hand += 1
            elif key in self.visited:
                self.visited.discard(key)
                self.hand += 1
            else:
                chosen.append(self.queue.pop(self.hand))
        return chosen

    def in_hand_order(self) -> list[OffloadKey]:
        """The queue read from the hand on, wrapping: what the split form keeps."""
        keys = [k for k, _ in self.queue]
        return keys[self.hand :] + keys[: self.hand]


KEYS = [make_offload_key(i.to_bytes(2, "big"), 0) for i in range(6)]
OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "complete", "fail", "touch", "load", "unload"]),
        st.lists(st.sampled_from(KEYS), max_size=5),
    ),
    max_size=80,
)


def policy_state(m: CPUOffloadingManager) -> object:
    if isinstance(m.policy, LRUCachePolicy):
        # The order; which blocks the fast one set aside past pinned ones is its own affair.
        return list(m.policy.coldest())
    # Each order as a whole, wherever the fast one set aside pinned blocks (its own affair).
    return {
        name: list(v) if isinstance(v, OrderedDict | ParkingOrder) else v
        for name, v in vars(m.policy).items()
    }


@settings(max_examples=500, deadline=None)
@given(policy=st.sampled_from(["arc", "lru", "slru"]), capacity=st.integers(1, 6), ops=OPS)
def test_optimised_policy_agrees_with_naive(policy: str, capacity: int, ops: list) -> None:  # type: ignore[type-arg]
    fast = CPUOffloadingManager(capacity, policy, enable_events=True)
    naive = CPUOffloadingManager(capacity, f"naive-{policy}", enable_events=True)
    for op, keys in ops:
        results = []
        for m in (fast, naive):
            if op == "store":
                out = m.prepare_store(keys)
                results.append(
                    None
                    if out is None
                    else (out.keys_to_store, out.evicted_keys, out.store_spec.block_ids.tolist())  # type: ignore[attr-defined]
                )
            elif op in ("complete", "fail"):
                m.complete_store(keys, success=op == "complete")
            elif op == "touch":
                m.touch(keys)
            elif op == "load":
                ready = [k for k in keys if (b := m.block_status(k)) is not None and b.is_ready]
                m.prepare_load(ready)
            else:
                pinned = [
                    k for k in dict.fromkeys(keys) if (b := m.block_status(k)) and b.ref_cnt > 0
                ]
                m.complete_load(pinned)
        assert results[:1] == results[1:]
        assert policy_state(fast) == policy_state(naive)
        assert fast.take_events() == naive.take_events()


def drive(m: CPUOffloadingManager, op: str, keys: list[OffloadKey]) -> object:
    """One random call; returns what the caller can observe."""
    if op == "store":
        out = m.prepare_store(keys)
        return None if out is None else (out.keys_to_store, out.evicted_keys)
    if op in ("complete", "fail"):
        m.complete_store(keys, success=op == "complete")
    elif op == "touch":
        m.touch(keys)
    elif op == "load":
        m.prepare_load([k for k in keys if (b := m.block_status(k)) is not None and b.is_ready])
    else:
        m.complete_load(
            [k for k in dict.fromkeys(keys) if (b := m.block_status(k)) and b.ref_cnt > 0]
        )
    return None


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 6), ops=OPS)
def test_sieve_agrees_with_the_textbook_form(capacity: int, ops: list) -> None:  # type: ignore[type-arg]
    fast = CPUOffloadingManager(capacity, "sieve", enable_events=True)
    textbook = CPUOffloadingManager(capacity, "naive-sieve", enable_events=True)
    for op, keys in ops:
        assert drive(fast, op, keys) == drive(textbook, op, keys)
        split, book = fast.policy, textbook.policy
        assert isinstance(split, SIEVECachePolicy) and isinstance(book, TextbookSIEVE)
        assert list(split.unswept) + list(split.swept) == book.in_hand_order()
        assert split.visited == book.visited
        assert fast.take_events() == textbook.take_events()
