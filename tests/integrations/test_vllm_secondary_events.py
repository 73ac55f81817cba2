"""KV events of our secondary tiers, through vLLM 0.33's own connector scheduler.

vLLM's scheduler decides what to store, its ``OffloadingEventsTracker`` turns
the tiers' events into ``BlockStored`` / ``BlockRemoved``, and a router is
played by replaying them per medium and tier. vLLM's worker needs CUDA, so its
GPU -> CPU copies are reported done without moving bytes (the events do not
depend on them).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from vllm_scheduler import (
    allocate,
    connector_scheduler,
    end_step,
    offload_keys,
    report_finished,
    schedule_prefill,
    vllm_request,
)

from kvoffload.tiers.slot_file import footprint
from tier_servers import ValkeyProcess

pytest.importorskip("torch")

BLOCK_BYTES = 4096
BLOCKS_PER_CHUNK = 2
"""Two of vLLM's blocks per chunk: a chunk's events carry two block hashes."""
CHUNK_BYTES = BLOCK_BYTES * BLOCKS_PER_CHUNK
WAIT_S = 30.0


class Router:
    """What a router following vLLM's KV events believes each (medium, tier) holds."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, str | None], set[Any]] = {}

    def follow(self, events: Any) -> None:
        for event in events:
            held = self.held.setdefault((event.medium, event.ownership), set())
            if type(event).__name__ == "BlockStored":
                held.update(event.block_hashes)
            elif type(event).__name__ == "BlockRemoved":
                held.difference_update(event.block_hashes)

    def storage(self) -> dict[str | None, set[Any]]:
        return {tier: held for (medium, tier), held in self.held.items() if medium == "STORAGE"}


def _run(tiers: list[dict[str, Any]], requests: int) -> tuple[Router, Any, list[Any]]:
    """``requests`` requests of two chunks each, one after another, through vLLM's
    scheduler over a CPU tier of two chunks (each request evicts the one before); the
    router's view once every tier settled, the manager (shut down by the caller) and the
    requests."""
    from kvoffload.integrations.vllm.secondary_replay import tiering_spec

    spec = tiering_spec(
        tiers,
        2 * CHUNK_BYTES,
        bytes_per_block=BLOCK_BYTES,
        engine_id=f"test-{uuid.uuid4().hex[:12]}",
        model=f"events-{uuid.uuid4().hex[:8]}",
        events=True,
        self_describing_events=True,
        blocks_per_chunk=BLOCKS_PER_CHUNK,
    )
    scheduler = connector_scheduler(spec)
    manager = spec.get_manager()
    router = Router()
    made = []

    def settle() -> None:
        deadline = time.monotonic() + WAIT_S
        while True:
            end_step(scheduler)
            router.follow(scheduler.take_events())
            if not scheduler.has_pending_push_work():
                return
            assert time.monotonic() < deadline, "the tiers never settled"
            time.sleep(0.002)

    for n in range(requests):
        blocks = 2 * BLOCKS_PER_CHUNK + 1  # two whole chunks and one token
        request = vllm_request(f"r{n}", list(range(1000 * n, 1000 * n + 16 * (blocks - 1) + 1)))
        made.append(request)
        scheduler.on_new_request(request)
        deadline = time.monotonic() + WAIT_S
        while scheduler.get_num_new_matched_tokens(request, 0)[0] is None:
            end_step(scheduler)  # our tiers answer lookups at the next step
            assert time.monotonic() < deadline, "the lookup never settled"
            time.sleep(0.002)
        allocate(scheduler, request, blocks, 0)
        meta = schedule_prefill(scheduler, request, blocks)
        report_finished(scheduler, list(meta.store_jobs))
        settle()
    return router, manager, made


def _hashes(request: Any) -> set[Any]:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return {maybe_convert_block_hash(h) for h in request.block_hashes}


def _chunk_hashes(request: Any, held: list[bool]) -> set[Any]:
    """The block hashes of the request's chunks that ``held`` marks."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    hashes = [maybe_convert_block_hash(h) for h in request.block_hashes]
    return {
        h
        for chunk, there in enumerate(held)
        if there
        for h in hashes[chunk * BLOCKS_PER_CHUNK : (chunk + 1) * BLOCKS_PER_CHUNK]
    }


def _chunk_keys(request: Any) -> list[Any]:
    """The request's chunk keys (a chunk is keyed by its last block's hash)."""
    keys = offload_keys(request)
    return keys[BLOCKS_PER_CHUNK - 1 :: BLOCKS_PER_CHUNK]


def _disk(tmp_path: Path, name: str, chunks: int) -> dict[str, Any]:
    from kvoffload.integrations.vllm.secondary import MODULE_PATH

    return {
        "type": "KVOffloadDiskTier",
        "module_path": MODULE_PATH,
        "disk_dir": str(tmp_path / name),
        "disk_bytes": footprint(chunks, CHUNK_BYTES),
        "admission": "none",
        "enable_kv_events": True,
    }


def test_a_disk_eviction_removes_every_block_hash_its_store_announced(
    vllm_modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    """With vLLM's self-describing events a chunk's store names each of its block hashes,
    and vLLM keeps them until every tier that promised a removal announced it. The disk
    tier evicts with an event: it must promise it, else vLLM forgets the chunk's hashes
    when its CPU tier evicts it, and the disk's later removal names only the chunk's key
    (a router kept the chunk's other block on disk for good)."""
    router, manager, requests = _run([_disk(tmp_path, "disk", chunks=2)], requests=4)
    try:
        (disk,) = manager.secondary_tiers
        held = set().union(*(_chunk_hashes(r, disk.tier.held(_chunk_keys(r))) for r in requests))
    finally:
        manager.shutdown()
    assert len(held) == 2 * BLOCKS_PER_CHUNK  # the disk holds the last request only
    assert held == _hashes(requests[-1])
    assert router.storage() == {"1:KVOffloadDiskTier": held}


def test_each_tier_announces_its_own_removals(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, valkey_server: ValkeyProcess
) -> None:
    """Two disk tiers of different sizes and a shared tier: each tier's events name it (as
    vLLM's ``tier`` label), so a router tells them apart, and one disk's eviction does not
    end what vLLM keeps of a chunk the other disk still holds."""
    from kvoffload.integrations.vllm.secondary import MODULE_PATH

    shared = {
        "type": "KVOffloadSharedTier",
        "module_path": MODULE_PATH,
        "url": valkey_server.url,
        "admission": "none",
        "enable_kv_events": True,
    }
    tiers = [_disk(tmp_path, "small", chunks=2), _disk(tmp_path, "large", chunks=8), shared]
    router, manager, requests = _run(tiers, requests=4)
    try:
        small, large, _ = manager.secondary_tiers
        expected = {
            tier.tier_label: set().union(
                *(_chunk_hashes(r, tier.tier.held(_chunk_keys(r))) for r in requests)
            )
            for tier in (small, large)
        }
        expected["3:KVOffloadSharedTier"] = set().union(*(_hashes(r) for r in requests))
    finally:
        manager.shutdown()
    assert len(expected["1:KVOffloadDiskTier"]) == 2 * BLOCKS_PER_CHUNK
    assert len(expected["2:KVOffloadDiskTier"]) == 4 * 2 * BLOCKS_PER_CHUNK
    assert router.storage() == expected
