"""kvoffload: offload LLM serving KV caches to cheaper tiers, and decide what to keep there.

Each public name is imported on its first use: ``import kvoffload`` stays light, because
the ``kvoffload`` command (:mod:`kvoffload.cli.main`) starts here and sets up Ctrl-C only
once this has run.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvoffload.core.errors import (
        BlockNotFoundError,
        BlockNotPinnedError,
        BlockNotReadyError,
        BlockStateError,
        InvalidArgumentError,
        KVOffloadError,
    )
    from kvoffload.core.hashing import hash_token_blocks, keys_for_tokens
    from kvoffload.core.keys import (
        OffloadKey,
        block_id_key,
        get_offload_block_hash,
        get_offload_group_idx,
        make_offload_key,
    )
    from kvoffload.core.layout import LAYOUT_PRESETS, KVLayout, layout_preset
    from kvoffload.core.manager import OffloadingEvent, OffloadingManager, PrepareStoreOutput
    from kvoffload.core.specs import (
        BlockIDsLoadStoreSpec,
        CPULoadStoreSpec,
        GPULoadStoreSpec,
        LoadStoreSpec,
    )
    from kvoffload.managers import (
        CPUOffloadingManager,
        FilterReusedOffloadingManager,
        build_manager,
    )
    from kvoffload.policies import (
        BlockStatus,
        CachePolicy,
        available_policies,
        register_cache_policy,
    )

_HOMES = {
    "BlockNotFoundError": "kvoffload.core.errors",
    "BlockNotPinnedError": "kvoffload.core.errors",
    "BlockNotReadyError": "kvoffload.core.errors",
    "BlockStateError": "kvoffload.core.errors",
    "InvalidArgumentError": "kvoffload.core.errors",
    "KVOffloadError": "kvoffload.core.errors",
    "hash_token_blocks": "kvoffload.core.hashing",
    "keys_for_tokens": "kvoffload.core.hashing",
    "OffloadKey": "kvoffload.core.keys",
    "block_id_key": "kvoffload.core.keys",
    "get_offload_block_hash": "kvoffload.core.keys",
    "get_offload_group_idx": "kvoffload.core.keys",
    "make_offload_key": "kvoffload.core.keys",
    "LAYOUT_PRESETS": "kvoffload.core.layout",
    "KVLayout": "kvoffload.core.layout",
    "layout_preset": "kvoffload.core.layout",
    "OffloadingEvent": "kvoffload.core.manager",
    "OffloadingManager": "kvoffload.core.manager",
    "PrepareStoreOutput": "kvoffload.core.manager",
    "BlockIDsLoadStoreSpec": "kvoffload.core.specs",
    "CPULoadStoreSpec": "kvoffload.core.specs",
    "GPULoadStoreSpec": "kvoffload.core.specs",
    "LoadStoreSpec": "kvoffload.core.specs",
    "CPUOffloadingManager": "kvoffload.managers",
    "FilterReusedOffloadingManager": "kvoffload.managers",
    "build_manager": "kvoffload.managers",
    "BlockStatus": "kvoffload.policies",
    "CachePolicy": "kvoffload.policies",
    "available_policies": "kvoffload.policies",
    "register_cache_policy": "kvoffload.policies",
}
"""Where each public name is defined."""

__all__ = [
    "LAYOUT_PRESETS",
    "BlockIDsLoadStoreSpec",
    "BlockNotFoundError",
    "BlockNotPinnedError",
    "BlockNotReadyError",
    "BlockStateError",
    "BlockStatus",
    "CPULoadStoreSpec",
    "CPUOffloadingManager",
    "CachePolicy",
    "FilterReusedOffloadingManager",
    "GPULoadStoreSpec",
    "InvalidArgumentError",
    "KVLayout",
    "KVOffloadError",
    "LoadStoreSpec",
    "OffloadKey",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "available_policies",
    "block_id_key",
    "build_manager",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "hash_token_blocks",
    "keys_for_tokens",
    "layout_preset",
    "make_offload_key",
    "register_cache_policy",
]


def __getattr__(name: str) -> Any:
    """``name`` from its module, imported now and kept (later look-ups find it here)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
