"""Offload keys: a block's chained prefix hash followed by its KV-group index.

Raw ``bytes`` instead of a ``(hash, group)`` tuple: keys are made in bulk and
used as dict keys on the scheduler's hot path, where bytes hash and compare
fastest and cost the garbage collector nothing.
"""

from __future__ import annotations

from typing import NewType, NoReturn

from kvoffload.core.errors import KVOffloadError

OffloadKey = NewType("OffloadKey", bytes)

GROUP_IDX_BYTES = 4


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Append ``group_idx`` as 4 big-endian bytes to ``block_hash``."""
    return OffloadKey(block_hash + group_idx.to_bytes(GROUP_IDX_BYTES, "big", signed=False))


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """The block hash part of ``key``."""
    return key[:-GROUP_IDX_BYTES]


def get_offload_group_idx(key: OffloadKey) -> int:
    """The KV-group index part of ``key``."""
    return int.from_bytes(key[-GROUP_IDX_BYTES:], "big")


BLOCK_ID_BYTES = 8


def block_id_key(block_id: int, group_idx: int = 0) -> OffloadKey:
    """The key of a block named by an integer id (8 big-endian bytes as its hash).

    Traces name blocks by integer ids that already encode the whole prefix, so
    the id itself can stand in for the engine's chained hash.
    """
    return make_offload_key(block_id.to_bytes(BLOCK_ID_BYTES, "big"), group_idx)


class NotAKeyIterableError(KVOffloadError, TypeError):
    """One key (bytes) or a string was passed where an iterable of keys is expected."""


SINGLE_KEY_TYPES = (bytes, bytearray, str)
"""What ``keys`` must not be: one key alone, whose bytes would iterate as integer "keys".

Checked inline with ``isinstance`` (a tuple, not a union rebuilt per call), so the hot
methods pay for a function call only on the error path."""


def refuse_single_key(keys: bytes | bytearray | str, method: str) -> NoReturn:
    """Raise the error for one key (or a string) passed where an iterable of keys is due."""
    raise NotAKeyIterableError(
        f"{method} expects an iterable of keys, got a single {type(keys).__name__} "
        f"{keys[:16]!r}; wrap it in a list"
    )
