"""S3-FIFO eviction: a small probation queue, a main queue and a ghost of small's victims.

New blocks enter the small FIFO (a tenth of the tier); a block still untouched
when it reaches small's head leaves at once, so one-hit blocks never push out
blocks that proved themselves. A block touched while ready moves to main,
which is a FIFO with reinsertion (up to 3 touches buy 3 more rounds). Keys
that small evicted are remembered in a ghost; storing one of them again puts
it straight into main. Touches of pending blocks do not count, nor, for a
request-scoped driver, a request's own store of a block (its insertion).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence

from kvoffload.core.keys import OffloadKey
from kvoffload.policies.base import BlockStatus, CachePolicy, Victims
from kvoffload.policies.registry import register_cache_policy

Victim = tuple[OffloadKey, BlockStatus]
MAX_FREQ = 3
SMALL_SHARE = 0.1


def small_target(capacity: int) -> int:
    """Blocks the small queue of a ``capacity``-block tier holds before it evicts first
    (the mini-tiers that mirror the policy size theirs the same way)."""
    return max(1, int(capacity * SMALL_SHARE))


@register_cache_policy("s3fifo")
class S3FIFOCachePolicy(CachePolicy):
    """Small FIFO for newcomers, main FIFO with reinsertion, ghost of small's victims."""

    recent_at_access = False

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.small_target = small_target(capacity)
        self.small: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.main: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.freq: dict[OffloadKey, int] = {}
        self.ghost: OrderedDict[OffloadKey, None] = OrderedDict()

    def insert(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus]) -> None:
        small, main, ghost, freq = self.small, self.main, self.ghost, self.freq
        for key, block in zip(keys, blocks, strict=True):
            if key in ghost:
                del ghost[key]
                main[key] = block
            else:
                small[key] = block
            freq[key] = 0

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        small, main, freq = self.small, self.main, self.freq
        for key in keys:
            if key in freq:
                del freq[key]
                if small.pop(key, None) is None:
                    del main[key]

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        freq, small, main = self.freq, self.small, self.main
        get = freq.get
        for key in keys:
            # The count first: a saturated block needs no look at its queue.
            count = get(key)
            if count is not None and count < MAX_FREQ:
                block = small[key] if key in small else main[key]
                if block.ref_cnt >= 0:
                    freq[key] = count + 1

    def finish_request(
        self,
        keys: Sequence[OffloadKey],
        reused: Container[OffloadKey],
        stored_only: Container[OffloadKey],
    ) -> None:
        """Only a read counts: a block the request only stored was inserted, not hit, and
        counting that would send every stored block to main, one-hit ones included."""
        self.touch([key for key in keys if key in reused])

    def evict(self, n: int, protected: Container[OffloadKey]) -> Victims | None:
        if n <= 0:
            return []
        if not _has_evictable(n, (self.small, self.main), protected):
            return None
        victims: Victims = []
        small, main, small_target = self.small, self.main, self.small_target
        from_small, from_main, take = self._from_small, self._from_main, victims.append
        while len(victims) < n:
            if len(small) >= small_target or not main:
                victim = from_small(protected)
                if victim is not None:
                    take(victim)
                    continue
            victim = from_main(protected)
            if victim is None:
                victim = from_small(protected)
            if victim is not None:
                take(victim)
        ghost = self.ghost
        for _ in range(len(ghost) - self.capacity):
            ghost.popitem(False)
        return victims

    def _from_small(self, protected: Container[OffloadKey]) -> Victim | None:
        """Walk small from its head once: promote touched blocks, evict the first untouched."""
        small, main, freq = self.small, self.main, self.freq
        for _ in range(len(small)):
            key, block = small.popitem(False)
            if block.ref_cnt != 0 or key in protected:
                small[key] = block
            elif freq[key] > 0:
                freq[key] = 0
                main[key] = block
            else:
                del freq[key]
                self.ghost[key] = None
                return key, block
        return None

    def _from_main(self, protected: Container[OffloadKey]) -> Victim | None:
        """Walk main from its head, reinserting touched blocks with one touch less."""
        main, freq = self.main, self.freq
        for _ in range((MAX_FREQ + 1) * len(main)):
            key, block = main.popitem(False)
            if block.ref_cnt != 0 or key in protected:
                main[key] = block
            elif freq[key] > 0:
                freq[key] -= 1
                main[key] = block
            else:
                del freq[key]
                return key, block
        return None


def _has_evictable(
    n: int, queues: Iterable[OrderedDict[OffloadKey, BlockStatus]], protected: Container[OffloadKey]
) -> bool:
    """Whether at least ``n`` ready, unpinned, unprotected blocks exist (stops at ``n``)."""
    found = 0
    for queue in queues:
        for key, block in queue.items():
            if block.ref_cnt == 0 and key not in protected:
                found += 1
                if found >= n:
                    return True
    return False
