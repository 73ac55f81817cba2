"""One simulation run: build the tier from a configuration, replay, and report metrics.

A run's report is a flat record of scalars, so it serialises to one JSON
object or one CSV row without translation.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload.admission import (
    WhatIf,
    WriteBudget,
    admission_params,
    attach_clock,
    available_admissions,
    check_write_budget,
    resolve_admission,
)
from kvoffload.admission.registry import ParamPairs
from kvoffload.core.errors import InvalidArgumentError, check_integer, is_number
from kvoffload.core.layout import KVLayout, layout_preset
from kvoffload.core.tier_protocol import SlotBytes, TierStats
from kvoffload.managers.stack import Stack, StackConfig, build_cpu_stack
from kvoffload.managers.tiered import TieredOffloadingManager
from kvoffload.observe import Observers
from kvoffload.policies import available_policies, resolve_policy
from kvoffload.sim import tier_model
from kvoffload.sim.belady import BeladyResult, belady_bound
from kvoffload.sim.engine import (
    PARTIAL_BLOCK_MODES,
    EngineConfig,
    EngineStats,
    Progress,
    ServingEngine,
)
from kvoffload.sim.transfers import TransferBackend
from kvoffload.sim.workload import Workload

GIB = 2**30
"""Capacities in "GB" are GiB, as vLLM's ``--kv-offloading-size`` is."""


@dataclass(frozen=True)
class SimConfig:
    """Everything that defines a run besides the workload. ``cpu_blocks=0``: no offload tier."""

    gpu_blocks: int
    cpu_blocks: int
    policy: str = "lru"
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    layout: str = "llama-3.1-8b"
    concurrency: int = 1
    prefill_tokens_per_s: float = 10_000.0
    decode_tokens_per_s: float = 50.0
    transfer_gb_per_s: float = 25.0
    bound: bool = True
    """Whether to compute the Belady bound beside the result (never with lower tiers)."""
    partial_block: str = "cache"
    """``"cache"`` or ``"drop"`` a prompt's keyed partial last block (vLLM drops it)."""
    admission: str = "none"
    """Admission layer in front of the tier, by name (``kvoffload.admission``)."""
    write_budget: float | WriteBudget | None = None
    """The budget the optimiser keeps to (``admission="recommended"``): writes per block
    reference, or a :class:`WriteBudget` in bytes per second or drive writes per day."""
    drive_bytes: int | None = None
    """The drive's size for a budget in drive writes per day; ``None``: the disk tier's."""
    admission_params: ParamPairs = ()
    """The admission rule's parameters, ``(name, value)`` pairs (``--admission-param``)."""
    # Tiers below the CPU tier (issue 9): a disk directory and a shared server.
    disk_dir: str | None = None
    disk_blocks: int = 0
    remote_url: str | None = dataclasses.field(default=None, repr=False)  # may hold a password
    tier_store_threshold: int = 0
    """Admission to the lower tiers: lookups seen before a block is written there."""
    disk_admission: str = "none"
    """The disk tier's own admission layer, after ``tier_store_threshold``."""
    disk_write_budget: float | WriteBudget | None = None
    """Writes per block reference reaching the disk tier (``disk_admission="recommended"``)."""
    disk_admission_params: ParamPairs = ()
    """The disk tier's rule's parameters (``--disk-admission-param``)."""
    remote_admission: str = "none"
    remote_write_budget: float | WriteBudget | None = None
    remote_admission_params: ParamPairs = ()
    """The shared tier's rule's parameters (``--remote-admission-param``)."""
    remote_blocks: int = 0
    """The shared tier's size as its admission layer models it."""
    disk_gb_per_s: float = tier_model.DISK_GB_PER_S
    disk_latency_ms: float = tier_model.DISK_LATENCY_MS
    remote_gb_per_s: float = tier_model.REMOTE_GB_PER_S
    remote_latency_ms: float = tier_model.REMOTE_LATENCY_MS
    disk_policy: str | None = None
    """The disk tier's eviction policy; ``None``: the CPU tier's."""
    disk_timeout_ms: float = 10_000.0
    """The deadline of each disk tier operation (plus its bytes at 50 MB/s)."""

    def __post_init__(self) -> None:
        _check_numbers(self)
        if self.partial_block not in PARTIAL_BLOCK_MODES:
            raise InvalidArgumentError(
                f"partial block mode must be one of {', '.join(PARTIAL_BLOCK_MODES)}, "
                f"got {self.partial_block!r}"
            )
        if self.policy not in available_policies():
            raise InvalidArgumentError(
                f"unknown cache policy {self.policy!r}; known: {', '.join(available_policies())}"
            )
        if self.max_tracker_size < 1:
            raise InvalidArgumentError(
                f"max tracker size must be >= 1, got {self.max_tracker_size}"
            )
        layout_preset(self.layout)
        if self.admission not in available_admissions():
            raise InvalidArgumentError(
                f"unknown admission {self.admission!r}; known: {', '.join(available_admissions())}"
            )
        admission_params(self.admission, self.admission_params)
        check_write_budget(self.write_budget)
        if self.write_budget is not None and resolve_admission(self.admission) != "optimiser":
            raise InvalidArgumentError(
                "a write budget needs --admission recommended (the optimiser), "
                f"not {self.admission!r}"
            )
        self._check_tiers()
        self.sized_write_budget(1)

    def _check_tiers(self) -> None:
        if self.disk_policy is not None and self.disk_policy not in available_policies():
            known = ", ".join(available_policies())
            raise InvalidArgumentError(f"unknown disk policy {self.disk_policy!r}; known: {known}")
        if self.disk_dir is not None and self.disk_blocks < 1:
            raise InvalidArgumentError(
                "a disk tier (--disk-dir) needs a size of >= 1 block: --disk-gb or --disk-blocks"
            )
        if self.disk_dir is not None:
            from kvoffload.tiers.disk import check_timeout_ms  # the tiers only when asked for

            check_timeout_ms(self.disk_timeout_ms, "the disk timeout")
        self.tier_costs()
        if self.cpu_blocks > 0:
            self.stack_config()  # the stack's own checks, each naming its field

    def sized_write_budget(self, bytes_per_block: int) -> WriteBudget | None:
        """The write budget with the block and drive sizes it converts with; the drive is
        ``drive_bytes``, or else the disk tier (``disk_blocks`` blocks)."""
        drive = self.drive_bytes
        if drive is None and self.disk_dir is not None:
            drive = self.disk_blocks * bytes_per_block
        return _sized(self.write_budget, bytes_per_block, drive, "--write-budget")

    @property
    def has_lower_tiers(self) -> bool:
        """Whether disk or remote tiers are used: only behind a CPU tier, which promotes hits."""
        return self.cpu_blocks > 0 and (self.disk_dir is not None or self.remote_url is not None)

    @property
    def bounded(self) -> bool:
        """Whether the run gets a Belady bound: asked for, and no lower tier, whose hits can
        come from blocks stored before the run (a reused disk directory, a shared server)."""
        return self.bound and not self.has_lower_tiers

    def stack_config(
        self,
        fingerprint: bytes = b"",
        slot_bytes: SlotBytes | None = None,
        enable_events: bool = False,
        bytes_per_block: int = 1,
    ) -> StackConfig:
        """The manager stack of this run (lower tiers only behind a CPU tier); the write
        budget is sized to ``bytes_per_block``."""
        tiers = self.has_lower_tiers
        disk_dir = self.disk_dir if tiers else None
        remote_url = self.remote_url if tiers else None
        return StackConfig(
            self.cpu_blocks,
            self.policy,
            self.store_threshold,
            self.max_tracker_size,
            self.admission,
            self.sized_write_budget(bytes_per_block),
            admission_params=self.admission_params,
            disk_dir=disk_dir,
            disk_blocks=0 if disk_dir is None else self.disk_blocks,
            disk_policy=self.disk_policy,
            disk_deadline_s=None if disk_dir is None else self.disk_timeout_ms / 1000,
            remote_url=remote_url,
            remote_blocks=0 if remote_url is None else self.remote_blocks,
            tier_store_threshold=self.tier_store_threshold,
            disk_admission=self.disk_admission,
            disk_write_budget=_sized(
                self.disk_write_budget,
                bytes_per_block,
                self.drive_bytes or self.disk_blocks * bytes_per_block,
                "--disk-write-budget",
            ),
            disk_admission_params=self.disk_admission_params,
            remote_admission=self.remote_admission,
            remote_admission_params=self.remote_admission_params,
            remote_write_budget=_sized(
                self.remote_write_budget,
                bytes_per_block,
                self.remote_blocks * bytes_per_block,
                "--remote-write-budget",
            ),
            enable_events=enable_events,
            wait_for_tiers=True,
            slot_bytes=slot_bytes,
            fingerprint=fingerprint,
        )

    def tier_costs(self) -> dict[str, tier_model.TierCost]:
        """The cost model of the lower tiers, by tier name."""
        return {
            "disk": tier_model.TierCost(self.disk_gb_per_s, self.disk_latency_ms),
            "remote": tier_model.TierCost(self.remote_gb_per_s, self.remote_latency_ms),
        }

    def kv_layout(self, block_tokens: int) -> KVLayout:
        """The layout preset, resized to the workload's block size."""
        return layout_preset(self.layout).with_block_size(block_tokens)

    def engine_config(self, block_tokens: int) -> EngineConfig:
        """The serving engine this run replays through, for a workload of ``block_tokens``."""
        return EngineConfig(
            gpu_blocks=self.gpu_blocks,
            bytes_per_block=self.kv_layout(block_tokens).bytes_per_block,
            block_tokens=block_tokens,
            concurrency=self.concurrency,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            decode_tokens_per_s=self.decode_tokens_per_s,
            transfer_bytes_per_s=self.transfer_gb_per_s * 1e9,
            partial_block=self.partial_block,
        )


_INTEGER_FIELDS = (
    "gpu_blocks",
    "cpu_blocks",
    "store_threshold",
    "max_tracker_size",
    "concurrency",
    "disk_blocks",
    "remote_blocks",
    "tier_store_threshold",
)
_RATE_FIELDS = (
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
    "transfer_gb_per_s",
    "disk_gb_per_s",
    "remote_gb_per_s",
)
_LATENCY_FIELDS = ("disk_latency_ms", "remote_latency_ms")


def _check_numbers(config: SimConfig) -> None:
    """Integers must be integers, rates finite and positive and latencies finite and not
    negative, whatever the caller passed (a tier's, even when the run has no such tier)."""
    for name in _INTEGER_FIELDS:
        check_integer(name, getattr(config, name), 0)
    if config.gpu_blocks < 1 or config.concurrency < 1:
        raise InvalidArgumentError(
            f"gpu_blocks and concurrency must be >= 1, got {config.gpu_blocks} "
            f"and {config.concurrency}"
        )
    for name in _RATE_FIELDS:
        value = getattr(config, name)
        if not (is_number(value) and math.isfinite(value) and value > 0):
            raise InvalidArgumentError(f"{name} must be a finite number > 0, got {value!r}")
    if not math.isfinite(config.transfer_gb_per_s * 1e9):  # the engine runs on bytes per second
        raise InvalidArgumentError(
            f"transfer_gb_per_s must be below {sys.float_info.max / 1e9:.3g} GB/s, "
            f"got {config.transfer_gb_per_s!r}"
        )
    for name in _LATENCY_FIELDS:
        value = getattr(config, name)
        if not (is_number(value) and math.isfinite(value) and value >= 0):
            raise InvalidArgumentError(f"{name} must be a finite number >= 0, got {value!r}")
    if not is_number(config.disk_timeout_ms):  # its range is checked with a disk tier
        raise InvalidArgumentError(
            f"disk_timeout_ms must be a number of milliseconds, got {config.disk_timeout_ms!r}"
        )
    if config.drive_bytes is not None:
        check_integer("drive_bytes", config.drive_bytes, 1)
    if not isinstance(config.bound, bool):
        raise InvalidArgumentError(f"bound must be true or false, got {config.bound!r}")


def blocks_for_gib(gib: float, layout: str, block_tokens: int) -> int:
    """How many whole blocks of ``block_tokens`` tokens fit in ``gib`` GiB under ``layout``."""
    if not (is_number(gib) and math.isfinite(gib)) or gib < 0:
        raise InvalidArgumentError(f"a capacity in GB must be a finite number >= 0, got {gib!r}")
    blocks = gib * GIB // layout_preset(layout).with_block_size(block_tokens).bytes_per_block
    if not math.isfinite(blocks):  # past the float range in bytes
        raise InvalidArgumentError(f"a capacity of {gib:g} GB is past any machine's memory")
    return int(blocks)


@dataclass(frozen=True)
class RunReport:
    """The metrics of one run. Ratios are per block reference; ``*_blocks`` count blocks."""

    workload: str
    requests: int
    refs: int
    unique_blocks: int
    block_tokens: int
    layout: str
    bytes_per_block: int
    gpu_blocks: int
    gpu_gib: float
    cpu_blocks: int
    cpu_gib: float
    policy: str
    store_threshold: int
    concurrency: int
    total_hit_ratio: float
    gpu_hit_ratio: float
    offload_hit_ratio: float
    belady_total_hit_ratio: float | None
    """Total hit ratio with a Belady offload tier of the same size; ``None`` if not computed."""
    belady_offload_hit_ratio: float | None
    gpu_hit_blocks: int
    offload_hit_blocks: int
    computed_blocks: int
    offload_blocks_written: int
    offload_bytes_written: int
    offload_blocks_read: int
    offload_bytes_read: int
    gpu_blocks_written: int
    """Blocks written into GPU memory: computed by prefill or loaded from the tier."""
    gpu_bytes_written: int
    gpu_blocks_read: int
    """Blocks read from GPU memory to be stored in the tier."""
    gpu_bytes_read: int
    writes_per_ref: float
    stores_offered: int
    stores_skipped_by_admission: int
    stores_rejected: int
    """Offered blocks not stored because ``prepare_store`` found no room (``None``)."""
    stores_failed: int
    loads_failed: int
    offload_evictions: int
    gpu_evictions: int
    prefill_seconds_baseline: float
    """Prefill time of every prompt token at the modelled throughput, with no cache at all."""
    prefill_seconds_saved: float
    prefill_seconds_saved_by_offload: float
    """Prefill time the tier's hits saved, less the time spent loading them and the lower
    tiers' modelled time reading the blocks they promoted."""
    load_seconds: float
    store_seconds: float
    lookups: int
    lookups_deferred: int
    peak_pending_store_blocks: int
    peak_pinned_blocks: int
    simulated_seconds: float
    manager_us_per_block: float
    wall_seconds: float
    refs_per_second: float
    partial_block: str
    admission: str = "none"
    """The admission layer's canonical name; the ``admission_*`` counters are its stats."""
    admission_offers: int = 0
    admission_admitted: int = 0
    admission_rejected: int = 0
    admission_ghost_hits: int = 0
    admission_control: float | None = None
    admission_bytes_per_key: float | None = None
    admission_candidate: str = ""
    """The rule an optimising layer followed at the end of the run."""
    admission_switches: int = 0
    """How many times an optimising layer changed the rule it follows."""
    whatif: dict[str, dict[str, dict[str, float | None]]] = dataclasses.field(default_factory=dict)
    """``candidate -> capacity factor -> {hit_ratio, writes_per_ref}`` over the whole run, from
    an optimising layer's miniature simulations (``None``: nothing sampled); empty for other
    layers."""
    tiers: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Per tier (``cpu``, ``disk``, ``remote``): hits, stores, bytes, failures, modelled seconds;
    a lower tier with its own optimiser also has ``admission_candidate``,
    ``admission_switches`` and a ``whatif`` object, as the CPU tier's are above."""

    def as_dict(self) -> dict[str, Any]:
        """The report; every value is a scalar except ``tiers`` and ``whatif``, nested objects."""
        return dataclasses.asdict(self)


def simulate(
    workload: Workload,
    config: SimConfig,
    backend: TransferBackend | None = None,
    progress: Progress | None = None,
    observers: Observers | None = None,
    bound_progress: Progress | None = None,
) -> RunReport:
    """Replay ``workload`` under ``config`` and return the run's metrics.

    ``observers`` wrap the tier's manager (see :class:`~kvoffload.observe.Observers`)
    to export its KV events and metrics while the replay runs. ``progress`` follows the
    replay, ``bound_progress`` the Belady bound's passes after it.
    """
    started = time.perf_counter()
    engine_config = config.engine_config(workload.block_tokens)
    bytes_per_block = engine_config.bytes_per_block
    enable_events = observers is not None and bool(observers.sinks)
    stack = _stack(config, workload.block_tokens, bytes_per_block, backend, enable_events)
    manager = None if stack is None else stack.manager
    observed = None
    if manager is not None and observers is not None:
        manager = observed = observers.wrap(manager, bytes_per_block)
        observers.watch_transfers(backend)
    engine = ServingEngine(
        engine_config,
        manager,
        backend,
        holds=None if stack is None else stack.holds,
        admission=None if stack is None else stack.admission,
    )
    if stack is not None:  # a per-time budget runs on trace time
        for layer in (stack.manager, stack.disk_admission, stack.remote_admission):
            if layer is not None:
                attach_clock(layer, engine.now)
    try:
        stats = engine.run(workload.requests, progress)
    finally:
        if stack is not None:
            stack.close()
        if observed is not None:  # closing lands promotions and writes: their events
            observed.flush()
    tiered = None if stack is None else stack.tiered
    bound = None
    if config.bounded:
        # The run's own order, GPU hits and store times: overlapping or parked requests
        # change them, and a sequential replay's bound is then no bound on this run.
        bound = belady_bound(
            engine.requests_by_start,
            config.gpu_blocks,
            config.cpu_blocks,
            _drop_partial_of(workload, config),
            engine.gpu_hits_by_start,
            engine.store_points_by_start,
            bound_progress,
        )
    wall = time.perf_counter() - started

    refs = stats.refs
    per_ref = 1.0 / refs if refs else 0.0
    written = stats.stored_blocks + stats.stores_failed
    read = stats.offload_hit_blocks + stats.loads_failed
    prefill_rate = config.prefill_tokens_per_s
    tiers = tier_model.tiers_report(
        tiered, _cpu_stats(stats, tiered), bytes_per_block, config.tier_costs()
    )
    # A hit promoted from a lower tier was read from it before the CPU tier loaded it.
    saved_by_offload = (
        stats.offload_hit_tokens / prefill_rate
        - stats.load_seconds
        - tier_model.read_seconds(tiers)
    )
    report = RunReport(
        workload=workload.name,
        requests=stats.requests,
        refs=refs,
        unique_blocks=workload.unique_blocks,
        block_tokens=workload.block_tokens,
        layout=config.layout,
        bytes_per_block=bytes_per_block,
        gpu_blocks=config.gpu_blocks,
        gpu_gib=config.gpu_blocks * bytes_per_block / GIB,
        cpu_blocks=config.cpu_blocks,
        cpu_gib=config.cpu_blocks * bytes_per_block / GIB,
        policy=resolve_policy(config.policy),
        store_threshold=config.store_threshold,
        concurrency=config.concurrency,
        total_hit_ratio=(stats.gpu_hit_blocks + stats.offload_hit_blocks) * per_ref,
        gpu_hit_ratio=stats.gpu_hit_blocks * per_ref,
        offload_hit_ratio=stats.offload_hit_blocks * per_ref,
        belady_total_hit_ratio=None if bound is None else bound.total_hit_ratio,
        belady_offload_hit_ratio=None if bound is None else bound.offload_hit_ratio,
        gpu_hit_blocks=stats.gpu_hit_blocks,
        offload_hit_blocks=stats.offload_hit_blocks,
        computed_blocks=stats.computed_blocks,
        offload_blocks_written=written,
        offload_bytes_written=written * bytes_per_block,
        offload_blocks_read=read,
        offload_bytes_read=read * bytes_per_block,
        gpu_blocks_written=stats.computed_blocks + read,
        gpu_bytes_written=(stats.computed_blocks + read) * bytes_per_block,
        gpu_blocks_read=written,
        gpu_bytes_read=written * bytes_per_block,
        writes_per_ref=written * per_ref,
        stores_offered=stats.store_offered_blocks,
        stores_skipped_by_admission=stats.stores_skipped_by_admission,
        stores_rejected=stats.stores_rejected,
        stores_failed=stats.stores_failed,
        loads_failed=stats.loads_failed,
        # The CPU tier's own count where it has lower tiers: a lookup's promotions from
        # them evict CPU blocks too, which no store of the engine's reports.
        offload_evictions=stats.offload_evictions if tiered is None else tiered.cpu_stats.evicted,
        gpu_evictions=stats.gpu_evictions,
        prefill_seconds_baseline=stats.prompt_tokens / prefill_rate,
        prefill_seconds_saved=stats.gpu_hit_tokens / prefill_rate + saved_by_offload,
        prefill_seconds_saved_by_offload=saved_by_offload,
        load_seconds=stats.load_seconds,
        store_seconds=stats.store_seconds,
        lookups=stats.lookups,
        lookups_deferred=stats.lookups_deferred,
        peak_pending_store_blocks=stats.peak_pending_store_blocks,
        peak_pinned_blocks=stats.peak_pinned_blocks,
        simulated_seconds=stats.simulated_seconds,
        manager_us_per_block=stats.manager_seconds * 1e6 * per_ref,
        wall_seconds=wall,
        refs_per_second=refs / wall if wall > 0 else 0.0,
        partial_block=config.partial_block,
        tiers=tiers,
    )
    return _with_tier_optimisers(_with_admission(report, config, stack), stack)


def bound_of(workload: Workload, config: SimConfig) -> BeladyResult:
    """The Belady bound of ``config``'s capacities over ``workload`` replayed one request after
    another (see :func:`belady_bound`): a run's own bound when it starts them in arrival order,
    which only a sequential run without lower tiers (whose lookups can park) is sure to do."""
    return belady_bound(
        workload.requests, config.gpu_blocks, config.cpu_blocks, _drop_partial_of(workload, config)
    )


def _drop_partial_of(workload: Workload, config: SimConfig) -> int | None:
    return workload.block_tokens if config.partial_block == "drop" else None


def _with_admission(report: RunReport, config: SimConfig, stack: Stack | None) -> RunReport:
    """``report`` with the admission's name and counters filled in: the layer's, or the seed
    filter's (admission 'filter', or a store threshold), which is no layer: its offers are
    the tier's, its refusals what admission skipped."""
    report = dataclasses.replace(report, admission=resolve_admission(config.admission))
    if stack is None:
        return report
    layer = stack.admission
    if layer is None:
        if stack.manager is stack.direct:
            return report
        skipped = report.stores_skipped_by_admission
        return dataclasses.replace(
            report,
            admission_offers=report.stores_offered,
            admission_admitted=report.stores_offered - skipped,
            admission_rejected=skipped,
        )
    stats = layer.stats()
    return dataclasses.replace(
        report,
        admission_offers=stats.offers,
        admission_admitted=stats.admitted,
        admission_rejected=stats.rejected,
        admission_ghost_hits=stats.ghost_hits,
        admission_control=stats.control,
        admission_bytes_per_key=stats.bytes_per_tracked_key,
        admission_candidate=stats.candidate,
        admission_switches=stats.switches,
        whatif=whatif_table(stats.whatif_total),
    )


def _with_tier_optimisers(report: RunReport, stack: Stack | None) -> RunReport:
    """``report`` with each lower tier's optimiser (its own ``--disk-admission`` /
    ``--remote-admission recommended``) in that tier's entry, named as the CPU tier's are
    at the top: ``admission_candidate``, ``admission_switches`` and ``whatif``."""
    tiered = None if stack is None else stack.tiered
    if tiered is None:
        return report
    tiers = dict(report.tiers)
    for tier, layer in zip(tiered.tiers, tiered.admissions, strict=True):
        stats = None if layer is None else layer.stats()
        if stats is None or not stats.whatif_total:
            continue
        name = tier.medium.lower()
        tiers[name] = {
            **tiers[name],
            "admission_candidate": stats.candidate,
            "admission_switches": stats.switches,
            "whatif": whatif_table(stats.whatif_total),
        }
    return dataclasses.replace(report, tiers=tiers)


def whatif_table(figures: Sequence[WhatIf]) -> dict[str, dict[str, dict[str, float | None]]]:
    """What-if figures as ``candidate -> capacity factor (as text) -> figures`` (a figure
    not known yet is ``None``, ``null`` in the JSON)."""
    table: dict[str, dict[str, dict[str, float | None]]] = {}
    for f in figures:
        table.setdefault(f.candidate, {})[f"{f.capacity_factor:g}"] = {
            "hit_ratio": f.hit_ratio,
            "writes_per_ref": f.writes_per_ref,
            "sampling_rate": f.sampling_rate,
        }
    return table


def _sized(
    budget: float | WriteBudget | None, bytes_per_block: int, drive_bytes: int | None, option: str
) -> WriteBudget | None:
    """``budget`` with the block and drive sizes a per-time budget converts with; an error
    names ``option``, the budget's: with budgets of two tiers, it said neither."""
    if budget is None:
        return None
    sized = WriteBudget.parse(budget).sized(bytes_per_block, drive_bytes or None)
    try:
        sized.check()
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{option}: {exc}") from None
    return sized


def _stack(
    config: SimConfig,
    block_tokens: int,
    bytes_per_block: int,
    backend: TransferBackend | None,
    enable_events: bool,
) -> Stack | None:
    """The run's manager stack (``None`` without a CPU tier); real bytes in the lower tiers
    if ``backend`` has them."""
    if config.cpu_blocks == 0:
        return None
    if not config.has_lower_tiers:
        return build_cpu_stack(
            config.stack_config(enable_events=enable_events, bytes_per_block=bytes_per_block)
        )
    # The tiers are imported only now: a run without them needs neither files nor client.
    from kvoffload.tiers import build_stack, layout_fingerprint

    slot_bytes = getattr(backend, "slot_bytes", None)
    layout = config.kv_layout(block_tokens)
    payload = layout.bytes_per_block if slot_bytes is not None else 0
    fingerprint = layout_fingerprint(config.layout, layout, payload)
    return build_stack(config.stack_config(fingerprint, slot_bytes, enable_events, bytes_per_block))


def _cpu_stats(stats: EngineStats, tiered: TieredOffloadingManager | None) -> TierStats:
    """The CPU tier's entry: its hits are the blocks loaded intact, its failures the
    copies to or from the GPU that failed and its rejections the offered blocks that
    found no room, as the engine counts them (the manager knows the loads it started,
    not which copies failed); with lower tiers, its stores and evictions are the
    manager's, which include the promotions no engine call makes."""
    cpu = tiered.cpu_stats if tiered is not None else None
    return TierStats(
        hit_blocks=stats.offload_hit_blocks,
        stored_blocks=stats.stored_blocks if cpu is None else cpu.stored_blocks,
        failed=stats.stores_failed + stats.loads_failed,
        evicted=stats.offload_evictions if cpu is None else cpu.evicted,
        rejected=stats.stores_rejected,
    )
