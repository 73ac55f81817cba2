"""Adaptive Replacement Cache, as vLLM's offloading tier runs it.

Deviations from textbook ARC that keep it identical to vLLM:
a ghost hit (through ``touch``) only adapts the target size; the later store
re-admits the block into T1. The replacement test is ``|T1| >= int(p)``
without the B2 tie rule, ``p`` is a float, and each ghost list is bounded by
the capacity on its own.

One deliberate difference, a bug fix: when T1 is below its target and T2 has
nothing evictable, vLLM's seed-era ARC gives up (stores fail with evictable
blocks present); here eviction falls back to T1, as vLLM itself later did.
Victims are found with one pass per list, not a rescan per victim, and, where the
driver follows blocks turning evictable, past the pinned and pending blocks the previous
eviction walked (:class:`~kvoffload.policies.base.ParkingOrder`, vLLM's #46216): the
victims are the same.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence

from kvoffload.core.keys import OffloadKey
from kvoffload.policies.base import (
    BlockStatus,
    CachePolicy,
    ParkingOrder,
    Victims,
    remove_from_either,
)
from kvoffload.policies.registry import register_cache_policy


@register_cache_policy("arc")
class ARCCachePolicy(CachePolicy):
    """T1 holds blocks seen once, T2 blocks touched again; B1/B2 remember evictions."""

    recent_at_access = False

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.target_t1_size = 0.0
        self.t1 = ParkingOrder()
        self.t2 = ParkingOrder()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def insert(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus]) -> None:
        self.t1.order.update(zip(keys, blocks, strict=True))
        b1, b2 = self.b1, self.b2
        if b1 or b2:
            for key in keys:
                if key in b1:
                    del b1[key]
                elif key in b2:
                    del b2[key]

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        remove_from_either(keys, self.t1, self.t2)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        t1, t2, b1, b2 = self.t1.order, self.t2.order, self.b1, self.b2
        parked = bool(self.t1.parked or self.t2.parked)
        for key in reversed(keys if isinstance(keys, list) else list(keys)):
            if key in t1:  # ``in`` then ``[]``: OrderedDict.get is several times slower
                block = t1[key]
                if block.ref_cnt >= 0:
                    del t1[key]
                    t2[key] = block
                else:
                    # Pending: just prepared for store, not really seen twice.
                    t1.move_to_end(key)
            elif key in t2:
                t2.move_to_end(key)
            elif key in b1:
                # max()/min() spelled out (first argument wins ties, as with the builtins).
                delta = len(b2) / len(b1)
                target = self.target_t1_size + (delta if delta > 1.0 else 1.0)
                self.target_t1_size = target if target <= self.capacity else self.capacity
                b1.move_to_end(key)
            elif key in b2:
                delta = len(b1) / len(b2)
                target = self.target_t1_size - (delta if delta > 1.0 else 1.0)
                self.target_t1_size = target if target >= 0.0 else 0.0
                b2.move_to_end(key)
            elif parked:
                if key in self.t1.parked:
                    block = self.t1.unpark(key)
                    (t2 if block.ref_cnt >= 0 else t1)[key] = block
                elif key in self.t2.parked:
                    t2[key] = self.t2.unpark(key)

    def store_missed(self, keys: Sequence[OffloadKey]) -> None:
        """Adapt to the ghosts among keys about to be stored (``touch`` of an absent key only
        adapts)."""
        if self.b1 or self.b2:
            self.touch(keys)

    def finish_request(
        self,
        keys: Sequence[OffloadKey],
        reused: Container[OffloadKey],
        stored_only: Container[OffloadKey],
    ) -> None:
        """As vLLM 0.32/0.33: a read moves a block from T1 to T2 (or up T2); a store only makes
        it recent in its own list; any other key (a store that got no slot) is left alone."""
        t1, t2 = self.t1.order, self.t2.order
        parked = bool(self.t1.parked or self.t2.parked)
        for key in reversed(keys):
            if key in t1:
                if key in reused:
                    t2[key] = t1.pop(key)
                elif key in stored_only:
                    t1.move_to_end(key)
            elif key in t2:
                if key in reused or key in stored_only:
                    t2.move_to_end(key)
            elif parked:
                if key in self.t1.parked:
                    if key in reused:
                        t2[key] = self.t1.unpark(key)
                    elif key in stored_only:
                        t1[key] = self.t1.unpark(key)
                elif key in self.t2.parked and (key in reused or key in stored_only):
                    t2[key] = self.t2.unpark(key)

    def follow_evictable(self) -> None:
        self.t1.following = self.t2.following = True

    def became_evictable(self, keys: Iterable[OffloadKey]) -> None:
        if self.t1.parked or self.t2.parked:
            keys = keys if isinstance(keys, list) else list(keys)
            self.t1.became_evictable(keys)
            self.t2.became_evictable(keys)

    def evict(self, n: int, protected: Container[OffloadKey]) -> Victims | None:
        if n <= 0:
            return []
        # Each victim taken from T1 shrinks it; T1 gives victims while it is at
        # or above the target, then T2, then T1 again (the fallback).
        t1_turns = len(self.t1) - int(self.target_t1_size) + 1
        # Most evictions take the front of the one list that gives every victim.
        if n <= t1_turns:
            victims = self.t1.take_front(n, protected)
            if victims is not None:
                self._remember(victims, [])
                return victims
        elif t1_turns <= 0:
            victims = self.t2.take_front(n, protected)
            if victims is not None:
                self._remember([], victims)
                return victims
        t1_walk = self.t1.walk(protected)
        first = t1_walk.take(n if n < t1_turns else t1_turns)
        if len(first) == n:
            t1_walk.commit()
            self._remember(first, [])
            return first
        t2_walk = self.t2.walk(protected)
        second = t2_walk.take(n - len(first))
        fallback = t1_walk.take(n - len(first) - len(second))
        victims = first + second + fallback
        if len(victims) < n:
            t1_walk.undo()
            t2_walk.undo()
            return None
        t1_walk.commit()
        t2_walk.commit()
        self._remember(first + fallback, second)
        return victims

    def _remember(self, from_t1: Victims, from_t2: Victims) -> None:
        """The ghosts of the victims taken (each ghost list bounded by the capacity)."""
        b1, b2 = self.b1, self.b2
        for key, _ in from_t1:
            b1[key] = None
        for key, _ in from_t2:
            b2[key] = None
        for ghosts in (b1, b2):
            for _ in range(len(ghosts) - self.capacity):
                ghosts.popitem(False)
