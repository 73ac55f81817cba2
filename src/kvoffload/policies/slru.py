"""Segmented LRU: blocks that were touched again are protected from blocks never touched since.

New blocks enter the probation segment; a touch of a ready block moves it to
the protected segment, which keeps at most ``PROTECTED_SHARE`` of the tier
(its least recent blocks are demoted back to probation's most recent end).
Victims come from probation's least recent end first, so a block admitted on
first sight and never used leaves before any block that proved itself. Both
segments keep LRU's backwards touch, so a request's tail leaves before its head.
For a request-scoped driver a request's own store of a block is its first
sight: it makes the block recent in its segment, and only a read promotes it.
Where the driver follows blocks turning evictable, an eviction starts past the pinned
and pending blocks the previous one walked in each segment
(:class:`~kvoffload.policies.base.ParkingOrder`, vLLM's #46216): the victims are the same.
"""

from __future__ import annotations

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

PROTECTED_SHARE = 0.8


def protected_limit(capacity: int) -> int:
    """Blocks the protected segment of a ``capacity``-block tier holds at most (the
    mini-tiers that mirror the policy size theirs the same way)."""
    return max(1, int(capacity * PROTECTED_SHARE))


@register_cache_policy("slru")
class SLRUCachePolicy(CachePolicy):
    """Probation and protected LRU segments; eviction drains probation first."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.protected_limit = protected_limit(capacity)
        self.probation = ParkingOrder()
        self.protected = ParkingOrder()

    def insert(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus]) -> None:
        self.probation.order.update(zip(keys, blocks, strict=True))

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        remove_from_either(keys, self.probation, self.protected)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        probation, protected = self.probation.order, self.protected.order
        parked = bool(self.probation.parked or self.protected.parked)
        for key in reversed(keys if isinstance(keys, list) else list(keys)):
            if key in protected:
                protected.move_to_end(key)
            elif key in probation:
                block = probation[key]
                if block.ref_cnt >= 0:
                    del probation[key]
                    protected[key] = block
                else:
                    probation.move_to_end(key)
            elif parked:
                if key in self.protected.parked:
                    protected[key] = self.protected.unpark(key)
                elif key in self.probation.parked:
                    block = self.probation.unpark(key)
                    (protected if block.ref_cnt >= 0 else probation)[key] = block
        self._demote()

    def finish_request(
        self,
        keys: Sequence[OffloadKey],
        reused: Container[OffloadKey],
        stored_only: Container[OffloadKey],
    ) -> None:
        """A read promotes, as a touch does; a store only makes its block recent in its own
        segment (promoting it would let every stored block into protected)."""
        probation, protected = self.probation.order, self.protected.order
        parked = bool(self.probation.parked or self.protected.parked)
        for key in reversed(keys):
            if key in protected:
                if key in reused or key in stored_only:
                    protected.move_to_end(key)
            elif key in probation:
                if key in reused and probation[key].ref_cnt >= 0:
                    protected[key] = probation.pop(key)
                elif key in reused or key in stored_only:
                    probation.move_to_end(key)
            elif parked and (key in reused or key in stored_only):
                if key in self.protected.parked:
                    protected[key] = self.protected.unpark(key)
                elif key in self.probation.parked:
                    block = self.probation.unpark(key)
                    promote = key in reused and block.ref_cnt >= 0
                    (protected if promote else probation)[key] = block
        self._demote()

    def _demote(self) -> None:
        """Move protected's least recent blocks beyond its share to probation's recent end."""
        segment, probation = self.protected, self.probation.order
        while len(segment) > self.protected_limit:
            key, block = segment.pop_first()
            probation[key] = block

    def follow_evictable(self) -> None:
        self.probation.following = self.protected.following = True

    def became_evictable(self, keys: Iterable[OffloadKey]) -> None:
        if self.probation.parked or self.protected.parked:
            keys = keys if isinstance(keys, list) else list(keys)
            self.probation.became_evictable(keys)
            self.protected.became_evictable(keys)

    def evict(self, n: int, protected: Container[OffloadKey]) -> Victims | None:
        if n <= 0:
            return []
        victims = self.probation.take_front(n, protected)
        if victims is not None:
            return victims
        first = self.probation.walk(protected)
        victims = first.take(n)
        if len(victims) < n:
            second = self.protected.walk(protected)
            victims += second.take(n - len(victims))
            if len(victims) < n:
                first.undo()
                second.undo()
                return None
            second.commit()
        first.commit()
        return victims
