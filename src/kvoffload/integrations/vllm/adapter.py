"""vLLM 0.33's per-key manager API on top of a kvoffload manager (the seed batch API).

Every call keeps its meaning: ``lookup(key)`` answers as a one-key batch
lookup, its ``None`` ("ask again") ``RETRY`` and its pending block
``HIT_PENDING``; loads and stores pass straight through. With lower tiers below
the CPU tier, vLLM's scan of a request (its keys one at a time, in prefix order)
is looked up as the seed's connector looked a request up, in one batch lookup
at the scan's first key, so that a run only a lower tier holds is promoted in
one read; the scan's later keys are answered from what the CPU tier then holds.
Where vLLM 0.33 and the seed differ, this adapter follows vLLM:

* recency is request-scoped: keys a request reads or stores become recent
  when first seen by it (head of the prefix most recent; vLLM 0.33 only, 0.32
  waits), and once more, in prefix order, when the request finishes; vLLM's
  scheduler no longer calls ``touch``;
* admission counts store offers (:class:`OfferCountFilter`), not lookups,
  and keys already held are never filtered.

An admission layer in the backing stack (``kvoffload.admission``) is told of
each request explicitly (``begin_request`` at its first store offer, or when
it finishes if it offered nothing, ``end_request`` after the offer), as its
keys in prefix order: the GPU's prefix hit first (the keys vLLM recorded for
the request before the first one it looked up in the step that ran or loaded
it, all of them if it looked up none then; not the first one offered, as vLLM
offers a request that loaded nothing from its first block), then those it
looked up and offered, ``tier_hit`` set if vLLM loaded part of it from the
tier; a later offer shows the request again, grown, with ``counted`` set to
the keys shown before; per-key lookups and touches go past it to the tier, so
they count no sightings.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TierFilter,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoffload.admission import AdmissionLayer, AdmissionStats
from kvoffload.core.keys import GROUP_IDX_BYTES, OffloadKey
from kvoffload.core.manager import OffloadingEvent as SeedEvent
from kvoffload.core.manager import OffloadingManager as SeedManager
from kvoffload.core.specs import BlockIDsLoadStoreSpec
from kvoffload.integrations.vllm.offer_filter import OfferCountFilter
from kvoffload.managers import CPUOffloadingManager
from kvoffload.managers.stack import Stack
from kvoffload.observe.counters import ManagerCounters
from kvoffload.observe.metrics import SWITCHES, recovery_samples, tier_counts, whatif_gauges
from kvoffload.policies import BlockStatus, CachePolicy
from kvoffload.sim.tier_model import recovery_counts

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import ScheduleEndContext

METRIC_PREFIX = "vllm:kvoffload_"
"""Our counters appear on vLLM's ``/metrics`` under this prefix."""

HELD_BLOCKS_METRIC = f"{METRIC_PREFIX}held_blocks"
GHOST_HITS_METRIC = f"{METRIC_PREFIX}admission_ghost_hits"
CONTROL_METRIC = f"{METRIC_PREFIX}admission_control"
"""Reported only when an admission layer is configured."""
SWITCHES_METRIC = f"{METRIC_PREFIX}{SWITCHES}"
"""Reported only for the optimiser (a layer with what-if figures)."""

_COUNTER_METRICS = {name: f"{METRIC_PREFIX}{name}" for name in ManagerCounters().as_dict()}
"""Each counter's vLLM metric name, formatted once rather than on every step's report."""

Probe = Callable[[OffloadKey], BlockStatus | None]
"""Where a key stands in the tier: ``None`` if absent, else its status (pending or ready)."""

REPORTS_FLUSH = hasattr(OffloadingManager, "on_reset_flushed")
"""Whether this vLLM tells the manager when the jobs in flight at a reset are done (0.33;
0.32 never does, so holding promotions until then would hold them for good)."""

RELEASES_METADATA = "metadata_only" in getattr(OffloadingEvent, "__dataclass_fields__", {})
"""Whether this vLLM's events can release a failed store's slot without announcing an
eviction (0.33: its event tracker drops what it recorded at ``prepare_store``; 0.32 has no
such event, and nothing to drop)."""

InfoSeries = Mapping[str, str | int | float | bool]
"""One series of ``vllm:kv_offload_config_info``: label name to value."""

_EVENT_MEDIA: dict[str, tuple[Any, Any, str | None, bool]] = {
    "CPU": (Medium.CPU, None, None, False),
    "DISK": (Medium.STORAGE, Locality.LOCAL, "DISK", True),
    "REMOTE": (Medium.STORAGE, Locality.REMOTE, "REMOTE", False),
}
"""Each of our tiers' media as vLLM's event fields ``(medium, locality, ownership,
removal_expected)``: vLLM's ``Medium`` has CPU and STORAGE only, so a lower tier is
STORAGE with its locality and our medium name as the event's ownership (the tier that
published it). The disk tier announces its evictions; the shared tier never removes."""

_PROMOTED_SOURCES = {"DISK": CacheHitSource.DISK, "REMOTE": CacheHitSource.EXTERNAL_UNSPECIFIED}
"""Where a block promoted from each lower tier came from, in vLLM's
``vllm:prompt_tokens_cached_by_source`` terms (a remote store is its
``external_unspecified``, as for the shared tier as a vLLM secondary tier); a block the CPU
tier held is ``host``."""


class LayerCount:
    """One of the admission layer's running counts, reported to vLLM as increments. A reset
    builds a new layer whose count starts at 0, so the old layer's count is carried."""

    def __init__(self) -> None:
        self._carried = 0
        self._reported = 0

    def carry(self, count: int) -> None:
        """The count of a layer a reset is about to replace."""
        self._carried += count

    def increment(self, count: int) -> int:
        """What the total grew by since the last report, ``count`` being the layer's now."""
        total = self._carried + count
        grown, self._reported = total - self._reported, total
        return grown


def _by_name_and_tier(counts: Mapping[str, Mapping[str, int]]) -> dict[tuple[str, str], int]:
    return {(name, tier): value for tier, found in counts.items() for name, value in found.items()}


def report_whatif(
    stats: Any, layer_stats: AdmissionStats, switches: LayerCount, tier: tuple[str, ...]
) -> None:
    """An optimiser's what-if and candidate gauges and its switches into vLLM's ``stats``,
    ``tier`` after the labels where the spec declared a ``tier`` label (nothing for another
    layer): the CPU tier's, a lower tier's and a vLLM secondary tier's optimiser alike."""
    for name, series in whatif_gauges(layer_stats).items():
        for labels, level in series.items():
            stats.set_gauge(f"{METRIC_PREFIX}{name}", level, labels + tier)
    if layer_stats.whatif:
        stats.increase_counter(SWITCHES_METRIC, switches.increment(layer_stats.switches), tier)


@dataclass
class _RequestKeys:
    """The keys one request has read or stored, first-seen order (per-request scratch)."""

    owner: object
    generation: int
    """The owner's cache generation: a reset drops every block, and what the request read
    or stored before it (vLLM's manager forgets it too; the request offers again)."""
    seen: dict[OffloadKey, None] = field(default_factory=dict)
    unsighted: dict[OffloadKey, None] = field(default_factory=dict)
    """Looked-up keys not yet shown to the admission layer."""
    sighted: dict[OffloadKey, None] = field(default_factory=dict)
    """Keys shown to the admission layer, in the order shown."""
    tier_hit: bool = False
    """The tier served part of this request: vLLM loaded from it (a lookup hit alone is no
    service: vLLM may delay the request and then find the blocks on the GPU)."""
    scheduled: bool = False
    """vLLM's scheduler has run this request: lookups it repeats (after a preemption) are
    kept, those of a request it never ran are an attempt it will make again."""
    reused: set[OffloadKey] = field(default_factory=set)
    """Keys it read: loaded, or found ready when it offered them (not those it stored)."""
    stored: set[OffloadKey] = field(default_factory=set)
    """Keys it got a slot for."""
    store_missed: set[OffloadKey] = field(default_factory=set)
    """Keys it offered that the tier lacked, told to the policy once (ARC's ghosts)."""
    promoted_from: dict[OffloadKey, str] = field(default_factory=dict)
    """Keys it found being promoted from a lower tier, and that tier's medium."""
    order: dict[bytes, list[OffloadKey]] = field(default_factory=dict)
    """Its keys in prefix order, per KV group (a key's last bytes), from the positions
    vLLM recorded for it."""
    index: dict[OffloadKey, int] = field(default_factory=dict)
    """Each key's place in its group's ``order``."""
    recorded: int = 0
    """How many key positions vLLM had recorded when ``order`` was built."""
    scan: _Scan | None = None
    """vLLM's scan of its keys in progress, if any."""


@dataclass
class _Scan:
    """vLLM's one-key lookups of one request in one step, in prefix order."""

    step: int
    """The adapter's scheduler step it runs in: vLLM scans a request once a step."""
    last: int
    """The place (in the request's ``order``) of the key it looked up last."""
    batched: bool
    """Begun by a batch lookup of the request from its first key: its later keys are
    answered from the CPU tier (otherwise each is a one-key lookup)."""
    deferred: bool = False
    """A key of it was answered ``RETRY`` or ``HIT_PENDING``: vLLM asks again later."""


class VLLMManagerAdapter(OffloadingManager):  # type: ignore[misc]
    """A vLLM ``OffloadingManager`` backed by a kvoffload manager.

    ``build`` makes the backing stack (:func:`kvoffload.tiers.build_stack`); it is called again
    by :meth:`reset_cache`, which drops every block. ``offer_filter`` is the
    vLLM-style admission (``None``: store everything offered).
    """

    def __init__(
        self,
        build: Callable[[], Stack],
        offer_filter: OfferCountFilter | None = None,
        bytes_per_block: int = 0,
        on_shutdown: Callable[[], None] | None = None,
        info: Sequence[InfoSeries] = ({},),
        recency_at_access: bool = True,
        whatif_tier_label: bool = False,
    ) -> None:
        self._build = build
        self._tier_label: tuple[str, ...] = ("",) if whatif_tier_label else ()
        """The CPU tier's ``tier`` label value, where the spec declared the label (a lower
        tier's optimiser exports beside it)."""
        self._lower_switches = {"disk": LayerCount(), "remote": LayerCount()}
        self._recency_at_access = recency_at_access
        self._on_shutdown = on_shutdown
        self._info = [dict(series) for series in info]
        self._lock = threading.Lock()
        self._promotions_held = False
        self._generation = 0
        self._step = 0
        self._install()
        self._filter = offer_filter
        self._bytes_per_block = bytes_per_block
        self.counters = ManagerCounters()
        self._reported = ManagerCounters().as_dict()
        """The counters as the last :meth:`get_stats` read them."""
        self._evicted_before = 0
        """With a tiered manager: what the CPU tiers a reset replaced evicted (each new one
        counts from 0). Its own count is the evictions': promotions evict CPU blocks too."""
        self._ghost_hits = LayerCount()
        self._switches = LayerCount()
        self._tier_counts: dict[tuple[str, str], LayerCount] = {}
        """Each lower tier's counts (:func:`~kvoffload.observe.metrics.tier_counts`), by name
        and tier: a reset closes the tiers and builds new ones that count from 0."""
        self._queued: list[Any] = []
        """Events in call order, not taken yet: vLLM's (converted from the backing manager's,
        which a reset replaces) and failed stores' released keys (a list each)."""
        self._dropped_at_reset = _dropped_at_reset(self._info)
        """Our media whose blocks a reset removes with an event each (the local disk tier)."""
        self._announced: dict[str, set[OffloadKey]] = {}
        """Per such medium, the keys its events said it holds (stored, not removed since)."""
        self._looked_up_in_step: dict[str, _RequestKeys] = {}
        """The requests that looked up keys in this scheduler step, by request id."""

    def _install(self) -> None:
        """Build the backing stack; lookups and touches bypass its admission layer."""
        stack = self._build()
        self._manager: SeedManager = stack.manager
        self._probe: Probe = stack.cpu.block_status
        self._layer: AdmissionLayer | None = stack.admission
        self._direct: SeedManager = stack.direct
        self._cpu: CPUOffloadingManager = stack.cpu
        self._tiered = stack.tiered
        self._has_lower_tiers = stack.tiered is not None and bool(stack.tiered.tiers)
        self._lower_layers = [
            (tier, layer)
            for tier, layer in (("disk", stack.disk_admission), ("remote", stack.remote_admission))
            if layer is not None
        ]
        policy = type(self._cpu.policy)
        # Only a policy with request-scoped rules of its own (not LRU) pays for their bookkeeping.
        self._tells_reads = policy.finish_request is not CachePolicy.finish_request
        self._learns_from_misses = policy.store_missed is not CachePolicy.store_missed

    @property
    def lock(self) -> threading.Lock:
        """vLLM's exclusion over this manager and its tiers, held by its scheduler from a
        step's lookups to the loads that pin their hits. A real lock: a caller on another
        thread cannot evict or promote in between. Our tiers' I/O threads never enter the
        manager, so only vLLM's callers ever contend for it."""
        return self._lock

    @property
    def backing(self) -> SeedManager:
        return self._manager

    def on_new_request(self, req_context: ReqContext) -> Any:
        self._request_keys(req_context)
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> Any:
        self.counters.lookups += 1
        if self._layer is not None:
            state = self._request_keys(req_context)
            state.unsighted[key] = None
            self._looked_up_in_step[req_context.req_id] = state
        if self._promotions_held:
            if self._probe(key) is None:
                # Until on_reset_flushed, a worker may still write a slot the reset freed:
                # no promotion may fill one, so a block only in a lower tier is recomputed.
                return LookupResult.MISS
            answer = self._lookup_one(key, req_context)
        elif self._has_lower_tiers:
            answer = self._lookup_in_scan(key, req_context)
        else:
            answer = self._lookup_one(key, req_context)
        if answer is LookupResult.HIT:
            self.counters.lookup_hit_blocks += 1
        elif answer is LookupResult.RETRY and self._tiered is not None:
            medium = self._tiered.promoting_from(key)
            if medium is not None:
                self._request_keys(req_context).promoted_from[key] = medium
        return answer

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        """Where a block vLLM loads for the request came from: our CPU tier (``host``, as
        vLLM's own CPU manager answers), or the lower tier the request saw it promoted from."""
        state = req_context.get_state(_RequestKeys)
        if not self._owns(state) or key not in state.promoted_from:
            return CacheHitSource.HOST
        return _PROMOTED_SOURCES.get(state.promoted_from[key], CacheHitSource.HOST)

    def _lookup_one(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """``key``'s answer as a one-key batch lookup."""
        hits = self._batch_lookup((key,), req_context)
        if hits is None:
            return LookupResult.RETRY
        if hits:
            return LookupResult.HIT
        return LookupResult.MISS if self._probe(key) is None else LookupResult.HIT_PENDING

    def _lookup_in_scan(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """``key``'s answer within vLLM's scan of its request, with lower tiers below.

        The scan's first key looks the request up from that key on in one batch lookup,
        as the seed's connector did: a run only the lower tiers hold is promoted in one
        read (one key at a time, each key started a read, and a round trip, of its own),
        the CPU hits in front are shielded from the eviction that makes room for it, and
        the lower tiers' books see the request once, not each key as a request. The
        scan's later keys are answered from what the CPU tier then holds, without asking
        the backing manager again: nothing else enters it before vLLM loads what the scan
        found (it holds the lock), and the hits the batch lookup answered are claimed for
        that load. A key the CPU tier lacks past one still to come (promoted or stored) is
        ``RETRY``: vLLM asks again, and its next scan looks the key up. Keys vLLM asks
        from the last one back (a sliding window) are one-key lookups, as before: a batch
        from each would read the request's tail again for every key.
        """
        state = self._request_keys(req_context)
        index = self._place(state, key, req_context)
        scan = state.scan
        if scan is not None and scan.step != self._step:
            scan = None
        if index is None:
            state.scan = None
            return self._lookup_one(key, req_context)
        if scan is not None and index == scan.last - 1:
            state.scan = _Scan(self._step, index, batched=False)
            return self._lookup_one(key, req_context)
        if scan is None or index != scan.last + 1 or not scan.batched:
            scan = state.scan = _Scan(self._step, index, batched=True)
            self._batch_lookup(state.order[key[-GROUP_IDX_BYTES:]][index:], req_context)
        scan.last = index
        block = self._probe(key)
        if block is None:
            answer = LookupResult.RETRY if scan.deferred else LookupResult.MISS
        elif block.is_ready:
            answer = LookupResult.HIT
        elif self._tiered is not None and self._tiered.is_promoting(key):
            answer = LookupResult.RETRY
        else:
            answer = LookupResult.HIT_PENDING
        scan.deferred |= answer in (LookupResult.RETRY, LookupResult.HIT_PENDING)
        return answer

    def _batch_lookup(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> int | None:
        """The seed's lookup of ``keys``, promoting only from the lower tiers the request
        lets it read (vLLM's per-request ``kv_load_tiers``, by each tier's medium and
        locality; the CPU tier always answers, as in vLLM's tiering)."""
        if self._tiered is None:
            return self._direct.lookup(keys)
        allowed = req_context.load_tier_filter
        tiers = (
            None
            if allowed is TierFilter.ALL
            else [
                index
                for index, tier in enumerate(self._tiered.tiers)
                if allowed.allows(*_EVENT_MEDIA[tier.medium][:2])
            ]
        )
        return self._tiered.lookup(keys, tiers, request=req_context.req_id)

    def _place(self, state: _RequestKeys, key: OffloadKey, req_context: ReqContext) -> int | None:
        """``key``'s place in its request's prefix order (``None``: vLLM recorded no
        position for it)."""
        recorded: Mapping[OffloadKey, int] = getattr(req_context, "_offload_key_positions", {})
        if len(recorded) != state.recorded:
            # vLLM records a request's keys as its blocks fill: the order grows with them.
            state.order = _prefix_order(recorded)
            state.index = {
                key: place for keys in state.order.values() for place, key in enumerate(keys)
            }
            state.recorded = len(recorded)
        return state.index.get(key)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> Any:
        keys = list(keys)
        spec = self._manager.prepare_load(keys)
        self.counters.loads += len(keys)
        self.counters.bytes_loaded += len(keys) * self._bytes_per_block
        if self._layer is not None and keys:
            # vLLM loads only for the attempt it runs (an async load runs before the request
            # is scheduled): its lookups are the request's own.
            state = self._request_keys(req_context)
            state.tier_hit = state.scheduled = True
        if self._tells_reads:
            state = self._request_keys(req_context)
            state.reused.update(key for key in keys if key not in state.stored)
        self._seen(keys, req_context)
        return _vllm_spec(spec)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._direct.touch(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._manager.complete_load(keys)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> Any:
        original = list(keys)
        c = self.counters
        c.stores_offered += len(original)
        status = [self._probe(key) for key in original]
        offered = original
        admitted: set[OffloadKey] | None = None
        if self._filter is not None:
            self._filter.record(original)
            candidates = [key for key, st in zip(original, status, strict=True) if st is None]
            admitted = set(self._filter.admit(candidates))
            c.stores_skipped += len(candidates) - len(admitted)
            # Held keys stay in the offer: the backing manager shields them from eviction.
            offered = [
                key
                for key, st in zip(original, status, strict=True)
                if st is not None or key in admitted
            ]
        # As vLLM: the request has seen its ready blocks and its store candidates, stored or not.
        seen = [
            key
            for key, st in zip(original, status, strict=True)
            if (st.is_ready if st is not None else admitted is None or key in admitted)
        ]
        state = self._request_keys(req_context)
        if self._tells_reads:
            state.reused.update(
                key
                for key, st in zip(original, status, strict=True)
                if st is not None and st.is_ready and key not in state.stored
            )
        if self._learns_from_misses:
            missed = [
                key
                for key, st in zip(original, status, strict=True)
                if st is None
                and (admitted is None or key in admitted)
                and key not in state.store_missed
            ]
            if missed:
                # Before the store: ARC's ghosts are gone once the blocks are inserted.
                state.store_missed.update(missed)
                self._cpu.policy.store_missed(missed)
        began = None if self._layer is None else self._sight(self._layer, original, req_context)
        output = self._manager.prepare_store(offered)
        if output is not None and self._tells_reads:
            state.stored.update(output.keys_to_store)
        if began and self._layer is not None:
            self._layer.end_request(began)
        if self._layer is not None and output is not None:
            # The layer holds back fresh keys silently: whatever fresh key got no slot.
            stored = set(output.keys_to_store)
            held = {key for key, st in zip(original, status, strict=True) if st is not None}
            fresh = sum(1 for key in offered if key not in held)
            c.stores_skipped += fresh - len(output.keys_to_store)
            seen = [key for key in seen if key in held or key in stored]
        # After the insertion, so that the head of the prefix ends up the most recent.
        self._seen(seen, req_context)
        if output is None:
            c.stores_rejected += len(offered)
            return None
        c.stores_admitted += len(output.keys_to_store)
        if self._tiered is None:  # else counted by the tiered manager (:meth:`get_stats`)
            c.evictions += len(output.evicted_keys)
        return PrepareStoreOutput(
            keys_to_store=list(output.keys_to_store),
            store_spec=_vllm_spec(output.store_spec),
            evicted_keys=list(output.evicted_keys),
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        keys = list(keys)
        pending = [key for key in keys if (st := self._probe(key)) is not None and not st.is_ready]
        self._manager.complete_store(keys, success)
        c = self.counters
        if success:
            c.stores_completed += len(pending)
            c.bytes_stored += len(pending) * self._bytes_per_block
        else:
            c.stores_failed += len(pending)
            if RELEASES_METADATA and self._cpu.events_enabled:
                released = [key for key in pending if self._probe(key) is None]
                if released:
                    self._queue_events()
                    self._queued.append(released)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._looked_up_in_step.pop(req_context.req_id, None)
        if self._tiered is not None:
            # An aborted request's retry will not come: its prompt's next request is new.
            self._tiered.request_finished(req_context.req_id)
        state = req_context.get_state(_RequestKeys)
        if not self._owns(state):
            return
        if self._layer is not None and (state.unsighted or not state.sighted):
            # A request that only hit (or stored nothing, or the GPU held all of it) is still
            # a sighting of its keys.
            began = self._sight(self._layer, (), req_context, will_offer=False)
            if began:
                self._layer.end_request(began)
        if self._tiered is not None:
            # A promotion that landed for a request vLLM then aborted is of no use to it.
            self._tiered.release_reservations(chain(state.index, state.seen))
        if not state.seen:
            return
        keys = list(state.seen)
        positions = [req_context.get_offload_key_position(key) for key in keys]
        if None not in positions:
            keys = [key for _, key in sorted(zip(positions, keys, strict=True))]
        self._cpu.policy.finish_request(keys, state.reused, state.stored - state.reused)
        for done in (state.seen, state.sighted, state.reused, state.stored, state.store_missed):
            done.clear()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """A request that looked up keys in this step but was not scheduled in it (vLLM
        delayed it, for a tier still answering or blocks another request is loading, or
        it did not fit) is asked again in a later step, from the GPU hit it has then: the
        keys it looked up now say nothing of that hit, and are forgotten."""
        self._step += 1
        scheduled = set(context.new_req_ids)
        for req_id, state in self._looked_up_in_step.items():
            if req_id in scheduled:
                state.scheduled = True
            elif not state.scheduled:
                state.unsighted.clear()
        self._looked_up_in_step.clear()

    def has_pending_work(self) -> bool:
        """Whether vLLM must keep stepping, as it does while so even with no request: a lower
        tier's promotion or write is unsettled, or what one settled is yet to be published.
        Settled work is applied here, so that an idle engine publishes a block its disk
        tier stored (or a write that failed) at once, not with its next request."""
        if self._tiered is None:
            return False
        unsettled = self._tiered.has_pending_work()  # before the poll: none finishes unseen
        self._tiered.poll()
        self._queue_events()
        return unsettled or bool(self._queued)

    def take_events(self) -> list[Any]:
        self._queue_events()
        queued, self._queued = self._queued, []
        events = []
        for item in queued:
            if isinstance(item, list):
                # As vLLM: a key stored again since its store failed is held, not released.
                keys = [key for key in item if self._probe(key) is None]
                if keys:
                    events.append(
                        OffloadingEvent(
                            keys=keys, medium=Medium.CPU, removed=True, metadata_only=True
                        )
                    )
            else:
                events.append(item)
        return events

    def _queue_events(self, events: Iterable[SeedEvent] | None = None) -> None:
        """``events`` (the backing manager's), as vLLM's, onto the queue in call order; what
        they say the media a reset drops hold is kept for the reset."""
        for event in self._manager.take_events() if events is None else events:
            if event.medium in self._dropped_at_reset:
                announced = self._announced.setdefault(event.medium, set())
                if event.removed:
                    announced.difference_update(event.keys)
                else:
                    announced.update(event.keys)
            medium, locality, ownership, announces_removal = _EVENT_MEDIA[event.medium]
            self._queued.append(
                OffloadingEvent(
                    keys=list(event.keys),
                    medium=medium,
                    removed=event.removed,
                    locality=locality,
                    ownership=ownership,
                    removal_expected=announces_removal and not event.removed,
                )
            )

    def reset_cache(self) -> None:
        """Drop every block of the CPU tier (and, through ``build``, what the spec says
        of the lower tiers); promotions wait for :meth:`on_reset_flushed`."""
        if self._layer is not None:
            self._ghost_hits.carry(self._layer.ghost_hits)
            self._switches.carry(self._layer.switches)
        for tier, layer in self._lower_layers:
            self._lower_switches[tier].carry(layer.switches)
        closing = self._tiered.tiers if self._tiered is not None else []
        closing_cpu = self._tiered.cpu_stats if self._tiered is not None else None
        # As vLLM's manager, whose reset keeps its queue: events from before it still go out.
        self._queue_events()
        if self._has_lower_tiers:
            # Promotions land between steps too (has_pending_work); vLLM publishes their
            # CPU stores after its AllBlocksCleared, telling of blocks the reset drops.
            self._queued = [item for item in self._queued if not _announces_cpu_block(item)]
        closed = self._manager
        self._install()
        # Closing the old tiers lands their writes in flight (the shared tier keeps those
        # blocks) and may remove broken ones: their events go out too, but not the stores of
        # promotions landing in the CPU tier the reset dropped.
        self._queue_events(
            event for event in closed.take_events() if event.medium != "CPU" or event.removed
        )
        self._announce_dropped()
        # Read once closed, when their writes are in.
        for key, count in _by_name_and_tier(tier_counts(closing)).items():
            self._tier_counts.setdefault(key, LayerCount()).carry(count)
        if closing_cpu is not None:
            self._evicted_before += closing_cpu.evicted
        self._generation += 1
        self._promotions_held = self._has_lower_tiers and REPORTS_FLUSH

    def _announce_dropped(self) -> None:
        """A removal for every block a medium the reset dropped was last said to hold."""
        for medium in sorted(self._dropped_at_reset):
            keys = self._announced.pop(medium, set())
            if keys:
                vllm_medium, locality, ownership, _ = _EVENT_MEDIA[medium]
                self._queued.append(
                    OffloadingEvent(
                        keys=sorted(keys),
                        medium=vllm_medium,
                        removed=True,
                        locality=locality,
                        ownership=ownership,
                    )
                )

    def on_reset_flushed(self) -> None:
        """The workers have reported every job in flight at the reset: promotions may
        fill the slots it freed again."""
        self._promotions_held = False

    def config_info(self) -> list[dict[str, Any]]:
        """The static facts of each tier, for ``vllm:kv_offload_config_info``."""
        return [dict(series) for series in self._info]

    def shutdown(self) -> None:
        """vLLM's end of the engine: let the spec finish and close its tiers."""
        if self._on_shutdown is not None:
            self._on_shutdown()

    def get_stats(self) -> Any:
        """Our counters since the last call, as vLLM's stats (declared by the spec)."""
        self.counters.held_blocks = self._cpu.num_blocks - self._cpu.num_free_blocks
        if self._tiered is not None:
            self.counters.evictions = self._evicted_before + self._tiered.cpu_stats.evicted
        # Read once: vLLM asks every step, and each reading copies every counter.
        reported, self._reported = self._reported, self.counters.as_dict()
        stats = OffloadingConnectorStats()
        for name, value in self._reported.items():
            if name == "held_blocks":
                stats.set_gauge(HELD_BLOCKS_METRIC, value)
            else:
                stats.increase_counter(_COUNTER_METRICS[name], value - reported[name])
        if self._layer is not None:
            ghost_hits = self._ghost_hits.increment(self._layer.ghost_hits)
            stats.increase_counter(GHOST_HITS_METRIC, ghost_hits)
            layer_stats = self._layer.step_stats()
            stats.set_gauge(CONTROL_METRIC, layer_stats.control)
            report_whatif(stats, layer_stats, self._switches, self._tier_label)
        if self._tier_label:  # declared: the lower tiers' optimisers export too
            for tier, layer in self._lower_layers:
                report_whatif(stats, layer.step_stats(), self._lower_switches[tier], (tier,))
        if self._tiered is not None:
            counts = {tier.medium.lower(): recovery_counts(tier) for tier in self._tiered.tiers}
            found = {name: tier_counts for name, tier_counts in counts.items() if tier_counts}
            for name, labels, value in recovery_samples(found):
                stats.set_gauge(f"{METRIC_PREFIX}{name}", value, labels)
        open_tiers = self._tiered.tiers if self._tiered is not None else []
        lower = _by_name_and_tier(tier_counts(open_tiers))
        for key in lower:
            self._tier_counts.setdefault(key, LayerCount())
        for (name, tier), count in self._tier_counts.items():  # a tier not reopened: 0 more
            grown = count.increment(lower.get((name, tier), 0))
            stats.increase_counter(f"{METRIC_PREFIX}{name}", grown, (tier,))
        return stats

    def _request_keys(self, req_context: ReqContext) -> _RequestKeys:
        state = req_context.get_state(_RequestKeys)
        if not self._owns(state):
            state = _RequestKeys(self, self._generation)
            req_context.set_state(state)
        return state  # type: ignore[no-any-return]

    def _owns(self, state: _RequestKeys | None) -> bool:
        """Whether ``state`` is this adapter's, since its last reset."""
        return state is not None and state.owner is self and state.generation == self._generation

    def _sight(
        self,
        layer: AdmissionLayer,
        offered: Sequence[OffloadKey],
        req_context: ReqContext,
        will_offer: bool = True,
    ) -> list[OffloadKey]:
        """Show the request's keys it has not seen yet to the layer, in prefix order, after
        those shown before (counted already: an offer in parts is one request, as vLLM
        offers a prompt prefilled in chunks and each block decoding fills); the keys shown
        (none: nothing new to show).

        The first time, the GPU's prefix hit comes first, as the request's keys before the
        first one vLLM's scheduler looked up (it looks up past the GPU hit only), found in
        the key positions it records for the whole request. A request it never looked up
        had less than one block past the GPU hit: all of it is GPU-held (a request that
        skips reading caches is counted so too). vLLM offers a request that loaded nothing
        from its first block, GPU-held ones included, so the offer cannot tell the hit. The
        layer then sees each request as the simulator shows it (GPU-held blocks counted,
        only the rest looked up).
        """
        state = self._request_keys(req_context)
        unsighted, sighted = state.unsighted, state.sighted
        first = not sighted
        looked_up = list(unsighted) if first else []
        unsighted.update(dict.fromkeys(offered))
        keys = [key for key in unsighted if key not in sighted]
        unsighted.clear()
        if not keys and not first:
            return keys
        positions = [req_context.get_offload_key_position(key) for key in keys]
        gpu_held: list[OffloadKey] = []
        if None not in positions:
            keys = [key for _, key in sorted(zip(positions, keys, strict=True))]
            if first:
                gpu_held = _leading_keys(req_context, _first_position(req_context, looked_up))
                held = set(gpu_held)
                keys = gpu_held + [key for key in keys if key not in held]
        if not keys:
            return keys
        counted = len(sighted)
        sighted.update(dict.fromkeys(keys))
        shown = list(sighted)
        layer.begin_request(
            shown,
            will_offer=will_offer,
            counted=counted,
            tier_hit=state.tier_hit,
            gpu_held=len(gpu_held),
        )
        return shown

    def _seen(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> None:
        """Record keys first seen by this request; with ``recency_at_access`` (vLLM 0.33)
        make them recent now, head of the prefix most recent (0.32 waits for the finish).
        """
        seen = self._request_keys(req_context).seen
        new = [key for key in keys if key not in seen]
        if new:
            seen.update(dict.fromkeys(new))
            if self._recency_at_access and self._cpu.policy.recent_at_access:
                self._direct.touch(new)


def _announces_cpu_block(item: Any) -> bool:
    """Whether a queued event (a vLLM event or a failed store's released keys) stores a CPU
    block."""
    return isinstance(item, OffloadingEvent) and item.medium == Medium.CPU and not item.removed


def _dropped_at_reset(info: Sequence[InfoSeries]) -> set[str]:
    """The media whose blocks a reset drops (by ``info``) and that announce their removals
    (the local disk tier): a router keeps their stored blocks until told they are gone, so
    the reset announces their removal. The CPU tier is left to vLLM's own reset, which
    announces nothing for it either."""
    dropped = set()
    for series in info:
        medium = str(series.get("medium"))
        if series.get("reset_drops_blocks") and medium in _EVENT_MEDIA and _EVENT_MEDIA[medium][3]:
            dropped.add(medium)
    return dropped


def _first_position(req_context: ReqContext, keys: Sequence[OffloadKey]) -> int | None:
    """Where the first of ``keys`` ends (``None``: no keys, or one without a position)."""
    positions = [req_context.get_offload_key_position(key) for key in keys]
    return None if not positions or None in positions else min(positions)


def _prefix_order(recorded: Mapping[OffloadKey, int]) -> dict[bytes, list[OffloadKey]]:
    """The recorded keys in prefix order (by the token each ends at), per KV group."""
    order: dict[bytes, list[tuple[int, OffloadKey]]] = {}
    for key, position in recorded.items():
        order.setdefault(key[-GROUP_IDX_BYTES:], []).append((position, key))
    return {group: [key for _, key in sorted(keys)] for group, keys in order.items()}


def _leading_keys(req_context: ReqContext, before: int | None) -> list[OffloadKey]:
    """The request's keys that end before token ``before`` (``None``: all of them), in
    prefix order, from the positions vLLM's scheduler records for every key of the request
    (``ReqContext`` has no public way to list them; without the record, none)."""
    recorded: Mapping[OffloadKey, int] = getattr(req_context, "_offload_key_positions", {})
    held = [
        (position, key) for key, position in recorded.items() if before is None or position < before
    ]
    held.sort()
    return [key for _, key in held]


def _vllm_spec(spec: Any) -> Any:
    """Our CPU slot spec as vLLM's, which its connector and workers expect."""
    if not isinstance(spec, BlockIDsLoadStoreSpec):
        raise TypeError(f"the backing manager returned {type(spec).__name__}, not slot ids")
    return CPULoadStoreSpec(spec.block_ids.tolist())
