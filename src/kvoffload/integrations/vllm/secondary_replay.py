"""Replay a workload through vLLM 0.33's own tiering manager (its CPU tier, then secondary tiers).

For the tests and ``benchmarks/vllm_secondary.py``: the scheduler side is
vLLM's ``TieringOffloadingSpec`` as its factory builds it from an extra
config; the worker side (GPU -> CPU copies) is played by ``fill``, which
writes a block's bytes into its CPU chunk row, because vLLM's CPU worker
needs CUDA. Requests run one after another, as vLLM's scheduler calls the
manager: a per-key prefix lookup past the GPU prefix cache's hit (stepping
the engine while a tier answers ``RETRY`` or a promotion is pending), the
load of the hit, then the store of the request's chunks from where vLLM's
connector starts them (after the offload hit for chunk-level requests, from
the first chunk otherwise: GPU hits included, and offload hits too for a
request some tier asked to see whole), then steps until every cascade has
finished, so a replay is deterministic.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import LookupResult, OffloadPolicy, ReqContext, ScheduleEndContext

from kvoffload.core.keys import OffloadKey
from kvoffload.sim.gpu_cache import GPUPrefixCache
from kvoffload.sim.workload import Request

Fill = Callable[[OffloadKey, memoryview], None]
"""Writes ``key``'s bytes into its CPU chunk row (the worker's GPU -> CPU copy)."""

STEP_PAUSE_S = 0.0002
"""How long one simulated engine step lets the tiers' threads run."""


def tiering_config(
    secondary_tiers: list[dict[str, Any]],
    cpu_bytes: int,
    *,
    bytes_per_block: int = 4096,
    engine_id: str = "replay",
    model: str = "replay-model",
    events: bool = False,
    self_describing_events: bool = False,
    blocks_per_chunk: int = 1,
) -> Any:
    """vLLM's offloading config for its tiering spec over ``secondary_tiers`` (one rank);
    ``self_describing_events``: vLLM's ``self_describing_kv_events`` (events carry every
    block hash of a chunk, its tokens, and keep them until the last removal announced)."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": cpu_bytes,
        "secondary_tiers": secondary_tiers,
        "self_describing_kv_events": self_describing_events,
    }
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer.0", "layer.1"), 0),),
        worker_kv_bytes_per_block=bytes_per_block,
        enable_kv_cache_events=events,
        extra_config=extra,
        engine_id=engine_id,
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


def tiering_spec(secondary_tiers: list[dict[str, Any]], cpu_bytes: int, **kwargs: Any) -> Any:
    """vLLM's ``TieringOffloadingSpec``, built by its own factory."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    return OffloadingSpecFactory.create_spec(tiering_config(secondary_tiers, cpu_bytes, **kwargs))


@dataclass(frozen=True)
class TieringReplayResult:
    """Block counts of one replay; ratios are per referenced block."""

    refs: int
    gpu_hit_blocks: int
    offload_hit_blocks: int
    """Blocks the offloading manager served: CPU hits, promotions from secondary tiers included."""
    stored_blocks: int
    """Blocks stored into the CPU tier (each one cascaded to every secondary tier)."""

    @property
    def hit_ratio(self) -> float:
        """GPU and offload hits together, as the admission table reports them."""
        return (self.gpu_hit_blocks + self.offload_hit_blocks) / self.refs if self.refs else 0.0


class TieringReplay:
    """Drives one tiering ``manager`` (and its CPU tier's rows) over requests."""

    def __init__(
        self,
        manager: Any,
        block_tokens: int = 16,
        gpu_blocks: int = 0,
        fill: Fill | None = None,
        max_wait_s: float = 30.0,
    ) -> None:
        self.manager = manager
        self.block_tokens = block_tokens
        self.gpu = GPUPrefixCache(gpu_blocks) if gpu_blocks else None
        self.fill = fill
        self.max_wait_s = max_wait_s
        primary = manager.primary_tier.get_kv_memoryview()
        self._rows = primary.cast("B")
        self._row_bytes = primary.strides[0]
        self._count = 0
        self.refs = self.gpu_hits = self.offload_hits = self.stored = 0
        self.events: list[Any] = []
        """The KV events the steps took (vLLM's ``OffloadingEvent``), in order."""

    def close(self) -> None:
        """Let go of the CPU tier's rows (before the manager's ``shutdown`` unmaps them)."""
        self._rows.release()

    def result(self) -> TieringReplayResult:
        return TieringReplayResult(self.refs, self.gpu_hits, self.offload_hits, self.stored)

    def row(self, chunk: int) -> memoryview:
        """CPU chunk ``chunk``'s row in the primary tier's shared memory."""
        start = chunk * self._row_bytes
        row: memoryview = self._rows[start : start + self._row_bytes]
        return row

    def run(self, requests: Sequence[Request]) -> TieringReplayResult:
        for request in requests:
            self.request(request.keys)
        return self.result()

    def request(self, keys: Sequence[OffloadKey]) -> int:
        """One request: returns how many of its blocks the offloading manager served."""
        manager = self.manager
        self._count += 1
        context = ReqContext(req_id=f"r{self._count}")
        for position, key in enumerate(keys, start=1):
            context.set_offload_key_position(key, position * self.block_tokens)
        whole = manager.on_new_request(context).policy is OffloadPolicy.REQUEST_LEVEL
        gpu = self.gpu
        on_gpu = gpu.match(keys) if gpu is not None else 0
        past = list(keys[on_gpu:])
        hits = self.lookup(past, context)
        if hits:
            manager.prepare_load(past[:hits], context)
            manager.complete_load(past[:hits], context)
        # vLLM's connector skips the offload hit only for chunk-level requests.
        rest = list(keys[on_gpu + hits :] if hits and not whole else keys)
        if rest:
            output = manager.prepare_store(rest, context)
            if output is not None and output.keys_to_store:
                if self.fill is not None:
                    chunks = output.store_spec.block_ids.tolist()
                    for key, chunk in zip(output.keys_to_store, chunks, strict=True):
                        self.fill(key, self.row(chunk))
                manager.complete_store(output.keys_to_store, context)
                self.stored += len(output.keys_to_store)
        manager.on_request_finished(context)
        self.settle()
        if gpu is not None:
            slots = gpu.acquire(keys[:on_gpu], len(keys) - on_gpu)
            gpu.register(keys, slots)
            gpu.release(slots)
        self.refs += len(keys)
        self.gpu_hits += on_gpu
        self.offload_hits += hits
        return hits

    def lookup(self, keys: Sequence[OffloadKey], context: ReqContext) -> int:
        """The leading run of ``keys`` the manager serves, stepping while it cannot tell yet.

        As vLLM's scheduler: stop at the first miss, look on past ``RETRY`` and
        ``HIT_PENDING`` so that every tier starts its lookups, ask again next step.
        """
        deadline = time.monotonic() + self.max_wait_s
        while True:
            hits, waiting = 0, False
            for key in keys:
                answer = self.manager.lookup(key, context)
                if answer is LookupResult.MISS:
                    break
                if answer is LookupResult.HIT and not waiting:
                    hits += 1
                elif answer is not LookupResult.HIT:
                    waiting = True
            if not waiting:
                return hits
            self._step(deadline)

    def settle(self) -> None:
        """Step until no cascade or promotion is in flight."""
        deadline = time.monotonic() + self.max_wait_s
        while self.manager.has_pending_work():
            self._step(deadline)

    def _step(self, deadline: float) -> None:
        """One engine step: its end, then its KV events taken, as vLLM's scheduler takes them
        at every step (events not taken are pending work)."""
        if time.monotonic() > deadline:
            raise TimeoutError(f"the tiers did not answer within {self.max_wait_s} s")
        self.manager.on_schedule_end(ScheduleEndContext((), ()))
        self.events.extend(self.manager.take_events())
        time.sleep(STEP_PAUSE_S)
