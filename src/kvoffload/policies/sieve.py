"""SIEVE eviction: one FIFO, a visited bit per block, and a hand that never moves survivors.

The hand sweeps from the oldest block towards the newest; a visited block it
passes loses its bit and stays where it is, the first unvisited one leaves.
The queue is kept as two ordered dicts split at the hand (``swept`` behind
it, ``unswept`` from the hand on), so every step is O(1) and survivors keep
their place. Touches of pending blocks do not set the bit, nor, for a
request-scoped driver, a request's own store of a block (its insertion).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence

from kvoffload.core.keys import OffloadKey
from kvoffload.policies.base import BlockStatus, CachePolicy, Victims, remove_from_either
from kvoffload.policies.registry import register_cache_policy
from kvoffload.policies.s3fifo import _has_evictable


@register_cache_policy("sieve")
class SIEVECachePolicy(CachePolicy):
    """FIFO order with lazy promotion: visited blocks survive the hand once."""

    recent_at_access = False

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.swept: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.unswept: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.visited: set[OffloadKey] = set()

    def insert(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus]) -> None:
        self.unswept.update(zip(keys, blocks, strict=True))

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        keys = list(keys)
        remove_from_either(keys, self.unswept, self.swept)
        self.visited.difference_update(keys)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        swept, unswept, visited = self.swept, self.unswept, self.visited
        for key in keys:
            block = unswept[key] if key in unswept else swept.get(key)
            if block is not None and block.ref_cnt >= 0:
                visited.add(key)

    def finish_request(
        self,
        keys: Sequence[OffloadKey],
        reused: Container[OffloadKey],
        stored_only: Container[OffloadKey],
    ) -> None:
        """Only a read visits: a block enters unvisited, so the request that stored it does
        not mark it (that would let every stored block survive the hand once)."""
        self.touch([key for key in keys if key in reused])

    def evict(self, n: int, protected: Container[OffloadKey]) -> Victims | None:
        if n <= 0:
            return []
        if not _has_evictable(n, (self.unswept, self.swept), protected):
            return None
        visited = self.visited
        victims: Victims = []
        while len(victims) < n:
            if not self.unswept:
                self.unswept, self.swept = self.swept, self.unswept
            key, block = self.unswept.popitem(False)
            if block.ref_cnt != 0 or key in protected:
                self.swept[key] = block
            elif key in visited:
                visited.discard(key)
                self.swept[key] = block
            else:
                victims.append((key, block))
        return victims
