"""A lower tier's fault under vLLM 0.33 is a miss, never a failed transfer job.

vLLM's connector worker asserts that every job succeeded (``get_finished``: "we
currently do not support job failures"), so one failed job stops the engine.
With kvoffload as the offloading spec, a block only a lower tier holds is read
into a CPU slot and checked before any lookup answers ``HIT``
(:class:`~kvoffload.managers.tiered.TieredOffloadingManager`: ``RETRY`` while the
read runs, a failed read a miss): the worker only copies CPU slots whose bytes
are in. Under vLLM's tiering our secondary tiers' failed reads are failed
promotion jobs, which vLLM's tiering manager turns into misses (the chunk's
primary slot freed, no GPU load ever asked of it).

Each test breaks a block at one point, on a real disk slot file or Valkey
server, and drives vLLM's own connector classes: its scheduler decides what to
load, its worker connector asserts the jobs.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from vllm_helpers import canonical_caches, create_spec, request_context
from vllm_scheduler import (
    allocate,
    connector_scheduler,
    connector_worker,
    end_step,
    offload_keys,
    vllm_request,
)

from kvoffload import block_id_key
from kvoffload.tiers.format import HEADER_BYTES
from kvoffload.tiers.slot_file import slot_start, slot_stride
from tier_servers import FakeValkey, ValkeyProcess

torch = pytest.importorskip("torch")

PAGE_BYTES = 256
BLOCK_BYTES = 2 * PAGE_BYTES
"""Two KV tensors of 256-byte pages per block."""
OTHER_KEYS = [block_id_key(i) for i in range(101, 103)]
WAIT_S = 30.0


class Engine:
    """One vLLM instance's offloading connector over our spec: vLLM's scheduler-side
    connector, and its worker-side connector over our worker (CPU "GPU" tensors)."""

    def __init__(self, extra: dict[str, Any], model: str, seed: int) -> None:
        options: dict[str, Any] = {
            "bytes_per_block": BLOCK_BYTES,
            "engine_id": f"test-{uuid.uuid4().hex[:12]}",
            "model": model,
        }
        self.spec = create_spec(extra, **options)
        self.caches = canonical_caches(2, 8, PAGE_BYTES, seed)
        self.connector = connector_worker(create_spec(extra, **options), self.caches)
        self.scheduler = connector_scheduler(self.spec)
        self.manager = self.spec.get_manager()
        self._jobs = 1000

    @property
    def tiers(self) -> list[Any]:
        return list(self.manager.backing.tiers)

    def gpu(self, blocks: list[int]) -> list[Any]:
        return [t.tensor[blocks].clone() for t in self.caches.tensors]

    def clear_gpu(self) -> None:
        for t in self.caches.tensors:
            t.tensor.zero_()

    def store(self, keys: list[Any], gpu_blocks: list[int]) -> None:
        """Store ``keys`` from ``gpu_blocks``: the GPU -> CPU copy is a worker job too."""
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        context = request_context(f"store-{self._jobs}", keys)
        output = self.manager.prepare_store(keys, context)
        assert output is not None and list(output.keys_to_store) == keys
        self._jobs += 1
        worker = self.connector.worker
        source = GPULoadStoreSpec(gpu_blocks, [len(gpu_blocks)], [0])
        assert worker.submit_store(self._jobs, source, output.store_spec)
        worker.wait({self._jobs})
        self.connector.get_finished(set())  # vLLM's assert on every job's success
        self.manager.complete_store(keys, context)
        self.manager.on_request_finished(context)

    def read(self, request: Any) -> int:
        """vLLM's scheduler and worker reading ``request`` from the offloading connector:
        asked again at each step while the manager cannot tell (a promotion is running),
        then the load of what it matched, on GPU blocks 1, 2, ...; the tokens it loaded."""
        self.scheduler.on_new_request(request)
        deadline = time.monotonic() + WAIT_S
        while True:
            matched, is_async = self.scheduler.get_num_new_matched_tokens(request, 0)
            if matched is not None:
                break
            end_step(self.scheduler)
            assert time.monotonic() < deadline, "the lookup never settled"
            time.sleep(0.005)
        if not matched:
            assert not end_step(self.scheduler).load_jobs
            return 0
        assert is_async
        allocate(self.scheduler, request, 3, matched)
        meta = end_step(self.scheduler)
        assert meta.load_jobs
        self.connector.start_kv_transfers(meta)
        self.connector.worker.wait(set(meta.load_jobs))
        finished: set[str] = set()
        while request.request_id not in finished:
            # vLLM's connector asserts each job's success here.
            finished |= self.connector.get_finished(set())[1]
            assert time.monotonic() < deadline, "the load never finished"
        return int(matched)

    def close(self) -> None:
        self.connector.shutdown()
        self.spec.close()


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(extra: dict[str, Any], model: str = "faults", seed: int = 0) -> Engine:
        engine = Engine(extra, model, seed)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)[0]
        file.seek(offset)
        file.write(bytes([byte ^ 0xFF]))


def _break_slot(disk: Any, keys: list[Any], fault: str) -> None:
    """Break the disk tier's copy of ``keys`` as a faulty disk or a stray writer would."""
    first, second = (disk.slot_offset(key) for key in keys)
    assert first is not None and second is not None
    if fault == "payload":  # a bit flipped in the first block's bytes
        _flip(disk.path, first + HEADER_BYTES + len(keys[0]) + 7)
    elif fault == "second-payload":
        _flip(disk.path, second + HEADER_BYTES + len(keys[1]) + 7)
    elif fault == "header":
        _flip(disk.path, first + 6)
    elif fault == "reused":  # the first slot holds another key's block now
        with open(disk.path, "r+b") as file:
            file.seek(second)
            other = file.read(disk.stride)
            file.seek(first)
            file.write(other)
    else:  # truncated before both slots
        with open(disk.path, "r+b") as file:
            file.truncate(min(first, second))


@pytest.mark.parametrize(
    ("fault", "loaded"),
    [("payload", 0), ("header", 0), ("reused", 0), ("truncated", 0), ("second-payload", 16)],
)
def test_a_broken_disk_block_is_recomputed_and_no_job_fails(
    vllm_modules: dict[str, ModuleType],
    tmp_path: Path,
    engines: Callable[..., Engine],
    fault: str,
    loaded: int,
) -> None:
    engine = engines(
        {
            "cpu_bytes_to_use": 2 * BLOCK_BYTES,
            "kvoffload.disk_dir": str(tmp_path / "disk"),
            "kvoffload.disk_bytes": slot_start(8, slot_stride(BLOCK_BYTES)),
        }
    )
    request = vllm_request("reader", list(range(48)))
    keys = offload_keys(request)[:2]
    expected = engine.gpu([0, 1])
    engine.store(keys, [0, 1])
    engine.store(OTHER_KEYS, [2, 3])  # the 2-block CPU tier writes ``keys`` back to disk
    (disk,) = engine.tiers
    disk.poll(wait=True)
    assert disk.present(keys) == 2
    _break_slot(disk, keys, fault)
    engine.clear_gpu()
    assert engine.read(request) == loaded
    blocks = loaded // 16
    for got, want in zip(engine.gpu(list(range(1, 1 + blocks))), expected, strict=True):
        assert torch.equal(got, want[:blocks])
    assert disk.stats.corrupt + disk.stats.failed >= 1
    assert not engine.manager.backing.holds(keys[blocks])  # its slot freed, to be recomputed


@pytest.mark.parametrize("fault", ["corrupt", "deleted"])
def test_a_shared_block_broken_or_gone_before_its_read_is_recomputed(
    vllm_modules: dict[str, ModuleType],
    valkey_server: ValkeyProcess,
    engines: Callable[..., Engine],
    fault: str,
) -> None:
    """The block is there when the lookup asks the server (``EXISTS``), broken or gone when
    its read comes (evicted by the server's ``maxmemory`` policy, deleted by another engine
    that found it broken): the read into the CPU slot fails and the lookup misses."""
    extra = {"cpu_bytes_to_use": 4 * BLOCK_BYTES, "kvoffload.remote_url": valkey_server.url}
    model = f"faults-{uuid.uuid4().hex[:8]}"
    writer = engines(extra, model=model, seed=1)
    request = vllm_request("reader", list(range(48)))
    keys = offload_keys(request)[:2]
    writer.store(keys, [0, 1])
    writer.spec.close()  # its write-through to the server has finished
    reader = engines(extra, model=model, seed=2)
    (shared,) = reader.tiers
    name = shared.name(keys[0])
    client = valkey_server.client()
    value = client.get(name)
    assert value is not None
    if fault == "corrupt":
        client.set(name, value[:-1] + bytes([value[-1] ^ 0xFF]))
    else:
        # EXISTS answers before the GET: the key leaves between them (the read is queued
        # behind a lookup's answer, so the test deletes it when the server is asked).
        original_present = shared.present

        def present_then_evicted(asked: Any) -> int:
            found = original_present(asked)
            client.delete(name)
            return int(found)

        shared.present = present_then_evicted
    assert reader.read(request) == 0
    assert reader.manager.backing.promotion_batches[0] >= 1  # the lookup found it: read
    assert shared.stats.hit_blocks <= 1  # only the second block could have been read
    assert shared.stats.corrupt == (fault == "corrupt")


def test_a_shared_block_the_server_drops_after_the_hit_still_loads(
    vllm_modules: dict[str, ModuleType],
    own_server: ValkeyProcess,
    engines: Callable[..., Engine],
) -> None:
    """Once a lookup answered ``HIT`` the bytes are in the CPU slot: a server flushed or
    killed between vLLM's lookup and its load changes nothing the load reads."""
    own_server.start()
    extra = {"cpu_bytes_to_use": 4 * BLOCK_BYTES, "kvoffload.remote_url": own_server.url}
    writer = engines(extra, seed=1)
    request = vllm_request("reader", list(range(48)))
    keys = offload_keys(request)[:2]
    expected = writer.gpu([0, 1])
    writer.store(keys, [0, 1])
    writer.spec.close()
    reader = engines(extra, seed=2)
    scheduler = reader.scheduler
    scheduler.on_new_request(request)
    deadline = time.monotonic() + WAIT_S
    while (matched := scheduler.get_num_new_matched_tokens(request, 0))[0] is None:
        end_step(scheduler)
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert matched == (32, True)
    own_server.client().flushall()
    own_server.stop()
    allocate(scheduler, request, 3, 32)
    meta = end_step(scheduler)
    reader.connector.start_kv_transfers(meta)
    reader.connector.worker.wait(set(meta.load_jobs))
    finished: set[str] = set()
    while request.request_id not in finished:
        finished |= reader.connector.get_finished(set())[1]
        assert time.monotonic() < deadline
    for got, want in zip(reader.gpu([1, 2]), expected, strict=True):
        assert torch.equal(got, want)


def test_a_dead_server_before_the_lookup_is_a_miss(
    vllm_modules: dict[str, ModuleType],
    own_server: ValkeyProcess,
    engines: Callable[..., Engine],
) -> None:
    own_server.start()
    extra = {"cpu_bytes_to_use": 4 * BLOCK_BYTES, "kvoffload.remote_url": own_server.url}
    writer = engines(extra, seed=1)
    request = vllm_request("reader", list(range(48)))
    writer.store(offload_keys(request)[:2], [0, 1])
    writer.spec.close()
    reader = engines(extra, seed=2)
    own_server.stop()
    assert reader.read(request) == 0


def test_a_store_a_dead_server_cannot_take_fails_no_job(
    vllm_modules: dict[str, ModuleType],
    own_server: ValkeyProcess,
    engines: Callable[..., Engine],
) -> None:
    """vLLM's store jobs copy GPU blocks into CPU slots only; the lower tiers' writes are
    the scheduler's, in the background: one that fails is counted, and the block is still
    served from the CPU tier."""
    own_server.start()
    extra = {"cpu_bytes_to_use": 4 * BLOCK_BYTES, "kvoffload.remote_url": own_server.url}
    engine = engines(extra)
    own_server.stop()
    request = vllm_request("reader", list(range(48)))
    expected = engine.gpu([0, 1])
    engine.store(offload_keys(request)[:2], [0, 1])  # asserts the job's success
    (shared,) = engine.tiers
    shared.poll(wait=True)
    assert (shared.stats.stored_blocks, shared.stats.failed) == (0, 2)
    engine.clear_gpu()
    assert engine.read(request) == 32
    for got, want in zip(engine.gpu([1, 2]), expected, strict=True):
        assert torch.equal(got, want)


def test_a_read_past_its_deadline_is_a_miss() -> None:
    """The server answers ``EXISTS`` but drips the value: the read misses its deadline."""
    pytest.importorskip("vllm")
    server = FakeValkey()
    made: list[Engine] = []
    try:
        extra = {"cpu_bytes_to_use": 4 * BLOCK_BYTES, "kvoffload.remote_url": server.url}
        writer = Engine(extra, "faults", seed=1)
        made.append(writer)
        request = vllm_request("reader", list(range(48)))
        writer.store(offload_keys(request)[:2], [0, 1])
        writer.spec.close()
        reader = Engine(extra, "faults", seed=2)
        made.append(reader)
        server.mode = "drip"
        assert reader.read(request) == 0
        assert reader.tiers[0].stats.failed >= 1
    finally:
        for engine in made:
            engine.close()
        server.stop()
