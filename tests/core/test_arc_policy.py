"""ARC behaviours of the reference (section 2.3), through the CPU manager."""

from __future__ import annotations

from kvoffload import CPUOffloadingManager, OffloadKey, block_id_key
from kvoffload.policies.arc import ARCCachePolicy


def keys(*ids: int) -> list[OffloadKey]:
    return [block_id_key(i) for i in ids]


def ids(table: object) -> list[int]:
    return [int.from_bytes(k[:8], "big") for k in table]  # type: ignore[attr-defined]


def arc_manager(
    capacity: int, stored: tuple[int, ...] = ()
) -> tuple[CPUOffloadingManager, ARCCachePolicy]:
    m = CPUOffloadingManager(num_blocks=capacity, cache_policy="arc", enable_events=True)
    if stored:
        m.prepare_store(keys(*stored))
        m.complete_store(keys(*stored))
    assert isinstance(m.policy, ARCCachePolicy)
    return m, m.policy


def test_basic_store_lands_in_t1() -> None:
    m, arc = arc_manager(4)
    m.prepare_store(keys(1, 2))
    assert m.lookup(keys(1, 2)) == 0
    m.complete_store(keys(1, 2))
    assert m.lookup(keys(1, 2)) == 2
    assert ids(arc.t1) == [1, 2] and not arc.t2


def test_touch_promotes_ready_t1_block_to_t2() -> None:
    m, arc = arc_manager(4, (1, 2))
    m.touch(keys(1))
    assert ids(arc.t1) == [2] and ids(arc.t2) == [1]


def test_touch_keeps_pending_block_in_t1_at_mru() -> None:
    m, arc = arc_manager(4, (1,))
    m.prepare_store(keys(2, 3))
    m.touch(keys(2))
    assert ids(arc.t1) == [1, 3, 2] and not arc.t2


def test_pinned_blocks_block_eviction_until_released() -> None:
    m, _ = arc_manager(4, (1, 2, 3, 4))
    m.prepare_load(keys(2, 3))
    assert m.prepare_store(keys(5, 6, 7)) is None
    m.complete_load(keys(2, 3))
    out = m.prepare_store(keys(5, 6, 7))
    assert out is not None and len(out.evicted_keys) >= 1


def test_ghost_hit_in_b1_raises_target_without_readmission() -> None:
    m, arc = arc_manager(2, (1, 2))
    out = m.prepare_store(keys(3))
    assert out is not None and ids(out.evicted_keys) == [1]
    assert ids(arc.b1) == [1]
    m.touch(keys(1))
    assert arc.target_t1_size > 0
    assert m.lookup(keys(1)) == 0
    m.complete_store(keys(3))
    m.prepare_store(keys(1))  # re-admission goes to T1 and clears the ghost
    assert 1 in ids(arc.t1) and 1 not in ids(arc.b1)


def test_ghost_hit_in_b2_lowers_target() -> None:
    m, arc = arc_manager(2, (1, 2))
    m.touch(keys(1, 2))  # both to T2
    arc.target_t1_size = 2.0
    out = m.prepare_store(keys(3))  # T1 empty: evict from T2
    assert out is not None and ids(out.evicted_keys) == [2]
    assert ids(arc.b2) == [2]
    m.touch(keys(2))
    assert arc.target_t1_size == 1.0


def test_target_decides_between_t1_and_t2() -> None:
    m, arc = arc_manager(4, (1, 2, 3, 4))
    m.touch(keys(3, 4))
    assert ids(arc.t1) == [1, 2] and ids(arc.t2) == [4, 3]
    arc.target_t1_size = 1.0
    out = m.prepare_store(keys(5))
    assert out is not None and ids(out.evicted_keys) == [1]
    assert ids(arc.b1) == [1] and 5 in ids(arc.t1)


def test_ghost_lists_are_each_bounded_by_capacity() -> None:
    m, arc = arc_manager(2)
    for i in range(17):
        m.prepare_store(keys(i))
        m.complete_store(keys(i))
        if i % 3 == 0:
            m.touch(keys(i))
        assert len(arc.b1) <= 2 and len(arc.b2) <= 2


def test_touch_order_and_slot_reuse() -> None:
    m, arc = arc_manager(4, (1, 2, 3, 4))
    m.touch(keys(3, 4))
    m.touch(keys(1, 3, 4))
    assert ids(arc.t1) == [2] and sorted(ids(arc.t2)) == [1, 3, 4]
    out = m.prepare_store(keys(5))
    assert out is not None and ids(out.evicted_keys) == [2]
    assert out.store_spec.block_ids.tolist() == [1]  # type: ignore[attr-defined]


def test_failed_store_leaves_ghost_in_place() -> None:
    m, arc = arc_manager(4, (1, 2, 3, 4))
    out = m.prepare_store(keys(5))
    assert out is not None and ids(out.evicted_keys) == [1]
    m.complete_store(keys(5), success=False)
    assert m.lookup(keys(5)) == 0
    assert 5 not in ids(arc.t1) and 5 not in ids(arc.t2)
    assert ids(arc.b1) == [1]


def test_full_scenario() -> None:
    m, arc = arc_manager(4, (1, 2))
    out = m.prepare_store(keys(3, 4, 5))
    assert out is not None and ids(out.evicted_keys) == [1]
    m.complete_store(keys(3, 4, 5))
    m.touch(keys(2, 3))
    assert ids(arc.t1) == [4, 5] and sorted(ids(arc.t2)) == [2, 3]
    out = m.prepare_store(keys(6))
    assert out is not None and ids(out.evicted_keys) == [4]
    assert m.lookup(keys(2)) == 1 and m.lookup(keys(3)) == 1
    assert m.take_events()


def test_falls_back_to_t1_when_t2_has_nothing_evictable() -> None:
    # The seed-era ARC returned None here although block 2 is evictable.
    m, arc = arc_manager(2, (1,))
    m.touch(keys(1))
    m.prepare_store(keys(2))
    m.complete_store(keys(2))
    m.prepare_load(keys(1))
    arc.target_t1_size = 2.0
    out = m.prepare_store(keys(3))
    assert out is not None and ids(out.evicted_keys) == [2]
    assert ids(arc.b1) == [2]


def test_t1_gives_victims_while_at_or_above_target() -> None:
    m, arc = arc_manager(3, (1, 2, 3))
    m.touch(keys(3))
    arc.target_t1_size = 1.0
    # |T1| = 2 >= 1: take 1; |T1| = 1 >= 1: take 2; |T1| = 0 < 1: take 3 from T2.
    out = m.prepare_store(keys(4, 5, 6))
    assert out is not None and ids(out.evicted_keys) == [1, 2, 3]
    assert ids(arc.b1) == [1, 2] and ids(arc.b2) == [3]


def test_finish_request_promotes_only_what_the_request_read() -> None:
    """vLLM's request-scoped access: a read counts, a store does not, anything else is left."""
    _, arc = arc_manager(8, (1, 2, 3, 4))
    arc.finish_request(keys(1, 2, 3, 9), reused=set(keys(2)), stored_only=set(keys(1, 3)))
    assert ids(arc.t1) == [4, 3, 1] and ids(arc.t2) == [2]
    arc.finish_request(keys(4, 2), reused=set(keys(2)), stored_only=set())
    assert ids(arc.t1) == [4, 3, 1] and ids(arc.t2) == [2]


def test_store_missed_adapts_to_a_ghost_the_store_then_forgets() -> None:
    m, arc = arc_manager(2, (1, 2))
    m.prepare_store(keys(3))
    m.complete_store(keys(3))
    assert ids(arc.b1) == [1] and arc.target_t1_size == 0.0
    arc.store_missed(keys(1))
    m.prepare_store(keys(1))
    assert arc.target_t1_size == 1.0 and 1 not in ids(arc.b1)


def test_other_policies_touch_on_finish_and_ignore_store_misses() -> None:
    m = CPUOffloadingManager(num_blocks=4, cache_policy="lru")
    m.prepare_store(keys(1, 2, 3))
    m.complete_store(keys(1, 2, 3))
    m.policy.store_missed(keys(7))
    m.policy.finish_request(keys(1, 3), reused=set(), stored_only=set(keys(1, 3)))
    assert list(m.policy.coldest() or ()) == keys(2, 3, 1)
