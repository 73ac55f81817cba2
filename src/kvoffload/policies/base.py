"""The policy interface: a policy only decides *which* block leaves the tier.

The manager owns slots, reference counts and events and hands the policy the
same :class:`BlockStatus` objects it keeps, so a policy can tell evictable
blocks from pinned or pending ones without asking back.

Policies call ``OrderedDict.popitem(False)`` with a positional argument: a
keyword costs an argument parse per call, and these calls are per block.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Container, Iterable, Iterator, Sequence
from typing import ClassVar

from kvoffload.core.errors import check_integer
from kvoffload.core.keys import OffloadKey

PENDING_STORE = -1
"""``ref_cnt`` of a block whose store has not completed: neither loadable nor evictable."""


class BlockStatus:
    """One offloaded block: its slot and how many loads hold it.

    ``ref_cnt`` is :data:`PENDING_STORE` while the write is in flight, 0 when
    the block is ready and evictable, and ``n > 0`` while ``n`` loads pin it.
    """

    __slots__ = ("block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = PENDING_STORE

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0

    def __repr__(self) -> str:
        return f"BlockStatus(block_id={self.block_id}, ref_cnt={self.ref_cnt})"


Victims = list[tuple[OffloadKey, BlockStatus]]


class CachePolicy(ABC):
    """Orders the blocks of one tier and picks eviction victims.

    ``evict`` is atomic: it either returns exactly ``n`` victims (and forgets
    them) or returns ``None`` and changes nothing.
    """

    recent_at_access: ClassVar[bool] = True
    """Whether a request's first read or store of a block makes it recent at once (vLLM
    0.33's LRU does); a policy that counts accesses per request (ARC, S3-FIFO, SIEVE)
    waits for :meth:`finish_request`. Only request-scoped drivers (the vLLM adapter) ask."""

    def __init__(self, capacity: int) -> None:
        # Checked here, not where it is used: a negative capacity once failed the first
        # eviction with "dictionary is empty" (ARC, S3-FIFO trim their ghosts to it), and
        # text failed in some policies only. 0 is allowed: vLLM may size a manager with it.
        check_integer("a cache policy's capacity", capacity, 0)
        self.capacity = capacity

    @abstractmethod
    def insert(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus]) -> None:
        """Start tracking newly stored (still pending) blocks, in offer order."""

    @abstractmethod
    def remove(self, keys: Iterable[OffloadKey]) -> None:
        """Stop tracking blocks whose store failed."""

    @abstractmethod
    def touch(self, keys: Iterable[OffloadKey]) -> None:
        """Record an access; keys may be absent. The first key ends up most recent."""

    def store_missed(self, keys: Sequence[OffloadKey]) -> None:
        """A request is about to store ``keys``, which the tier does not hold, before
        :meth:`insert`: ARC learns from the ghosts among them here, as ``insert`` forgets
        them. Called once per key and request, by request-scoped drivers. Default: nothing."""
        return

    def finish_request(
        self,
        keys: Sequence[OffloadKey],
        reused: Container[OffloadKey],
        stored_only: Container[OffloadKey],
    ) -> None:
        """A finished request's keys, head of the prefix first: ``reused`` it read (loaded,
        or found ready when it offered them), ``stored_only`` it only wrote. vLLM calls
        this once per request; the default touches every key, as vLLM does for a policy
        without a rule of its own. ARC, S3-FIFO, SIEVE and SLRU count only a read as a
        second access: the request that stored a block inserted it, it did not reuse it."""
        self.touch(keys)

    @abstractmethod
    def evict(self, n: int, protected: Container[OffloadKey]) -> Victims | None:
        """Choose ``n`` ready, unpinned blocks outside ``protected``, or ``None``."""

    def follow_evictable(self) -> None:
        """The driver's promise: from now on it calls :meth:`became_evictable` whenever a
        block's ``ref_cnt`` turns 0 (as vLLM 0.33's manager calls ``mark_evictable``), so
        that a policy may set aside pinned and pending blocks its evictions walk past.
        Without it a policy rereads every ``ref_cnt`` it walks. Default: nothing."""
        return

    def became_evictable(self, keys: Iterable[OffloadKey]) -> None:
        """Blocks among ``keys`` whose ``ref_cnt`` turned 0 (a store completed, the last load
        released them); see :meth:`follow_evictable`. Default: nothing."""
        return

    def coldest(self) -> Collection[OffloadKey] | None:
        """The tracked keys, the next to be evicted first, as a view that stays current until
        the next :meth:`evict` (ask again after one), where one order decides evictions and
        ``touch`` moves a key out of its front (so a caller may steer which block leaves);
        ``None`` for policies whose victims depend on more than one order."""
        return None


def take_evictable(
    items: Iterator[tuple[OffloadKey, BlockStatus]], k: int, protected: Container[OffloadKey]
) -> Victims:
    """Up to ``k`` ready, unpinned, unprotected items from ``items``, consuming no further.

    An explicit loop: a filtering generator under ``islice`` costs a frame switch per item.
    """
    taken: Victims = []
    if k > 0:
        append = taken.append
        for item in items:
            if item[1].ref_cnt == 0 and item[0] not in protected:
                append(item)
                if len(taken) == k:
                    break
    return taken


def remove_from_either(
    keys: Iterable[OffloadKey],
    first: dict[OffloadKey, BlockStatus],
    second: dict[OffloadKey, BlockStatus],
) -> None:
    """Forget ``keys`` from whichever of two segments holds each (an absent key is skipped):
    ``remove`` of a policy that keeps every block in exactly one of two ordered dicts."""
    for key in keys:
        if first.pop(key, None) is None:
            second.pop(key, None)
