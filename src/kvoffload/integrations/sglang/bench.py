"""``kvoffload bench tiers --sglang``: pages through the HiCache backend beside the plain tier path.

For each tier (the disk tier, and the shared tier with ``--remote``), each
page shape (MHA ``page_first``, MHA ``layer_first``, MLA ``page_first``)
and each of SGLang's interfaces (``v1``: host-pool indices; ``copy``: page
tensors), one batch of pages is stored through the backend and loaded back
into other pages (bytes checked), and in the same run the same bytes go the
plain way: on disk, the tier under the backend with one buffer per page (what a
single-buffer layout would cost); on the shared tier, the plainest pipelined
SET and GET on a raw socket to the same server (GET replies read straight into
place; no client library, no header, no checksum). Rounds alternate; rates are
the best rounds', ratios compare best rates, and the median of the rounds'
own ratios comes beside them. The copy interface's page tensors and the zero-copy
interface's host indices are made before the clock starts (the tensors put back
after it stops): SGLang makes them, the backend only moves their bytes.

The host pool is a small one of ours with SGLang's buffer shapes and page
methods (:class:`BenchPool`); SGLang's own needs its GPU stack to import.
Page geometry: 32 tokens, 8 KV heads of 128 (MHA) or a 576-wide latent
(MLA), bfloat16, as many layers as make a page of about ``page_mib``.
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from kvoffload.core.errors import InvalidArgumentError, KVOffloadError
from kvoffload.core.memory import check_fits
from kvoffload.tiers.bench import BenchBlocks, RawSockets, scratch_path, shown_figure
from kvoffload.tiers.remote import RemoteTier
from kvoffload.tiers.slot_file import footprint

INTERFACES = ("v1", "copy")
SHAPES = {
    "MHA page_first": ("page_first", False),
    "MHA layer_first": ("layer_first", False),
    "MLA page_first": ("page_first", True),
}
PAGE_TOKENS, HEADS, HEAD_DIM, MLA_DIM = 32, 8, 128, 576
MIB = 2**20
SGLANG_MISSING = (
    "bench tiers --sglang needs SGLang's storage modules; install sglang==0.5.23 with "
    "--no-deps and the packages docs/sglang.md lists"
)


def parse_interfaces(text: str) -> tuple[str, ...]:
    """``v1``, ``copy`` or both, comma-separated; anything else is a one-line error."""
    chosen = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [name for name in chosen if name not in INTERFACES]
    if unknown or not chosen:
        raise InvalidArgumentError(
            f"bench tiers --sglang: unknown interface {(unknown or [text])[0]!r} "
            f"(choose from {', '.join(INTERFACES)}, comma-separated)"
        )
    return chosen


class BenchPool:
    """A host KV pool of ``pages`` pages with SGLang's buffer shapes and page methods
    (``page_first`` or ``layer_first``; MHA: K and V, MLA: one latent vector per token).

    SGLang's own pool needs its GPU stack to import; this one has the same layout, so the
    backend cannot tell them apart. ``heads`` and ``head_dim`` default to the benchmark's
    page geometry (8 heads of 128, or a 576-wide latent)."""

    def __init__(
        self,
        layout: str,
        mla: bool,
        pages: int,
        layers: int,
        page_size: int = PAGE_TOKENS,
        heads: int = HEADS,
        head_dim: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if layout not in ("page_first", "layer_first"):
            raise InvalidArgumentError(f"unknown host pool layout {layout!r}")
        self.layout = layout
        self.page_size = page_size
        self.size = pages * page_size
        self.layer_num = layers
        self.head_num = 1 if mla else heads
        self.head_dim = head_dim or (MLA_DIM if mla else HEAD_DIM)
        self.mla = mla
        self.dtype = dtype
        tokens = (layers, self.size) if layout == "layer_first" else (self.size, layers)
        inner = (*tokens, self.head_num, self.head_dim)
        self.kv_buffer = torch.zeros(inner if mla else (2, *inner), dtype=self.dtype)

    def _page(self, index: int) -> torch.Tensor:
        tokens = slice(index, index + self.page_size)
        lead: tuple[slice, ...] = () if self.mla else (slice(None),)
        where = (*lead, slice(None), tokens) if self.layout == "layer_first" else (*lead, tokens)
        return self.kv_buffer[where]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._page(int(index))
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros_like(self._page(0)).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        view = self._page(int(index))
        view.copy_(data_page.reshape(view.shape))

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """(pointer, size) segments of each page, in SGLang's order for these layouts."""
        row = self.head_num * self.head_dim * self.dtype.itemsize
        base = self.kv_buffer.data_ptr()
        v_offset = 0 if self.mla else self.layer_num * self.size * row
        pointers: list[int] = []
        for start in indices.tolist()[:: self.page_size]:
            if self.layout == "layer_first":
                for layer in range(self.layer_num):
                    k = base + start * row + layer * self.size * row
                    pointers += [k] if self.mla else [k, k + v_offset]
                size = self.page_size * row
            else:
                k = base + start * self.layer_num * row
                pointers += [k] if self.mla else [k, k + v_offset]
                size = self.page_size * self.layer_num * row
        return pointers, [size] * len(pointers)

    def indices(self, pages: Iterable[int]) -> torch.Tensor:
        """Host token indices of whole pages, as SGLang hands them to the backend."""
        size = self.page_size
        return torch.cat([torch.arange(p * size, (p + 1) * size) for p in pages])

    def page_bytes(self, page: int) -> bytes:
        flat = self.get_data_page(page * self.page_size).contiguous()
        return bytes(flat.view(torch.uint8).numpy())


def layer_bytes(mla: bool) -> int:
    """One layer of a page: 128 KiB for MHA (K and V), 36 KiB for MLA."""
    return PAGE_TOKENS * (MLA_DIM if mla else 2 * HEADS * HEAD_DIM) * 2


def layers_for(page_mib: float, mla: bool) -> int:
    """Layers that make a page of about ``page_mib`` (at least one)."""
    return max(1, round(page_mib * MIB / layer_bytes(mla)))


def check_page_mib(page_mib: float) -> None:
    """Refuse pages that round to no layer of an MHA page, the widest: they would run at
    one layer (128 KiB), far from the size asked for, unsaid."""
    widest = layer_bytes(mla=False)
    if round(page_mib * MIB / widest) < 1:
        raise InvalidArgumentError(
            f"pages of {page_mib:g} MiB round to no layer of {widest // 1024} KiB (an MHA "
            f"page's): give more than {widest / 2 / MIB:g} MiB"
        )


Times = list[tuple[float, float]]


def _config(extra: dict[str, Any], mla: bool, model: str) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=model,
        extra_config={
            "backend_name": "kvoffload",
            "module_path": "kvoffload.integrations.sglang",
            "class_name": "KVOffloadStorage",
            **extra,
        },
    )


def measure_row(
    tier_extra: dict[str, Any], shape: str, interface: str, pages: int, page_mib: float, rounds: int
) -> dict[str, Any]:
    """One tier, page shape and interface: backend rounds alternated with plain tier rounds."""
    from kvoffload.integrations.sglang.storage import KVOffloadStorage, page_key

    layout, mla = SHAPES[shape]
    pool = BenchPool(layout, mla, 2 * pages, layers_for(page_mib, mla))
    generator = torch.Generator().manual_seed(0)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=generator))
    source, into = range(pages), range(pages, 2 * pages)
    # SGLang hands the backend its host indices made: not on the clock, as the copy
    # interface's page tensors are not.
    source_indices, into_indices = pool.indices(source), pool.indices(into)
    expected = [pool.page_bytes(p) for p in source]
    size = len(expected[0])
    extra = {"interface_v1": int(interface == "v1"), **tier_extra}
    if "kvoffload.disk_dir" in extra:
        extra["kvoffload.disk_bytes"] = footprint(2 * pages, size)  # the whole slot file
    backend = KVOffloadStorage(_config(extra, mla, f"bench-{shape}-{interface}"), {})
    backend.register_mem_pool_host(pool)
    landing = memoryview(bytearray(pages * size))
    plain_times: Times = []
    ours_times: Times = []

    raw: RawSockets | None = None
    shared: RemoteTier | None = None
    if "kvoffload.remote_url" in extra:  # the plainest pipelined SET / GET of the same bytes
        remote = backend.paths[0].tier
        if not isinstance(remote, RemoteTier):
            raise KVOffloadError("bench tiers --sglang: the shared tier did not open")
        shared = remote
        raw, blocks = RawSockets(remote), BenchBlocks(pages, size, expected)

    def plain(r: int) -> tuple[float, float]:
        if raw is not None:
            times = raw.round(r, blocks)
            blocks.verify()
            blocks.clear()
            return times
        tier = backend.paths[0].tier
        keys = [page_key(f"plain-{r}-{i}") for i in range(pages)]
        started = time.perf_counter()
        tier.write(keys, expected)
        tier.poll(wait=True)
        stored = time.perf_counter()
        ok = tier.read(keys, lambda i: landing[i * size : (i + 1) * size]).result()
        loaded = time.perf_counter()
        if not all(ok):
            raise KVOffloadError("bench tiers --sglang: the tier lost pages during the benchmark")
        return stored - started, loaded - stored

    def ours(r: int) -> tuple[float, float]:
        keys = [f"{r:032x}{i:032x}" for i in range(pages)]  # hex, as SGLang's page hashes
        if interface == "v1":
            started = time.perf_counter()
            ok = all(backend.batch_set_v1(keys, source_indices))
            stored = time.perf_counter()
            got = all(backend.batch_get_v1(keys, into_indices))
            loaded = time.perf_counter()
        else:
            values = [pool.get_data_page(p * PAGE_TOKENS) for p in source]
            targets = [pool.get_dummy_flat_data_page() for _ in keys]
            started = time.perf_counter()
            ok = backend.batch_set(keys, values)
            stored = time.perf_counter()
            loads = backend.batch_get(keys, targets)
            loaded = time.perf_counter()
            got = all(page is not None for page in loads)
            for p, page in zip(into, loads, strict=True):
                if page is not None:
                    pool.set_from_flat_data_page(p * PAGE_TOKENS, page)
        if not (ok and got and [pool.page_bytes(p) for p in into] == expected):
            raise KVOffloadError("bench tiers --sglang: pages did not come back intact")
        return stored - started, loaded - stored

    try:
        for r in range(rounds):
            plain_times.append(plain(r))
            ours_times.append(ours(r))
            for p in into:
                pool.set_from_flat_data_page(p * PAGE_TOKENS, pool.get_dummy_flat_data_page())
            backend.clear()
            if shared is not None:  # clear() keeps the shared tier's pages; ours leave none
                shared.delete_all()
    finally:
        if raw is not None:
            raw.close()
        backend.close()
    return rate_figures(pages, size, plain_times, ours_times)


def rate_figures(
    pages: int,
    page_bytes: int,
    plain: Sequence[tuple[float, ...]],
    ours: Sequence[tuple[float, ...]],
) -> dict[str, float]:
    """Rates of the best rounds, their ratio, and the median of the rounds' own ratios.

    A round's times start with its store and load seconds; any after them (a caller's CPU
    times) are not read. One rule for ``bench tiers --sglang`` and the SGLang benchmark.
    """
    out: dict[str, float] = {"page_bytes": page_bytes}
    for k, what in enumerate(("store", "load")):
        best, best_plain = min(t[k] for t in ours), min(t[k] for t in plain)
        out[f"{what}_pages_per_s"] = pages / best
        out[f"{what}_gbps"] = pages * page_bytes / best / 1e9
        out[f"plain_{what}_gbps"] = pages * page_bytes / best_plain / 1e9
        out[f"{what}_ratio"] = best_plain / best
        out[f"{what}_ratio_median"] = statistics.median(
            p[k] / o[k] for p, o in zip(plain, ours, strict=True)
        )
    return out


def measure_sglang(
    pages: int,
    page_mib: float,
    rounds: int,
    directory: str | None = None,
    remote: str | None = None,
    interfaces: tuple[str, ...] = INTERFACES,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Rows for every tier, page shape and interface: ``{"sglang": [row, ...]}``."""
    try:
        import sglang.srt.mem_cache.hicache_storage  # noqa: F401
    except ImportError:
        raise KVOffloadError(SGLANG_MISSING) from None
    check_page_mib(page_mib)
    # The pool holds two copies of each page; the expected bytes and the landing buffer one.
    check_fits(4 * pages * page_mib * MIB, f"{pages} SGLang pages of {page_mib:g} MiB")
    rows: list[dict[str, Any]] = []
    scratch = scratch_path(directory)
    try:
        scratch.mkdir(mode=0o700)
        tiers: list[tuple[str, Callable[[int], dict[str, Any]]]] = [
            ("disk", lambda n: {"kvoffload.disk_dir": str(scratch / f"row-{n}")})
        ]
        if remote is not None:
            tiers.append(("remote", lambda n: {"kvoffload.remote_url": remote}))
        for tier, extra in tiers:
            for shape in SHAPES:
                for interface in interfaces:
                    if progress is not None:
                        progress(f"{tier} {shape} {interface}")
                    figures = measure_row(
                        extra(len(rows)), shape, interface, pages, page_mib, rounds
                    )
                    rows.append({"tier": tier, "shape": shape, "interface": interface, **figures})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"pages": pages, "rounds": rounds, "sglang": rows}


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure_reads_beside_backups(
    directory: str | None = None,
    page_mib: float = 0.5,
    read_pages: int = 4,
    backup_pages: int = 64,
    reads: int = 150,
    rounds: int = 2,
) -> dict[str, float]:
    """Prefetch latency on the disk tier, alone and beside SGLang's backup thread: one
    thread looks ``read_pages`` up and reads them (``batch_exists``, ``batch_get_v1``, what
    a waiting request costs), ``reads`` times per phase, while another writes batches of
    ``backup_pages`` new pages back to back (``batch_set_v1``) or rests. Phases alternate,
    ``rounds`` of each; milliseconds at the 50th and 99th percentile, and the pages the
    backups offered per second, and the reads that found their pages evicted meanwhile
    (stored again off the clock). A read that waited for a backup's disk I/O shows in
    p99."""
    import threading

    from kvoffload.integrations.sglang.storage import KVOffloadStorage

    check_page_mib(page_mib)
    check_fits(4 * (read_pages + backup_pages) * page_mib * MIB, "the benchmark's host pool")
    layers = layers_for(page_mib, mla=False)
    pool = BenchPool("page_first", False, 2 * read_pages + backup_pages, layers)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=torch.Generator()))
    page_bytes = len(pool.page_bytes(0))
    scratch = scratch_path(directory)
    latency: dict[bool, list[float]] = {False: [], True: []}
    missed = {False: 0, True: 0}
    written = [0]
    backup_seconds = 0.0
    try:
        scratch.mkdir(mode=0o700)
        backend = KVOffloadStorage(
            _config(
                {
                    "interface_v1": 1,
                    "kvoffload.disk_dir": str(scratch),
                    "kvoffload.disk_bytes": footprint(4 * backup_pages + read_pages, page_bytes),
                    "kvoffload.disk_admission": "none",
                },
                False,
                "bench-reads-beside-backups",
            )
        )
        backend.register_mem_pool_host(pool)
        try:
            keys = [f"read-{i}" for i in range(read_pages)]
            if not all(backend.batch_set_v1(keys, pool.indices(range(read_pages)))):
                raise KVOffloadError("bench: the disk tier did not take the pages to read")
            into = pool.indices(range(read_pages, 2 * read_pages))
            source = pool.indices(range(2 * read_pages, 2 * read_pages + backup_pages))

            def backups(stop: threading.Event, phase: int) -> None:
                batch = 0
                while not stop.is_set():
                    batch += 1
                    new = [f"backup-{phase}-{batch}-{j}" for j in range(backup_pages)]
                    backend.batch_set_v1(new, source)
                    written[0] += backup_pages

            for r in range(2 * rounds):
                beside = r % 2 == 1
                stop = threading.Event()
                writer = threading.Thread(target=backups, args=(stop, r), name="bench-backup")
                started = time.perf_counter()
                if beside:
                    writer.start()
                try:
                    for _ in range(reads):
                        began = time.perf_counter()
                        found = backend.batch_exists(keys)
                        intact = backend.batch_get_v1(keys, into)
                        latency[beside].append(time.perf_counter() - began)
                        if found != read_pages or not all(intact):
                            # Evicted by the backups while the reads waited: stored again,
                            # off the clock, and counted.
                            missed[beside] += 1
                            backend.batch_set_v1(keys, pool.indices(range(read_pages)))
                        time.sleep(0.002)  # requests arrive; they do not queue back to back
                finally:
                    stop.set()
                    if beside:
                        writer.join()
                        backup_seconds += time.perf_counter() - started
        finally:
            backend.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out = {"page_bytes": float(page_bytes)}
    for beside, name in ((False, "alone"), (True, "beside_backups")):
        for q in (0.5, 0.99):
            out[f"{name}_p{round(q * 100)}_ms"] = _quantile(latency[beside], q) * 1e3
        out[f"{name}_misses"] = float(missed[beside])
    out["backup_pages_per_s"] = written[0] / backup_seconds if backup_seconds else 0.0
    return out


def table_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]], str]:
    """Headers, one row per tier, page shape and interface (backend GB/s beside the plain tier
    path's, ratios), and the note under them."""
    headers = ["tier", "shape", "interface", "page KiB", "store GB/s", "plain", "ratio"]
    headers += ["median", "load GB/s", "plain", "ratio", "median"]
    rows = []
    for row in results["sglang"]:
        cells = [row["tier"], row["shape"], row["interface"], f"{row['page_bytes'] / 1024:.0f}"]
        for what in ("store", "load"):
            cells += [
                shown_figure(row[figure])
                for figure in (
                    f"{what}_gbps",
                    f"plain_{what}_gbps",
                    f"{what}_ratio",
                    f"{what}_ratio_median",
                )
            ]
        rows.append(cells)
    rounds = results["rounds"]
    note = (
        f"{results['pages']} pages per batch; plain: disk, the same tier with one buffer per "
        "page; remote, pipelined SET / GET of the same bytes on a plain socket; best of "
        f"{rounds} round{'s' * (rounds != 1)}, median of the rounds' own ratios"
    )
    return headers, rows, note
