"""kvoffload: offload LLM serving KV caches to cheaper tiers, and decide what to keep there."""

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
