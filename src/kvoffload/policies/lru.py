"""Least-recently-used eviction over one ordered dict (front = least recent)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, KeysView, Sequence

from kvoffload.core.keys import OffloadKey
from kvoffload.policies.base import BlockStatus, CachePolicy, Victims, take_evictable
from kvoffload.policies.registry import register_cache_policy


@register_cache_policy("lru")
class LRUCachePolicy(CachePolicy):
    """Evicts the least recently inserted or touched ready, unpinned block.

    ``touch`` walks the keys backwards so a request's first block ends up most
    recent: tails leave before the shared heads they extend.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()

    def insert(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus]) -> None:
        self._order.update(zip(keys, blocks, strict=True))

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        order = self._order
        for key in keys:
            order.pop(key, None)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        order = self._order
        move_to_end = order.move_to_end
        for key in reversed(keys if isinstance(keys, list) else list(keys)):
            if key in order:
                move_to_end(key)

    def coldest(self) -> KeysView[OffloadKey]:
        return self._order.keys()

    def evict(self, n: int, protected: Container[OffloadKey]) -> Victims | None:
        if n <= 0:
            return []
        victims = take_evictable(iter(self._order.items()), n, protected)
        if len(victims) < n:
            return None
        order = self._order
        for key, _ in victims:
            del order[key]
        return victims
