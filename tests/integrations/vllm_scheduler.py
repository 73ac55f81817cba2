"""vLLM 0.33's own offloading connector classes around a spec, without an engine.

The scheduler side reads only the cache, speculative-decoding and parallel
settings of vLLM's config, so a namespace with those stands in for a
``VllmConfig`` (which would need a model); the KV cache config is vLLM's own.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def connector_scheduler(spec: Any, world_size: int = 1) -> Any:
    """vLLM's ``OffloadingConnectorScheduler`` over ``spec`` (one full-attention group)."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    group = spec.config.groups[0]
    kv_spec = FullAttentionSpec(
        block_size=group.tokens_per_block, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(group.layer_names), kv_spec)],
    )
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(
            prefix_cache_retention_interval=None, enable_prefix_caching=True
        ),
        speculative_config=None,
        parallel_config=SimpleNamespace(world_size=world_size, decode_context_parallel_size=1),
    )
    return OffloadingConnectorScheduler(spec, vllm_config, kv_cache_config)


def connector_worker(spec: Any, kv_caches: Any) -> Any:
    """vLLM's ``OffloadingConnectorWorker`` over ``spec``, its worker built on ``kv_caches``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
        OffloadingConnectorWorker,
    )

    worker = OffloadingConnectorWorker(spec, SimpleNamespace(), SimpleNamespace())
    worker._init_worker(kv_caches)
    return worker


def vllm_request(req_id: str, prompt: list[int], block_size: int = 16) -> Any:
    """A vLLM ``Request`` whose block hashes vLLM computes as its engine would."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(block_size, sha256)
    return Request(req_id, prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)


def offload_keys(request: Any) -> list[Any]:
    """The request's offload keys (group 0), as vLLM's connector forms them."""
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(block_hash, 0) for block_hash in request.block_hashes]


def allocate(scheduler: Any, request: Any, num_blocks: int, num_external_tokens: int) -> None:
    """What vLLM's scheduler does once the KV cache manager gave ``request`` its blocks."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    blocks = KVCacheBlocks(blocks=([KVCacheBlock(i + 1) for i in range(num_blocks)],))
    scheduler.update_state_after_alloc(request, blocks, num_external_tokens)


def schedule_prefill(scheduler: Any, request: Any, num_blocks: int) -> Any:
    """A step that prefills the rest of ``request`` on GPU blocks 1..``num_blocks`` (after
    :func:`allocate`): the connector's metadata for it, its store offer made."""
    return schedule_step(
        scheduler, request, request.num_tokens - request.num_computed_tokens, num_blocks
    )


def schedule_step(
    scheduler: Any, request: Any, num_tokens: int, num_blocks: int | None = None
) -> Any:
    """A step that computes ``num_tokens`` more of ``request``: a new request on GPU blocks
    1..``num_blocks``, else a running one that got no new block. The connector's metadata
    for it; the request's computed tokens move on, as vLLM's scheduler moves them after."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    output = SchedulerOutput.make_empty()
    if num_blocks is not None:
        block_ids = list(range(1, num_blocks + 1))
        output.scheduled_new_reqs = [NewRequestData.from_request(request, (block_ids,))]
    else:
        output.scheduled_cached_reqs = CachedRequestData(
            req_ids=[request.request_id],
            resumed_req_ids=set(),
            new_token_ids=[[]],
            all_token_ids={},
            new_block_ids=[None],
            num_computed_tokens=[request.num_computed_tokens],
            num_output_tokens=[0],
        )
    output.num_scheduled_tokens = {request.request_id: num_tokens}
    output.total_num_scheduled_tokens = num_tokens
    meta = scheduler.build_connector_meta(output)
    request.num_computed_tokens += num_tokens
    return meta


def end_step(scheduler: Any) -> Any:
    """The end of a step that scheduled no tokens: the connector's metadata for it."""
    from vllm.v1.core.sched.output import SchedulerOutput

    return scheduler.build_connector_meta(SchedulerOutput.make_empty())


def report_finished(scheduler: Any, job_ids: list[int]) -> None:
    """One worker reports ``job_ids`` finished, as its connector output does."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )
    from vllm.v1.outputs import KVConnectorOutput

    meta = OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(job_ids, 1))
    scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))
