"""Our disk and shared tiers as vLLM 0.33 secondary tiers, under vLLM's own CPU tier.

vLLM's ``TieringOffloadingSpec`` keeps its CPU tier and cascades every store
to every secondary tier; it forbids ``store_threshold`` with tiering. Here
each of our tiers decides itself what of that cascade it writes, with an
admission layer of its own that judges what this tier sees: the stores the
CPU tier above offers (cascades) and the lookups that reach it (those the
CPU tier missed). vLLM loads the classes out of tree from its extra config::

    {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 64000000000,
     "secondary_tiers": [
       {"type": "KVOffloadDiskTier", "module_path": "kvoffload.integrations.vllm.secondary",
        "disk_dir": "/nvme/kv", "disk_bytes": 500000000000},
       {"type": "KVOffloadSharedTier", "module_path": "kvoffload.integrations.vllm.secondary",
        "url": "redis://cache:6379/0", "remote_bytes": 2000000000000}]}

Every call vLLM makes returns at once: one thread of each tier judges and
writes its cascades in call order, and its lookups (vLLM's ``AsyncLookupManager``,
``RETRY`` until the answer is in, as vLLM's ``fs`` tier does) and promotions
go beside them, never behind a write under way (:class:`_Owner`). A cascade
job keeps its CPU chunks pinned until its admitted blocks are written, and
they are written straight from the CPU tier's shared memory, never copied
on the scheduler thread; one offered while those queued pin
``max_pending_write_bytes`` is refused at once. A slow or dead server, a full
disk, a broken block, a chunk outside the CPU tier: counted misses and failed
jobs, never an exception into the engine.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoffload.admission import AdmissionLayer, AdmissionStats
from kvoffload.admission.registry import OPTIMISER, resolve_admission
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.manager import OffloadingEvent as TierEvent
from kvoffload.core.specs import LoadStoreSpec
from kvoffload.core.tier_protocol import LowerTier, Target
from kvoffload.integrations.vllm.adapter import LayerCount, report_whatif
from kvoffload.integrations.vllm.secondary_settings import (
    VLLM_KEYS,
    SecondarySettings,
    parse_disk_settings,
    parse_shared_settings,
    set_keys,
)
from kvoffload.integrations.vllm.spec import config_fingerprint, whatif_definitions
from kvoffload.tiers.backlog import WriteBacklog, default_pending_bytes
from kvoffload.tiers.remote import RemoteTier
from kvoffload.tiers.stack import tier_book, tier_opener

logger = logging.getLogger(__name__)

MODULE_PATH = __name__
"""What ``module_path`` of a tier entry names."""

METRIC_PREFIX = "vllm:kvoffload_secondary_"
TIER_TYPE_LABEL = "tier_type"
TIER_LABEL = "tier"
"""The label vLLM's tiering series give a tier (``1:KVOffloadDiskTier``): named so in 0.32
and 0.33, though only 0.33 exports the name as a constant."""


@dataclass
class SecondaryCounters:
    """What one secondary tier did, in blocks (and bytes) since it started."""

    lookups: int = 0
    """Lookups answered (once per request and key), i.e. the CPU tier's misses that reached us."""
    lookup_hits: int = 0
    offered_blocks: int = 0
    """Blocks the cascade offered (every store of the CPU tier above)."""
    served_blocks: int = 0
    """Offered blocks the request was served (a whole request is offered): sightings only."""
    held_blocks: int = 0
    """Offered blocks this tier already held: nothing to write, not judged."""
    admitted_blocks: int = 0
    skipped_blocks: int = 0
    """Offered blocks the admission layer held back: not written."""
    written_blocks: int = 0
    bytes_written: int = 0
    write_failures: int = 0
    writes_skipped_full: int = 0
    """Blocks of ``write_failures`` the shared tier did not send: its server refused a store
    as full (``OOM``) or unable to persist (``MISCONF``) less than a breaker cool-down ago."""
    writes_skipped_backlog: int = 0
    """Blocks of ``write_failures`` refused unqueued: the cascades queued or under way pinned
    ``max_pending_write_bytes`` of vLLM's CPU chunks (a disk or server slower than the cascade)."""
    loaded_blocks: int = 0
    bytes_read: int = 0
    load_failures: int = 0

    def as_dict(self) -> dict[str, int]:
        """Every counter by name: a shallow copy of the fields (``dataclasses.asdict`` deep-
        copies each, three times per engine step in :meth:`get_stats`)."""
        return dict(vars(self))

    def minus(self, other: SecondaryCounters) -> SecondaryCounters:
        mine, theirs = self.as_dict(), other.as_dict()
        return SecondaryCounters(**{name: mine[name] - theirs[name] for name in mine})


COUNTER_DOCS = {
    "lookups": "Lookups that reached this secondary tier (the CPU tier missed).",
    "lookup_hits": "Lookups this secondary tier answered with a hit.",
    "offered_blocks": "Blocks the CPU tier's cascade offered to this secondary tier.",
    "served_blocks": "Offered blocks the request was served from a cache (sightings, not writes).",
    "held_blocks": "Offered blocks this secondary tier already held (not written again).",
    "admitted_blocks": "Offered blocks this tier's admission layer let through.",
    "skipped_blocks": "Offered blocks this tier's admission layer held back (not written).",
    "written_blocks": "Blocks written to this secondary tier.",
    "bytes_written": "Bytes written to this secondary tier.",
    "write_failures": "Blocks whose write failed (server down or slow, disk full, ...).",
    "writes_skipped_full": "Failed writes the shared tier did not send: its server refused a "
    "store as full (OOM) or unable to persist (MISCONF) less than a breaker cool-down ago.",
    "writes_skipped_backlog": "Failed writes refused unqueued: the cascades queued or under "
    "way pinned max_pending_write_bytes of vLLM's CPU chunks.",
    "loaded_blocks": "Blocks promoted from this secondary tier into the CPU tier, intact.",
    "bytes_read": "Bytes promoted from this secondary tier into the CPU tier.",
    "load_failures": "Blocks whose promotion failed (absent, unreachable or corrupt).",
}


class _Spec(LoadStoreSpec):
    @staticmethod
    def medium() -> str:
        return "SECONDARY"


_SPEC = _Spec()


@dataclass(frozen=True)
class _Sighting:
    """A request's keys to announce to the admission layer (``AdmissionLayer.begin_request``)."""

    keys: list[OffloadKey]
    counted: int
    tier_hit: bool
    will_offer: bool = True


@dataclass(frozen=True)
class _Stored:
    """What one cascade job came to, in blocks (of those judged: not served to the request)."""

    held: int
    admitted: int
    held_back: int
    """Judged and not admitted; a job that failed before its judgement held none back."""
    written: int
    failed: int
    skipped_full: int = 0
    """Of ``failed``, those the shared tier did not send (:attr:`RemoteTier.skipped_full`)."""


class _Owner:
    """The threads that call the tier and its admission layer.

    One thread judges and writes the stores, in call order, and alone calls the
    admission layer; lookups (on vLLM's lookup thread) and promotions (on a
    thread of their own) go beside it, never behind a write under way: a request
    waits on them, nobody waits on a cascade. The disk tier expects one caller
    at a time: its calls take a lock, held to queue a write and to apply it, not
    while the write is under way (:meth:`LowerTier.wait_written`); the shared tier
    takes its own locks, and its calls none here. Every operation turns the
    tier's failures into results; a surprise from the tier (a bug) is a failed
    operation here, never an exception in the engine.
    """

    def __init__(self, tier: LowerTier, layer: AdmissionLayer | None, tier_label: str) -> None:
        self.tier = tier
        self.layer = layer
        self.events: queue.SimpleQueue[TierEvent] = queue.SimpleQueue()
        self._thread = ThreadPoolExecutor(1, f"kvoffload-{tier_label}")
        self._reads = ThreadPoolExecutor(1, f"kvoffload-{tier_label}-reads")
        self._calls: contextlib.AbstractContextManager[Any] = (
            contextlib.nullcontext() if isinstance(tier, RemoteTier) else threading.RLock()
        )
        """Held around each call of a tier that expects one caller at a time."""
        self._closed = False
        self._taken: AdmissionStats | None = None
        self._taking: Future[AdmissionStats] | None = None
        # What the tier found on opening (the disk's recovered blocks, announced as stores):
        # vLLM's next event poll publishes it, not the first job's, perhaps long after.
        self._take_events()

    def held(self, keys: list[OffloadKey]) -> list[bool]:
        """Per key, whether the tier holds it (on the caller's thread; misses once closed)."""
        with self._calls:
            if self._closed:
                return [False] * len(keys)
            try:
                return self.tier.held(keys)
            except Exception:  # a failed lookup is a miss
                return [False] * len(keys)

    def sight(self, sighting: _Sighting) -> None:
        """Show the admission layer a request that no offer follows (in the background, in
        call order): begun and ended, so the layer's open requests keep none of it."""
        self._thread.submit(self._sight, sighting, True)

    def store(
        self,
        sighting: _Sighting | None,
        keys: list[OffloadKey],
        payloads: list[memoryview],
    ) -> Future[_Stored]:
        """Judge the offer ``keys`` (the request's computed blocks) and write what is admitted;
        finishes once written."""
        return self._thread.submit(self._store, sighting, keys, payloads)

    def load(self, keys: list[OffloadKey], target: Target) -> Future[list[bool]]:
        return self._reads.submit(self._load, keys, target)

    def admission_stats(self) -> dict[str, float] | None:
        return self._thread.submit(self._admission_stats).result()

    def latest_stats(self) -> AdmissionStats | None:
        """The admission layer's stats as this thread last took them, and the next taken
        behind the work queued now: vLLM asks at every scheduler step, which must never
        wait behind a slow write (``None`` until the first is taken, or without a layer)."""
        layer = self.layer
        if layer is None or self._closed:
            return self._taken
        if self._taking is None or self._taking.done():
            if self._taking is not None:
                self._taken = _result(self._taking, self._taken)
            self._taking = self._thread.submit(layer.step_stats)
        return self._taken

    def close(self) -> None:
        """Close the tier after the work queued before; once (a shutdown may be retried)."""
        if self._closed:
            return
        self._closed = True
        self._reads.shutdown(wait=True)
        self._thread.submit(self._close).result()
        self._thread.shutdown(wait=True)

    def _sight(self, sighting: _Sighting, ends: bool) -> None:
        """Begin the request at the layer; end it too when ``ends`` (no offer of it follows
        here: an offer reads the request's prefix, and :meth:`_store` ends it after)."""
        layer = self.layer
        if layer is not None and sighting.keys:
            layer.begin_request(
                sighting.keys,
                will_offer=sighting.will_offer,
                counted=sighting.counted,
                tier_hit=sighting.tier_hit,
            )
            if ends or not sighting.will_offer:
                layer.end_request(sighting.keys)

    def _store(
        self, sighting: _Sighting | None, keys: list[OffloadKey], payloads: list[memoryview]
    ) -> _Stored:
        tier, layer = self.tier, self.layer
        if sighting is not None:
            self._sight(sighting, False)
        try:
            # Per key: several KV groups, or a sliding window, offer out of prefix order.
            with self._calls:
                holds = tier.held(keys)
        except Exception:  # unknown: judge and write them all
            holds = [False] * len(keys)
        fresh = [key for key, there in zip(keys, holds, strict=True) if not there]
        held = len(keys) - len(fresh)
        admitted = fresh
        if layer is not None and fresh:
            output = layer.prepare_store(fresh)
            chosen = set() if output is None else set(output.keys_to_store)
            admitted = [key for key in fresh if key in chosen]
        if layer is not None and sighting is not None and sighting.keys:
            layer.end_request(sighting.keys)
        held_back = len(fresh) - len(admitted)
        if not admitted:
            return _Stored(held, 0, held_back, 0, 0)
        chosen_payloads = dict(zip(keys, payloads, strict=True))
        stats = tier.stats
        try:
            with self._calls:
                # Only this thread writes: the counts move by this batch alone (reads
                # beside it count their own failures, so a write's are what it did not store).
                stored, skipped = stats.stored_blocks, _skipped_full(tier)
                # Straight from the CPU tier's rows: our tiers send any buffer as it is.
                tier.write(admitted, [chosen_payloads[key] for key in admitted])
            tier.wait_written()  # without the lock: lookups and reads go on
            with self._calls:
                tier.poll(wait=True)
        except Exception:  # a surprise from the tier is a failed write of the whole batch
            self._take_events()
            return _Stored(held, len(admitted), held_back, 0, len(admitted))
        self._take_events()
        written = stats.stored_blocks - stored
        skipped_full = _skipped_full(tier) - skipped
        return _Stored(
            held, len(admitted), held_back, written, len(admitted) - written, skipped_full
        )

    def _load(self, keys: list[OffloadKey], target: Target) -> list[bool]:
        try:
            with self._calls:
                reading = self.tier.read(keys, target)
            intact = reading.result()
            with self._calls:
                self.tier.poll(wait=False)  # forgets the disk's broken slots at once
        except Exception:  # a surprise from the tier is a failed read
            intact = [False] * len(keys)
        self._take_events()
        return intact

    def _admission_stats(self) -> dict[str, float] | None:
        if self.layer is None:
            return None
        return self.layer.stats().numbers()

    def _close(self) -> None:
        try:
            with self._calls:
                self.tier.close()
        finally:
            self._take_events()

    def _take_events(self) -> None:
        with self._calls:
            taken = self.tier.take_events()
        for event in taken:
            self.events.put(event)


class _Lookups(AsyncLookupManager):  # type: ignore[misc]
    """vLLM's batched, asynchronous lookups, answered on vLLM's lookup thread."""

    def __init__(self, owner: _Owner, tier_type: str) -> None:
        super().__init__(tier_type=tier_type)
        self._owner = owner

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        # Per key: vLLM asks a sliding-window layer's keys from the newest back.
        return self._owner.held(keys)


@dataclass
class _RequestView:
    """What one tier saw of one request: the keys shown to admission, in order, and the
    looked-up keys not shown yet."""

    unsighted: dict[OffloadKey, None] = field(default_factory=dict)
    shown: list[OffloadKey] = field(default_factory=list)
    sighted: set[OffloadKey] = field(default_factory=set)
    answered: set[OffloadKey] = field(default_factory=set)
    tier_hit: bool = False
    hits: set[OffloadKey] = field(default_factory=set)
    misses: set[OffloadKey] = field(default_factory=set)


@dataclass
class _RequestViews:
    """Per-request scratch of all our tiers (``ReqContext`` keeps one value per type)."""

    by_tier: dict[int, _RequestView] = field(default_factory=dict)

    def computed(self, context: ReqContext) -> Callable[[OffloadKey], bool]:
        """Whether the request computed a key rather than being served it: not one our tiers
        served, and from the first key they missed (vLLM asks the next tier only after a
        miss, and stops looking at the first key no tier has); with no miss, past the last
        key they were asked about (its decode blocks, never looked up). With no lookup at all
        (the CPU tier served every key vLLM looked up, or it looked up none) which keys were
        served is unknown: all are judged, and keys a tier holds are never written again."""
        hits: set[OffloadKey] = set()
        misses: set[OffloadKey] = set()
        for view in self.by_tier.values():
            hits |= view.hits
            misses |= view.misses
        position = context.get_offload_key_position
        missed = [at for key in misses - hits if (at := position(key)) is not None]
        asked = [at for key in hits | misses if (at := position(key)) is not None]
        if missed:
            start = min(missed)
        elif asked:
            start = max(asked) + 1
        else:
            return lambda key: key not in hits

        def computed(key: OffloadKey) -> bool:
            at = position(key)
            return key not in hits and (at is None or at >= start)

        return computed


@dataclass
class _Job:
    result: Future[Any]
    keys: list[OffloadKey]
    is_load: bool
    started: float
    context: ReqContext
    release: Callable[[], None] | None = None
    """Takes a cascade's pinned chunks out of the tier's backlog once vLLM learns it ended."""


class _KVOffloadSecondaryTier(SecondaryTierManager):  # type: ignore[misc]
    """One of our tiers behind its own admission layer, in vLLM's secondary-tier contract."""

    tolerates_off_thread_polling: ClassVar[bool] = False
    announces_removals: ClassVar[bool] = False
    """Whether the tier publishes its removals (evictions) as KV events: its stores then ask
    vLLM's event tracker to keep the chunk's block hashes until the removal names them all
    (``removal_expected``); a tier that never announces one must not, or they are kept
    for good. Each event's ``ownership`` is the tier's ``tier`` label, so a removal from one
    tier ends that tier's residency only, and a router tells the tiers apart."""

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        settings = self.parse(tier_type, options)
        self.settings = settings
        self.tier_label = _vllm_tier_label(offloading_spec, tier_type, options)
        """The ``tier`` label of this tier's series, vLLM's own for it (``2:KVOffloadDiskTier``)."""
        self.locality = Locality(settings.locality) if settings.locality else None
        self.payload_bytes = _payload_bytes(offloading_spec, self.block_size_bytes)
        self._flat = primary_kv_view.cast("B")
        events = settings.enable_kv_events and _events_enabled(offloading_spec)
        self.fingerprint = _fingerprint(offloading_spec, self.payload_bytes)
        try:
            # The stack builder's opener and book, as the simulator's, the spec's and
            # SGLang's tiers: every setting means and is checked the same.
            self.tier_config = settings.sized(self.payload_bytes)
            self.capacity_blocks = self.tier_config.blocks or 0
            # The book before the tier: nothing after the opening can fail and leave the
            # tier (its directory lock, its connections) open.
            layer = tier_book(self.tier_config, _SPEC)
            tier = tier_opener(self.tier_config, self.fingerprint, enable_events=events)()
        except BaseException:
            self._flat.release()  # vLLM unmaps the CPU tier's region on a failed start
            raise
        self.counters = SecondaryCounters()
        self._reported = SecondaryCounters()
        self._whatif_tier = (self.tier_label,) if _has_optimiser(settings) else None
        """The ``tier`` label of this tier's what-if series; ``None``: not the optimiser."""
        self._switches = LayerCount()
        self._backlog = WriteBacklog(
            settings.max_pending_write_bytes, default_pending_bytes(self.tier_config.io_threads)
        )
        """The bytes of vLLM's CPU chunks our cascades pin until vLLM learns they ended."""
        self._owner = _Owner(tier, layer, self.tier_label)
        self._lookups = _Lookups(self._owner, tier_type)
        self._jobs: dict[int, _Job] = {}
        self._done: list[JobResult] = []

    @classmethod
    @abstractmethod
    def parse(cls, tier_type: str, entry: dict[str, Any]) -> SecondarySettings:
        """The checked settings of a tier entry of this kind."""

    @property
    def tier(self) -> LowerTier:
        """Our tier underneath (called by its owner's threads while running: :class:`_Owner`)."""
        return self._owner.tier

    @classmethod
    @override
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """Our counters, and with the optimiser its what-if gauges and switch counter (the
        spec's, labelled by ``tier``); the entry is checked here too, so vLLM stops before
        any tier opens."""
        settings = cls.parse(str(extra_config.get("type", cls.__name__)), extra_config)
        definitions: dict[str, OffloadingMetricMetadata] = {
            f"{METRIC_PREFIX}{name}": OffloadingCounterMetadata(
                documentation=doc, labelnames=(TIER_TYPE_LABEL, TIER_LABEL)
            )
            for name, doc in COUNTER_DOCS.items()
        }
        if _has_optimiser(settings):
            definitions.update(whatif_definitions(tier_label=True))
        return definitions

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """With ``offer_hits`` (the default, when admitting) vLLM offers every chunk of the
        request, hits included: the blocks the CPU tier serves are sightings too, and a block
        reused while in the CPU tier is offered again (only new blocks are ever written)."""
        if self.settings.offer_hits and self._owner.layer is not None:
            return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
        return RequestOffloadingContext()

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        view = self._view(req_context)
        view.unsighted[key] = None
        if found is None:
            return LookupResult.RETRY
        if key not in view.answered:
            view.answered.add(key)
            self.counters.lookups += 1
            self.counters.lookup_hits += int(found)
        if found:
            view.tier_hit = True
            view.hits.add(key)
            return LookupResult.HIT
        view.misses.add(key)
        return LookupResult.MISS

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        """Show the request to the layer; judge and write the blocks it computed.

        Blocks before the first one our tiers missed and none served, and the
        blocks one of them served, came to the request from a cache or a tier:
        offered again only because the request is offered whole, they are
        sightings, never writes (else each reuse in the CPU tier would write
        again what the disk tier evicted meanwhile).
        """
        keys = list(job_metadata.keys)
        context = job_metadata.req_context
        view = self._view(context)
        chunks = job_metadata.chunk_ids.tolist()
        if self._owner.layer is None:  # vLLM's cascade-everything: every offer is written
            computed = list(range(len(keys)))
        else:
            views = context.get_state(_RequestViews)
            was_computed = views.computed(context)
            computed = [i for i, key in enumerate(keys) if was_computed(key)]
        # A request served all it offers offers the layer nothing: the optimiser's mini-tiers
        # then store what they lack of it, as the tier holds it. Begun as an offer that never
        # came, its lookup was scored and never stored: at every size but the real one the
        # what-if figures missed it for good.
        sighting = self._sighting(view, keys, context, will_offer=bool(computed))
        self.counters.offered_blocks += len(keys)
        self.counters.served_blocks += len(keys) - len(computed)
        if not computed:
            if sighting is not None:
                self._owner.sight(sighting)
            # No bytes moved: vLLM's back-pressure skips it (None would count every block).
            self._done.append(
                JobResult(job_metadata.job_id, True, transfer_time=0.0, transfer_bytes=0)
            )
            return
        judged = [keys[i] for i in computed]
        if self._backlog.is_full:
            self._refuse(job_metadata.job_id, sighting, len(judged))
            return
        try:
            payloads = self._rows(job_metadata.job_id, [chunks[i] for i in computed])
        except IndexError as exc:
            if sighting is not None:
                self._owner.sight(sighting)
            store = _failed(exc)
        else:
            store = self._owner.store(sighting, judged, payloads)
        release = self._backlog.hold(len(chunks) * self.block_size_bytes)
        self._jobs[job_metadata.job_id] = _Job(
            store, judged, False, time.monotonic(), context, release
        )

    def _refuse(self, job_id: int, sighting: _Sighting | None, blocks: int) -> None:
        """Fail a cascade at once, nothing queued or written: the cascades before it pin
        ``max_pending_write_bytes`` of vLLM's CPU chunks, which a tier slower than the cascade
        would otherwise pin without end (vLLM's own tiers queue every store). vLLM unpins its
        chunks at its next poll, and counts a failed cascade (its back-pressure detector too)."""
        if sighting is not None:
            self._owner.sight(sighting)
        self.counters.write_failures += blocks
        self.counters.writes_skipped_backlog += blocks
        self._done.append(JobResult(job_id, False, transfer_time=0.0, transfer_bytes=0))

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        try:
            rows = self._rows(job_metadata.job_id, job_metadata.chunk_ids.tolist())
        except IndexError as exc:
            load = _failed(exc)
        else:

            def target(index: int) -> memoryview:
                return rows[index]

            load = self._owner.load(keys, target)
        self._jobs[job_metadata.job_id] = _Job(
            load, keys, True, time.monotonic(), job_metadata.req_context
        )

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        results, self._done = self._done, []
        for job_id in [job_id for job_id, job in self._jobs.items() if job.result.done()]:
            results.append(self._finish(job_id, self._jobs.pop(job_id)))
        return results

    @override
    def has_pending_work(self) -> bool:
        """Jobs to report, or KV events not taken yet: vLLM steps an engine with no request
        only while this holds, and takes the events at each step (the blocks a restarted
        disk tier recovered are published though no request comes)."""
        return bool(self._jobs or self._done) or not self._owner.events.empty()

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        events = self._owner.events
        while not events.empty():
            event = events.get()
            yield OffloadingEvent(
                keys=list(event.keys),
                medium=Medium.STORAGE,
                removed=event.removed,
                locality=self.locality,
                ownership=self.tier_label,
                removal_expected=self.announces_removals and not event.removed,
            )

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        views = req_context.get_state(_RequestViews)
        view = None if views is None else views.by_tier.pop(id(self), None)
        if view is not None and view.unsighted:
            # A request that only looked up (or stored nothing) is still a sighting.
            sighting = self._sighting(view, (), req_context, will_offer=False)
            if sighting is not None:
                self._owner.sight(sighting)
        self._lookups.cleanup(req_context.req_id)

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    @override
    def drain_jobs(self) -> None:
        for job in list(self._jobs.values()):
            job.result.exception()  # waits; the tiers' own timeouts bound it

    @override
    def shutdown(self) -> None:
        self.drain_jobs()
        self._lookups.shutdown()
        self._owner.close()
        self._flat.release()  # vLLM unmaps the CPU tier's region next

    @override
    def get_stats(self) -> OffloadingConnectorStats | None:
        """Our counters since the last call, labelled with this tier's type and vLLM's label
        of it; with the optimiser its what-if figures, chosen rule and switches as the owner
        thread last read them (a report behind: reading waits for no write)."""
        delta = self.counters.minus(self._reported)
        self._reported = SecondaryCounters(**self.counters.as_dict())
        stats = OffloadingConnectorStats()
        for name, value in delta.as_dict().items():
            if value:
                stats.increase_counter(
                    f"{METRIC_PREFIX}{name}", value, (self.tier_type, self.tier_label)
                )
        if self._whatif_tier is not None:
            layer_stats = self._owner.latest_stats()
            if layer_stats is not None:
                report_whatif(stats, layer_stats, self._switches, self._whatif_tier)
        return stats

    @property
    def layer(self) -> AdmissionLayer | None:
        """This tier's admission layer (``None``: every offered block is written)."""
        return self._owner.layer

    def admission_stats(self) -> dict[str, float] | None:
        """The admission layer's counters (``None`` without one), in call order."""
        return self._owner.admission_stats()

    def _rows(self, job_id: int, chunks: list[int]) -> list[memoryview]:
        """The CPU tier's rows of ``chunks``; :class:`IndexError` (logged, naming the chunk)
        for one outside its region, which fails the whole job with no byte moved, as vLLM's
        own file tier does: a slice would clip a row past the end to a short or empty one,
        and a negative start would count from the end, another chunk's bytes."""
        rows, size, flat = [], self.block_size_bytes, self._flat
        count = len(flat) // size
        for chunk in chunks:
            if not 0 <= chunk < count:
                logger.warning(
                    "kvoffload: secondary tier %s job %d failed: chunk %d is outside the CPU "
                    "tier's %d chunks",
                    self.tier_label,
                    job_id,
                    chunk,
                    count,
                )
                raise IndexError(f"chunk {chunk} is outside the CPU tier's {count} chunks")
            rows.append(flat[chunk * size : chunk * size + self.payload_bytes])
        return rows

    def _sighting(
        self,
        view: _RequestView,
        offered: Sequence[OffloadKey],
        context: ReqContext,
        will_offer: bool = True,
    ) -> _Sighting | None:
        """The request's keys for the layer: those shown before, then the new ones in prefix
        order (looked up or offered), so an offer in parts is one request, counted once."""
        if self._owner.layer is None:
            return None
        view.unsighted.update(dict.fromkeys(offered))
        new = [key for key in view.unsighted if key not in view.sighted]
        view.unsighted.clear()
        positions = [context.get_offload_key_position(key) for key in new]
        if None not in positions:
            new = [key for _, key in sorted(zip(positions, new, strict=True))]
        counted = len(view.shown)
        view.sighted.update(new)
        view.shown.extend(new)
        return _Sighting(list(view.shown), counted, view.tier_hit, will_offer)

    def _view(self, context: ReqContext) -> _RequestView:
        views = context.get_state(_RequestViews)
        if views is None:
            views = _RequestViews()
            context.set_state(views)
        view: _RequestView = views.by_tier.setdefault(id(self), _RequestView())
        return view

    def _not_served(self, context: ReqContext, keys: list[OffloadKey]) -> None:
        """Keys whose promotion failed were hits this tier did not serve: the request computes
        them (vLLM's prefix ends at the first), so its offer of them is judged and written, not
        taken for a sighting of blocks it was served (which left a broken block unwritten)."""
        views = context.get_state(_RequestViews)
        view = None if views is None else views.by_tier.get(id(self))
        if view is not None:
            view.hits.difference_update(keys)
            view.misses.update(keys)
            view.tier_hit = bool(view.hits)

    def _finish(self, job_id: int, job: _Job) -> JobResult:
        elapsed = time.monotonic() - job.started
        if job.release is not None:
            job.release()  # vLLM unpins the chunks as it takes this result
        c = self.counters
        if job.is_load:
            intact = _result(job.result, [False] * len(job.keys))
            good = [key for key, ok in zip(job.keys, intact, strict=True) if ok]
            failed = [key for key, ok in zip(job.keys, intact, strict=True) if not ok]
            c.loaded_blocks += len(good)
            c.bytes_read += len(good) * self.payload_bytes
            c.load_failures += len(failed)
            if failed:
                self._lookups.mark_miss(failed)  # so vLLM does not ask to promote them again
                self._not_served(job.context, failed)
                return JobResult(job_id, False, successful_keys=good or None, transfer_time=elapsed)
            return JobResult(
                job_id, True, transfer_time=elapsed, transfer_bytes=len(good) * self.payload_bytes
            )
        stored = _result(job.result, _Stored(0, 0, 0, 0, len(job.keys)))
        c.held_blocks += stored.held
        c.admitted_blocks += stored.admitted
        c.skipped_blocks += stored.held_back
        c.written_blocks += stored.written
        c.bytes_written += stored.written * self.payload_bytes
        c.write_failures += stored.failed
        c.writes_skipped_full += stored.skipped_full
        return JobResult(
            job_id,
            stored.failed == 0,
            transfer_time=elapsed,
            transfer_bytes=stored.written * self.payload_bytes,
        )


class KVOffloadDiskTier(_KVOffloadSecondaryTier):
    """Our local-disk tier (one slot file, bounded, our eviction policy) as a secondary tier.

    Entry keys: ``disk_dir``, ``disk_bytes`` (required), ``eviction_policy``,
    ``disk_timeout_ms``, ``admission``, ``admission_params``, ``write_budget``,
    ``io_threads``, ``fsync``, ``enable_kv_events``, ``locality``,
    ``max_pending_write_bytes``.
    """

    medium: ClassVar[Medium] = Medium.STORAGE
    announces_removals: ClassVar[bool] = True

    @classmethod
    @override
    def parse(cls, tier_type: str, entry: dict[str, Any]) -> SecondarySettings:
        return parse_disk_settings(tier_type, entry)


class KVOffloadSharedTier(_KVOffloadSecondaryTier):
    """Our shared Valkey/Redis tier (standalone or Cluster) as a secondary tier.

    Entry keys: ``url`` (required), ``remote_bytes`` (this instance's share of
    the server, which sizes the admission layer; required unless ``admission``
    is ``none``), ``admission``, ``admission_params``, ``write_budget``,
    ``io_threads``, ``enable_kv_events``, ``locality`` (default ``REMOTE``),
    ``max_pending_write_bytes``. The server's own ``maxmemory-policy`` evicts.
    """

    medium: ClassVar[Medium] = Medium.STORAGE
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    @classmethod
    @override
    def parse(cls, tier_type: str, entry: dict[str, Any]) -> SecondarySettings:
        return parse_shared_settings(tier_type, entry)


def _has_optimiser(settings: SecondarySettings) -> bool:
    """Whether the tier's admission layer is the optimiser, which has what-if figures."""
    return resolve_admission(settings.admission) == OPTIMISER


def _vllm_tier_label(spec: OffloadingSpec, tier_type: str, options: Mapping[str, Any]) -> str:
    """vLLM's ``tier`` label of the tier built from ``options``: its place in
    ``secondary_tiers``, from 1, and its type, as vLLM's tiering metrics label their series
    of it (``2:KVOffloadDiskTier``), so two tiers of one type stay apart and a join on
    ``tier`` with vLLM's series matches. vLLM tells a tier neither its place nor its label:
    the place is that of the entry of ``tier_type`` whose keys, less those vLLM's factory
    takes, are ``options``; two such entries cannot be told apart and name one tier (the
    same server, the same settings), so they are refused. Outside vLLM's tiering spec, the
    type alone."""
    entries = spec.secondary_tier_configs if isinstance(spec, TieringOffloadingSpec) else []
    ours = set_keys(options)  # a key set to null is unset: such entries are one tier too
    places = [
        place
        for place, entry in enumerate(entries, start=1)
        if entry.get("type") == tier_type
        and set_keys({key: value for key, value in entry.items() if key not in VLLM_KEYS}) == ours
    ]
    if len(places) > 1:
        raise InvalidArgumentError(
            f"secondary tier {tier_type!r}: entries {places[0]} and {places[1]} of "
            "secondary_tiers are the same tier; list it once"
        )
    return f"{places[0]}:{tier_type}" if places else tier_type


def _skipped_full(tier: LowerTier) -> int:
    """The stores ``tier`` dropped unsent so far, its server resting (the shared tier only)."""
    return tier.skipped_full if isinstance(tier, RemoteTier) else 0


def _payload_bytes(spec: OffloadingSpec, row_bytes: int) -> int:
    """The bytes of a chunk row that hold KV data: every rank's page, not the alignment pad."""
    per_worker = int(getattr(spec, "cpu_page_size_per_worker", 0) or 0)
    copies = 1 if getattr(spec, "replicated_layout", False) else spec.config.parallel.world_size
    used = per_worker * max(1, copies)
    return used if 0 < used <= row_bytes else row_bytes


def _events_enabled(spec: OffloadingSpec) -> bool:
    return bool(spec.kv_events_config.enable_kv_cache_events)


def _fingerprint(spec: OffloadingSpec, payload_bytes: int) -> bytes:
    """What a chunk's bytes mean under this vLLM configuration and CPU tier layout."""
    config = spec.config
    replicated = bool(getattr(spec, "replicated_layout", False))
    return config_fingerprint(
        "vllm-tiering", config, config.parallel.world_size, replicated, payload_bytes
    )


def _failed(error: Exception) -> Future[Any]:
    """A job that failed before it started: reported as failed when vLLM polls for it."""
    job: Future[Any] = Future()
    job.set_exception(error)
    return job


def _result(job: Future[Any], failed: Any) -> Any:
    """A finished job's value; ``failed`` if it raised (a failed job, not the engine's problem)."""
    try:
        return job.result()
    except Exception:  # see _Owner: never an exception into the engine
        return failed
