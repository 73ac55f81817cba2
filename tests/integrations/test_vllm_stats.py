"""Our counters as vLLM's ``/metrics`` shows them: increments per report, gauges as levels,
seconds as seconds. Each report goes through vLLM's own offloading metrics frontend."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from vllm_helpers import (
    SPEC_CONFIG,
    Instance,
    canonical_caches,
    create_spec,
    lookup_until_settled,
    metrics_frontend,
    request_context,
)

from kvoffload import block_id_key
from tier_servers import ValkeyProcess

KEYS = [block_id_key(i) for i in range(1, 9)]


def _sample(registry: Any, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, {"engine": "0", **labels})
    assert value is not None, name
    return float(value)


def _offer_twice(manager: Any, keys: list[Any], tag: str) -> None:
    """Two requests offering ``keys``: the admission layer holds the first one's back and
    remembers them, so the second one's offer is one ghost hit per key."""
    for turn in range(2):
        context = request_context(f"{tag}{turn}", keys)
        for key in keys:
            manager.lookup(key, context)
        manager.prepare_store(keys, context)
        manager.on_request_finished(context)


def test_ghost_hits_reach_metrics_as_increments_across_reports_and_resets(
    vllm_modules: dict[str, ModuleType],
) -> None:
    from kvoffload.admission import find_admission

    extra = {**SPEC_CONFIG, "cpu_bytes_to_use": 64 * 1024, "kvoffload.admission": "feedback"}
    frontend, registry = metrics_frontend(extra)
    manager = create_spec(extra).get_manager()
    total = 0
    for round_ in range(4):
        if round_ == 2:
            total += find_admission(manager.backing).ghost_hits
            manager.reset_cache()  # a new admission layer, whose count starts again
        keys = [block_id_key(100 * round_ + i) for i in range(3)]
        _offer_twice(manager, keys, f"r{round_}-")
        frontend.observe(manager.get_stats().data, 0)
        reported = _sample(registry, "vllm:kvoffload_admission_ghost_hits_total")
        assert reported == total + find_admission(manager.backing).ghost_hits
    assert reported == 4 * 3


def test_a_failed_store_gives_its_slots_back_in_the_held_blocks_gauge(
    vllm_modules: dict[str, ModuleType],
) -> None:
    extra = {**SPEC_CONFIG, "cpu_bytes_to_use": 4 * 1024}
    frontend, registry = metrics_frontend(extra)
    manager = create_spec(extra).get_manager()
    context = request_context("r", KEYS[:3])
    manager.prepare_store(KEYS[:3], context)
    frontend.observe(manager.get_stats().data, 0)
    assert _sample(registry, "vllm:kvoffload_held_blocks") == 3
    manager.complete_store(KEYS[:1], context)
    manager.complete_store(KEYS[1:3], context, success=False)
    frontend.observe(manager.get_stats().data, 0)
    assert _sample(registry, "vllm:kvoffload_held_blocks") == 1
    assert _sample(registry, "vllm:kvoffload_stores_failed_total") == 2


def test_held_blocks_counts_promoted_blocks_too(
    vllm_modules: dict[str, ModuleType],
    valkey_server: ValkeyProcess,
    instances: Callable[..., Instance],
) -> None:
    """A promotion from the shared tier takes CPU slots without a store offer."""
    from vllm.v1.kv_offload.base import LookupResult

    extra = {"cpu_bytes_to_use": 4 * 512, "kvoffload.remote_url": valkey_server.url}
    model = f"held-{uuid.uuid4().hex[:8]}"
    writer = instances(extra, model=model)
    context = request_context("w", KEYS[:2])
    writer.store(KEYS[:2], [0, 1], context)
    writer.scheduler.close()
    reader = instances(extra, model=model)
    context = request_context("r", KEYS[:2])
    for key in KEYS[:2]:
        assert lookup_until_settled(reader.manager, key, context)[-1] is LookupResult.HIT
    values = reader.manager.get_stats().reduce()
    assert values["vllm:kvoffload_held_blocks"] == 2
    assert values["vllm:kvoffload_stores_admitted"] == 0


def test_transfer_times_reach_vllm_as_seconds(vllm_modules: dict[str, ModuleType]) -> None:
    """vLLM's worker adds each job's ``transfer_time`` to its load and store time counters:
    seconds, so no more than the time the jobs took in all (not a job count or bytes)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        TransferJob,
    )
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm_scheduler import connector_worker

    spec = create_spec({"cpu_bytes_to_use": 8 * 512}, bytes_per_block=512)
    connector = connector_worker(spec, canonical_caches(2, 8, 256, seed=4))
    stores = {
        job: TransferJob(f"s{job}", GPULoadStoreSpec([job], [1], [0]), CPULoadStoreSpec([job]))
        for job in (1, 2)
    }
    loads = {
        job: TransferJob(f"l{job}", CPULoadStoreSpec([job]), GPULoadStoreSpec([job], [1], [0]))
        for job in (3, 4)
    }
    started = time.perf_counter()
    connector.prepare_store_kv(OffloadingConnectorMetadata(load_jobs={}, store_jobs=stores))
    connector.start_kv_transfers(OffloadingConnectorMetadata(load_jobs=loads, store_jobs={}))
    connector.worker.wait({1, 2, 3, 4})
    done: set[str] = set()
    meta = None
    deadline = time.monotonic() + 10
    while (meta is None or len(meta.completed_jobs) < 4) and time.monotonic() < deadline:
        done |= connector.get_finished(set())[1]
        new = connector.build_connector_worker_meta()
        meta = new if meta is None else (meta if new is None else meta.aggregate(new))
    elapsed = time.perf_counter() - started
    assert meta is not None and set(meta.completed_jobs) == {1, 2, 3, 4}
    assert done == {"l3", "l4"}
    stats = meta.transfer_stats
    assert stats.store.bytes == stats.load.bytes == 2 * 512
    assert 0 < stats.store.time <= elapsed
    assert 0 < stats.load.time <= elapsed
    connector.shutdown()


def test_a_disk_tiers_failed_writes_reach_metrics_and_survive_a_reset(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, instances: Callable[..., Instance]
) -> None:
    """The disk tier's own counts reached no metric: a disk whose writes failed (here its
    slot file removed under it) showed nothing on vLLM's ``/metrics``. They are counters
    labelled ``tier``, reported as increments: a reset closes the tier and opens a new one
    counting from 0, and the totals neither go back nor count the closed tier twice."""
    from kvoffload.tiers import DiskTier

    extra = {
        "cpu_bytes_to_use": 4 * 512,
        "kvoffload.disk_dir": str(tmp_path),
        "kvoffload.disk_bytes": 1 << 20,
    }
    frontend, registry = metrics_frontend({**SPEC_CONFIG, **extra})
    engine = instances(extra)
    manager = engine.manager

    def disk() -> DiskTier:
        tier = manager.backing.tiers[0]
        assert isinstance(tier, DiskTier)
        return tier

    def store_pairs(tag: str, keys: list[Any]) -> None:
        """Store ``keys`` two at a time: past the CPU tier's 4 slots each pair evicts the
        oldest pair, which is written back to the disk tier."""
        for start in range(0, len(keys), 2):
            engine.store(keys[start : start + 2], [0, 1], request_context(tag, keys))

    def settled(stored: int, failed: int) -> dict[str, float]:
        deadline = time.monotonic() + 30
        while (disk().stats.stored_blocks, disk().stats.failed) != (stored, failed):
            assert time.monotonic() < deadline, disk().stats
            manager.backing.poll()
            time.sleep(0.01)
        frontend.observe(manager.get_stats().data, 0)
        return {
            name: _sample(registry, f"vllm:kvoffload_tier_{name}_blocks_total", tier="disk")
            for name in ("stored", "failed", "skipped_backlog")
        }

    store_pairs("a", KEYS[:6])
    assert settled(stored=2, failed=0) == {"stored": 2, "failed": 0, "skipped_backlog": 0}
    os.remove(disk().path)  # a failing disk: every write from now on fails
    store_pairs("b", KEYS[6:8])
    assert settled(stored=2, failed=2) == {"stored": 2, "failed": 2, "skipped_backlog": 0}
    manager.reset_cache()
    manager.on_reset_flushed()
    assert settled(stored=0, failed=0) == {"stored": 2, "failed": 2, "skipped_backlog": 0}
    store_pairs("c", [block_id_key(i) for i in range(20, 26)])
    assert settled(stored=2, failed=0) == {"stored": 4, "failed": 2, "skipped_backlog": 0}


def test_evictions_count_those_of_promotions_too_and_survive_a_reset(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, instances: Callable[..., Instance]
) -> None:
    """A promotion from a lower tier evicts CPU blocks as a store does: those evictions went
    uncounted, so ``vllm:kvoffload_evictions`` read less than the CPU tier evicted (and less
    than ``kvoffload simulate`` reports for the same run, its ``tiers.cpu.evicted``). A reset
    builds a new CPU tier counting from 0: the total neither goes back nor doubles."""
    from vllm.v1.kv_offload.base import LookupResult

    extra = {
        "cpu_bytes_to_use": 4 * 512,
        "kvoffload.disk_dir": str(tmp_path),
        "kvoffload.disk_bytes": 1 << 20,
    }
    frontend, registry = metrics_frontend({**SPEC_CONFIG, **extra})
    engine = instances(extra)
    manager = engine.manager

    def evict_then_promote(tag: str, keys: list[Any]) -> None:
        """Six blocks into the CPU tier's four slots evict the first pair (written back to
        disk); looking that pair up promotes it, evicting two blocks more."""
        for start in range(0, 6, 2):
            engine.store(keys[start : start + 2], [0, 1], request_context(tag, keys))
        deadline = time.monotonic() + 30
        while manager.backing.tiers[0].stats.stored_blocks < 2:
            assert time.monotonic() < deadline
            manager.backing.poll()
            time.sleep(0.01)
        context = request_context(f"{tag}-again", keys[:2])
        for key in keys[:2]:
            assert lookup_until_settled(manager, key, context)[-1] is LookupResult.HIT

    def evictions() -> float:
        frontend.observe(manager.get_stats().data, 0)
        return _sample(registry, "vllm:kvoffload_evictions_total")

    evict_then_promote("a", KEYS[:6])
    assert manager.backing.cpu_stats.evicted == 4
    assert evictions() == 4
    manager.reset_cache()
    manager.on_reset_flushed()
    assert evictions() == 4
    evict_then_promote("b", [block_id_key(i) for i in range(20, 26)])
    assert evictions() == 8


def test_each_report_holds_the_counters_growth_since_the_last_one_step_after_step(
    vllm_modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    """vLLM asks for stats on every scheduler step, so the report reads the counters once:
    each step's counters are still what grew since the last report (0 for one that did not)
    and held blocks the level, across steps that offer, steps with nothing new and a reset;
    and the increments add up to the counters."""
    from kvoffload.integrations.vllm.replay import replay
    from kvoffload.observe.counters import ManagerCounters
    from kvoffload.sim.generators import generate

    extra = {
        **SPEC_CONFIG,
        "cpu_bytes_to_use": 40 * 1024,
        "kvoffload.admission": "recommended",
        "kvoffload.disk_dir": str(tmp_path),
        "kvoffload.disk_bytes": 1 << 20,
    }
    manager = create_spec(extra).get_manager()
    workload = generate({"chat": 1.0}, num_requests=120, seed=3, block_tokens=16, rate=2.0)
    last = ManagerCounters()
    totals: dict[str, int] = {}
    for step in range(30):
        if step == 20:
            manager.reset_cache()
            manager.on_reset_flushed()
        elif step % 3:  # every third step offers nothing new
            requests = workload.requests[4 * step : 4 * step + 4]
            replay(manager, requests, workload.block_tokens)
        data = manager.get_stats().data["data"]
        now = manager.counters.copy()
        for name, grown in now.minus(last).as_dict().items():
            assert data[f"vllm:kvoffload_{name}"] == {(): grown}, (step, name)
            totals[name] = totals.get(name, 0) + grown
        last = now
    counted = last.as_dict()
    assert totals.pop("held_blocks") > 0 and counted.pop("held_blocks") > 0
    assert totals == counted
    assert totals["stores_admitted"] > 0 and totals["lookups"] > 0
