"""Building vLLM 0.33 configurations and canonical KV caches for the tests."""

from __future__ import annotations

from typing import Any

SPEC_CONFIG = {
    "spec_name": "KVOffloadSpec",
    "spec_module_path": "kvoffload.integrations.vllm",
}


def offloading_config(
    extra: dict[str, Any],
    bytes_per_block: int = 1024,
    blocks_per_chunk: int = 1,
    events: bool = False,
    model: str = "test-model",
    engine_id: str = "test-engine",
    rank: int = 0,
    world_size: int = 1,
) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer.0", "layer.1"), 0),),
        worker_kv_bytes_per_block=bytes_per_block,
        enable_kv_cache_events=events,
        extra_config={**SPEC_CONFIG, **extra},
        engine_id=engine_id,
        model=OffloadingModelConfig(model, "float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def create_spec(extra: dict[str, Any], **kwargs: Any) -> Any:
    """Our spec as vLLM builds it: through its factory, from the extra config."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    return OffloadingSpecFactory.create_spec(offloading_config(extra, **kwargs))


def metrics_frontend(extra: dict[str, Any]) -> tuple[Any, Any]:
    """vLLM's offloading Prometheus frontend for ``extra``, on a registry of its own."""
    import functools
    from types import SimpleNamespace

    import prometheus_client
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadPromMetrics,
    )

    transfer = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
    )
    registry = prometheus_client.CollectorRegistry()
    kinds = (prometheus_client.Counter, prometheus_client.Gauge, prometheus_client.Histogram)
    frontend = OffloadPromMetrics(
        SimpleNamespace(kv_transfer_config=transfer),
        {kind: functools.partial(kind, registry=registry) for kind in kinds},
        ["engine"],
        {0: ["0"]},
    )
    return frontend, registry


def canonical_caches(
    num_tensors: int, num_blocks: int, page_bytes: int, seed: int, device: str = "cpu"
) -> Any:
    """vLLM's canonical KV caches over random tensors on ``device`` (one group, one page
    size)."""
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    generator = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randint(
            -128, 128, (num_blocks, page_bytes), dtype=torch.int8, generator=generator
        ).to(device)
        for _ in range(num_tensors)
    ]
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, page_bytes) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(i, page_bytes) for i in range(num_tensors)]],
    )


def finish(worker: Any, job_ids: set[int]) -> dict[int, Any]:
    """The results of ``job_ids``, waited for."""
    import time

    worker.wait(job_ids)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + 10
    while set(results) != job_ids and time.monotonic() < deadline:
        results.update({r.job_id: r for r in worker.get_finished()})
    return results


def request_context(req_id: str, keys: list[Any]) -> Any:
    """A vLLM request context that knows each key's position, as the scheduler's does."""
    from vllm.v1.kv_offload.base import ReqContext

    context = ReqContext(req_id=req_id)
    for position, key in enumerate(keys, start=1):
        context.set_offload_key_position(key, 16 * position)
    return context


def lookup_until_settled(manager: Any, key: Any, context: Any) -> list[Any]:
    """Every answer to ``key``'s lookups, asking again (as vLLM's scheduler does) on RETRY."""
    import time

    from vllm.v1.kv_offload.base import LookupResult

    answers = [manager.lookup(key, context)]
    deadline = time.monotonic() + 10
    while answers[-1] is LookupResult.RETRY and time.monotonic() < deadline:
        time.sleep(0.005)
        answers.append(manager.lookup(key, context))
    return answers


class Instance:
    """One vLLM instance as its offloading connector builds it: a scheduler-side spec and
    one worker-side spec per rank, all from one config and engine id. Each rank's "GPU"
    KV caches are random CPU tensors (seeded by ``seed`` and the rank).
    """

    def __init__(
        self,
        extra: dict[str, Any],
        engine_id: str,
        *,
        world_size: int = 1,
        num_tensors: int = 2,
        page_bytes: int = 256,
        num_gpu_blocks: int = 12,
        model: str = "test-model",
        seed: int = 0,
        workers: bool = True,
    ) -> None:
        def spec(rank: int) -> Any:
            return create_spec(
                extra,
                bytes_per_block=num_tensors * page_bytes,
                model=model,
                engine_id=engine_id,
                rank=rank,
                world_size=world_size,
            )

        self._spec = spec
        self.scheduler = spec(0)
        self.manager = self.scheduler.get_manager()
        self.caches = [
            canonical_caches(num_tensors, num_gpu_blocks, page_bytes, seed * 100 + rank)
            for rank in range(world_size)
        ]
        self.workers: list[Any] = []
        if workers:
            self.start_workers()
        self._jobs = 0

    def start_workers(self) -> None:
        """Each rank's worker, as vLLM's connector builds it once the KV caches exist."""
        self.workers = [
            self._spec(rank).get_worker(caches) for rank, caches in enumerate(self.caches)
        ]

    def gpu(self, rank: int, blocks: list[int]) -> list[Any]:
        """Copies of ``blocks`` of every KV tensor of ``rank``."""
        return [t.tensor[blocks].clone() for t in self.caches[rank].tensors]

    def clear_gpu(self) -> None:
        for caches in self.caches:
            for t in caches.tensors:
                t.tensor.zero_()

    def store(self, keys: list[Any], gpu_blocks: list[int], context: Any) -> None:
        """Offer ``keys`` for storing; every rank copies its GPU blocks into the slots."""
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        output = self.manager.prepare_store(keys, context)
        assert output is not None and list(output.keys_to_store) == keys, output
        source = GPULoadStoreSpec(gpu_blocks, [len(gpu_blocks)], [0])
        self._run([(w.submit_store, source, output.store_spec) for w in self.workers])
        self.manager.complete_store(keys, context)

    def load(self, keys: list[Any], gpu_blocks: list[int], context: Any) -> None:
        """Load ``keys`` (all hits) from their CPU slots into ``gpu_blocks`` on every rank."""
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        slots = self.manager.prepare_load(keys, context)
        target = GPULoadStoreSpec(gpu_blocks, [len(gpu_blocks)], [0])
        self._run([(w.submit_load, slots, target) for w in self.workers])
        self.manager.complete_load(keys, context)

    def _run(self, jobs: list[tuple[Any, Any, Any]]) -> None:
        for (submit, src, dst), worker in zip(jobs, self.workers, strict=True):
            self._jobs += 1
            assert submit(self._jobs, src, dst)
            assert finish(worker, {self._jobs})[self._jobs].success

    def close(self) -> None:
        """Shut the workers down (unlinking their regions) and close the scheduler's tiers."""
        for worker in self.workers:
            worker.shutdown()
        self.scheduler.close()
