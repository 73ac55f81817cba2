"""The admission optimiser: candidate rules run in exact worlds; the real tier mirrors the best.

Every candidate is an existing rule: store-everything, the seed filter
(:class:`FilterReusedOffloadingManager`, threshold 2) and the feedback layer.
Each runs in a world of its own (:mod:`kvoffload.admission.worlds`): a key-only
tier of the real tier's size and policy that answers the rule's lookups, so each
world is exactly what the tier would have done under that rule from the start
(for store-everything and the filter: the baselines themselves). The real tier
follows the best world and *mirrors* it: it stores an offered block only if the
followed world holds it, and only blocks that world holds are made recent, so
blocks written under an earlier rule age out first. Whatever the real tier did
before, after a switch it lacks only blocks the new world holds; each is stored again
at its next miss, though that miss also ends the hit run of the request that asks
for it (the refill a switch costs). Once refilled, the real tier's hits are the
followed world's, and the followed world is, up to the objective's tolerances, the
best one, the baselines included.

Three opt-in mechanisms (``guard=1``, ``steer=1``) aim to keep that true when recent
figures mislead; they are off by default, as each lost on some traffic it was not
developed on (``docs/admission-research.md``):

* **The guard** bounds the loss: the baselines' worlds count every hit each
  baseline made since the start, the real tier counts its own, and once the
  real tier trails the leading baseline by more than a small share of the
  references seen, it follows that baseline until the gap is back within three
  quarters of that share, or another world has paid for a switch.
* **Steered eviction**: under a policy with one eviction order (LRU, the
  recommended one), the followed world's blocks among the tier's coldest are
  made recent before a store, so the tier evicts blocks the world does not hold
  first and keeps what the world keeps.
* **The hedge** (where eviction can be steered): while the followed world leaves
  most of its tier empty (a rule that admits little), the real tier stores every
  offered block in that room;
  steered eviction makes those the first to leave once the world's own blocks
  need the room. A rule that kept little then costs no hits store-everything's
  recent blocks would have given.

The objective: hits first; among candidates within ``HIT_TOLERANCE`` of the best
hit ratio, the fewest writes; never a candidate that writes more than
store-everything, nor (with a write budget) more than the budget. The choice
changes only when the current candidate falls out of that set by a margin and
not within a dwell after a switch (hysteresis). Store-everything is followed
until a world's tier fills: before that, no rule has lost a hit.

Under LRU the worlds are the 1x what-if figures, exactly. A
:class:`~kvoffload.admission.minisim.MiniSimulation` on hash-sampled keys gives
the others: each candidate at other capacities, storing what its world holds
(what a tier mirroring that world stores); under a policy whose worlds are
approximations (:func:`~kvoffload.admission.worlds.exact_worlds`) its sampled
1x mini-tiers give the 1x figures too.

A lower tier of the tiered manager is only told of lookups, and offered what the
tier above evicts: it cannot mirror. There each candidate rule also runs fed what
the real tier answers, the sampled 1x mini-tiers rank them, and the tier stores
what the chosen rule admits. A switch away from store-everything is on trial while
it dwells: store-everything is taken back once its mini-tier has out-hit the followed
rule's since the switch by the guard's allowance (a refused block is not offered again
until it is recomputed, so each hit a thriftier rule loses stays lost), and the rule it
was lost to is chosen again only once it has out-hit store-everything by as much.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from kvoffload.admission.base import (
    AdmissionLayer,
    AdmissionStats,
    check_looked_up,
    check_request_counts,
    check_request_keys,
)
from kvoffload.admission.budget import BudgetCredit, WriteBudget, check_write_budget
from kvoffload.admission.feedback import FeedbackAdmission
from kvoffload.admission.minisim import WINDOW_TIERS, MiniSimulation, WhatIf
from kvoffload.admission.params import check_params, is_finite, param, shown
from kvoffload.admission.registry import register_admission
from kvoffload.admission.reuse_counts import MAX_STORE_THRESHOLD, MAX_TRACKED_KEYS
from kvoffload.admission.reuse_filter import FilterReusedOffloadingManager
from kvoffload.admission.sketch import key_hashes
from kvoffload.admission.worlds import Probe, World, Worlds, exact_worlds
from kvoffload.core.errors import InvalidArgumentError, is_number
from kvoffload.core.keys import SINGLE_KEY_TYPES, OffloadKey, refuse_single_key
from kvoffload.core.manager import OffloadingManager, PrepareStoreOutput, stack_layers
from kvoffload.core.specs import LoadStoreSpec
from kvoffload.policies.base import CachePolicy
from kvoffload.policies.lru import LRUCachePolicy

STORE_ALL, FILTER, FEEDBACK = "store-all", "filter", "feedback"
CANDIDATES = (STORE_ALL, FILTER, FEEDBACK)
DEFAULT = STORE_ALL
"""The rule followed until a world's tier fills (vLLM's default: it loses no hit then)."""
HIT_TOLERANCE = 0.0005
"""Candidates this close to the best hit ratio (per block reference) count as tied on hits."""
SWITCH_MARGIN = 0.002
"""The current candidate is kept while it is within the tolerance plus this margin."""
DWELL_TIERS = 2.0
"""After a switch the choice stays for this many tier-fulls of references: a switch costs
hits while the tier turns over, so flapping costs more than either rule."""
SAMPLED_WARMUP_TIERS = 2.0
"""A lower tier (no mirroring) chooses on its sampled 1x mini-tiers, fed what that tier
is offered: the counts of this many mini-tier-fulls of sampled references are dropped,
the first choice comes half a mini-tier-full later, and until then store-everything is
followed (as a mirroring tier follows it until a world fills: before hits no rule that
writes less has shown what its refusals cost), with the wider tolerances the sampling
noise needs."""
SAMPLED_OBJECTIVE = (0.0015, 0.003)
"""``(hit tolerance, switch margin)`` of a lower tier's sampled choice."""
SWITCH_TIERS = 0.05
"""A switch away from a rule that writes less than store-everything waits until the new
world has hit this many tier-fulls of blocks more than the followed one since the last
switch: each such switch costs a refill (every block the new world holds and the tier
lacks misses once, and ends its request's hit run), so two rules that trade a small lead
must not flap. Leaving store-everything usually costs little refill (its tier holds the
offered blocks of every rule's recent past) and is not asked to pay for one."""
EVIDENCE_TIERS = 0.1
"""The write tie-break waits until the best world has hit this many tier-fulls of blocks
in the window: tiers that have shown no reuse yet tie every rule at zero hits, and the
rule that writes least would lose every hit that reuse brings later."""
LOSS_SHARE = 0.0015
"""The guard's allowance: the real tier may trail the leading baseline's hits since the
start by this share of the references seen (plus ``LOSS_TIERS``) before it follows it."""
LOSS_TIERS = 0.02
"""The guard's allowance in tier-fulls of hits, beside ``LOSS_SHARE``: early on, when few
references have been seen, one switch's refill must not trip it."""
GUARD_RELEASE = 0.75
"""The guard lets go once the gap is back within this share of the allowance (the gap stays
put while the leader is followed and the allowance grows, so a hold lasts about a third of
the references seen when it began), or sooner on evidence (see ``_guard``)."""
HEDGE_ROOM = 0.75
"""The hedge stores every offered block while the followed world's tier is more than this
share empty; hedging whenever any room was left lost hits where the filter's world was
filling (docs/admission-research.md)."""
BASELINES = (STORE_ALL, FILTER)
"""The rules the guard measures the real tier against: the goal's baselines."""
DWELL_SHARE = 0.25
"""The dwell is at most this share of the references seen so far: a choice made early, on
little evidence, can be corrected soon."""
WRITE_MARGIN = 0.1
"""A tied candidate must write this share fewer blocks than the current one to replace it."""
WHATIF_FACTORS = (0.5, 1.0, 2.0, 4.0)
FILTER_THRESHOLD, FILTER_TRACKER = 2, 64_000
"""The seed filter as vLLM configures it by default."""


@dataclass(frozen=True)
class Objective:
    """How candidates are ranked (see the module docstring)."""

    hit_tolerance: float = HIT_TOLERANCE
    switch_margin: float = SWITCH_MARGIN
    write_margin: float = WRITE_MARGIN
    write_budget: float | None = None
    """Writes per block reference; ``None`` for no budget (a per-time budget is converted
    at the observed reference rate before each choice)."""

    def __post_init__(self) -> None:
        """Refuse a tolerance or margin that no hit ratio can meet: a NaN or negative hit
        tolerance left no candidate tied with the best, and the first choice raised a bare
        ``ValueError`` from inside a store. The budget may be infinite: a per-time budget
        before any reference took time."""
        bounds = (("hit_tolerance", 1.0), ("switch_margin", 1.0), ("write_margin", math.inf))
        for name, high in bounds:
            value = getattr(self, name)
            if not is_number(value) or not is_finite(value) or not 0 <= value <= high:
                allowed = ">= 0" if high == math.inf else f"in [0, {high:g}]"
                raise InvalidArgumentError(
                    f"objective {name} must be a finite number {allowed}, got {shown(value)}"
                )
        budget = self.write_budget
        if budget is not None and not (is_number(budget) and budget >= 0):
            raise InvalidArgumentError(
                f"objective write_budget must be None or a number of writes per block "
                f"reference >= 0, got {shown(budget)}"
            )

    def choose(
        self, scores: Mapping[str, tuple[float, float]], current: str, informed: bool = True
    ) -> str:
        """The candidate to follow, given ``candidate -> (hits, writes)`` per reference.

        Not ``informed`` (the best candidate has hit too few blocks for a tie on hits to
        mean anything), store-everything wins a tie it is in, outright: a rule that writes
        less than it is preferred only once hits say what its refusals cost."""
        ceiling = scores[STORE_ALL][1] if STORE_ALL in scores else math.inf
        if self.write_budget is not None:
            ceiling = min(ceiling, self.write_budget)
        feasible = {n: s for n, s in scores.items() if s[1] <= ceiling + 1e-12}
        if not feasible:
            return min(scores, key=lambda n: scores[n][1])
        best = max(hits for hits, _ in feasible.values())
        tied = [n for n, (hits, _) in feasible.items() if hits >= best - self.hit_tolerance]
        if not informed and STORE_ALL in tied:
            return STORE_ALL
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
        WINDOW_TIERS, 0.01, help="the worlds' and mini-tiers' recent window, in tier-fulls"
    )
    dwell_tiers: float = param(
        DWELL_TIERS, 0.0, help="tier-fulls of references a choice stays after each switch"
    )
    switch_tiers: float = param(
        SWITCH_TIERS, 0.0, help="tier-fulls of hits a rule must gain before a switch to it"
    )
    evidence_tiers: float = param(
        EVIDENCE_TIERS, 0.0, help="tier-fulls of hits the best world needs before writes tie-break"
    )
    guard: int = param(0, 0, 1, "1: the guard (off by default: it lost on Mooncake cuts)")
    steer: int = param(
        0, 0, 1, "1: steered eviction and the hedge, under LRU (off by default, see the docs)"
    )
    loss_share: float = param(
        LOSS_SHARE, 0.0, 1.0, "share of references the tier's hits may trail the best baseline"
    )
    loss_tiers: float = param(
        LOSS_TIERS, 0.0, help="tier-fulls of hits it may trail, beside loss_share"
    )
    hedge_room: float = param(
        HEDGE_ROOM, 0.0, 1.0, "empty share of the followed world's tier above which all is stored"
    )
    filter_threshold: int = param(
        FILTER_THRESHOLD, 2, MAX_STORE_THRESHOLD, "the filter candidate's store threshold"
    )
    filter_tracker: int = param(
        FILTER_TRACKER, 1, MAX_TRACKED_KEYS, "the filter candidate's tracker size"
    )

    def __post_init__(self) -> None:
        check_params(self, "optimiser")


@register_admission("optimiser", params=OptimiserParams)
class OptimisingAdmission(AdmissionLayer):
    """Follows whichever candidate rule its miniature simulations rank best right now.

    ``objective`` and ``window_tiers``, where given, are used instead of the same settings
    in ``params`` (its ``hit_tolerance``, ``switch_margin``, ``write_margin`` and
    ``window_tiers``); a setting given both ways, with ``params`` away from its default and
    the two different, is refused rather than one silently dropped. ``policy`` is the
    tier's eviction policy class (found under ``backing`` when not given)."""

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
        self.params = p = _merged_params(params, objective, window_tiers)
        window_tiers = p.window_tiers
        if policy is not None and not (
            isinstance(policy, type) and issubclass(policy, CachePolicy)
        ):
            raise InvalidArgumentError(f"policy must be a CachePolicy class, got {policy!r}")
        if not callable(clock):  # else a TypeError at the first request a time budget counts
            raise InvalidArgumentError(f"clock must be a callable giving seconds, got {clock!r}")
        budget = objective.write_budget if write_budget is None and objective else write_budget
        self.write_credit = None if budget is None else BudgetCredit(budget, clock)
        """The budget's token bucket; ``clock`` (seconds) drives a per-time budget."""
        per_ref = None if self.write_credit is None else self.write_credit.writes_per_ref()
        if objective is not None and objective.write_budget not in (None, per_ref):
            raise InvalidArgumentError("give the write budget once: in the objective or alone")
        # A budget given beside an objective ranks the candidates too, not only caps writes.
        self.objective = (
            Objective(p.hit_tolerance, p.switch_margin, p.write_margin, per_ref)
            if objective is None
            else replace(objective, write_budget=per_ref)
        )
        self._probe = Probe()
        self.feedback = FeedbackAdmission(self._probe, capacity)
        self.filter = FilterReusedOffloadingManager(
            self._probe, p.filter_threshold, p.filter_tracker
        )
        """The candidate rules fed what the real tier answers: only a tier that does not
        mirror (see ``_offers_follow``) feeds them and chooses on their sampled figures."""
        policy = policy or tier_policy(backing)
        self._minisim_args = (capacity, policy, CANDIDATES, window_tiers, bits)
        self._exact_worlds = exact_worlds(policy)
        self._world_feedback = FeedbackAdmission(Probe(), capacity)
        self._world_filter = FilterReusedOffloadingManager(
            Probe(), p.filter_threshold, p.filter_tracker
        )
        self.worlds = Worlds(
            {
                STORE_ALL: World(capacity, policy),
                FILTER: World(capacity, policy, self._world_filter),
                FEEDBACK: World(capacity, policy, self._world_feedback),
            },
            window_tiers * capacity,
        )
        self.chosen = DEFAULT
        self._seen = 0
        """References since the start (never halved)."""
        self._next_choice = 0.0
        self._dwell_until = 0.0
        """References before which only the guard changes the choice (a switch dwells)."""
        self._left = DEFAULT
        """The rule the last switch left: store-everything puts a lower tier's switch on trial."""
        self._switched_at = 0
        """References seen at the last switch (a lower tier's trial counts from there)."""
        self._barred: set[str] = set()
        """Rules a lower tier's trial was lost to, each until it earns its way back."""
        self._loaded = 0
        """The real tier's hits since the start: the blocks loaded from it."""
        self._written = 0
        """The real tier's writes since the start: never more than store-everything's world."""
        self._whole_requests = False
        """Whether a driver shows each request whole, lookup included (the engine model):
        only then are the worlds' writes the real tier's to compare with. Per-key drivers
        (vLLM, SGLang) show a request in parts, the GPU's share found by position."""
        self._excused = 0.0
        """Gap the guard let go of on evidence (see :meth:`_guard`)."""
        self.guarded: str | None = None
        """The baseline the guard makes the real tier follow; ``None`` while it does not."""
        self.hedged = 0
        """Blocks the hedge stored beyond the followed world's (offered, not yet stored)."""
        self._cold_policy = _steerable_policy(backing) if p.steer else None
        """The real tier's policy where touches steer its eviction (its ``coldest`` view is
        asked for at each store: it may change with an eviction)."""
        self._pending: Sequence[OffloadKey] | None = None
        """The request whose worlds wait for its lookup (to learn the GPU's prefix hit)."""
        self._settled_at: float | None = None
        """A lower tier's sampled references at the end of its warm-up; ``None`` before."""
        self._offers_follow = False
        """Whether a driver announced a request whose offer follows (its missed blocks):
        the worlds' model of the tier. A lower tier of the tiered manager is only told of
        lookups, and offered the blocks the tier above evicts; it stores what the chosen
        rule admits of them instead of mirroring."""
        self._mirrors = True
        """Whether the real tier mirrors the followed world: while no driver announces
        requests, or once one announced a request whose offer follows (``_offers_follow``)."""
        self._hashed: tuple[Sequence[OffloadKey], np.ndarray] = ((), np.zeros(0, np.uint64))
        self._minisim = self._new_minisim()

    @property
    def minisim(self) -> MiniSimulation:
        """The what-if mini-tiers. A mirroring tier's exact worlds are its 1x figures, so
        only a tier that does not mirror, which chooses on them, or whose worlds are
        approximations runs the sampled 1x tiers (made anew, at the request that says so,
        when a tier starts or stops mirroring: a per-key driver's first request may offer
        nothing, and a tier that mirrors from its second on needs no sampled 1x tiers)."""
        return self._minisim

    def _new_minisim(self) -> MiniSimulation:
        """Mini-tiers for the tier as it now runs (see :attr:`minisim`)."""
        capacity, policy, candidates, window_tiers, bits = self._minisim_args
        worlds_at_1x = self._mirrors and self._exact_worlds
        factors = [f for f in WHATIF_FACTORS if f != 1.0 or not worlds_at_1x]
        return MiniSimulation(capacity, policy, candidates, factors, window_tiers, bits)

    def _hashes(self, keys: Sequence[OffloadKey]) -> np.ndarray:
        """Hashes of a request's ``keys``: a slice of the last request's when they end that
        request. Only the ends are compared, which is enough for requests alone: a key is
        chained from the one before it, so a request's last key fixes all its keys."""
        last, hashes = self._hashed
        start = len(last) - len(keys)
        if start >= 0 and keys and last[-1] == keys[-1] and last[start] == keys[0]:
            return hashes[start:]
        hashes = key_hashes(keys)
        self._hashed = (keys, hashes)
        return hashes

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        """Only blocks the followed world holds are made recent in the real tier (the
        others, written under an earlier rule, age out first). No candidate rule sees a
        touch: each world shows its rule the request where it starts."""
        if type(keys) is not list and isinstance(keys, SINGLE_KEY_TYPES):
            refuse_single_key(keys, "touch")
        keys = keys if isinstance(keys, list) else list(keys)
        if keys and not self._announced and self._requests.on_touch(keys):
            self._sighting(keys)
        if self._mirrors:
            keys = self.worlds.worlds[self.chosen].tier.held_among(keys)
        self._backing.touch(keys)

    def lookup(self, keys: Iterable[OffloadKey]) -> int | None:
        if type(keys) is not list and isinstance(keys, SINGLE_KEY_TYPES):
            refuse_single_key(keys, "lookup")
        keys = keys if isinstance(keys, list) else list(keys)
        found = super().lookup(keys)
        pending = self._pending
        if pending is not None and keys and pending[-1] == keys[-1] and len(keys) <= len(pending):
            self._run_worlds(len(pending) - len(keys))
            if found and self._mirrors:
                self._keep_hits(keys[:found])
        if not self._mirrors:
            self._probe.found = found
            self.feedback.lookup(keys)
            self.filter.lookup(keys)
        if found is not None and keys:
            self._minisim.on_lookup(keys)
        return found

    def _keep_hits(self, hits: list[OffloadKey]) -> None:
        """Make recent the tier's ``hits`` that the followed world holds now that it has run
        the request. The engine's touch came first and reached only the blocks the world
        held then: a hit on a block written under an earlier rule, which the world has just
        stored, stayed the coldest and, once loaded, unpinned, so the request's own store
        evicted it and the next request to reuse it missed its whole run."""
        self._backing.touch(self.worlds.worlds[self.chosen].tier.held_among(hits))

    def prepare_load(self, keys: Iterable[OffloadKey]) -> LoadStoreSpec:
        if type(keys) is not list and isinstance(keys, SINGLE_KEY_TYPES):
            refuse_single_key(keys, "prepare_load")
        keys = keys if isinstance(keys, list) else list(keys)
        # Counted once the tier has taken the load: a load it refuses (a block not stored,
        # or not yet written) is no hit, and leaves the request open for its offer.
        spec = super().prepare_load(keys)
        if keys:
            self._loaded += len(keys)
            self._minisim.on_full_hit(keys[-1])
        return spec

    def begin_request(
        self,
        keys: Sequence[OffloadKey],
        *,
        lookup_follows: bool = False,
        will_offer: bool = True,
        counted: int = 0,
        tier_hit: bool = False,
        gpu_held: int = 0,
        looked_up: bool = True,
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
        A request not looked up (``looked_up=False``) runs the same way, every world and
        mini-tier missing its keys past ``gpu_held``: the real tier served none of them,
        whatever a world holds.
        """
        check_request_keys(keys, "begin_request")  # before any change here
        counted, gpu_held = check_request_counts(counted, gpu_held)
        check_looked_up(tier_hit, looked_up)
        if keys:  # a request of no keys announces nothing
            if lookup_follows or will_offer:
                self._offers_follow = True
            if lookup_follows:
                self._whole_requests = True
            self._mirrors = self._offers_follow  # announced from here on
            if self._minisim.decides == (self._mirrors and self._exact_worlds):
                self._minisim = self._new_minisim()  # 1x tiers are needed now, or no longer
        super().begin_request(
            keys,
            lookup_follows=lookup_follows,
            will_offer=will_offer,
            counted=counted,
            tier_hit=tier_hit,
            gpu_held=gpu_held,
            looked_up=looked_up,
        )
        if not keys or lookup_follows:
            return
        if counted:
            self._pending = None  # a later part: the worlds ran the request with its first
        else:
            self._run_worlds(gpu_held, looked_up)
        if not self._mirrors:
            self.feedback.begin_request(
                keys, will_offer=will_offer, counted=counted, tier_hit=tier_hit
            )
            self._probe.found = 0
            first_new = max(counted, gpu_held)
            if first_new < len(keys):
                self.filter.lookup(list(keys[first_new:]))
        if counted == 0 and gpu_held < len(keys):
            self._minisim.on_lookup(keys[gpu_held:] if gpu_held else keys, looked_up)
            if not will_offer:
                if self._mirrors:  # announced after its loads: no offer follows
                    self._minisim.on_full_hit(keys[-1])
                else:  # a lower tier's lookup: its stores come as offers of their own
                    self._minisim.forget(keys[-1])

    def end_request(self, keys: Sequence[OffloadKey]) -> None:
        """See :meth:`AdmissionLayer.end_request`; a request never looked up (the GPU held
        all of it) runs through the worlds here, so that the last one counts too."""
        check_request_keys(keys, "end_request")
        pending = self._pending
        if pending is not None and keys and pending[-1] == keys[-1]:
            self._run_worlds(len(pending))
        if self.feedback.announced:
            self.feedback.end_request(keys)
        super().end_request(keys)

    def _sighting(self, keys: Sequence[OffloadKey]) -> None:
        if self._pending is not None:  # never looked up: the GPU held all of it
            self._run_worlds(len(self._pending))
        self._pending = keys
        self._minisim.on_request(keys, self._hashes(keys))
        self.ghost_hits = (self._world_feedback if self._mirrors else self.feedback).ghost_hits
        if self.write_credit is not None:
            self.write_credit.earn(len(keys))

    def _admit(self, offered: Sequence[OffloadKey], prefix: int) -> list[OffloadKey]:
        offered = offered if isinstance(offered, list) else list(offered)
        if self._pending is not None:  # an offer with no lookup before it
            self._run_worlds(0)
        if self._mirrors:
            self._minisim.on_offer_ruled(offered, self.worlds.worlds)
        else:
            admitted: dict[str, list[OffloadKey] | None] = {
                STORE_ALL: None,
                FILTER: self.filter.admit(offered),
                FEEDBACK: self.feedback.admit(offered),
            }
            # Hashed on their own: blocks let go in the tier above's eviction order are no
            # request, and may start and end like the last one with other keys between.
            self._minisim.on_written_back(offered, key_hashes(offered), admitted)
        if self._seen >= self._next_choice:
            self._choose()
        if self._mirrors:
            tier = self.worlds.worlds[self.chosen].tier
            keys = tier.held_among(offered)
            if self.chosen != STORE_ALL and self._cold_policy is not None:
                coldest = self._cold_policy.coldest()
                if coldest is not None:
                    keys = self._steer(offered, keys, tier.held, coldest)
            # Never more writes than store-everything: a refill after a switch (blocks that
            # world hit, the tier lacks) waits for writes the thriftier rule left unspent.
            if self._whole_requests:
                room = self.worlds.worlds[STORE_ALL].tier.total_writes - self._written
                if len(keys) > room:
                    keys = keys[: max(0, room)]
        else:
            chosen = admitted[self.chosen]
            keys = list(offered) if chosen is None else chosen
        if self.write_credit is not None:
            self.write_credit.earn(0)
            keys = keys[: self.write_credit.allowance()]
        return keys

    def _steer(
        self,
        offered: list[OffloadKey],
        keys: list[OffloadKey],
        held: Container[OffloadKey],
        coldest: Collection[OffloadKey],
    ) -> list[OffloadKey]:
        """What the real tier stores of ``offered`` (``keys``: what the followed world holds)
        with the hedge, after making the world's blocks among the coldest recent, so that
        the store evicts blocks the world does not hold first."""
        world = self.worlds[self.chosen].tier
        if self.capacity - len(world) > self.params.hedge_room * self.capacity:
            self.hedged += len(offered) - len(keys)
            keys = offered
        need = sum(1 for key in keys if key not in coldest) - (self.capacity - len(coldest))
        if need <= 0:
            return keys
        stored = set(keys)
        rescued = []
        for key in coldest:
            if key in held:
                rescued.append(key)
            elif key not in stored:
                need -= 1
                if not need:
                    break
        if rescued:
            self.backing.touch(rescued)
        return keys

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        output = super().prepare_store(keys)
        if output is not None:
            self.wrote(len(output.keys_to_store))
        return output

    def wrote(self, blocks: int) -> None:
        self._written += blocks
        if self.write_credit is not None:
            self.write_credit.spend(blocks)

    def _run_worlds(self, gpu_held: int, looked_up: bool = True) -> None:
        """Run the pending request through every world, ``gpu_held`` of its keys on the GPU
        (``looked_up``: see :meth:`begin_request`)."""
        keys = self._pending
        self._pending = None
        if keys:
            # Not min(): a builtin call costs more, and this runs every request.
            held = gpu_held if gpu_held < len(keys) else len(keys)
            self.worlds.request(keys, held, looked_up)
            self._seen += len(keys)

    def _choose(self) -> None:
        """Re-rank the worlds: none before one fills, none while a switch dwells."""
        self._next_choice = self._seen + max(16.0, self.capacity / 64)
        if self._mirrors:
            if not self.worlds.full or self._guard() or self._seen < self._dwell_until:
                return
            scores = self.worlds.scores()
            best = max(world.hits for world in self.worlds.worlds.values())
            informed = best >= self.params.evidence_tiers * self.capacity
        else:
            if self._seen < self._dwell_until:
                if self._left == STORE_ALL and self._trial_lost():
                    self._barred.add(self.chosen)
                    self._switch(STORE_ALL)
                return
            seen, tier = self._minisim.seen, self._minisim.tiers[STORE_ALL, 1.0][0]
            if self._settled_at is None:
                if seen < SAMPLED_WARMUP_TIERS * tier.capacity:
                    return
                self._settled_at = seen
                self._minisim.restart_window()
            if seen < self._settled_at + 0.5 * tier.capacity:
                return
            scores = self._minisim.scores()
            informed = True
        if self.write_credit is not None and not self.write_credit.budget.per_ref:
            per_ref = self.write_credit.writes_per_ref()
            self.objective = replace(self.objective, write_budget=per_ref)
        objective = self.objective
        if not self._mirrors:
            tolerance, margin = SAMPLED_OBJECTIVE
            objective = replace(objective, hit_tolerance=tolerance, switch_margin=margin)
        candidate = objective.choose(scores, self.chosen, informed)
        if candidate in self._barred:
            if self._regained(candidate):
                self._barred.discard(candidate)
            else:
                candidate = self.chosen
        leaves = candidate != self.chosen and informed and self._mirrors
        if (
            leaves
            and self.chosen != STORE_ALL
            and self._gained(candidate) < (self.params.switch_tiers * self.capacity)
        ):
            candidate = self.chosen
        self._switch(candidate)

    def _guard(self) -> bool:
        """Whether the guard holds the choice: a bound on what following the best world may
        cost, whatever the traffic does next.

        The gap is how far the real tier's hits since the start trail the leading baseline
        world's (less what earlier releases excused). Past the allowance (``loss_share`` of
        the references seen plus ``loss_tiers`` tier-fulls) the real tier follows that
        baseline, which stops the gap growing but for a refill; not while the followed
        world out-hits the leader over the window (the gap is then a switch's refill, which
        following the leader would only repeat). The guard lets go once the gap is back
        within ``GUARD_RELEASE`` of the allowance, or once some world has hit a switch's
        worth (``switch_tiers``) more than the guarded one since the hold began: then what
        is left of the gap beyond that share is excused, so the choice is free again and
        the guard holds anew only if the gap grows by another allowance. Under a write
        budget only the baselines that kept it count.

        The real tier's hits are the blocks loaded through this layer: where loads bypass
        it (vLLM's secondary tiers, SGLang's L3, which load from the tier directly), none
        are seen and the guard stays off."""
        p = self.params
        if not p.guard or not self._loaded:
            return False
        budget = self.objective.write_budget
        totals = {}
        for name in BASELINES:
            tier = self.worlds[name].tier
            if budget is None or tier.total_writes <= budget * self._seen:
                totals[name] = tier.total_hits
        if not totals:
            self.guarded = None
            return False
        leader = max(totals, key=totals.__getitem__)
        guarded = self.guarded
        if guarded in totals and totals[leader] < totals[guarded] + p.switch_tiers * self.capacity:
            leader = guarded
        gap = totals[leader] - self._loaded - self._excused
        allowance = p.loss_share * self._seen + p.loss_tiers * self.capacity
        worlds = self.worlds
        if guarded is not None:
            since = worlds.hits_since_mark
            gained = max(since(name) for name in CANDIDATES) - since(guarded)
            if gained >= p.switch_tiers * self.capacity:
                self._excused += max(0.0, gap - GUARD_RELEASE * allowance)
                self.guarded = None
                return False
            if gap <= GUARD_RELEASE * allowance:
                self.guarded = None
                return False
        elif gap <= allowance or worlds[leader].hits < worlds[self.chosen].hits:
            return False
        self.guarded = leader
        self._switch(leader)
        return True

    def _trial_lost(self) -> bool:
        """Whether a lower tier's switch away from store-everything has lost its trial:
        store-everything's sampled 1x tier has out-hit the followed rule's since the switch
        (:meth:`_outhit`). The blocks a thriftier rule
        refused are offered again only once recomputed and let go anew, so a dwell spent on
        a losing rule costs every hit it loses, and the refill after."""
        return self._outhit(STORE_ALL, self.chosen)

    def _regained(self, candidate: str) -> bool:
        """Whether a rule a lower tier's trial was lost to may be chosen again: its sampled
        1x tier has out-hit store-everything's since the last switch (the take-back, while
        store-everything is followed) by the trial's allowance. A rule that ties
        store-everything over the window yet loses each trial was otherwise left for after
        every dwell and taken back within the next: the tier flapped, each stay on the rule
        losing the hits its refusals cost."""
        return self._outhit(candidate, STORE_ALL)

    def _outhit(self, leader: str, other: str) -> bool:
        """Whether ``leader``'s sampled 1x tier has out-hit ``other``'s since the last switch
        by the guard's allowance (``loss_share`` of the references since, plus
        ``loss_tiers`` tier-fulls), scaled to the sampled keys."""
        sim, p = self._minisim, self.params
        allowance = p.loss_share * (self._seen - self._switched_at) + p.loss_tiers * self.capacity
        lead = sim.hits_since_mark(leader) - sim.hits_since_mark(other)
        return lead > allowance * sim.sampling_rate

    def _gained(self, candidate: str) -> float:
        """Hits ``candidate``'s world made beyond the followed world's since the last
        switch, over the window: a switch must first have paid for the refill it costs."""
        since = self.worlds.hits_since_mark
        return since(candidate) - since(self.chosen)

    def _switch(self, candidate: str) -> None:
        if candidate != self.chosen:
            self._left, self.chosen = self.chosen, candidate
            self.switches += 1
            self.worlds.mark()
            self._switched_at = self._seen
            if self._minisim.decides:
                self._minisim.mark()
            dwell = self.params.dwell_tiers * self.capacity
            self._dwell_until = self._seen + min(dwell, DWELL_SHARE * self._seen)

    def whatif(self, cumulative: bool = False) -> list[WhatIf]:
        """Every candidate at every capacity factor over recent traffic (``cumulative``:
        since the start): the mini-tiers' figures, and at 1x the exact worlds' where the
        mini-tiers run none (a mirroring tier under LRU)."""
        sim = self._minisim
        figures = sim.figures(cumulative)
        if not sim.decides:
            figures += self.worlds.figures(cumulative)
            order = {name: index for index, name in enumerate(CANDIDATES)}
            figures.sort(key=lambda f: (f.capacity_factor, order[f.candidate]))
        return figures

    def stats(self) -> AdmissionStats:
        """:meth:`step_stats` with the cumulative what-if figures (``whatif_total``)."""
        return replace(self.step_stats(), whatif_total=tuple(self.whatif(cumulative=True)))

    def step_stats(self) -> AdmissionStats:
        """Every figure but ``whatif_total``: the engines report the recent what-if figures
        at every step, and the cumulative ones (about 20 us more per call on the dev VM)
        only the simulator's report reads, once.

        The real-fed candidates count in memory whether fed or not: they are made with
        the layer (a tier may stop mirroring at any request), and their tables take their
        size then. Control and ghost hits are the rule the real tier's choice is made on."""
        world_rule, real_rule = self._world_feedback.stats(), self.feedback.stats()
        rules = [world_rule, real_rule] if self._mirrors else [real_rule, world_rule]
        tables = [self._world_filter.reuse, self.filter.reuse]
        counted = self._stats(
            rules[0].control,
            sum(rule.memory_bytes for rule in rules)
            + sum(table.memory_bytes for table in tables)
            + self._minisim.memory_bytes
            + self.worlds.memory_bytes,
            sum(rule.tracked_keys for rule in rules)
            + sum(table.max_keys for table in tables)
            + self._minisim.tracked_keys
            + self.worlds.tracked_keys,
            rules[0].ghost_hits,
        )
        return replace(counted, candidate=self.chosen, whatif=tuple(self.whatif()))


OBJECTIVE_PARAMS = ("hit_tolerance", "switch_margin", "write_margin")
"""The :class:`OptimiserParams` fields an :class:`Objective` gives too."""


def _merged_params(
    params: OptimiserParams | None, objective: Objective | None, window_tiers: float | None
) -> OptimiserParams:
    """``params`` (the defaults if ``None``) with the settings ``objective`` and
    ``window_tiers`` give in it, checked as the parameters: an out-of-range window was a
    bare ``ValueError`` from deep in the constructor. :class:`InvalidArgumentError` too for
    an argument of the wrong type, or a setting that ``params`` moves from its default
    while ``objective`` or ``window_tiers`` gives another value for it."""
    if params is not None and not isinstance(params, OptimiserParams):
        raise InvalidArgumentError(f"params must be OptimiserParams, got {params!r}")
    if objective is not None and not isinstance(objective, Objective):
        raise InvalidArgumentError(f"objective must be an Objective, got {objective!r}")
    given = params or OptimiserParams()
    explicit = {name: getattr(objective, name) for name in OBJECTIVE_PARAMS if objective}
    if window_tiers is not None:
        explicit["window_tiers"] = window_tiers
    defaults = OptimiserParams()
    for name, value in explicit.items():
        mine = getattr(given, name)
        if mine != getattr(defaults, name) and mine != value:
            where = "the objective" if name in OBJECTIVE_PARAMS else "the window_tiers argument"
            raise InvalidArgumentError(
                f"{name} is given twice, {mine!r} in params and {value!r} in {where}: give it once"
            )
    return replace(given, **explicit) if explicit else given


def _policy_of(manager: OffloadingManager) -> CachePolicy | None:
    """The eviction policy of the tier under ``manager``, if one is found."""
    for layer in stack_layers(manager):
        policy = getattr(layer, "policy", None)
        if isinstance(policy, CachePolicy):
            return policy
        policy = getattr(getattr(layer, "cpu", None), "policy", None)
        if isinstance(policy, CachePolicy):
            return policy
    return None


def tier_policy(manager: OffloadingManager) -> type[CachePolicy]:
    """The eviction policy class of the tier under ``manager`` (LRU if none is found)."""
    policy = _policy_of(manager)
    return LRUCachePolicy if policy is None else type(policy)


def _steerable_policy(manager: OffloadingManager) -> CachePolicy | None:
    """The policy of the tier under ``manager`` where touches steer its evictions
    (:meth:`CachePolicy.coldest` is not ``None``); ``None`` where they do not."""
    policy = _policy_of(manager)
    return None if policy is None or policy.coldest() is None else policy
