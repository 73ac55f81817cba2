"""KV events of every tier, through vLLM's own connector: its ``Medium`` has CPU and
STORAGE only, so the disk and shared tiers publish STORAGE with their locality and
our medium as the event's ownership."""

from __future__ import annotations

import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

from vllm_helpers import canonical_caches, create_spec, request_context
from vllm_scheduler import connector_scheduler

from kvoffload import block_id_key
from kvoffload.tiers.slot_file import slot_start, slot_stride
from tier_servers import ValkeyProcess

KEYS = [block_id_key(i) for i in range(1, 7)]
BLOCK_BYTES = 2 * 256


def _block_hash(key: bytes) -> Any:
    """The block hash as vLLM's events carry it."""
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    return maybe_convert_block_hash(BlockHash(key[:-4]))


def test_tier_events_pass_vllms_connector_with_their_media(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, valkey_server: ValkeyProcess
) -> None:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    extra = {
        "cpu_bytes_to_use": 2 * BLOCK_BYTES,
        "kvoffload.disk_dir": str(tmp_path / "disk"),
        "kvoffload.disk_bytes": slot_start(8, slot_stride(BLOCK_BYTES)),
        "kvoffload.remote_url": valkey_server.url,
    }
    engine = f"test-{uuid.uuid4().hex[:12]}"
    options: dict[str, Any] = {
        "bytes_per_block": BLOCK_BYTES,
        "events": True,
        "engine_id": engine,
        "model": f"events-{uuid.uuid4().hex[:8]}",
    }
    spec = create_spec(extra, **options)
    worker = create_spec(extra, **options).get_worker(canonical_caches(2, 8, 256, seed=1))
    scheduler = connector_scheduler(spec)
    manager = spec.get_manager()
    try:
        for index in range(0, 4, 2):  # the second pair evicts the first to disk
            keys = KEYS[index : index + 2]
            context = request_context(f"r{index}", keys)
            output = manager.prepare_store(keys, context)
            assert output is not None and output.keys_to_store == keys
            assert worker.submit_store(index, GPULoadStoreSpec([0, 1], [2], [0]), output.store_spec)
            worker.wait({index})
            assert all(result.success for result in worker.get_finished())
            manager.complete_store(keys, context)
            manager.on_request_finished(context)
        for tier in manager.backing.tiers:
            tier.poll(wait=True)
        published = {
            (type(event).__name__, event.medium, event.locality, event.ownership, h)
            for event in scheduler.take_events()
            for h in event.block_hashes
        }
    finally:
        worker.shutdown()
        spec.close()
    first, second = [_block_hash(k) for k in KEYS[0:2]], [_block_hash(k) for k in KEYS[2:4]]
    expected = set()
    for h in first + second:
        expected.add(("BlockStored", "CPU", None, None, h))
        expected.add(("BlockStored", "STORAGE", "REMOTE", "REMOTE", h))
    for h in first:
        expected.add(("BlockRemoved", "CPU", None, None, h))
        expected.add(("BlockStored", "STORAGE", "LOCAL", "DISK", h))
    assert published == expected


def test_only_the_disk_tier_promises_to_announce_removals(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, valkey_server: ValkeyProcess
) -> None:
    """vLLM keeps a stored block's event payload until each tier that promised to
    announce its removal has done so: the disk tier evicts with an event, the shared
    tier never removes, and the CPU tier's residency is vLLM's own."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    extra = {
        "cpu_bytes_to_use": BLOCK_BYTES,
        "kvoffload.disk_dir": str(tmp_path / "disk"),
        "kvoffload.disk_bytes": slot_start(8, slot_stride(BLOCK_BYTES)),
        "kvoffload.remote_url": valkey_server.url,
    }
    options: dict[str, Any] = {
        "bytes_per_block": BLOCK_BYTES,
        "events": True,
        "engine_id": f"test-{uuid.uuid4().hex[:12]}",
        "model": f"removal-{uuid.uuid4().hex[:8]}",
    }
    spec = create_spec(extra, **options)
    worker = create_spec(extra, **options).get_worker(canonical_caches(2, 8, 256, seed=2))
    manager = spec.get_manager()
    try:
        for index, key in enumerate(KEYS[:2]):  # the second evicts the first to disk
            context = request_context(f"r{index}", [key])
            output = manager.prepare_store([key], context)
            assert worker.submit_store(index, GPULoadStoreSpec([0], [1], [0]), output.store_spec)
            worker.wait({index})
            assert all(result.success for result in worker.get_finished())
            manager.complete_store([key], context)
        for tier in manager.backing.tiers:
            tier.poll(wait=True)
        stored = {
            (event.ownership, event.removal_expected)
            for event in manager.take_events()
            if not event.removed
        }
    finally:
        worker.shutdown()
        spec.close()
    assert stored == {(None, False), ("DISK", True), ("REMOTE", False)}
