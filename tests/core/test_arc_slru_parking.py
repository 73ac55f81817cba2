"""ARC and SLRU under the CPU manager set aside pinned and pending blocks their evictions
walked past (vLLM's #46216): the next eviction starts past them, and every decision is the
one the walking versions make. Those are the policies as they were, kept here word for word
as the reference."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from itertools import chain

import hypothesis.strategies as st
from hypothesis import given, settings
from parking_drivers import (
    KEYS,
    CountingBlock,
    drive,
    random_ops,
    request_end,
    turn_ref_counts,
)
from parking_drivers import MANAGER_OPS as BASE_OPS

from kvoffload import CPUOffloadingManager, block_id_key
from kvoffload.core.keys import OffloadKey
from kvoffload.policies.arc import ARCCachePolicy
from kvoffload.policies.base import (
    BlockStatus,
    CachePolicy,
    Victims,
    remove_from_either,
    take_evictable,
)
from kvoffload.policies.registry import register_cache_policy
from kvoffload.policies.slru import SLRUCachePolicy, protected_limit


@register_cache_policy("walking-arc")
class WalkingARC(CachePolicy):
    """ARC as it was before it set blocks aside: every eviction walks T1 and T2 from the front."""

    recent_at_access = False

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.target_t1_size = 0.0
        self.t1: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def insert(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus]) -> None:
        self.t1.update(zip(keys, blocks, strict=True))
        b1, b2 = self.b1, self.b2
        if b1 or b2:
            for key in keys:
                if key in b1:
                    del b1[key]
                elif key in b2:
                    del b2[key]

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        remove_from_either(keys, self.t1, self.t2)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        for key in reversed(keys if isinstance(keys, list) else list(keys)):
            if key in t1:  # ``in`` then ``[]``: OrderedDict.get is several times slower
                block = t1[key]
                if block.ref_cnt >= 0:
                    del t1[key]
                    t2[key] = block
                else:
                    # Pending: just prepared for store, not really seen twice.
                    t1.move_to_end(key)
            elif key in t2:
                t2.move_to_end(key)
            elif key in b1:
                # max()/min() spelled out (first argument wins ties, as with the builtins).
                delta = len(b2) / len(b1)
                target = self.target_t1_size + (delta if delta > 1.0 else 1.0)
                self.target_t1_size = target if target <= self.capacity else self.capacity
                b1.move_to_end(key)
            elif key in b2:
                delta = len(b1) / len(b2)
                target = self.target_t1_size - (delta if delta > 1.0 else 1.0)
                self.target_t1_size = target if target >= 0.0 else 0.0
                b2.move_to_end(key)

    def store_missed(self, keys: Sequence[OffloadKey]) -> None:
        """Adapt to the ghosts among keys about to be stored (``touch`` of an absent key only
        adapts)."""
        if self.b1 or self.b2:
            self.touch(keys)

    def finish_request(
        self,
        keys: Sequence[OffloadKey],
        reused: Container[OffloadKey],
        stored_only: Container[OffloadKey],
    ) -> None:
        """As vLLM 0.32/0.33: a read moves a block from T1 to T2 (or up T2); a store only makes
        it recent in its own list; any other key (a store that got no slot) is left alone."""
        t1, t2 = self.t1, self.t2
        for key in reversed(keys):
            if key in t1:
                if key in reused:
                    t2[key] = t1.pop(key)
                elif key in stored_only:
                    t1.move_to_end(key)
            elif key in t2 and (key in reused or key in stored_only):
                t2.move_to_end(key)

    def evict(self, n: int, protected: Container[OffloadKey]) -> Victims | None:
        if n <= 0:
            return []
        t1_candidates = iter(self.t1.items())
        # Each victim taken from T1 shrinks it; T1 gives victims while it is at
        # or above the target, then T2, then T1 again (the fallback).
        t1_turns = len(self.t1) - int(self.target_t1_size) + 1
        first = take_evictable(t1_candidates, n if n < t1_turns else t1_turns, protected)
        second = take_evictable(iter(self.t2.items()), n - len(first), protected)
        fallback = take_evictable(t1_candidates, n - len(first) - len(second), protected)
        victims = first + second + fallback
        if len(victims) < n:
            return None
        self._apply(first + fallback, second)
        return victims

    def _apply(self, from_t1: Victims, from_t2: Victims) -> None:
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        for key, _ in from_t1:
            del t1[key]
            b1[key] = None
        for key, _ in from_t2:
            del t2[key]
            b2[key] = None
        for ghosts in (b1, b2):
            for _ in range(len(ghosts) - self.capacity):
                ghosts.popitem(False)


@register_cache_policy("walking-slru")
class WalkingSLRU(CachePolicy):
    """SLRU as it was before it set blocks aside: every eviction walks both segments."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.protected_limit = protected_limit(capacity)
        self.probation: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self.protected: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()

    def insert(self, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus]) -> None:
        self.probation.update(zip(keys, blocks, strict=True))

    def remove(self, keys: Iterable[OffloadKey]) -> None:
        remove_from_either(keys, self.probation, self.protected)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        probation, protected = self.probation, self.protected
        for key in reversed(keys if isinstance(keys, list) else list(keys)):
            if key in protected:
                protected.move_to_end(key)
            elif key in probation:
                block = probation[key]
                if block.ref_cnt >= 0:
                    del probation[key]
                    protected[key] = block
                else:
                    probation.move_to_end(key)
        self._demote()

    def finish_request(
        self,
        keys: Sequence[OffloadKey],
        reused: Container[OffloadKey],
        stored_only: Container[OffloadKey],
    ) -> None:
        """A read promotes, as a touch does; a store only makes its block recent in its own
        segment (promoting it would let every stored block into protected)."""
        probation, protected = self.probation, self.protected
        for key in reversed(keys):
            if key in protected:
                if key in reused or key in stored_only:
                    protected.move_to_end(key)
            elif key in probation:
                if key in reused and probation[key].ref_cnt >= 0:
                    protected[key] = probation.pop(key)
                elif key in reused or key in stored_only:
                    probation.move_to_end(key)
        self._demote()

    def _demote(self) -> None:
        """Move protected's least recent blocks beyond its share to probation's recent end."""
        probation, protected = self.probation, self.protected
        while len(protected) > self.protected_limit:
            key, block = protected.popitem(False)
            probation[key] = block

    def evict(self, n: int, protected: Container[OffloadKey]) -> Victims | None:
        if n <= 0:
            return []
        segments = chain(self.probation.items(), self.protected.items())
        victims = take_evictable(segments, n, protected)
        if len(victims) < n:
            return None
        probation, segment = self.probation, self.protected
        for key, _ in victims:
            if probation.pop(key, None) is None:
                del segment[key]
        return victims


def counting_blocks(pinned: int, total: int) -> tuple[list[OffloadKey], list[CountingBlock]]:
    """``total`` ready blocks, the first ``pinned`` of them pinned."""
    keys = [block_id_key(i) for i in range(total)]
    blocks = [CountingBlock(i) for i in range(total)]
    for block in blocks:
        block.ref_cnt = 1 if block.block_id < pinned else 0
    return keys, blocks


def no_second_walk(
    policy: CachePolicy, keys: list[OffloadKey], blocks: list[CountingBlock]
) -> None:
    """Blocks 0-899 pinned at the front of the order evictions take from (900 onwards)."""
    assert policy.evict(1, set()) == [(keys[900], blocks[900])]
    CountingBlock.reads = 0
    assert policy.evict(2, set()) == [(keys[901], blocks[901]), (keys[902], blocks[902])]
    assert CountingBlock.reads <= 4  # was 902: every pinned block read again
    # Released, the least recent pinned block is the next victim, as in the walk.
    blocks[3].ref_cnt = 0
    policy.became_evictable([keys[3]])
    CountingBlock.reads = 0
    assert policy.evict(2, set()) == [(keys[3], blocks[3]), (keys[903], blocks[903])]
    assert CountingBlock.reads <= 6


def test_an_arc_eviction_does_not_walk_again_the_pinned_blocks_of_t1() -> None:
    arc = ARCCachePolicy(1000)
    arc.follow_evictable()
    keys, blocks = counting_blocks(900, 1000)
    arc.insert(keys, blocks)
    no_second_walk(arc, keys, blocks)
    assert list(arc.t1) == keys[:3] + keys[4:900] + keys[904:]
    assert list(arc.b1) == [*keys[900:903], keys[3], keys[903]] and len(arc.t1) == 995


def test_an_arc_eviction_does_not_walk_again_the_pinned_blocks_of_t2() -> None:
    arc = ARCCachePolicy(1000)
    arc.follow_evictable()
    keys, blocks = counting_blocks(900, 1000)
    arc.insert(keys, blocks)
    arc.touch(keys[::-1])  # all into T2, 0 the least recent
    arc.target_t1_size = 1.0  # T1 (empty) below its target: T2 gives the victims
    no_second_walk(arc, keys, blocks)
    assert list(arc.t2) == keys[:3] + keys[4:900] + keys[904:] and not arc.t1
    assert list(arc.b2) == [*keys[900:903], keys[3], keys[903]]


def test_an_slru_eviction_does_not_walk_again_the_pinned_blocks_of_probation() -> None:
    slru = SLRUCachePolicy(1000)
    slru.follow_evictable()
    keys, blocks = counting_blocks(900, 1000)
    slru.insert(keys, blocks)
    no_second_walk(slru, keys, blocks)
    assert list(slru.probation) == keys[:3] + keys[4:900] + keys[904:]


def test_an_slru_eviction_does_not_walk_again_the_pinned_blocks_of_protected() -> None:
    slru = SLRUCachePolicy(1250)  # protected holds 1,000
    slru.follow_evictable()
    keys, blocks = counting_blocks(900, 1000)
    slru.insert(keys, blocks)
    slru.touch(keys[::-1])  # all protected, 0 the least recent; probation empty
    no_second_walk(slru, keys, blocks)
    assert list(slru.protected) == keys[:3] + keys[4:900] + keys[904:] and not slru.probation
    # Demotion takes protected's least recent blocks, the set-aside ones first, in order.
    slru.protected_limit = 990
    slru.touch([])
    assert list(slru.probation) == keys[:3] + keys[4:6]


MANAGER_OPS = [*BASE_OPS, "finish", "missed"]


def state(policy: CachePolicy) -> tuple[object, ...]:
    """Every list or segment in order, and ARC's target."""
    if isinstance(policy, ARCCachePolicy | WalkingARC):
        lists: tuple[Iterable[OffloadKey], ...] = (policy.t1, policy.t2, policy.b1, policy.b2)
        return (*(list(keys) for keys in lists), policy.target_t1_size)
    assert isinstance(policy, SLRUCachePolicy | WalkingSLRU)
    return list(policy.probation), list(policy.protected)


def same_lists(fast: CachePolicy, walking: CachePolicy) -> None:
    """The fast policy's lists hold what the walking ones do, as a whole."""
    assert state(fast) == state(walking)
    pairs = (
        [(fast.t1, walking.t1), (fast.t2, walking.t2)]
        if isinstance(fast, ARCCachePolicy) and isinstance(walking, WalkingARC)
        else [(fast.probation, walking.probation), (fast.protected, walking.protected)]  # type: ignore[attr-defined]
    )
    for mine, theirs in pairs:
        assert len(mine) == len(theirs)
        assert all(key in mine for key in theirs) and not any(key in mine for key in MISSING)


MISSING = [block_id_key(99)]


def parked_lists(policy: CachePolicy) -> set[str]:
    """The lists in which ``policy`` holds blocks set aside now."""
    if isinstance(policy, ARCCachePolicy):
        return {name for name in ("t1", "t2") if getattr(policy, name).parked}
    assert isinstance(policy, SLRUCachePolicy)
    return {name for name in ("probation", "protected") if getattr(policy, name).parked}


def through_managers(policy: str, capacity: int, seed: int) -> set[str]:
    """One random run through two managers, the fast policy's and the walking one's, equal
    after every call; returns the lists in which blocks were set aside on the way."""
    fast = CPUOffloadingManager(capacity, policy, enable_events=True)
    walking = CPUOffloadingManager(capacity, f"walking-{policy}", enable_events=True)
    seen: set[str] = set()
    for op, ids, n in random_ops(seed, MANAGER_OPS, 150):
        keys = [KEYS[i % len(KEYS)] for i in ids]
        assert drive(fast, op, keys, n) == drive(walking, op, keys, n)
        same_lists(fast.policy, walking.policy)
        assert fast.take_events() == walking.take_events()
        seen |= parked_lists(fast.policy)
    return seen


@settings(max_examples=300, deadline=None)
@given(
    policy=st.sampled_from(["arc", "slru"]),
    capacity=st.integers(1, 7),
    seed=st.integers(0, 2**32 - 1),
)
def test_arc_and_slru_decide_as_the_walking_versions(policy: str, capacity: int, seed: int) -> None:
    through_managers(policy, capacity, seed)


KEYS10 = [block_id_key(i) for i in range(10)]
POLICY_OPS = ["insert", "ready", "pin", "unpin", "touch", "remove", "evict", "evict"]
POLICY_OPS += ["finish", "missed"]


def directly(policy: str, capacity: int, seed: int) -> set[str]:
    """One random run of calls on the fast policy and the walking one themselves (an
    eviction the manager would not ask for fails and changes nothing), over the same block
    objects, equal after every call; returns the lists in which blocks were set aside."""
    fast: CachePolicy
    walking: CachePolicy
    if policy == "arc":
        fast, walking = ARCCachePolicy(capacity), WalkingARC(capacity)
    else:
        fast, walking = SLRUCachePolicy(capacity), WalkingSLRU(capacity)
    fast.follow_evictable()
    blocks: dict[OffloadKey, BlockStatus] = {}
    seen: set[str] = set()
    for op, ids, n in random_ops(seed, POLICY_OPS, 200):
        keys = list(dict.fromkeys(KEYS10[i] for i in ids))
        if op == "insert":
            new = [key for key in keys if key not in blocks]
            statuses = [BlockStatus(len(blocks)) for _ in new]
            blocks.update(zip(new, statuses, strict=True))
            fast.insert(new, statuses)
            walking.insert(new, statuses)
        elif op == "remove":
            fast.remove(keys)
            walking.remove(keys)
            for key in keys:
                blocks.pop(key, None)
        elif op == "touch":
            fast.touch(keys)
            walking.touch(keys)
        elif op in ("finish", "missed"):
            request_end(fast, op, keys, n)
            request_end(walking, op, keys, n)
        elif op == "evict":
            victims = fast.evict(n, set(keys))
            assert victims == walking.evict(n, set(keys))
            for key, _ in victims or ():
                del blocks[key]
        else:
            turned = turn_ref_counts(blocks, op, keys)
            fast.became_evictable(turned)
        same_lists(fast, walking)
        seen |= parked_lists(fast)
    return seen


@settings(max_examples=300, deadline=None)
@given(
    policy=st.sampled_from(["arc", "slru"]),
    capacity=st.integers(1, 10),
    seed=st.integers(0, 2**32 - 1),
)
def test_arc_and_slru_alone_decide_as_the_walking_versions_failed_evictions_included(
    policy: str, capacity: int, seed: int
) -> None:
    directly(policy, capacity, seed)


def test_the_comparisons_see_blocks_set_aside_in_every_list() -> None:
    """The properties above meet blocks set aside in each list (else they would prove
    nothing new): a few fixed runs of each."""
    for policy, lists in (("arc", {"t1", "t2"}), ("slru", {"probation", "protected"})):
        for run in (through_managers, directly):
            seen: set[str] = set()
            for seed in range(20):
                seen |= run(policy, 3 + seed % 5, seed)
            assert seen == lists, (policy, run.__name__)
