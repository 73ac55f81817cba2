"""The offline limit of an offload tier: Belady's furthest-next-use eviction.

The bound replays the workload through the same GPU prefix cache, and gives
the offload tier perfect knowledge of the future: every newly computed block
is admitted, and whenever the tier is over capacity the block whose next use
lies furthest ahead leaves (possibly the one just admitted, which amounts to
not storing it). Comparing a policy with this number shows roughly how much a
smarter policy could still gain (not exactly: see below).

Three details keep it above a policy under KV-prefix semantics, where a tier
hit counts only in the leading run of blocks past the GPU hit:

- a *use* is a request that needs the block from the tier: one where it lies
  at or past that request's GPU prefix hit. A reference the GPU cache serves
  needs no tier copy, so it must not make the tier keep one. The GPU hits are
  computed first (the tier does not change the GPU cache's course).
- of blocks with the same next use, the one furthest into that request goes
  first: a request can use a block only with all the blocks before it, so
  keeping a child without its parent is worthless.
- for the same reason a block a tier-full or more past the request's GPU hit is
  no use there: keeping it for that request would only take a useful block's
  room (a tier of one block kept a third block for a request whose first two it
  could never hold with it, and lost a hit LRU made).

Overlapping requests (a run's ``store_points``) store late: a long prefill
can store after later requests have looked up. The bound then offers such a
request's blocks twice, when it starts (as if stored at once) and again where
the run stored them, so every choice the run made is one the bound could make.

Furthest-next-use is provably optimal only for independent blocks; under
prefix semantics it is a heuristic that no tested policy has beaten, and not the
optimum: it can drop a parent and keep its child for nothing (docs/simulate.md
has six requests on which it gets 2 tier hits where 3 can be had).

Next uses are precomputed in one backward pass and eviction uses a heap with
lazy deletion, so the whole bound costs O(n log n) in the block references.
A block with no next use would be the first victim anyway, so it never
enters the tier (nor the heap): the same hits, far fewer heap entries.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload.core.errors import InvalidArgumentError, check_integer
from kvoffload.core.keys import OffloadKey
from kvoffload.sim.gpu_cache import GPUPrefixCache
from kvoffload.sim.workload import Progress, Request, cacheable_keys, max_gpu_hit

PROGRESS_REQUESTS = 256
"""Requests a pass of the bound goes through between two reports to a progress callback."""

NextUse = tuple[int, int]
"""(index of the next request that needs a block from the tier, its position there)."""


@dataclass(frozen=True)
class BeladyResult:
    """Hits of the bound run, in blocks.

    Its ratios multiply by ``1 / refs`` as a run's report does (dividing differs in the last
    bit), so a run that reaches its bound shows the same figure, never one above it."""

    refs: int
    gpu_hit_blocks: int
    offload_hit_blocks: int

    @property
    def total_hit_ratio(self) -> float:
        return (self.gpu_hit_blocks + self.offload_hit_blocks) * self._per_ref

    @property
    def offload_hit_ratio(self) -> float:
        return self.offload_hit_blocks * self._per_ref

    @property
    def _per_ref(self) -> float:
        return 1.0 / self.refs if self.refs else 0.0


def gpu_prefix_hits(
    requests: Sequence[Request],
    cacheable: Sequence[Sequence[OffloadKey]],
    gpu_blocks: int,
    max_hits: Sequence[int],
    progress: Progress | None = None,
) -> list[int]:
    """Each request's GPU prefix hit (at most its ``max_hits``), replaying ``requests``
    one after another; ``progress(done, total)`` is told the requests replayed now and then."""
    gpu = GPUPrefixCache(gpu_blocks)
    hits = []
    for index, (req, keys, most) in enumerate(zip(requests, cacheable, max_hits, strict=True)):
        if progress is not None and not index % PROGRESS_REQUESTS:
            progress(index, len(requests))
        hit = min(gpu.match(keys), most)
        slots = gpu.acquire(keys[:hit], len(req.keys) - hit)
        gpu.register(keys[hit:], slots[hit : len(keys)])
        gpu.release(slots)
        hits.append(hit)
    return hits


def reach_end(keys: Sequence[OffloadKey], start: int, reach: int) -> int:
    """One past the last position of ``keys`` a tier of ``reach`` blocks can serve from
    ``start`` on: it must hold every distinct key from ``start`` to there at once. A key
    repeated within a request takes no second slot (keys chained by prefix never repeat;
    a trace's may), so the end is counted in distinct keys."""
    end = min(len(keys), start + reach)
    if end == len(keys):
        return end
    held = set(keys[start:end])
    while end < len(keys):
        key = keys[end]
        if key not in held:
            if len(held) >= reach:
                break
            held.add(key)
        end += 1
    return end


def next_uses(
    requests: Sequence[Sequence[OffloadKey]],
    gpu_hits: Sequence[int],
    reach: int | None = None,
    progress: Progress | None = None,
) -> list[list[NextUse]]:
    """For each request and block, where the key is next needed from the tier.

    A request needs a key from the tier only at or past its GPU hit, and (``reach``: the
    tier's capacity) fewer than ``reach`` blocks past it: a hit there needs every block
    from the GPU hit on in the tier at once. Keys never needed again get
    ``(len(requests), 0)``, later than any real use. ``progress(done, total)`` is told the
    requests gone through (from the last one back) now and then.
    """
    never = (len(requests), 0)
    next_use: dict[OffloadKey, NextUse] = {}
    result: list[list[NextUse]] = [[] for _ in requests]
    for index in range(len(requests) - 1, -1, -1):
        done = len(requests) - 1 - index
        if progress is not None and not done % PROGRESS_REQUESTS:
            progress(done, len(requests))
        keys = requests[index]
        result[index] = [next_use.get(key, never) for key in keys]
        end = len(keys) if reach is None else reach_end(keys, gpu_hits[index], reach)
        for position in range(end - 1, gpu_hits[index] - 1, -1):
            next_use[keys[position]] = (index, position)
    return result


def belady_bound(
    requests: Sequence[Request],
    gpu_blocks: int,
    offload_blocks: int,
    drop_partial_of: int | None = None,
    gpu_hits: Sequence[int] | None = None,
    store_points: Sequence[int] | None = None,
    progress: Progress | None = None,
) -> BeladyResult:
    """Hits of a GPU LRU prefix cache in front of a Belady offload tier of ``offload_blocks``.

    ``drop_partial_of``: the block size in tokens, to leave partial last blocks
    uncached as the engine's ``partial_block="drop"`` does; ``None`` caches them.
    ``gpu_hits``: each request's GPU prefix hit as a run saw it, ``requests``
    in the order that run started them; ``None`` replays ``requests`` one after
    another through a GPU cache of ``gpu_blocks``.
    ``store_points``: for each request, how many requests had started when it
    offered its blocks to the tier (overlapping requests store after later ones
    looked up); ``None``: each stores before the next one starts.
    ``progress(done, total)`` is told the requests its passes have gone through now and then
    (two passes, three where it replays the GPU cache itself), and ``(total, total)`` at the
    end: it takes a fifth of a simulation's time, after the replay's own progress ended.
    """
    check_integer("offload_blocks", offload_blocks, 0)
    if drop_partial_of is not None:
        check_integer("drop_partial_of", drop_partial_of, 1)
    if gpu_hits is not None and len(gpu_hits) != len(requests):
        raise InvalidArgumentError(f"{len(gpu_hits)} GPU hit counts for {len(requests)} requests")
    if store_points is not None and len(store_points) != len(requests):
        raise InvalidArgumentError(f"{len(store_points)} store points for {len(requests)} requests")
    drop, block_tokens = drop_partial_of is not None, drop_partial_of or 1
    passes = _Passes(len(requests), 2 if gpu_hits is not None else 3, progress)
    cacheable = [cacheable_keys(req, block_tokens, drop) for req in requests]
    if gpu_hits is None:
        most = [max_gpu_hit(req, block_tokens, drop) for req in requests]
        gpu_hits = gpu_prefix_hits(requests, cacheable, gpu_blocks, most, passes.next())
    refs = sum(len(req.keys) for req in requests)
    if offload_blocks == 0:
        passes.finish()
        return BeladyResult(refs, sum(gpu_hits), 0)
    uses = next_uses(cacheable, gpu_hits, offload_blocks, passes.next())
    replayed = passes.next()
    late_stores = _late_stores(len(requests), store_points)
    tracking = any(late_stores)
    next_use: dict[OffloadKey, NextUse] = {}
    """Each key's next use after the lookups replayed so far (for late stores)."""
    if tracking:
        for index, keys in enumerate(cacheable):
            hit = gpu_hits[index]
            for position in range(hit, reach_end(keys, hit, offload_blocks)):
                next_use.setdefault(keys[position], (index, position))
    tier: dict[OffloadKey, int] = {}
    by_use = _ByNextUse(cacheable)
    offload_hits = 0
    never = (len(requests), 0)
    for index, keys in enumerate(cacheable):
        if replayed is not None and not index % PROGRESS_REQUESTS:
            replayed(index, len(cacheable))
        # A request that stored after later ones started offers its blocks again.
        for stored in late_stores[index]:
            offered = cacheable[stored]
            for position in range(gpu_hits[stored], len(offered)):
                key = offered[position]
                use = next_use.get(key, never)
                if key not in tier and use != never:
                    tier[key] = use[0]
                    by_use.place(use)
        if len(tier) > offload_blocks:
            by_use.evict(tier, offload_blocks)
        by_use.forget(index)
        hit = gpu_hits[index]
        found = hit
        while found < len(keys) and keys[found] in tier:
            found += 1
        offload_hits += found - hit
        # Every block past the GPU hit enters (or stays) with its next use, as if stored
        # at once; a block never used again would be the first to leave: it leaves now.
        for position in range(hit, len(keys)):
            key, use = keys[position], uses[index][position]
            if tracking:
                next_use[key] = use
            if use == never:
                tier.pop(key, None)
            else:
                tier[key] = use[0]
                by_use.place(use)
        if len(tier) > offload_blocks:
            by_use.evict(tier, offload_blocks)
    passes.finish()
    return BeladyResult(refs, sum(gpu_hits), offload_hits)


class _Passes:
    """One progress for a bound's passes over its requests: each pass's ``(done, total)``
    told as a share of all of them."""

    def __init__(self, requests: int, passes: int, progress: Progress | None) -> None:
        self._requests = requests
        self._total = requests * passes
        self._started = -1
        self._progress = progress

    def next(self) -> Progress | None:
        """The progress of the next pass (``None`` where nothing is told)."""
        self._started += 1
        progress = self._progress
        if progress is None:
            return None
        offset, total = self._started * self._requests, self._total
        return lambda done, _: progress(offset + done, total)

    def finish(self) -> None:
        if self._progress is not None:
            self._progress(self._total, self._total)


def _late_stores(num_requests: int, store_points: Sequence[int] | None) -> list[list[int]]:
    """For each request, the requests that stored just before it started, after another
    request had started since their own start (a sequential run has none)."""
    late: list[list[int]] = [[] for _ in range(num_requests + 1)]
    for index, point in enumerate(store_points or ()):
        if not index < point <= num_requests:
            raise InvalidArgumentError(
                f"request {index} stored when {point} requests had started, not "
                f"{index + 1} to {num_requests}"
            )
        if point > index + 1:
            late[point].append(index)
    return late


class _ByNextUse:
    """The tier's keys grouped by next use: evicts the furthest first, deepest there first.

    The order is that of a heap of ``(-next_use, -position there)`` with lazy
    deletion, but most keys cost one list append instead of a heap push: a
    request's blocks mostly share their next use. A group holds positions in
    its request, which name the keys; a key whose next use changed stays in
    its old group and is skipped when met there.
    """

    def __init__(self, keys: Sequence[Sequence[OffloadKey]]) -> None:
        self._keys = keys
        """Each request's cacheable keys, by which a group's positions name its keys."""
        self.added: dict[int, list[int]] = {}
        """Positions given each next use since it was last sorted."""
        self._sorted: dict[int, list[int]] = {}
        """Positions of each next use, shallowest first, so the deepest pops off the end."""
        self._uses: list[int] = []
        """A heap of the negated next uses that have (or had) a group."""

    def place(self, use: NextUse) -> None:
        """Group a key (named by its position in request ``use[0]``) under its next use."""
        request, position = use
        bucket = self.added.get(request)
        if bucket is None:
            self.added[request] = [position]
            heapq.heappush(self._uses, -request)
        else:
            bucket.append(position)

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
                queue = ready[use] = sorted({*fresh, *(queue or ())})
            keys = self._keys[use]
            while queue and len(tier) > capacity:
                key = keys[queue.pop()]
                if tier.get(key) == use:
                    del tier[key]
            if not queue:
                ready.pop(use, None)
                heapq.heappop(uses)
