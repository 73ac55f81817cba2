"""Known answers for every figure a run reports, on workloads small enough to work out by hand.

Timing: 16-token blocks, prefill 1,600 tokens/s (10 ms a block), 1,000-byte
blocks over a 1 MB/s link (1 ms a block), decode 10 tokens/s unless fast.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest

from kvoffload import block_id_key
from kvoffload.admission.registry import wrap_with_admission
from kvoffload.core.keys import OffloadKey
from kvoffload.core.layout import layout_preset
from kvoffload.core.manager import OffloadingManager, PrepareStoreOutput
from kvoffload.core.specs import CPULoadStoreSpec, LoadStoreSpec
from kvoffload.managers import build_manager
from kvoffload.policies import create_cache_policy
from kvoffload.policies.arc import ARCCachePolicy
from kvoffload.policies.base import BlockStatus
from kvoffload.sim.belady import belady_bound
from kvoffload.sim.engine import EngineConfig, EngineStats, ServingEngine
from kvoffload.sim.run import SimConfig, simulate
from kvoffload.sim.transfers import NullTransferBackend
from kvoffload.sim.workload import Request, Workload

K = block_id_key


def request(at: float, ids: Sequence[int], tokens: int | None = None, out: int = 1) -> Request:
    return Request(at, len(ids) * 16 if tokens is None else tokens, out, [K(i) for i in ids])


def engine(
    manager: OffloadingManager | None,
    gpu_blocks: int = 3,
    concurrency: int = 1,
    decode: float = 10.0,
    backend: NullTransferBackend | None = None,
    **extra: object,
) -> ServingEngine:
    config = EngineConfig(
        gpu_blocks=gpu_blocks,
        bytes_per_block=1000,
        block_tokens=16,
        concurrency=concurrency,
        prefill_tokens_per_s=1600.0,
        decode_tokens_per_s=decode,
        transfer_bytes_per_s=1e6,
        **extra,  # type: ignore[arg-type]
    )
    return ServingEngine(config, manager, backend)


def counts(stats: EngineStats) -> dict[str, int]:
    return {
        name: value
        for name, value in vars(stats).items()
        if isinstance(value, int) and name != "requests"
    }


class DictManager(OffloadingManager):
    """An unbounded tier: ``ready`` keys hit; ``refuse`` keys are never stored; optional Nones."""

    def __init__(self, ready: Iterable[int] = (), refuse: Iterable[int] = (), nones: int = 0):
        self.ready: set[OffloadKey] = {K(i) for i in ready}
        self.refuse: set[OffloadKey] = {K(i) for i in refuse}
        self.nones = nones
        self.lookups = 0

    def lookup(self, keys: Iterable[OffloadKey]) -> int | None:
        self.lookups += 1
        if self.nones:
            self.nones -= 1
            return None
        hits = 0
        for key in keys:
            if key not in self.ready:
                break
            hits += 1
        return hits

    def prepare_load(self, keys: Iterable[OffloadKey]) -> LoadStoreSpec:
        return CPULoadStoreSpec(range(len(list(keys))))

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        return None

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        return None

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        new = [k for k in keys if k not in self.ready and k not in self.refuse]
        return PrepareStoreOutput(new, CPULoadStoreSpec(range(len(new))), [])

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        if success:
            self.ready.update(keys)


class FailFirstStore(NullTransferBackend):
    """The first store job fails; everything else succeeds."""

    def __init__(self) -> None:
        self.stores: list[int] = []

    def submit_store(
        self,
        job_id: int,
        keys: Sequence[OffloadKey],
        gpu_block_ids: Sequence[int],
        dst: LoadStoreSpec,
    ) -> None:
        self.stores.append(job_id)

    def finish(self, job_id: int) -> bool:
        return not self.stores or job_id != self.stores[0]


def test_sequential_replay_through_a_four_block_lru_tier() -> None:
    # r0 stores 1,2,3; r1 evicts 3,2 (LRU order 3,2,1 after the post-store touch) to
    # store 4,5,6; r2 loads 1 and evicts 6,5 to store 2,7. The GPU (3 blocks) keeps nothing.
    reqs = [request(0, [1, 2, 3]), request(1, [4, 5, 6]), request(2, [1, 2, 7])]
    stats = engine(build_manager(4)).run(reqs)
    assert counts(stats) == {
        "refs": 9,
        "gpu_hit_blocks": 0,
        "offload_hit_blocks": 1,
        "computed_blocks": 8,
        "gpu_hit_tokens": 0,
        "offload_hit_tokens": 16,
        "prompt_tokens": 144,
        "stored_blocks": 8,
        "store_offered_blocks": 8,
        "stores_skipped_by_admission": 0,
        "stores_rejected": 0,
        "stores_failed": 0,
        "loads_failed": 0,
        "offload_evictions": 4,
        "gpu_evictions": 6,
        "lookups": 3,
        "lookups_deferred": 0,
        "peak_pending_store_blocks": 3,
        "peak_pinned_blocks": 1,
    }
    assert stats.load_seconds == pytest.approx(0.001)
    assert stats.store_seconds == pytest.approx(0.008)
    # r2: load 1 ms, prefill 2 blocks 20 ms, decode 100 ms.
    assert stats.simulated_seconds == pytest.approx(2.121)


def test_report_derives_bytes_times_and_ratios() -> None:
    bytes_per_block = layout_preset("tiny").with_block_size(16).bytes_per_block
    reqs = [request(0, [1, 2, 3]), request(1, [4, 5, 6]), request(2, [1, 2, 7]), request(3, [4, 5])]
    config = SimConfig(3, 4, layout="tiny", prefill_tokens_per_s=1600.0, transfer_gb_per_s=1e-3)
    report = simulate(Workload("hand", 16, reqs), config)
    # As above, then r3: the GPU lost 4,5 to r2; the tier (LRU first: 4,7,2,1) lost 5 to
    # r2's store, so r3 loads 4, computes 5 and evicts 7 to store it.
    assert (report.gpu_hit_blocks, report.offload_hit_blocks, report.computed_blocks) == (0, 2, 9)
    assert report.refs == 11 and report.unique_blocks == 7
    assert report.gpu_gib == 3 * bytes_per_block / 2**30
    assert report.cpu_gib == 4 * bytes_per_block / 2**30
    assert (report.offload_blocks_written, report.offload_blocks_read) == (9, 2)
    assert report.offload_bytes_written == 9 * bytes_per_block
    assert report.offload_bytes_read == 2 * bytes_per_block
    assert (report.gpu_blocks_written, report.gpu_blocks_read) == (11, 9)
    assert report.gpu_bytes_written == 11 * bytes_per_block
    assert report.total_hit_ratio == report.offload_hit_ratio == pytest.approx(2 / 11)
    assert report.writes_per_ref == pytest.approx(9 / 11)
    block_s = bytes_per_block / 1e6
    assert report.load_seconds == pytest.approx(2 * block_s)
    assert report.store_seconds == pytest.approx(9 * block_s)
    assert report.prefill_seconds_baseline == pytest.approx(176 / 1600)
    assert report.prefill_seconds_saved_by_offload == pytest.approx(32 / 1600 - 2 * block_s)
    assert report.prefill_seconds_saved == pytest.approx(32 / 1600 - 2 * block_s)
    assert report.offload_evictions == 5 and report.gpu_evictions == 8


def test_prefill_saved_per_source_and_gpu_hit_tokens_capped_at_the_prompt() -> None:
    # A 40-token prompt has a keyed partial third block; the second run hits all three on
    # the GPU, which saves 40 tokens (not 48). The tier (empty, always missed) saves nothing.
    reqs = [request(0, [1, 2, 3], tokens=40), request(1, [1, 2, 3], tokens=40)]
    report = simulate(
        Workload("hand", 16, reqs), SimConfig(4, 8, layout="tiny", prefill_tokens_per_s=1600.0)
    )
    assert report.gpu_hit_blocks == 3
    assert report.prefill_seconds_baseline == pytest.approx(80 / 1600)
    assert report.prefill_seconds_saved == pytest.approx(40 / 1600)
    assert report.prefill_seconds_saved_by_offload == 0
    stats = engine(None, gpu_blocks=4).run(reqs)
    assert stats.gpu_hit_tokens == 40


def test_no_filter_skips_nothing_even_when_offered_blocks_are_already_held() -> None:
    # Two overlapping requests share a prefix: the second offers 1,2 while their store is pending.
    reqs = [request(0, [1, 2, 3]), request(0, [1, 2, 4])]
    stats = engine(build_manager(8), gpu_blocks=6, concurrency=2).run(reqs)
    assert (stats.store_offered_blocks, stats.stored_blocks) == (6, 4)
    assert stats.stores_skipped_by_admission == 0


def test_filtered_blocks_count_as_skipped_unless_already_held() -> None:
    # Threshold 2: r0 and r1 are seen once (skipped 2 + 2); r2 brings 1,2 to two lookups.
    reqs = [request(0, [1, 2]), request(1, [3, 4]), request(2, [1, 2]), request(3, [1, 2, 5])]
    stats = engine(build_manager(8, store_threshold=2), gpu_blocks=2).run(reqs[:3])
    assert (stats.stores_skipped_by_admission, stats.stored_blocks) == (4, 2)
    # r3 hits 1,2 on the GPU and offers 5, seen once: skipped (r1 had 3 to skip).
    stats = engine(build_manager(8, store_threshold=2), gpu_blocks=3).run(
        [reqs[0], request(1, [3, 4, 6]), reqs[2], reqs[3]]
    )
    assert stats.gpu_hit_blocks == 2
    assert (stats.stores_skipped_by_admission, stats.stored_blocks) == (6, 2)


def test_filtered_blocks_already_held_are_not_skipped() -> None:
    # Two concurrent copies of [1,2]: both lookups count before either prefill ends, so the
    # first stores 1,2; the second's offer finds them pending in the tier: nothing skipped.
    reqs = [request(0, [1, 2]), request(0, [1, 2])]
    stats = engine(build_manager(8, store_threshold=2), gpu_blocks=4, concurrency=2).run(reqs)
    assert (stats.store_offered_blocks, stats.stored_blocks) == (4, 2)
    assert stats.stores_skipped_by_admission == 0


def test_failed_store_keys_leave_the_held_set() -> None:
    # r0's store of 1 fails; r2 offers 1 again and the tier refuses it: skipped, as 1 is not held.
    manager = DictManager(refuse=[])
    backend = FailFirstStore()
    eng = engine(manager, gpu_blocks=1, backend=backend)
    reqs = [request(0, [1]), request(1, [2]), request(2, [1])]
    first = eng.run(reqs[:2])
    assert (first.stores_failed, first.stored_blocks) == (1, 1)
    manager.refuse.add(K(1))
    eng.run(reqs[2:])
    assert eng.stats.stores_skipped_by_admission == 1


class SlotRecorder(NullTransferBackend):
    """Which GPU block each key was computed into, and which one each store copies from."""

    def __init__(self) -> None:
        self.computed: dict[OffloadKey, int] = {}
        self.stored: dict[OffloadKey, int] = {}

    def compute(self, keys: Sequence[OffloadKey], gpu_block_ids: Sequence[int]) -> None:
        self.computed.update(zip(keys, gpu_block_ids, strict=True))

    def submit_store(
        self,
        job_id: int,
        keys: Sequence[OffloadKey],
        gpu_block_ids: Sequence[int],
        dst: LoadStoreSpec,
    ) -> None:
        self.stored.update(zip(keys, gpu_block_ids, strict=True))


def test_a_store_the_tier_thins_copies_each_key_from_its_own_gpu_block() -> None:
    # The tier refuses 2 of the offer 1,2,3 and already holds 5 of 4,5,6: the blocks it
    # stores are not the offer's first ones, so their GPU blocks must be found by key.
    manager = DictManager(ready=[5], refuse=[2])
    backend = SlotRecorder()
    engine(manager, gpu_blocks=3, backend=backend).run(
        [request(0, [1, 2, 3]), request(1, [4, 5, 6])]
    )
    assert set(backend.stored) == {K(1), K(3), K(4), K(6)}
    assert backend.stored == {key: backend.computed[key] for key in backend.stored}


def test_stores_queue_on_their_link_and_pending_blocks_peak_together() -> None:
    # Both prefills end at 20 ms; the stores share one link: 20-22 ms and 22-24 ms.
    reqs = [request(0, [1, 2]), request(0, [3, 4])]
    stats = engine(DictManager(), gpu_blocks=4, concurrency=2, decode=1e9).run(reqs)
    assert stats.store_seconds == pytest.approx(0.004)
    assert stats.simulated_seconds == pytest.approx(0.024)
    assert stats.peak_pending_store_blocks == 4


def test_loads_queue_on_their_own_link_and_pinned_blocks_peak_together() -> None:
    # Both load 2 blocks at t=0: 0-2 ms and 2-4 ms, then 1 block of prefill (10 ms) each;
    # their stores (1 block each, 12-13 and 14-15 ms) do not wait for the load link.
    reqs = [request(0, [1, 2, 3]), request(0, [4, 5, 6])]
    manager = DictManager(ready=[1, 2, 4, 5])
    stats = engine(manager, gpu_blocks=6, concurrency=2, decode=1e9).run(reqs)
    assert stats.load_seconds == pytest.approx(0.004)
    assert stats.peak_pinned_blocks == 4
    assert stats.simulated_seconds == pytest.approx(0.015)
    assert stats.offload_hit_tokens == 64


@pytest.mark.parametrize(("nones", "hits"), [(0, 2), (3, 2), (16, 2), (17, 0), (40, 0)])
def test_deferred_lookups_are_retried(nones: int, hits: int) -> None:
    manager = DictManager(ready=[1, 2], nones=nones)
    stats = engine(manager, decode=1e9).run([request(0, [1, 2, 3])])
    parked = min(nones, 16)
    assert stats.lookups == manager.lookups == parked + 1
    assert stats.lookups_deferred == min(nones, 17)
    assert stats.offload_hit_blocks == hits
    load = 0.002 if hits else 0.0
    prefill = 0.01 * (3 - hits)
    store = 0.001  # the manager holds 1,2 already: only 3 is stored
    assert stats.simulated_seconds == pytest.approx(parked * 0.001 + load + prefill + store)


@pytest.mark.parametrize("rule", ["sketch", "feedback"])
def test_a_retried_lookup_is_one_sighting_for_an_admission_layer(rule: str) -> None:
    # Both rules store a block seen twice: a request parked once and retried is still
    # seen once, so its first blocks are skipped as if no lookup had been deferred.
    for nones in (0, 1):
        tier = wrap_with_admission(rule, DictManager(nones=nones), 8)
        stats = engine(tier, gpu_blocks=2).run([request(0, [1, 2])])
        assert stats.lookups_deferred == nones
        assert (stats.stored_blocks, stats.stores_skipped_by_admission) == (0, 2)


def test_a_parked_request_lets_the_next_one_start() -> None:
    # r0 is parked once (5 ms); r1 arrives at 1 ms and takes the only seat meanwhile.
    manager = DictManager(nones=1)
    eng = engine(manager, gpu_blocks=6, decode=1e9, lookup_retry_s=0.005)
    stats = eng.run([request(0, [1, 2]), request(0.001, [3])])
    assert (stats.requests, stats.lookups, stats.lookups_deferred) == (2, 3, 1)
    # r1 starts at 1 ms and ends at 12 ms (10 ms prefill, 1 ms store); r0, back in the
    # queue at 5 ms, starts then: 20 ms of prefill and 2 ms of store.
    assert stats.simulated_seconds == pytest.approx(0.034)


def test_partial_last_block_dropped_is_computed_but_never_cached() -> None:
    # 40 tokens, keys 1,2,3: with "drop" key 3 (8 tokens) is never matched, looked up or stored.
    reqs = [request(0, [1, 2, 3], tokens=40), request(1, [1, 2, 3], tokens=40)]
    kept = engine(DictManager(), gpu_blocks=3).run(reqs)
    manager = DictManager()
    dropped = engine(manager, gpu_blocks=3, partial_block="drop").run(reqs)
    assert (kept.gpu_hit_blocks, kept.computed_blocks, kept.stored_blocks) == (3, 3, 3)
    assert (dropped.gpu_hit_blocks, dropped.computed_blocks, dropped.stored_blocks) == (2, 4, 2)
    assert dropped.refs == kept.refs == 6
    assert dropped.gpu_hit_tokens == 32 and K(3) not in manager.ready
    # The second request computes its 8 partial tokens: 5 ms, plus 100 ms of decode.
    assert dropped.simulated_seconds == pytest.approx(1.105)
    report = simulate(
        Workload("hand", 16, reqs), SimConfig(3, 4, layout="tiny", partial_block="drop")
    )
    assert (report.gpu_hit_blocks, report.partial_block) == (2, "drop")
    assert report.belady_total_hit_ratio == pytest.approx(2 / 6)


def test_partial_block_drop_leaves_unkeyed_tails_alone() -> None:
    # The synthetic sources key only full blocks: 40 tokens and 2 keys, nothing to drop.
    reqs = [request(0, [1, 2], tokens=40), request(1, [1, 2], tokens=40)]
    dropped = engine(None, gpu_blocks=3, partial_block="drop").run(reqs)
    assert dropped.gpu_hit_blocks == 2 and dropped.computed_blocks == 2


def _ready_blocks(n: int) -> list[BlockStatus]:
    blocks = [BlockStatus(i) for i in range(n)]
    for block in blocks:
        block.ref_cnt = 0
    return blocks


def test_lru_touch_leaves_the_first_key_most_recent() -> None:
    policy = create_cache_policy("lru", 8)
    policy.insert([K(i) for i in range(1, 6)], _ready_blocks(5))
    policy.touch([K(1), K(2)])
    victims = policy.evict(5, ())
    assert victims is not None
    assert [key for key, _ in victims] == [K(3), K(4), K(5), K(2), K(1)]


def test_arc_touch_promotes_tail_first_into_t2() -> None:
    policy = create_cache_policy("arc", 8)
    policy.insert([K(i) for i in range(1, 6)], _ready_blocks(5))
    policy.touch([K(1), K(2)])
    policy.touch([K(3)])
    assert isinstance(policy, ARCCachePolicy)
    assert (list(policy.t1), list(policy.t2)) == ([K(4), K(5)], [K(2), K(1), K(3)])
    # A pending block is not promoted by a touch, only made most recent in T1.
    pending = BlockStatus(9)
    policy.insert([K(6)], [pending])
    policy.touch([K(6), K(4)])
    assert (list(policy.t1), list(policy.t2)) == ([K(5), K(6)], [K(2), K(1), K(3), K(4)])
    pending.ref_cnt = 0
    # T1 goes first while at/above its target (0), then T2 from its least recent end.
    victims = policy.evict(6, ())
    assert victims is not None
    assert [key for key, _ in victims] == [K(5), K(6), K(2), K(1), K(3), K(4)]


def test_drop_recomputes_the_last_token_of_a_block_aligned_prompt() -> None:
    # vLLM's GPU hit covers at most input_tokens - 1 tokens: the second 32-token prompt
    # hits block 1 on the GPU and looks block 2 up in the tier, which loads it.
    reqs = [request(0, [1, 2], tokens=32), request(1, [1, 2], tokens=32)]
    manager = DictManager()
    stats = engine(manager, gpu_blocks=4, partial_block="drop").run(reqs)
    assert (stats.gpu_hit_blocks, stats.offload_hit_blocks, stats.lookups) == (1, 1, 2)
    assert (stats.gpu_hit_tokens, stats.offload_hit_tokens) == (16, 16)
    cached = engine(DictManager(), gpu_blocks=4).run(reqs)
    assert (cached.gpu_hit_blocks, cached.offload_hit_blocks) == (2, 0)
    report = simulate(
        Workload("hand", 16, reqs), SimConfig(4, 0, layout="tiny", partial_block="drop")
    )
    assert report.gpu_hit_blocks == 1
    assert belady_bound(reqs, 4, 0, drop_partial_of=16).gpu_hit_blocks == 1
    assert belady_bound(reqs, 4, 2, drop_partial_of=16).offload_hit_blocks == 1


def test_prefill_saved_by_offload_is_net_of_the_lower_tiers_reads(tmp_path: Path) -> None:
    # A 2-block GPU and CPU tier: r2 and r3 push 1,2 out of both (to the disk), and r4's
    # lookup promotes them in one disk read (5 ms + 2 blocks at 1 MB/s), then loads them.
    bytes_per_block = layout_preset("tiny").with_block_size(16).bytes_per_block
    reqs = [request(0, [1, 2]), request(1, [3, 4]), request(2, [5, 6]), request(3, [1, 2])]
    config = SimConfig(
        2,
        2,
        layout="tiny",
        bound=False,
        prefill_tokens_per_s=1600.0,
        transfer_gb_per_s=1e-3,
        disk_dir=str(tmp_path),
        disk_blocks=100,
        disk_gb_per_s=1e-3,
        disk_latency_ms=5.0,
    )
    report = simulate(Workload("hand", 16, reqs), config)
    assert report.tiers["disk"]["hit_blocks"] == report.offload_hit_blocks == 2
    block_s = bytes_per_block / 1e6
    disk_read_s = 0.005 + 2 * block_s
    assert report.tiers["disk"]["read_seconds"] == pytest.approx(disk_read_s)
    expected = 32 / 1600 - 2 * block_s - disk_read_s
    assert report.prefill_seconds_saved_by_offload == pytest.approx(expected)
    assert report.prefill_seconds_saved == pytest.approx(expected)


@pytest.mark.parametrize("with_disk", [False, True])
def test_the_cpu_tiers_entry_counts_the_stores_that_found_no_room(
    tmp_path: Path, with_disk: bool
) -> None:
    # Two requests start at once on a 3-block tier: r0's store of 1,2,3 fills it with
    # pending blocks, so r1's offer of 4,5,6 at the same instant finds nothing to evict.
    reqs = [request(0, [1, 2, 3]), request(0, [4, 5, 6])]
    disk_dir = str(tmp_path) if with_disk else None
    config = SimConfig(
        8, 3, layout="tiny", concurrency=2, bound=False, disk_dir=disk_dir, disk_blocks=10
    )
    report = simulate(Workload("hand", 16, reqs), config)
    assert (report.offload_blocks_written, report.stores_rejected) == (3, 3)
    assert report.tiers["cpu"]["rejected"] == 3
