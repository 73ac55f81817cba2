"""LRU under the CPU manager sets aside pinned and pending blocks its evictions walked past
(vLLM's #46216): the next eviction starts past them, and every decision is the one a walk
over every block makes."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence

import hypothesis.strategies as st
from hypothesis import given, settings
from parking_drivers import (
    KEYS,
    MANAGER_OPS,
    CountingBlock,
    drive,
    random_ops,
    turn_ref_counts,
)

from kvoffload import CPUOffloadingManager, block_id_key
from kvoffload.core.keys import OffloadKey
from kvoffload.policies.base import BlockStatus, CachePolicy, Victims
from kvoffload.policies.lru import LRUCachePolicy
from kvoffload.policies.registry import register_cache_policy


@register_cache_policy("walking-lru")
class WalkingLRU(CachePolicy):
    """The literal rule: one order of every block, each eviction walks it from the front."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.order: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()

    def insert(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus]) -> None:
        self.order.update(zip(keys, blocks, strict=True))

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            self.order.pop(key, None)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        for key in reversed(list(keys)):
            if key in self.order:
                self.order.move_to_end(key)

    def evict(self, n: int, protected: Container[OffloadKey]) -> Victims | None:
        victims = [
            (key, block)
            for key, block in self.order.items()
            if block.ref_cnt == 0 and key not in protected
        ][:n]
        if len(victims) < n:
            return None
        for key, _ in victims:
            del self.order[key]
        return victims


def test_an_eviction_does_not_walk_again_the_pinned_blocks_the_last_one_walked() -> None:
    policy = LRUCachePolicy(1000)
    policy.follow_evictable()
    keys = [block_id_key(i) for i in range(1000)]
    blocks = [CountingBlock(i) for i in range(1000)]
    for block in blocks:
        block.ref_cnt = 1 if block.block_id < 900 else 0
    policy.insert(keys, blocks)
    assert policy.evict(1, set()) == [(keys[900], blocks[900])]
    CountingBlock.reads = 0
    assert policy.evict(2, set()) == [(keys[901], blocks[901]), (keys[902], blocks[902])]
    assert CountingBlock.reads <= 4  # was 902: every pinned block read again
    # Released, the least recent pinned block is the next victim, as in the walk.
    blocks[3].ref_cnt = 0
    policy.became_evictable([keys[3]])
    assert policy.evict(2, set()) == [(keys[3], blocks[3]), (keys[903], blocks[903])]
    assert list(policy.coldest())[:3] == keys[:3]
    assert len(policy.coldest()) == 995


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 7), seed=st.integers(0, 2**32 - 1))
def test_lru_decides_as_the_walk_over_every_block(capacity: int, seed: int) -> None:
    lru = CPUOffloadingManager(capacity, "lru", enable_events=True)
    walking = CPUOffloadingManager(capacity, "walking-lru", enable_events=True)
    for op, ids, _ in random_ops(seed, MANAGER_OPS, 150):
        keys = [KEYS[i % len(KEYS)] for i in ids]
        assert drive(lru, op, keys, 0) == drive(walking, op, keys, 0)
        assert list(lru.policy.coldest()) == list(walking.policy.order)
        assert len(lru.policy.coldest()) == len(walking.policy.order)
        assert all(key in lru.policy.coldest() for key in walking.policy.order)
        assert lru.take_events() == walking.take_events()


def test_the_walk_rule_holds_where_parking_happens() -> None:
    """The property above sees blocks set aside (else it would prove nothing new)."""
    m = CPUOffloadingManager(4, "lru")
    out = m.prepare_store(KEYS[:4])
    assert out is not None
    m.complete_store(KEYS[:4])
    m.prepare_load(KEYS[:2])
    out = m.prepare_store(KEYS[4:5])
    assert out is not None and out.evicted_keys == KEYS[2:3]
    m.complete_load(KEYS[1:2])
    out = m.prepare_store(KEYS[5:6])  # 1 was unpinned: less recent than 3
    assert out is not None and out.evicted_keys == KEYS[1:2]
    assert list(m.policy.coldest()) == [KEYS[0], KEYS[3], KEYS[4], KEYS[5]]


POLICY_OPS = ["insert", "ready", "pin", "unpin", "touch", "remove", "evict"]


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_lru_policy_alone_decides_as_the_walk_failed_evictions_included(seed: int) -> None:
    """Driven directly (an eviction the manager would not ask for fails and changes nothing),
    over the same block objects as the walking rule."""
    lru, walking = LRUCachePolicy(10), WalkingLRU(10)
    lru.follow_evictable()
    blocks: dict[OffloadKey, BlockStatus] = {}
    for op, ids, n in random_ops(seed, POLICY_OPS, 150):
        keys = list(dict.fromkeys(KEYS10[i] for i in ids))
        if op == "insert":
            new = [key for key in keys if key not in blocks]
            statuses = [BlockStatus(len(blocks)) for _ in new]
            blocks.update(zip(new, statuses, strict=True))
            lru.insert(new, statuses)
            walking.insert(new, statuses)
        elif op == "remove":
            for policy in (lru, walking):
                policy.remove(keys)
            for key in keys:
                blocks.pop(key, None)
        elif op == "touch":
            lru.touch(keys)
            walking.touch(keys)
        elif op == "evict":
            protected = set(keys)
            victims = lru.evict(n, protected)
            assert victims == walking.evict(n, protected)
            for key, _ in victims or ():
                del blocks[key]
        else:
            turned = turn_ref_counts(blocks, op, keys)
            lru.became_evictable(turned)
        assert list(lru.coldest()) == list(walking.order)


KEYS10 = [block_id_key(i) for i in range(10)]
