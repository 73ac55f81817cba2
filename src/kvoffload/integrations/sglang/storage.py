"""``KVOffloadStorage``: our disk and shared (Valkey/Redis) tiers as SGLang's HiCache L3.

SGLang loads it with ``--hicache-storage-backend dynamic`` and an extra
config naming this module and class (see :mod:`kvoffload.integrations.sglang`).
Pages are keyed by SGLang's page hashes under a fingerprint of model, host
layout, page size, dtype, page bytes, interface and shard (TP rank, or one
shard for every rank of an MLA model), so two deployments that share a server
only ever read pages that mean the same to them. Reads try the disk first,
then the shared tier; writes go to each tier its admission layer lets them
into. A slow or dead server, a full disk or a corrupt value is a counted miss
or failed write, never an exception into SGLang.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvoffload.admission import WriteBudget
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import OffloadKey, make_offload_key
from kvoffload.core.manager import OffloadingEvent
from kvoffload.integrations.sglang.pages import HostPages, flat_tensor, tensor_bytes, tensor_parts
from kvoffload.integrations.sglang.paths import L3_SPEC, TierPath
from kvoffload.integrations.sglang.settings import (
    DISK_BYTES,
    DISK_DIR,
    EVENTS_ENDPOINT,
    EVENTS_REPLAY_ENDPOINT,
    METRICS_PORT,
    REMOTE_BYTES,
    REMOTE_URL,
    BackendSettings,
    parse_settings,
)
from kvoffload.managers.stack import LowerTierConfig
from kvoffload.tiers import fingerprint_of, lower_tiers
from kvoffload.tiers.format import Payload, payload_size
from kvoffload.tiers.slot_file import slot_note, slots_within

logger = logging.getLogger(__name__)

GB = 1e9
PREFETCH, BACKUP = "prefetch", "backup"


@dataclass
class L3Metrics:
    """SGLang's ``StorageMetrics`` fields, for installs where its metrics module cannot load."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


METRICS_MODULE = "sglang.srt.observability.metrics_collector"


def _metrics_class() -> type[Any]:
    """SGLang's ``StorageMetrics`` once SGLang has loaded its metrics module (its collector,
    the only caller of ``get_stats``, asserts that type), else :class:`L3Metrics`; the
    module itself is never imported here: it pulls torchvision and more."""
    module = sys.modules.get(METRICS_MODULE)
    found = getattr(module, "StorageMetrics", None)
    return found if isinstance(found, type) else L3Metrics


PAGE_HASH_BYTES = 32
"""SGLang's page hash: a SHA-256 digest, written as 64 lowercase hex digits."""
TEXT_MARK = b"\xff"
"""Ends the bytes of a key that is not a page hash: a byte UTF-8 never holds."""


def page_key(key: str) -> OffloadKey:
    """SGLang's page hash as our key, its 32 bytes; any other string by its UTF-8 bytes (a
    lone surrogate kept) and one :data:`TEXT_MARK`, two where one would make 32 bytes; any
    other key by its ``str()``, as SGLang's own backends format keys.

    No two strings share a page: only a page hash in SGLang's own spelling is read as
    bytes (not ``"30"``, which would be ``"0"``'s, nor ``"AB"``, ``"ab"``'s), and the
    bytes of any other string are never 32 long.
    """
    text = key if isinstance(key, str) else str(key)
    if len(text) == 2 * PAGE_HASH_BYTES:
        try:
            digest = bytes.fromhex(text)
        except ValueError:
            digest = b""
        if digest.hex() == text:  # not "AB.." for "ab..", nor digits spaced out
            return make_offload_key(digest, 0)
    raw = text.encode("utf-8", "surrogatepass") + TEXT_MARK
    if len(raw) == PAGE_HASH_BYTES:
        raw += TEXT_MARK
    return make_offload_key(raw, 0)


def _cpu_tensors(values: Any, count: int) -> TypeGuard[Sequence[torch.Tensor]]:
    """Whether ``values`` is a list (or tuple) of ``count`` CPU tensors."""
    return (
        isinstance(values, (list, tuple))
        and len(values) == count
        and all(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in values)
    )


def _at(target: Any, positions: list[int], index: int) -> Any:
    """``target`` of the ``index``-th key of a read that asks only for ``positions``: one
    buffer, or a page's segments."""
    return target(positions[index])


def offset_endpoint(endpoint: str, offset: int) -> str:
    """``endpoint`` for the ``offset``-th publisher: its TCP port plus ``offset``, or (another
    transport) its address with ``-offset`` appended; unchanged for the first."""
    if offset == 0:
        return endpoint
    head, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port.isdigit():
        return f"{head}:{int(port) + offset}"
    return f"{endpoint}-{offset}"


def data_parallel_rank(storage_config: HiCacheStorageConfig) -> int:
    """This process's data-parallel rank: the storage config's under DP attention, else the
    replica SGLang's launcher recorded (plain ``--dp-size`` replicas are processes of the
    same TP ranks, and their storage configs all say 0); 0 without either."""
    if storage_config.dp_rank:
        return int(storage_config.dp_rank)
    try:
        from sglang.srt.runtime_context import get_parallel

        replica = get_parallel().dp_rank
    except (ImportError, AttributeError, RuntimeError, ValueError):  # nothing recorded
        return 0
    return replica if isinstance(replica, int) and replica > 0 else 0


BYTE_DTYPE = str(torch.uint8)
"""What SGLang's host pools hold an fp8 KV cache as (its device pool's ``store_dtype``),
whichever fp8 format it is."""


def kv_cache_dtype() -> str | None:
    """SGLang's ``--kv-cache-dtype`` (``fp8_e4m3``, ``fp8_e5m2``, ``auto``...) from the config
    its process published; ``None`` where none is (a backend built outside SGLang)."""
    try:
        from sglang.srt.runtime_context import get_model

        value = get_model().kv_cache_dtype
    except (ImportError, AttributeError, RuntimeError, ValueError):  # nothing published
        return None
    return value if isinstance(value, str) else None


class KVOffloadStorage(HiCacheStorage):  # type: ignore[misc]
    """A HiCache L3 backend over kvoffload's disk tier and shared tier.

    The settings are checked in the constructor, so a bad key or value stops
    SGLang at start-up with an error naming it; the tiers open when SGLang
    registers its host pool (the page geometry is known only then), and a
    server that cannot be reached or a directory that cannot be used stops it
    there, naming the key too. ``kwargs`` is what SGLang's factory passes on
    to a dynamic backend (nothing this one reads).
    """

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None
    ) -> None:
        self.storage_config = storage_config
        self.settings: BackendSettings = parse_settings(storage_config.extra_config)
        self.is_writer = bool(storage_config.is_storage_writer)
        self.dp_rank = data_parallel_rank(storage_config)
        """What keeps data-parallel replicas' slot files, ports and events apart."""
        self.kv_cache_dtype = kv_cache_dtype()
        """SGLang's KV cache dtype as given: which fp8 format a pool of bytes holds."""
        if (
            self.settings.disk_dir is not None
            and storage_config.is_mla_model
            and storage_config.tp_size > 1
        ):
            raise InvalidArgumentError(
                f"hicache-storage-backend-extra-config {DISK_DIR!r}: an MLA model's pages are "
                f"written by one rank of {storage_config.tp_size} and read by all; a disk tier "
                f"is one process's, so use {REMOTE_URL!r} for MLA with tp_size > 1"
            )
        self.pages: HostPages | None = None
        self.paths: list[TierPath] = []
        self.fingerprint = b""
        self._publisher: Any = None
        self._parents: dict[OffloadKey, OffloadKey] = {}
        """Per page being written, the page before it in its request, for the store events
        (SGLang's routers chain a store's pages from its parent page); kept during the write
        alone, in which the tiers announce what they stored."""
        self._parents_lock = threading.Lock()
        self._metrics: Any = None
        self._beside: ThreadPoolExecutor | None = None
        """Writes every tier but the first, while the caller's thread writes that one."""
        self._recent = L3Metrics()
        self._recent_lock = threading.Lock()

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._close_parts()
        pages = HostPages(mem_pool_host)
        if not pages.flat and not self.settings.interface_v1:
            raise InvalidArgumentError(
                "this host pool has no flat pages (K and V of different head dims), which "
                "SGLang's copy interface moves: set 'interface_v1': 1 in "
                "hicache-storage-backend-extra-config (its zero-copy interface)"
            )
        self.pages = pages
        self.fingerprint = self._fingerprint(pages)
        try:
            self._open_parts(pages)
        except BaseException:
            self._close_parts()
            raise

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang's hybrid-model controller registers every host pool of the model here; the
        KV pool (the one :meth:`register_mem_pool_host` got) is ours, any other (Mamba, SWA,
        indexer states) would need the ``batch_*_v2`` interface, which this backend does not
        implement: the attach stops, naming the pool, rather than failing mid-request."""
        if host_pool is getattr(self, "mem_pool_host", None):
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            return
        name = getattr(host_pool_name, "value", host_pool_name)
        raise InvalidArgumentError(
            f"kvoffload's HiCache backend stores the KV pool's pages only; this model also has "
            f"the host pool {name!r}, which needs SGLang's batch_*_v2 interface (hybrid models: "
            "Mamba, SWA, indexer pools), not implemented: use another L3 backend for this model"
        )

    # Look-ups (both interfaces), then the zero-copy interface ("interface_v1": 1).

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Leading run of ``keys`` held by the tiers together; a sighting for admission.

        The pages SGLang passes before ``keys`` (``hicache_storage_pass_prefix_keys``) lead
        the request but were not looked up here, as vLLM's GPU-held blocks: the device and
        host hold them, and in a query's later 128-page batch the earlier batches (which
        this query looked up, and found, before). Admission sees each batch's lookup as
        its own pages alone, so its worlds count an L3 hit only where L3 served one."""
        if not keys:
            return 0
        ours = [page_key(key) for key in keys]
        found, served = self._present(ours)
        given = extra_info.prefix_keys if extra_info is not None else None
        prefix = [page_key(key) for key in given or ()]
        request = prefix + ours
        for path in self.paths:
            path.sighted(request, path.name in served, held=len(prefix))
        return found

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read pages straight into the host pool at ``host_indices`` (each into its segments);
        indices that are not ``page_size`` a key inside the pool read nothing (all ``False``)."""
        pages = self._pages()
        if not keys or not pages.fits(host_indices, len(keys)):
            return [False] * len(keys)
        started = time.perf_counter()
        segments = pages.segments(host_indices)
        intact = self._read([page_key(key) for key in keys], segments.__getitem__)
        self._note(PREFETCH, len(intact), sum(intact) * pages.page_bytes, started)
        return intact

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Write the host pool's pages at ``host_indices``, each from its segments as they are
        (MLA: the writer rank only); indices as :meth:`batch_get_v1` refuses store nothing."""
        if not self.is_writer:
            return [True] * len(keys)
        pages = self._pages()
        if not keys or not pages.fits(host_indices, len(keys)):
            return [False] * len(keys)
        started = time.perf_counter()
        given = extra_info.prefix_keys if extra_info is not None else None
        done, moved = self._write(
            [page_key(key) for key in keys],
            pages.segments(host_indices),
            [page_key(key) for key in given or ()],
        )
        self._note(BACKUP, len(done), moved, started)
        return done

    # The copy interface: flat page tensors.

    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        """Each page into its ``target_locations`` tensor (a new page tensor if none given);
        anything but one CPU tensor of a page's bytes per key reads nothing (all ``None``):
        the shared tier would take a value longer or shorter than its target for a corrupt
        one and delete it from the server."""
        pages = self._pages()
        if target_locations is None:
            given = [pages.dummy_page() for _ in keys]
        elif not _cpu_tensors(target_locations, len(keys)) or any(
            t.numel() * t.element_size() != pages.page_bytes for t in target_locations
        ):
            return [None] * len(keys)
        else:
            given = list(target_locations)
        started = time.perf_counter()
        # A destination that is not one run of memory is filled as a copy, returned instead.
        targets = [flat_tensor(t) for t in given]
        views = [tensor_bytes(target) for target in targets]
        intact = self._read([page_key(key) for key in keys], views.__getitem__)
        self._note(PREFETCH, len(intact), sum(intact) * pages.page_bytes, started)
        return [target if ok else None for target, ok in zip(targets, intact, strict=True)]

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Write flat page tensors; whether every page is stored (or held back by admission).
        Anything but a CPU page tensor for each key (``set(key)`` with no value, a page of
        another size) stores nothing and answers ``False``, as for a write that failed."""
        if not self.is_writer:
            return True
        if not _cpu_tensors(values, len(keys)):
            return False
        page_bytes = self._pages().page_bytes
        started = time.perf_counter()
        payloads = [tensor_parts(value) for value in values]
        if any(payload_size(payload) != page_bytes for payload in payloads):
            return False
        done, moved = self._write([page_key(key) for key in keys], payloads)
        self._note(BACKUP, len(done), moved, started)
        return all(done)

    def exists(self, key: str) -> bool:
        return self._present([page_key(key)])[0] == 1

    def clear(self) -> bool:
        """Empty the disk tier, this instance's own; the shared tier keeps its pages, which
        other instances on the server read and announced. KV event subscribers hear
        ``AllBlocksCleared``, or they would go on routing to pages the disk tier lost; they
        forget this instance's shared-tier pages with them, an index holding too little.
        The announcement is made under the disk tier's lock (:meth:`TierPath.clear`), never
        after waiting for the shared tier: a write landing in between would otherwise be
        announced before it, and dropped by the router."""
        disk = next((path for path in self.paths if path.name == "disk"), None)
        if disk is None:
            self._announce_cleared()
        else:
            disk.clear(self._announce_cleared)
        return True

    def get_stats(self) -> Any:
        """SGLang's storage metrics since the last call, with ``kvoffload`` (our counters) added."""
        with self._recent_lock:
            recent, self._recent = self._recent, L3Metrics()
        metrics = _metrics_class()()
        metrics.prefetch_pgs.extend(recent.prefetch_pgs)
        metrics.backup_pgs.extend(recent.backup_pgs)
        metrics.prefetch_bandwidth.extend(recent.prefetch_bandwidth)
        metrics.backup_bandwidth.extend(recent.backup_bandwidth)
        metrics.kvoffload = self.counters()
        return metrics

    def counters(self) -> dict[str, dict[str, Any]]:
        """Per tier (``disk``, ``remote``): our counters, and the admission layer's if any."""
        out: dict[str, dict[str, Any]] = {}
        for path in self.paths:
            values: dict[str, Any] = path.counters().as_dict()
            admission = path.admission_stats()
            if admission is not None:
                values["admission"] = admission
            out[path.name] = values
        return out

    @property
    def metrics_port(self) -> int | None:
        """The port this rank serves ``/metrics`` on (the one picked for
        ``kvoffload.metrics_port`` 0), ``None`` without an endpoint."""
        return None if self._metrics is None else int(self._metrics.port)

    @property
    def publishes_events(self) -> bool:
        """Whether this rank publishes KV events (the first TP rank of the first pipeline
        stage does, for its data-parallel replica)."""
        return self._publisher is not None

    def flush_events(self, timeout_s: float = 10.0) -> None:
        """Wait until the KV events published so far are sent (nothing without a publisher)."""
        if self._publisher is not None:
            self._publisher.flush(timeout_s)

    def close(self) -> None:
        """Finish the writes in flight and close tiers, event publisher and metrics server."""
        self._close_parts()

    # Internals.

    def _pages(self) -> HostPages:
        if self.pages is None:
            raise RuntimeError("SGLang called the storage backend before registering its host pool")
        return self.pages

    def _fingerprint(self, pages: HostPages) -> bytes:
        c = self.storage_config
        if c.is_mla_model:
            shard: tuple[Any, ...] = ("mla", c.dcp_rank, c.dcp_size)
        else:
            shard = ("tp", c.tp_rank, c.tp_size)
        return fingerprint_of(
            "sglang-hicache",
            c.model_name or "",
            pages.layout,
            pages.page_size,
            self._page_dtype(pages),
            pages.page_bytes,
            "v1" if self.settings.interface_v1 else "copy",
            *shard,
            c.pp_rank,
            c.pp_size,
            c.attn_cp_rank,
            c.attn_cp_size,
        )

    def _page_dtype(self, pages: HostPages) -> str:
        """The pages' dtype; for a pool of bytes, with the fp8 format SGLang stores in them
        (``fp8_e4m3`` and ``fp8_e5m2`` pages are both ``uint8`` there: the same bytes read
        in the other format are other numbers)."""
        if pages.dtype == BYTE_DTYPE and self.kv_cache_dtype is not None:
            return f"{pages.dtype}:{self.kv_cache_dtype}"
        return pages.dtype

    def _page_shards(self) -> int:
        """Ranks whose values make up one page of the instance: every TP rank of an MHA
        model (an MLA model's page is one writer's, or one per DCP shard), times the pipeline
        stages and context-parallel ranks (stages of unequal layers: about)."""
        c = self.storage_config
        ranks = c.dcp_size if c.is_mla_model else c.tp_size
        return max(1, int(ranks) * int(c.pp_size) * int(c.attn_cp_size))

    def _open_parts(self, pages: HostPages) -> None:
        s, c = self.settings, self.storage_config
        # One stream per data-parallel replica, as SGLang's own (its is_kv_publisher_rank and
        # select_kv_publisher_dp_rank): the first TP and CP rank of the first pipeline stage
        # speaks for the replica (the other ranks hold the same pages, each its shard; the
        # other stages those pages' other layers), on the endpoints' ports plus the replica,
        # the ports a router set up for SGLang reads.
        if (
            s.kv_events_endpoint is not None
            and c.tp_rank == 0
            and c.attn_cp_rank == 0
            and c.pp_rank == 0
        ):
            from kvoffload.integrations.sglang.events import to_sglang_events
            from kvoffload.observe.publisher import KVEventPublisher

            replay = s.kv_events_replay_endpoint
            replay_at = None if replay is None else offset_endpoint(replay, self.dp_rank)
            try:
                self._publisher = KVEventPublisher(
                    offset_endpoint(s.kv_events_endpoint, self.dp_rank),
                    replay_at,
                    block_size=pages.page_size,
                    data_parallel_rank=self.dp_rank,
                    # SGLang's routers decode SGLang's events: its structs, its page numbers.
                    to_events=functools.partial(
                        to_sglang_events, page_size=pages.page_size, parents=self._parents
                    ),
                )
            except InvalidArgumentError as exc:
                # The publisher's error quotes the endpoint it could not bind.
                replay_failed = replay_at is not None and repr(replay_at) in str(exc)
                key = EVENTS_REPLAY_ENDPOINT if replay_failed else EVENTS_ENDPOINT
                raise InvalidArgumentError(
                    f"hicache-storage-backend-extra-config {key!r}: {exc}"
                ) from None
        sink = None if self._publisher is None else self._publish
        events = sink is not None
        disk = remote = None
        if s.disk_tier is not None:
            # The whole slot file (superblock, headers, alignment) fits in disk_bytes.
            blocks = slots_within(s.disk_bytes, pages.page_bytes)
            if blocks < 1:
                raise InvalidArgumentError(
                    f"hicache-storage-backend-extra-config {DISK_BYTES!r} {s.disk_bytes} holds "
                    f"no page of {pages.page_bytes} bytes ({slot_note(pages.page_bytes)})"
                )
            # Data-parallel replicas have the same shard (fingerprint), not the same disk;
            # the tier itself locks its directory against a second process. Each rank has its
            # own file of disk_bytes, all of them on the drive under disk_dir: the budget
            # counts whole pages against every rank's files, so the ranks together keep a
            # bytes-per-second budget, and drive writes per day come to the same per rank.
            shards = self._page_shards()
            disk = dataclasses.replace(
                s.disk_tier,
                location=str(Path(s.disk_tier.location) / f"dp{self.dp_rank}"),
                blocks=blocks,
                write_budget=_sized_budget(
                    s.disk_write_budget,
                    pages.page_bytes * shards,
                    s.disk_bytes * shards,
                    "disk",
                ),
            )
        if s.remote_tier is not None:
            # The server's room is the instance's, and a page there is every rank's share of
            # it: each rank counts whole pages, so the ranks together keep to its size and
            # budget (as a vLLM block is every rank's bytes).
            whole_page = pages.page_bytes * self._page_shards()
            capacity = s.remote_bytes // whole_page
            if s.remote_admission != "none" and capacity < 1:
                raise InvalidArgumentError(
                    f"hicache-storage-backend-extra-config {REMOTE_BYTES!r} {s.remote_bytes} "
                    f"holds no page of {whole_page} bytes (every rank's share)"
                )
            remote = dataclasses.replace(
                s.remote_tier,
                blocks=capacity,
                write_budget=_sized_budget(
                    s.remote_write_budget, whole_page, s.remote_bytes or None, "remote"
                ),
            )
        if not self.is_writer:
            # An MLA model's other ranks write nothing (SGLang skips their backups): an
            # admission layer there would only hold memory (the optimiser's worlds, sized by
            # the tier's pages) and take the prefetch thread's time at every look-up.
            disk, remote = _never_written(disk), _never_written(remote)
        # Openers, not open tiers: a path opens its own, and reopens a disk tier it emptied.
        tiers = lower_tiers(disk, remote, self.fingerprint, L3_SPEC, enable_events=events)
        for name, parts in (("disk", tiers.disk), ("remote", tiers.remote)):
            if parts is not None:
                self.paths.append(TierPath(name, parts.open, parts.book, pages.page_bytes, sink))
        if len(self.paths) > 1:
            self._beside = ThreadPoolExecutor(len(self.paths) - 1, "kvoffload-l3-write")
        if s.metrics_port is not None:
            from kvoffload.integrations.sglang.metrics import TierCollector
            from kvoffload.observe.metrics import MetricsServer

            rank = ((self.dp_rank * c.pp_size + c.pp_rank) * c.attn_cp_size + c.attn_cp_rank) * (
                c.tp_size
            ) + c.tp_rank
            try:  # every rank has its own tiers, so its own port: the given one plus its rank
                self._metrics = MetricsServer(s.metrics_port + rank if s.metrics_port else 0)
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(
                    f"hicache-storage-backend-extra-config {METRICS_PORT!r}: {exc}"
                ) from None
            labels = {  # cp_rank too: ranks of one TP rank and stage differ by it alone
                "tp_rank": str(c.tp_rank),
                "pp_rank": str(c.pp_rank),
                "cp_rank": str(c.attn_cp_rank),
                "dp_rank": str(self.dp_rank),
            }
            self._metrics.add(TierCollector(self.paths, labels))
            # With port 0 the port is the server's pick: said here, or no one could scrape it.
            logger.info(
                "kvoffload: L3 metrics of %s on http://127.0.0.1:%d/metrics",
                ", ".join(f"{name} {value}" for name, value in labels.items()),
                self._metrics.port,
            )

    def _close_parts(self) -> None:
        if self._beside is not None:
            beside, self._beside = self._beside, None
            beside.shutdown(wait=True)
        paths, self.paths = self.paths, []
        for path in paths:
            path.close()
        if self._publisher is not None:
            publisher, self._publisher = self._publisher, None
            publisher.close()
        if self._metrics is not None:
            metrics, self._metrics = self._metrics, None
            metrics.close()

    def _announce_cleared(self) -> None:
        """Tell routers this server holds no page now (with a disk tier, under its path's
        lock, so no store landing during the clear is announced before it); vLLM's
        ``AllBlocksCleared`` is SGLang's, to the byte."""
        publisher = self._publisher
        if publisher is not None:
            from kvoffload.observe.events import AllBlocksCleared, make_batch

            publisher.publish_batch(make_batch([AllBlocksCleared()], publisher.data_parallel_rank))

    def _publish(self, events: list[OffloadingEvent]) -> None:
        publisher = self._publisher
        if publisher is not None:
            publisher.publish(events)

    def _present(self, keys: list[OffloadKey]) -> tuple[int, list[str]]:
        """Leading run held by the tiers together (each run from the first tier holding it),
        and which tiers served part of it. The tier whose run just ended is not asked for
        the page it ended at, which it does not hold (a server would take a round trip more
        per partial hit); each tier asked counts one look-up."""
        found = 0
        hits: dict[TierPath, int] = {}
        ended: TierPath | None = None
        while found < len(keys):
            for path in self.paths:
                if path is ended:
                    continue
                held = path.present(keys[found:])
                hits[path] = hits.get(path, 0) + held
                if held:
                    found += held
                    ended = path
                    break
            else:
                break
        for path, held in hits.items():
            path.looked_up(held)
        return found, [path.name for path, held in hits.items() if held]

    def _read(self, keys: list[OffloadKey], target: Any) -> list[bool]:
        """Each key from the first tier that delivers it intact."""
        intact = [False] * len(keys)
        wanted = list(range(len(keys)))
        for path in self.paths:
            if not wanted:
                break
            asked = wanted
            got = path.read([keys[i] for i in asked], functools.partial(_at, target, asked))
            for i, ok in zip(asked, got, strict=True):
                intact[i] = ok
            wanted = [i for i in asked if not intact[i]]
        return intact

    def _write(
        self,
        keys: list[OffloadKey],
        payloads: Sequence[Payload],
        prefix: Sequence[OffloadKey] = (),
    ) -> tuple[list[bool], int]:
        """Per page, whether some tier holds it or no tier failed it (each stored it or its
        admission held it back): a page one tier's admission passed over and the other
        failed to write is stored nowhere, so it is a failed write, as with that tier
        alone; and the bytes the tiers wrote (pages held back, or held already, move none).
        ``prefix``: the pages SGLang passes before ``keys`` (:meth:`TierPath.write`).

        The tiers write at the same time, each on its own thread and under its own lock
        only: a tier still taking its pages (a slow server, up to its deadline) never keeps
        SGLang's reads and look-ups from another tier."""
        if not self.paths:
            return [False] * len(keys), 0
        if self._publisher is None:
            return self._write_tiers(keys, payloads, prefix)
        # SGLang's pages of one write follow each other, the first its prefix keys' last.
        links = dict(zip(keys[1:], keys[:-1], strict=True))
        if prefix and keys:
            links[keys[0]] = prefix[-1]
        with self._parents_lock:
            self._parents.update(links)
        try:
            return self._write_tiers(keys, payloads, prefix)
        finally:
            with self._parents_lock:
                for key, parent in links.items():
                    if self._parents.get(key) == parent:
                        del self._parents[key]

    def _write_tiers(
        self, keys: list[OffloadKey], payloads: Sequence[Payload], prefix: Sequence[OffloadKey]
    ) -> tuple[list[bool], int]:
        """:meth:`_write` on the tiers themselves."""
        beside = self._beside
        first, *others = self.paths
        if beside is None:  # one tier (or closing: one after the other)
            batches = [path.write(keys, payloads, prefix) for path in self.paths]
        else:
            jobs = [beside.submit(path.write, keys, payloads, prefix) for path in others]
            try:
                batches = [first.write(keys, payloads, prefix)]
            finally:
                wait(jobs)  # the pages' bytes are the tiers' until every write is done
            batches += [job.result() for job in jobs]
        done = [
            any(batch.holds[i] for batch in batches) or all(batch.result[i] for batch in batches)
            for i in range(len(keys))
        ]
        return done, sum(batch.stored for batch in batches) * first.page_bytes

    def _note(self, kind: str, pages: int, moved_bytes: int, started: float) -> None:
        """One call's pages and GB/s (of the bytes it moved), for SGLang's storage metrics
        histograms."""
        if not self.storage_config.enable_storage_metrics or not pages:
            return
        seconds = time.perf_counter() - started
        rate = moved_bytes / seconds / GB if seconds > 0 else 0.0
        with self._recent_lock:
            recent = self._recent
            if kind == PREFETCH:
                recent.prefetch_pgs.append(pages)
                recent.prefetch_bandwidth.append(rate)
            else:
                recent.backup_pgs.append(pages)
                recent.backup_bandwidth.append(rate)


def _never_written(tier: LowerTierConfig | None) -> LowerTierConfig | None:
    """``tier`` for a rank that never writes to it: no admission layer, no write budget."""
    if tier is None:
        return None
    return dataclasses.replace(tier, admission="none", admission_params=None, write_budget=None)


def _sized_budget(
    budget: WriteBudget | None, page_bytes: int, drive_bytes: int | None, tier: str
) -> WriteBudget | None:
    """A tier's write budget in its pages; drive writes per day count against its size."""
    if budget is None:
        return None
    sized = budget.sized(page_bytes, drive_bytes)
    try:
        sized.check()
    except InvalidArgumentError as exc:
        key = f"kvoffload.{tier}_write_budget"
        raise InvalidArgumentError(f"hicache-storage-backend-extra-config {key!r}: {exc}") from None
    return sized
