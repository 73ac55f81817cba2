"""Replay a workload through any manager speaking vLLM 0.33's per-key API.

One driver for ours and vLLM's own managers, so a comparison differs only in
the manager. Requests run one after another in the order vLLM's scheduler
calls the manager: ``on_new_request``, a per-key prefix ``lookup`` that stops
at the first miss, ``prepare_load``/``complete_load`` of the hit prefix,
``prepare_store``/``complete_store`` of the rest, ``on_request_finished``.
With ``gpu_blocks`` a GPU prefix cache (the simulator's) sits in front, and
lookups start past its hit, as vLLM's scheduler starts them past
``num_computed_tokens``; as vLLM's connector, a request that loaded nothing
offers every block from the first, GPU-held ones included (the simulator's
engine offers only past the GPU hit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import LookupResult, ReqContext

from kvoffload.sim.gpu_cache import GPUPrefixCache
from kvoffload.sim.workload import Request


@dataclass(frozen=True)
class ReplayResult:
    """Block counts of one replay; ``hit_ratio`` and ``writes_per_ref`` are per referenced block."""

    refs: int
    hit_blocks: int
    """Blocks the offload tier served."""
    written_blocks: int
    rejected_blocks: int
    gpu_hit_blocks: int = 0
    reoffered_blocks: int = 0
    """GPU-held blocks offered again, by requests that loaded nothing."""

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.refs if self.refs else 0.0

    @property
    def total_hit_ratio(self) -> float:
        """GPU and offload hits per referenced block."""
        return (self.gpu_hit_blocks + self.hit_blocks) / self.refs if self.refs else 0.0

    @property
    def writes_per_ref(self) -> float:
        return self.written_blocks / self.refs if self.refs else 0.0


def replay(
    manager: Any, requests: Sequence[Request], block_tokens: int, gpu_blocks: int = 0
) -> ReplayResult:
    """Drive ``manager`` (a vLLM ``OffloadingManager``) over ``requests``; stores finish at once.

    ``block_tokens``: tokens per offloaded block (vLLM's chunk, of ``blocks_per_chunk`` GPU
    blocks; key positions are in these). ``gpu_blocks`` > 0: a GPU prefix cache of that many
    offloaded blocks in front of the manager, each held whole or not at all (vLLM's GPU
    cache can hold part of a chunk; it then looks the chunk up, as here one not held).
    """
    gpu = GPUPrefixCache(gpu_blocks) if gpu_blocks else None
    refs = hits_total = written = rejected = gpu_hits_total = reoffered = 0
    for index, request in enumerate(requests):
        keys = request.keys
        context = ReqContext(req_id=str(index))
        for position, key in enumerate(keys, start=1):
            context.set_offload_key_position(key, position * block_tokens)
        gpu_hits, slots = 0, []
        if gpu is not None:
            gpu_hits = gpu.match(keys)
            slots = gpu.acquire_slots(gpu.slots_of(keys[:gpu_hits]), len(keys) - gpu_hits)
        manager.on_new_request(context)
        hits = 0
        for key in keys[gpu_hits:]:
            if manager.lookup(key, context) is not LookupResult.HIT:
                break
            hits += 1
        first = gpu_hits + hits
        if hits:
            manager.prepare_load(keys[gpu_hits:first], context)
            manager.complete_load(keys[gpu_hits:first], context)
        if gpu is not None:
            gpu.register(keys[gpu_hits:], slots[gpu_hits:])
        # As vLLM's connector: past the offload hit, or from the first block if it loaded none.
        offered = keys[first:] if hits else keys
        reoffered += 0 if hits else gpu_hits
        if offered:
            output = manager.prepare_store(offered, context)
            if output is None:
                rejected += len(offered)
            elif output.keys_to_store:
                manager.complete_store(output.keys_to_store, context)
                written += len(output.keys_to_store)
        manager.on_request_finished(context)
        if gpu is not None:
            gpu.release(slots)
        refs += len(keys)
        hits_total += hits
        gpu_hits_total += gpu_hits
    return ReplayResult(refs, hits_total, written, rejected, gpu_hits_total, reoffered)
