"""The simulator's data-plane backend: overlapping jobs, out-of-order finishes, verified loads."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from dataplane_helpers import LAYOUTS  # noqa: E402

from kvoffload.core.errors import InvalidArgumentError  # noqa: E402
from kvoffload.core.keys import OffloadKey, block_id_key  # noqa: E402
from kvoffload.core.specs import CPULoadStoreSpec  # noqa: E402
from kvoffload.managers import CPUOffloadingManager  # noqa: E402
from kvoffload.sim.dataplane_backend import DataPlaneBackend  # noqa: E402

key = block_id_key


def test_content_depends_on_the_key_only() -> None:
    backend = DataPlaneBackend(LAYOUTS["bf16"], 8, 4)
    a, b = backend.content([key(1), key(2)]), backend.content([key(2), key(1)])
    assert torch.equal(a[0], b[1]) and torch.equal(a[1], b[0])
    assert not torch.equal(a[0], a[1])
    backend.close()


def test_many_overlapping_jobs_finish_in_any_order() -> None:
    rng = random.Random(3)
    backend = DataPlaneBackend(LAYOUTS["tiny-f16"], 64, 64)
    keys = [key(i) for i in range(64)]
    backend.compute(keys, list(range(64)))
    stores = {job: list(range(job * 4, job * 4 + 4)) for job in range(16)}
    for job, blocks in stores.items():
        backend.submit_store(job, [keys[b] for b in blocks], blocks, CPULoadStoreSpec(blocks))
    order = list(stores)
    rng.shuffle(order)
    assert all(backend.finish(job) for job in order)

    gpu_free = list(range(64))
    rng.shuffle(gpu_free)
    loads = {100 + job: (blocks, gpu_free[job * 4 : job * 4 + 4]) for job, blocks in stores.items()}
    for job, (slots, gpu) in loads.items():
        backend.submit_load(job, [keys[s] for s in slots], CPULoadStoreSpec(slots), gpu)
    order = list(loads)
    rng.shuffle(order)
    assert all(backend.finish(job) for job in order)
    assert (backend.verified_blocks, backend.mismatched_blocks, backend.failed_jobs) == (64, 0, 0)
    with pytest.raises(InvalidArgumentError, match="never submitted"):
        backend.finish(100)
    backend.close()


def test_corrupted_tier_is_caught_at_load() -> None:
    backend = DataPlaneBackend(LAYOUTS["fp32"], 8, 4)
    keys = [key(1), key(2)]
    backend.compute(keys, [0, 1])
    backend.submit_store(1, keys, [0, 1], CPULoadStoreSpec([2, 3]))
    assert backend.finish(1)
    backend.store.block(3)[0, -1, -1] ^= 1  # one flipped bit in the last page of key 2
    backend.submit_load(2, keys, CPULoadStoreSpec([2, 3]), [5, 6])
    assert not backend.finish(2)
    assert (backend.verified_blocks, backend.mismatched_blocks) == (1, 1)
    backend.close()


def test_failed_transfers_are_counted_and_reported() -> None:
    def fail_job_2(job_id: int, step: int) -> None:
        if job_id == 2:
            raise OSError("injected")

    backend = DataPlaneBackend(LAYOUTS["tiny-f16"], 8, 4, fault_hook=fail_job_2)
    backend.compute([key(1)], [0])
    backend.submit_store(1, [key(1)], [0], CPULoadStoreSpec([0]))
    backend.submit_load(2, [key(1)], CPULoadStoreSpec([0]), [3])
    backend.submit_store(3, [key(1)], [99], CPULoadStoreSpec([1]))  # refused: no GPU block 99
    assert [backend.finish(job) for job in (1, 2, 3)] == [True, False, False]
    assert (backend.failed_jobs, backend.verified_blocks) == (2, 0)
    backend.close()


def test_long_randomized_run_with_the_manager_verifies_every_load() -> None:
    """An engine-like loop: compute, store, evict, load back, with jobs left in flight."""
    rng = random.Random(11)
    num_gpu, num_cpu, universe = 96, 32, 48
    backend = DataPlaneBackend(LAYOUTS["bf16"], num_gpu, num_cpu)
    manager = CPUOffloadingManager(num_cpu)
    pending: dict[int, tuple[str, list[OffloadKey]]] = {}
    busy: set[int] = set()  # GPU blocks read or written by a job in flight
    job_of_block: dict[int, int] = {}
    loads = 0

    def finish(job: int) -> None:
        nonlocal loads
        kind, keys = pending.pop(job)
        ok = backend.finish(job)
        assert ok
        if kind == "store":
            manager.complete_store(keys, ok)
        else:
            manager.complete_load(keys)
            loads += len(keys)
        for block in [b for b, j in job_of_block.items() if j == job]:
            busy.discard(block)
            del job_of_block[block]

    for job in range(1500):
        free = [b for b in range(num_gpu) if b not in busy]
        if len(free) < 8 or (pending and rng.random() < 0.4):
            finish(rng.choice(sorted(pending)))
            continue
        wanted = [key(rng.randrange(universe)) for _ in range(rng.randint(1, 6))]
        wanted = list(dict.fromkeys(wanted))
        gpu = rng.sample(free, len(wanted))
        hits = manager.lookup(wanted)
        if hits and rng.random() < 0.8:
            keys = wanted[:hits]
            backend.submit_load(job, keys, manager.prepare_load(keys), gpu[:hits])
            pending[job] = ("load", keys)
            gpu = gpu[:hits]
        else:
            backend.compute(wanted, gpu)
            output = manager.prepare_store(wanted)
            if output is None or not output.keys_to_store:
                continue
            slot_of = dict(zip(wanted, gpu, strict=True))
            keys = output.keys_to_store
            gpu = [slot_of[k] for k in keys]
            backend.submit_store(job, keys, gpu, output.store_spec)
            pending[job] = ("store", keys)
        busy.update(gpu)
        job_of_block.update(dict.fromkeys(gpu, job))
    for job in sorted(pending):
        finish(job)
    backend.close()
    assert backend.mismatched_blocks == 0 and backend.failed_jobs == 0
    assert backend.verified_blocks == loads > 200
