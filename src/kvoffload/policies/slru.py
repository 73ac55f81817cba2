"""Segmented LRU: blocks that were touched again are protected from blocks never touched since.

New blocks enter the probation segment; a touch of a ready block moves it to
the protected segment, which keeps at most ``PROTECTED_SHARE`` of the tier
(its least recent blocks are demoted back to probation's most recent end).
Victims come from probation's least recent end first, so a block admitted on
first sight and never used leaves before any block that proved itself. Both
segments keep LRU's backwards touch, so a request's tail leaves before its head.
For a request-scoped driver a request's own store of a block is its first
sight: it makes the block recent in its segment, and only a read promotes it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from itertools import chain

from kvoffload.core.keys import OffloadKey
from kvoffload.policies.base import (
    BlockStatus,
    CachePolicy,
    Victims,
    remove_from_either,
    take_evictable,
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
        self.probation: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.protected: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()

    def insert(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus]) -> None:
        self.probation.update(zip(keys, blocks, strict=True))

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        remove_from_either(keys, self.probation, self.protected)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        probation, protected = self.probation, self.protected
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
        self._demote()

    def finish_request(
        self,
        keys: Sequence[OffloadKey],
        reused: Container[OffloadKey],
        stored_only: Container[OffloadKey],
    ) -> None:
        """A read promotes, as a touch does; a store only makes its block recent in its own
        segment (promoting it would let every stored block into protected)."""
        probation, protected = self.probation, self.protected
        for key in reversed(keys):
            if key in protected:
                if key in reused or key in stored_only:
                    protected.move_to_end(key)
            elif key in probation:
                if key in reused and probation[key].ref_cnt >= 0:
                    protected[key] = probation.pop(key)
                elif key in reused or key in stored_only:
                    probation.move_to_end(key)
        self._demote()

    def _demote(self) -> None:
        """Move protected's least recent blocks beyond its share to probation's recent end."""
        probation, protected = self.probation, self.protected
        while len(protected) > self.protected_limit:
            key, block = protected.popitem(False)
            probation[key] = block

    def evict(self, n: int, protected: Container[OffloadKey]) -> Victims | None:
        if n <= 0:
            return []
        segments = chain(self.probation.items(), self.protected.items())
        victims = take_evictable(segments, n, protected)
        if len(victims) < n:
            return None
        probation, segment = self.probation, self.protected
        for key, _ in victims:
            if probation.pop(key, None) is None:
                del segment[key]
        return victims
