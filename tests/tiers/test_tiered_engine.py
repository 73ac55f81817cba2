"""The engine's lookup retry over a real tiered stack: known answers worked out by hand.

The stack is a CPU tier in front of a real disk tier that already holds some
blocks (header-only payloads, bookkeeping only), waiting for its I/O so the
replay is deterministic: a promotion started by one call has landed by the
next. Timing as in tests/sim/test_accounting.py: 16-token blocks, 10 ms of
prefill a block, 1 ms of transfer a block, 100 ms of decode per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from kvoffload import CPUOffloadingManager, InvalidArgumentError, block_id_key
from kvoffload.core.keys import OffloadKey
from kvoffload.core.layout import layout_preset
from kvoffload.core.manager import OffloadingManager
from kvoffload.managers.reuse_filter import FilterReusedOffloadingManager
from kvoffload.managers.tiered import TieredOffloadingManager, TierSettings
from kvoffload.sim.engine import EngineConfig, EngineStats, ServingEngine
from kvoffload.sim.workload import Request
from kvoffload.tiers import DiskTier, layout_fingerprint

K = block_id_key
FP = layout_fingerprint("tiered-engine", layout_preset("tiny"), 0)


def filled_disk(directory: Path) -> DiskTier:
    """A disk tier holding blocks 0..11."""
    tier = DiskTier(directory, 32, FP)
    keys = [K(i) for i in range(12)]
    tier.write(keys, [b""] * len(keys))
    tier.poll(wait=True)
    return tier


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[DiskTier]:
    tier = filled_disk(tmp_path / "disk")
    yield tier
    tier.close()


def stack(disk: DiskTier, cpu_blocks: int) -> TieredOffloadingManager:
    return TieredOffloadingManager(
        CPUOffloadingManager(cpu_blocks), [(disk, TierSettings())], wait_for_tiers=True
    )


def replay(
    manager: OffloadingManager,
    requests: Sequence[Request],
    holds: Callable[[OffloadKey], bool] | None = None,
    **extra: int,
) -> EngineStats:
    config = EngineConfig(
        gpu_blocks=16,
        bytes_per_block=1000,
        block_tokens=16,
        prefill_tokens_per_s=1600.0,
        decode_tokens_per_s=10.0,
        transfer_bytes_per_s=1e6,
        **extra,
    )
    return ServingEngine(config, manager, holds=holds).run(requests)


def request(at: float, ids: Sequence[int]) -> Request:
    return Request(at, len(ids) * 16, 1, [K(i) for i in ids])


def test_parked_requests_keep_their_promotions_until_they_ask_again(disk: DiskTier) -> None:
    """R1 [0,1], R2 [2,3], R3 [4,5] arrive together; the CPU tier has 4 slots.

    R1 and R2 each start a promotion and park. R3 finds the CPU tier full of
    their promoted blocks, which it may not evict: it promotes nothing,
    computes its 2 blocks and its store is rejected (no room). After R3, R2
    and then R1 retry and load their blocks from the CPU tier. Every promoted
    block is read from disk once and loaded once: 4 disk hits, 4 CPU hits.
    """
    m = stack(disk, 4)
    stats = replay(m, [request(0.0, [0, 1]), request(0.0, [2, 3]), request(0.0, [4, 5])])
    m.close()
    assert disk.stats.hit_blocks == 4 and m.promotion_batches == [2]
    assert m.cpu_stats.hit_blocks == 4 == stats.offload_hit_blocks
    assert (stats.lookups, stats.lookups_deferred) == (5, 2)
    assert (stats.computed_blocks, stats.stores_rejected, stats.stored_blocks) == (2, 2, 0)
    assert stats.stores_skipped_by_admission == 0
    # R3 ran first (20 ms prefill, 100 ms decode), then R2 and R1 (2 ms load, 100 ms decode).
    assert stats.simulated_seconds == pytest.approx(0.120 + 2 * 0.102)


def test_a_promotable_prefix_larger_than_the_cpu_tier_promotes_what_fits(
    disk: DiskTier,
) -> None:
    """One request for blocks 0..9, all on disk; the CPU tier has 4 slots.

    Its lookup promotes the 4-block prefix that fits and parks the request
    once; the retry loads those 4. The 6 computed blocks do not fit (the
    CPU tier holds 4): the store is rejected. No livelock: one deferral.
    """
    m = stack(disk, 4)
    stats = replay(m, [request(0.0, list(range(10)))])
    m.close()
    assert (stats.lookups, stats.lookups_deferred) == (2, 1)
    assert disk.stats.hit_blocks == 4 == stats.offload_hit_blocks == m.cpu_stats.hit_blocks
    assert (stats.computed_blocks, stats.stores_rejected) == (6, 6)


def test_many_parked_requests_over_a_tiny_cpu_tier_end_with_bounded_retries(
    disk: DiskTier,
) -> None:
    """Six 2-block requests at once over a 3-slot CPU tier: each block promoted at most once."""
    m = stack(disk, 3)
    requests = [request(0.0, [2 * i, 2 * i + 1]) for i in range(6)]
    stats = replay(m, requests, max_lookup_retries=16)
    m.close()
    assert stats.requests == 6
    assert stats.lookups_deferred <= 6  # one per promotion started, never a retry loop
    assert disk.stats.hit_blocks == stats.offload_hit_blocks == m.cpu_stats.hit_blocks > 0
    assert stats.offload_hit_blocks + stats.computed_blocks == 12
    assert m.cpu.num_evictable_blocks(()) == len(m.cpu._blocks)  # no reservation left pinned


def test_promoted_blocks_offered_for_storing_are_not_skipped_by_admission(
    disk: DiskTier, tmp_path: Path
) -> None:
    """With no retry the request computes blocks 0,1 that its lookup promoted: the tier holds them.

    Only admission refusals count as skipped: with no filter none; behind a
    reuse filter (threshold 2, everything seen once) only block 20, the one
    the tier does not hold (not on disk either).
    """
    m = stack(disk, 4)
    stats = replay(m, [request(0.0, [0, 1])], max_lookup_retries=0)
    m.close()
    assert (stats.lookups_deferred, stats.offload_hit_blocks, stats.computed_blocks) == (1, 0, 2)
    assert stats.stores_skipped_by_admission == 0 and stats.stored_blocks == 0

    tiered = stack(filled_disk(tmp_path / "other"), 4)
    filtered = FilterReusedOffloadingManager(tiered, 2)
    stats = replay(filtered, [request(0.0, [0, 1, 20])], tiered.holds, max_lookup_retries=0)
    tiered.close()
    assert stats.stores_skipped_by_admission == 1 and filtered.stores_skipped == 3


def test_a_lookup_claims_its_reservation_and_an_unclaimed_one_expires(disk: DiskTier) -> None:
    m = TieredOffloadingManager(
        CPUOffloadingManager(2), [(disk, TierSettings())], wait_for_tiers=True, reserve_lookups=4
    )
    try:
        assert m.lookup([K(0)]) is None
        assert m.lookup([K(9)]) is None  # K(0) lands during this lookup, the 1st after it
        assert m.is_reserved(K(0)) and m.cpu.block_status(K(0)).ref_cnt == 1  # type: ignore[union-attr]
        assert m.lookup([K(10)]) == 0  # no room: K(0) and K(9) are reserved, not evictable
        assert m.lookup([K(9)]) == 1  # claimed by its lookup: pinned for its load
        assert m.is_reserved(K(9)) and m.cpu.block_status(K(9)).ref_cnt == 1  # type: ignore[union-attr]
        m.prepare_load([K(9)])  # the load's pin alone
        assert not m.is_reserved(K(9)) and m.cpu.block_status(K(9)).ref_cnt == 1  # type: ignore[union-attr]
        m.complete_load([K(9)])
        assert m.cpu.block_status(K(9)).ref_cnt == 0  # type: ignore[union-attr]
        assert m.is_reserved(K(0))
        assert m.lookup([K(11)]) is None  # the 4th lookup since K(0) landed: it expired
        assert not m.is_reserved(K(0)) and m.promotions_in_flight == 1
    finally:
        m.close()


def test_reserve_lookups_must_be_a_positive_int(disk: DiskTier) -> None:
    cpu = CPUOffloadingManager(2)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="reserve_lookups"):
            TieredOffloadingManager(cpu, [(disk, TierSettings())], reserve_lookups=bad)  # type: ignore[arg-type]


def test_bad_tier_settings_and_tracker_sizes_are_refused_naming_them(disk: DiskTier) -> None:
    for fields, named in [
        ({"capacity": "4"}, "capacity"),
        ({"capacity": -1}, "capacity"),
        ({"write_through": "yes"}, "write_through"),
    ]:
        with pytest.raises(InvalidArgumentError, match=named):
            TierSettings(**fields)  # type: ignore[arg-type]
    for bad in ("8", 2.5, True, 0):
        with pytest.raises(InvalidArgumentError, match="max_tracker_size"):
            TieredOffloadingManager(
                CPUOffloadingManager(2),
                [(disk, TierSettings())],
                max_tracker_size=bad,  # type: ignore[arg-type]
            )
