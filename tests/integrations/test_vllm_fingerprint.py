"""The block fingerprint: every dimension that changes a block's bytes, and no other.

A lower tier hands a block only to an engine whose fingerprint matches, so a
dimension left out of it loads another configuration's KV bytes as this one's
(wrong attention, no error), and a dimension that does not change the bytes
but is in it stops replicas of one deployment from sharing blocks.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from vllm_helpers import Instance, lookup_until_settled, offloading_config, request_context

from kvoffload import block_id_key
from tier_servers import ValkeyProcess

KEYS = [block_id_key(i) for i in range(1, 5)]
BASE = {"cpu_bytes_to_use": 1 << 20}


def _fingerprint(config: Any) -> bytes:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    spec = OffloadingSpecFactory.create_spec(config)
    return bytes(spec.fingerprint)


def _base() -> Any:
    """Two ranks of tensor parallelism, so that each parallel size can be changed alone."""
    return offloading_config(BASE, world_size=2)


def _replace(obj: Any, **changes: Any) -> Any:
    """``obj`` with ``changes``; skipped where this vLLM release has no such field."""
    missing = set(changes) - {field.name for field in dataclasses.fields(obj)}
    if missing:
        pytest.skip(f"this vLLM's {type(obj).__name__} has no {', '.join(sorted(missing))}")
    return dataclasses.replace(obj, **changes)


def _top(**changes: Any) -> Callable[[Any], Any]:
    return lambda c: _replace(c, **changes)


def _parallel(**changes: Any) -> Callable[[Any], Any]:
    return lambda c: _replace(c, parallel=_replace(c.parallel, **changes))


def _model(**changes: Any) -> Callable[[Any], Any]:
    return lambda c: _replace(c, model=_replace(c.model, **changes))


def _cache(**changes: Any) -> Callable[[Any], Any]:
    return lambda c: _replace(c, cache=_replace(c.cache, **changes))


def _group(**changes: Any) -> Callable[[Any], Any]:
    return lambda c: _replace(c, groups=tuple(_replace(g, **changes) for g in c.groups))


CHANGES_BYTES = {
    "tensor parallel size": _parallel(tp_size=1),
    "pipeline parallel size": _parallel(pp_size=2),
    "prefill context parallel size": _parallel(pcp_size=2),
    "decode context parallel size": _parallel(dcp_size=2),
    "number of ranks": _parallel(world_size=4),
    "bytes per rank": _top(worker_kv_bytes_per_block=2048),
    "model": _model(name="another-model"),
    "KV dtype": _model(dtype="bfloat16"),
    "KV cache layout": _top(kv_cache_layout="HND"),
    "canonical layout": _top(canonical_layout=True),
    "tokens per hash": _cache(tokens_per_hash=32),
    "blocks per chunk": _cache(blocks_per_chunk=2),
    "tokens per block": _group(tokens_per_block=32),
    "layers of the group": _group(layer_names=("layer.0",)),
}

KEEPS_BYTES = {
    "rank of the process": _parallel(rank=1),
    "data-parallel replica": _parallel(data_parallel_index=1, data_parallel_size=2),
    "engine id": _top(engine_id="another-engine"),
    "longest request": _model(max_model_len=8192),
    "KV events": _top(enable_kv_cache_events=True),
}


@pytest.mark.parametrize("change", list(CHANGES_BYTES), ids=list(CHANGES_BYTES))
def test_every_dimension_of_a_blocks_bytes_changes_the_fingerprint(
    vllm_modules: dict[str, ModuleType], change: str
) -> None:
    base = _base()
    assert _fingerprint(CHANGES_BYTES[change](base)) != _fingerprint(base)


@pytest.mark.parametrize("change", list(KEEPS_BYTES), ids=list(KEEPS_BYTES))
def test_what_does_not_change_the_bytes_keeps_the_fingerprint(
    vllm_modules: dict[str, ModuleType], change: str
) -> None:
    base = _base()
    assert _fingerprint(KEEPS_BYTES[change](base)) == _fingerprint(base)


def test_tp1_blocks_are_a_miss_for_tp2_with_the_same_bytes_per_block(
    vllm_modules: dict[str, ModuleType],
    valkey_server: ValkeyProcess,
    instances: Callable[..., Instance],
) -> None:
    """The same model at TP=1 and TP=2: a block is 512 bytes under both (one rank of 512,
    or two of 256 in rank order), but its bytes are laid out differently."""
    from vllm.v1.kv_offload.base import LookupResult

    extra = {"cpu_bytes_to_use": 8 * 512, "kvoffload.remote_url": valkey_server.url}
    model = f"tp-{uuid.uuid4().hex[:8]}"
    tp1 = instances(extra, model=model, page_bytes=256, world_size=1)
    tp2 = instances(extra, model=model, page_bytes=128, world_size=2, workers=False)
    assert tp1.scheduler.bytes_per_block == tp2.scheduler.bytes_per_block == 512
    context = request_context("w", KEYS)
    tp1.store(KEYS, [0, 1, 2, 3], context)
    tp1.scheduler.close()  # the write-through to the server has finished
    assert tp1.manager.backing.tiers[0].stats.stored_blocks == len(KEYS)

    answers = lookup_until_settled(tp2.manager, KEYS[0], request_context("r", KEYS))
    assert answers == [LookupResult.MISS]
    # The control: another TP=1 engine of the same model is served by the shared tier.
    peer = instances(extra, model=model, page_bytes=256, world_size=1)
    answers = lookup_until_settled(peer.manager, KEYS[0], request_context("p", KEYS))
    assert answers[0] is LookupResult.RETRY and answers[-1] is LookupResult.HIT, answers
