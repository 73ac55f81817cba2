"""Scenario tests of the CPU manager, following the reference conformance trace."""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator

import pytest

from kvoffload import (
    BlockNotFoundError,
    BlockNotPinnedError,
    BlockNotReadyError,
    CPUOffloadingManager,
    InvalidArgumentError,
    KVOffloadError,
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    block_id_key,
    register_cache_policy,
)
from kvoffload.policies.base import Victims
from kvoffload.policies.lru import LRUCachePolicy
from kvoffload.policies.registry import _POLICIES

POLICIES = ["lru", "arc", "s3fifo", "sieve", "slru"]
"""Every shipped policy runs the policy-independent scenarios."""


def keys(*ids: int) -> list[OffloadKey]:
    return [block_id_key(i) for i in ids]


def ids_of(event_keys: Iterable[OffloadKey]) -> set[int]:
    return {int.from_bytes(key[:8], "big") for key in event_keys}


def check_store(
    out: PrepareStoreOutput | None, stored: list[int], slots: list[int], evicted: list[int]
) -> None:
    assert out is not None
    assert out.keys_to_store == keys(*stored)
    assert out.store_spec.medium() == "CPU"
    assert out.store_spec.block_ids.tolist() == slots  # type: ignore[attr-defined]
    assert out.evicted_keys == keys(*evicted)


def events_of(manager: CPUOffloadingManager) -> list[tuple[set[int], bool]]:
    return [(ids_of(event.keys), event.removed) for event in manager.take_events()]


def test_reference_trace_lru() -> None:
    m = CPUOffloadingManager(num_blocks=4, cache_policy="lru", enable_events=True)
    # 1-2: stored blocks are pending, hence misses, and no event yet.
    check_store(m.prepare_store(keys(1, 2)), [1, 2], [0, 1], [])
    assert m.lookup(keys(1, 2)) == 0
    assert events_of(m) == []
    # 3-4
    m.complete_store(keys(1, 2))
    assert events_of(m) == [({1, 2}, False)]
    assert [m.lookup(keys(1)), m.lookup(keys(1, 2)), m.lookup(keys(1, 2, 3))] == [1, 2, 2]
    # 5: fresh ids first, then the freed id 0; 2 is offered, so 1 is evicted.
    check_store(m.prepare_store(keys(2, 3, 4, 5)), [3, 4, 5], [2, 3, 0], [1])
    assert events_of(m) == [({1}, True)]
    # 6: only 2 is evictable but two slots are needed.
    assert m.prepare_store(keys(1, 6)) is None
    # 7: 2 is already ready and is ignored.
    m.complete_store(keys(2, 3, 4, 5))
    assert events_of(m) == [({3, 4, 5}, False)]
    # 8-9: pinned blocks cannot be evicted.
    spec = m.prepare_load(keys(2, 3))
    assert spec.block_ids.tolist() == [1, 2]  # type: ignore[attr-defined]
    assert m.prepare_store(keys(6, 7, 8)) is None
    # 10: freed ids come back last-in-first-out.
    m.complete_load(keys(2, 3))
    check_store(m.prepare_store(keys(6, 7, 8)), [6, 7, 8], [3, 2, 1], [2, 3, 4])
    # 11-12: touch makes 5 the most recent, 8 the least.
    m.complete_store(keys(6, 7, 8))
    m.touch(keys(5, 6, 7))
    check_store(m.prepare_store(keys(9)), [9], [1], [8])
    # 13-14: a failed completion drops only the pending block.
    m.complete_store(keys(7, 9), success=False)
    assert m.lookup(keys(7)) == 1
    assert m.lookup(keys(9)) == 0
    assert events_of(m) == [
        ({2, 3, 4}, True),
        ({6, 7, 8}, False),
        ({8}, True),
    ]


@pytest.mark.parametrize("policy", POLICIES)
def test_already_stored_block_not_evicted_during_prepare_store(policy: str) -> None:
    m = CPUOffloadingManager(num_blocks=4, cache_policy=policy)
    m.prepare_store(keys(1, 2))
    m.complete_store(keys(1, 2))
    m.touch(keys(1))
    check_store(m.prepare_store(keys(2, 3, 4, 5)), [3, 4, 5], [2, 3, 0], [1])
    assert m.lookup(keys(2)) == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_empty_and_already_held_offers_give_empty_output(policy: str) -> None:
    m = CPUOffloadingManager(num_blocks=2, cache_policy=policy)
    check_store(m.prepare_store([]), [], [], [])
    m.prepare_store(keys(1))
    check_store(m.prepare_store(keys(1)), [], [], [])  # pending counts as held


def test_duplicate_keys_in_one_offer_take_one_slot() -> None:
    m = CPUOffloadingManager(num_blocks=3)
    check_store(m.prepare_store(keys(1, 1, 2)), [1, 2], [0, 1], [])
    assert m.num_free_blocks == 1


def test_generators_are_accepted_everywhere() -> None:
    m = CPUOffloadingManager(num_blocks=4, cache_policy="arc", enable_events=True)

    def gen(*ids: int) -> Iterator[OffloadKey]:
        yield from keys(*ids)

    check_store(m.prepare_store(gen(1, 2)), [1, 2], [0, 1], [])
    m.complete_store(gen(1, 2))
    assert m.lookup(gen(1, 2, 3)) == 2
    m.touch(gen(1, 2))
    assert m.prepare_load(gen(1, 2)).block_ids.tolist() == [0, 1]  # type: ignore[attr-defined]
    m.complete_load(gen(1, 2))
    m.prepare_store(gen(3))
    m.complete_store(gen(3), False)
    assert m.lookup(gen(3)) == 0
    assert events_of(m) == [({1, 2}, False)]


def test_take_events_detaches_the_batch() -> None:
    m = CPUOffloadingManager(num_blocks=2, enable_events=True)
    m.prepare_store(keys(1))
    m.complete_store(keys(1))
    m.prepare_store(keys(2))
    m.complete_store(keys(2))
    first = m.take_events()
    next(iter(first))  # a consumer that stops early ...
    m.prepare_store(keys(3))
    second = m.take_events()
    # ... has kept every event of its batch, and none comes back in the next.
    assert [ids_of(e.keys) for e in first] == [{1}, {2}]
    assert second == [OffloadingEvent(keys(1), "CPU", removed=True)]
    assert m.take_events() == []


def test_events_off_by_default() -> None:
    m = CPUOffloadingManager(num_blocks=1)
    m.prepare_store(keys(1))
    m.complete_store(keys(1))
    assert list(m.take_events()) == []


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_bad_num_blocks(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="num_blocks"):
        CPUOffloadingManager(num_blocks=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["no", None, 0, 1])
def test_events_are_switched_by_a_bool_only(bad: object) -> None:
    """``"no"`` would switch them on, and ``None`` off, both silently."""
    with pytest.raises(InvalidArgumentError, match="enable_events"):
        CPUOffloadingManager(num_blocks=4, enable_events=bad)  # type: ignore[arg-type]


def test_unknown_policy_lists_known_ones() -> None:
    with pytest.raises(InvalidArgumentError, match=r"'fifo'.*arc, lru"):
        CPUOffloadingManager(num_blocks=4, cache_policy="fifo")


def snapshot(m: CPUOffloadingManager) -> object:
    status = {k: (b.block_id, b.ref_cnt) for k, b in m._blocks.items()}
    policy = {name: list(v) if hasattr(v, "keys") else v for name, v in vars(m.policy).items()}
    return status, policy, [b.block_id for b in m._free], m._num_allocated


@pytest.mark.parametrize("policy", POLICIES)
def test_bad_calls_raise_and_change_nothing(policy: str) -> None:
    m = CPUOffloadingManager(num_blocks=4, cache_policy=policy)
    m.prepare_store(keys(1, 2, 3))
    m.complete_store(keys(1, 2))
    m.prepare_load(keys(1))
    before = snapshot(m)

    with pytest.raises(BlockNotFoundError) as absent:
        m.prepare_load(keys(1, 2, 9))
    assert absent.value.key == keys(9)[0] and repr(keys(9)[0]) in str(absent.value)
    with pytest.raises(BlockNotReadyError) as pending:
        m.prepare_load(keys(2, 3))
    assert pending.value.key == keys(3)[0]
    with pytest.raises(BlockNotPinnedError) as unpinned:
        m.complete_load(keys(1, 2))
    assert unpinned.value.key == keys(2)[0]
    with pytest.raises(BlockNotPinnedError):
        m.complete_load(keys(1, 1))  # pinned once, released twice
    with pytest.raises(KeyError):  # the builtin base works too
        m.complete_load(keys(7))
    with pytest.raises(KVOffloadError):
        m.prepare_load(keys(7))
    assert snapshot(m) == before


class CountingLRU(LRUCachePolicy):
    """LRU that counts the evictions it is asked for (each may walk the whole tier)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.asked = 0

    def evict(self, n: int, protected: Container[OffloadKey]) -> Victims | None:
        self.asked += 1
        return super().evict(n, protected)


def test_a_store_that_cannot_fit_fails_without_asking_the_policy() -> None:
    """vLLM's known bug (#45757): on a full tier of pinned and pending blocks every refused
    store walked all of them in the policy (3 ms a store at 50,000 blocks, per request per
    engine step). The manager counts its evictable blocks and refuses such a store at once;
    with enough evictable blocks the policy still chooses."""
    register_cache_policy("test-counting-lru")(CountingLRU)
    try:
        m = CPUOffloadingManager(6, "test-counting-lru")
        policy = m.policy
        assert isinstance(policy, CountingLRU)
        m.prepare_store(keys(1, 2, 3, 4, 5, 6))
        m.complete_store(keys(1, 2, 3))
        m.prepare_load(keys(1, 2, 2))  # 1 and 2 pinned, 3 evictable, 4-6 pending
        assert m.prepare_store(keys(7, 8)) is None
        assert m.prepare_store(keys(3, 7)) is None  # 3 is offered: nothing to evict
        assert policy.asked == 0
        m.complete_load(keys(2))  # 2 is still pinned once
        assert m.prepare_store(keys(7, 8)) is None and policy.asked == 0
        m.complete_load(keys(2))
        check_store(m.prepare_store(keys(7, 8)), [7, 8], [2, 1], [2, 3])
        assert policy.asked == 1
        assert m.num_evictable_blocks(set()) == 0
        m.complete_store(keys(4, 5), success=False)  # failed stores never were evictable
        m.complete_load(keys(1))
        assert m.num_evictable_blocks(set()) == 1 and m.num_evictable_blocks(keys(1)) == 0
        assert m.remove(keys(1)) == keys(1) and m.num_evictable_blocks(set()) == 0
    finally:
        _POLICIES.pop("test-counting-lru", None)


@pytest.mark.parametrize("policy", POLICIES)
def test_remove_drops_only_ready_unpinned_blocks(policy: str) -> None:
    """A tier drops blocks whose bytes broke; a pending block's slot is still being
    written and a pinned one's still read, so freeing either would let the next store
    reuse a slot under a transfer."""
    m = CPUOffloadingManager(num_blocks=3, cache_policy=policy, enable_events=True)
    m.prepare_store(keys(1, 2, 3))
    m.complete_store(keys(1, 2))
    m.prepare_load(keys(2))  # 1 ready, 2 pinned, 3 pending
    m.take_events()
    assert m.remove(keys(1, 2, 3, 4)) == keys(1)
    assert [m.holds(key) for key in keys(1, 2, 3)] == [False, True, True]
    assert m.num_free_blocks == 1 and m.num_evictable_blocks(set()) == 0
    assert m.take_events() == []  # the caller reports its own removal
    # The freed slot is the only one a store may take: nothing else is evictable.
    check_store(m.prepare_store(keys(5)), [5], [0], [])
    assert m.prepare_store(keys(6)) is None
    m.complete_store(keys(3))
    m.complete_load(keys(2))
    assert m.lookup(keys(2, 3)) == 2
