"""S3-FIFO, SIEVE and SLRU behaviours, through the CPU manager (the model-based
tests in test_manager_model.py check the shared contract for every policy)."""

from __future__ import annotations

from kvoffload import CPUOffloadingManager, OffloadKey, block_id_key
from kvoffload.policies.s3fifo import S3FIFOCachePolicy
from kvoffload.policies.sieve import SIEVECachePolicy
from kvoffload.policies.slru import SLRUCachePolicy


def keys(*ids: int) -> list[OffloadKey]:
    return [block_id_key(i) for i in ids]


def ids(table: object) -> list[int]:
    return [int.from_bytes(k[:8], "big") for k in table]  # type: ignore[attr-defined]


def stored(policy: str, capacity: int, *blocks: int) -> CPUOffloadingManager:
    m = CPUOffloadingManager(capacity, policy)
    for block in blocks:
        m.prepare_store(keys(block))
        m.complete_store(keys(block))
    return m


def evicted(m: CPUOffloadingManager, *new: int) -> list[int]:
    out = m.prepare_store(keys(*new))
    assert out is not None
    m.complete_store(out.keys_to_store)
    return ids(out.evicted_keys)


def test_s3fifo_evicts_untouched_newcomers_before_touched_ones() -> None:
    m = stored("s3fifo", 10, *range(10))
    m.touch(keys(0, 1))
    # 0 and 1 were touched: they move to main; 2 is the first untouched in small.
    assert evicted(m, 10) == [2]
    policy = m.policy
    assert isinstance(policy, S3FIFOCachePolicy)
    assert ids(policy.main)[:2] == [0, 1]
    assert ids(policy.ghost) == [2]


def test_s3fifo_ghost_hit_goes_straight_to_main() -> None:
    m = stored("s3fifo", 4, 1, 2, 3, 4)
    assert evicted(m, 5) == [1]
    evicted(m, 1)  # stored again while in the ghost
    policy = m.policy
    assert isinstance(policy, S3FIFOCachePolicy)
    assert 1 in ids(policy.main) and 1 not in ids(policy.ghost)


def test_s3fifo_touch_of_a_pending_block_does_not_count() -> None:
    m = CPUOffloadingManager(2, "s3fifo")
    m.prepare_store(keys(1, 2))
    m.touch(keys(1))  # pending: the engine's post-store touch
    m.complete_store(keys(1, 2))
    assert evicted(m, 3) == [1]


def test_sieve_keeps_a_visited_block_in_place_and_moves_the_hand() -> None:
    m = stored("sieve", 3, 1, 2, 3)
    m.touch(keys(1))
    assert evicted(m, 4) == [2]  # 1 was visited: the hand clears it and passes
    policy = m.policy
    assert isinstance(policy, SIEVECachePolicy)
    assert ids(policy.swept) == [1] and ids(policy.unswept) == [3, 4]
    assert evicted(m, 5) == [3]  # the hand goes on towards newer blocks; 1 stays
    m.touch(keys(4, 5))
    assert evicted(m, 6) == [1]  # 4 and 5 survive, the hand wraps: 1 lost its bit
    assert ids(policy.unswept) == [4, 5, 6] and not policy.visited


def test_sieve_skips_pinned_blocks_and_fails_atomically() -> None:
    m = stored("sieve", 2, 1, 2)
    m.prepare_load(keys(1, 2))
    policy = m.policy
    assert isinstance(policy, SIEVECachePolicy)
    before = (ids(policy.swept), ids(policy.unswept), set(policy.visited))
    assert m.prepare_store(keys(3)) is None
    assert (ids(policy.swept), ids(policy.unswept), set(policy.visited)) == before
    m.complete_load(keys(1))
    assert evicted(m, 3) == [1]


def test_slru_evicts_probation_before_protected() -> None:
    m = stored("slru", 4, 1, 2, 3, 4)
    m.touch(keys(1, 2))
    policy = m.policy
    assert isinstance(policy, SLRUCachePolicy)
    assert ids(policy.protected) == [2, 1] and ids(policy.probation) == [3, 4]
    assert evicted(m, 5, 6) == [3, 4]
    assert evicted(m, 7) == [5]


def test_slru_demotes_beyond_its_protected_share() -> None:
    m = stored("slru", 5, 1, 2, 3, 4, 5)
    m.touch(keys(1, 2, 3, 4, 5))  # protected may hold 4 of 5
    policy = m.policy
    assert isinstance(policy, SLRUCachePolicy)
    assert ids(policy.protected) == [4, 3, 2, 1] and ids(policy.probation) == [5]
    assert evicted(m, 6) == [5]
