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

from kvoffload.core.errors import InvalidArgumentError
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
    gpu_hits: Sequence[int] | None = None,
) -> BeladyResult:
    """Hits of a GPU LRU prefix cache in front of a Belady offload tier of ``offload_blocks``.

    ``drop_partial_of``: the block size in tokens, to leave partial last blocks
    uncached as the engine's ``partial_block="drop"`` does; ``None`` caches them.
    ``gpu_hits``: each request's GPU prefix hit, when a sequential replay
    through the same GPU cache has computed them already (the tier does not
    change the GPU cache's course); the GPU cache is then not replayed again.
    """
    if gpu_hits is not None and len(gpu_hits) != len(requests):
        raise InvalidArgumentError(f"{len(gpu_hits)} GPU hit counts for {len(requests)} requests")
    gpu = GPUPrefixCache(gpu_blocks) if gpu_hits is None else None
    known_hits: Sequence[int] = () if gpu_hits is None else gpu_hits
    drop = drop_partial_of is not None
    cacheable = [cacheable_keys(req, drop_partial_of or 1, drop) for req in requests]
    uses = next_uses(cacheable) if offload_blocks > 0 else []
    tier: dict[OffloadKey, int] = {}
    by_use = _ByNextUse()
    added = by_use.added
    refs = total_gpu_hits = offload_hits = 0
    never = len(requests)
    slots: list[int] = []
    for index, req in enumerate(requests):
        keys = cacheable[index]
        num_blocks = len(req.keys)
        if gpu is None:
            hit = known_hits[index]
        else:
            hit = gpu.match(keys)
            slots = gpu.acquire(keys[:hit], num_blocks - hit)
        refs += num_blocks
        total_gpu_hits += hit
        if offload_blocks > 0:
            by_use.forget(index)
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
                    bucket = added.get(use)
                    if bucket is None:
                        by_use.start(use, key)
                    else:
                        bucket.append(key)
            if len(tier) > offload_blocks:
                by_use.evict(tier, offload_blocks)
        if gpu is not None:
            gpu.register(keys[hit:], slots[hit : len(keys)])
            gpu.release(slots)
    return BeladyResult(refs, total_gpu_hits, offload_hits)


class _ByNextUse:
    """The tier's keys grouped by next use: evicts the furthest first, smallest key first.

    The order is that of a heap of ``(-next_use, key)`` with lazy deletion,
    but most keys cost one list append instead of a heap push: a request's
    blocks mostly share their next use. A key whose next use changed stays
    in its old group and is skipped when met there.
    """

    def __init__(self) -> None:
        self.added: dict[int, list[OffloadKey]] = {}
        """Keys given each next use since it was last sorted."""
        self._sorted: dict[int, list[OffloadKey]] = {}
        """Keys of each next use, largest first, so the smallest pops off the end."""
        self._uses: list[int] = []
        """A heap of the negated next uses that have (or had) a group."""

    def start(self, use: int, key: OffloadKey) -> None:
        self.added[use] = [key]
        heapq.heappush(self._uses, -use)

    def forget(self, use: int) -> None:
        """Drop the group of a request now running: its keys all get a new next use."""
        self.added.pop(use, None)
        self._sorted.pop(use, None)

    def evict(self, tier: dict[OffloadKey, int], capacity: int) -> None:
        """Delete keys from ``tier`` until it holds ``capacity``."""
        uses, added, ready = self._uses, self.added, self._sorted
        while len(tier) > capacity:
            use = -uses[0]
            fresh = added.pop(use, None)
            queue = ready.get(use)
            if fresh is not None:
                queue = ready[use] = sorted({*fresh, *(queue or ())}, reverse=True)
            while queue and len(tier) > capacity:
                key = queue.pop()
                if tier.get(key) == use:
                    del tier[key]
            if not queue:
                ready.pop(use, None)
                heapq.heappop(uses)
