"""The policy interface: a policy only decides *which* block leaves the tier.

The manager owns slots, reference counts and events and hands the policy the
same :class:`BlockStatus` objects it keeps, so a policy can tell evictable
blocks from pinned or pending ones without asking back.

Policies call ``OrderedDict.popitem(False)`` with a positional argument: a
keyword costs an argument parse per call, and these calls are per block.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Collection, Container, Iterable, Iterator, Sequence
from heapq import heappop, heappush
from typing import ClassVar, Protocol

from kvoffload.core.errors import check_integer
from kvoffload.core.keys import OffloadKey
from kvoffload.policies.block_loops import PENDING_STORE as PENDING_STORE
from kvoffload.policies.loops import front_victims


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


class Segment(Protocol):
    """Blocks one part of a policy keeps: a dict, or a :class:`ParkingOrder`."""

    def pop(self, key: OffloadKey, default: None, /) -> BlockStatus | None: ...


def remove_from_either(keys: Iterable[OffloadKey], first: Segment, second: Segment) -> None:
    """Forget ``keys`` from whichever of two segments holds each (an absent key is skipped):
    ``remove`` of a policy that keeps every block in exactly one of two segments."""
    for key in keys:
        if first.pop(key, None) is None:
            second.pop(key, None)


class ParkingOrder(Collection[OffloadKey]):
    """One order of blocks, least recent first, whose pinned and pending blocks at the front
    that an eviction walks past are set aside ("parked"), in order, ahead of the rest, while
    the policy follows blocks turning evictable (vLLM's #46216): the next eviction takes the
    parked blocks reported evictable since, then starts past the parked ones instead of
    reading each again. The order itself, hence every victim, is the one a walk over every
    block sees; iterating gives it, and :meth:`items` with the blocks.

    Policies use ``order`` (the blocks not parked) directly on their hot paths; every parked
    block is less recent than all of ``order``.
    """

    __slots__ = ("_heap", "_places", "_ready", "following", "order", "parked")

    def __init__(self) -> None:
        self.order: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.parked: OrderedDict[OffloadKey, tuple[int, BlockStatus]] = OrderedDict()
        """The parked blocks in order, each with its place (places only grow)."""
        self.following = False
        """Whether the policy follows blocks turning evictable: only then is anything parked."""
        self._ready: dict[OffloadKey, int] = {}
        """The parked blocks reported evictable since, by place (one pinned again since is
        dropped when met)."""
        self._heap: list[tuple[int, OffloadKey]] = []
        """``_ready``'s entries by place, so that an eviction takes its few victims without
        sorting every ready block; an entry whose key has left ``_ready`` (or came back with
        another place) is dropped when met."""
        self._places = 0

    def __len__(self) -> int:
        return len(self.order) + len(self.parked)

    def __contains__(self, key: object) -> bool:
        return key in self.order or key in self.parked

    def __iter__(self) -> Iterator[OffloadKey]:
        yield from self.parked
        yield from self.order

    def items(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        for key, (_, block) in self.parked.items():
            yield key, block
        yield from self.order.items()

    def unpark(self, key: OffloadKey) -> BlockStatus:
        """Take a parked block out of the parked ones; the caller puts it in an order."""
        self._ready.pop(key, None)
        block = self.parked.pop(key)[1]
        if not self.parked:
            self._heap.clear()  # only entries left behind by blocks no longer parked
        return block

    def pop(self, key: OffloadKey, default: None = None, /) -> BlockStatus | None:
        """Forget ``key`` wherever it is; ``None`` if absent (``default`` only lets an order
        stand where a dict's ``pop(key, None)`` is called: :func:`remove_from_either`)."""
        block = self.order.pop(key, None)
        if block is None and key in self.parked:
            block = self.unpark(key)
        return block

    def pop_first(self) -> tuple[OffloadKey, BlockStatus]:
        """Take out the least recent block, parked or not (the order must not be empty)."""
        if self.parked:
            key = next(iter(self.parked))
            return key, self.unpark(key)
        return self.order.popitem(False)

    def became_evictable(self, keys: Iterable[OffloadKey]) -> None:
        """Note the parked blocks among ``keys`` whose ``ref_cnt`` turned 0."""
        parked = self.parked
        if parked:
            ready, heap = self._ready, self._heap
            for key in keys:
                entry = parked.get(key)
                if entry is not None and entry[1].ref_cnt == 0 and key not in ready:
                    ready[key] = entry[0]
                    heappush(heap, (entry[0], key))

    def take_front(self, n: int, protected: Container[OffloadKey]) -> Victims | None:
        """The first ``n`` blocks, forgotten, where each is a victim (ready, unpinned, not
        protected) and no parked block is ready: most evictions, without a :meth:`walk`.
        Otherwise ``None``, and nothing changed."""
        order = self.order
        if self._ready or len(order) < n:
            return None
        return front_victims(order, n, protected)

    def walk(self, protected: Container[OffloadKey]) -> OrderWalk:
        """Start one eviction's pass over this order."""
        return OrderWalk(self, protected)

    def _park(self, popped: Victims) -> None:
        """Set aside blocks popped from ``order``'s front, in order, behind those parked;
        the evictable ones (of a walk undone) as ready."""
        parked, ready, heap = self.parked, self._ready, self._heap
        place = self._places
        for key, block in popped:
            parked[key] = (place, block)
            if block.ref_cnt == 0:
                ready[key] = place
                heappush(heap, (place, key))
            place += 1
        self._places = place


_PARKED, _FRONT, _REST = 0, 1, 2
"""An :class:`OrderWalk`'s stages: the parked ready blocks, the front popped, the rest walked."""


class OrderWalk:
    """One eviction's pass over a :class:`ParkingOrder`, least recent first.

    :meth:`take` goes on where the previous call stopped (ARC takes from T1 again after
    T2); then :meth:`commit` forgets the victims and parks the pinned and pending blocks
    popped on the way, or :meth:`undo` leaves the order as it was. The front is popped
    while it is pinned, pending or a victim; the first block that stays (protected) ends
    the popping, and the rest is only walked, as without parking.
    """

    __slots__ = (
        "_blocks",
        "_from_parked",
        "_front",
        "_held",
        "_protected",
        "_rest",
        "_skipped",
        "_stage",
        "_walked",
    )

    def __init__(self, blocks: ParkingOrder, protected: Container[OffloadKey]) -> None:
        self._blocks = blocks
        self._protected = protected
        self._stage = _PARKED if blocks.following else _REST
        self._from_parked: Victims = []
        self._skipped: list[tuple[int, OffloadKey]] = []
        """Heap entries of parked ready blocks that are protected: pushed back at the end."""
        self._front: Victims = []
        """Victims popped from the front, in order."""
        self._held: list[tuple[OffloadKey, BlockStatus, int]] = []
        """Pinned and pending blocks popped from the front, each with the number of front
        victims before it."""
        self._rest: Iterator[tuple[OffloadKey, BlockStatus]] = (
            iter(blocks.order.items()) if self._stage == _REST else iter(())
        )
        self._walked: Victims = []

    def take(self, k: int) -> Victims:
        """Up to ``k`` more victims: ready, unpinned blocks outside ``protected``, in order."""
        taken: Victims = []
        if k <= 0:
            return taken
        if self._stage == _PARKED:
            self._take_parked(k, taken)
            if len(taken) == k:
                return taken
            self._stage = _FRONT
        if self._stage == _FRONT:
            need = k - len(taken)
            order, protected = self._blocks.order, self._protected
            popitem = order.popitem
            front, held = self._front, self._held
            start = len(front)
            while need and order:
                key, block = popitem(False)
                if block.ref_cnt != 0:
                    held.append((key, block, len(front)))
                elif key in protected:
                    order[key] = block
                    order.move_to_end(key, False)
                    self._stage = _REST
                    self._rest = iter(order.items())
                    break
                else:
                    front.append((key, block))
                    need -= 1
            taken += front[start:]
        if self._stage == _REST and len(taken) < k:
            walked = take_evictable(self._rest, k - len(taken), self._protected)
            self._walked += walked
            taken += walked
        return taken

    def _take_parked(self, k: int, taken: Victims) -> None:
        """Parked, evictable, unprotected blocks, least recent first, into ``taken`` until it
        holds ``k``: taken off the heap, and left parked until :meth:`commit`."""
        blocks, protected = self._blocks, self._protected
        parked, ready, heap = blocks.parked, blocks._ready, blocks._heap
        skipped, from_parked = self._skipped, self._from_parked
        while heap and len(taken) < k:
            place, key = heappop(heap)
            if ready.get(key) != place:
                continue  # evicted, removed or touched out since
            block = parked[key][1]
            if block.ref_cnt != 0:
                del ready[key]  # pinned again: became_evictable brings it back
            elif key in protected:
                skipped.append((place, key))
            else:
                taken.append((key, block))
                from_parked.append((key, block))

    def commit(self) -> None:
        """Forget the victims taken; park the pinned and pending blocks popped."""
        blocks = self._blocks
        heap = blocks._heap
        for entry in self._skipped:
            heappush(heap, entry)
        if self._from_parked:
            parked, ready = blocks.parked, blocks._ready
            for key, _ in self._from_parked:
                del parked[key]
                del ready[key]
            if not parked:
                heap.clear()
        if self._held:
            blocks._park([(key, block) for key, block, _ in self._held])
        if self._walked:
            order = blocks.order
            for key, _ in self._walked:
                del order[key]

    def undo(self) -> None:
        """Leave the order as it was: the blocks popped from the front are parked in the
        order they were popped (the evictable ones as ready), the parked victims stay."""
        blocks = self._blocks
        heap, ready = blocks._heap, blocks._ready
        for entry in self._skipped:
            heappush(heap, entry)
        for key, _ in self._from_parked:
            heappush(heap, (ready[key], key))
        if self._held:
            popped: Victims = []
            taken = 0
            for key, block, before in self._held:
                popped += self._front[taken:before]
                taken = before
                popped.append((key, block))
            popped += self._front[taken:]
            blocks._park(popped)
        elif self._front:
            blocks._park(self._front)
