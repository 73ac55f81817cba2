"""Tiers below the CPU tier: byte stores that need no torch (local disk, Valkey/Redis).

Each implements :class:`~kvoffload.core.tier_protocol.LowerTier`; the shared
tier's client package (``valkey``) is imported only when a remote tier is
created.
"""

from kvoffload.tiers.breaker import CircuitBreaker
from kvoffload.tiers.disk import DiskTier
from kvoffload.tiers.format import CorruptBlockError, fingerprint_of, layout_fingerprint
from kvoffload.tiers.remote import RemoteTier, RemoteTierError
from kvoffload.tiers.stack import LowerTierConfig, Stack, StackConfig, build_stack, lower_tiers
from kvoffload.tiers.url import RemoteAddress, parse_remote_url

__all__ = [
    "CircuitBreaker",
    "CorruptBlockError",
    "DiskTier",
    "LowerTierConfig",
    "RemoteAddress",
    "RemoteTier",
    "RemoteTierError",
    "Stack",
    "StackConfig",
    "build_stack",
    "fingerprint_of",
    "layout_fingerprint",
    "lower_tiers",
    "parse_remote_url",
]
