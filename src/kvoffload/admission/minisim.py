"""Miniature simulations: scaled-down copies of the tier, fed a hash-sampled share of the keys.

Spatial sampling as in SHARDS (Waldspurger et al., FAST 2015; miniature
simulations, ATC 2017): a key is sampled when the low ``bits`` bits of its
hash are zero, so every request of a sampled key is seen, and a mini-tier of
``capacity x 2**-bits`` keys under the tier's own eviction policy sees about
the hits and writes of the full tier, scaled by the same rate. Requests keep
their prefix semantics: a sampled key hits only within the leading run of the
request's sampled lookup keys that the mini-tier holds.

One :class:`MiniSimulation` runs one mini-tier per candidate admission rule
and capacity factor. Each candidate's decisions come from its own rule (run on
every key); the mini-tiers only replay what each decision would have done to
the tier. Every counter is halved once ``window`` sampled references have been
counted since the last halving, so the figures follow a workload that shifts.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Collection, Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvoffload.admission.params import is_finite
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import OffloadKey
from kvoffload.policies.arc import ARCCachePolicy
from kvoffload.policies.base import PENDING_STORE, BlockStatus, CachePolicy
from kvoffload.policies.lru import LRUCachePolicy
from kvoffload.policies.s3fifo import MAX_FREQ as S3FIFO_MAX_FREQ
from kvoffload.policies.s3fifo import S3FIFOCachePolicy
from kvoffload.policies.s3fifo import small_target as s3fifo_small_target
from kvoffload.policies.sieve import SIEVECachePolicy
from kvoffload.policies.slru import SLRUCachePolicy
from kvoffload.policies.slru import protected_limit as slru_protected_limit

# Each compiled module is optional (installed without a C compiler: the Python twin runs).
try:
    from kvoffload.admission._lru_tier import LRUTier
except ImportError:
    LRUTier = None  # type: ignore[assignment,misc]
try:
    from kvoffload.admission._s3fifo_tier import S3FIFOTier
except ImportError:
    S3FIFOTier = None  # type: ignore[assignment,misc]
try:
    from kvoffload.admission._arc_tier import ARCTier
except ImportError:
    ARCTier = None  # type: ignore[assignment,misc]
try:
    from kvoffload.admission._sieve_tier import SIEVETier
except ImportError:
    SIEVETier = None  # type: ignore[assignment,misc]
try:
    from kvoffload.admission._slru_tier import SLRUTier
except ImportError:
    SLRUTier = None  # type: ignore[assignment,misc]
try:
    from kvoffload.admission._sketch import sampled_positions
except ImportError:
    sampled_positions = None  # type: ignore[assignment]

MIN_MINI_KEYS = 1024
"""The sampling rate is the highest power-of-two fraction that leaves a 1x mini-tier at
least this many keys (every key for smaller tiers)."""
MAX_BITS = 8
"""The lowest rate is 1 in 256."""
MIN_WHATIF_KEYS = 256
"""Mini-tiers kept only for the what-if figures (other capacities) hold at least this many
keys: a quarter of the decision tiers' minimum, so that they cost less than those."""
BYTES_PER_MINI_KEY = 400
"""Approximate CPython cost of one key of a pure-Python mini-tier: the held dict's entry,
the policy's ordered-dict entry and the status object (the compiled tier counts its own
arrays, about 65 bytes a key)."""
WINDOW_TIERS = 32
"""Counters are halved every this many 1x mini-tier-fulls of sampled references."""
OPEN_REQUESTS = 256
"""Requests whose lookup awaits its store; older ones are forgotten."""


def sampling_bits(capacity: int, min_keys: int = MIN_MINI_KEYS, max_bits: int = MAX_BITS) -> int:
    """The most ``bits`` (up to ``max_bits``) that leave ``capacity >> bits >= min_keys``."""
    bits = 0
    while bits < max_bits and capacity >> (bits + 1) >= min_keys:
        bits += 1
    return bits


class MiniTier:
    """A tier of ``capacity`` keys with no data and no slots.

    With ``pending`` (the default) a store's blocks stay pending until the touch that
    follows it, as the real tier's do until ``complete_store``: the engine (and vLLM's
    connector) touches a request's keys again after ``prepare_store``, and a policy that
    counts touches (ARC, S3-FIFO, SIEVE, SLRU) does not count that touch for a block still
    pending, so the mini-tier is the real tier scaled down. Without it that touch promotes
    every block just written, which the worlds keep on purpose
    (:mod:`~kvoffload.admission.worlds`). Under LRU a touch only reorders: no difference.

    These methods also declare the compiled tiers' (which mix in this class or a subclass),
    so a parameter their C takes only by position is positional-only (``/``) here too.
    """

    _keys: Mapping[OffloadKey, object]
    """The held keys (the specialised tiers keep them in their own structure)."""

    def __init__(self, capacity: int, policy: type[CachePolicy], pending: bool = True) -> None:
        self._start(capacity, pending)
        self.policy = policy(capacity)
        self._held: dict[OffloadKey, BlockStatus] = {}
        self._keys = self._held
        self._free: list[BlockStatus] = []
        self._unsettled: list[BlockStatus] = []
        """The last store's blocks while pending, until the touch after it."""

    def _start(self, capacity: int, pending: bool = True) -> None:
        """What every mini-tier starts with: its capacity, no unreachable keys, no counts."""
        if capacity < 1:
            raise InvalidArgumentError(f"mini-tier capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.pending = pending
        """Whether a store's blocks stay pending until the touch after it (see the class)."""
        self._keys = {}
        self._dead: set[OffloadKey] = set()
        self.hits = 0.0
        self.writes = 0.0
        """Hits and writes, halved with the simulation's window."""
        self.total_hits = 0
        self.total_writes = 0

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object, /) -> bool:
        return key in self._keys

    @property
    def memory_bytes(self) -> int:
        """Approximate bytes of the tier's structures (:data:`BYTES_PER_MINI_KEY` a key)."""
        return BYTES_PER_MINI_KEY * self.capacity

    @property
    def held(self) -> Container[OffloadKey]:
        """The held keys (reachable or not), for membership tests without a call per key."""
        return self._keys

    def held_among(self, keys: Sequence[OffloadKey], /) -> list[OffloadKey]:
        """The held keys (reachable or not) among ``keys``, in order."""
        held = self._keys
        return [key for key in keys if key in held]

    def leading_held(self, keys: Sequence[OffloadKey], /) -> int:
        """How many leading ``keys`` are held (reachable or not)."""
        held = self._keys
        run = 0
        for key in keys:
            if key not in held:
                break
            run += 1
        return run

    def hit_run(self, keys: Sequence[OffloadKey], /) -> int:
        """How many leading ``keys`` are held and reachable."""
        held, dead = self._keys, self._dead
        run = 0
        for key in keys:
            if key not in held or key in dead:
                break
            run += 1
        if run:
            self.hits += run
            self.total_hits += run
        return run

    def store(self, keys: Sequence[OffloadKey], behind_gap: Sequence[bool] = ()) -> int:
        """Write those of ``keys`` not held, evicting by the policy; how many were written.

        A key with ``behind_gap`` set follows a block its candidate did not
        store: it is written but unreachable by a prefix lookup (it breaks a
        hit run) until a later store of it comes without a gap, which revives
        it without a write. As the real tier does, an offer that cannot make
        room writes nothing.
        """
        self._settle()
        held, dead = self._held, self._dead
        if behind_gap:
            new = []
            new_dead = []
            for key, gap in zip(keys, behind_gap, strict=True):
                if key in held:
                    if not gap and key in dead:
                        dead.discard(key)
                elif key not in new:
                    new.append(key)
                    if gap:
                        new_dead.append(key)
        else:
            new = [key for key in keys if key not in held]
            new_dead = []
            if dead:
                dead.difference_update(keys)
            if len(new) > 1 and len(set(new)) < len(new):
                new = list(dict.fromkeys(new))
        if not new:
            return 0
        need = len(new) - (self.capacity - len(held))
        if need > 0:
            victims = self.policy.evict(need, set(keys))
            if victims is None:
                return 0
            for key, status in victims:
                del held[key]
                dead.discard(key)
                self._free.append(status)
        statuses = [self._free.pop() if self._free else BlockStatus(0) for _ in new]
        state = PENDING_STORE if self.pending else 0
        for status in statuses:
            status.ref_cnt = state
        if self.pending:
            self._unsettled = statuses
        held.update(zip(new, statuses, strict=True))
        dead.update(new_dead)
        self.policy.insert(new, statuses)
        self.writes += len(new)
        self.total_writes += len(new)
        return len(new)

    def touch(self, keys: Sequence[OffloadKey], /) -> None:
        self.policy.touch(keys)
        self._settle()

    def _settle(self) -> None:
        """The last store's blocks are written (its ``complete_store``)."""
        if self._unsettled:
            for status in self._unsettled:
                status.ref_cnt = 0
            self._unsettled = []

    def store_admitted(
        self,
        keys: Sequence[OffloadKey],
        at: Sequence[int],
        keep: Container[OffloadKey] | None,
        gap: int,
    ) -> int:
        """:meth:`store` of what a candidate's tier writes of a request's sampled lookup
        ``keys``: those the real tier served (``at`` -1, else the key's offer index) and
        those in ``keep`` (``None``: every offered key), each behind a gap past offer
        index ``gap`` (the candidate's first key left out)."""
        if keep is None:
            return self.store(keys)
        to_store = []
        behind = []
        for key, j in zip(keys, at, strict=True):
            if j < 0 or key in keep:
                to_store.append(key)
                behind.append(j > gap)
        return self.store(to_store, behind) if to_store else 0


class LRUMiniTier(MiniTier):
    """:class:`MiniTier` under LRU, specialised: one ordered dict of ``key -> unreachable``.

    The same decisions as the generic tier under
    :class:`~kvoffload.policies.lru.LRUCachePolicy` (a differential test holds
    them equal), in one structure: a mini-tier's blocks are never pinned or
    pending, so no status objects are needed, and the unreachable mark is the
    entry's value, so that a hit run reads each key with one probe.
    """

    def __init__(self, capacity: int) -> None:
        self._start(capacity)
        self._order: OrderedDict[OffloadKey, bool] = OrderedDict()
        """Least recent first; the value is ``True`` while the key is unreachable."""
        self._keys = self._order

    def hit_run(self, keys: Sequence[OffloadKey], /) -> int:
        get = self._order.get
        run = 0
        for key in keys:
            if get(key, True):
                break
            run += 1
        if run:
            self.hits += run
            self.total_hits += run
        return run

    def store(
        self,
        keys: Sequence[OffloadKey],
        behind_gap: Sequence[bool] = (),
        request: Sequence[OffloadKey] = (),
    ) -> int:
        """See :meth:`MiniTier.store`; ``request``: see :meth:`_insert`."""
        order = self._order
        get = order.get
        new: dict[OffloadKey, bool] = {}
        if behind_gap:
            for key, gap in zip(keys, behind_gap, strict=True):
                dead = get(key)
                if dead is None:
                    if key not in new:
                        new[key] = gap
                elif dead and not gap:
                    order[key] = False
        else:
            for key in keys:
                dead = get(key)
                if dead is None:
                    new[key] = False
                elif dead:
                    order[key] = False
        if not new:
            return 0
        return self._insert(new, keys, request)

    def store_admitted(
        self,
        keys: Sequence[OffloadKey],
        at: Sequence[int],
        keep: Container[OffloadKey] | None,
        gap: int,
        request: Sequence[OffloadKey] = (),
    ) -> int:
        """See :meth:`MiniTier.store_admitted`; ``request``: see :meth:`_insert`."""
        if keep is None:
            return self.store(keys, request=request)
        # The generic path's filtering and :meth:`store`'s gap path in one pass.
        order = self._order
        get = order.get
        new: dict[OffloadKey, bool] = {}
        stored = []
        for key, j in zip(keys, at, strict=True):
            if j < 0 or key in keep:
                stored.append(key)
                dead = get(key)
                if dead is None:
                    if key not in new:
                        new[key] = j > gap
                elif dead and j <= gap:
                    order[key] = False
        if not new:
            return 0
        return self._insert(new, stored, request)

    def store_offer(
        self,
        offered: Sequence[OffloadKey],
        admitted: Sequence[OffloadKey] | None,
        request: Sequence[OffloadKey] = (),
    ) -> int:
        """:meth:`store_admitted` of a candidate's ``admitted`` part of ``offered`` (a
        world's offer: every key looked up, ``None`` admitting all), each key behind the
        gap :func:`admitted_set` finds; ``request``: see :meth:`_insert`."""
        keep, gap = admitted_set(offered, admitted)
        return self.store_admitted(offered, range(len(offered)), keep, gap, request)

    def _insert(
        self,
        new: dict[OffloadKey, bool],
        keys: Sequence[OffloadKey],
        request: Sequence[OffloadKey] = (),
    ) -> int:
        """Write ``new`` (not held: key -> unreachable), evicting the oldest keys outside
        ``keys``; how many were written (none if ``keys`` leave too little room).

        ``request``: the keys of the request storing ``keys``, which the caller makes
        recent after the store instead of before it (one touch, not two). They then
        leave last, as if touched first: the others are evicted first, and where too few
        others are held the request is touched here first. The order after the caller's
        touch is the order that touching, storing and touching again gives."""
        order = self._order
        need = len(new) - (self.capacity - len(order))
        if need > 0:
            if request and len(order) - len(request) >= need:
                protected = set(request)
            else:
                if request:
                    self.touch(request)
                protected = set(keys)
                # The held keys of ``keys`` cannot leave: too few others, no write.
                if len(order) - (len(protected) - len(new)) < need:
                    return 0
            # The oldest unprotected keys leave, popped from the old end; a protected key
            # met there goes back to its place.
            popitem = order.popitem
            kept = []
            while need:
                key, dead = popitem(False)
                if key in protected:
                    kept.append((key, dead))
                else:
                    need -= 1
            for key, dead in reversed(kept):
                order[key] = dead
                order.move_to_end(key, False)
        order.update(new)
        written = len(new)
        self.writes += written
        self.total_writes += written
        return written

    def touch(self, keys: Sequence[OffloadKey], /) -> None:
        order = self._order
        move_to_end = order.move_to_end
        for key in reversed(keys):
            if key in order:
                move_to_end(key)

    def in_order(self) -> list[OffloadKey]:
        """The held keys, least recent first."""
        return list(self._order)

    def unreachable(self, key: OffloadKey, /) -> bool:
        """Whether held ``key`` was written behind a gap (a prefix lookup stops at it)."""
        return bool(self._order.get(key, False))


CompiledLRUMiniTier: type[LRUMiniTier] | None = None
"""The LRU mini-tier in C (``_lru_tier.c``), where the package was built with a compiler:
the same decisions, a few times faster; ``None`` where only the pure-Python tier exists."""
if LRUTier is not None:

    class _CompiledLRUMiniTier(LRUTier, LRUMiniTier):
        """:class:`LRUMiniTier` with every operation in C; its state lives in the C object."""

        def __init__(self, capacity: int) -> None:
            """Nothing to do: the C type's constructor made the tier."""

    CompiledLRUMiniTier = _CompiledLRUMiniTier


class S3FIFOMiniTier(MiniTier):
    """:class:`MiniTier` under S3-FIFO, specialised: the policy's queues of keys alone.

    The same decisions as the generic tier under
    :class:`~kvoffload.policies.s3fifo.S3FIFOCachePolicy` (a differential test
    holds them equal): a mini-tier's blocks are never pinned and pending (with
    ``pending``) only from a store to the touch after it, so the policy's checks
    of a block's state come down to skipping the last store's keys in that touch,
    and no status objects are kept; the held keys are the keys of the touch counts.
    """

    def __init__(self, capacity: int, pending: bool = True) -> None:
        self._start(capacity, pending)
        self.small_target = s3fifo_small_target(capacity)
        self._small: OrderedDict[OffloadKey, None] = OrderedDict()
        self._main: OrderedDict[OffloadKey, None] = OrderedDict()
        self._ghost: OrderedDict[OffloadKey, None] = OrderedDict()
        self._freq: dict[OffloadKey, int] = {}
        """Held keys and their touch counts."""
        self._keys = self._freq
        self._fresh: Collection[OffloadKey] = ()
        """The last store's keys, pending until the touch after it (not counted there)."""

    def store(self, keys: Sequence[OffloadKey], behind_gap: Sequence[bool] = ()) -> int:
        self._fresh = ()
        held, dead = self._freq, self._dead
        new: dict[OffloadKey, bool] = {}
        if behind_gap:
            for key, gap in zip(keys, behind_gap, strict=True):
                if key in held:
                    if not gap and key in dead:
                        dead.discard(key)
                elif key not in new:
                    new[key] = gap
        else:
            for key in keys:
                if key in held:
                    if key in dead:
                        dead.discard(key)
                else:
                    new[key] = False
        if not new:
            return 0
        need = len(new) - (self.capacity - len(held))
        if need > 0:
            protected = set(keys)
            # The distinct held keys of ``keys`` cannot leave: too few others, no write.
            if len(held) - (len(protected) - len(new)) < need:
                return 0
            self._evict(need, protected)
        small, main, ghost = self._small, self._main, self._ghost
        for key, gap in new.items():
            if key in ghost:
                del ghost[key]
                main[key] = None
            else:
                small[key] = None
            held[key] = 0
            if gap:
                dead.add(key)
        if self.pending:
            self._fresh = new
        written = len(new)
        self.writes += written
        self.total_writes += written
        return written

    def _evict(self, n: int, protected: set[OffloadKey]) -> None:
        """The policy's eviction of ``n`` keys outside ``protected`` (at least ``n`` exist)."""
        small, main, small_target, dead = self._small, self._main, self.small_target, self._dead
        while n:
            if len(small) >= small_target or not main:
                victim = self._from_small(protected)
                if victim is not None:
                    dead.discard(victim)
                    n -= 1
                    continue
            victim = self._from_main(protected)
            if victim is None:
                victim = self._from_small(protected)
            if victim is not None:
                dead.discard(victim)
                n -= 1
        ghost = self._ghost
        for _ in range(len(ghost) - self.capacity):
            ghost.popitem(False)

    def _from_small(self, protected: set[OffloadKey]) -> OffloadKey | None:
        small, main, freq = self._small, self._main, self._freq
        for _ in range(len(small)):
            key = small.popitem(False)[0]
            if key in protected:
                small[key] = None
            elif freq[key] > 0:
                freq[key] = 0
                main[key] = None
            else:
                del freq[key]
                self._ghost[key] = None
                return key
        return None

    def _from_main(self, protected: set[OffloadKey]) -> OffloadKey | None:
        main, freq = self._main, self._freq
        for _ in range((S3FIFO_MAX_FREQ + 1) * len(main)):
            key = main.popitem(False)[0]
            if key in protected:
                main[key] = None
            elif freq[key] > 0:
                freq[key] -= 1
                main[key] = None
            else:
                del freq[key]
                return key
        return None

    def touch(self, keys: Sequence[OffloadKey], /) -> None:
        freq, fresh = self._freq, self._fresh
        get = freq.get
        for key in keys:
            count = get(key)
            if count is not None and count < S3FIFO_MAX_FREQ and key not in fresh:
                freq[key] = count + 1
        self._fresh = ()


CompiledS3FIFOMiniTier: type[S3FIFOMiniTier] | None = None
"""The S3-FIFO mini-tier in C (``_s3fifo_tier.c``), where the package was built with a
compiler; ``None`` where only the pure-Python tier exists."""
if S3FIFOTier is not None:

    class _CompiledS3FIFOMiniTier(S3FIFOTier, S3FIFOMiniTier):
        """:class:`S3FIFOMiniTier` with every operation in C; its state lives in the C object."""

        def __new__(cls, capacity: int, pending: bool = True) -> _CompiledS3FIFOMiniTier:
            small_target = s3fifo_small_target(capacity)
            return super().__new__(cls, capacity, pending, small_target, S3FIFO_MAX_FREQ)

        def __init__(self, capacity: int, pending: bool = True) -> None:
            """Nothing to do: the C type's constructor made the tier."""

    CompiledS3FIFOMiniTier = _CompiledS3FIFOMiniTier


CompiledARCMiniTier: Callable[[int, bool], MiniTier] | None = None
"""The generic tier over :class:`~kvoffload.policies.arc.ARCCachePolicy` in C
(``_arc_tier.c``), where the package was built with a compiler; ``None`` where not."""
if ARCTier is not None:

    class _CompiledARCMiniTier(ARCTier, MiniTier):
        """:class:`MiniTier` under ARC with every operation in C; its state lives in the C
        object (no policy object, no status objects)."""

        def __init__(self, capacity: int, pending: bool = True) -> None:
            """Nothing to do: the C type's constructor made the tier."""

    CompiledARCMiniTier = _CompiledARCMiniTier

CompiledSIEVEMiniTier: Callable[[int, bool], MiniTier] | None = None
"""The generic tier over :class:`~kvoffload.policies.sieve.SIEVECachePolicy` in C
(``_sieve_tier.c``), where the package was built with a compiler; ``None`` where not."""
if SIEVETier is not None:

    class _CompiledSIEVEMiniTier(SIEVETier, MiniTier):
        """:class:`MiniTier` under SIEVE with every operation in C; its state lives in the C
        object (no policy object, no status objects)."""

        def __init__(self, capacity: int, pending: bool = True) -> None:
            """Nothing to do: the C type's constructor made the tier."""

    CompiledSIEVEMiniTier = _CompiledSIEVEMiniTier

CompiledSLRUMiniTier: Callable[[int, bool], MiniTier] | None = None
"""The generic tier over :class:`~kvoffload.policies.slru.SLRUCachePolicy` in C
(``_slru_tier.c``), where the package was built with a compiler; ``None`` where not."""
if SLRUTier is not None:

    class _CompiledSLRUMiniTier(SLRUTier, MiniTier):
        """:class:`MiniTier` under SLRU with every operation in C; its state lives in the C
        object (no policy object, no status objects)."""

        def __new__(cls, capacity: int, pending: bool = True) -> _CompiledSLRUMiniTier:
            return super().__new__(cls, capacity, pending, slru_protected_limit(capacity))

        def __init__(self, capacity: int, pending: bool = True) -> None:
            """Nothing to do: the C type's constructor made the tier."""

    CompiledSLRUMiniTier = _CompiledSLRUMiniTier


def mini_tier(
    capacity: int, policy: type[CachePolicy], generic: bool = False, pending: bool = True
) -> MiniTier:
    """A mini-tier under ``policy``: a specialised one (LRU, S3-FIFO; compiled where the
    package was built, and then also ARC, SIEVE and SLRU), unless ``generic``; ``pending``:
    see :class:`MiniTier`."""
    if generic:
        return MiniTier(capacity, policy, pending)
    if policy is LRUCachePolicy:
        return (CompiledLRUMiniTier or LRUMiniTier)(capacity)
    if policy is S3FIFOCachePolicy:
        return (CompiledS3FIFOMiniTier or S3FIFOMiniTier)(capacity, pending)
    if policy is ARCCachePolicy and CompiledARCMiniTier is not None:
        return CompiledARCMiniTier(capacity, pending)
    if policy is SIEVECachePolicy and CompiledSIEVEMiniTier is not None:
        return CompiledSIEVEMiniTier(capacity, pending)
    if policy is SLRUCachePolicy and CompiledSLRUMiniTier is not None:
        return CompiledSLRUMiniTier(capacity, pending)
    return MiniTier(capacity, policy, pending)


@dataclass(frozen=True)
class WhatIf:
    """One candidate at one capacity, as its mini-tier sees the recent traffic."""

    candidate: str
    capacity_factor: float
    hit_ratio: float | None
    """Total (GPU and tier) hits per block reference; ``None`` while unknown: until a key
    that reached the tier was sampled."""
    writes_per_ref: float | None
    """Writes per block reference; ``None`` while unknown, as :attr:`hit_ratio`."""
    capacity: int
    """The mini-tier's keys."""
    sampling_rate: float


@dataclass
class _Level:
    """Counters of one sampling rate: keys looked up past the GPU hit (``bits`` 0: all of
    them, and all references), halved with the window, and since the start."""

    bits: int
    refs: float = 0.0
    lookups: float = 0.0
    total_refs: int = 0
    total_lookups: int = 0


class _Open:
    """A request between its lookup and its store: its sampled keys per level.

    :attr:`requested`, :attr:`suffix`, :attr:`suffix_at` and :attr:`runs` end at the first
    level without a key (an empty list): the levels nest, so no deeper level has one."""

    __slots__ = ("length", "positions", "requested", "runs", "suffix", "suffix_at")

    def __init__(
        self, requested: list[list[OffloadKey]], positions: list[list[int]], length: int
    ) -> None:
        self.requested = requested
        self.positions = positions
        """Per level, the sampled keys' positions in the request."""
        self.length = length
        self.suffix: list[list[OffloadKey]] = []
        self.suffix_at: list[list[int]] = []
        """Per level, each sampled suffix key's position in the request (the tail of
        :attr:`positions` past the GPU hit)."""
        self.runs: list[list[int]] = []
        """Per level, each mini-tier's hit run in the sampled suffix: its store starts past it."""


class MiniSimulation:
    """One mini-tier per (candidate, capacity factor), fed the same sampled keys.

    ``factors`` are capacities relative to the tier's; the 1x tier of each
    candidate, which a lower tier's choice uses, is sampled at the base rate
    ``2**-bits``, the others at a sparser rate (see :meth:`_bits_of`). Without 1x
    among them (a mirroring tier, whose exact worlds give the 1x figures) there are
    no decision tiers and no :meth:`scores`.
    """

    def __init__(
        self,
        capacity: int,
        policy: type[CachePolicy],
        candidates: Sequence[str],
        factors: Sequence[float] = (1.0,),
        window_tiers: float = WINDOW_TIERS,
        bits: int | None = None,
        generic: bool = False,
    ) -> None:
        if capacity < 1:
            raise InvalidArgumentError(f"mini-simulation capacity must be >= 1, got {capacity}")
        if not factors or not all(is_finite(f) and f > 0 for f in factors):
            raise InvalidArgumentError(
                f"capacity factors must be finite numbers > 0, got {factors}"
            )
        if bits is not None and (type(bits) is not int or not 0 <= bits <= 64):
            raise InvalidArgumentError(f"sampling bits must be an int from 0 to 64, got {bits!r}")
        self.bits = sampling_bits(capacity) if bits is None else bits
        self.candidates = list(candidates)
        self.factors = sorted(factors)
        self.decides = 1.0 in self.factors
        """Whether it runs the 1x tiers that :meth:`scores` ranks."""
        factor_bits = {f: self._bits_of(capacity, f) for f in self.factors}
        level_bits = sorted(set(factor_bits.values()))
        self._levels = [_Level(b) for b in level_bits]
        self._exact = _Level(0)
        self._masks = [(1 << b) - 1 for b in level_bits]
        self._mask_tuple = tuple(self._masks)
        self._low = np.uint64(self._masks[-1])
        self.tiers: dict[tuple[str, float], tuple[MiniTier, int]] = {}
        """``(candidate, factor) -> (mini-tier, level index)``."""
        for factor in self.factors:
            level = level_bits.index(factor_bits[factor])
            keys = max(1, round(capacity * factor / (1 << level_bits[level])))
            for name in self.candidates:
                self.tiers[name, factor] = (mini_tier(keys, policy, generic), level)
        self._by_level = self._group_by_level()
        self._tiers_of = [[tier for _, tier in tiers] for tiers in self._by_level]
        """Per level, its mini-tiers alone."""
        base_keys = max(1, round(capacity / (1 << level_bits[0])))
        """A 1x tier's keys at the densest rate: the window's unit."""
        if not window_tiers > 0:
            raise InvalidArgumentError(f"window_tiers must be > 0, got {window_tiers}")
        self.window = window_tiers * base_keys
        """Sampled references between two halvings of the windowed counters."""
        self._since_halving = 0.0
        self.seen = 0
        """Sampled references at the densest rate since the start (never halved)."""
        self._open: OrderedDict[OffloadKey, _Open] = OrderedDict()
        self._admit_all: dict[str, tuple[Collection[OffloadKey] | None, int]] = {
            name: (None, 0) for name in self.candidates
        }
        self._marks: dict[str, int] = {}
        """Each 1x tier's hits since the start at :meth:`mark`."""

    def _bits_of(self, capacity: int, factor: float) -> int:
        """The 1x tiers at the base rate; the others, which only feed what-if figures, at the
        rate that leaves them :data:`MIN_WHATIF_KEYS` (never denser than the base rate)."""
        if factor == 1.0:
            return self.bits
        return max(self.bits, sampling_bits(int(capacity * factor), MIN_WHATIF_KEYS))

    def _group_by_level(self) -> list[list[tuple[str, MiniTier]]]:
        return [
            [(name, tier) for (name, _), (tier, lvl) in self.tiers.items() if lvl == index]
            for index in range(len(self._levels))
        ]

    @property
    def sampling_rate(self) -> float:
        return 1.0 / (1 << self.bits)

    @property
    def refs(self) -> float:
        """Sampled references at the densest rate (halved with the other counters)."""
        return self._levels[0].refs

    def _scale(self, level: _Level, cumulative: bool) -> tuple[float, float, float]:
        """``(GPU hits per reference, tier references per reference, sampled lookups)``.

        The GPU's share and the share of references that reach the tier are
        counted on every key; only what happens in the tier is sampled. Heavy
        hitters (a system prompt in every request) then bias no estimate by
        being sampled or not, as long as the GPU holds them.
        """
        exact = self._exact
        refs = float(exact.total_refs if cumulative else exact.refs)
        lookups = float(exact.total_lookups if cumulative else exact.lookups)
        sampled = float(level.total_lookups if cumulative else level.lookups)
        if not refs:
            return 0.0, 0.0, 0.0
        reach = min(1.0, lookups / refs)
        return 1.0 - reach, reach, sampled

    @property
    def memory_bytes(self) -> int:
        return sum(tier.memory_bytes for tier, _ in self.tiers.values())

    @property
    def tracked_keys(self) -> int:
        return sum(tier.capacity for tier, _ in self.tiers.values())

    def _sample(self, hashes: np.ndarray) -> list[list[int]]:
        """Positions of the sampled keys, per level: each level's are a subset of the one
        before (its mask has more bits), so each is filtered from the one before."""
        if sampled_positions is not None:
            return sampled_positions(hashes, self._mask_tuple)
        masks = self._masks
        if masks[-1]:
            low = (hashes & self._low).tolist()
            mask = masks[0]
            picked = [i for i, v in enumerate(low) if not v & mask] if mask else [*range(len(low))]
            positions = [picked]
            for mask in masks[1:]:
                if picked:
                    picked = [i for i in picked if not low[i] & mask]
                positions.append(picked)
            return positions
        return [[*range(len(hashes))] for _ in masks]

    def on_request(self, keys: Sequence[OffloadKey], hashes: np.ndarray) -> None:
        """A request's keys (GPU-held ones included), once per request: count and touch."""
        exact = self._exact
        n = len(keys)
        exact.refs += n
        exact.total_refs += n
        positions = self._sample(hashes)
        requested: list[list[OffloadKey]] = []
        # The per-request loops zip lists built in lockstep (one item per level, or per
        # sampled key) without ``strict=True``: its keyword is parsed on every call, about
        # 2,000 instructions, and these loops make six zips a request.
        for level, picked, tiers in zip(self._levels, positions, self._tiers_of):  # noqa: B905
            if not picked:  # many requests have no key at the sparser rates
                requested.append([])
                break  # the levels nest: none deeper either (zips over levels stop here)
            sampled = [keys[i] for i in picked]
            requested.append(sampled)
            level.refs += len(sampled)
            level.total_refs += len(sampled)
            for tier in tiers:
                tier.touch(sampled)
        opened = self._open
        last = keys[-1]
        opened[last] = _Open(requested, positions, n)
        opened.move_to_end(last)
        if len(opened) > OPEN_REQUESTS:
            opened.popitem(False)
        base = len(requested[0])
        if base:
            self.seen += base
            self._since_halving += base
            if self._since_halving >= self.window:
                self._halve()

    def on_lookup(self, keys: Sequence[OffloadKey], looked_up: bool = True) -> None:
        """The keys past the GPU hit (a suffix of the request) were looked up: score each
        mini-tier's leading run (none where the tier was not asked: not ``looked_up``)."""
        if not keys:
            return
        entry = self._open.get(keys[-1])
        if entry is None or entry.suffix:
            return  # unknown (nothing to score it against), or the same request again
        length = entry.length
        start = length - len(keys)
        if start < 0:
            return
        self._exact.lookups += len(keys)
        self._exact.total_lookups += len(keys)
        suffix, suffix_at, runs = entry.suffix, entry.suffix_at, entry.runs
        lockstep = zip(entry.positions, self._levels, self._tiers_of)  # noqa: B905 - on_request
        for picked, level, tiers in lockstep:
            cut = bisect_left(picked, start) if start else 0
            if cut == len(picked):
                suffix.append([])
                suffix_at.append([])
                runs.append([])
                break  # the levels nest: no deeper level has a key past ``start`` either
            inside = picked[cut:] if cut else picked
            sampled = [keys[i - start] for i in inside]
            suffix.append(sampled)
            suffix_at.append(inside)
            level.lookups += len(sampled)
            level.total_lookups += len(sampled)
            runs.append(
                [tier.hit_run(sampled) for tier in tiers] if looked_up else [0] * len(tiers)
            )

    def on_written_back(
        self,
        offered: Sequence[OffloadKey],
        hashes: np.ndarray,
        admitted: Mapping[str, Sequence[OffloadKey] | None],
    ) -> None:
        """An offer that is not a looked-up request's missed blocks (a lower tier's: what
        the tier above lets go, whenever it does): each candidate's mini-tiers write the
        sampled keys of it that the candidate admitted (``None``: all), as separate blocks.
        ``hashes``: the offered keys'. Its lookups were scored when they came
        (:meth:`on_lookup`, then :meth:`forget`)."""
        positions = self._sample(hashes)
        if not positions[0]:
            return  # no key sampled at the densest rate, hence at none
        kept = {name: None if a is None else set(a) for name, a in admitted.items()}
        for picked, tiers in zip(positions, self._by_level, strict=True):
            if not picked:
                break  # the levels nest: none deeper either
            sampled = [offered[i] for i in picked]
            for name, tier in tiers:
                keep = kept[name]
                tier.store(sampled if keep is None else [k for k in sampled if k in keep])

    def forget(self, last: OffloadKey) -> None:
        """Drop the open request ending at ``last`` unstored: its lookup is scored, and what
        its tier stores comes later, as offers of their own (:meth:`on_written_back`)."""
        self._open.pop(last, None)

    def on_offer_ruled(self, offered: Sequence[OffloadKey], worlds: Mapping[str, Kept]) -> None:
        """Each candidate's kept part of ``offered`` (and the first key it leaves out), asked
        of its exact world (``worlds``), which has run the request
        (:mod:`~kvoffload.admission.worlds`), only for a request with a sampled key: each
        mini-tier runs the candidate's own decisions at its capacity."""
        entry = self._take(offered)
        if entry is not None:
            self._store(
                entry, offered, {name: world.kept_of(offered) for name, world in worlds.items()}
            )

    def on_full_hit(self, last: OffloadKey) -> None:
        """The tier served every key the request looked up, so no offer follows: each
        mini-tier writes the sampled keys it lacks (every candidate admits a stored key)."""
        entry = self._take((last,))
        if entry is not None:
            self._store(entry, (), self._admit_all)

    def _take(self, keys: Sequence[OffloadKey]) -> _Open | None:
        """Forget the open request ending at ``keys``' last key; it, if it has a sampled
        lookup key to store (at the densest rate, hence at every level: levels nest)."""
        entry = self._open.pop(keys[-1], None) if keys else None
        return entry if entry is not None and entry.suffix and entry.suffix[0] else None

    def _store(
        self,
        entry: _Open,
        offered: Sequence[OffloadKey],
        chosen: Mapping[str, tuple[Container[OffloadKey] | None, int]],
    ) -> None:
        """Store ``entry``'s sampled lookup keys per candidate: ``chosen`` gives each its
        admitted keys (``None``: every offered key) and the offer index of its first key
        left out (at least one sampled key at the densest rate, hence at every level).

        Each mini-tier stores past its own hit run, as a tier's offer starts past its hit:
        the blocks it just served are loaded and may leave to make room, where shielding
        them would refuse a store the full-size tier makes."""
        # A sampled key at request position i is offer index i - shift, if it is offered.
        shift = entry.length - len(offered)
        everything = True
        for keep, _ in chosen.values():
            if keep is not None:
                everything = False
                break
        for sampled, positions, requested, runs, tiers in zip(  # noqa: B905 - see on_request
            entry.suffix, entry.suffix_at, entry.requested, entry.runs, self._by_level
        ):
            if not sampled:
                break
            if everything:
                for run, (_, tier) in zip(runs, tiers):  # noqa: B905 - see on_request
                    if tier.store(sampled[run:] if run else sampled):
                        tier.touch(requested)
                continue
            at = [
                i - shift if i >= shift and offered[i - shift] == key else -1
                for key, i in zip(sampled, positions)  # noqa: B905 - see on_request
            ]
            for run, (name, tier) in zip(runs, tiers):  # noqa: B905 - see on_request
                keep, gap = chosen[name]
                tail, tail_at = (sampled[run:], at[run:]) if run else (sampled, at)
                if keep is not None and not keep:
                    # Nothing admitted: only the keys the tier served are stored, none behind
                    # a gap (a store without gaps).
                    served = zip(tail, tail_at)  # noqa: B905 - see on_request
                    to_store = [key for key, j in served if j < 0]
                    written = tier.store(to_store) if to_store else 0
                else:
                    written = tier.store_admitted(tail, tail_at, keep, gap)
                if written:
                    tier.touch(requested)

    def figures(self, cumulative: bool = False) -> list[WhatIf]:
        """Every mini-tier's hit ratio and writes per reference over the recent window
        (``cumulative``: since the start); ``None`` where no sampled key has reached the
        tier yet (a 0.0 read as "this rule writes nothing")."""
        result = []
        for (name, factor), (tier, index) in self.tiers.items():
            level = self._levels[index]
            gpu, reach, sampled = self._scale(level, cumulative)
            hits = float(tier.total_hits if cumulative else tier.hits)
            writes = float(tier.total_writes if cumulative else tier.writes)
            result.append(
                WhatIf(
                    candidate=name,
                    capacity_factor=factor,
                    hit_ratio=gpu + reach * hits / sampled if sampled else None,
                    writes_per_ref=reach * writes / sampled if sampled else None,
                    capacity=tier.capacity,
                    sampling_rate=1.0 / (1 << level.bits),
                )
            )
        return result

    def scores(self) -> dict[str, tuple[float, float]]:
        """``candidate -> (tier hits, writes)`` per block reference, at 1x capacity."""
        if not self.decides:
            raise InvalidArgumentError("this mini-simulation runs no 1x tiers to score")
        _, reach, sampled = self._scale(self._levels[0], cumulative=False)
        scale = reach / sampled if sampled else 0.0
        return {
            name: (
                self.tiers[name, 1.0][0].hits * scale,
                self.tiers[name, 1.0][0].writes * scale,
            )
            for name in self.candidates
        }

    def mark(self) -> None:
        """Start counting the 1x tiers' hits since now (a lower tier's last switch)."""
        self._marks = {name: self.tiers[name, 1.0][0].total_hits for name in self.candidates}

    def hits_since_mark(self, name: str) -> int:
        """Sampled hits of ``name``'s 1x tier since :meth:`mark` (since the start before it),
        counted in full: a switch's trial spans less than a window."""
        return self.tiers[name, 1.0][0].total_hits - self._marks.get(name, 0)

    def _halve(self, factor: float = 0.5) -> None:
        for level in (*self._levels, self._exact):
            level.refs *= factor
            level.lookups *= factor
        for tier, _ in self.tiers.values():
            tier.hits *= factor
            tier.writes *= factor
        self._since_halving = 0.0

    def restart_window(self) -> None:
        """Forget the windowed counters (the mini-tiers keep their contents): the end of a
        cold start, whose empty tiers say little about the rules."""
        self._halve(0.0)


class Kept(Protocol):
    """What a candidate's tier keeps of an offer: an exact world
    (:class:`~kvoffload.admission.worlds.World`, which imports this module)."""

    def kept_of(
        self, offered: Sequence[OffloadKey]
    ) -> tuple[Container[OffloadKey] | None, int]: ...


def admitted_set(
    offered: Sequence[OffloadKey], admitted: Sequence[OffloadKey] | None
) -> tuple[set[OffloadKey] | None, int]:
    """The admitted keys (``None``: all of the offer) and the offer index of the first key
    left out (the offer's length if none is)."""
    if admitted is None or len(admitted) == len(offered):
        return None, len(offered)
    gap = len(admitted)
    for index, (key, kept) in enumerate(zip(offered, admitted, strict=False)):
        if key != kept:
            gap = index
            break
    return set(admitted), gap
