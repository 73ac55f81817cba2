"""Eviction policies: each decides which block leaves a tier, nothing more."""

from kvoffload.policies import arc, lru, s3fifo, sieve, slru
from kvoffload.policies.base import PENDING_STORE, BlockStatus, CachePolicy
from kvoffload.policies.registry import (
    available_policies,
    create_cache_policy,
    register_cache_policy,
    resolve_policy,
)

__all__ = [
    "PENDING_STORE",
    "BlockStatus",
    "CachePolicy",
    "arc",
    "available_policies",
    "create_cache_policy",
    "lru",
    "register_cache_policy",
    "resolve_policy",
    "s3fifo",
    "sieve",
    "slru",
]
