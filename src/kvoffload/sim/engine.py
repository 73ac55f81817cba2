"""A serving engine model that drives an offloading manager the way vLLM's connector does.

Requests are admitted first come, first served, up to ``concurrency`` at a
time and only when their blocks fit in the GPU pool. For each request the
engine

1. matches the longest prefix held by the GPU prefix cache;
2. ``touch``-es all of the request's keys in the offload tier, then
   ``lookup``-s only the keys past the GPU hit (none if no block remains);
   a ``None`` ("ask later") answer parks the request, as vLLM's scheduler
   does, and retries its touch and lookup ``lookup_retry_s`` later; after
   ``max_lookup_retries`` retries it proceeds with no offload hit;
3. ``prepare_load``-s the offload hit, copies it in, and ``complete_load``-s
   it when the modelled transfer ends (a failed load is recomputed);
4. prefills the rest, then ``prepare_store``-s the newly computed blocks
   (loaded blocks are never stored again; ``None`` means "not stored"),
   ``touch``-es the request's keys again after a non-empty store, and
   ``complete_store``-s each store job when its modelled transfer ends;
5. decodes, and releases its GPU blocks only once its stores have finished,
   as vLLM keeps blocks alive while a store still reads them.

With ``partial_block="drop"`` a prompt's partial last block (its length is
not a multiple of the block size, yet the request has a key for it) is
computed and takes a GPU slot, but is never matched, registered, looked up
or offered, as in vLLM; it still counts as a block reference (always a miss).
And as in vLLM, the GPU hit then never covers a prompt's last token (it is
computed for its logits): a prompt that ends on a block boundary looks its
last block up in the offload tier even when the GPU holds it.

The engine knows request boundaries: when the tier has an admission layer it
announces each request to it (``begin_request`` before the touch and lookup,
``end_request`` after the store offer), so the layer does not guess them
from the call order. A parked request is announced again with each retry of
its touch and lookup, and counted again, as the guessed boundaries counted it.
A tiered manager in the stack is told which request (by its index in the run)
each ``None`` answer kept waiting, and when that request's wait ends (it
starts, answered or out of retries): the record that keeps its retry from
counting again in the lower tiers then ends with it, not with the next request
that has its prompt.

Time is simulated: prefill and decode from token throughputs, transfers
from a bandwidth shared first come, first served per direction. With
``concurrency=1`` the next request starts only when the previous one is
completely done (or parked), so the replay is sequential and deterministic.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload.admission import AdmissionLayer, find_admission
from kvoffload.admission.params import is_finite
from kvoffload.core.errors import InvalidArgumentError, brief, check_integer, is_number
from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import OffloadingManager, find_layer
from kvoffload.managers.tiered import TieredOffloadingManager
from kvoffload.sim.gpu_cache import GPUPrefixCache
from kvoffload.sim.transfers import NullTransferBackend, TransferBackend
from kvoffload.sim.workload import Request, cacheable_keys, max_gpu_hit

Progress = Callable[[int, int], None]
"""Called with (requests finished, requests in total)."""

PARTIAL_BLOCK_MODES = ("cache", "drop")


@dataclass(frozen=True)
class EngineConfig:
    """The hardware and serving parameters of the modelled engine."""

    gpu_blocks: int
    bytes_per_block: int
    block_tokens: int
    concurrency: int = 1
    prefill_tokens_per_s: float = 10_000.0
    decode_tokens_per_s: float = 50.0
    transfer_bytes_per_s: float = 25e9
    lookup_retry_s: float = 0.001
    """How long a request whose lookup answered ``None`` waits before asking again."""
    max_lookup_retries: int = 16
    partial_block: str = "cache"
    """``"cache"``: every key of a request is cacheable; ``"drop"``: see the module docstring."""

    def __post_init__(self) -> None:
        for name in ("gpu_blocks", "bytes_per_block", "block_tokens", "concurrency"):
            check_integer(name, getattr(self, name), 1)
        for name in ("prefill_tokens_per_s", "decode_tokens_per_s", "transfer_bytes_per_s"):
            value = getattr(self, name)
            if not (is_number(value) and is_finite(value) and value > 0):
                raise InvalidArgumentError(f"{name} must be finite and > 0, got {brief(value)}")
        retry = self.lookup_retry_s
        if not (is_number(retry) and is_finite(retry) and retry > 0):
            raise InvalidArgumentError(f"lookup_retry_s must be finite and > 0, got {brief(retry)}")
        check_integer("max_lookup_retries", self.max_lookup_retries, 0)
        if self.partial_block not in PARTIAL_BLOCK_MODES:
            raise InvalidArgumentError(
                f"partial_block must be one of {', '.join(PARTIAL_BLOCK_MODES)}, "
                f"got {self.partial_block!r}"
            )


@dataclass
class EngineStats:
    """What happened during a replay; all counts are in blocks unless named otherwise."""

    requests: int = 0
    refs: int = 0
    gpu_hit_blocks: int = 0
    offload_hit_blocks: int = 0
    computed_blocks: int = 0
    gpu_hit_tokens: int = 0
    offload_hit_tokens: int = 0
    prompt_tokens: int = 0
    stored_blocks: int = 0
    store_offered_blocks: int = 0
    stores_skipped_by_admission: int = 0
    stores_rejected: int = 0
    stores_failed: int = 0
    loads_failed: int = 0
    offload_evictions: int = 0
    gpu_evictions: int = 0
    lookups: int = 0
    lookups_deferred: int = 0
    peak_pending_store_blocks: int = 0
    peak_pinned_blocks: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    simulated_seconds: float = 0.0
    manager_seconds: float = 0.0


class _Running:
    """Per-request progress through the phases above."""

    __slots__ = (
        "computed_from",
        "decoded",
        "gpu_hits",
        "index",
        "keys",
        "load_hits",
        "load_job",
        "pending_stores",
        "req",
        "slots",
    )

    def __init__(
        self,
        req: Request,
        keys: list[OffloadKey],
        slots: list[int],
        gpu_hits: int,
        load_hits: int,
        index: int,
    ) -> None:
        self.req = req
        self.keys = keys
        """The cacheable keys: all of ``req.keys``, or all but a dropped partial block."""
        self.slots = slots
        self.gpu_hits = gpu_hits
        self.load_hits = load_hits
        self.index = index
        """Where the request is in the order the requests started."""
        self.computed_from = gpu_hits + load_hits
        self.load_job = -1
        self.pending_stores = 0
        self.decoded = False


_LOAD_DONE, _PREFILL_DONE, _STORE_DONE, _DECODE_DONE, _RETRY = range(5)
_WAITS = {
    _LOAD_DONE: ("load", "transfer_bytes_per_s"),
    _PREFILL_DONE: ("prefill", "prefill_tokens_per_s"),
    _STORE_DONE: ("store", "transfer_bytes_per_s"),
    _DECODE_DONE: ("decode", "decode_tokens_per_s"),
    _RETRY: ("lookup retry", "lookup_retry_s"),
}
"""What each event waits for, and the setting that times it: for an overflow to name."""
_STARTED, _NO_ROOM, _PARKED = range(3)

Event = tuple[float, int, int, Any, int, list[OffloadKey]]
"""(time, sequence number, kind, a ``_Running`` or a parked request's index, job id, job
keys)."""

_NO_KEYS: list[OffloadKey] = []


def _check_order(requests: Sequence[Request]) -> None:
    """Refuse requests out of arrival order: the replay starts them in list order and its
    clock never goes back, so an earlier arrival listed later would start late, unsaid."""
    for index in range(1, len(requests)):
        before, after = requests[index - 1].arrival_s, requests[index].arrival_s
        if after < before:
            raise InvalidArgumentError(
                f"request {index} arrives at {after:g} s, before request {index - 1} at "
                f"{before:g} s: sort the requests by arrival_s"
            )


class ServingEngine:
    """Replays requests through a GPU prefix cache in front of an optional offload tier."""

    def __init__(
        self,
        config: EngineConfig,
        manager: OffloadingManager | None,
        backend: TransferBackend | None = None,
        holds: Callable[[OffloadKey], bool] | None = None,
        admission: AdmissionLayer | None = None,
    ) -> None:
        self.config = config
        self.manager = manager
        self.backend: TransferBackend = NullTransferBackend() if backend is None else backend
        self.gpu = GPUPrefixCache(config.gpu_blocks)
        self.stats = EngineStats()
        self._events: list[Event] = []
        self._seq = 0
        self._now = 0.0
        self._link_free_at = {"load": 0.0, "store": 0.0}
        self._held: set[OffloadKey] = set()
        self._pending_store_blocks = 0
        self._pinned_blocks = 0
        self._drop_partial = config.partial_block == "drop"
        self.requests_by_start: list[Request] = []
        """The requests in the order they started (parked ones and overlap reorder them)."""
        self.gpu_hits_by_start: list[int] = []
        """Each request's GPU prefix hit, in the order the requests started."""
        self.store_points_by_start: list[int] = []
        """For each request, in the order they started: how many requests had started when
        it offered its blocks to the tier (at the end of its prefill)."""
        self._retries: dict[int, int] = {}
        """Per request (by its index in the run) waiting after ``None``: the ``None`` answers
        it has had so far."""
        self._tiered = find_layer(manager, TieredOffloadingManager)
        """The tiered manager under ``manager``'s layers, told which request each ``None``
        answer kept waiting and when its wait ends (the layers pass no name on)."""
        self._holds: Callable[[OffloadKey], bool] = (
            holds or getattr(manager, "holds", None) or self._held.__contains__
        )
        """Whether the tier holds a key, for an offered block it did not store: held, it was
        not refused by admission. The tier's own ``holds`` (the stack's, :attr:`Stack.holds`)
        where it has one: a tier places and evicts blocks itself too (a tiered stack
        promotes lower-tier hits into its CPU tier); else the engine's held set, which knows
        what the engine stored."""
        self._layer = admission
        if admission is None and manager is not None:
            self._layer = find_admission(manager)
        """The outermost admission layer, told where each request begins and ends (found
        in ``manager`` for a caller that does not name it)."""

    def _check(self, index: int, request: Request) -> None:
        """Refuse, before the replay, a request it cannot time or place: an infinite or nan
        time or token count would stall its event loop, a fractional or negative count run
        in nonsense, and more blocks than the GPU holds never start."""
        arrival = request.arrival_s
        if not (is_number(arrival) and is_finite(arrival)):
            raise InvalidArgumentError(
                f"request {index}: arrival_s must be a finite number of seconds, "
                f"got {brief(request.arrival_s)}"
            )
        for name in ("input_tokens", "output_tokens"):
            check_integer(f"request {index}: {name}", getattr(request, name), 0)
        if not isinstance(request.keys, list | tuple):
            raise InvalidArgumentError(
                f"request {index}: keys must be a list of keys, got {type(request.keys).__name__}"
            )
        if len(request.keys) > self.config.gpu_blocks:
            raise InvalidArgumentError(
                f"a request of {len(request.keys)} blocks cannot fit in a GPU cache of "
                f"{self.config.gpu_blocks} blocks; give the GPU more blocks"
            )

    def now(self) -> float:
        """The trace time the replay has reached, in seconds: the clock of a write budget
        in bytes per second or drive writes per day."""
        return self._now

    def run(self, requests: Sequence[Request], progress: Progress | None = None) -> EngineStats:
        """Replay ``requests`` (sorted by arrival) to completion and return the counters."""
        for index, request in enumerate(requests):
            self._check(index, request)
        _check_order(requests)
        waiting: deque[int] = deque()  # the indices of arrived requests not yet started
        next_arrival, active, finished, total = 0, 0, 0, len(requests)
        events = self._events
        concurrency = self.config.concurrency
        while next_arrival < total or events or waiting:
            arrival = requests[next_arrival].arrival_s if next_arrival < total else math.inf
            if events and events[0][0] < arrival:
                when, _, kind, running, job, keys = heapq.heappop(events)
                if when > self._now:
                    self._now = when
                if kind == _RETRY:
                    waiting.appendleft(running)
                elif self._handle(kind, running, job, keys):
                    self.gpu.release(running.slots)
                    active -= 1
                    finished += 1
                    if progress is not None:
                        progress(finished, total)
            elif next_arrival < total:
                if arrival > self._now:
                    self._now = arrival
                waiting.append(next_arrival)
                next_arrival += 1
            while waiting and active < concurrency:
                outcome = self._start(waiting[0], requests[waiting[0]])
                if outcome == _NO_ROOM:
                    break
                waiting.popleft()
                if outcome == _STARTED:
                    active += 1
            if waiting and not active and not events:
                raise RuntimeError("an idle engine could not admit a request that fits")
        self.backend.close()
        self.stats.simulated_seconds = self._now
        self.stats.gpu_evictions = self.gpu.evictions
        return self.stats

    def _at(
        self,
        delay: float,
        kind: int,
        payload: Any,
        job: int = -1,
        keys: list[OffloadKey] = _NO_KEYS,
    ) -> None:
        when = self._now + delay
        if not math.isfinite(when):  # an event at infinity never comes: the loop would spin
            what, setting = _WAITS[kind]
            raise InvalidArgumentError(
                f"simulated time overflows a float after {self._now:.3g} s, at a {what} timed "
                f"by {setting} {getattr(self.config, setting):g} (due {delay:.3g} s later): a "
                "prefill, decode or transfer throughput is too low for the workload's tokens, "
                "or its arrivals too late"
            )
        self._seq += 1
        heapq.heappush(self._events, (when, self._seq, kind, payload, job, keys))

    def _transfer(self, direction: str, num_blocks: int) -> float:
        """Queue a transfer on its direction's link; return the delay until it ends."""
        seconds = num_blocks * self.config.bytes_per_block / self.config.transfer_bytes_per_s
        if direction == "load":
            self.stats.load_seconds += seconds
        else:
            self.stats.store_seconds += seconds
        start = max(self._now, self._link_free_at[direction])
        self._link_free_at[direction] = start + seconds
        return start + seconds - self._now

    def _timed(self, started: float) -> None:
        self.stats.manager_seconds += time.perf_counter() - started

    def _lookup(self, index: int, keys: list[OffloadKey], gpu_hits: int) -> int | None:
        """Touch and look up ``keys`` of request ``index`` in the tier: the offload hit, or
        ``None`` if parked."""
        manager, stats = self.manager, self.stats
        if manager is None or not keys:
            return 0
        started = time.perf_counter()
        if self._layer is not None:
            # A retry after a parked lookup is the same request: shown once, not again.
            retried = index in self._retries
            counted = len(keys) if retried else 0
            self._layer.begin_request(keys, lookup_follows=True, counted=counted)
        manager.touch(keys)
        found: int | None = 0
        if len(keys) > gpu_hits:
            looked_up = keys[gpu_hits:]
            found = manager.lookup(looked_up)
            stats.lookups += 1
            if found is None and self._tiered is not None:
                self._tiered.request_waits(index, looked_up)
        self._timed(started)
        if found is not None:
            return found
        stats.lookups_deferred += 1
        retries = self._retries
        parked = retries.get(index, 0)
        retries[index] = parked + 1
        if parked < self.config.max_lookup_retries:
            self._at(self.config.lookup_retry_s, _RETRY, index)
            return None
        return 0

    def _start(self, index: int, req: Request) -> int:
        """Admit ``req`` (``index`` in the run) if its blocks fit on the GPU now; return what
        became of it."""
        gpu, stats = self.gpu, self.stats
        block_tokens, drop = self.config.block_tokens, self._drop_partial
        keys = cacheable_keys(req, block_tokens, drop)
        num_blocks = len(req.keys)
        gpu_hits = min(gpu.match(keys), max_gpu_hit(req, block_tokens, drop))
        shared = gpu.slots_of(keys[:gpu_hits])
        if not gpu.fits_slots(shared, num_blocks - gpu_hits):
            return _NO_ROOM
        load_hits = self._lookup(index, keys, gpu_hits)
        if load_hits is None:
            return _PARKED
        if self._retries and self._retries.pop(index, None) is not None:
            self._wait_ended(index)
        slots = gpu.acquire_slots(shared, num_blocks - gpu_hits)
        running = _Running(req, keys, slots, gpu_hits, load_hits, len(self.requests_by_start))
        self.requests_by_start.append(req)
        self.gpu_hits_by_start.append(gpu_hits)
        self.store_points_by_start.append(0)  # set when its prefill ends
        stats.requests += 1
        stats.refs += num_blocks
        stats.prompt_tokens += req.input_tokens
        stats.gpu_hit_blocks += gpu_hits
        stats.gpu_hit_tokens += min(req.input_tokens, gpu_hits * self.config.block_tokens)
        if load_hits and self.manager is not None:
            hit_keys = keys[gpu_hits : gpu_hits + load_hits]
            started = time.perf_counter()
            spec = self.manager.prepare_load(hit_keys)
            self._timed(started)
            running.load_job = self._job_id()
            self.backend.submit_load(
                running.load_job, hit_keys, spec, running.slots[gpu_hits : gpu_hits + load_hits]
            )
            self._pinned_blocks += load_hits
            stats.peak_pinned_blocks = max(stats.peak_pinned_blocks, self._pinned_blocks)
            delay = self._transfer("load", load_hits)
            self._at(delay, _LOAD_DONE, running)
        else:
            self._prefill(running)
        return _STARTED

    def _wait_ended(self, index: int) -> None:
        """Request ``index``, kept waiting by a ``None`` answer, starts (answered, out of
        retries, or with no lookup left past a GPU hit that grew meanwhile): its retry will
        not come, and the tiered manager's record of it must not take the next request with
        its prompt for that retry."""
        if self._tiered is not None:
            started = time.perf_counter()
            self._tiered.request_finished(index)
            self._timed(started)

    def _job_id(self) -> int:
        self._seq += 1
        return self._seq

    def _handle(self, kind: int, running: _Running, job: int, keys: list[OffloadKey]) -> bool:
        """Process one event; return whether it finished its request."""
        if kind == _LOAD_DONE:
            self._load_done(running)
        elif kind == _PREFILL_DONE:
            self._prefill_done(running)
        elif kind == _STORE_DONE:
            self._store_done(running, job, keys)
        else:
            running.decoded = True
        return running.decoded and running.pending_stores == 0

    def _load_done(self, running: _Running) -> None:
        start, end = running.gpu_hits, running.gpu_hits + running.load_hits
        keys = running.keys[start:end]
        ok = self.backend.finish(running.load_job)
        if self.manager is not None:
            started = time.perf_counter()
            self.manager.complete_load(keys)
            self._timed(started)
        self._pinned_blocks -= len(keys)
        if ok:
            self.gpu.register(keys, running.slots[start:end])
            self.stats.offload_hit_blocks += len(keys)
            hit_tokens = min(running.req.input_tokens, end * self.config.block_tokens)
            self.stats.offload_hit_tokens += hit_tokens - min(
                running.req.input_tokens, start * self.config.block_tokens
            )
        else:
            self.stats.loads_failed += len(keys)
            running.computed_from = start
        self._prefill(running)

    def _prefill(self, running: _Running) -> None:
        first = running.computed_from
        cached_tokens = min(running.req.input_tokens, first * self.config.block_tokens)
        seconds = (running.req.input_tokens - cached_tokens) / self.config.prefill_tokens_per_s
        self._at(seconds, _PREFILL_DONE, running)

    def _prefill_done(self, running: _Running) -> None:
        req, slots, first = running.req, running.slots, running.computed_from
        computed = req.keys[first:]
        if computed:
            self.backend.compute(computed, slots[first:])
            cacheable = len(running.keys)
            if cacheable > first:
                self.gpu.register(running.keys[first:], slots[first:cacheable])
            self.stats.computed_blocks += len(computed)
        self.store_points_by_start[running.index] = len(self.requests_by_start)
        self._store(running)
        if self._layer is not None:
            started = time.perf_counter()
            self._layer.end_request(running.keys)
            self._timed(started)
        self._at(req.output_tokens / self.config.decode_tokens_per_s, _DECODE_DONE, running)

    def _store(self, running: _Running) -> None:
        """Offer the blocks this request computed (not loaded ones) to the offload tier."""
        manager, stats, keys = self.manager, self.stats, running.keys
        first = running.gpu_hits + running.load_hits
        offered = keys[first:]
        if manager is None or not offered:
            return
        stats.store_offered_blocks += len(offered)
        started = time.perf_counter()
        output = manager.prepare_store(offered)
        self._timed(started)
        if output is None:
            stats.stores_rejected += len(offered)
            return
        held = self._held
        if output.evicted_keys:
            held.difference_update(output.evicted_keys)
            stats.offload_evictions += len(output.evicted_keys)
        to_store = output.keys_to_store
        if to_store == offered:
            slots = running.slots[first : first + len(offered)]
        else:
            chosen = set(to_store)
            holds = self._holds
            refused = [key for key in offered if key not in chosen and not holds(key)]
            stats.stores_skipped_by_admission += len(refused)
            if not to_store:
                return
            slot_of = dict(zip(offered, running.slots[first:], strict=False))
            slots = [slot_of[k] for k in to_store]
        held.update(to_store)
        started = time.perf_counter()
        manager.touch(keys)
        self._timed(started)
        job = self._job_id()
        self.backend.submit_store(job, to_store, slots, output.store_spec)
        self._pending_store_blocks += len(to_store)
        stats.peak_pending_store_blocks = max(
            stats.peak_pending_store_blocks, self._pending_store_blocks
        )
        running.pending_stores += 1
        self._at(self._transfer("store", len(to_store)), _STORE_DONE, running, job, to_store)

    def _store_done(self, running: _Running, job: int, keys: list[OffloadKey]) -> None:
        ok = self.backend.finish(job)
        if self.manager is not None:  # always set: stores exist only with a tier
            started = time.perf_counter()
            self.manager.complete_store(keys, ok)
            self._timed(started)
        self._pending_store_blocks -= len(keys)
        running.pending_stores -= 1
        if ok:
            self.stats.stored_blocks += len(keys)
        else:
            self.stats.stores_failed += len(keys)
            self._held.difference_update(keys)
