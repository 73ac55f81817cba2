"""The worker side: vLLM's OffloadingWorker contract on our handlers, CPU canonical KV caches."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm_helpers import canonical_caches, create_spec, finish, offloading_config

torch = pytest.importorskip("torch")

NUM_GPU_BLOCKS = 12
PAGE_BYTES = 256


def _canonical_caches(num_tensors: int) -> Any:
    return canonical_caches(num_tensors, NUM_GPU_BLOCKS, PAGE_BYTES, seed=0)


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_store_then_load_round_trips_bytes(
    vllm_modules: dict[str, ModuleType], blocks_per_chunk: int
) -> None:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, OffloadingWorker
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    num_tensors = 3
    spec = create_spec(
        {"cpu_bytes_to_use": 8 * num_tensors * PAGE_BYTES * blocks_per_chunk},
        bytes_per_block=num_tensors * PAGE_BYTES,
        blocks_per_chunk=blocks_per_chunk,
    )
    caches = _canonical_caches(num_tensors)
    worker = spec.get_worker(caches)
    assert isinstance(worker, OffloadingWorker)
    assert spec.get_worker(caches) is worker
    gpu = [t.tensor for t in caches.tensors]
    source_blocks = [1, 2, 5, 6]
    expected = [t[source_blocks].clone() for t in gpu]
    slots = [3, 0] if blocks_per_chunk == 2 else [3, 0, 7, 4]
    store = worker.submit_store(
        1, GPULoadStoreSpec(source_blocks, [4], [0]), CPULoadStoreSpec(slots)
    )
    assert store
    stored = finish(worker, {1})
    assert stored[1].success
    assert stored[1].transfer_size == 4 * num_tensors * PAGE_BYTES
    for t in gpu:
        t.zero_()
    targets = [9, 10, 11, 4]
    assert worker.submit_load(2, CPULoadStoreSpec(slots), GPULoadStoreSpec(targets, [4], [0]))
    assert finish(worker, {2})[2].success
    for t, want in zip(gpu, expected, strict=True):
        assert torch.equal(t[targets], want)
        assert not t[source_blocks].any()
    worker.shutdown()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_stored_byte_loads_back_whatever_the_canonical_layout(
    vllm_modules: dict[str, ModuleType], data: st.DataObject
) -> None:
    """vLLM's canonical tensors are int8 views into its own allocations: one per layer or one
    packed for all, at any byte offset. Random tensor counts, page sizes, offsets, chunk
    factors, slots, GPU ids, load skips and queues: every stored byte comes back, and the
    blocks no load named keep theirs."""
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    num_tensors, page = data.draw(st.integers(1, 3)), 2 * data.draw(st.integers(1, 40))
    num_blocks, offset = data.draw(st.integers(1, 9)), data.draw(st.integers(0, 15))
    factor, num_slots = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    size = offset + num_tensors * num_blocks * page
    allocation = torch.randint(-128, 128, (size,), dtype=torch.int8, generator=generator)
    tensors = [
        allocation[offset + i * num_blocks * page :][: num_blocks * page].view(num_blocks, page)
        for i in range(num_tensors)
    ]
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, page) for t in tensors],
        [[CanonicalKVCacheRef(i, page) for i in range(num_tensors)]],
    )
    spec = create_spec(
        {"cpu_bytes_to_use": num_slots * num_tensors * page * factor},
        bytes_per_block=num_tensors * page,
        blocks_per_chunk=factor,
    )
    worker = spec.get_worker(caches)
    used = data.draw(st.integers(0, min(num_slots, num_blocks // factor)))
    slots = data.draw(st.permutations(range(num_slots)))[:used]
    sources = data.draw(st.permutations(range(num_blocks)))[: used * factor]
    stored = [t.clone() for t in tensors]
    gpu = GPULoadStoreSpec(sources, [len(sources)], [0])
    assert worker.submit_store(1, gpu, CPULoadStoreSpec(slots))
    assert finish(worker, {1})[1].success
    allocation.copy_(torch.randint(-128, 128, (size,), dtype=torch.int8, generator=generator))
    scrambled = [t.clone() for t in tensors]
    skip = data.draw(st.integers(0, factor - 1)) if used else 0
    targets = data.draw(st.permutations(range(num_blocks)))[: used * factor - skip]
    load = GPULoadStoreSpec(targets, [len(targets)], [skip])
    assert worker.submit_load(2, CPULoadStoreSpec(slots), load, data.draw(st.booleans()))
    assert finish(worker, {2})[2].success
    untouched = sorted(set(range(num_blocks)) - set(targets))
    for t, before, after in zip(tensors, stored, scrambled, strict=True):
        assert torch.equal(t[targets], before[sources[skip:]])
        assert torch.equal(t[untouched], after[untouched])
    worker.shutdown()


@pytest.mark.parametrize(
    ("factor", "first", "sources", "slots"),
    [
        # A sliding-window group: the request's blocks 12-14 fell out of the window (null,
        # left out), 15 ends chunk 3 and chunk 4 is whole.
        (4, 15, [5, 6, 7, 8, 9], [2, 0]),
        # A Mamba group's boundary state: one block, the last of its chunk.
        (2, 5, [3], [2]),
    ],
)
def test_a_store_starting_inside_an_offloaded_block_lands_where_its_load_reads(
    vllm_modules: dict[str, ModuleType],
    factor: int,
    first: int,
    sources: list[int],
    slots: list[int],
) -> None:
    """vLLM 0.32 and 0.33 store a sliding-window or Mamba group with ``blocks_per_chunk``
    above 1 from the first block still in reach, part-way into its chunk, and assert that
    every store succeeds: ours was refused, which stopped the engine. The blocks land at
    their sub-blocks (a load from the same request position reads them back), and the
    sub-blocks before them keep their bytes."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    spec = create_spec(
        {"cpu_bytes_to_use": 4 * factor * PAGE_BYTES},
        bytes_per_block=PAGE_BYTES,
        blocks_per_chunk=factor,
    )
    caches = _canonical_caches(1)
    worker = spec.get_worker(caches)
    (gpu,) = [t.tensor for t in caches.tensors]
    whole = list(range(factor))  # first filled whole, as by an earlier request
    assert worker.submit_store(1, GPULoadStoreSpec(whole, [factor], [0]), CPULoadStoreSpec([2]))
    assert finish(worker, {1})[1].success
    before, stored = gpu[whole].clone(), gpu[sources].clone()
    store = GPULoadStoreSpec(sources, [len(sources)], [first])
    assert worker.submit_store(2, store, CPULoadStoreSpec(slots))
    assert finish(worker, {2})[2].success
    gpu.zero_()
    targets = list(range(NUM_GPU_BLOCKS - len(sources), NUM_GPU_BLOCKS))
    load = GPULoadStoreSpec(targets, [len(targets)], [first])
    assert worker.submit_load(3, CPULoadStoreSpec(slots), load)
    assert worker.submit_load(4, CPULoadStoreSpec([2]), GPULoadStoreSpec(whole, [factor], [0]))
    assert all(result.success for result in finish(worker, {3, 4}).values())
    assert torch.equal(gpu[targets], stored)
    skip = first % factor
    assert torch.equal(gpu[whole[:skip]], before[:skip])
    assert torch.equal(gpu[whole[skip:]], stored[: factor - skip])
    worker.shutdown()


def test_a_slot_larger_than_vllms_block_figure_is_refused_naming_both_sizes(
    vllm_modules: dict[str, ModuleType],
) -> None:
    """vLLM's bytes per block sized the slots within cpu_bytes_to_use: caches whose blocks
    take more (here three 256-byte pages, vLLM said 256) would allocate three times the
    budget. A smaller slot of ours is vLLM's padding and is taken."""
    from kvoffload.core.errors import InvalidArgumentError

    budget = 8 * PAGE_BYTES
    spec = create_spec({"cpu_bytes_to_use": budget}, bytes_per_block=PAGE_BYTES)
    with pytest.raises(InvalidArgumentError, match=r"stores 768 bytes .* vLLM reported 256: its 8"):
        spec.get_worker(_canonical_caches(3))
    padded = create_spec({"cpu_bytes_to_use": budget}, bytes_per_block=PAGE_BYTES + 64)
    worker = padded.get_worker(_canonical_caches(1))
    assert worker.store.data.numel() * worker.store.data.element_size() <= budget
    worker.shutdown()


def test_kv_blocks_not_contiguous_are_refused_not_copied(
    vllm_modules: dict[str, ModuleType],
) -> None:
    """A cache whose blocks are not each contiguous (halves interleaved byte by byte) cannot
    be viewed as rows of bytes: a copy would take the stores and loads, never vLLM's cache."""
    from vllm.v1.kv_offload.base import CanonicalKVCacheTensor

    from kvoffload.core.errors import InvalidArgumentError

    caches = _canonical_caches(1)
    interleaved = torch.zeros(NUM_GPU_BLOCKS, PAGE_BYTES // 2, 2, dtype=torch.int8)
    caches.tensors[0] = CanonicalKVCacheTensor(interleaved.transpose(1, 2), PAGE_BYTES)
    spec = create_spec({"cpu_bytes_to_use": 8 * PAGE_BYTES}, bytes_per_block=PAGE_BYTES)
    with pytest.raises(InvalidArgumentError, match="each KV block contiguous"):
        spec.get_worker(caches)


def test_a_bad_job_is_refused_not_raised(vllm_modules: dict[str, ModuleType]) -> None:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    spec = create_spec({"cpu_bytes_to_use": 4 * 2 * PAGE_BYTES}, bytes_per_block=2 * PAGE_BYTES)
    worker = spec.get_worker(_canonical_caches(2))
    out_of_range = CPULoadStoreSpec([99])
    assert not worker.submit_store(1, GPULoadStoreSpec([0], [1], [0]), out_of_range)
    worker.shutdown()


def test_a_refused_job_is_logged_as_one_line_naming_why(
    vllm_modules: dict[str, ModuleType], caplog: pytest.LogCaptureFixture
) -> None:
    """A spec out of range, or a job after shutdown, is bad input: the warning carried a
    traceback from deep inside the data plane, the reason at its foot."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    spec = create_spec({"cpu_bytes_to_use": 4 * 2 * PAGE_BYTES}, bytes_per_block=2 * PAGE_BYTES)
    worker = spec.get_worker(_canonical_caches(2))
    logger = "kvoffload.integrations.vllm.worker"
    with caplog.at_level("WARNING", logger=logger):
        assert not worker.submit_store(1, GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([99]))
        worker.shutdown()
        assert not worker.submit_load(2, CPULoadStoreSpec([0]), GPULoadStoreSpec([0], [1], [0]))
    records = [r for r in caplog.records if r.name == logger]
    assert [r.getMessage() for r in records] == [
        "kvoffload: job 1 refused, InvalidArgumentError: CPU block ids must lie in [0, 4), "
        "got [99]",
        "kvoffload: job 2 refused, RunnerClosedError: transfer job 2 refused: its runner is closed",
    ]
    assert [r.exc_info for r in records] == [None, None]


def test_a_spec_our_conversion_refuses_is_false_not_raised(
    vllm_modules: dict[str, ModuleType],
) -> None:
    """vLLM's spec does not check the sign of block_indices; ours does, while converting,
    and that refusal must reach vLLM's loop as False with no byte moved."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    spec = create_spec({"cpu_bytes_to_use": 4 * 2 * PAGE_BYTES}, bytes_per_block=2 * PAGE_BYTES)
    caches = _canonical_caches(2)
    worker = spec.get_worker(caches)
    before = [t.tensor.clone() for t in caches.tensors]
    negative = GPULoadStoreSpec([1], [1], [-1])
    assert not worker.submit_load(1, CPULoadStoreSpec([0]), negative)
    assert not worker.submit_store(2, negative, CPULoadStoreSpec([0]))
    assert worker.get_finished() == []
    assert all(torch.equal(t.tensor, b) for t, b in zip(caches.tensors, before, strict=True))
    worker.shutdown()


def test_a_job_id_in_flight_is_refused_on_every_queue(
    vllm_modules: dict[str, ModuleType],
) -> None:
    """Stores, loads and expedited loads run on three handlers that each know only their
    own ids; a reused id would be reported finished twice."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    spec = create_spec({"cpu_bytes_to_use": 4 * 2 * PAGE_BYTES}, bytes_per_block=2 * PAGE_BYTES)
    worker = spec.get_worker(_canonical_caches(2))
    assert worker.submit_load(1, CPULoadStoreSpec([0]), GPULoadStoreSpec([3], [1], [0]))
    assert not worker.submit_load(
        1, CPULoadStoreSpec([1]), GPULoadStoreSpec([4], [1], [0]), expedited=True
    )
    assert not worker.submit_store(1, GPULoadStoreSpec([5], [1], [0]), CPULoadStoreSpec([2]))
    worker.wait({1})
    assert [r.job_id for r in worker.get_finished()] == [1]
    assert worker.submit_store(1, GPULoadStoreSpec([5], [1], [0]), CPULoadStoreSpec([2]))
    assert finish(worker, {1})[1].success
    worker.shutdown()


def test_a_hybrid_model_is_refused_when_the_spec_is_built(
    vllm_modules: dict[str, ModuleType],
) -> None:
    """A hybrid model (full attention beside sliding-window or Mamba layers) has several
    KV-cache groups, and our worker copies one group's pages. vLLM's config lists the groups
    in the scheduler too, so the spec refuses it at start-up; it was refused only once the
    workers registered their caches. The worker still refuses such caches, with the same
    message."""
    import dataclasses

    from vllm.v1.kv_offload.base import CanonicalKVCaches
    from vllm.v1.kv_offload.config import OffloadingGroupConfig
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from kvoffload.core.errors import InvalidArgumentError

    extra = {"cpu_bytes_to_use": 8 * PAGE_BYTES}
    config = offloading_config(extra, bytes_per_block=PAGE_BYTES)
    window = OffloadingGroupConfig(16, ("layer.2",), 1)
    hybrid = dataclasses.replace(config, groups=(*config.groups, window))
    refusal = "handles one KV-cache group, got 2"
    with pytest.raises(InvalidArgumentError, match=refusal):
        OffloadingSpecFactory.create_spec(hybrid)
    caches = _canonical_caches(1)
    two_groups = CanonicalKVCaches(caches.tensors, caches.group_data_refs * 2)
    with pytest.raises(InvalidArgumentError, match=refusal):
        create_spec(extra, bytes_per_block=PAGE_BYTES).get_worker(two_groups)


def _store_job(slot: int) -> Any:
    """vLLM's metadata for one store, job 7, of GPU block 2 into CPU slot ``slot``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        TransferJob,
    )
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    job = TransferJob("req", GPULoadStoreSpec([2], [1], [0]), CPULoadStoreSpec([slot]))
    return OffloadingConnectorMetadata(load_jobs={}, store_jobs={7: job})


UNDER_O = r"; vLLM running under python -O cannot be told of a failed transfer"


def test_with_vllms_asserts_off_a_failed_store_stops_the_engine_never_reported_stored(
    vllm_modules: dict[str, ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's connector worker asserts each result's success; under ``python -O`` it marked
    a failed store completed, and its scheduler made the never-written slot loadable. With
    asserts off our worker raises, naming the job, and vLLM never hears of it as done."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
    )
    from vllm_scheduler import connector_worker

    from kvoffload.integrations.vllm import worker as worker_module

    monkeypatch.setattr(worker_module, "VLLM_ASSERTS_SUCCESS", False)
    spec = create_spec({"cpu_bytes_to_use": 4 * 2 * PAGE_BYTES}, bytes_per_block=2 * PAGE_BYTES)
    connector = connector_worker(spec, _canonical_caches(2))
    worker = connector.worker

    def copy_error(job_id: int, step: int) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    worker._store._fault_hook = copy_error
    connector.prepare_store_kv(_store_job(slot=3))
    connector.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={}, store_jobs={}))
    worker.wait({7})
    with pytest.raises(RuntimeError, match=rf"^kvoffload: transfer job 7 failed .*{UNDER_O}"):
        connector.get_finished(set())
    assert connector.build_connector_worker_meta() is None
    connector.shutdown()


def test_with_vllms_asserts_off_a_refused_job_stops_the_engine_naming_the_cause(
    vllm_modules: dict[str, ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM asserts that each submission succeeded; under ``python -O`` a refused store was
    never reported (its slots held for good), a refused load left its request waiting, and a
    refused in-step load let the request run on blocks never filled."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
    )
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm_scheduler import connector_worker

    from kvoffload.integrations.vllm import worker as worker_module

    monkeypatch.setattr(worker_module, "VLLM_ASSERTS_SUCCESS", False)
    spec = create_spec({"cpu_bytes_to_use": 4 * 2 * PAGE_BYTES}, bytes_per_block=2 * PAGE_BYTES)
    caches = _canonical_caches(2)
    connector = connector_worker(spec, caches)
    before = [t.tensor.clone() for t in caches.tensors]
    connector.prepare_store_kv(_store_job(slot=99))
    step = OffloadingConnectorMetadata(load_jobs={}, store_jobs={})
    with pytest.raises(
        RuntimeError, match=rf"^kvoffload: transfer job 7 refused \(Inv.*99.*{UNDER_O}"
    ):
        connector.start_kv_transfers(step)
    worker = connector.worker
    assert worker.submit_load(1, CPULoadStoreSpec([0]), GPULoadStoreSpec([3], [1], [0]))
    with pytest.raises(RuntimeError, match=r"^kvoffload: transfer job 1 refused \(a job of th"):
        worker.submit_store(1, GPULoadStoreSpec([5], [1], [0]), CPULoadStoreSpec([2]))
    assert finish(worker, {1})[1].success
    assert all(torch.equal(t.tensor[5], b[5]) for t, b in zip(caches.tensors, before, strict=True))
    connector.shutdown()
