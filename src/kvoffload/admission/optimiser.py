"""The admission optimiser: candidate rules run as miniature simulations; the tier follows the best.

Every candidate is an existing rule stacked on a :class:`_Probe` (a manager
that records what it is asked to store and stores nothing): store-everything
(the probe alone), the seed filter (:class:`FilterReusedOffloadingManager`,
threshold 2) and the feedback layer. Each sees every call the tier sees and
decides every offer; a :class:`~kvoffload.admission.minisim.MiniSimulation`
replays each candidate's decisions on hash-sampled keys through a mini-tier
under the tier's own policy, and the real tier stores what the chosen
candidate admits.

The objective: hits first; among candidates within ``HIT_TOLERANCE`` of the best
hit ratio, the fewest writes; never a candidate that writes more than
store-everything, nor (with a write budget) more than the budget. The choice
changes only when the current candidate falls out of that set by a margin
(hysteresis), so that noise in the sampled figures does not make it flap.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvoffload.admission.base import AdmissionLayer, AdmissionStats
from kvoffload.admission.feedback import FeedbackAdmission
from kvoffload.admission.minisim import WINDOW_TIERS, MiniSimulation, WhatIf
from kvoffload.admission.reuse_filter import FilterReusedOffloadingManager
from kvoffload.admission.sketch import key_hashes
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import OffloadingManager, PrepareStoreOutput
from kvoffload.core.specs import CPULoadStoreSpec, LoadStoreSpec
from kvoffload.policies.base import CachePolicy
from kvoffload.policies.lru import LRUCachePolicy

STORE_ALL, FILTER, FEEDBACK = "store-all", "filter", "feedback"
CANDIDATES = (STORE_ALL, FILTER, FEEDBACK)
DEFAULT = FEEDBACK
"""The rule followed until the first choice (the layer recommended before the optimiser)."""
WARMUP_TIERS = 2.0
"""The counts of the first this many 1x mini-tier-fulls of sampled references are dropped:
while the mini-tiers fill and the rules start, they say little about the rules."""
SETTLE_TIERS = 0.5
"""The first choice comes this many 1x mini-tier-fulls of sampled references later."""
HIT_TOLERANCE = 0.0015
"""Candidates this close to the best hit ratio (per block reference) count as tied on hits."""
SWITCH_MARGIN = 0.003
"""The current candidate is kept while it is within the tolerance plus this margin."""
DWELL_TIERS = 2.0
"""After a switch the choice stays for this many 1x mini-tier-fulls of sampled references:
a switch costs hits while the tier turns over, so flapping costs more than either rule."""
WRITE_MARGIN = 0.1
"""A tied candidate must write this share fewer blocks than the current one to replace it."""
WHATIF_FACTORS = (0.5, 1.0, 2.0, 4.0)
FILTER_THRESHOLD, FILTER_TRACKER = 2, 64_000
"""The seed filter as vLLM configures it by default."""
BYTES_PER_FILTER_KEY = 120
"""Approximate CPython cost of one tracked key in the filter's table."""
BUDGET_BURST_REFS = 1024
"""A write budget may be spent ahead by at most this many block references' worth."""


class _Probe(OffloadingManager):
    """The bottom of a candidate's stack: answers lookups with the real tier's answer and
    records the keys a candidate would store."""

    def __init__(self) -> None:
        self.found: int | None = 0
        self.stored: list[OffloadKey] = []

    def lookup(self, keys: Iterable[OffloadKey]) -> int | None:
        return self.found

    def prepare_load(self, keys: Iterable[OffloadKey]) -> LoadStoreSpec:
        return CPULoadStoreSpec([])

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        return None

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        self.stored = list(keys)
        return PrepareStoreOutput(self.stored, CPULoadStoreSpec([]), [])

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        return None


@dataclass(frozen=True)
class Objective:
    """How candidates are ranked (see the module docstring)."""

    hit_tolerance: float = HIT_TOLERANCE
    switch_margin: float = SWITCH_MARGIN
    write_margin: float = WRITE_MARGIN
    write_budget: float | None = None
    """Writes per block reference; ``None`` for no budget."""

    def choose(self, scores: Mapping[str, tuple[float, float]], current: str) -> str:
        """The candidate to follow, given ``candidate -> (hits, writes)`` per reference."""
        ceiling = scores[STORE_ALL][1] if STORE_ALL in scores else math.inf
        if self.write_budget is not None:
            ceiling = min(ceiling, self.write_budget)
        feasible = {n: s for n, s in scores.items() if s[1] <= ceiling + 1e-12}
        if not feasible:
            return min(scores, key=lambda n: scores[n][1])
        best = max(hits for hits, _ in feasible.values())
        tied = [n for n, (hits, _) in feasible.items() if hits >= best - self.hit_tolerance]
        target = min(tied, key=lambda n: feasible[n][1])
        if target == current or current not in feasible:
            return target
        hits, writes = feasible[current]
        keeps_hits = hits >= best - self.hit_tolerance - self.switch_margin
        if keeps_hits and writes <= feasible[target][1] * (1 + self.write_margin):
            return current
        return target


class OptimisingAdmission(AdmissionLayer):
    """Follows whichever candidate rule its miniature simulations rank best right now."""

    def __init__(
        self,
        backing: OffloadingManager,
        capacity: int,
        write_budget: float | None = None,
        objective: Objective | None = None,
        policy: type[CachePolicy] | None = None,
        bits: int | None = None,
        window_tiers: float = WINDOW_TIERS,
    ) -> None:
        super().__init__(backing, capacity)
        check_write_budget(write_budget)
        self.objective = objective or Objective(write_budget=write_budget)
        if write_budget is not None and self.objective.write_budget != write_budget:
            raise InvalidArgumentError("give the write budget once: in the objective or alone")
        self._probe = _Probe()
        self.feedback = FeedbackAdmission(self._probe, capacity)
        self.filter = FilterReusedOffloadingManager(self._probe, FILTER_THRESHOLD, FILTER_TRACKER)
        self._candidates: dict[str, OffloadingManager] = {
            STORE_ALL: self._probe,
            FILTER: self.filter,
            FEEDBACK: self.feedback,
        }
        policy = policy or tier_policy(backing)
        self.minisim = MiniSimulation(
            capacity, policy, CANDIDATES, WHATIF_FACTORS, window_tiers, bits
        )
        self.chosen = DEFAULT
        self.switches = 0
        self._next_choice = 0.0
        self._dwell_until = 0.0
        self._settled_at: float | None = None
        """Sampled references at the end of the warm-up; ``None`` before."""
        self._credit = 0.0
        self._hashed: tuple[Sequence[OffloadKey], np.ndarray] = ((), np.zeros(0, np.uint64))

    def _hashes(self, keys: Sequence[OffloadKey]) -> np.ndarray:
        """Hashes of ``keys``: a slice of the last request's when they end that request."""
        last, hashes = self._hashed
        start = len(last) - len(keys)
        if start >= 0 and keys and last[-1] == keys[-1] and last[start] == keys[0]:
            return hashes[start:]
        hashes = key_hashes(keys)
        self._hashed = (keys, hashes)
        return hashes

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        keys = keys if isinstance(keys, list) else list(keys)
        self.feedback.touch(keys)
        super().touch(keys)

    def lookup(self, keys: Iterable[OffloadKey]) -> int | None:
        keys = keys if isinstance(keys, list) else list(keys)
        found = super().lookup(keys)
        self._probe.found = found
        self.feedback.lookup(keys)
        self.filter.lookup(keys)
        if found is not None and keys:
            self.minisim.on_lookup(keys)
        return found

    def prepare_load(self, keys: Iterable[OffloadKey]) -> LoadStoreSpec:
        keys = keys if isinstance(keys, list) else list(keys)
        if keys:
            self.minisim.on_full_hit(keys[-1])
        return super().prepare_load(keys)

    def see_request(
        self, keys: Sequence[OffloadKey], will_offer: bool = True, counted: int = 0
    ) -> None:
        """For per-key drivers (see :meth:`AdmissionLayer.see_request`): ``keys`` stand for the
        request's lookup too, so the filter counts them and the mini-tiers score them.

        A later part of a request offered in parts (``counted`` > 0) counts only its new
        keys in the filter; the mini-tiers scored the request's lookup with its first part.
        """
        if not keys:
            return
        super().see_request(keys, will_offer, counted)
        self.feedback.see_request(keys, will_offer, counted)
        self._probe.found = 0
        if counted < len(keys):
            self.filter.lookup(list(keys[counted:]))
        if counted == 0:
            self.minisim.on_lookup(keys)

    def saw_tier_hit(self, keys: Sequence[OffloadKey]) -> None:
        super().saw_tier_hit(keys)
        self.feedback.saw_tier_hit(keys)

    def _sighting(self, keys: Sequence[OffloadKey]) -> None:
        self.minisim.on_request(keys, self._hashes(keys))
        self.ghost_hits = self.feedback.ghost_hits
        if self.objective.write_budget is not None:
            cap = self.objective.write_budget * BUDGET_BURST_REFS
            self._credit = min(cap, self._credit + self.objective.write_budget * len(keys))

    def _admit(self, offered: Sequence[OffloadKey], prefix: int) -> list[OffloadKey]:
        probe = self._probe
        admitted: dict[str, list[OffloadKey] | None] = {STORE_ALL: None}
        for name in (FILTER, FEEDBACK):
            self._candidates[name].prepare_store(offered)
            admitted[name] = probe.stored
        self.minisim.on_offer(offered, admitted)
        if self.minisim.seen >= self._next_choice:
            self._choose()
        chosen = admitted[self.chosen]
        keys = list(offered) if chosen is None else chosen
        if self.objective.write_budget is not None:
            keys = keys[: int(self._credit + 1e-9)]
        return keys

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        output = super().prepare_store(keys)
        if output is not None and self.objective.write_budget is not None:
            self._credit -= len(output.keys_to_store)
        return output

    def _choose(self) -> None:
        """Re-rank the candidates: none in the warm-up, none while a switch dwells."""
        seen, tier = self.minisim.seen, self.minisim.tiers[STORE_ALL, 1.0][0]
        self._next_choice = seen + max(16.0, tier.capacity / 64)
        if self._settled_at is None:
            if seen < WARMUP_TIERS * tier.capacity:
                return
            self._settled_at = seen
            self.minisim.restart_window()
        if seen < max(self._settled_at + SETTLE_TIERS * tier.capacity, self._dwell_until):
            return
        self._switch(self.objective.choose(self.minisim.scores(), self.chosen))

    def _switch(self, candidate: str) -> None:
        if candidate != self.chosen:
            self.chosen = candidate
            self.switches += 1
            capacity = self.minisim.tiers[STORE_ALL, 1.0][0].capacity
            self._dwell_until = self.minisim.seen + DWELL_TIERS * capacity

    def whatif(self) -> list[WhatIf]:
        """Every candidate at every capacity factor, as the mini-tiers see recent traffic."""
        return self.minisim.figures()

    def stats(self) -> AdmissionStats:
        feedback = self.feedback.stats()
        return AdmissionStats(
            offers=self.offers,
            admitted=self.admitted,
            rejected=self.offers - self.admitted,
            ghost_hits=feedback.ghost_hits,
            control=feedback.control,
            memory_bytes=feedback.memory_bytes
            + BYTES_PER_FILTER_KEY * FILTER_TRACKER
            + self.minisim.memory_bytes,
            tracked_keys=feedback.tracked_keys + FILTER_TRACKER + self.minisim.tracked_keys,
            candidate=self.chosen,
            whatif=tuple(self.whatif()),
            whatif_total=tuple(self.minisim.figures(cumulative=True)),
        )


def check_write_budget(budget: float | None) -> None:
    """A write budget is ``None`` or a finite number of writes per block reference >= 0."""
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise InvalidArgumentError(f"write budget must be a number, got {budget!r}")
    if not math.isfinite(budget) or budget < 0:
        raise InvalidArgumentError(
            f"write budget must be a finite number of writes per block reference >= 0, "
            f"got {budget!r}"
        )


def tier_policy(manager: OffloadingManager) -> type[CachePolicy]:
    """The eviction policy class of the tier under ``manager`` (LRU if none is found)."""
    current: object = manager
    while current is not None:
        policy = getattr(current, "policy", None)
        if isinstance(policy, CachePolicy):
            return type(policy)
        cpu = getattr(current, "cpu", None)
        policy = getattr(cpu, "policy", None)
        if isinstance(policy, CachePolicy):
            return type(policy)
        current = getattr(current, "backing", None)
    return LRUCachePolicy
