"""The engine's GPU prefix cache: a fixed pool of block slots with LRU reuse.

Modelled on vLLM's block pool. Every block a running request uses occupies a
slot in ``[0, num_blocks)``; a slot whose block is complete (computed or
loaded) is registered under its key so later requests can share it. When a
request finishes, its slots are released tail first, so its first block ends
up most recently used; released slots that still hold a registered block
stay cached and are reused least recently released first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import OffloadKey
from kvoffload.core.memory import check_fits

BYTES_PER_SLOT = 160
"""A generous estimate of what the pool's index costs per slot once it is in use."""


class GPUPrefixCache:
    """Slot pool plus a key → slot index of the complete blocks it holds."""

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise InvalidArgumentError(
                f"the GPU needs an integer >= 1 of blocks, got {num_blocks!r}"
            )
        check_fits(num_blocks * BYTES_PER_SLOT, f"a GPU prefix cache of {num_blocks:,} blocks")
        self.num_blocks = num_blocks
        self.evictions = 0
        self._slot_of: dict[OffloadKey, int] = {}
        self._key_of: list[OffloadKey | None] = [None] * num_blocks
        self._refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, key: OffloadKey) -> bool:
        return key in self._slot_of

    def match(self, keys: Sequence[OffloadKey]) -> int:
        """Length of the leading run of ``keys`` held as complete blocks."""
        slot_of = self._slot_of
        hits = 0
        for key in keys:
            if key not in slot_of:
                break
            hits += 1
        return hits

    def fits(self, shared: Sequence[OffloadKey], num_new: int) -> bool:
        """Whether :meth:`acquire` of ``shared`` (all held) and ``num_new`` slots can succeed."""
        return self.fits_slots(self.slots_of(shared), num_new)

    def slots_of(self, keys: Sequence[OffloadKey]) -> list[int]:
        """The slots of ``keys``, all held: for :meth:`fits_slots` and :meth:`acquire_slots`."""
        slot_of = self._slot_of
        return [slot_of[key] for key in keys]

    def fits_slots(self, shared_slots: list[int], num_new: int) -> bool:
        """:meth:`fits`, given the shared blocks' slots."""
        # Cached blocks the request shares stop being reclaimable once it holds them.
        refs = self._refs
        idle_shared = [refs[slot] for slot in shared_slots].count(0)
        return num_new <= len(self._free) + len(self._cached) - idle_shared

    def acquire(self, keys: Sequence[OffloadKey], num_new: int) -> list[int]:
        """Take a reference on the slots of ``keys`` (all held) and ``num_new`` fresh slots.

        Returns the shared slots followed by the new ones. New slots come from
        the free list, then from the least recently released cached blocks,
        whose keys are dropped.
        """
        return self.acquire_slots(self.slots_of(keys), num_new)

    def acquire_slots(self, shared_slots: list[int], num_new: int) -> list[int]:
        """:meth:`acquire`, given the shared blocks' slots (the list is extended and returned)."""
        if not self.fits_slots(shared_slots, num_new):
            raise InvalidArgumentError(f"not enough GPU blocks for {num_new} new ones")
        refs, cached = self._refs, self._cached
        for slot in shared_slots:
            if refs[slot] == 0:
                del cached[slot]
            refs[slot] += 1
        free = self._free
        reused = min(num_new, len(free))
        if reused:
            taken = free[len(free) - reused :]
            del free[len(free) - reused :]
            taken.reverse()
            for slot in taken:
                refs[slot] = 1
            shared_slots += taken
        evict = num_new - reused
        if evict:
            slot_of, key_of = self._slot_of, self._key_of
            popitem = cached.popitem
            for _ in range(evict):
                slot = popitem(last=False)[0]
                del slot_of[key_of[slot]]  # type: ignore[arg-type]  # cached slots hold a key
                key_of[slot] = None
                refs[slot] = 1
                shared_slots.append(slot)
            self.evictions += evict
        return shared_slots

    def register(self, keys: Sequence[OffloadKey], slots: Sequence[int]) -> None:
        """Index the now complete blocks ``keys`` held in ``slots`` for sharing.

        A key already held elsewhere (a concurrent request computed it first)
        keeps its first slot; the duplicate slot is freed at release.
        """
        slot_of, key_of = self._slot_of, self._key_of
        for key, slot in zip(keys, slots, strict=True):
            if key not in slot_of:
                slot_of[key] = slot
                key_of[slot] = key

    def release(self, slots: Sequence[int]) -> None:
        """Drop one reference on each slot, last slot first (tail-first release)."""
        refs, cached, key_of, free = self._refs, self._cached, self._key_of, self._free
        for slot in reversed(slots):
            left = refs[slot] - 1
            refs[slot] = left
            if not left:
                if key_of[slot] is None:
                    free.append(slot)
                else:
                    cached[slot] = None
