"""Each kvoffload eviction policy as a vLLM 0.32/0.33 ``CachePolicy``, for vLLM's own CPU manager.

vLLM resolves ``eviction_policy`` as an attribute of
``cache_policy_module_path``; ``kvoffload.integrations.vllm`` answers
``kvoffload_<name>`` for every registered policy (``kvoffload_lru``,
``kvoffload_arc``, and any registered later). vLLM keeps its manager (slots,
reference counts, request-scoped access); only the victim choice is ours.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from vllm.v1.kv_offload.cpu.policies.base import CachePolicy as VLLMCachePolicy
from vllm.v1.kv_offload.cpu.policies.base import order_request_keys

from kvoffload.core.keys import OffloadKey
from kvoffload.integrations.vllm.versions import running_release
from kvoffload.policies import CachePolicy, available_policies, create_cache_policy

PREFIX = "kvoffload_"


class PolicyShim(VLLMCachePolicy):  # type: ignore[misc]
    """Holds vLLM's chunk statuses by key and asks our policy for the order and victims.

    vLLM's ``ChunkStatus`` has the ``ref_cnt`` our policies read (``-1``
    pending, ``0`` evictable, ``>0`` pinned), so they work on it unchanged.
    """

    policy_name = "lru"

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._chunks: dict[OffloadKey, Any] = {}
        self._policy: CachePolicy = self._following_policy()

    def _following_policy(self) -> CachePolicy:
        """Our policy, told of every chunk whose ``ref_cnt`` turns 0: vLLM 0.32 and 0.33 call
        :meth:`mark_evictable` at each such turn, so the policy may set aside the pinned and
        pending chunks its evictions walk past (vLLM's #46216) instead of walking them at
        every store."""
        policy = create_cache_policy(self.policy_name, self.cache_capacity)
        policy.follow_evictable()
        return policy

    def mark_evictable(self, key: OffloadKey) -> None:
        self._policy.became_evictable((key,))

    def get(self, key: OffloadKey) -> Any:
        return self._chunks.get(key)

    def insert(self, key: OffloadKey, chunk: Any, req_context: Any = None) -> None:
        """0.33 passes the storing request's context, 0.32 none; our policies need neither."""
        self._chunks[key] = chunk
        self._policy.insert([key], [chunk])

    def remove(self, key: OffloadKey) -> None:
        del self._chunks[key]
        self._policy.remove([key])

    def touch(self, keys: Iterable[OffloadKey], req_context: Any) -> None:
        self._policy.touch(list(keys))

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: Any) -> None:
        """vLLM 0.33: a request's first read or store of blocks; recent now where our policy
        says so (LRU), as vLLM's own LRU makes them."""
        if self._policy.recent_at_access:
            self._policy.touch(list(keys))

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: Any,
    ) -> None:
        """The request's keys in one head-to-tail order across its KV-cache groups (by
        position, where the request knows each key's), as vLLM's LRU and ARC take them;
        our policy tells reads from stores (ARC). Group by group, a hybrid model's first
        group's blocks all ended less recent than the second's, not block by block."""
        keys = order_request_keys(key_groups, req_context)
        self._policy.finish_request(keys, reused_keys, insertion_only_keys)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, Any]] | None:
        victims = self._policy.evict(n, protected)
        if victims is None:
            return None
        for key, _ in victims:
            del self._chunks[key]
        return list(victims)

    def clear(self) -> None:
        self._chunks.clear()
        self._policy = self._following_policy()


_SHIMS: dict[str, type[PolicyShim]] = {}


def policy_shim(attribute: str) -> type[PolicyShim]:
    """The shim class for ``kvoffload_<name>``; one class per name, made on first use.

    vLLM resolves the name when it builds its CPU manager: an untested vLLM stops here.
    """
    running_release()
    name = attribute.removeprefix(PREFIX)
    if not attribute.startswith(PREFIX) or name not in available_policies():
        known = ", ".join(PREFIX + p for p in available_policies())
        raise AttributeError(f"no kvoffload policy {attribute!r} for vLLM; known: {known}")
    if name not in _SHIMS:
        _SHIMS[name] = type(attribute, (PolicyShim,), {"policy_name": name})
    return _SHIMS[name]
