"""Exact worlds: each candidate rule on a key-only tier of the real tier's size and policy.

A world is fed every request (its keys, GPU-held ones first, and how many the
GPU held) and answers its rule's lookups from its own tier, so under LRU it
holds, hits and writes exactly what the real tier would have, had it followed
that rule from the start. For store-everything and the seed filter that is the
baseline itself, whatever the real tier did; the optimiser follows the best
world and makes the real tier mirror it (``admission/optimiser.py``).

Under the policies that count touches (ARC, S3-FIFO, SIEVE, SLRU) a world's tier
counts the touch after a store for the blocks it just wrote, which the real
tier, where they are still pending, does not (:class:`MiniTier`'s ``pending``);
so there a world approximates its rule's tier (ARC's and SLRU's come out as
LRU's, so they run on the LRU tier: :data:`LRU_IN_A_WORLD`). Made exact, the
real tier mirroring them did worse (docs/admission.md, "Under policies other
than LRU"), so they stay so; :func:`exact_worlds` says where they are exact.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence

from kvoffload.admission.base import AdmissionLayer
from kvoffload.admission.minisim import (
    LRUMiniTier,
    MiniTier,
    WhatIf,
    admitted_set,
    mini_tier,
)
from kvoffload.admission.reuse_filter import FilterReusedOffloadingManager
from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import OffloadingManager, PrepareStoreOutput
from kvoffload.core.specs import CPULoadStoreSpec, LoadStoreSpec
from kvoffload.policies.arc import ARCCachePolicy
from kvoffload.policies.base import CachePolicy
from kvoffload.policies.loops import distinct
from kvoffload.policies.lru import LRUCachePolicy
from kvoffload.policies.slru import SLRUCachePolicy

LRU_IN_A_WORLD = (ARCCachePolicy, SLRUCachePolicy)
"""Policies whose world is LRU's, key for key: a world touches every block it writes
right after the store, so ARC's recency list and SLRU's probation segment are empty
whenever it evicts, and both evict in LRU's order (a test holds them equal). Their
worlds run on the LRU mini-tier, which is compiled where the package was built."""


class Probe(OffloadingManager):
    """The bottom of a candidate rule's stack: answers lookups with the hit run set in
    :attr:`found` (what the real tier answered; a world tells its rule its own hit run
    without a lookup) and stores nothing (the caller asks the rule's ``admit`` for its
    decision)."""

    def __init__(self) -> None:
        self.found: int | None = 0

    def lookup(self, keys: Iterable[OffloadKey]) -> int | None:
        return self.found

    def prepare_load(self, keys: Iterable[OffloadKey]) -> LoadStoreSpec:
        return CPULoadStoreSpec([])

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        return None

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        return PrepareStoreOutput(list(keys), CPULoadStoreSpec([]), [])

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        return None


class World:
    """One rule (``None``: store everything) over its own tier.

    Each request runs as the engine model runs it against a real tier: every
    key made recent, the keys past the GPU hit looked up (the leading run held
    is the hit), the rest offered and the admitted part written, a block behind
    a refused one written but unreachable, and every key made recent again
    after a write. An LRU tier makes the keys recent once, after the store, which
    leaves the same order (:meth:`LRUMiniTier._insert`).
    """

    def __init__(
        self,
        capacity: int,
        policy: type[CachePolicy],
        rule: AdmissionLayer | FilterReusedOffloadingManager | None = None,
    ) -> None:
        tier_policy = LRUCachePolicy if policy in LRU_IN_A_WORLD else policy
        self.tier: MiniTier = mini_tier(capacity, tier_policy, pending=False)
        self._lru = self.tier if isinstance(self.tier, LRUMiniTier) else None
        self.rule = rule
        self._layer = rule if isinstance(rule, AdmissionLayer) else None
        """The rule as a layer, told of each request (its lookup's hit included) up front."""
        self._counts = rule.reuse if isinstance(rule, FilterReusedOffloadingManager) else None
        """The seed filter's lookup counts, which its ``lookup`` would count the keys in."""
        self.hits = 0.0
        self.writes = 0.0
        """Hits and writes, halved with the worlds' window."""
        self.hits_at_mark = 0.0
        """:attr:`hits` when :meth:`Worlds.mark` was last called, halved with them."""
        self._admitted: Sequence[OffloadKey] | None = None
        """What the rule admitted of the last request's offer (``None``: all, or no offer)."""

    def __contains__(self, key: object) -> bool:
        return key in self.tier

    def request(
        self,
        keys: Sequence[OffloadKey],
        gpu_held: int,
        unique: bool = False,
        looked_up: bool = True,
    ) -> None:
        """Run a request; ``unique``: its keys are known to be distinct (no deduplication);
        not ``looked_up``: the keys past ``gpu_held`` miss whatever the tier holds (the real
        tier was not asked for them).

        An LRU tier makes the keys recent once, after the store: the same order as
        :meth:`_request`'s touch before the lookup and again after a write."""
        tier = self._lru
        if tier is None:
            self._request(keys, gpu_held, unique, looked_up)
            return
        offered = self._lookup(keys, gpu_held, unique, looked_up)
        admitted = None
        if offered:
            rule = self.rule
            admitted = None if rule is None else rule.admit(offered)
            self.writes += tier.store_offer(offered, admitted, keys)
        self._admitted = admitted
        tier.touch(keys)

    def _lookup(
        self, keys: Sequence[OffloadKey], gpu_held: int, unique: bool, looked_up: bool
    ) -> list[OffloadKey]:
        """The request's lookup, counted and shown to the rule; the keys it offers.

        The rule's own ``lookup`` is not called, as its backing would only echo the hit
        run: a layer learns the request and whether the tier served part of it in one
        ``begin_request``, the seed filter's counts are counted directly."""
        looked = keys[gpu_held:] if gpu_held else keys
        found = self.tier.hit_run(looked) if looked and looked_up else 0
        self.hits += found
        layer = self._layer
        if layer is not None:
            layer.begin_request(keys, lookup_follows=True, tier_hit=found > 0)
        elif looked and self._counts is not None:
            self._counts.count(looked)
        offered = looked[found:]
        if not offered:
            return []
        return offered if unique and type(offered) is list else distinct(offered)

    def kept_of(self, offered: Sequence[OffloadKey]) -> tuple[Container[OffloadKey] | None, int]:
        """What a tier running this world's rule keeps of ``offered`` (an offer of the last
        request, past another tier's hit), and the offer index of the first key it leaves
        out: the keys this world holds after the request, and those its rule admitted then
        and the request's own store evicted (an offer larger than the tier); ``None``:
        everything."""
        n = len(offered)
        if self.rule is None:
            return None, n
        tier = self.tier
        gap = tier.leading_held(offered)
        admitted = self._admitted
        if gap == n:
            return None, n
        if not admitted:
            return tier.held, gap
        keep = _HeldOrAdmitted(
            tier.held, set(admitted) if len(admitted) > _SCANNED_ADMITTED else admitted
        )
        while gap < n and offered[gap] in keep:
            gap += 1
        return keep, gap

    def _request(
        self, keys: Sequence[OffloadKey], gpu_held: int, unique: bool, looked_up: bool
    ) -> None:
        tier, rule = self.tier, self.rule
        tier.touch(keys)
        offered = self._lookup(keys, gpu_held, unique, looked_up)
        self._admitted = None
        if not offered:
            return
        if rule is None:
            written = tier.store(offered)
        else:
            admitted = self._admitted = rule.admit(offered)
            keep, gap = admitted_set(offered, admitted)
            written = tier.store_admitted(offered, range(len(offered)), keep, gap)
        if written:
            self.writes += written
            tier.touch(keys)


_SCANNED_ADMITTED = 8
"""Up to this many admitted keys are scanned as a list; more are hashed first: an offer
larger than the tier leaves most admitted keys unheld, and the leading run walks them all."""


class _HeldOrAdmitted:
    """A world's held keys, and those its rule admitted in the last request (a short list,
    or a set: asked only of the sampled keys and the leading run the world does not hold)."""

    __slots__ = ("_admitted", "_held")

    def __init__(self, held: Container[OffloadKey], admitted: Container[OffloadKey]) -> None:
        self._held = held
        self._admitted = admitted

    def __contains__(self, key: object) -> bool:
        return key in self._held or key in self._admitted


def exact_worlds(policy: type[CachePolicy]) -> bool:
    """Whether worlds under ``policy`` are exactly their rules' tiers (see the module)."""
    return policy is LRUCachePolicy


class Worlds:
    """The candidates' worlds, fed the same requests; windowed hits and writes per
    reference (halved every ``window`` references) for the choice, and the same since the
    start: each world is its rule at the tier's own size, so under LRU they are the exact
    1x what-if figures of a mirroring tier."""

    def __init__(self, worlds: Mapping[str, World], window: float) -> None:
        if not window > 0:
            raise ValueError(f"the worlds' window must be > 0, got {window}")
        self.worlds = dict(worlds)
        self.window = window
        self.refs = 0.0
        self.gpu_hits = 0.0
        """Keys the GPU held, halved with :attr:`refs`."""
        self.total_refs = 0
        self.total_gpu_hits = 0
        self._since_halving = 0.0

    def __getitem__(self, name: str) -> World:
        return self.worlds[name]

    def request(self, keys: Sequence[OffloadKey], gpu_held: int, looked_up: bool = True) -> None:
        """Run a request through every world (see :meth:`World.request`)."""
        n = len(keys)
        unique = len(distinct(keys)) == n  # compiled, cheaper than a set of tens of keys
        for world in self.worlds.values():
            world.request(keys, gpu_held, unique, looked_up)
        self.refs += n
        self.gpu_hits += gpu_held
        self.total_refs += n
        self.total_gpu_hits += gpu_held
        self._since_halving += n
        if self._since_halving >= self.window:
            self.refs /= 2
            self.gpu_hits /= 2
            for world in self.worlds.values():
                world.hits /= 2
                world.writes /= 2
                world.hits_at_mark /= 2
            self._since_halving = 0.0

    def mark(self) -> None:
        """Start counting every world's hits since now (the optimiser's last switch)."""
        for world in self.worlds.values():
            world.hits_at_mark = world.hits

    def hits_since_mark(self, name: str) -> float:
        """Hits of world ``name`` since :meth:`mark`, over the window (halved with it)."""
        world = self.worlds[name]
        return world.hits - world.hits_at_mark

    @property
    def full(self) -> bool:
        """Whether some world's tier has filled: before that, no rule has lost a hit."""
        return any(len(w.tier) >= w.tier.capacity for w in self.worlds.values())

    def scores(self) -> dict[str, tuple[float, float]]:
        """``candidate -> (tier hits, writes)`` per block reference over the window."""
        refs = self.refs or 1.0
        return {name: (w.hits / refs, w.writes / refs) for name, w in self.worlds.items()}

    def figures(self, cumulative: bool = False) -> list[WhatIf]:
        """Each world as a what-if figure at 1x: total hits (GPU and tier) and writes per
        reference over the window (``cumulative``: since the start); ``None`` before any
        reference."""
        refs = float(self.total_refs if cumulative else self.refs)
        gpu = float(self.total_gpu_hits if cumulative else self.gpu_hits)
        result = []
        for name, world in self.worlds.items():
            tier = world.tier
            hits = float(tier.total_hits) if cumulative else world.hits
            writes = float(tier.total_writes) if cumulative else world.writes
            result.append(
                WhatIf(
                    candidate=name,
                    capacity_factor=1.0,
                    hit_ratio=(gpu + hits) / refs if refs else None,
                    writes_per_ref=writes / refs if refs else None,
                    capacity=tier.capacity,
                    sampling_rate=1.0,
                )
            )
        return result

    @property
    def memory_bytes(self) -> int:
        return sum(w.tier.memory_bytes for w in self.worlds.values())

    @property
    def tracked_keys(self) -> int:
        return sum(w.tier.capacity for w in self.worlds.values())
