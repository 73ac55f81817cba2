"""Exact worlds: each candidate rule on a key-only tier of the real tier's size and policy.

A world is fed every request (its keys, GPU-held ones first, and how many the
GPU held) and answers its rule's lookups from its own tier, so it holds, hits
and writes exactly what the real tier would have, had it followed that rule
from the start. For store-everything and the seed filter that is the baseline
itself, whatever the real tier did; the optimiser follows the best world and
makes the real tier mirror it (``admission/optimiser.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kvoffload.admission.base import AdmissionLayer
from kvoffload.admission.minisim import BYTES_PER_MINI_KEY, MiniTier, admitted_set, mini_tier
from kvoffload.admission.reuse_filter import FilterReusedOffloadingManager
from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import OffloadingManager, PrepareStoreOutput
from kvoffload.core.specs import CPULoadStoreSpec, LoadStoreSpec
from kvoffload.policies.base import CachePolicy


class Probe(OffloadingManager):
    """The bottom of a candidate rule's stack: answers lookups with the hit run set in
    :attr:`found` (a world's own, or what the real tier answered) and stores nothing (the
    caller asks the rule's ``admit`` for its decision)."""

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
    after a write.
    """

    def __init__(
        self,
        capacity: int,
        policy: type[CachePolicy],
        rule: AdmissionLayer | FilterReusedOffloadingManager | None = None,
        probe: Probe | None = None,
    ) -> None:
        if (rule is None) != (probe is None):
            raise ValueError("a world's rule and its probe go together")
        self.tier: MiniTier = mini_tier(capacity, policy)
        self.held = self.tier.held
        """The tier's held keys: what a tier mirroring this world may keep."""
        self.rule = rule
        self.probe = probe
        self.hits = 0.0
        self.writes = 0.0
        """Hits and writes, halved with the worlds' window."""
        self.hits_at_mark = 0.0
        """:attr:`hits` when :meth:`Worlds.mark` was last called, halved with them."""

    def __contains__(self, key: object) -> bool:
        return key in self.tier

    def request(self, keys: Sequence[OffloadKey], gpu_held: int) -> None:
        tier, rule = self.tier, self.rule
        tier.touch(keys)
        if isinstance(rule, AdmissionLayer):
            rule.begin_request(keys, lookup_follows=True)
        looked = keys[gpu_held:] if gpu_held else keys
        if not looked:
            return
        found = tier.hit_run(looked)
        self.hits += found
        if rule is not None and self.probe is not None:
            self.probe.found = found
            rule.lookup(looked if isinstance(looked, list) else list(looked))
        offered = looked[found:]
        if not offered:
            return
        offered = list(dict.fromkeys(offered))
        if rule is None:
            written = tier.store(offered)
        else:
            keep, gap = admitted_set(offered, rule.admit(offered))
            written = tier.store_admitted(offered, range(len(offered)), keep, gap)
        if written:
            self.writes += written
            tier.touch(keys)


class Worlds:
    """The candidates' worlds, fed the same requests; windowed hits and writes per
    reference (halved every ``window`` references) for the choice."""

    def __init__(self, worlds: Mapping[str, World], window: float) -> None:
        if not window > 0:
            raise ValueError(f"the worlds' window must be > 0, got {window}")
        self.worlds = dict(worlds)
        self.window = window
        self.refs = 0.0
        self._since_halving = 0.0

    def __getitem__(self, name: str) -> World:
        return self.worlds[name]

    def request(self, keys: Sequence[OffloadKey], gpu_held: int) -> None:
        for world in self.worlds.values():
            world.request(keys, gpu_held)
        n = len(keys)
        self.refs += n
        self._since_halving += n
        if self._since_halving >= self.window:
            self.refs /= 2
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

    @property
    def memory_bytes(self) -> int:
        return BYTES_PER_MINI_KEY * self.tracked_keys

    @property
    def tracked_keys(self) -> int:
        return sum(w.tier.capacity for w in self.worlds.values())
