"""Replay a workload through any manager speaking vLLM 0.33's per-key API.

One driver for ours and vLLM's own managers, so a comparison differs only in
the manager. Requests run one after another in the order vLLM's scheduler
calls the manager: ``on_new_request``, a per-key prefix ``lookup`` that stops
at the first miss, ``prepare_load``/``complete_load`` of the hit prefix,
``prepare_store``/``complete_store`` of the rest, ``on_request_finished``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import LookupResult, ReqContext

from kvoffload.sim.workload import Request


@dataclass(frozen=True)
class ReplayResult:
    """Block counts of one replay; ``hit_ratio`` and ``writes_per_ref`` are per referenced block."""

    refs: int
    hit_blocks: int
    written_blocks: int
    rejected_blocks: int

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.refs if self.refs else 0.0

    @property
    def writes_per_ref(self) -> float:
        return self.written_blocks / self.refs if self.refs else 0.0


def replay(manager: Any, requests: Sequence[Request], block_tokens: int) -> ReplayResult:
    """Drive ``manager`` (a vLLM ``OffloadingManager``) over ``requests``; stores finish at once."""
    refs = hits_total = written = rejected = 0
    for index, request in enumerate(requests):
        keys = request.keys
        context = ReqContext(req_id=str(index))
        for position, key in enumerate(keys, start=1):
            context.set_offload_key_position(key, position * block_tokens)
        manager.on_new_request(context)
        hits = 0
        for key in keys:
            if manager.lookup(key, context) is not LookupResult.HIT:
                break
            hits += 1
        if hits:
            manager.prepare_load(keys[:hits], context)
            manager.complete_load(keys[:hits], context)
        if hits < len(keys):
            output = manager.prepare_store(keys[hits:], context)
            if output is None:
                rejected += len(keys) - hits
            elif output.keys_to_store:
                manager.complete_store(output.keys_to_store, context)
                written += len(output.keys_to_store)
        manager.on_request_finished(context)
        refs += len(keys)
        hits_total += hits
    return ReplayResult(refs, hits_total, written, rejected)
