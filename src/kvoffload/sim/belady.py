"""The offline limit of an offload tier: Belady's furthest-next-use eviction.

The bound replays the workload sequentially through the same GPU prefix
cache, and gives the offload tier perfect knowledge of the future: every
newly computed block is admitted, and whenever the tier is over capacity
the block whose next use lies furthest ahead leaves (possibly the one just
admitted, which amounts to not storing it). No online policy with the same
capacity and the same GPU cache should do better; comparing a policy with
this number shows how much any smarter policy could still gain.

Next uses are precomputed in one backward pass and eviction uses a heap with
lazy deletion, so the whole bound costs O(n log n) in the block references.
A block with no next use would be the first victim anyway, so it never
enters the tier (nor the heap): the same hits, far fewer heap entries.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload.core.keys import OffloadKey
from kvoffload.sim.gpu_cache import GPUPrefixCache
from kvoffload.sim.workload import Request, cacheable_keys


@dataclass(frozen=True)
class BeladyResult:
    """Hits of the bound run, in blocks."""

    refs: int
    gpu_hit_blocks: int
    offload_hit_blocks: int

    @property
    def total_hit_ratio(self) -> float:
        return (self.gpu_hit_blocks + self.offload_hit_blocks) / self.refs if self.refs else 0.0

    @property
    def offload_hit_ratio(self) -> float:
        return self.offload_hit_blocks / self.refs if self.refs else 0.0


def next_uses(requests: Sequence[Sequence[OffloadKey]]) -> list[list[int]]:
    """For each request and block, the index of the next request using that key.

    Keys never used again get ``len(requests)``, later than any real use.
    """
    never = len(requests)
    last_use: dict[OffloadKey, int] = {}
    result: list[list[int]] = [[] for _ in requests]
    for index in range(len(requests) - 1, -1, -1):
        keys = requests[index]
        result[index] = [last_use.get(key, never) for key in keys]
        for key in keys:
            last_use[key] = index
    return result


def belady_bound(
    requests: Sequence[Request],
    gpu_blocks: int,
    offload_blocks: int,
    drop_partial_of: int | None = None,
) -> BeladyResult:
    """Hits of a GPU LRU prefix cache in front of a Belady offload tier of ``offload_blocks``.

    ``drop_partial_of``: the block size in tokens, to leave partial last blocks
    uncached as the engine's ``partial_block="drop"`` does; ``None`` caches them.
    """
    gpu = GPUPrefixCache(gpu_blocks)
    drop = drop_partial_of is not None
    cacheable = [cacheable_keys(req, drop_partial_of or 1, drop) for req in requests]
    uses = next_uses(cacheable) if offload_blocks > 0 else []
    tier: dict[OffloadKey, int] = {}
    heap: list[tuple[int, OffloadKey]] = []
    refs = gpu_hits = offload_hits = 0
    never = len(requests)
    for index, req in enumerate(requests):
        keys = cacheable[index]
        num_blocks = len(req.keys)
        hit = gpu.match(keys)
        slots = gpu.acquire(keys[:hit], num_blocks - hit)
        refs += num_blocks
        gpu_hits += hit
        if offload_blocks > 0:
            found = hit
            while found < len(keys) and keys[found] in tier:
                found += 1
            offload_hits += found - hit
            # A block never used again is the first to leave: keep it out, or drop it, at once.
            for position, (key, use) in enumerate(zip(keys, uses[index], strict=True)):
                if use == never:
                    tier.pop(key, None)
                elif position >= found or key in tier:
                    tier[key] = use
                    heapq.heappush(heap, (-use, key))
            while len(tier) > offload_blocks:
                negative_use, key = heapq.heappop(heap)
                if tier.get(key) == -negative_use:
                    del tier[key]
        gpu.register(keys[hit:], slots[hit : len(keys)])
        gpu.release(slots)
    return BeladyResult(refs, gpu_hits, offload_hits)
