"""The CPU manager against a literal reading of vLLM's seed-era manager, LRU and ARC.

The reference below follows the reference notes (sections 2.1-2.3) line by line: its own
slot pool, its own policies (ARC with the T1 fallback we keep on purpose), vLLM's
``assert`` where we raise. Unlike the policy differential, nothing is shared with the
code under test, so the whole path is compared: hits, the slot ids of every store and
load (fresh ascending, then last freed first), the victims in eviction order, refusals,
and every event in order. The model test checks the states; this checks the choices.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

import hypothesis.strategies as st
from hypothesis import given, settings

from kvoffload import BlockStateError, CPUOffloadingManager, OffloadKey, block_id_key

PENDING = -1


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id, self.ref_cnt = block_id, PENDING


def evictable(table: OrderedDict[OffloadKey, Block], protected: Container[OffloadKey]) -> list:  # type: ignore[type-arg]
    return [k for k, b in table.items() if b.ref_cnt == 0 and k not in protected]


class SeedLRU:
    def __init__(self, capacity: int) -> None:
        self.order: OrderedDict[OffloadKey, Block] = OrderedDict()

    def get(self, key: OffloadKey) -> Block | None:
        return self.order.get(key)

    def insert(self, key: OffloadKey, block: Block) -> None:
        self.order[key] = block

    def remove(self, key: OffloadKey) -> None:
        del self.order[key]

    def touch(self, keys: list[OffloadKey]) -> None:
        for key in reversed(keys):
            if key in self.order:
                self.order.move_to_end(key)

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        victims = evictable(self.order, protected)[:n]
        if len(victims) < n:
            return None
        for key in victims:
            del self.order[key]
        return victims


class SeedARC:
    def __init__(self, capacity: int) -> None:
        self.capacity, self.p = capacity, 0.0
        self.t1: OrderedDict[OffloadKey, Block] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, Block] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def get(self, key: OffloadKey) -> Block | None:
        return self.t1.get(key) or self.t2.get(key)

    def insert(self, key: OffloadKey, block: Block) -> None:
        self.t1[key] = block
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: OffloadKey) -> None:
        if self.t1.pop(key, None) is None:
            del self.t2[key]

    def touch(self, keys: list[OffloadKey]) -> None:
        for key in reversed(keys):
            if key in self.t1:
                block = self.t1.pop(key)
                (self.t2 if block.ref_cnt >= 0 else self.t1)[key] = block
            elif key in self.t2:
                self.t2.move_to_end(key)
            elif key in self.b1:
                self.p = min(self.p + max(1, len(self.b2) / len(self.b1)), self.capacity)
                self.b1.move_to_end(key)
            elif key in self.b2:
                self.p = max(self.p - max(1, len(self.b1) / len(self.b2)), 0)
                self.b2.move_to_end(key)

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        chosen: list[tuple[OffloadKey, bool]] = []
        virtual_t1 = len(self.t1)
        for _ in range(n):
            taken = {key for key, _ in chosen}
            t1 = [k for k in evictable(self.t1, protected) if k not in taken]
            t2 = [k for k in evictable(self.t2, protected) if k not in taken]
            if t1 and virtual_t1 >= int(self.p):
                chosen.append((t1[0], True))
            elif t2:
                chosen.append((t2[0], False))
            elif t1:  # the fallback vLLM's seed lacked
                chosen.append((t1[0], True))
            else:
                return None
            virtual_t1 -= chosen[-1][1]
        for key, from_t1 in chosen:
            del (self.t1 if from_t1 else self.t2)[key]
            (self.b1 if from_t1 else self.b2)[key] = None
        for ghosts in (self.b1, self.b2):
            while len(ghosts) > self.capacity:
                ghosts.popitem(last=False)
        return [key for key, _ in chosen]


class SeedManager:
    def __init__(self, num_blocks: int, policy: str) -> None:
        self.num_blocks, self.num_allocated = num_blocks, 0
        self.free: list[int] = []
        self.policy = SeedLRU(num_blocks) if policy == "lru" else SeedARC(num_blocks)
        self.events: list[tuple[list[OffloadKey], bool]] = []
        self.slot_of: dict[OffloadKey, int] = {}

    def lookup(self, keys: list[OffloadKey]) -> int:
        hits = 0
        for key in keys:
            block = self.policy.get(key)
            if block is None or block.ref_cnt < 0:
                break
            hits += 1
        return hits

    def prepare_load(self, keys: list[OffloadKey]) -> list[int]:
        blocks = [self.policy.get(key) for key in keys]
        assert all(b is not None and b.ref_cnt >= 0 for b in blocks)
        for block in blocks:
            block.ref_cnt += 1  # type: ignore[union-attr]
        return [block.block_id for block in blocks]  # type: ignore[union-attr]

    def touch(self, keys: list[OffloadKey]) -> None:
        self.policy.touch(keys)

    def complete_load(self, keys: list[OffloadKey]) -> None:
        for key in keys:
            block = self.policy.get(key)
            assert block is not None and block.ref_cnt >= keys.count(key)
        for key in keys:
            self.policy.get(key).ref_cnt -= 1  # type: ignore[union-attr]

    def prepare_store(self, keys: list[OffloadKey]) -> object:
        to_store = [k for k in dict.fromkeys(keys) if self.policy.get(k) is None]
        if not to_store:
            return [], [], []
        need = len(to_store) - (len(self.free) + self.num_blocks - self.num_allocated)
        evicted: list[OffloadKey] = []
        if need > 0:
            victims = self.policy.evict(need, set(keys))
            if victims is None:
                return None
            evicted = victims
            self.free += [self.slot_of.pop(key) for key in victims]
            self.events.append((evicted, True))
        ids = []
        for key in to_store:
            if self.num_allocated < self.num_blocks:
                ids.append(self.num_allocated)
                self.num_allocated += 1
            else:
                ids.append(self.free.pop())
            self.policy.insert(key, Block(ids[-1]))
            self.slot_of[key] = ids[-1]
        return to_store, ids, evicted

    def complete_store(self, keys: list[OffloadKey], success: bool) -> None:
        changed = []
        for key in keys:
            block = self.policy.get(key)
            if block is not None and block.ref_cnt == PENDING:
                changed.append(key)
                if success:
                    block.ref_cnt = 0
                else:
                    self.policy.remove(key)
                    self.free.append(self.slot_of.pop(key))
        if success and changed:
            self.events.append((changed, False))

    def take_events(self) -> list[tuple[list[OffloadKey], bool]]:
        events, self.events = self.events, []
        return events


def call(manager: CPUOffloadingManager | SeedManager, op: str, keys: list[OffloadKey]) -> object:
    """One call; what a caller observes (an error on a bad call, for both alike)."""
    try:
        if op == "store":
            out = manager.prepare_store(keys)
            if isinstance(manager, SeedManager) or out is None:
                return out
            return out.keys_to_store, out.store_spec.block_ids.tolist(), out.evicted_keys  # type: ignore[attr-defined]
        if op == "load":
            spec = manager.prepare_load(keys)
            return spec if isinstance(spec, list) else spec.block_ids.tolist()
        if op == "events":
            events = manager.take_events()
            return [e if isinstance(e, tuple) else (e.keys, e.removed) for e in events]
        return {
            "lookup": lambda: manager.lookup(keys),
            "touch": lambda: manager.touch(keys),
            "unload": lambda: manager.complete_load(keys),
            "complete": lambda: manager.complete_store(keys, True),
            "fail": lambda: manager.complete_store(keys, False),
        }[op]()
    except (AssertionError, BlockStateError):
        return "refused"


KEYS = [block_id_key(i) for i in range(6)]
CALLS = ["lookup", "store", "complete", "fail", "touch", "load", "unload", "events"]
OPS = st.lists(
    st.tuples(
        st.sampled_from([*CALLS, "complete pending", "load ready", "unload pinned"]),
        st.lists(st.sampled_from(KEYS), max_size=5),
    ),
    min_size=20,  # shorter runs seldom fill the tier and choose a victim
    max_size=80,
)


@settings(max_examples=400, deadline=None)
@given(policy=st.sampled_from(["lru", "arc"]), capacity=st.integers(1, 5), ops=OPS)
def test_the_manager_decides_as_the_seed_reference(
    policy: str, capacity: int, ops: list[tuple[str, list[OffloadKey]]]
) -> None:
    ours = CPUOffloadingManager(capacity, policy, enable_events=True)
    seed = SeedManager(capacity, policy)
    for op, keys in ops:
        if op == "complete pending":  # the calls a driver makes, so blocks get ready
            op, keys = "complete", [k for k in KEYS if (b := seed.policy.get(k)) and b.ref_cnt < 0]
        elif op == "load ready":
            op, keys = "load", [k for k in keys if (b := seed.policy.get(k)) and b.ref_cnt >= 0]
        elif op == "unload pinned":
            op, keys = (
                "unload",
                [k for k in dict.fromkeys(keys) if (b := seed.policy.get(k)) and b.ref_cnt > 0],
            )
        assert call(ours, op, keys) == call(seed, op, keys), (op, keys)
    assert call(ours, "events", []) == call(seed, "events", [])
