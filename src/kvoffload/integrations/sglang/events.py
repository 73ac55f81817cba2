"""SGLang's KV-event wire format, in which the L3 backend announces its pages.

A router that reads SGLang's KV events decodes every payload with SGLang's own
``KVEventBatch``: the same ``[ts, events, rank]`` array as vLLM's, events tagged
maps by class name as vLLM's, sent in the same ``[topic, seq, payload]`` frames and
replay protocol, but with ``block_hashes: list[int]``: a batch naming a block by
bytes does not decode. SGLang's own GPU and host events number a plain request's
page by ``hash_str_to_int64`` of its hash (the first 16 hex digits, a signed 64-bit
integer), so ours number it the same, and the router sees one page on several media.
The structs carry SGLang 0.5.23's names and fields in its order; SGLang is not
imported here, msgspec is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from kvoffload.core.keys import OffloadKey, get_offload_block_hash
from kvoffload.core.manager import OffloadingEvent

PAGE_DIGEST_BYTES = hashlib.sha256().digest_size
"""A page hash as the backend keys it: SGLang's SHA-256 hex digest as its 32 bytes (a key
that is no page hash is stored by other bytes, never 32 long)."""

MEDIA = {"DISK": "DISK", "REMOTE": "EXTERNAL"}
"""Our tiers' media in SGLang's words (its ``StorageMedium``): the disk tier is its L3
``DISK``; the shared tier, a pool other servers read too, its ``EXTERNAL``."""


class SGLangBlockStored(msgspec.Struct, tag="BlockStored", gc=False):
    """SGLang's ``BlockStored``. Every field is sent, ``None`` as nil where SGLang leaves its
    defaults out: its decoder reads nil as the default, and decoders with vLLM's structs
    (kvoffload's subscriber) need ``medium`` and ``lora_name``, which vLLM's require."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class SGLangBlockRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    """SGLang's ``BlockRemoved``, ``medium`` always sent as in :class:`SGLangBlockStored`."""

    block_hashes: list[int]
    medium: str | None = None


def page_number(hash_bytes: bytes) -> int:
    """What SGLang's events call the page of a key's hash part: for a page hash its first 8
    bytes, big-endian and signed (``hash_str_to_int64`` of the hex digest). A key that is
    no page hash has no number of SGLang's: it gets the first 8 bytes of the SHA-256 of
    its bytes, its own, so removing it never removes another key from a router's index
    (reading its leading characters as hex would: an upper-case page hash, a page of its
    own here, would share the lower-case one's number)."""
    if len(hash_bytes) != PAGE_DIGEST_BYTES:
        hash_bytes = hashlib.sha256(hash_bytes).digest()
    return int.from_bytes(hash_bytes[:8], "big", signed=True)


def to_sglang_events(
    events: Iterable[OffloadingEvent],
    page_size: int,
    parents: Mapping[OffloadKey, OffloadKey] | None = None,
) -> list[Any]:
    """SGLang's events for the manager's, pages in order. SGLang's routers read a
    ``BlockStored``'s pages as one chain hanging from its ``parent_block_hash``, so a store
    is split where a page does not follow the one before it in ``parents`` (each page's
    page before it in its request, where known), each part naming its first page's
    parent. The tiers know pages by key only, so stores carry no token ids."""
    out: list[Any] = []
    for event in events:
        medium = MEDIA.get(event.medium, event.medium)
        if not event.removed:
            for parent, chain in _chains(event.keys, parents or {}):
                numbers = [page_number(get_offload_block_hash(key)) for key in chain]
                parent_number = None if parent is None else page_number(parent)
                out.append(SGLangBlockStored(numbers, parent_number, [], page_size, None, medium))
        elif event.keys:
            numbers = [page_number(get_offload_block_hash(key)) for key in event.keys]
            out.append(SGLangBlockRemoved(numbers, medium))
    return out


def _chains(
    keys: Sequence[OffloadKey], parents: Mapping[OffloadKey, OffloadKey]
) -> list[tuple[bytes | None, list[OffloadKey]]]:
    """``keys`` cut into runs of pages that each follow the one before, each with the hash
    part of the page its first follows (``None``: unknown, or the request's first)."""
    runs: list[tuple[bytes | None, list[OffloadKey]]] = []
    for key in keys:
        parent = parents.get(key)
        if runs and parent is not None and parent == runs[-1][1][-1]:
            runs[-1][1].append(key)
        else:
            runs.append((None if parent is None else get_offload_block_hash(parent), [key]))
    return runs
