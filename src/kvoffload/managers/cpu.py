"""The CPU tier's manager: slot allocation, reference counts and events.

Which block to evict is left to a :class:`~kvoffload.policies.CachePolicy`
chosen by name; everything else about a block's life is decided here.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import numpy as np

from kvoffload.core.errors import (
    BlockNotFoundError,
    BlockNotPinnedError,
    BlockNotReadyError,
    InvalidArgumentError,
)
from kvoffload.core.keys import (
    SINGLE_KEY_TYPES,
    OffloadKey,
    refuse_single_key,
)
from kvoffload.core.manager import (
    EventLog,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
)
from kvoffload.core.specs import CPULoadStoreSpec
from kvoffload.policies import PENDING_STORE, BlockStatus, CachePolicy, create_cache_policy
from kvoffload.policies.loops import (
    claim_pending,
    distinct,
    drop_victims,
    leading_ready,
    mark_ready,
    pin_all,
    store_pairs,
    unpin_all,
)

MEDIUM = CPULoadStoreSpec.medium()


class CPUOffloadingManager(OffloadingManager):
    """Holds up to ``num_blocks`` offloaded blocks in CPU slots ``0 .. num_blocks-1``.

    Slots are handed out fresh in ascending order first, then reused from the
    free list last-in-first-out. A freed slot keeps its :class:`BlockStatus`
    object, which the next store of that slot reuses: no allocation per block
    once the tier has filled. ``prepare_store`` is atomic: when it cannot
    make room it returns ``None`` and nothing changes, and it asks the policy
    only when the tier has enough evictable blocks (they are counted, not
    searched for: a full tier of pinned and pending blocks refused each store
    after a walk over all of them, vLLM's #45757). Removal events are
    emitted when blocks are evicted (at prepare time), store events when a
    store completes successfully.

    Raises :class:`~kvoffload.core.errors.InvalidArgumentError` for
    ``num_blocks < 1`` or an unknown ``cache_policy`` (the message lists the
    registered ones). Bad calls raise a
    :class:`~kvoffload.core.errors.BlockStateError` naming the key and change
    nothing: see :meth:`prepare_load` and :meth:`complete_load`.
    """

    def __init__(self, num_blocks: int, cache_policy: str = "lru", enable_events: bool = False):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise InvalidArgumentError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._policy = create_cache_policy(cache_policy, num_blocks)
        self._policy.follow_evictable()
        self._blocks: dict[OffloadKey, BlockStatus] = {}
        self._num_allocated = 0
        self._free: list[BlockStatus] = []
        self._num_evictable = 0
        """Held blocks that are ready and unpinned (``ref_cnt`` 0)."""
        self._events = EventLog(enable_events)

    @property
    def policy(self) -> CachePolicy:
        """The eviction policy instance (for inspection and tests)."""
        return self._policy

    @property
    def events_enabled(self) -> bool:
        """Whether this manager keeps events for ``take_events``."""
        return self._events.enabled

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self.num_blocks - self._num_allocated

    def block_status(self, key: OffloadKey) -> BlockStatus | None:
        """The status of ``key``, or ``None`` if it is not held (read-only use)."""
        return self._blocks.get(key)

    def holds(self, key: OffloadKey) -> bool:
        """Whether ``key`` has a slot here (ready, pinned or still pending)."""
        return key in self._blocks

    def num_evictable_blocks(self, protected: Collection[OffloadKey]) -> int:
        """Ready, unpinned blocks outside ``protected``: what a store could evict now.

        Counted as blocks change state, so this costs a look-up per protected key,
        not a walk over the tier.
        """
        if not isinstance(protected, set | frozenset | dict):
            protected = set(protected)  # a key listed twice is one block
        return self._num_evictable - self._num_ready_among(protected)

    def _num_ready_among(self, keys: Iterable[OffloadKey]) -> int:
        """How many of ``keys`` (each listed once) are held ready and unpinned."""
        blocks = self._blocks
        ready = 0
        for key in keys:
            block = blocks.get(key)
            if block is not None and block.ref_cnt == 0:
                ready += 1
        return ready

    def lookup(self, keys: Iterable[OffloadKey]) -> int:
        if type(keys) is not list and isinstance(keys, SINGLE_KEY_TYPES):
            refuse_single_key(keys, "lookup")
        return leading_ready(self._blocks, keys)

    def prepare_load(self, keys: Iterable[OffloadKey]) -> CPULoadStoreSpec:
        """Pin ``keys``; :class:`BlockNotFoundError` / :class:`BlockNotReadyError` otherwise."""
        if type(keys) is not list and isinstance(keys, SINGLE_KEY_TYPES):
            refuse_single_key(keys, "prepare_load")
        keys = keys if type(keys) is list else list(keys)
        pinned = pin_all(self._blocks, keys)
        if isinstance(pinned, int):  # the index of a key not held ready; nothing stays pinned
            key = keys[pinned]
            if key not in self._blocks:
                raise BlockNotFoundError(f"cannot load {key!r}: it is not offloaded", key)
            raise BlockNotReadyError(f"cannot load {key!r}: its store has not completed", key)
        block_ids, newly_pinned = pinned
        self._num_evictable -= newly_pinned
        return CPULoadStoreSpec(block_ids)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        if type(keys) is not list and isinstance(keys, SINGLE_KEY_TYPES):
            refuse_single_key(keys, "touch")
        self._policy.touch(keys)

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        """Unpin ``keys``; :class:`BlockNotPinnedError` for a key no load holds."""
        if type(keys) is not list and isinstance(keys, SINGLE_KEY_TYPES):
            refuse_single_key(keys, "complete_load")
        keys = keys if type(keys) is list else list(keys)
        unpinned = unpin_all(self._blocks, keys)
        if isinstance(unpinned, int):  # the index of a key no load holds; every pin is back
            key = keys[unpinned]
            raise BlockNotPinnedError(f"cannot complete a load of {key!r}: no load holds it", key)
        if unpinned:
            self._num_evictable += len(unpinned)
            self._policy.became_evictable(unpinned)

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        if type(keys) is not list and isinstance(keys, SINGLE_KEY_TYPES):
            refuse_single_key(keys, "prepare_store")
        blocks = self._blocks
        offered = distinct(keys)  # each key once, in order (a new list)
        if not offered:  # Most offers behind an admission filter: nothing to store.
            return PrepareStoreOutput([], _NO_STORE, [])
        # Usually none is held: then one pass in C (a set intersection) finds that.
        held = blocks.keys() & offered
        to_store = [key for key in offered if key not in blocks] if held else offered
        if not to_store:
            return PrepareStoreOutput([], _NO_STORE, [])

        evicted_keys: list[OffloadKey] = []
        need = len(to_store) - self.num_free_blocks
        if need > 0:
            if need > self._num_evictable - (self._num_ready_among(held) if held else 0):
                return None
            # Offered keys are shielded from this eviction.
            victims = self._policy.evict(need, set(offered))
            if victims is None:
                return None
            self._num_evictable -= len(victims)
            evicted_keys = drop_victims(blocks, victims, self._free)
            self._events.record(evicted_keys, MEDIUM, removed=True)

        new_blocks = self._allocate(len(to_store))
        block_ids = claim_pending(new_blocks)
        store_pairs(blocks, to_store, new_blocks)
        self._policy.insert(to_store, new_blocks)
        return PrepareStoreOutput(to_store, CPULoadStoreSpec(block_ids), evicted_keys)

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        if type(keys) is not list and isinstance(keys, SINGLE_KEY_TYPES):
            refuse_single_key(keys, "complete_store")
        blocks = self._blocks
        if success:
            changed = mark_ready(blocks, keys)
            if changed:
                self._num_evictable += len(changed)
                self._policy.became_evictable(changed)
                self._events.record(changed, MEDIUM, removed=False)
            return
        free = self._free
        dropped: list[OffloadKey] = []
        for key in keys:
            block = blocks.get(key)
            if block is not None and block.ref_cnt == PENDING_STORE:
                del blocks[key]
                free.append(block)
                dropped.append(key)
        if dropped:
            self._policy.remove(dropped)

    def remove(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """Drop the ready, unpinned blocks among ``keys`` (a tier found their bytes broken).

        Their slots are free at once; pending or pinned blocks stay. Returns
        the keys dropped; no event is recorded (the caller reports its own).
        """
        if type(keys) is not list and isinstance(keys, SINGLE_KEY_TYPES):
            refuse_single_key(keys, "remove")
        blocks = self._blocks
        removed: list[OffloadKey] = []
        for key in keys:
            block = blocks.get(key)
            if block is not None and block.ref_cnt == 0:
                del blocks[key]
                self._free.append(block)
                removed.append(key)
        if removed:
            self._num_evictable -= len(removed)
            self._policy.remove(removed)
        return removed

    def take_events(self) -> list[OffloadingEvent]:
        """Events since the last call, detached at once: none is lost or replayed."""
        return self._events.take()

    def _allocate(self, n: int) -> list[BlockStatus]:
        """Blocks for ``n`` slots: fresh ids first, then freed ones, last freed first (the
        caller marks them pending: :func:`~kvoffload.policies.loops.claim_pending`)."""
        fresh = min(n, self.num_blocks - self._num_allocated)
        new_blocks = [
            BlockStatus(block_id)
            for block_id in range(self._num_allocated, self._num_allocated + fresh)
        ]
        self._num_allocated += fresh
        reused = n - fresh
        if reused:
            free = self._free
            recycled = free[-reused:]
            del free[-reused:]
            recycled.reverse()
            new_blocks += recycled
        return new_blocks


_NO_STORE = CPULoadStoreSpec(np.empty(0, dtype=np.int64))
"""The spec of a store of nothing, shared: most offers behind an admission layer store
nothing, and making a spec costs an abstract-class ``isinstance`` test (about 1 us)."""
