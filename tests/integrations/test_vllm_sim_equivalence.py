"""Under vLLM's per-key adapter the optimiser decides as in the simulator, block for block.

Both replay the same seeded workload with a GPU prefix cache in front: the
simulator's engine through the batch API, vLLM's API through our spec's
adapter (``kvoffload.integrations.vllm.replay`` with ``gpu_blocks``: lookups
start past the GPU hit, and the adapter announces the GPU-held prefix from the
key positions vLLM records). Two shapes: a filler request of GPU-cache size
after each request turns the GPU cache over, so every reference reaches the
tier; and a GPU cache that serves part of the requests, which the adapter only
sees through those positions. Each at one and at two GPU blocks per offloaded
block (the simulator's block is vLLM's chunk, whole on the GPU or not at all:
vLLM looks a chunk the GPU holds part of up again, and the adapter counts it
looked up, not GPU-held). There vLLM offers a request that loaded nothing
from its first block, GPU-held ones included, where the simulator's engine
offers only past the GPU hit: the layer counts those offers too, and its
feedback candidate, which learns from offers, scores otherwise.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from vllm_helpers import create_spec

from kvoffload import block_id_key
from kvoffload.admission import OptimisingAdmission, find_admission
from kvoffload.managers import build_manager
from kvoffload.sim.engine import EngineConfig, ServingEngine
from kvoffload.sim.generators import generate
from kvoffload.sim.workload import Request

WORKLOADS = {
    "chat": ({"chat": 1.0}, 200, 16),
    "one-shot heavy": ({"oneshot": 0.8, "rag": 0.2}, 300, 256),
    "longchat": ({"longchat": 1.0}, 200, 512),
}


def _with_fillers(requests: list[Request], gpu: int, block_tokens: int) -> list[Request]:
    """Each request followed by one of ``gpu`` blocks never seen again."""
    out: list[Request] = []
    for i, request in enumerate(requests):
        out.append(Request(2.0 * i, request.input_tokens, request.output_tokens, request.keys))
        filler = [block_id_key(10**9 + i * gpu + j) for j in range(gpu)]
        out.append(Request(2.0 * i + 1, gpu * block_tokens, 1, filler))
    return out


def _figures(layer: Any) -> tuple[Any, ...]:
    assert isinstance(layer, OptimisingAdmission)
    stats = layer.stats()
    return (layer.chosen, layer.switches, stats.offers, stats.admitted, stats.whatif_total)


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
@pytest.mark.parametrize("gpu_in_front", [False, True], ids=["fillers", "gpu-hits"])
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_the_optimiser_decides_and_reports_the_same_under_vllms_adapter(
    vllm_modules: dict[str, ModuleType], name: str, gpu_in_front: bool, blocks_per_chunk: int
) -> None:
    from kvoffload.integrations.vllm.replay import replay
    from kvoffload.integrations.vllm.versions import running_release

    if not running_release().recency_at_access:
        pytest.skip(
            "this vLLM makes a request's blocks recent when it finishes (0.32), the "
            "simulator when they are used: the same rules over another LRU order"
        )
    mix, requests, block_tokens = WORKLOADS[name]
    workload = generate(mix, num_requests=requests, seed=0, block_tokens=block_tokens, rate=1.0)
    longest = max(len(r.keys) for r in workload.requests)
    if gpu_in_front:
        # A tier that never evicts: vLLM 0.33 does not make GPU-held blocks recent in the
        # tier and the simulator does, which changes an evicting tier's order, not this one.
        gpu, trace = longest + 40, workload.requests
        capacity = len({key for request in trace for key in request.keys})
    else:
        gpu, trace = longest, _with_fillers(workload.requests, longest, block_tokens)
        capacity = 300 + 4 * longest
    simulated = build_manager(capacity, admission="recommended")
    engine = ServingEngine(EngineConfig(gpu, 1, block_tokens), simulated)
    stats = engine.run(trace)
    adapter = create_spec(
        {
            "cpu_bytes_to_use": capacity * 1024 * blocks_per_chunk,
            "kvoffload.admission": "recommended",
        },
        blocks_per_chunk=blocks_per_chunk,
    ).get_manager()
    result = replay(adapter, trace, block_tokens, gpu_blocks=gpu)
    assert (result.refs, result.gpu_hit_blocks) == (stats.refs, stats.gpu_hit_blocks)
    assert (stats.gpu_hit_blocks > 0) is gpu_in_front
    assert result.hit_blocks == stats.offload_hit_blocks > 0
    assert result.written_blocks == stats.stored_blocks > 0
    ours = _figures(find_admission(simulated))
    theirs = _figures(find_admission(adapter.backing))
    assert (result.reoffered_blocks > 0) is gpu_in_front
    if gpu_in_front:
        offers, admitted = (count + result.reoffered_blocks for count in ours[2:4])
        assert theirs[:4] == (*ours[:2], offers, admitted)
        assert _not_learning_from_offers(theirs[4]) == _not_learning_from_offers(ours[4])
    else:
        assert theirs == ours
    assert len(ours[-1]) == 12  # every candidate's what-if at every capacity factor


def _not_learning_from_offers(whatif: tuple[Any, ...]) -> list[Any]:
    return [figure for figure in whatif if figure.candidate != "feedback"]
