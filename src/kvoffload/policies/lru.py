"""Least-recently-used eviction over one ordered dict (front = least recent)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Container, Iterable, Iterator, KeysView, Sequence
from heapq import heappop, heappush

from kvoffload.core.keys import OffloadKey
from kvoffload.policies.base import BlockStatus, CachePolicy, Victims, take_evictable
from kvoffload.policies.registry import register_cache_policy


@register_cache_policy("lru")
class LRUCachePolicy(CachePolicy):
    """Evicts the least recently inserted or touched ready, unpinned block.

    ``touch`` walks the keys backwards so a request's first block ends up most
    recent: tails leave before the shared heads they extend.

    Where the driver reports blocks turning evictable (:meth:`follow_evictable`),
    pinned and pending blocks at the front that an eviction walks past are set
    aside, in order, ahead of the rest: the next eviction starts past them instead
    of walking them again (vLLM's #46216), and the order, hence every victim, is
    the same.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self._parked: dict[OffloadKey, tuple[int, BlockStatus]] = {}
        """Blocks set aside from ``_order``'s front while pinned or pending, least recent
        first, each with its place: all are less recent than every block in ``_order``."""
        self._parked_ready: dict[OffloadKey, int] = {}
        """The parked blocks reported evictable since, by place (one pinned again since is
        dropped when met)."""
        self._ready_heap: list[tuple[int, OffloadKey]] = []
        """``_parked_ready``'s entries by place, least recent first, so that an eviction takes
        its few victims without sorting every ready block; an entry whose key has left
        ``_parked_ready`` (or came back with another place) is dropped when met."""
        self._places = 0
        self._parking = False

    def insert(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus]) -> None:
        self._order.update(zip(keys, blocks, strict=True))

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        order, parked = self._order, self._parked
        for key in keys:
            if order.pop(key, None) is None and parked.pop(key, None) is not None:
                self._parked_ready.pop(key, None)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        order, parked = self._order, self._parked
        move_to_end = order.move_to_end
        for key in reversed(keys if isinstance(keys, list) else list(keys)):
            if key in order:
                move_to_end(key)
            elif parked and key in parked:
                order[key] = parked.pop(key)[1]
                self._parked_ready.pop(key, None)

    def follow_evictable(self) -> None:
        self._parking = True

    def became_evictable(self, keys: Iterable[OffloadKey]) -> None:
        parked = self._parked
        if parked:
            ready, heap = self._parked_ready, self._ready_heap
            for key in keys:
                entry = parked.get(key)
                if entry is not None and entry[1].ref_cnt == 0 and key not in ready:
                    ready[key] = entry[0]
                    heappush(heap, (entry[0], key))

    def coldest(self) -> Collection[OffloadKey]:
        if self._parked:
            return _Chained(self._parked.keys(), self._order.keys())
        return self._order.keys()

    def evict(self, n: int, protected: Container[OffloadKey]) -> Victims | None:
        if n <= 0:
            return []
        if not self._parking:
            victims = take_evictable(iter(self._order.items()), n, protected)
            if len(victims) < n:
                return None
            order = self._order
            for key, _ in victims:
                del order[key]
            return victims
        victims = self._take_parked(n, protected) if self._ready_heap else []
        # The front is popped while it is pinned, pending or a victim; the first block that
        # stays (protected) ends the popping, and the rest is only walked, as without parking.
        order = self._order
        popitem = order.popitem
        need = n - len(victims)
        front: Victims = []
        # The pinned and pending blocks popped, each with the number of victims before it.
        held: list[tuple[OffloadKey, BlockStatus, int]] = []
        while need and order:
            key, block = popitem(False)
            if block.ref_cnt != 0:
                held.append((key, block, len(front)))
            elif key in protected:
                order[key] = block
                order.move_to_end(key, False)
                break
            else:
                front.append((key, block))
                need -= 1
        walked = take_evictable(iter(order.items()), need, protected) if need else []
        if len(walked) < need:
            self._unpark_failed(victims)
            self._park_failed(front, held)
            return None
        if held:
            self._park(held)
        if victims:
            parked, ready = self._parked, self._parked_ready
            for key, _ in victims:
                del parked[key]
                del ready[key]
            victims += front
        else:
            victims = front
        for key, _ in walked:
            del order[key]
        return victims + walked if walked else victims

    def _take_parked(self, n: int, protected: Container[OffloadKey]) -> Victims:
        """Up to ``n`` parked, evictable, unprotected blocks, least recent first, taken off
        the heap (:meth:`_unpark_failed` puts them back) and left parked."""
        parked, ready, heap = self._parked, self._parked_ready, self._ready_heap
        taken: Victims = []
        protected_entries: list[tuple[int, OffloadKey]] = []
        while heap and len(taken) < n:
            place, key = heappop(heap)
            if ready.get(key) != place:
                continue  # evicted, removed or touched back since
            block = parked[key][1]
            if block.ref_cnt != 0:
                del ready[key]  # pinned again: became_evictable brings it back
            elif key in protected:
                protected_entries.append((place, key))
            else:
                taken.append((key, block))
        for entry in protected_entries:
            heappush(heap, entry)
        return taken

    def _unpark_failed(self, victims: Victims) -> None:
        """Parked victims of an eviction that failed back on the heap, as they were."""
        ready, heap = self._parked_ready, self._ready_heap
        for key, _ in victims:
            heappush(heap, (ready[key], key))

    def _park(self, held: list[tuple[OffloadKey, BlockStatus, int]]) -> None:
        """Set aside the pinned and pending blocks popped, in order, behind those parked."""
        parked = self._parked
        place = self._places
        for key, block, _ in held:
            parked[key] = (place, block)
            place += 1
        self._places = place

    def _park_failed(self, front: Victims, held: list[tuple[OffloadKey, BlockStatus, int]]) -> None:
        """A failed eviction's popped blocks all set aside in the order they were popped, the
        evictable ones as ready: the order is unchanged."""
        popped: Victims = []
        taken = 0
        for key, block, before in held:
            popped += front[taken:before]
            taken = before
            popped.append((key, block))
        popped += front[taken:]
        parked, ready = self._parked, self._parked_ready
        place = self._places
        for key, block in popped:
            parked[key] = (place, block)
            if block.ref_cnt == 0:
                ready[key] = place
                heappush(self._ready_heap, (place, key))
            place += 1
        self._places = place


class _Chained(Collection[OffloadKey]):
    """The parked keys, then the ordered ones: :meth:`LRUCachePolicy.coldest` while
    some are parked."""

    __slots__ = ("_first", "_second")

    def __init__(self, first: KeysView[OffloadKey], second: KeysView[OffloadKey]) -> None:
        self._first, self._second = first, second

    def __contains__(self, key: object) -> bool:
        return key in self._first or key in self._second

    def __len__(self) -> int:
        return len(self._first) + len(self._second)

    def __iter__(self) -> Iterator[OffloadKey]:
        yield from self._first
        yield from self._second
