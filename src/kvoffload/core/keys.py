"""Offload keys: a block's chained prefix hash followed by its KV-group index.

Raw ``bytes`` instead of a ``(hash, group)`` tuple: keys are made in bulk and
used as dict keys on the scheduler's hot path, where bytes hash and compare
fastest and cost the garbage collector nothing.
"""

from __future__ import annotations

from typing import NewType, NoReturn

from kvoffload.core.errors import InvalidArgumentError, KVOffloadError

OffloadKey = NewType("OffloadKey", bytes)

GROUP_IDX_BYTES = 4
MAX_GROUP_IDX = 2 ** (8 * GROUP_IDX_BYTES) - 1


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Append ``group_idx`` as 4 big-endian bytes to ``block_hash``."""
    # Keys are made per block: the arguments are looked at only once the join has failed,
    # or has made no bytes (a bytearray hash joins into a bytearray, which no dict takes),
    # or ``group_idx`` is a bool (an int to ``to_bytes``: ``True`` would name group 1).
    try:
        key = block_hash + group_idx.to_bytes(GROUP_IDX_BYTES, "big", signed=False)
        if type(key) is bytes and type(group_idx) is not bool:
            return OffloadKey(key)
    except (AttributeError, OverflowError, TypeError):
        pass
    _check_part("group_idx", group_idx, MAX_GROUP_IDX)
    raise InvalidArgumentError(f"block_hash must be bytes, got {type(block_hash).__name__}")


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """The block hash part of ``key``."""
    return key[:-GROUP_IDX_BYTES]


def get_offload_group_idx(key: OffloadKey) -> int:
    """The KV-group index part of ``key``."""
    return int.from_bytes(key[-GROUP_IDX_BYTES:], "big")


BLOCK_ID_BYTES = 8
MAX_BLOCK_ID = 2 ** (8 * BLOCK_ID_BYTES) - 1


def block_id_key(block_id: int, group_idx: int = 0) -> OffloadKey:
    """The key of a block named by an integer id (8 big-endian bytes as its hash).

    Traces name blocks by integer ids that already encode the whole prefix, so
    the id itself can stand in for the engine's chained hash.
    """
    try:
        block_hash = block_id.to_bytes(BLOCK_ID_BYTES, "big")
    except (AttributeError, OverflowError):
        _check_part("block_id", block_id, MAX_BLOCK_ID)
        raise
    if type(block_id) is bool:
        _check_part("block_id", block_id, MAX_BLOCK_ID)
    return make_offload_key(block_hash, group_idx)


def _check_part(name: str, value: object, maximum: int) -> None:
    """:class:`InvalidArgumentError` naming ``name`` unless ``value`` is an int from 0 to
    ``maximum`` (not a bool, which Python counts as one)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise InvalidArgumentError(
            f"{name} must be an int from 0 to {maximum}, got {value!r}"
        ) from None


class NotAKeyIterableError(KVOffloadError, TypeError):
    """One key (bytes) or a string was passed where an iterable of keys is expected."""


SINGLE_KEY_TYPES = (bytes, bytearray, str)
"""What ``keys`` must not be: one key alone, whose bytes would iterate as integer "keys".

Checked inline with ``isinstance`` (a tuple, not a union rebuilt per call), so the hot
methods pay for a function call only on the error path; ``type(keys) is not list`` first,
as a list (the usual argument) is none of them, and the tuple's test of a list costs three
subtype checks (about 100 ns, ten times per request behind an admission layer)."""


def refuse_single_key(keys: bytes | bytearray | str, method: str) -> NoReturn:
    """Raise the error for one key (or a string) passed where an iterable of keys is due."""
    raise NotAKeyIterableError(
        f"{method} expects an iterable of keys, got a single {type(keys).__name__} "
        f"{keys[:16]!r}; wrap it in a list"
    )
