"""Our policies inside vLLM's own CPU manager set aside the pinned chunks an eviction walked
past (vLLM #46216), told by vLLM's ``mark_evictable``, and still choose what vLLM's own
policies choose."""

from __future__ import annotations

import random
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_vllm_replay import _vllm_manager

from kvoffload import block_id_key
from kvoffload.policies.base import ParkingOrder

KEYS = [block_id_key(i) for i in range(12)]
SHIMS = "kvoffload.integrations.vllm"


def _drive(manager: Any, context: Any, op: str, keys: list[bytes]) -> object:
    """One call on vLLM's manager; what a caller observes."""
    if op == "store":
        out = manager.prepare_store(keys, context)
        return None if out is None else (list(out.keys_to_store), list(out.evicted_keys))
    if op == "complete":
        pending = [k for k in keys if (c := manager._policy.get(k)) is not None and c.ref_cnt < 0]
        manager.complete_store(pending, context)
    elif op == "load":
        ready = [k for k in keys if (c := manager._policy.get(k)) is not None and c.ref_cnt >= 0]
        if ready:
            manager.prepare_load(ready, context)
    else:
        pinned = [k for k in keys if (c := manager._policy.get(k)) is not None and c.ref_cnt > 0]
        if pinned:
            manager.complete_load(pinned, context)
    return None


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    capacity=st.integers(1, 6),
    policy=st.sampled_from(["lru", "arc", "slru"]),
)
def test_shimmed_policies_choose_as_they_do_walking_with_chunks_pinned(
    vllm_modules: dict[str, ModuleType], seed: int, capacity: int, policy: str
) -> None:
    """vLLM's manager over the shim against the same manager over a shim whose policy is not
    told of chunks turning evictable (so it walks every chunk at each eviction)."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvoffload.integrations.vllm.policy import policy_shim
    from kvoffload.policies import create_cache_policy

    class Walking(policy_shim(f"kvoffload_{policy}")):  # type: ignore[misc]
        def _following_policy(self) -> Any:
            return create_cache_policy(self.policy_name, self.cache_capacity)

    context = ReqContext(req_id="r")
    walking = _vllm_manager(capacity, 0, f"kvoffload_{policy}", SHIMS)
    walking._policy = Walking(capacity)
    ours = _vllm_manager(capacity, 0, f"kvoffload_{policy}", SHIMS)
    rng = random.Random(seed)
    for _ in range(120):
        op = rng.choice(["store", "store", "complete", "load", "unload"])
        keys = list(dict.fromkeys(rng.choice(KEYS) for _ in range(rng.randint(1, 4))))
        assert _drive(ours, context, op, keys) == _drive(walking, context, op, keys)
        assert _state(ours._policy._policy) == _state(walking._policy._policy)


def _state(policy: Any) -> object:
    """Every order a policy keeps (ARC's ghosts and target too), least recent first."""
    names = ("coldest", "t1", "t2", "b1", "b2", "target_t1_size", "probation", "protected")
    found = {name: getattr(policy, name, None) for name in names}
    found["coldest"] = policy.coldest()
    return {
        name: value if isinstance(value, int | float) else list(value)
        for name, value in found.items()
        if value is not None
    }


def test_a_shimmed_lru_sets_aside_the_pinned_chunks_an_eviction_walked_past(
    vllm_modules: dict[str, ModuleType],
) -> None:
    """Without ``mark_evictable`` passed on, the policy would walk the pinned chunks again at
    every store; with it, they are set aside, and taken first once their loads complete."""
    from vllm.v1.kv_offload.base import ReqContext

    context = ReqContext(req_id="r")
    manager = _vllm_manager(4, 0, "kvoffload_lru", SHIMS)
    assert _drive(manager, context, "store", KEYS[:4]) == (KEYS[:4], [])
    _drive(manager, context, "complete", KEYS[:4])
    _drive(manager, context, "load", KEYS[:2])
    assert _drive(manager, context, "store", KEYS[4:5]) == (KEYS[4:5], KEYS[2:3])
    assert _parked(manager._policy._policy) == KEYS[:2]
    _drive(manager, context, "unload", KEYS[1:2])
    assert _drive(manager, context, "store", KEYS[5:6]) == (KEYS[5:6], KEYS[1:2])


@pytest.mark.parametrize("policy", ["lru", "arc", "slru"])
def test_a_shim_reset_keeps_following(vllm_modules: dict[str, ModuleType], policy: str) -> None:
    from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

    from kvoffload.integrations.vllm.policy import policy_shim

    shim: Any = policy_shim(f"kvoffload_{policy}")(4)
    shim.clear()  # vLLM's reset_cache: a new policy
    chunks = []
    for i in range(3):
        chunk = ChunkStatus(i)
        chunk.ref_cnt = 1 if i < 2 else 0
        chunks.append(chunk)
        shim.insert(KEYS[i], chunk)
    assert shim.evict(1, set()) == [(KEYS[2], chunks[2])]
    assert _parked(shim._policy) == KEYS[:2], "a reset policy is told of chunks turning evictable"
    chunks[0].ref_cnt = 0
    shim.mark_evictable(KEYS[0])
    assert shim.evict(1, set()) == [(KEYS[0], chunks[0])]


def _parked(policy: Any) -> list[bytes]:
    """The chunks ``policy`` has set aside, over all its orders."""
    names = ("t1", "t2", "probation", "protected")
    orders = [getattr(policy, name) for name in names if hasattr(policy, name)]
    if isinstance(coldest := policy.coldest(), ParkingOrder):
        orders.append(coldest)
    return [key for order in orders for key in order.parked]
