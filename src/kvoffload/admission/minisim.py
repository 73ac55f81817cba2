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

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import OffloadKey
from kvoffload.policies.base import BlockStatus, CachePolicy

MIN_MINI_KEYS = 1024
"""The sampling rate is the highest power-of-two fraction that leaves a 1x mini-tier at
least this many keys (every key for smaller tiers)."""
MAX_BITS = 8
"""The lowest rate is 1 in 256."""
MIN_WHATIF_KEYS = 256
"""Mini-tiers kept only for the what-if figures (other capacities) hold at least this many
keys: a quarter of the decision tiers' minimum, so that they cost less than those."""
BYTES_PER_MINI_KEY = 400
"""Approximate CPython cost of one mini-tier key: the held dict's entry, the policy's
ordered-dict entry and the status object."""
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
    """A tier of ``capacity`` keys with no data, no slots and no pending stores."""

    def __init__(self, capacity: int, policy: type[CachePolicy]) -> None:
        if capacity < 1:
            raise InvalidArgumentError(f"mini-tier capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.policy = policy(capacity)
        self._held: dict[OffloadKey, BlockStatus] = {}
        self._free: list[BlockStatus] = []
        self._dead: set[OffloadKey] = set()
        self.hits = 0.0
        self.writes = 0.0
        """Hits and writes, halved with the simulation's window."""
        self.total_hits = 0
        self.total_writes = 0

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def hit_run(self, keys: Sequence[OffloadKey]) -> int:
        """How many leading ``keys`` are held and reachable."""
        held, dead = self._held, self._dead
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
        for status in statuses:
            status.ref_cnt = 0
        held.update(zip(new, statuses, strict=True))
        dead.update(new_dead)
        self.policy.insert(new, statuses)
        self.writes += len(new)
        self.total_writes += len(new)
        return len(new)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self.policy.touch(keys)


@dataclass(frozen=True)
class WhatIf:
    """One candidate at one capacity, as its mini-tier sees the recent traffic."""

    candidate: str
    capacity_factor: float
    hit_ratio: float
    """Total (GPU and tier) hits per block reference."""
    writes_per_ref: float
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
    """A request between its lookup and its store: its sampled keys per level."""

    __slots__ = ("length", "positions", "requested", "suffix", "suffix_start")

    def __init__(
        self, requested: list[list[OffloadKey]], positions: list[list[int]], length: int
    ) -> None:
        self.requested = requested
        self.positions = positions
        """Per level, the sampled keys' positions in the request."""
        self.length = length
        self.suffix: list[list[OffloadKey]] = []
        self.suffix_start: list[list[int]] = []
        """Per level, each sampled suffix key's position from the end of the request."""


class MiniSimulation:
    """One mini-tier per (candidate, capacity factor), fed the same sampled keys.

    ``factors`` are capacities relative to the tier's; the 1x tier of each
    candidate, which the choice uses, is sampled at the base rate ``2**-bits``,
    the others at a sparser rate (see :meth:`_bits_of`).
    """

    def __init__(
        self,
        capacity: int,
        policy: type[CachePolicy],
        candidates: Sequence[str],
        factors: Sequence[float] = (1.0,),
        window_tiers: float = WINDOW_TIERS,
        bits: int | None = None,
    ) -> None:
        if capacity < 1:
            raise InvalidArgumentError(f"mini-simulation capacity must be >= 1, got {capacity}")
        if 1.0 not in factors or any(f <= 0 for f in factors):
            raise InvalidArgumentError(f"capacity factors must be > 0 and include 1, got {factors}")
        self.bits = sampling_bits(capacity) if bits is None else bits
        self.candidates = list(candidates)
        self.factors = sorted(factors)
        factor_bits = {f: self._bits_of(capacity, f) for f in self.factors}
        level_bits = sorted(set(factor_bits.values()))
        self._levels = [_Level(b) for b in level_bits]
        self._exact = _Level(0)
        self._masks = [np.uint64((1 << b) - 1) for b in level_bits]
        self.tiers: dict[tuple[str, float], tuple[MiniTier, int]] = {}
        """``(candidate, factor) -> (mini-tier, level index)``."""
        for factor in self.factors:
            level = level_bits.index(factor_bits[factor])
            keys = max(1, round(capacity * factor / (1 << level_bits[level])))
            for name in self.candidates:
                self.tiers[name, factor] = (MiniTier(keys, policy), level)
        self._by_level = self._group_by_level()
        base_keys = self.tiers[self.candidates[0], 1.0][0].capacity
        if not window_tiers > 0:
            raise InvalidArgumentError(f"window_tiers must be > 0, got {window_tiers}")
        self.window = window_tiers * base_keys
        """Sampled references between two halvings of the windowed counters."""
        self._since_halving = 0.0
        self.seen = 0
        """Sampled references at the base rate since the start (never halved)."""
        self._open: OrderedDict[OffloadKey, _Open] = OrderedDict()

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
        """Sampled references at the base rate (halved with the other counters)."""
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
        return BYTES_PER_MINI_KEY * sum(tier.capacity for tier, _ in self.tiers.values())

    @property
    def tracked_keys(self) -> int:
        return sum(tier.capacity for tier, _ in self.tiers.values())

    def _sample(self, keys: Sequence[OffloadKey], hashes: np.ndarray) -> list[list[int]]:
        """Positions of the sampled keys, per level."""
        positions: list[list[int]] = []
        picked = np.arange(len(keys))
        for mask in self._masks:
            picked = picked[(hashes[picked] & mask) == 0]
            positions.append(picked.tolist())
        return positions

    def on_request(self, keys: Sequence[OffloadKey], hashes: np.ndarray) -> None:
        """A request's keys (GPU-held ones included), once per request: count and touch."""
        exact = self._exact
        exact.refs += len(keys)
        exact.total_refs += len(keys)
        positions = self._sample(keys, hashes)
        requested = [[keys[i] for i in level] for level in positions]
        for level, sampled in zip(self._levels, requested, strict=True):
            level.refs += len(sampled)
            level.total_refs += len(sampled)
        for index, sampled in enumerate(requested):
            if sampled:
                for _, tier in self._by_level[index]:
                    tier.touch(sampled)
        self._open[keys[-1]] = _Open(requested, positions, len(keys))
        self._open.move_to_end(keys[-1])
        if len(self._open) > OPEN_REQUESTS:
            self._open.popitem(False)
        self.seen += len(requested[0])
        self._since_halving += len(requested[0])
        if self._since_halving >= self.window:
            self._halve()

    def on_lookup(self, keys: Sequence[OffloadKey]) -> None:
        """The keys past the GPU hit (a suffix of the request) were looked up: score each
        mini-tier's leading run."""
        if not keys:
            return
        entry = self._open.get(keys[-1])
        if entry is not None and entry.suffix:
            return  # the same request looked up again
        start = -1 if entry is None else entry.length - len(keys)
        if entry is None or start < 0:
            return  # not a suffix of a request seen: nothing to score it against
        self._exact.lookups += len(keys)
        self._exact.total_lookups += len(keys)
        for index, level in enumerate(entry.positions):
            sampled = [keys[i - start] for i in level if i >= start]
            entry.suffix.append(sampled)
            entry.suffix_start.append([entry.length - i for i in level if i >= start])
            self._levels[index].lookups += len(sampled)
            self._levels[index].total_lookups += len(sampled)
            if sampled:
                for _, tier in self._by_level[index]:
                    tier.hit_run(sampled)

    def on_offer(
        self, offered: Sequence[OffloadKey], admitted: Mapping[str, Sequence[OffloadKey] | None]
    ) -> None:
        """Each candidate's admitted part of ``offered`` (``None``: everything) into its tiers.

        A sampled lookup key that was not offered (the real tier served it) is
        written wherever the mini-tier lacks it: every candidate admits a key
        that was stored before.
        """
        entry = self._open.pop(offered[-1], None) if offered else None
        if entry is not None and entry.suffix:
            self._store(entry, offered, admitted)

    def on_full_hit(self, last: OffloadKey) -> None:
        """The tier served every key the request looked up, so no offer follows: each
        mini-tier writes the sampled keys it lacks (every candidate admits a stored key)."""
        entry = self._open.pop(last, None)
        if entry is not None and entry.suffix:
            self._store(entry, (), {name: None for name in self.candidates})

    def _store(
        self,
        entry: _Open,
        offered: Sequence[OffloadKey],
        admitted: Mapping[str, Sequence[OffloadKey] | None],
    ) -> None:
        n = len(offered)
        chosen = {name: _admitted_set(offered, keys) for name, keys in admitted.items()}
        for index, (sampled, from_end) in enumerate(
            zip(entry.suffix, entry.suffix_start, strict=True)
        ):
            if not sampled:
                continue
            at = [
                n - end if end <= n and offered[n - end] == key else -1
                for key, end in zip(sampled, from_end, strict=True)
            ]
            requested = entry.requested[index]
            for name, tier in self._by_level[index]:
                keep, gap = chosen[name]
                if keep is None:
                    written = tier.store(sampled)
                else:
                    kept = [j < 0 or key in keep for key, j in zip(sampled, at, strict=True)]
                    to_store = [key for key, ok in zip(sampled, kept, strict=True) if ok]
                    behind = [j > gap for j, ok in zip(at, kept, strict=True) if ok]
                    written = tier.store(to_store, behind) if to_store else 0
                if written:
                    tier.touch(requested)

    def figures(self, cumulative: bool = False) -> list[WhatIf]:
        """Every mini-tier's hit ratio and writes per reference over the recent window
        (``cumulative``: since the start)."""
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
                    hit_ratio=gpu + reach * hits / sampled if sampled else gpu,
                    writes_per_ref=reach * writes / sampled if sampled else 0.0,
                    capacity=tier.capacity,
                    sampling_rate=1.0 / (1 << level.bits),
                )
            )
        return result

    def scores(self) -> dict[str, tuple[float, float]]:
        """``candidate -> (tier hits, writes)`` per block reference, at 1x capacity."""
        _, reach, sampled = self._scale(self._levels[0], cumulative=False)
        scale = reach / sampled if sampled else 0.0
        return {
            name: (
                self.tiers[name, 1.0][0].hits * scale,
                self.tiers[name, 1.0][0].writes * scale,
            )
            for name in self.candidates
        }

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


def _admitted_set(
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
