"""``KVOffloadSpec``: kvoffload's managers and data plane as a vLLM 0.33 offloading spec.

vLLM loads it out of tree from ``kv_connector_extra_config``::

    {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.integrations.vllm",
     "cpu_bytes_to_use": 64000000000, "eviction_policy": "arc", "store_threshold": 2}
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingSpec,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvoffload.admission import WriteBudget, available_admissions, resolve_admission
from kvoffload.core.errors import InvalidArgumentError, KVOffloadError
from kvoffload.dataplane.shared_region import default_directory, region_path
from kvoffload.dataplane.shared_slot_bytes import SharedSlotBytes
from kvoffload.integrations.vllm.adapter import (
    CONTROL_METRIC,
    GHOST_HITS_METRIC,
    HELD_BLOCKS_METRIC,
    METRIC_PREFIX,
    SWITCHES_METRIC,
    VLLMManagerAdapter,
)
from kvoffload.integrations.vllm.offer_filter import OfferCountFilter
from kvoffload.integrations.vllm.settings import (
    ADMISSION_KEY,
    CONNECTOR_KEYS,
    DISK_ADMISSION_KEY,
    DISK_BYTES_KEY,
    DISK_DIR_KEY,
    DISK_WRITE_BUDGET_KEY,
    OWN_KEYS,
    REMOTE_ADMISSION_KEY,
    REMOTE_BYTES_KEY,
    REMOTE_URL_KEY,
    REMOTE_WRITE_BUDGET_KEY,
    SPEC_KEYS,
    WRITE_BUDGET_KEY,
    SpecSettings,
    parse_settings,
)
from kvoffload.integrations.vllm.versions import running_release
from kvoffload.managers.stack import Stack, StackConfig
from kvoffload.observe.counters import COUNTER_DOCS
from kvoffload.observe.metrics import (
    CANDIDATE,
    RECOVERY_DOCS,
    RECOVERY_LABELS,
    SWITCHES_DOC,
    TIER_COUNT_DOCS,
    WHATIF_DOCS,
    WHATIF_LABELS,
)
from kvoffload.tiers import RemoteTierError, build_stack, fingerprint_of, parse_remote_url
from kvoffload.tiers.disk import DiskTier
from kvoffload.tiers.slot_file import slot_note, slot_start, slot_stride, slots_within

logger = logging.getLogger(__name__)

CONFIG_INFO_KEYS = (
    "tier",
    "medium",
    "num_blocks",
    "size_bytes",
    "block_bytes",
    "blocks_per_chunk",
    "eviction_policy",
    "store_threshold",
    "admission",
    "address",
    "fingerprint",
    "reset_drops_blocks",
)
"""Labels of ``vllm:kv_offload_config_info``; a tier leaves empty what it does not have
(the shared tier has no size of its own, a lower tier no admission unless it has its own)."""


class KVOffloadSpec(OffloadingSpec):  # type: ignore[misc]
    """Scheduler side: a :class:`VLLMManagerAdapter` over our manager stack.
    Worker side: our batched CPU<->GPU handlers behind vLLM's ``OffloadingWorker``.

    The settings are checked in the constructor, so a bad key or value stops
    vLLM at start-up with an error naming it. With lower tiers each worker
    keeps its CPU slots in a shared region named by vLLM's engine id (unique
    per launch and data-parallel replica, the same in the scheduler and the
    workers) and its rank; the scheduler maps every rank's region
    (:class:`SharedSlotBytes`) when its tier stack first needs the bytes.
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """Our counters and the held-blocks gauge (and the admission layer's), for ``/metrics``."""
        definitions: dict[str, Any] = {
            f"{METRIC_PREFIX}{name}": OffloadingCounterMetadata(documentation=doc)
            for name, doc in COUNTER_DOCS.items()
        }
        definitions[HELD_BLOCKS_METRIC] = OffloadingGaugeMetadata(
            documentation="Blocks holding a slot in kvoffload's CPU tier (stored or pending)."
        )
        if extra_config.get(ADMISSION_KEY, "none") not in (None, "none"):
            definitions[GHOST_HITS_METRIC] = OffloadingCounterMetadata(
                documentation="First-seen offered blocks requested again while the "
                "admission layer remembered them."
            )
            definitions[CONTROL_METRIC] = OffloadingGaugeMetadata(
                documentation="The admission layer's control value (feedback: share of block "
                "classes written on first sight; sketch: its sightings threshold)."
            )
        definitions.update(_whatif_definitions(extra_config))
        if extra_config.get(DISK_DIR_KEY) is not None:  # what the disk tier found on start
            for name, doc in RECOVERY_DOCS.items():
                definitions[f"{METRIC_PREFIX}{name}"] = OffloadingGaugeMetadata(
                    documentation=doc, labelnames=RECOVERY_LABELS[name]
                )
        if any(extra_config.get(key) is not None for key in (DISK_DIR_KEY, REMOTE_URL_KEY)):
            for name, doc in TIER_COUNT_DOCS.items():  # what each lower tier did
                definitions[f"{METRIC_PREFIX}{name}"] = OffloadingCounterMetadata(
                    documentation=doc, labelnames=("tier",)
                )
        return definitions

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """The labels of ``vllm:kv_offload_config_info``: one series per tier."""
        return CONFIG_INFO_KEYS

    def config_info(self) -> list[dict[str, str | int | bool]]:
        """The facts of each tier, CPU first, as :meth:`config_info_keys` names them."""
        settings = self.settings
        common = {
            "blocks_per_chunk": self.blocks_per_chunk,
            "block_bytes": self.bytes_per_block,
            "fingerprint": self.fingerprint.hex(),
        }
        cpu = {
            "tier": "cpu",
            "medium": "CPU",
            "num_blocks": self.num_blocks,
            "size_bytes": self.num_blocks * self.bytes_per_block,
            "eviction_policy": settings.eviction_policy,
            "store_threshold": settings.store_threshold,
            "admission": settings.admission,
            "reset_drops_blocks": True,
        }
        series = [{**common, **cpu}]
        if settings.disk_dir is not None:
            disk = {
                "tier": "disk",
                "medium": "DISK",
                "num_blocks": self.disk_blocks,
                "size_bytes": slot_start(self.disk_blocks, self.disk_slot_bytes),
                "eviction_policy": settings.eviction_policy,
                "reset_drops_blocks": True,
            }
            if settings.disk_admission != "none":
                disk["admission"] = settings.disk_admission
            series.append({**common, **disk})
        if settings.remote_url is not None:
            remote = {
                "tier": "remote",
                "medium": "REMOTE",
                "address": parse_remote_url(settings.remote_url).redacted(),
                "reset_drops_blocks": False,
            }
            if settings.remote_admission != "none":
                remote["admission"] = settings.remote_admission
            series.append({**common, **remote})
        return series

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        check_one_kv_group(len(config.groups))
        self.release = running_release()
        self.settings: SpecSettings = parse_settings(set_keys(self.extra_config))
        if self.settings.remote_url is not None:
            # The URL's syntax now; the server answers when the scheduler builds its manager.
            try:
                parse_remote_url(self.settings.remote_url)
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(
                    f"kv_connector_extra_config {REMOTE_URL_KEY!r}: {exc}"
                ) from None
        self.world_size = max(1, config.parallel.world_size)
        self.rank_slot_bytes = config.worker_kv_bytes_per_block * self.blocks_per_chunk
        self.bytes_per_block = self.rank_slot_bytes * self.world_size
        if self.bytes_per_block <= 0:
            raise InvalidArgumentError("vLLM reported no KV bytes per block; cannot size the tier")
        self.num_blocks = self.settings.cpu_bytes_to_use // self.bytes_per_block
        if self.num_blocks < 1:
            raise InvalidArgumentError(
                f"cpu_bytes_to_use {self.settings.cpu_bytes_to_use} holds no offloaded block "
                f"of {self.bytes_per_block} bytes"
            )
        # The whole slot file (superblock, and per block every rank's bytes with their
        # header, page-aligned) fits in disk_bytes, however many ranks there are.
        self.disk_slot_bytes = slot_stride(self.bytes_per_block)
        self.disk_blocks = slots_within(self.settings.disk_bytes, self.bytes_per_block)
        if self.settings.disk_dir is not None and self.disk_blocks < 1:
            raise InvalidArgumentError(
                f"kv_connector_extra_config {DISK_BYTES_KEY!r} {self.settings.disk_bytes} holds "
                f"no offloaded block of {self.bytes_per_block} bytes "
                f"({slot_note(self.bytes_per_block)})"
            )
        self.remote_blocks = self.settings.remote_bytes // self.bytes_per_block
        if self.settings.remote_admission != "none" and self.remote_blocks < 1:
            raise InvalidArgumentError(
                f"kv_connector_extra_config {REMOTE_BYTES_KEY!r} {self.settings.remote_bytes} "
                f"holds no offloaded block of {self.bytes_per_block} bytes"
            )
        # The CPU tier's budget and the disk tier's count drive writes per day against
        # kvoffload.drive_bytes, or else the disk tier's size; the shared tier's against its
        # share of the server (kvoffload.remote_bytes).
        self.write_budget = self._sized(
            self.settings.write_budget, self._disk_drive_bytes(), WRITE_BUDGET_KEY
        )
        self.disk_write_budget = self._sized(
            self.settings.disk_write_budget, self._disk_drive_bytes(), DISK_WRITE_BUDGET_KEY
        )
        self.remote_write_budget = self._sized(
            self.settings.remote_write_budget,
            self.settings.remote_bytes or None,
            REMOTE_WRITE_BUDGET_KEY,
        )
        self.fingerprint = _fingerprint(config, self.rank_slot_bytes, self.world_size)
        self._manager: VLLMManagerAdapter | None = None
        self._stack: Stack | None = None
        """The last stack built with lower tiers (closed on a reset or at shutdown)."""
        self._worker: Any = None
        self._slot_bytes: SharedSlotBytes | None = None

    def _disk_drive_bytes(self) -> int | None:
        """The drive that drive writes per day count against: ``kvoffload.drive_bytes``, or
        else the disk tier's size, as in the simulator."""
        if self.settings.drive_bytes is None and self.settings.disk_dir is not None:
            return self.settings.disk_bytes
        return self.settings.drive_bytes

    def _sized(self, budget: WriteBudget | None, drive: int | None, key: str) -> WriteBudget | None:
        """``budget`` in this spec's blocks, ``drive`` its drive's size; an error names ``key``."""
        if budget is None:
            return None
        budget = budget.sized(self.bytes_per_block, drive)
        try:
            budget.check()
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"kv_connector_extra_config {key!r}: {exc}") from None
        return budget

    def region_path(self, rank: int) -> Path:
        """Where worker ``rank`` keeps its CPU slots when lower tiers are configured."""
        return region_path(default_directory(), self.config.engine_id, rank)

    def shared_slot_bytes(self) -> SharedSlotBytes:
        """The scheduler's view of the workers' slots (kept across cache resets)."""
        if self._slot_bytes is None:
            paths = [self.region_path(rank) for rank in range(self.world_size)]
            self._slot_bytes = SharedSlotBytes(paths, self.num_blocks, self.rank_slot_bytes)
        return self._slot_bytes

    def build_backing(self) -> Stack:
        """The manager stack behind the adapter, through the package's one builder.

        The stack is the admission layer (if any) over the CPU tier and its lower tiers.
        vLLM-style ``store_threshold`` filtering stays in the adapter, because vLLM counts
        store offers where the seed counts lookups.
        """
        events = bool(self.kv_events_config.enable_kv_cache_events)
        settings = self.settings
        if not settings.has_lower_tiers:
            return build_stack(self.stack_config(events))
        # A second build is vLLM's reset_cache: the local disk tier is this engine's and is
        # emptied with the CPU tier; the shared tier belongs to every engine on it and
        # keeps its blocks.
        resetting = self._stack is not None
        self._close_tiers(wipe_disk=resetting)
        config = self.stack_config(events, self.shared_slot_bytes())
        try:
            self._stack = build_stack(config)
        except KVOffloadError as exc:
            if resetting:  # once the engine runs, nothing raises into it
                return self._cpu_tier_alone(config, exc)
            if isinstance(exc, RemoteTierError):
                raise RemoteTierError(
                    f"kv_connector_extra_config {REMOTE_URL_KEY!r}: {exc}"
                ) from None
            if isinstance(exc, InvalidArgumentError):
                raise InvalidArgumentError(
                    f"kv_connector_extra_config {DISK_DIR_KEY!r}: {exc}"
                ) from None
            raise
        return self._stack

    def _cpu_tier_alone(self, config: StackConfig, why: KVOffloadError) -> Stack:
        """The stack without its lower tiers, when they cannot open again at a reset (the
        server down, the directory taken or replaced by a link): vLLM's reset must not
        fail for them; the engine runs on the CPU tier until it restarts."""
        logger.warning(
            "kvoffload: the lower tiers could not open again after vLLM's cache reset, so "
            "this engine runs on its CPU tier alone until it restarts: %s",
            why,
        )
        alone = dataclasses.replace(
            config,
            disk_dir=None,
            disk_blocks=0,
            disk_deadline_s=None,
            remote_url=None,
            remote_blocks=0,
            disk_admission="none",
            disk_write_budget=None,
            disk_admission_params=None,
            remote_admission="none",
            remote_write_budget=None,
            remote_admission_params=None,
            disk_max_pending_write_bytes=None,
            remote_max_pending_write_bytes=None,
        )
        self._stack = build_stack(alone)  # a reset after this one tries the tiers again
        return self._stack

    def stack_config(self, events: bool, slot_bytes: SharedSlotBytes | None = None) -> StackConfig:
        """The stack these settings describe; lower tiers share the CPU tier's policy."""
        settings = self.settings
        return StackConfig(
            self.num_blocks,
            settings.eviction_policy,
            admission=settings.admission,
            write_budget=self.write_budget,
            admission_params=settings.admission_params,
            disk_dir=settings.disk_dir,
            disk_blocks=self.disk_blocks,
            disk_deadline_s=None if settings.disk_dir is None else settings.disk_timeout_ms / 1000,
            disk_max_pending_write_bytes=settings.disk_max_pending_write_bytes,
            remote_url=settings.remote_url,
            remote_blocks=self.remote_blocks,
            disk_admission=settings.disk_admission,
            disk_write_budget=self.disk_write_budget,
            disk_admission_params=settings.disk_admission_params,
            remote_admission=settings.remote_admission,
            remote_write_budget=self.remote_write_budget,
            remote_admission_params=settings.remote_admission_params,
            remote_max_pending_write_bytes=settings.remote_max_pending_write_bytes,
            enable_events=events,
            slot_bytes=slot_bytes,
            fingerprint=self.fingerprint,
            size_keys={
                "cpu_blocks": "kv_connector_extra_config 'cpu_bytes_to_use'",
                "disk_blocks": f"kv_connector_extra_config {DISK_BYTES_KEY!r}",
                "remote_blocks": f"kv_connector_extra_config {REMOTE_BYTES_KEY!r}",
            },
        )

    def _close_tiers(self, wipe_disk: bool = False) -> None:
        if self._stack is not None:
            stack, self._stack = self._stack, None
            if wipe_disk and isinstance(stack.disk, DiskTier):
                stack.disk.empty_on_close = True  # by its open file: a path may be a link now
            stack.close()

    def close(self) -> None:
        """Wait for the lower tiers' writes in flight, close them and unmap the workers'
        regions (nothing without tiers); vLLM calls it through the manager's ``shutdown``."""
        self._close_tiers()
        if self._slot_bytes is not None:
            self._slot_bytes.close()

    def get_manager(self) -> VLLMManagerAdapter:
        if self._manager is None:
            threshold = self.settings.store_threshold
            offer_filter = (
                OfferCountFilter(threshold, self.settings.max_tracker_size)
                if threshold >= 2
                else None
            )
            self._manager = VLLMManagerAdapter(
                self.build_backing,
                offer_filter,
                self.bytes_per_block,
                on_shutdown=self.close,
                info=self.config_info(),
                recency_at_access=self.release.recency_at_access,
                whatif_tier_label=whatif_tiers(self.extra_config) not in ((), ("",)),
            )
        return self._manager

    def get_worker(self, kv_caches: Any) -> Any:
        if self._worker is None:
            from kvoffload.integrations.vllm.worker import KVOffloadWorker

            region = None
            if self.settings.has_lower_tiers:
                region = self.region_path(self.config.parallel.rank)
            self._worker = KVOffloadWorker(
                kv_caches, self.num_blocks, self.blocks_per_chunk, region, self.rank_slot_bytes
            )
        return self._worker


def check_one_kv_group(count: int) -> None:
    """Refuse other than one KV-cache group: the worker copies one group's pages, and a hybrid
    model (full attention beside sliding-window or Mamba layers) has several. The spec checks
    at start-up, where vLLM's config lists the groups to offload, and the worker again when
    it registers the caches."""
    if count != 1:
        raise InvalidArgumentError(
            f"kvoffload's worker handles one KV-cache group, got {count} (a hybrid model: "
            "full attention beside sliding-window or Mamba layers)"
        )


def set_keys(extra_config: Mapping[str, Any]) -> dict[str, Any]:
    """The extra config without the known keys set to ``null``: such a key is unset and takes
    its default, as vLLM reads its own (``get(key) is None``: the default); a required key
    given as ``null`` is missing, and an unknown key is kept, to be refused whatever its
    value. A ``null`` ``store_threshold`` or ``kvoffload.remote_bytes`` stopped start-up."""
    known = SPEC_KEYS | CONNECTOR_KEYS | OWN_KEYS
    return {
        key: value for key, value in extra_config.items() if value is not None or key not in known
    }


def whatif_tiers(extra_config: dict[str, Any]) -> tuple[str, ...]:
    """The tiers whose admission layer is the optimiser, by the ``tier`` label of their
    what-if series: ``""`` for the CPU tier, ``"disk"``, ``"remote"`` (a name start-up
    will refuse counts as none)."""

    def optimiser(key: str) -> bool:
        name = extra_config.get(key)
        return name in available_admissions() and resolve_admission(name) == "optimiser"

    tiers = [""] if optimiser(ADMISSION_KEY) else []
    for tier, location, admission in (
        ("disk", DISK_DIR_KEY, DISK_ADMISSION_KEY),
        ("remote", REMOTE_URL_KEY, REMOTE_ADMISSION_KEY),
    ):
        if extra_config.get(location) is not None and optimiser(admission):
            tiers.append(tier)
    return tuple(tiers)


def _whatif_definitions(extra_config: dict[str, Any]) -> dict[str, Any]:
    """The optimisers' what-if and candidate gauges, labelled as kvoffload's own exporter
    labels them, and their switch counter; none without an optimiser. vLLM declares a
    metric's labels once, so a lower tier's optimiser adds ``tier`` to every series (the
    CPU tier's ``tier=""``, which Prometheus stores as no label): without one the series
    are as they always were."""
    tiers = whatif_tiers(extra_config)
    return whatif_definitions(tiers != ("",)) if tiers else {}


def whatif_definitions(tier_label: bool) -> dict[str, Any]:
    """The what-if and candidate gauges and the switch counter as vLLM declares them, with
    ``tier`` after our exporter's labels where ``tier_label`` (the spec's and a vLLM
    secondary tier's optimisers alike)."""
    tier = ("tier",) if tier_label else ()
    definitions: dict[str, Any] = {
        f"{METRIC_PREFIX}{name}": OffloadingGaugeMetadata(
            documentation=doc,
            labelnames=(("candidate",) if name == CANDIDATE else WHATIF_LABELS) + tier,
        )
        for name, doc in WHATIF_DOCS.items()
    }
    definitions[SWITCHES_METRIC] = OffloadingCounterMetadata(
        documentation=SWITCHES_DOC, labelnames=tier
    )
    return definitions


def _fingerprint(config: OffloadingConfig, rank_slot_bytes: int, world_size: int) -> bytes:
    """What a block's bytes mean under this vLLM configuration.

    A lower tier's block is every rank's slot bytes in rank order, so its
    meaning depends on the model, the KV dtype, the block size (tokens per
    hash, blocks per chunk, each group's tokens per block and layers), the
    layout, and how the KV is split over ranks: tensor, pipeline, prefill- and
    decode-context parallel sizes, the number of ranks and each rank's slot
    size. Which rank holds which part follows from those sizes; the rank
    itself and the data-parallel replica do not change the bytes, so replicas
    of one deployment share blocks.
    """
    return config_fingerprint("vllm", config, world_size, rank_slot_bytes)


def config_fingerprint(
    tag: str, config: OffloadingConfig, world_size: int, *layout: object
) -> bytes:
    """The fingerprint of ``config``'s KV meaning under ``tag`` (our spec: ``vllm``; the
    secondary tiers: ``vllm-tiering``), followed by the caller's ``layout`` fields."""
    parallel = config.parallel
    groups = [(group.tokens_per_block, group.layer_names) for group in config.groups]
    return fingerprint_of(
        tag,
        config.model.name,
        config.model.dtype,
        config.cache.tokens_per_hash,
        config.cache.blocks_per_chunk,
        groups,
        config.kv_cache_layout,
        config.canonical_layout,
        parallel.tp_size,
        parallel.pp_size,
        parallel.pcp_size,
        parallel.dcp_size,
        world_size,
        *layout,
    )
