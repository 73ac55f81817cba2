"""A literal, unoptimised rendering of the seed-era manager family, as a same-run baseline.

Written here from the behaviour described in the reference notes (sections
2.1-2.3 and 3.1), step by step and with the seed's data structures: a ctypes
``BlockStatus`` per stored block, one policy call per key, an eager numpy
array per spec, ARC rescanning T1/T2 for every victim, and the seed-era ARC
behaviour (no T1 fallback). It exists only so that ``manager.py`` can report
the speed of kvoffload's managers as a ratio against it, measured in the same
process on the same machine; it is not part of the package.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from collections.abc import Iterable, Iterator

import numpy as np

from kvoffload import (
    FilterReusedOffloadingManager,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
)
from kvoffload.core.manager import OffloadingEvent
from kvoffload.core.specs import LoadStoreSpec


class SeedBlockStatus(ctypes.Structure):
    _fields_ = [("ref_cnt", ctypes.c_int32), ("block_id", ctypes.c_int64)]

    def __init__(self, block_id: int) -> None:
        super().__init__()
        self.ref_cnt = -1
        self.block_id = block_id

    @property
    def is_ready(self) -> bool:
        return bool(self.ref_cnt >= 0)


class EagerCPUSpec(LoadStoreSpec):
    def __init__(self, block_ids: list[int]) -> None:
        self.block_ids = np.array(block_ids, dtype=np.int64)

    @staticmethod
    def medium() -> str:
        return "CPU"


Victims = list[tuple[OffloadKey, SeedBlockStatus]]


class SeedLRU:
    def __init__(self, cache_capacity: int) -> None:
        self.blocks: OrderedDict[OffloadKey, SeedBlockStatus] = OrderedDict()

    def get(self, key: OffloadKey) -> SeedBlockStatus | None:
        return self.blocks.get(key)

    def insert(self, key: OffloadKey, block: SeedBlockStatus) -> None:
        self.blocks[key] = block

    def remove(self, key: OffloadKey) -> None:
        del self.blocks[key]

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        for key in reversed(list(keys)):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def evict(self, n: int, protected: set[OffloadKey]) -> Victims | None:
        if n == 0:
            return []
        candidates: Victims = []
        for key, block in self.blocks.items():
            if block.ref_cnt == 0 and key not in protected:
                candidates.append((key, block))
                if len(candidates) == n:
                    break
        if len(candidates) < n:
            return None
        for key, _ in candidates:
            del self.blocks[key]
        return candidates


class SeedARC:
    def __init__(self, cache_capacity: int) -> None:
        self.cache_capacity = cache_capacity
        self.target_t1_size = 0.0
        self.t1: OrderedDict[OffloadKey, SeedBlockStatus] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, SeedBlockStatus] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def get(self, key: OffloadKey) -> SeedBlockStatus | None:
        return self.t1.get(key) or self.t2.get(key)

    def insert(self, key: OffloadKey, block: SeedBlockStatus) -> None:
        self.t1[key] = block
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: OffloadKey) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        for key in reversed(list(keys)):
            if key in self.t1:
                block = self.t1[key]
                if not block.is_ready:
                    self.t1.move_to_end(key)
                else:
                    del self.t1[key]
                    self.t2[key] = block
            elif key in self.t2:
                self.t2.move_to_end(key)
            elif key in self.b1:
                delta = max(1, len(self.b2) / len(self.b1))
                self.target_t1_size = min(self.target_t1_size + delta, self.cache_capacity)
                self.b1.move_to_end(key)
            elif key in self.b2:
                delta = max(1, len(self.b1) / len(self.b2))
                self.target_t1_size = max(self.target_t1_size - delta, 0)
                self.b2.move_to_end(key)

    def evict(self, n: int, protected: set[OffloadKey]) -> Victims | None:
        if n == 0:
            return []
        chosen: list[tuple[OffloadKey, SeedBlockStatus, bool]] = []
        chosen_keys: set[OffloadKey] = set()
        virtual_t1 = len(self.t1)
        for _ in range(n):
            victim = None
            if virtual_t1 >= int(self.target_t1_size):
                for key, block in self.t1.items():
                    if block.ref_cnt == 0 and key not in protected and key not in chosen_keys:
                        victim = (key, block, True)
                        virtual_t1 -= 1
                        break
            if victim is None:
                for key, block in self.t2.items():
                    if block.ref_cnt == 0 and key not in protected and key not in chosen_keys:
                        victim = (key, block, False)
                        break
            if victim is None:
                return None
            chosen.append(victim)
            chosen_keys.add(victim[0])
        for key, _, from_t1 in chosen:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        while len(self.b1) > self.cache_capacity:
            self.b1.popitem(last=False)
        while len(self.b2) > self.cache_capacity:
            self.b2.popitem(last=False)
        return [(key, block) for key, block, _ in chosen]


class SeedCPUManager(OffloadingManager):
    def __init__(
        self, num_blocks: int, cache_policy: str = "lru", enable_events: bool = False
    ) -> None:
        self._num_blocks = num_blocks
        self._num_allocated_blocks = 0
        self._free_list: list[int] = []
        self._policy = {"lru": SeedLRU, "arc": SeedARC}[cache_policy](num_blocks)
        self.events: list[OffloadingEvent] | None = [] if enable_events else None

    def _free_count(self) -> int:
        return len(self._free_list) + self._num_blocks - self._num_allocated_blocks

    def _allocate(self, keys: list[OffloadKey]) -> list[SeedBlockStatus]:
        blocks = []
        for _ in keys:
            if self._num_allocated_blocks < self._num_blocks:
                block_id = self._num_allocated_blocks
                self._num_allocated_blocks += 1
            else:
                block_id = self._free_list.pop()
            blocks.append(SeedBlockStatus(block_id))
        return blocks

    def lookup(self, keys: Iterable[OffloadKey]) -> int:
        hits = 0
        for key in keys:
            block = self._policy.get(key)
            if block is None or not block.is_ready:
                break
            hits += 1
        return hits

    def prepare_load(self, keys: Iterable[OffloadKey]) -> LoadStoreSpec:
        ids = []
        for key in keys:
            block = self._policy.get(key)
            assert block is not None and block.is_ready
            block.ref_cnt += 1
            ids.append(block.block_id)
        return EagerCPUSpec(ids)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        self._policy.touch(keys)

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            block = self._policy.get(key)
            assert block is not None and block.ref_cnt > 0
            block.ref_cnt -= 1

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        keys_list = list(keys)
        to_store = [key for key in keys_list if self._policy.get(key) is None]
        if not to_store:
            return PrepareStoreOutput([], EagerCPUSpec([]), [])
        evicted: list[OffloadKey] = []
        need = len(to_store) - self._free_count()
        if need > 0:
            victims = self._policy.evict(need, set(keys_list))
            if victims is None:
                return None
            for key, block in victims:
                self._free_list.append(block.block_id)
                evicted.append(key)
            if self.events is not None:
                self.events.append(OffloadingEvent(evicted, "CPU", removed=True))
        blocks = self._allocate(to_store)
        for key, block in zip(to_store, blocks, strict=True):
            self._policy.insert(key, block)
        return PrepareStoreOutput(to_store, EagerCPUSpec([b.block_id for b in blocks]), evicted)

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        changed = []
        for key in keys:
            block = self._policy.get(key)
            if block is not None and block.ref_cnt == -1:
                if success:
                    block.ref_cnt = 0
                else:
                    self._policy.remove(key)
                    self._free_list.append(block.block_id)
                changed.append(key)
        if success and changed and self.events is not None:
            self.events.append(OffloadingEvent(changed, "CPU", removed=False))

    def take_events(self) -> Iterator[OffloadingEvent]:
        if self.events is not None:
            yield from self.events
            self.events.clear()


class SeedFilter(FilterReusedOffloadingManager):
    """The seed's counting and filtering; everything else is plain delegation, shared.

    It keeps the seed's own ``OrderedDict`` tracker from the start (the package's
    filter starts with a plain dict while its tracker fills).
    """

    def __init__(
        self, backing: OffloadingManager, store_threshold: int, max_tracker_size: int
    ) -> None:
        super().__init__(backing, store_threshold, max_tracker_size)
        self.tracker: OrderedDict[OffloadKey, int] = OrderedDict()

    def lookup(self, keys: Iterable[OffloadKey]) -> int | None:
        keys = list(keys)
        for key in keys:
            if key in self.tracker:
                self.tracker.move_to_end(key)
                self.tracker[key] += 1
            else:
                if len(self.tracker) >= self.max_tracker_size:
                    self.tracker.popitem(last=False)
                self.tracker[key] = 1
        return self.backing.lookup(keys)

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        eligible = [k for k in keys if self.tracker.get(k, 0) >= self.store_threshold]
        return self.backing.prepare_store(eligible)


def build_seed_manager(
    num_blocks: int, policy: str, store_threshold: int, max_tracker_size: int = 64_000
) -> OffloadingManager:
    manager: OffloadingManager = SeedCPUManager(num_blocks, policy)
    if store_threshold >= 2:
        manager = SeedFilter(manager, store_threshold, max_tracker_size)
    return manager
