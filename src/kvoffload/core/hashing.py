"""Prefix-chained block hashes for callers that have token ids but no engine.

Each full block's hash covers its tokens and its parent's hash, so one hash
names a whole prefix and prefix lookups can walk keys in order. SHA-256 over a
fixed byte encoding keeps the result identical across processes and runs,
unlike Python's salted ``hash()``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import GROUP_IDX_BYTES, OffloadKey, make_offload_key

HASH_BYTES = 32
"""A SHA-256 digest: every hash of a chain, its root included."""
ROOT_HASH = b"\x00" * HASH_BYTES
"""Parent hash of a sequence's first block."""


def hash_token_blocks(
    token_ids: Sequence[int], block_size: int, parent_hash: bytes = ROOT_HASH
) -> list[bytes]:
    """Chained 32-byte hashes of the full ``block_size``-token blocks of ``token_ids``.

    A trailing partial block is not hashed: it cannot be shared or offloaded.
    ``parent_hash`` continues a chain (e.g. a cached prefix's last hash): it is
    one of this function's 32-byte hashes, or :data:`ROOT_HASH`. Any other length
    (``b""``, or an offload key, which carries 4 more bytes of group index) would
    start a chain that matches no other, so it is refused.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise InvalidArgumentError(f"block_size must be an int >= 1, got {block_size!r}")
    if not isinstance(parent_hash, bytes):
        raise InvalidArgumentError(f"parent_hash must be bytes, got {type(parent_hash).__name__}")
    if len(parent_hash) != HASH_BYTES:
        hint = (
            "; an offload key? pass get_offload_block_hash(key)"
            if len(parent_hash) == HASH_BYTES + GROUP_IDX_BYTES
            else ""
        )
        raise InvalidArgumentError(
            f"parent_hash must be a {HASH_BYTES}-byte hash from hash_token_blocks "
            f"(or ROOT_HASH), got {len(parent_hash)} bytes{hint}"
        )
    try:
        full_blocks = len(token_ids) // block_size
    except TypeError:
        raise InvalidArgumentError(
            f"token_ids must be a sequence of ints, got {type(token_ids).__name__}"
        ) from None
    if full_blocks == 0:  # and no struct of a huge block_size to build
        return []
    block_format = struct.Struct(f"<{block_size}q")
    hashes: list[bytes] = []
    parent = parent_hash
    for start in range(0, full_blocks * block_size, block_size):
        try:
            payload = block_format.pack(*token_ids[start : start + block_size])
        except struct.error as exc:
            raise InvalidArgumentError(
                f"token ids must be integers that fit in 64 bits (block at {start}): {exc}"
            ) from None
        parent = hashlib.sha256(parent + payload).digest()
        hashes.append(parent)
    return hashes


def keys_for_tokens(
    token_ids: Sequence[int], block_size: int, group_idx: int = 0
) -> list[OffloadKey]:
    """Offload keys for the full blocks of ``token_ids`` in KV group ``group_idx``."""
    return [make_offload_key(h, group_idx) for h in hash_token_blocks(token_ids, block_size)]
