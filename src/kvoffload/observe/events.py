"""vLLM's KV-event wire format, and our manager events turned into it.

Routers (llm-d's KV-cache indexer, Dynamo's KV router) decode vLLM's
``KVEventBatch``: a msgpack array ``[ts, events, data_parallel_rank]`` whose
events are msgpack maps tagged by class name (``"type": "BlockStored"``).
These structs have the same names, fields and options, so vLLM's classes
decode what we encode and ours decode what vLLM publishes (fields we do not
know are skipped). msgspec is imported here only.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Union

import msgspec

from kvoffload.core.keys import get_offload_block_hash, get_offload_group_idx
from kvoffload.core.manager import OffloadingEvent

BlockHash = Union[bytes, int]  # noqa: UP007 - msgspec resolves the alias at run time
"""vLLM's ``ExternalBlockHash``: our keys' hash part is bytes."""

INT_HASH_MASK = (1 << 64) - 1


def external_block_hash(hash_bytes: bytes, as_int: bool) -> BlockHash:
    """A key's hash part as events name it: the bytes, or as vLLM does by default
    (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``) the unsigned 64-bit integer of their last
    8 bytes, big-endian, for routers that read block hashes as 64-bit integers only."""
    return int.from_bytes(hash_bytes, "big") & INT_HASH_MASK if as_int else hash_bytes


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged event structs."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]  # noqa: UP007


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


DecodeError = msgspec.DecodeError
"""What :func:`decode_batch` raises, for callers that import no msgspec."""

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Raises ``msgspec.DecodeError`` for a payload that is not a KV event batch."""
    return _DECODER.decode(payload)


def to_kv_events(
    events: Iterable[OffloadingEvent], block_size: int, int_hashes: bool = False
) -> list[Event]:
    """One vLLM event per manager event and KV group, keys in order; block hashes as
    :func:`external_block_hash` names them.

    The manager knows blocks only by key, so stores carry no token ids and
    no parent hash, as vLLM's own offloading events without
    ``self_describing_kv_events``.
    """
    out: list[Event] = []
    for event in events:
        groups: dict[int, list[BlockHash]] = {}
        for key in event.keys:
            block_hash = external_block_hash(get_offload_block_hash(key), int_hashes)
            groups.setdefault(get_offload_group_idx(key), []).append(block_hash)
        for group, hashes in groups.items():
            if event.removed:
                out.append(BlockRemoved(hashes, event.medium, group_idx=group))
            else:
                out.append(
                    BlockStored(hashes, None, [], block_size, None, event.medium, None, None, group)
                )
    return out


def make_batch(events: list[Event], data_parallel_rank: int | None = None) -> KVEventBatch:
    return KVEventBatch(time.time(), events, data_parallel_rank)
