"""S3-FIFO, SIEVE and SLRU behaviours, through the CPU manager (the model-based
tests in test_manager_model.py check the shared contract for every policy)."""

from __future__ import annotations

from collections.abc import Sequence

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

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


def test_s3fifo_counts_at_most_three_touches_and_promotion_spends_them() -> None:
    m = stored("s3fifo", 10, *range(10))
    m.touch(keys(0, 0, 0, 0, 0))
    policy = m.policy
    assert isinstance(policy, S3FIFOCachePolicy)
    assert policy.freq[keys(0)[0]] == 3  # up to 3 touches buy 3 more rounds in main
    assert evicted(m, 10) == [1]
    assert ids(policy.main) == [0] and policy.freq[keys(0)[0]] == 0


def test_s3fifo_evicts_from_small_once_it_holds_its_share() -> None:
    # Capacity 10: small's share is one block. 0-8 move to main, 9 leaves; then 10 is
    # small's one block, which is its share, so small gives the next victim, not main.
    m = stored("s3fifo", 10, *range(10))
    m.touch(keys(*range(9)))
    assert evicted(m, 10) == [9]
    assert evicted(m, 11) == [10]


def test_s3fifo_ghost_remembers_only_the_tiers_size_newest_first_kept() -> None:
    m = stored("s3fifo", 2, 1, 2)
    assert [evicted(m, 3), evicted(m, 4), evicted(m, 5)] == [[1], [2], [3]]
    policy = m.policy
    assert isinstance(policy, S3FIFOCachePolicy)
    assert ids(policy.ghost) == [2, 3]


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


def test_slru_touch_of_a_pending_block_makes_it_recent_in_probation_only() -> None:
    m = stored("slru", 4, 1, 2)
    m.prepare_store(keys(3, 4))
    m.touch(keys(3))  # pending: not promoted, but the most recent of probation
    policy = m.policy
    assert isinstance(policy, SLRUCachePolicy)
    assert ids(policy.probation) == [1, 2, 4, 3] and not policy.protected


def test_slru_a_request_store_makes_its_block_recent_in_its_own_segment() -> None:
    m = stored("slru", 10, 1, 2, 3, 4)
    m.touch(keys(1, 2))
    policy = m.policy
    assert isinstance(policy, SLRUCachePolicy)
    policy.finish_request(keys(2, 3), set(), set(keys(2, 3)))
    assert ids(policy.protected) == [1, 2] and ids(policy.probation) == [4, 3]


def test_slru_protected_holds_four_fifths_of_the_tier() -> None:
    # Touched in reverse, 0 is the most recent: 8, the least, is demoted past 8 blocks.
    m = stored("slru", 10, *range(10))
    m.touch(keys(*range(9)))
    policy = m.policy
    assert isinstance(policy, SLRUCachePolicy)
    assert len(policy.protected) == 8 and ids(policy.probation) == [9, 8]


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


def request(m: CPUOffloadingManager, new: Sequence[int] = (), read: Sequence[int] = ()) -> None:
    """One request as a request-scoped driver (the vLLM adapter) reports it: reads ``read``,
    stores ``new``, and finishes with the reads as reuse and the stores as stores only."""
    policy = m.policy
    loaded, offered = keys(*read), keys(*new)
    if loaded:
        m.prepare_load(loaded)
        if policy.recent_at_access:
            m.touch(loaded)
        m.complete_load(loaded)
    out = m.prepare_store(offered)
    assert out is not None
    if policy.recent_at_access:
        m.touch(offered)  # still pending: no access yet
    m.complete_store(out.keys_to_store)
    policy.finish_request(loaded + offered, set(loaded), set(out.keys_to_store))


@pytest.mark.parametrize("policy", ["s3fifo", "sieve", "slru"])
def test_a_request_that_only_stored_a_block_did_not_reuse_it(policy: str) -> None:
    m = CPUOffloadingManager(10, policy)
    request(m, new=[0])
    request(m, read=[0])  # the one block used again
    for block in range(1, 10):
        request(m, new=[block])
    assert evicted(m, 10) == [1]  # the oldest block stored and never read, not block 0


REQUESTS = st.lists(
    st.tuples(st.lists(st.integers(0, 7), max_size=4, unique=True), st.booleans()), max_size=40
)


@settings(max_examples=200, deadline=None)
@given(
    policy=st.sampled_from(["s3fifo", "sieve", "slru"]), capacity=st.integers(1, 6), run=REQUESTS
)
def test_only_a_read_promotes_under_request_scoped_driving(
    policy: str, capacity: int, run: list[tuple[list[int], bool]]
) -> None:
    """Whatever the requests, a block that no request read since it was stored is not in
    main with a count (S3-FIFO), visited (SIEVE) or protected (SLRU). As for the adapter, a
    request reads what it loads and the ready blocks it offers again."""
    m = CPUOffloadingManager(capacity, policy)
    read_since_stored: set[OffloadKey] = set()
    for blocks, success in run:
        wanted = keys(*blocks)
        hits = m.lookup(wanted)
        loaded, offered = wanted[:hits], wanted[hits:]
        m.prepare_load(loaded)
        if m.policy.recent_at_access:
            m.touch(loaded)
        m.complete_load(loaded)
        reused = set(loaded) | {k for k in offered if (b := m.block_status(k)) and b.is_ready}
        read_since_stored.update(reused)
        out = m.prepare_store(offered)
        stored = [] if out is None else out.keys_to_store
        read_since_stored.difference_update(stored)
        if m.policy.recent_at_access:
            m.touch(offered)
        m.complete_store(stored, success)
        m.policy.finish_request(wanted, reused, set(stored) if success else set())
        p = m.policy
        if isinstance(p, S3FIFOCachePolicy):
            promoted = {key for key, count in p.freq.items() if count}
        elif isinstance(p, SIEVECachePolicy):
            promoted = set(p.visited)
        else:
            assert isinstance(p, SLRUCachePolicy)
            promoted = set(p.protected)
        assert promoted <= read_since_stored


@pytest.mark.parametrize("policy", ["s3fifo", "sieve", "slru"])
def test_a_removed_block_stored_again_starts_unread(policy: str) -> None:
    """A tier removes a block whose bytes broke; stored again, it is new bytes nobody
    read, so it keeps no mark its old copy earned (SIEVE's hand would pass it once)."""
    m = stored(policy, 3, 1, 2, 3)
    m.touch(keys(1))
    assert m.remove(keys(1)) == keys(1)
    assert evicted(m, 1) == []
    p = m.policy
    if isinstance(p, S3FIFOCachePolicy):
        assert not p.freq.get(keys(1)[0])
    elif isinstance(p, SIEVECachePolicy):
        assert keys(1)[0] not in p.visited
    else:
        assert isinstance(p, SLRUCachePolicy)
        assert keys(1)[0] not in p.protected
