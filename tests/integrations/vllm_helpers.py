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
        engine_id="test-engine",
        model=OffloadingModelConfig(model, "float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
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
