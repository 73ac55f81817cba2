"""SGLang's ``hicache_storage_pass_prefix_keys``: the pages before a look-up are no L3 look-up.

SGLang 0.5.23 hands ``batch_exists`` the page hashes before the batch it asks
about (``HiCacheStorageExtraInfo.prefix_keys``): the pages its device and host
hold (the prefetch's anchor's ancestors, ``scheduler.py`` ``_prefetch_kvcache``),
and, from a query's second 128-page batch on, the query's earlier batches too
(``cache_controller.py`` ``_storage_hit_query``: ``prefix_keys + batch_hashes``
after a batch found whole). The ``recommended`` admission's store-everything
world is the real tier under LRU, request for request: it must count as L3 hits
exactly the pages L3 served, never the pages passed before the batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (CI installs it --no-deps)")

from sglang_helpers import HostPool, page_hash

from kvoffload.admission import OptimisingAdmission
from kvoffload.admission.optimiser import STORE_ALL
from kvoffload.tiers.slot_file import footprint


def _backend(backends: Any, tmp_path: Path, pool: HostPool, pages: int) -> Any:
    extra = {
        "interface_v1": 1,
        "hicache_storage_pass_prefix_keys": True,
        "kvoffload.disk_dir": str(tmp_path / "l3"),
        "kvoffload.disk_bytes": footprint(pages, len(pool.page_bytes(0))),
        "kvoffload.disk_admission": "recommended",
    }
    return backends(extra, pool, model="prefix-keys")


def _query(backend: Any, sglang: dict[str, Any], keys: list[str], held: list[str] | None) -> int:
    """SGLang's L3 query (``_storage_hit_query``): batch by batch while each is found whole,
    each batch's ``prefix_keys`` the host-held pages and the query's batches before it."""
    storage = sglang["sglang.srt.mem_cache.hicache_storage"]
    size = storage.STORAGE_BATCH_SIZE
    prefix, found = held, 0
    for start in range(0, len(keys), size):
        batch = keys[start : start + size]
        hit = backend.batch_exists(batch, storage.HiCacheStorageExtraInfo(prefix_keys=prefix))
        found += hit
        if hit < len(batch):
            break
        if prefix is not None:
            prefix = prefix + batch
    return found


def _write_back(backend: Any, pool: HostPool, keys: list[str]) -> None:
    """The host tier's backup of ``keys`` (pool pages 0.. as their bytes)."""
    assert backend.batch_set_v1(keys, pool.indices(list(range(len(keys))))) == [True] * len(keys)


def _store_all_world(backend: Any) -> Any:
    layer = backend.paths[0].layer
    assert isinstance(layer, OptimisingAdmission)
    assert layer.chosen == STORE_ALL  # the real tier mirrors it: the premise of the checks
    return layer.worlds


def test_host_held_prefix_is_no_l3_lookup_for_admission(
    backends: Any, sglang: dict[str, Any], tmp_path: Path
) -> None:
    """Turns of a conversation: each query past what the host holds, the misses written
    back. The store-everything world hits what the disk served, and counts the pages passed
    before each query as held above L3; it counted them as its own hits before."""
    pool = HostPool(pages=16)
    backend = _backend(backends, tmp_path, pool, pages=64)
    pool.fill(list(range(16)), seed=3)
    keys = [page_hash(i) for i in range(14)]
    held_pages = 0
    # (pages the host holds, pages the query asks for): the host loses pages between turns.
    for held, end in ((0, 6), (6, 10), (3, 12), (2, 14)):
        found = _query(backend, sglang, keys[held:end], keys[:held] if held else None)
        _write_back(backend, pool, keys[held + found : end])
        held_pages += held
    counters = backend.counters()["disk"]
    assert counters["lookup_hit_pages"] == 17  # turns 3 and 4: 7 and 10 pages from disk
    worlds = _store_all_world(backend)
    assert worlds[STORE_ALL].tier.total_hits == counters["lookup_hit_pages"]
    assert worlds[STORE_ALL].tier.total_writes == counters["stores_completed"] == 14
    assert worlds.total_gpu_hits == held_pages == 11
    assert worlds.total_refs == 6 + 10 + 12 + 14


def test_a_querys_later_batch_looks_up_its_own_pages_only(
    backends: Any, sglang: dict[str, Any], tmp_path: Path
) -> None:
    """A query longer than SGLang's batch: the second batch's ``prefix_keys`` hold the first
    batch, which this query found on disk already. Admission's L3 look-up of each call is
    the batch alone: the first batch is no second hit (nor the host's pages a first)."""
    size = sglang["sglang.srt.mem_cache.hicache_storage"].STORAGE_BATCH_SIZE
    pool = HostPool(pages=size)
    backend = _backend(backends, tmp_path, pool, pages=2 * size)
    pool.fill(list(range(size)), seed=4)
    keys = [page_hash(i) for i in range(size + 8)]
    assert _query(backend, sglang, keys[:size], None) == 0
    _write_back(backend, pool, keys[:size])
    # A later turn, its first batch on the host: the 8 pages past it are asked and written.
    assert _query(backend, sglang, keys[size:], keys[:size]) == 0
    _write_back(backend, pool, keys[size:])
    counters = backend.counters()["disk"]
    before = counters["lookup_hit_pages"], counters["lookups"]
    # The host lost all but 2 pages: 128 asked in the first batch, 6 in the second.
    assert _query(backend, sglang, keys[2:], keys[:2]) == size + 6
    counters = backend.counters()["disk"]
    assert (counters["lookup_hit_pages"], counters["lookups"]) == (before[0] + size + 6, 4)
    worlds = _store_all_world(backend)
    assert worlds[STORE_ALL].tier.total_hits == counters["lookup_hit_pages"] == size + 6
    assert worlds[STORE_ALL].tier.total_writes == counters["stores_completed"] == size + 8
