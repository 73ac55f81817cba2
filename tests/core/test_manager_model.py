"""Model-based tests: the manager (with and without the reuse filter) against a plain model.

After every step: lookups agree with the model's longest ready prefix, slot
ids are unique and in range, the held blocks and their states match the
model, and replaying all events gives exactly the ready set. A ``None`` from
``prepare_store`` must leave every bit of state as it was; evictions may only
take ready, unpinned keys outside the offer.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvoffload import (
    BlockStateError,
    CPUOffloadingManager,
    FilterReusedOffloadingManager,
    OffloadingManager,
    OffloadKey,
    block_id_key,
)

UNIVERSE = [block_id_key(i) for i in range(5)]
KEY_LISTS = st.lists(st.sampled_from(UNIVERSE), max_size=6)
PENDING = -1


def snapshot(m: CPUOffloadingManager) -> object:
    status = {k: (b.block_id, b.ref_cnt) for k, b in m._blocks.items()}
    policy = {name: list(v) if hasattr(v, "keys") else v for name, v in vars(m.policy).items()}
    return status, policy, [b.block_id for b in m._free], m._num_allocated


class ManagerMachine(RuleBasedStateMachine):
    policy = "lru"
    use_filter = False

    @initialize(capacity=st.integers(1, 3), threshold=st.integers(2, 3), tracker=st.integers(1, 6))
    def setup(self, capacity: int, threshold: int, tracker: int) -> None:
        self.capacity = capacity
        self.cpu = CPUOffloadingManager(capacity, self.policy, enable_events=True)
        self.manager: OffloadingManager = self.cpu
        if self.use_filter:
            self.manager = FilterReusedOffloadingManager(self.cpu, threshold, tracker)
        self.threshold, self.tracker = threshold, tracker
        self.ref: dict[OffloadKey, int] = {}  # model: key -> ref count (PENDING = -1)
        self.slot: dict[OffloadKey, int] = {}
        self.counts: list[list[Any]] = []  # model tracker: [key, count], least recent first
        self.replayed: set[OffloadKey] = set()

    def count_lookup(self, keys: list[OffloadKey]) -> None:
        for key in keys:
            entry = next((e for e in self.counts if e[0] == key), None)
            if entry is None:
                if len(self.counts) >= self.tracker:
                    self.counts.pop(0)
                self.counts.append([key, 1])
            else:
                self.counts.remove(entry)
                entry[1] += 1
                self.counts.append(entry)

    def eligible(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        if not self.use_filter:
            return keys
        seen = {key: count for key, count in self.counts}
        return [k for k in keys if seen.get(k, 0) >= self.threshold]

    @rule(keys=KEY_LISTS)
    def lookup(self, keys: list[OffloadKey]) -> None:
        expected = 0
        for key in keys:
            if self.ref.get(key, PENDING) < 0:
                break
            expected += 1
        if self.use_filter:
            self.count_lookup(keys)
        assert self.manager.lookup(iter(keys)) == expected

    @rule(keys=KEY_LISTS)
    def touch(self, keys: list[OffloadKey]) -> None:
        self.manager.touch(iter(keys))

    @rule(keys=KEY_LISTS)
    def prepare_store(self, keys: list[OffloadKey]) -> None:
        offered = list(dict.fromkeys(self.eligible(keys)))
        to_store = [k for k in offered if k not in self.ref]
        evictable = {k for k, r in self.ref.items() if r == 0 and k not in offered}
        need = len(to_store) - (self.capacity - len(self.ref))
        before = snapshot(self.cpu)
        out = self.manager.prepare_store(iter(keys))
        if to_store and need > len(evictable):
            assert out is None
            assert snapshot(self.cpu) == before
            return
        assert out is not None
        assert out.keys_to_store == to_store
        assert len(out.evicted_keys) == max(need, 0)
        assert set(out.evicted_keys) <= evictable
        assert len(set(out.evicted_keys)) == len(out.evicted_keys)
        for key in out.evicted_keys:
            del self.ref[key], self.slot[key]
        for key, block_id in zip(to_store, out.store_spec.block_ids.tolist(), strict=True):  # type: ignore[attr-defined]
            self.ref[key] = PENDING
            self.slot[key] = block_id

    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        ready = sorted(k for k, r in self.ref.items() if r >= 0)
        if not ready:
            return
        keys = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=4))
        spec = self.manager.prepare_load(iter(keys))
        assert spec.block_ids.tolist() == [self.slot[k] for k in keys]  # type: ignore[attr-defined]
        for key in keys:
            self.ref[key] += 1

    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        pinned = sorted(k for k, r in self.ref.items() if r > 0)
        if not pinned:
            return
        keys = data.draw(st.lists(st.sampled_from(pinned), min_size=1, max_size=3, unique=True))
        self.manager.complete_load(iter(keys))
        for key in keys:
            self.ref[key] -= 1

    @rule(keys=KEY_LISTS, success=st.booleans())
    def complete_store(self, keys: list[OffloadKey], success: bool) -> None:
        self.manager.complete_store(iter(keys), success)
        for key in dict.fromkeys(keys):
            if self.ref.get(key) == PENDING:
                if success:
                    self.ref[key] = 0
                else:
                    del self.ref[key], self.slot[key]

    @rule(key=st.sampled_from(UNIVERSE))
    def bad_calls_change_nothing(self, key: OffloadKey) -> None:
        before = snapshot(self.cpu)
        if self.ref.get(key, PENDING) < 0:
            try:
                self.manager.prepare_load([*[k for k, r in self.ref.items() if r >= 0], key])
            except BlockStateError as exc:
                assert exc.key == key
            else:
                raise AssertionError("prepare_load of a missing or pending key succeeded")
        if self.ref.get(key, 0) <= 0:
            try:
                self.manager.complete_load([key])
            except BlockStateError as exc:
                assert exc.key == key
            else:
                raise AssertionError("complete_load of an unpinned key succeeded")
        assert snapshot(self.cpu) == before

    @invariant()
    def state_matches_model(self) -> None:
        if not hasattr(self, "cpu"):
            return
        held = {k: (b.block_id, b.ref_cnt) for k, b in self.cpu._blocks.items()}
        assert held == {k: (self.slot[k], self.ref[k]) for k in self.ref}
        slots = [block_id for block_id, _ in held.values()]
        assert len(set(slots)) == len(slots)
        assert all(0 <= s < self.capacity for s in slots)
        for event in self.manager.take_events():
            if event.removed:
                self.replayed.difference_update(event.keys)
            else:
                self.replayed.update(event.keys)
        assert self.replayed == {k for k, r in self.ref.items() if r >= 0}


SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None)


def machine(policy: str, use_filter: bool) -> type[ManagerMachine]:
    return type(
        f"{policy.upper()}{'Filtered' if use_filter else ''}Machine",
        (ManagerMachine,),
        {"policy": policy, "use_filter": use_filter},
    )


TestLRU = SETTINGS(machine("lru", False)).TestCase
TestLRUFiltered = SETTINGS(machine("lru", True)).TestCase
TestARC = SETTINGS(machine("arc", False)).TestCase
TestARCFiltered = SETTINGS(machine("arc", True)).TestCase
