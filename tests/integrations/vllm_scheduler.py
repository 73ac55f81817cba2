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
