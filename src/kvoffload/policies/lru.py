"""Least-recently-used eviction over one ordered dict (front = least recent)."""

from __future__ import annotations

from collections.abc import Collection, Container, Iterable, Sequence

from kvoffload.core.keys import OffloadKey
from kvoffload.policies.base import BlockStatus, CachePolicy, ParkingOrder, Victims
from kvoffload.policies.loops import move_recent, store_pairs
from kvoffload.policies.registry import register_cache_policy


@register_cache_policy("lru")
class LRUCachePolicy(CachePolicy):
    """Evicts the least recently inserted or touched ready, unpinned block.

    ``touch`` walks the keys backwards so a request's first block ends up most
    recent: tails leave before the shared heads they extend.

    Where the driver reports blocks turning evictable (:meth:`follow_evictable`),
    pinned and pending blocks at the front that an eviction walks past are set
    aside, in order, ahead of the rest (:class:`~kvoffload.policies.base.ParkingOrder`):
    the next eviction starts past them instead of walking them again (vLLM's
    #46216), and the order, hence every victim, is the same.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._blocks = ParkingOrder()
        self._order = self._blocks.order
        """The blocks not set aside, least recent first: what the hot paths touch."""

    def insert(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus]) -> None:
        store_pairs(self._order, keys, blocks)

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        pop = self._blocks.pop
        for key in keys:
            pop(key)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        move_recent(self._order, self._blocks, keys)

    def follow_evictable(self) -> None:
        self._blocks.following = True

    def became_evictable(self, keys: Iterable[OffloadKey]) -> None:
        self._blocks.became_evictable(keys)

    def coldest(self) -> Collection[OffloadKey]:
        return self._blocks if self._blocks.parked else self._order.keys()

    def evict(self, n: int, protected: Container[OffloadKey]) -> Victims | None:
        if n <= 0:
            return []
        blocks = self._blocks
        victims = blocks.take_front(n, protected)
        if victims is not None:
            return victims
        walk = blocks.walk(protected)
        victims = walk.take(n)
        if len(victims) < n:
            walk.undo()
            return None
        walk.commit()
        return victims
