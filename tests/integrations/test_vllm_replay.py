"""Our spec against vLLM 0.33's own CPUOffloadingManager, through vLLM's per-key API."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from vllm_helpers import create_spec

from kvoffload import block_id_key
from kvoffload.sim.traces import read_trace
from kvoffload.sim.workload import Request

CAPACITY = 4392
"""Blocks in the tier: 10% of the trace's unique blocks, as the manual's runs use."""


def _vllm_manager(
    num_blocks: int, threshold: int, policy: str = "lru", path: Any = None, tracker: int = 64_000
) -> Any:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return CPUOffloadingManager(
        num_blocks,
        policy,
        cache_policy_module_path=path,
        store_threshold=threshold,
        max_tracker_size=tracker,
    )


def _ours(num_blocks: int, threshold: int, policy: str = "lru", tracker: int = 64_000) -> Any:
    extra = {"cpu_bytes_to_use": num_blocks * 1024, "eviction_policy": policy}
    extra |= {"store_threshold": threshold, "max_tracker_size": tracker}
    return create_spec(extra).get_manager()


@pytest.fixture(scope="module")
def mooncake(mooncake_trace: Path) -> Any:
    return read_trace(mooncake_trace)


Replayed = Callable[[tuple[object, ...], Callable[[], Any]], Any]


@pytest.fixture(scope="module")
def replayed(vllm_modules: dict[str, ModuleType], mooncake: Any) -> Replayed:
    """The Mooncake replay of ``make()``, once per module by ``name``: a replay is
    deterministic, and several tests compare with the same one (vLLM's LRU, ours without a
    threshold), about 1.5 s each."""
    from kvoffload.integrations.vllm.replay import replay

    done: dict[tuple[object, ...], Any] = {}

    def get(name: tuple[object, ...], make: Callable[[], Any]) -> Any:
        if name not in done:
            done[name] = replay(make(), mooncake.requests, mooncake.block_tokens)
        return done[name]

    return get


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("threshold", [0, 2])
def test_mooncake_matches_vllms_manager(replayed: Replayed, policy: str, threshold: int) -> None:
    """Block for block: ARC too, with its ghost hits learnt before the store and a store
    not counted as a second access."""
    theirs = replayed(
        ("vllm", policy, threshold), lambda: _vllm_manager(CAPACITY, threshold, policy)
    )
    ours = replayed(("ours", policy, threshold), lambda: _ours(CAPACITY, threshold, policy))
    assert theirs.hit_ratio > 0.2
    assert ours == theirs
    if threshold:
        everything = replayed(("ours", policy, 0), lambda: _ours(CAPACITY, 0, policy))
        assert ours.written_blocks < 0.6 * everything.written_blocks


def _requests(prefixes: list[list[int]]) -> list[Request]:
    return [
        Request(float(i), 16 * len(p), 1, [block_id_key(b) for b in p])
        for i, p in enumerate(prefixes)
    ]


@settings(max_examples=60, deadline=None)
@example(  # block 0, read once (T2), outlives blocks only stored (T1), which go first
    prefixes=[[0], [0], [1, 3, 4, 5, 6], [2], [0]], capacity=6, threshold=0, tracker=1, policy="arc"
)
@given(
    prefixes=st.lists(
        st.lists(st.integers(0, 12), min_size=1, max_size=6, unique=True), min_size=1, max_size=25
    ),
    capacity=st.integers(1, 8),
    threshold=st.sampled_from([0, 2, 3]),
    tracker=st.integers(1, 8),
    policy=st.sampled_from(["lru", "arc"]),
)
def test_every_request_matches_vllms_manager(
    vllm_modules: dict[str, ModuleType],
    prefixes: list[list[int]],
    capacity: int,
    threshold: int,
    tracker: int,
    policy: str,
) -> None:
    """Request by request, the same hits, writes and refusals as vLLM's LRU and ARC managers."""
    from kvoffload.integrations.vllm.replay import replay

    theirs = _vllm_manager(capacity, threshold, policy, tracker=tracker)
    ours = _ours(capacity, threshold, policy, tracker=tracker)
    for request in _requests(prefixes):
        assert replay(ours, [request], 16) == replay(theirs, [request], 16)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_our_policies_run_inside_vllms_manager(
    vllm_modules: dict[str, ModuleType], mooncake: Any, replayed: Replayed, policy: str
) -> None:
    """``cache_policy_module_path``: vLLM's manager, our victim choice."""
    from kvoffload.integrations.vllm.policy import PolicyShim
    from kvoffload.integrations.vllm.replay import replay

    path = "kvoffload.integrations.vllm"
    shimmed = _vllm_manager(CAPACITY, 0, f"kvoffload_{policy}", path)
    assert isinstance(shimmed._policy, PolicyShim)
    assert shimmed._policy.policy_name == policy
    with_shim = replay(shimmed, mooncake.requests, mooncake.block_tokens)
    native = replayed(("vllm", policy, 0), lambda: _vllm_manager(CAPACITY, 0, policy))
    assert with_shim == native


def test_an_unknown_shim_name_lists_ours(vllm_modules: dict[str, ModuleType]) -> None:
    with pytest.raises(AttributeError, match="kvoffload_lru"):
        _vllm_manager(4, 0, "kvoffload_mru", "kvoffload.integrations.vllm")


def test_a_policy_named_without_our_prefix_lists_ours(vllm_modules: dict[str, ModuleType]) -> None:
    # A name vLLM has not registered is looked up bare in our module: it said only
    # "has no attribute 's3fifo'".
    with pytest.raises(AttributeError, match="eviction policies for vLLM are kvoffload_"):
        _vllm_manager(4, 0, "s3fifo", "kvoffload.integrations.vllm")


@pytest.mark.parametrize("policy", ["lru", "arc"])
@given(
    blocks=st.integers(1, 4),
    reused=st.lists(st.booleans(), min_size=8, max_size=8),
    capacity=st.integers(4, 10),
)
@settings(max_examples=60, deadline=None)
def test_a_request_of_two_kv_groups_is_ordered_across_them_as_vllms_policies_do(
    vllm_modules: dict[str, ModuleType], policy: str, blocks: int, reused: list[bool], capacity: int
) -> None:
    """A hybrid model's request has one group of keys per KV-cache group; vLLM's LRU and ARC
    take them in one head-to-tail order by position. The shim took them group by group, so
    for two groups of two blocks vLLM's ARC kept ``[a1, b1, a0, b0]`` and ours
    ``[a0, b0, a1, b1]``, and the victims then differed."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
    from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus
    from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

    from kvoffload import make_offload_key
    from kvoffload.integrations.vllm.policy import policy_shim

    groups = [[make_offload_key(bytes([g, i]) * 4, g) for i in range(blocks)] for g in range(2)]
    keys = [key for group in groups for key in group]
    context = ReqContext(req_id="hybrid")
    for group in groups:
        for position, key in enumerate(group):
            context.set_offload_key_position(key, position)
    native_class = LRUCachePolicy if policy == "lru" else ARCCachePolicy
    takes_context = "req_context" in inspect.signature(native_class.insert).parameters  # 0.33
    victims = []
    for cache in (native_class(capacity), policy_shim(f"kvoffload_{policy}")(capacity)):
        for slot, key in enumerate(keys):
            chunk = ChunkStatus(slot)
            chunk.ref_cnt = 0
            cache.insert(key, chunk, *([context] if takes_context else []))
        cache.on_request_finished(groups, set(), set(keys), context)  # a second request reads
        read = {key for key, again in zip(keys, reused, strict=False) if again}
        cache.on_request_finished(groups, set(keys) - read, read, context)
        victims.append([key for key, _ in cache.evict(len(keys), set()) or []])
    assert victims[0] == victims[1]
