"""The admission optimiser: candidate rules run as miniature simulations; the tier follows the best.

Every candidate is an existing rule stacked on a :class:`_Probe` (a manager
that answers lookups as the real tier did and stores nothing): store-everything
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
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from kvoffload.admission.base import AdmissionLayer, AdmissionStats
from kvoffload.admission.budget import BudgetCredit, WriteBudget, check_write_budget
from kvoffload.admission.feedback import FeedbackAdmission
from kvoffload.admission.minisim import WINDOW_TIERS, MiniSimulation, WhatIf
from kvoffload.admission.params import check_params, param
from kvoffload.admission.registry import register_admission
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


class _Probe(OffloadingManager):
    """The bottom of a candidate's stack: answers lookups with the real tier's answer and
    stores nothing (the optimiser asks each candidate's ``admit`` for its decision)."""

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


@dataclass(frozen=True)
class Objective:
    """How candidates are ranked (see the module docstring)."""

    hit_tolerance: float = HIT_TOLERANCE
    switch_margin: float = SWITCH_MARGIN
    write_margin: float = WRITE_MARGIN
    write_budget: float | None = None
    """Writes per block reference; ``None`` for no budget (a per-time budget is converted
    at the observed reference rate before each choice)."""

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


@dataclass(frozen=True)
class OptimiserParams:
    """What a user may set of the optimiser (``--admission-param key=value``)."""

    hit_tolerance: float = param(
        HIT_TOLERANCE, 0.0, 1.0, "hit ratio gap within which candidates tie on hits"
    )
    switch_margin: float = param(
        SWITCH_MARGIN, 0.0, 1.0, "extra hit gap the current candidate is kept within"
    )
    write_margin: float = param(
        WRITE_MARGIN, 0.0, help="share fewer writes a tied candidate needs to replace it"
    )
    window_tiers: float = param(
        WINDOW_TIERS, 0.01, help="the mini-tiers' recent window, in tier-fulls"
    )
    warmup_tiers: float = param(
        WARMUP_TIERS, 0.0, help="mini-tier-fulls of sampled references dropped from the counts"
    )
    settle_tiers: float = param(
        SETTLE_TIERS, 0.0, help="mini-tier-fulls after the warm-up before the first choice"
    )
    dwell_tiers: float = param(
        DWELL_TIERS, 0.0, help="mini-tier-fulls a choice stays after each switch"
    )
    filter_threshold: int = param(
        FILTER_THRESHOLD, 2, help="the filter candidate's store threshold"
    )
    filter_tracker: int = param(FILTER_TRACKER, 1, help="the filter candidate's tracker size")

    def __post_init__(self) -> None:
        check_params(self, "optimiser")


@register_admission("optimiser", params=OptimiserParams)
class OptimisingAdmission(AdmissionLayer):
    """Follows whichever candidate rule its miniature simulations rank best right now."""

    def __init__(
        self,
        backing: OffloadingManager,
        capacity: int,
        write_budget: float | WriteBudget | None = None,
        objective: Objective | None = None,
        policy: type[CachePolicy] | None = None,
        bits: int | None = None,
        window_tiers: float | None = None,
        params: OptimiserParams | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(backing, capacity)
        check_write_budget(write_budget)
        self.params = p = params or OptimiserParams()
        if window_tiers is None:
            window_tiers = p.window_tiers
        budget = objective.write_budget if write_budget is None and objective else write_budget
        self.write_credit = None if budget is None else BudgetCredit(budget, clock)
        """The budget's token bucket; ``clock`` (seconds) drives a per-time budget."""
        per_ref = None if self.write_credit is None else self.write_credit.writes_per_ref()
        self.objective = objective or Objective(
            p.hit_tolerance, p.switch_margin, p.write_margin, per_ref
        )
        if self.objective.write_budget not in (None, per_ref):
            raise InvalidArgumentError("give the write budget once: in the objective or alone")
        self._probe = _Probe()
        self.feedback = FeedbackAdmission(self._probe, capacity)
        self.filter = FilterReusedOffloadingManager(
            self._probe, p.filter_threshold, p.filter_tracker
        )
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
        """The feedback candidate is shown a request where it starts, never the touch after
        the real tier's store: that tier may store when the candidate did not, and the
        candidate would count that touch as a second sighting (its own offers as returns)."""
        keys = keys if isinstance(keys, list) else list(keys)
        if keys and not self._announced and self._requests.on_touch(keys):
            self.feedback.begin_request(keys, lookup_follows=True)
            self._sighting(keys)
        self.backing.touch(keys)

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

    def begin_request(
        self,
        keys: Sequence[OffloadKey],
        *,
        lookup_follows: bool = False,
        will_offer: bool = True,
        counted: int = 0,
        tier_hit: bool = False,
        gpu_held: int = 0,
    ) -> None:
        """See :meth:`AdmissionLayer.begin_request`. For per-key drivers (no
        ``lookup_follows``) ``keys[gpu_held:]`` stand for the request's lookup too, so the
        filter counts them and the mini-tiers score them (as the engine model's lookup past
        the GPU hit), and the feedback candidate is told of
        the request. With ``lookup_follows`` the feedback candidate is told the request
        starts here and the filter and mini-tiers see the lookup that follows; the touch
        after the real tier's store is no new sighting for the candidate (see :meth:`touch`).

        A later part of a request offered in parts (``counted`` > 0) counts only its new
        keys in the filter; the mini-tiers scored the request's lookup with its first part.
        """
        super().begin_request(
            keys,
            lookup_follows=lookup_follows,
            will_offer=will_offer,
            counted=counted,
            tier_hit=tier_hit,
            gpu_held=gpu_held,
        )
        if not keys:
            return
        if lookup_follows:
            self.feedback.begin_request(keys, lookup_follows=True)
            return
        self.feedback.begin_request(keys, will_offer=will_offer, counted=counted, tier_hit=tier_hit)
        self._probe.found = 0
        looked_up = max(counted, gpu_held)
        if looked_up < len(keys):
            self.filter.lookup(list(keys[looked_up:]))
        if counted == 0 and gpu_held < len(keys):
            self.minisim.on_lookup(keys[gpu_held:] if gpu_held else keys)
            if not will_offer:  # announced at its end, after its loads: no offer follows
                self.minisim.on_full_hit(keys[-1])

    def end_request(self, keys: Sequence[OffloadKey]) -> None:
        if self.feedback.announced:
            self.feedback.end_request(keys)
        super().end_request(keys)

    def _sighting(self, keys: Sequence[OffloadKey]) -> None:
        self.minisim.on_request(keys, self._hashes(keys))
        self.ghost_hits = self.feedback.ghost_hits
        if self.write_credit is not None:
            self.write_credit.earn(len(keys))

    def _admit(self, offered: Sequence[OffloadKey], prefix: int) -> list[OffloadKey]:
        offered = offered if isinstance(offered, list) else list(offered)
        admitted: dict[str, list[OffloadKey] | None] = {
            STORE_ALL: None,
            FILTER: self.filter.admit(offered),
            FEEDBACK: self.feedback.admit(offered),
        }
        self.minisim.on_offer(offered, admitted)
        if self.minisim.seen >= self._next_choice:
            self._choose()
        chosen = admitted[self.chosen]
        keys = list(offered) if chosen is None else chosen
        if self.write_credit is not None:
            self.write_credit.earn(0)
            keys = keys[: self.write_credit.allowance()]
        return keys

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        output = super().prepare_store(keys)
        if output is not None and self.write_credit is not None:
            self.write_credit.spend(len(output.keys_to_store))
        return output

    def _choose(self) -> None:
        """Re-rank the candidates: none in the warm-up, none while a switch dwells."""
        seen, tier, p = self.minisim.seen, self.minisim.tiers[STORE_ALL, 1.0][0], self.params
        self._next_choice = seen + max(16.0, tier.capacity / 64)
        if self._settled_at is None:
            if seen < p.warmup_tiers * tier.capacity:
                return
            self._settled_at = seen
            self.minisim.restart_window()
        if seen < max(self._settled_at + p.settle_tiers * tier.capacity, self._dwell_until):
            return
        if self.write_credit is not None and not self.write_credit.budget.per_ref:
            per_ref = self.write_credit.writes_per_ref()
            self.objective = replace(self.objective, write_budget=per_ref)
        self._switch(self.objective.choose(self.minisim.scores(), self.chosen))

    def _switch(self, candidate: str) -> None:
        if candidate != self.chosen:
            self.chosen = candidate
            self.switches += 1
            capacity = self.minisim.tiers[STORE_ALL, 1.0][0].capacity
            self._dwell_until = self.minisim.seen + self.params.dwell_tiers * capacity

    def whatif(self) -> list[WhatIf]:
        """Every candidate at every capacity factor, as the mini-tiers see recent traffic."""
        return self.minisim.figures()

    def stats(self) -> AdmissionStats:
        feedback = self.feedback.stats()
        counted = self._stats(
            feedback.control,
            feedback.memory_bytes
            + BYTES_PER_FILTER_KEY * self.params.filter_tracker
            + self.minisim.memory_bytes,
            feedback.tracked_keys + self.params.filter_tracker + self.minisim.tracked_keys,
            feedback.ghost_hits,
        )
        return replace(
            counted,
            candidate=self.chosen,
            whatif=tuple(self.whatif()),
            whatif_total=tuple(self.minisim.figures(cumulative=True)),
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
