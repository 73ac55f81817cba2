"""Drivers shared by the tests of the policies' setting aside of pinned blocks (vLLM #46216):
a block that counts reads of its ``ref_cnt``, long random runs, and one call on a manager or a
policy's blocks per step."""

from __future__ import annotations

import random

from kvoffload import CPUOffloadingManager, block_id_key
from kvoffload.core.keys import OffloadKey
from kvoffload.policies.base import BlockStatus, CachePolicy

KEYS = [block_id_key(i) for i in range(8)]
MANAGER_OPS = ["store", "stored", "complete", "fail", "touch", "load", "unload", "remove"]


class CountingBlock(BlockStatus):
    """A block that counts how often a policy reads its ``ref_cnt``."""

    __slots__ = ("_ref",)
    reads = 0

    @property  # type: ignore[override]
    def ref_cnt(self) -> int:
        CountingBlock.reads += 1
        return self._ref

    @ref_cnt.setter
    def ref_cnt(self, value: int) -> None:
        self._ref = value


def random_ops(seed: int, names: list[str], count: int) -> list[tuple[str, list[int], int]]:
    """A long random run: hypothesis's own lists stay short, and pinned or pending blocks
    at the cold end of a full tier take a few dozen calls to arise."""
    rng = random.Random(seed)
    return [
        (
            rng.choice(names),
            [rng.randrange(10) for _ in range(rng.randint(0, 4))],
            rng.randint(0, 4),
        )
        for _ in range(count)
    ]


def request_end(policy: CachePolicy, op: str, keys: list[OffloadKey], n: int) -> None:
    """A request-scoped driver's calls: the first ``n`` keys read, the rest only stored."""
    if op == "missed":
        policy.store_missed(keys)
    else:
        policy.finish_request(keys, set(keys[:n]), set(keys[n:]))


def drive(m: CPUOffloadingManager, op: str, keys: list[OffloadKey], n: int) -> object:
    """One call; returns what a caller observes."""
    if op in ("store", "stored"):  # "stored": and completed at once
        out = m.prepare_store(keys)
        if out is not None and op == "stored":
            m.complete_store(out.keys_to_store)
        return None if out is None else (out.keys_to_store, out.evicted_keys)
    if op in ("complete", "fail"):
        m.complete_store(keys, success=op == "complete")
    elif op == "touch":
        m.touch(keys)
    elif op == "load":
        m.prepare_load([k for k in keys if (b := m.block_status(k)) is not None and b.is_ready])
    elif op == "unload":
        m.complete_load(
            [k for k in dict.fromkeys(keys) if (b := m.block_status(k)) and b.ref_cnt > 0]
        )
    elif op in ("finish", "missed"):
        request_end(m.policy, op, keys, n)
    else:
        return m.remove(keys)
    return None


def turn_ref_counts(
    blocks: dict[OffloadKey, BlockStatus], op: str, keys: list[OffloadKey]
) -> list[OffloadKey]:
    """``op`` ("ready", "pin" or "unpin") on the ``blocks`` of ``keys`` that allow it; the keys
    whose ``ref_cnt`` turned 0, which a driver reports with ``became_evictable``."""
    turned = []
    for key in keys:
        block = blocks.get(key)
        if block is None:
            continue
        before = block.ref_cnt
        if op == "ready" and before == -1:
            block.ref_cnt = 0
        elif op == "pin" and before >= 0:
            block.ref_cnt += 1
        elif op == "unpin" and before > 0:
            block.ref_cnt -= 1
        if block.ref_cnt == 0 and before != 0:
            turned.append(key)
    return turned
