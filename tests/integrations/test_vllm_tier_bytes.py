"""KV bytes through the lower tiers under vLLM: worker slots in shared memory, scheduler tiers.

The workers are vLLM's ``OffloadingWorker`` contract on our handlers over CPU
"GPU" tensors; the scheduler side is the spec's manager. Blocks go GPU -> CPU
slot (worker), CPU slot -> disk or server (scheduler, through the shared
region), back into a CPU slot (promotion) and CPU -> GPU (worker).
"""

from __future__ import annotations

import multiprocessing
import uuid
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from vllm_helpers import (
    Instance,
    canonical_caches,
    create_spec,
    lookup_until_settled,
    request_context,
)

from kvoffload import block_id_key
from kvoffload.core.keys import OffloadKey
from kvoffload.tiers.slot_file import slot_start, slot_stride
from tier_servers import ValkeyProcess

torch = pytest.importorskip("torch")

KEYS = [block_id_key(i) for i in range(1, 9)]
NUM_TENSORS = 2
PAGE_BYTES = 256
BLOCK_BYTES = NUM_TENSORS * PAGE_BYTES


def _disk(tmp_path: Path, cpu_blocks: int = 2, world_size: int = 1) -> dict[str, Any]:
    """A 2-block CPU tier over a disk tier whose slot file holds 16 blocks."""
    return {
        "cpu_bytes_to_use": cpu_blocks * BLOCK_BYTES * world_size,
        "kvoffload.disk_dir": str(tmp_path / "disk"),
        "kvoffload.disk_bytes": slot_start(16, slot_stride(BLOCK_BYTES * world_size)),
    }


def _settle(instance: Instance, keys: list[OffloadKey], context: Any) -> None:
    """Look ``keys`` up one by one as vLLM does: the first is RETRY while all of them are
    promoted, in one read, then each is HIT."""
    from vllm.v1.kv_offload.base import LookupResult

    reads = sum(instance.manager.backing.promotion_batches)
    answers = lookup_until_settled(instance.manager, keys[0], context)
    assert answers[0] is LookupResult.RETRY and answers[-1] is LookupResult.HIT, answers
    for key in keys[1:]:
        assert instance.manager.lookup(key, context) is LookupResult.HIT
    assert sum(instance.manager.backing.promotion_batches) == reads + 1


def _evict_to_disk(instance: Instance) -> Any:
    """Store KEYS[0:2] from GPU blocks 0-1, then KEYS[2:4] from 2-3: the first pair is
    evicted from the 2-block CPU tier into the disk tier. Returns the disk tier."""
    for index, (keys, blocks) in enumerate(((KEYS[0:2], [0, 1]), (KEYS[2:4], [2, 3]))):
        context = request_context(f"s{index}", keys)
        instance.store(keys, blocks, context)
        instance.manager.on_request_finished(context)
    disk = instance.manager.backing.tiers[0]
    disk.poll(wait=True)  # the evicted blocks' background writes have landed
    assert (disk.medium, disk.stats.stored_blocks, disk.stats.failed) == ("DISK", 2, 0)
    return disk


def test_blocks_written_back_to_disk_come_back_with_their_bytes(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, instances: Callable[..., Instance]
) -> None:
    instance = instances(_disk(tmp_path))
    expected = instance.gpu(0, [0, 1])
    _evict_to_disk(instance)
    instance.clear_gpu()
    context = request_context("back", KEYS[:2])
    _settle(instance, KEYS[:2], context)
    instance.load(KEYS[:2], [8, 9], context)
    for loaded, want in zip(instance.gpu(0, [8, 9]), expected, strict=True):
        assert torch.equal(loaded, want)
    slot_bytes = instance.scheduler.shared_slot_bytes()
    assert slot_bytes.unavailable == 0 and slot_bytes.mapped
    instance.manager.shutdown()  # vLLM's scheduler, at the end: tiers closed, regions unmapped
    assert not slot_bytes.mapped
    path = instance.scheduler.region_path(0)
    assert path.exists()
    instance.workers[0].shutdown()  # the worker, at the end: its region is unlinked
    assert not path.exists()


def test_a_second_instance_loads_what_the_first_wrote_to_the_shared_tier(
    vllm_modules: dict[str, ModuleType],
    valkey_server: ValkeyProcess,
    instances: Callable[..., Instance],
) -> None:
    from vllm.v1.kv_offload.base import LookupResult

    extra = {"cpu_bytes_to_use": 8 * BLOCK_BYTES, "kvoffload.remote_url": valkey_server.url}
    first = instances(extra, model="shared-bytes", seed=1)
    expected = first.gpu(0, [4, 5, 6])
    context = request_context("w", KEYS[:3])
    assert first.manager.lookup(KEYS[0], context) is LookupResult.MISS
    first.store(KEYS[:3], [4, 5, 6], context)
    first.scheduler.close()  # its write-through to the server has finished
    assert first.manager.backing.tiers[0].stats.stored_blocks == 3

    second = instances(extra, model="shared-bytes", seed=2)
    other_model = instances(extra, model="other-model", workers=False)
    assert not torch.equal(second.gpu(0, [0, 1, 2])[0], expected[0])  # different GPU contents
    context = request_context("r", KEYS[:3])
    _settle(second, KEYS[:3], context)
    second.load(KEYS[:3], [0, 1, 2], context)
    for loaded, want in zip(second.gpu(0, [0, 1, 2]), expected, strict=True):
        assert torch.equal(loaded, want)
    assert second.manager.backing.tiers[0].stats.hit_blocks == 3
    # Another model's blocks are never offered, though the keys are the same.
    answer = other_model.manager.lookup(KEYS[0], request_context("o", KEYS))
    assert answer is LookupResult.MISS


def test_two_ranks_write_and_promote_the_concatenation_of_their_slots(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, instances: Callable[..., Instance]
) -> None:
    instance = instances(_disk(tmp_path, world_size=2), world_size=2)
    assert len(instance.workers) == 2 and instance.scheduler.bytes_per_block == 2 * BLOCK_BYTES
    expected = [instance.gpu(rank, [0, 1]) for rank in range(2)]
    assert not torch.equal(expected[0][0], expected[1][0])
    disk = _evict_to_disk(instance)
    # On disk, a block is rank 0's slot bytes followed by rank 1's.
    view = memoryview(bytearray(2 * BLOCK_BYTES))
    assert disk.read([KEYS[0]], lambda _: view).result() == [True]
    for rank in range(2):
        half = torch.frombuffer(
            view[rank * BLOCK_BYTES : (rank + 1) * BLOCK_BYTES], dtype=torch.int8
        )
        pages = half.view(NUM_TENSORS, PAGE_BYTES)
        for tensor in range(NUM_TENSORS):
            assert torch.equal(pages[tensor], expected[rank][tensor][0])
    instance.clear_gpu()
    context = request_context("back", KEYS[:2])
    _settle(instance, KEYS[:2], context)
    instance.load(KEYS[:2], [10, 11], context)
    for rank in range(2):
        for loaded, want in zip(instance.gpu(rank, [10, 11]), expected[rank], strict=True):
            assert torch.equal(loaded, want)


def test_without_the_workers_buffers_blocks_are_counted_failures_until_they_appear(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, instances: Callable[..., Instance]
) -> None:
    from vllm.v1.kv_offload.base import LookupResult

    writer = instances(_disk(tmp_path))
    writer_bytes = writer.gpu(0, [0])
    _evict_to_disk(writer)
    writer.close()  # its region is unlinked; the disk keeps the two blocks

    # Same model and disk, but its workers never created their buffers.
    reader = instances(_disk(tmp_path), workers=False, seed=3)
    slot_bytes = reader.scheduler.shared_slot_bytes()
    disk = reader.manager.backing.tiers[0]
    assert disk.present(KEYS[:2]) == 2
    context = request_context("miss", KEYS[:1])
    answers = lookup_until_settled(reader.manager, KEYS[0], context)
    assert answers[0] is LookupResult.RETRY and answers[-1] is LookupResult.MISS, answers
    assert slot_bytes.unavailable == 1 and not slot_bytes.mapped
    # Evictions cannot be written down either: counted as the disk tier's failed stores.
    for index, keys in enumerate((KEYS[4:6], KEYS[6:8])):
        context = request_context(f"n{index}", keys)
        output = reader.manager.prepare_store(keys, context)
        assert output is not None
        reader.manager.complete_store(keys, context)
    disk.poll(wait=True)
    assert (disk.stats.failed, slot_bytes.unavailable) == (2, 3)
    assert disk.present(KEYS[4:6]) == 0
    # Once the workers are up, the same lookup promotes the block with its bytes.
    reader.start_workers()
    context = request_context("late", KEYS[:1])
    _settle(reader, KEYS[:1], context)
    reader.load(KEYS[:1], [11], context)
    assert slot_bytes.mapped and slot_bytes.unavailable == 3
    for loaded, want in zip(reader.gpu(0, [11]), writer_bytes, strict=True):
        assert torch.equal(loaded, want)


def _spawned_worker(path: str, num_blocks: int, seed: int, conn: Any) -> None:
    """A worker process: our data plane over ``path``'s shared region, GPU as CPU tensors.

    It builds the halves view of canonical pages as ``KVOffloadWorker`` does, without
    importing vLLM (a second vLLM import would cost the test ~15 s).
    """
    import torch

    from kvoffload.core.layout import KVLayout
    from kvoffload.core.specs import CPULoadStoreSpec, GPULoadStoreSpec
    from kvoffload.dataplane import CPUBlockStore, cpu_gpu_handlers
    from kvoffload.dataplane.shared_region import SharedRegion

    generator = torch.Generator().manual_seed(seed)
    pages = [
        torch.randint(0, 256, (12, PAGE_BYTES), dtype=torch.uint8, generator=generator)
        for _ in range(NUM_TENSORS)
    ]
    halves = [p.view(12, 2, PAGE_BYTES // 2).transpose(0, 1) for p in pages]
    layout = KVLayout(NUM_TENSORS, 1, PAGE_BYTES // 2, "float8", tokens_per_block=1)
    region = SharedRegion(Path(path), num_blocks * BLOCK_BYTES)
    store = CPUBlockStore(layout, num_blocks, buffer=region.tensor)
    (_, _, to_cpu), (_, _, to_gpu) = cpu_gpu_handlers(halves, store)
    conn.send("ready")
    job = 0
    while (message := conn.recv())[0] != "stop":
        kind, gpu_blocks, slots = message
        job += 1
        gpu = GPULoadStoreSpec(gpu_blocks, [len(gpu_blocks)], [0])
        if kind == "store":
            to_cpu.transfer_async(job, (gpu, CPULoadStoreSpec(slots)))
            to_cpu.wait({job})
            ok = all(r.success for r in to_cpu.get_finished())
        else:
            to_gpu.transfer_async(job, (CPULoadStoreSpec(slots), gpu))
            to_gpu.wait({job})
            ok = all(r.success for r in to_gpu.get_finished())
        conn.send((ok, [bytes(p[gpu_blocks].numpy()) for p in pages]))
    to_cpu.close()
    to_gpu.close()
    region.close()
    conn.send("stopped")


def _expected_pages(seed: int, blocks: list[int]) -> list[bytes]:
    generator = torch.Generator().manual_seed(seed)
    pages = [
        torch.randint(0, 256, (12, PAGE_BYTES), dtype=torch.uint8, generator=generator)
        for _ in range(NUM_TENSORS)
    ]
    return [bytes(p[blocks].numpy()) for p in pages]


def test_bytes_cross_from_a_worker_process_to_the_scheduler_and_back(
    vllm_modules: dict[str, ModuleType], tmp_path: Path, instances: Callable[..., Instance]
) -> None:
    scheduler = instances(_disk(tmp_path), workers=False)
    manager = scheduler.manager
    path = scheduler.scheduler.region_path(0)
    context_spawn = multiprocessing.get_context("spawn")
    ours, theirs = context_spawn.Pipe()
    worker = context_spawn.Process(
        target=_spawned_worker, args=(str(path), scheduler.scheduler.num_blocks, 7, theirs)
    )
    worker.start()
    try:
        assert ours.poll(60) and ours.recv() == "ready"
        assert path.exists()
        for index, (keys, blocks) in enumerate(((KEYS[0:2], [0, 1]), (KEYS[2:4], [2, 3]))):
            context = request_context(f"s{index}", keys)
            output = manager.prepare_store(keys, context)
            assert output is not None
            ours.send(("store", blocks, list(output.store_spec.block_ids)))
            assert ours.poll(30) and ours.recv()[0]
            manager.complete_store(keys, context)
            manager.on_request_finished(context)
        disk = manager.backing.tiers[0]
        disk.poll(wait=True)
        assert disk.stats.stored_blocks == 2  # read from the worker's region by the scheduler
        context = request_context("back", KEYS[:2])
        _settle(scheduler, KEYS[:2], context)
        slots = manager.prepare_load(KEYS[:2], context)
        ours.send(("load", [8, 9], list(slots.block_ids)))
        assert ours.poll(30)
        ok, loaded = ours.recv()
        manager.complete_load(KEYS[:2], context)
        assert ok and loaded == _expected_pages(7, [0, 1])
        ours.send(("stop", [], []))
        assert ours.poll(30) and ours.recv() == "stopped"
        assert not path.exists()  # the creator unlinked its region
    finally:
        worker.join(30)
        if worker.is_alive():
            worker.kill()
            worker.join()


def test_a_worker_whose_slots_differ_from_what_vllm_reported_stops_at_start_up(
    vllm_modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    from kvoffload import InvalidArgumentError

    engine_id = f"test-{uuid.uuid4().hex[:12]}"
    spec = create_spec(_disk(tmp_path), bytes_per_block=3 * PAGE_BYTES, engine_id=engine_id)
    with pytest.raises(InvalidArgumentError, match=r"stores 512 bytes.*vLLM reported 768"):
        spec.get_worker(canonical_caches(NUM_TENSORS, 12, PAGE_BYTES, 0))
    assert not spec.region_path(0).exists()
