"""The admission optimiser: candidate rules run as miniature simulations; the tier follows the best.

Every candidate is an existing rule stacked on a :class:`_Probe` (a manager
that records what it is asked to store and stores nothing): store-everything
(the probe alone), the seed filter (:class:`FilterReusedOffloadingManager`,
threshold 2) and the feedback layer. Each sees every call the tier sees and
decides every offer; a :class:`~kvoffload.admission.minisim.MiniSimulation`
replays each candidate's decisions on hash-sampled keys through a mini-tier
under the tier's own policy, and the real tier stores what the chosen
candidate admits.

The rule followed starts as store-everything: while a tier fills, storing
everything loses no hit. The mini-tiers' counts are cut into chunks (a
quarter of a mini-tier-full of sampled references each, the last sixteen
mini-tier-fulls kept); the difference between two candidates' hits is
estimated over them, with its standard error from the spread of the
per-chunk differences (paired: every candidate saw the same references).

* **The baselines** (store-everything and the seed filter, the two settings
  an operator has without kvoffload) are judged on the point estimates: the
  one with more hits is followed, the current one kept while within
  ``switch_margin``; the one that writes ``write_margin`` fewer blocks is
  followed when it is, by ``confidence`` standard errors, within
  ``hit_tolerance`` of the other's hits.
* **Any other rule** (the feedback layer) replaces the baseline only on
  confident evidence against every baseline: more hits by ``switch_margin``
  and above zero by ``confidence`` standard errors, or fewer writes by
  ``write_margin`` at hits confidently within ``hit_tolerance``. Once
  followed, it is kept on half that confidence.
* Never a candidate that writes more than store-everything, nor (with a
  write budget) more than the budget.

The first mini-tier-full of sampled references (the cold start, while every
rule fills its tier and writes cost no hits) is not counted, and no choice is
made on fewer than one mini-tier-full of evidence.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
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
DEFAULT = STORE_ALL
"""The rule followed until the evidence says otherwise: while the tier fills it loses no hit."""
WARMUP_TIERS = 1.0
"""The counts of the first this many 1x mini-tier-fulls of sampled references are dropped:
while the mini-tiers fill, a rule's writes cost it no hits, so fewer writes say nothing."""
CHUNK_TIERS = 0.25
"""One chunk of evidence: this many 1x mini-tier-fulls of sampled references."""
MIN_CHUNKS = 4
"""No choice on fewer chunks than this: too few to estimate the spread of the differences."""
CONFIDENCE = 2.5
"""Standard errors by which a difference must clear its bar."""
STAY_SHARE = 0.5
"""A rule other than the baselines, once followed, is kept on this share of the confidence."""
HIT_TOLERANCE = 0.001
"""A candidate whose hits (per block reference) are confidently no more than this below the best
counts as tied with it on hits."""
SWITCH_MARGIN = 0.001
"""A candidate must have more hits than the current one by more than this to replace it: a
switch costs hits while the tier turns over."""
DWELL_TIERS = 1.0
"""After a switch the choice stays for this many 1x mini-tier-fulls of sampled references, while
the tier turns over."""
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
    confidence: float = CONFIDENCE
    baselines: tuple[str, ...] = (STORE_ALL, FILTER)
    """The rules judged on point estimates; any other is followed only on confident evidence."""

    def choose(
        self,
        scores: Mapping[str, tuple[float, float]],
        current: str,
        error: Callable[[str, str], float] | None = None,
    ) -> str:
        """The candidate to follow, given ``candidate -> (hits, writes)`` per reference and
        ``error(a, b)``, the standard error of ``a``'s hits minus ``b``'s (none: exact)."""
        ceiling = scores[STORE_ALL][1] if STORE_ALL in scores else math.inf
        if self.write_budget is not None:
            ceiling = min(ceiling, self.write_budget)
        feasible = {n: s for n, s in scores.items() if s[1] <= ceiling + 1e-12}
        if not feasible:
            return min(scores, key=lambda n: scores[n][1])
        baselines = [n for n in feasible if n in self.baselines]
        if not baselines:
            return max(feasible, key=lambda n: (feasible[n][0], -feasible[n][1]))

        def low(a: str, b: str, z: float) -> float:
            """A lower confidence bound of ``a``'s hits minus ``b``'s."""
            spread = error(a, b) if error is not None and a != b else 0.0
            return feasible[a][0] - feasible[b][0] - z * spread

        # The better baseline on the point estimates, the current one kept within the margin;
        # then one that writes fewer blocks and is confidently tied with it on hits.
        base = max(baselines, key=lambda n: feasible[n][0])
        if current in baselines and feasible[current][0] >= feasible[base][0] - self.switch_margin:
            base = current
        frugal = [
            n
            for n in baselines
            if feasible[n][1] < feasible[base][1] * (1 - self.write_margin)
            and low(n, base, self.confidence) >= -self.hit_tolerance
        ]
        if frugal:
            base = min(frugal, key=lambda n: feasible[n][1])
        # Another rule only on confident evidence against every baseline (a lower bar to stay).
        best, best_low = base, 0.0
        for name, (hits, writes) in feasible.items():
            if name in self.baselines:
                continue
            z = self.confidence * (STAY_SHARE if name == current else 1.0)
            margin = min(low(name, m, z) for m in baselines)
            gains = margin > 0 and hits > feasible[base][0] + self.switch_margin
            ties = writes < feasible[base][1] * (1 - self.write_margin)
            ties = ties and margin >= -self.hit_tolerance
            if (gains or ties) and (best == base or margin > best_low):
                best, best_low = name, margin
        return best


class _Evidence:
    """The 1x mini-tiers' hits and writes in chunks of sampled references, the last ``size``
    chunks kept: windowed scores, and the paired standard error of two candidates' difference
    from the spread of its per-chunk values."""

    def __init__(self, names: Sequence[str], chunk: float, size: int) -> None:
        self.index = {name: i for i, name in enumerate(names)}
        self.chunk = chunk
        self.chunks: deque[np.ndarray] = deque(maxlen=size)
        """Per chunk: block references, lookups past the GPU hit, sampled lookups, then each
        candidate's hits, then each candidate's writes."""
        self._mark: np.ndarray | None = None
        self._seen = 0

    def _read(self, minisim: MiniSimulation) -> np.ndarray:
        tiers = [minisim.tiers[name, 1.0][0] for name in self.index]
        return np.array(
            [
                *minisim.lookup_totals(),
                *(t.total_hits for t in tiers),
                *(t.total_writes for t in tiers),
            ],
            float,
        )

    def restart(self, minisim: MiniSimulation) -> None:
        """Forget every chunk; the next one starts now."""
        self.chunks.clear()
        self._mark = self._read(minisim)
        self._seen = minisim.seen

    def update(self, minisim: MiniSimulation) -> bool:
        """Close a chunk if one has passed since the last; whether one was closed."""
        if self._mark is None:
            self.restart(minisim)
            return False
        if minisim.seen - self._seen < self.chunk:
            return False
        now = self._read(minisim)
        self.chunks.append(now - self._mark)
        self._mark, self._seen = now, minisim.seen
        return True

    def _totals(self) -> tuple[np.ndarray, float]:
        """The summed chunks and the per-reference scale of a sampled count: the share of
        references that reach the tier over the sampled lookups."""
        total = np.sum(self.chunks, axis=0)
        refs, lookups, sampled = total[:3]
        return total, (lookups / refs / sampled if refs and sampled else 0.0)

    def scores(self) -> dict[str, tuple[float, float]]:
        """``candidate -> (tier hits, writes)`` per block reference over the chunks kept."""
        if not self.chunks:
            return {name: (0.0, 0.0) for name in self.index}
        total, scale = self._totals()
        n = len(self.index)
        return {
            name: (float(total[3 + i] * scale), float(total[3 + n + i] * scale))
            for name, i in self.index.items()
        }

    def error(self, a: str, b: str) -> float:
        """The standard error of ``a``'s hits minus ``b``'s, per block reference (a ratio
        estimator over the chunks: each chunk's difference against its share of lookups)."""
        count = len(self.chunks)
        if count < 2:
            return math.inf
        chunks = np.array(self.chunks)
        diff = chunks[:, 3 + self.index[a]] - chunks[:, 3 + self.index[b]]
        sampled = chunks[:, 2]
        total = float(sampled.sum())
        if not total:
            return math.inf
        residual = diff - diff.sum() / total * sampled
        _, scale = self._totals()
        spread = math.sqrt(count / (count - 1) * float(residual @ residual))
        return spread * scale


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
        base = self.minisim.tiers[STORE_ALL, 1.0][0].capacity
        self._warm_until = WARMUP_TIERS * base
        self.evidence = _Evidence(
            CANDIDATES, CHUNK_TIERS * base, max(MIN_CHUNKS, round(window_tiers / 2 / CHUNK_TIERS))
        )
        """Chunks of the last half of the mini-tiers' halving window (16 mini-tier-fulls)."""
        self._warm = False
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
        """Re-rank the candidates at the end of each chunk of evidence: none in the warm-up,
        none while a switch dwells."""
        seen, tier = self.minisim.seen, self.minisim.tiers[STORE_ALL, 1.0][0]
        self._next_choice = seen + max(16.0, tier.capacity / 64)
        if not self._warm:
            if seen < self._warm_until:
                return
            self._warm = True
            self.minisim.restart_window()
            self.evidence.restart(self.minisim)
            return
        if not self.evidence.update(self.minisim):
            return
        if len(self.evidence.chunks) < MIN_CHUNKS or seen < self._dwell_until:
            return
        self._switch(
            self.objective.choose(self.evidence.scores(), self.chosen, self.evidence.error)
        )

    def _switch(self, candidate: str) -> None:
        if candidate != self.chosen:
            self.chosen = candidate
            self.switches += 1
            self._dwell_until = self.minisim.seen + DWELL_TIERS * self.evidence.chunk / CHUNK_TIERS

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
