"""vLLM 0.33's manager and worker contract beyond the per-key calls, through vLLM's own
connector classes: the manager ``lock``, ``config_info`` for
``vllm:kv_offload_config_info``, and expedited (in-step) loads."""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

import pytest
from vllm_helpers import SPEC_CONFIG, canonical_caches, create_spec, metrics_frontend
from vllm_scheduler import connector_scheduler, connector_worker

from kvoffload import block_id_key
from kvoffload.core.errors import BlockNotFoundError
from tier_servers import ValkeyProcess

KEYS = [block_id_key(i) for i in range(1, 7)]


def _needs(feature: str) -> None:
    """Skip where the running vLLM's contract has no ``feature`` (0.32 has none of these)."""
    import inspect

    from vllm.v1.kv_offload.base import OffloadingManager, OffloadingWorker

    present = {
        "lock": hasattr(OffloadingManager, "lock"),
        "config_info": hasattr(OffloadingManager, "config_info"),
        "expedited": "expedited" in inspect.signature(OffloadingWorker.submit_load).parameters,
    }
    if not present[feature]:
        pytest.skip(f"this vLLM's offloading contract has no {feature}")


def _context(req_id: str, keys: list[Any]) -> Any:
    from vllm_helpers import request_context

    return request_context(req_id, keys)


def test_vllms_step_excludes_an_eviction_between_a_hit_and_its_load(
    vllm_modules: dict[str, ModuleType],
) -> None:
    """vLLM's scheduler holds ``manager.lock`` from a step's lookups to the loads that pin
    their hits; another thread's store, which would evict the hits, waits for the step."""
    _needs("lock")
    from vllm_scheduler import allocate, end_step, offload_keys, vllm_request

    spec = create_spec({"cpu_bytes_to_use": 2 * 1024})  # two blocks
    scheduler = connector_scheduler(spec)
    manager = spec.get_manager()
    request = vllm_request("reader", list(range(48)))
    keys = offload_keys(request)[:2]
    context = _context("old", keys)
    manager.prepare_store(keys, context)
    manager.complete_store(keys, context)
    outcome: dict[str, Any] = {}

    def evict() -> None:
        with manager.lock:
            outcome["store"] = manager.prepare_store(KEYS[:2], _context("new", KEYS[:2]))

    scheduler.on_new_request(request)
    other = threading.Thread(target=evict)
    try:
        assert scheduler.get_num_new_matched_tokens(request, 0) == (32, True)  # the step opens
        other.start()
        other.join(0.5)
        assert other.is_alive()  # waiting for the step, not evicting its hits
        allocate(scheduler, request, 3, 32)  # vLLM's prepare_load of the hits
    finally:
        meta = end_step(scheduler)  # the step closes
        other.join(30)
    assert not other.is_alive()
    (job,) = meta.load_jobs.values()
    assert sorted(job.src_spec.block_ids.tolist()) == [0, 1]
    assert outcome["store"] is None  # both blocks are pinned by the load: no room


def test_an_eviction_outside_the_lock_would_have_broken_the_load(
    vllm_modules: dict[str, ModuleType],
) -> None:
    """The hazard the lock closes, shown without it: the load of a HIT evicted meanwhile."""
    from vllm.v1.kv_offload.base import LookupResult

    spec = create_spec({"cpu_bytes_to_use": 2 * 1024})
    manager = spec.get_manager()
    context = _context("old", KEYS[:2])
    manager.prepare_store(KEYS[:2], context)
    manager.complete_store(KEYS[:2], context)
    reader = _context("reader", KEYS[:2])
    assert manager.lookup(KEYS[0], reader) is LookupResult.HIT
    manager.prepare_store(KEYS[2:4], _context("new", KEYS[2:4]))
    with pytest.raises(BlockNotFoundError):
        manager.prepare_load(KEYS[:1], reader)


def test_config_info_reaches_vllms_info_metric_one_series_per_tier(
    vllm_modules: dict[str, ModuleType], tmp_path: Any, valkey_server: ValkeyProcess
) -> None:
    from kvoffload.tiers.slot_file import slot_start, slot_stride

    extra = {
        **SPEC_CONFIG,
        "cpu_bytes_to_use": 6 * 1024,
        "eviction_policy": "arc",
        "store_threshold": 2,
        "kvoffload.admission": "recommended",
        "kvoffload.disk_dir": str(tmp_path / "disk"),
        "kvoffload.disk_bytes": slot_start(8, slot_stride(1024)),
        "kvoffload.remote_url": valkey_server.url,
    }
    _needs("config_info")
    frontend, registry = metrics_frontend(extra)
    spec = create_spec(extra, model="info")
    try:
        scheduler = connector_scheduler(spec)
        frontend.observe(scheduler.get_stats().data, 0)
        assert scheduler.get_stats().data["info"] is None  # sent once, with the first stats
    finally:
        spec.close()
    series = {}
    for family in registry.collect():
        if family.name == "vllm:kv_offload_config_info":
            for sample in family.samples:
                series[sample.labels["tier"]] = sample.labels
    fingerprint = spec.fingerprint.hex()
    address = f"redis://127.0.0.1:{valkey_server.port}/0"
    assert series == {
        "cpu": _labels(
            tier="cpu", medium="CPU", num_blocks="6", size_bytes=str(6 * 1024),
            eviction_policy="arc", store_threshold="2", admission="recommended",
            reset_drops_blocks="True", fingerprint=fingerprint,
        ),
        "disk": _labels(
            tier="disk", medium="DISK", num_blocks="8", size_bytes=str(slot_start(8, 4096)),
            eviction_policy="arc", reset_drops_blocks="True", fingerprint=fingerprint,
        ),
        "remote": _labels(
            tier="remote", medium="REMOTE", address=address, reset_drops_blocks="False",
            fingerprint=fingerprint,
        ),
    }  # fmt: skip


def _labels(**values: str) -> dict[str, str]:
    """Every declared label, empty where the series has no value, and vLLM's engine label."""
    from kvoffload.integrations.vllm.spec import CONFIG_INFO_KEYS

    common = {"engine": "0", "block_bytes": "1024", "blocks_per_chunk": "1"}
    return {key: "" for key in CONFIG_INFO_KEYS} | common | values


def test_config_info_never_shows_the_servers_password(
    vllm_modules: dict[str, ModuleType],
) -> None:
    url = "redis://user:s3cret@127.0.0.1:6390/0"
    spec = create_spec({"cpu_bytes_to_use": 4096, "kvoffload.remote_url": url})
    (remote,) = [s for s in spec.config_info() if s["tier"] == "remote"]
    assert remote["address"] == "redis://user:***@127.0.0.1:6390/0"
    assert "s3cret" not in repr(spec.config_info())


def test_an_expedited_load_does_not_wait_behind_regular_loads(
    vllm_modules: dict[str, ModuleType],
) -> None:
    """vLLM waits for a sync (expedited) load within the step; a regular load still
    copying must not hold it up."""
    _needs("expedited")
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        TransferJob,
    )
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    spec = create_spec({"cpu_bytes_to_use": 8 * 512}, bytes_per_block=512)
    caches = canonical_caches(2, 8, 256, seed=5)
    connector = connector_worker(spec, caches)
    worker = connector.worker
    release = threading.Event()

    def hold_regular_loads(job_id: int, step: int) -> None:
        if job_id == 1:
            release.wait(60)

    worker._load._fault_hook = hold_regular_loads  # the regular load thread stays busy
    slots = worker.store.rows()
    expected = slots[3].clone()
    loads = {
        1: TransferJob("regular", CPULoadStoreSpec([2]), GPULoadStoreSpec([2], [1], [0])),
        2: TransferJob("sync", CPULoadStoreSpec([3]), GPULoadStoreSpec([5], [1], [0]), True),
    }
    step = threading.Thread(
        target=connector.start_kv_transfers,
        args=(OffloadingConnectorMetadata(load_jobs=loads, store_jobs={}),),
    )
    step.start()
    try:
        step.join(30)
        assert not step.is_alive()  # the step went on while the regular load still copies
    finally:
        release.set()
        step.join(30)
    worker.wait({1, 2})
    pages = torch.stack([t.tensor[5] for t in caches.tensors]).view(torch.uint8)
    assert torch.equal(pages.flatten(), expected.flatten().view(torch.uint8))
    connector.shutdown()
