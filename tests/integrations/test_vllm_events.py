"""KV events of every tier, through vLLM's own connector: its ``Medium`` has CPU and
STORAGE only, so the disk and shared tiers publish STORAGE with their locality and
our medium as the event's ownership."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

from vllm_helpers import canonical_caches, create_spec, request_context
from vllm_scheduler import connector_scheduler, end_step

from kvoffload import block_id_key
from kvoffload.tiers.slot_file import slot_start, slot_stride
from tier_servers import ValkeyProcess

KEYS = [block_id_key(i) for i in range(1, 7)]
BLOCK_BYTES = 2 * 256


def _block_hash(key: bytes) -> Any:
    """The block hash as vLLM's events carry it."""
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    return maybe_convert_block_hash(BlockHash(key[:-4]))


def _spec(
    tmp_path: Path,
    seed: int,
    cpu_blocks: int = 2,
    remote_url: str | None = None,
    model: str | None = None,
) -> tuple[Any, Any, Any]:
    """A spec with KV events over a CPU tier of ``cpu_blocks`` blocks, a disk tier of 8 (and
    the shared tier at ``remote_url``), a worker of its own over GPU caches of 8 blocks
    filled from ``seed``, and its scheduler-side manager."""
    extra: dict[str, Any] = {
        "cpu_bytes_to_use": cpu_blocks * BLOCK_BYTES,
        "kvoffload.disk_dir": str(tmp_path / "disk"),
        "kvoffload.disk_bytes": slot_start(8, slot_stride(BLOCK_BYTES)),
    }
    if remote_url is not None:
        extra["kvoffload.remote_url"] = remote_url
    options: dict[str, Any] = {
        "bytes_per_block": BLOCK_BYTES,
        "events": True,
        "engine_id": f"test-{uuid.uuid4().hex[:12]}",
    }
    if model is not None:
        options["model"] = f"{model}-{uuid.uuid4().hex[:8]}"
    spec = create_spec(extra, **options)
    worker = create_spec(extra, **options).get_worker(canonical_caches(2, 8, 256, seed=seed))
    return spec, worker, spec.get_manager()


def test_tier_events_pass_vllms_connector_with_their_media(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, valkey_server: ValkeyProcess
) -> None:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    spec, worker, manager = _spec(tmp_path, 1, remote_url=valkey_server.url, model="events")
    scheduler = connector_scheduler(spec)
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


def test_an_idle_engine_steps_until_the_disk_tiers_writes_are_published(
    vllm_modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    """vLLM keeps stepping an engine with no request while its connector has pending work,
    and publishes each step's events. The disk tier writes back the blocks the CPU tier
    evicted on its own threads: the manager reports that work pending until it is applied
    and published, so a router learns of those blocks when they land, not with the
    engine's next request (which the router, not knowing them, may send elsewhere)."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    spec, worker, manager = _spec(tmp_path, 1)
    scheduler = connector_scheduler(spec)
    published: set[Any] = set()

    def step() -> None:
        end_step(scheduler)
        published.update(
            (type(event).__name__, event.ownership, h)
            for event in scheduler.take_events()
            for h in event.block_hashes
        )

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
            step()
        deadline = time.monotonic() + 30
        while scheduler.has_pending_push_work():  # what vLLM's engine asks before a step
            assert time.monotonic() < deadline, "the disk tier's writes never settled"
            step()
            time.sleep(0.005)
    finally:
        worker.shutdown()
        spec.close()
    assert {("BlockStored", "DISK", _block_hash(key)) for key in KEYS[:2]} <= published


def test_only_the_disk_tier_promises_to_announce_removals(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, valkey_server: ValkeyProcess
) -> None:
    """vLLM keeps a stored block's event payload until each tier that promised to
    announce its removal has done so: the disk tier evicts with an event, the shared
    tier never removes, and the CPU tier's residency is vLLM's own."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    spec, worker, manager = _spec(
        tmp_path, 2, cpu_blocks=1, remote_url=valkey_server.url, model="removal"
    )
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


def _replay(events: Any, into: dict[tuple[str, str | None], set[Any]]) -> None:
    """What a router following vLLM's KV events believes each medium holds."""
    for event in events:
        held = into.setdefault((event.medium, event.ownership), set())
        if type(event).__name__ == "BlockStored":
            held.update(event.block_hashes)
        elif type(event).__name__ == "BlockRemoved":
            held.difference_update(event.block_hashes)


def _across_a_reset(
    tmp_path: Path, valkey_server: ValkeyProcess
) -> tuple[dict[tuple[str, str | None], set[Any]], set[Any], set[Any]]:
    """Three pairs stored through a 2-block CPU tier (each evicts the one before to disk;
    all go through to the shared tier), events taken after each, then vLLM's cache reset
    with the last writes still to land: what the events, replayed per medium, say, and
    what the disk and shared tiers hold after the reset."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    spec, worker, manager = _spec(tmp_path, 3, remote_url=valkey_server.url, model="reset-events")
    scheduler = connector_scheduler(spec)
    believed: dict[tuple[str, str | None], set[Any]] = {}
    try:
        for index in range(0, 6, 2):
            keys = KEYS[index : index + 2]
            context = request_context(f"r{index}", keys)
            output = manager.prepare_store(keys, context)
            assert output is not None and output.keys_to_store == keys
            assert worker.submit_store(index, GPULoadStoreSpec([0, 1], [2], [0]), output.store_spec)
            worker.wait({index})
            assert all(result.success for result in worker.get_finished())
            manager.complete_store(keys, context)
            manager.on_request_finished(context)
            _replay(scheduler.take_events(), believed)
        deadline = time.monotonic() + 30  # the demotions land on the disk's own threads
        while not believed.get(("STORAGE", "DISK")) and time.monotonic() < deadline:
            time.sleep(0.005)
            manager.backing.poll()
            _replay(scheduler.take_events(), believed)
        assert believed[("STORAGE", "DISK")]  # the router knows of blocks on disk
        scheduler.reset_cache()
        _replay(scheduler.take_events(), believed)
        disk, remote = manager.backing.tiers
        on_disk = {_block_hash(k) for k, held in zip(KEYS, disk.held(KEYS), strict=True) if held}
        on_server = {
            _block_hash(k) for k, held in zip(KEYS, remote.held(KEYS), strict=True) if held
        }
    finally:
        worker.shutdown()
        spec.close()
    return believed, on_disk, on_server


def test_writes_landing_at_a_reset_are_announced(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, valkey_server: ValkeyProcess
) -> None:
    """The reset took the events before closing the old tiers, so those recorded while
    closing were lost: the shared tier's writes that landed then were never announced,
    though the server keeps those blocks across the reset."""
    believed, _, on_server = _across_a_reset(tmp_path, valkey_server)
    assert on_server == {_block_hash(k) for k in KEYS}
    assert believed[("STORAGE", "REMOTE")] == on_server


def test_blocks_a_reset_wipes_from_disk_are_announced_removed(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, valkey_server: ValkeyProcess
) -> None:
    """The disk tier promises to announce its removals (vLLM keeps a block's payload until
    it does), but the blocks a reset wiped from it got no event: a router kept them."""
    believed, on_disk, _ = _across_a_reset(tmp_path, valkey_server)
    assert on_disk == set()
    assert believed[("STORAGE", "DISK")] == on_disk


def test_a_promotion_landing_at_a_reset_announces_no_cpu_block(
    vllm_modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    """vLLM's reset announces nothing per block for its CPU tier (the engine's cache reset
    publishes ``AllBlocksCleared`` before the connector's events). A promotion from disk
    still in flight lands, while the old tiers close, in the CPU tier the reset threw
    away: announcing that store would tell a router of CPU blocks that are gone."""

    spec, worker, manager = _spec(tmp_path, 4)
    scheduler = connector_scheduler(spec)
    believed: dict[tuple[str, str | None], set[Any]] = {}
    try:
        _promote_from_disk(worker, manager, scheduler, believed)
        scheduler.reset_cache()
        believed[("CPU", None)] = set()  # as a router does on vLLM's AllBlocksCleared
        _replay(scheduler.take_events(), believed)
        held = [manager.backing.cpu.holds(key) for key in KEYS]
    finally:
        worker.shutdown()
        spec.close()
    assert held == [False] * len(KEYS)
    assert believed[("CPU", None)] == set()


def test_a_promotion_landed_before_a_reset_but_unpublished_announces_no_cpu_block(
    vllm_modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    """An idle engine's ``has_pending_work`` lands a promotion (a CPU store queued) between
    steps; vLLM may run a cache reset before the next step publishes it. That step's batch
    is vLLM's ``AllBlocksCleared`` then the connector's events: a CPU store from before the
    reset, published after it, tells a router of a CPU block the reset threw away."""

    spec, worker, manager = _spec(tmp_path, 5)
    scheduler = connector_scheduler(spec)
    believed: dict[tuple[str, str | None], set[Any]] = {}
    try:
        _promote_from_disk(worker, manager, scheduler, believed)
        deadline = time.monotonic() + 30  # the read lands on the disk's own threads
        while manager.backing.is_promoting(KEYS[0]) and time.monotonic() < deadline:
            time.sleep(0.005)
            manager.has_pending_work()  # the idle engine's poll: the promotion lands
        assert manager.backing.cpu.holds(KEYS[0]) and not manager.backing.is_promoting(KEYS[0])
        scheduler.reset_cache()
        believed[("CPU", None)] = set()  # as a router does on vLLM's AllBlocksCleared
        _replay(scheduler.take_events(), believed)
        held = [manager.backing.cpu.holds(key) for key in KEYS]
    finally:
        worker.shutdown()
        spec.close()
    assert held == [False] * len(KEYS)
    assert believed[("CPU", None)] == set()


def _promote_from_disk(
    worker: Any, manager: Any, scheduler: Any, believed: dict[tuple[str, str | None], set[Any]]
) -> None:
    """Store two pairs of blocks through vLLM (the second pair evicts the first to disk),
    replay their events into ``believed``, then look the first pair up: a promotion from
    disk in flight."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult

    for index in range(0, 4, 2):
        keys = KEYS[index : index + 2]
        context = request_context(f"r{index}", keys)
        output = manager.prepare_store(keys, context)
        assert output is not None
        assert worker.submit_store(index, GPULoadStoreSpec([0, 1], [2], [0]), output.store_spec)
        worker.wait({index})
        assert all(result.success for result in worker.get_finished())
        manager.complete_store(keys, context)
        manager.on_request_finished(context)
    manager.backing.tiers[0].poll(wait=True)
    _replay(scheduler.take_events(), believed)
    reader = request_context("reader", KEYS[:2])
    assert manager.lookup(KEYS[0], reader) is LookupResult.RETRY
