"""The real tier's per-key loops, one function each: the reference of their C twins.

The CPU manager and the LRU policy walk a request's keys once per call (look-up, pin,
unpin, store completion, touch, eviction), each key a score of bytecodes around a
dict probe. ``_block_loops.c`` runs the same steps over the same objects where a C
compiler was found (:mod:`kvoffload.policies.loops` picks one or the other); these
functions are what runs without one, and what ``tests/core/test_block_loops.py`` holds
the compiled ones to: the same results, order, counts and errors.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, MutableMapping, Sequence
from itertools import islice
from typing import TYPE_CHECKING

from kvoffload.core.keys import OffloadKey

if TYPE_CHECKING:
    from kvoffload.policies.base import BlockStatus, ParkingOrder, Victims

PENDING_STORE = -1
"""``ref_cnt`` of a block whose store has not completed: neither loadable nor evictable
(defined here, below ``policies.base``, which imports it from here)."""


def leading_ready(blocks: dict[OffloadKey, BlockStatus], keys: Iterable[OffloadKey], /) -> int:
    """How many leading ``keys`` are held ready (pinned or not): a look-up's hit run."""
    hits = 0
    for key in keys:
        block = blocks.get(key)
        if block is None or block.ref_cnt < 0:
            break
        hits += 1
    return hits


def pin_all(
    blocks: dict[OffloadKey, BlockStatus], keys: Sequence[OffloadKey], /
) -> tuple[list[int], int] | int:
    """Pin each key's block: their slot ids and how many were unpinned before; or, where a
    key is not held ready, the index of that key, with every block pinned so far unpinned."""
    pinned: list[BlockStatus] = []
    newly_pinned = 0
    for index, key in enumerate(keys):
        block = blocks.get(key)
        if block is None or (ref_cnt := block.ref_cnt) < 0:
            for done in pinned:
                done.ref_cnt -= 1
            return index
        if not ref_cnt:
            newly_pinned += 1
        block.ref_cnt = ref_cnt + 1
        pinned.append(block)
    return [block.block_id for block in pinned], newly_pinned


def unpin_all(
    blocks: dict[OffloadKey, BlockStatus], keys: Sequence[OffloadKey], /
) -> list[OffloadKey] | int:
    """Unpin each key's block: the keys whose last pin this released; or, where a key's
    block is not pinned, the index of that key, with every block unpinned so far pinned."""
    released: list[BlockStatus] = []
    unpinned: list[OffloadKey] = []
    for index, key in enumerate(keys):
        block = blocks.get(key)
        if block is None or (ref_cnt := block.ref_cnt) <= 0:
            for done in released:
                done.ref_cnt += 1
            return index
        if ref_cnt == 1:
            unpinned.append(key)
        block.ref_cnt = ref_cnt - 1
        released.append(block)
    return unpinned


def mark_ready(
    blocks: dict[OffloadKey, BlockStatus], keys: Iterable[OffloadKey], /
) -> list[OffloadKey]:
    """Make the pending blocks among ``keys`` ready (a store completed): their keys."""
    changed: list[OffloadKey] = []
    for key in keys:
        block = blocks.get(key)
        if block is not None and block.ref_cnt == PENDING_STORE:
            block.ref_cnt = 0
            changed.append(key)
    return changed


def drop_victims(
    blocks: dict[OffloadKey, BlockStatus], victims: Victims, free: list[BlockStatus], /
) -> list[OffloadKey]:
    """Forget evicted blocks and put their slots on ``free``, in order: their keys."""
    evicted: list[OffloadKey] = []
    append_key, append_free = evicted.append, free.append
    for key, block in victims:
        del blocks[key]
        append_key(key)
        append_free(block)
    return evicted


def store_pairs(
    mapping: MutableMapping[OffloadKey, BlockStatus],
    keys: Iterable[OffloadKey],
    values: Iterable[BlockStatus],
    /,
) -> None:
    """``mapping[key] = value`` for each pair, in order: a store's new blocks entered where
    the manager and the policy keep them (ValueError, as ``zip``'s, where the lengths differ,
    after the pairs they share)."""
    mapping.update(zip(keys, values, strict=True))


def claim_pending(blocks: Iterable[BlockStatus], /) -> list[int]:
    """Mark ``blocks`` pending (a store of them starts): their slot ids."""
    ids: list[int] = []
    for block in blocks:
        block.ref_cnt = PENDING_STORE
        ids.append(block.block_id)
    return ids


def move_recent(
    order: OrderedDict[OffloadKey, BlockStatus],
    parking: ParkingOrder,
    keys: Iterable[OffloadKey],
    /,
) -> None:
    """LRU's touch: each key ``order`` holds, or ``parking`` holds parked, made most recent,
    last key first, so that the first ends most recent (``order`` is ``parking.order``)."""
    parked = parking.parked
    move_to_end = order.move_to_end
    for key in reversed(keys if isinstance(keys, list) else list(keys)):
        if key in order:
            move_to_end(key)
        elif parked and key in parked:
            order[key] = parking.unpark(key)


def distinct(keys: Iterable[OffloadKey], /) -> list[OffloadKey]:
    """``keys`` each once, where it first comes: an offer as the tier takes it."""
    return list(dict.fromkeys(keys))


def front_victims(
    order: OrderedDict[OffloadKey, BlockStatus], n: int, protected: Container[OffloadKey], /
) -> Victims | None:
    """The first ``n`` blocks of ``order``, taken out, where each is a victim (ready, not
    pinned, not ``protected``); otherwise ``None``, and nothing changed."""
    taken = list(islice(order.items(), n))
    for key, block in taken:
        if block.ref_cnt != 0 or key in protected:
            return None
    for key, _ in taken:
        del order[key]
    return taken
