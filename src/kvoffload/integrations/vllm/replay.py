"""Replay a workload through any manager speaking vLLM 0.33's per-key API.

One driver for ours and vLLM's own managers, so a comparison differs only in
the manager. Requests run one after another in the order vLLM's scheduler
calls the manager: ``on_new_request``, a per-key prefix ``lookup`` that stops
at the first miss, ``prepare_load``/``complete_load`` of the hit prefix,
``prepare_store``/``complete_store`` of the rest, ``on_request_finished``.
A scan with a key answered ``RETRY`` or ``HIT_PENDING`` (a lower tier's
promotion in flight) delays the request, as vLLM's scheduler does: it scans
on to the first miss, so that every read starts, ends the step
(``on_schedule_end``, the request not scheduled) and scans again from the GPU
hit in the next one; the request is counted once, when a scan settles.
With ``gpu_blocks`` a GPU prefix cache (the simulator's) sits in front, and
lookups start past its hit, as vLLM's scheduler starts them past
``num_computed_tokens``; as vLLM's connector, a request that loaded nothing
offers every block from the first, GPU-held ones included (the simulator's
engine offers only past the GPU hit).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

from kvoffload.core.keys import OffloadKey
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
    delayed_scans: int = 0
    """Scans the manager deferred (``RETRY``/``HIT_PENDING``): steps a request waited."""

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


STEP_PAUSE_S = 0.0002
"""How long a request delayed more than once waits per step, for a tier's I/O thread."""


def replay(
    manager: Any,
    requests: Sequence[Request],
    block_tokens: int,
    gpu_blocks: int = 0,
    max_wait_s: float = 30.0,
) -> ReplayResult:
    """Drive ``manager`` (a vLLM ``OffloadingManager``) over ``requests``; stores finish at once.

    ``block_tokens``: tokens per offloaded block (vLLM's chunk, of ``blocks_per_chunk`` GPU
    blocks; key positions are in these). ``gpu_blocks`` > 0: a GPU prefix cache of that many
    offloaded blocks in front of the manager, each held whole or not at all (vLLM's GPU
    cache can hold part of a chunk; it then looks the chunk up, as here one not held).
    ``max_wait_s``: how long one request may stay delayed before :class:`TimeoutError`
    (a stack that waits for its tiers settles in one retry).
    """
    gpu = GPUPrefixCache(gpu_blocks) if gpu_blocks else None
    refs = hits_total = written = rejected = gpu_hits_total = reoffered = delayed = 0
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
        hits, retries = _settled_scan(manager, keys[gpu_hits:], context, max_wait_s)
        delayed += retries
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
    return ReplayResult(refs, hits_total, written, rejected, gpu_hits_total, reoffered, delayed)


def _settled_scan(
    manager: Any, keys: Sequence[OffloadKey], context: ReqContext, max_wait_s: float
) -> tuple[int, int]:
    """The leading run of ``keys`` the manager serves, once a scan of them is not deferred,
    and how many scans were (each one step the request waited, unscheduled)."""
    deadline = time.monotonic() + max_wait_s
    retries = 0
    while True:
        hits, deferred = _scan(manager, keys, context)
        if not deferred:
            return hits, retries
        manager.on_schedule_end(ScheduleEndContext((), ()))
        if retries:
            if time.monotonic() > deadline:
                raise TimeoutError(f"a lookup was still deferred after {max_wait_s} s")
            time.sleep(STEP_PAUSE_S)
        retries += 1


def _scan(manager: Any, keys: Sequence[OffloadKey], context: ReqContext) -> tuple[int, bool]:
    """vLLM's one-key prefix scan: the hits before the first miss, and whether the manager
    deferred it (scanned on past ``RETRY``, a ``HIT_PENDING`` a hit not yet readable)."""
    hits, deferred = 0, False
    for key in keys:
        answer = manager.lookup(key, context)
        if answer is LookupResult.MISS:
            break
        if answer is LookupResult.RETRY:
            deferred = True
        else:
            hits += 1
            deferred |= answer is LookupResult.HIT_PENDING
    return hits, deferred
