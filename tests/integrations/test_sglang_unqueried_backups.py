"""Backups of pages SGLang never asked L3 about are judged by admission, not dropped.

SGLang 0.5.23 backs up every page that enters its host pool
(``cache_controller.py`` ``_page_backup``: 128-page batches, each batch's
``prefix_keys`` the node's ancestors and the batches before it), but queries L3
for only some of them: a prompt whose uncached part is below its prefetch
threshold is not queried, nor are generated pages, and a query stops at the
first batch not found whole (``_storage_hit_query``). The ``recommended``
admission followed store-everything and wrote only pages a query had covered:
0 of 4 pages backed up before any query, 128 of a 200-page prompt. While it
follows store-everything it must write what ``none`` writes, and its
store-everything world must stay the real tier (hits and writes).
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


def _backend(
    backends: Any, tmp_path: Path, pool: HostPool, admission: str, pages: int = 1024
) -> Any:
    extra = {
        "interface_v1": 1,
        "hicache_storage_pass_prefix_keys": True,
        "kvoffload.disk_dir": str(tmp_path / admission),
        "kvoffload.disk_bytes": footprint(pages, len(pool.page_bytes(0))),
        "kvoffload.disk_admission": admission,
    }
    return backends(extra, pool, model=f"unqueried-{admission}")


def _query(backend: Any, sglang: dict[str, Any], keys: list[str], held: list[str]) -> int:
    """SGLang's L3 query: batch by batch while each is found whole."""
    storage = sglang["sglang.srt.mem_cache.hicache_storage"]
    size = storage.STORAGE_BATCH_SIZE
    prefix, found = held, 0
    for start in range(0, len(keys), size):
        batch = keys[start : start + size]
        hit = backend.batch_exists(batch, storage.HiCacheStorageExtraInfo(prefix_keys=prefix))
        found += hit
        if hit < len(batch):
            break
        prefix = prefix + batch
    return found


def _backup(
    backend: Any, sglang: dict[str, Any], pool: HostPool, keys: list[str], held: list[str]
) -> None:
    """SGLang's backup of a host node's pages ``keys`` (``_page_backup``), its ancestors
    ``held``: 128-page batches, each passed the pages before it."""
    storage = sglang["sglang.srt.mem_cache.hicache_storage"]
    size = storage.STORAGE_BATCH_SIZE
    prefix = held
    for start in range(0, len(keys), size):
        batch = keys[start : start + size]
        info = storage.HiCacheStorageExtraInfo(prefix_keys=prefix)
        done = backend.batch_set_v1(batch, pool.indices(list(range(len(batch)))), info)
        assert done == [True] * len(batch)
        prefix = prefix + batch


def _written(backend: Any) -> int:
    return int(backend.counters()["disk"]["stores_completed"])


def _check_store_all_world(backend: Any) -> None:
    """The layer follows store-everything, whose world is the real tier, hit for hit."""
    layer = backend.paths[0].layer
    assert isinstance(layer, OptimisingAdmission)
    assert layer.chosen == STORE_ALL
    counters = backend.counters()["disk"]
    world = layer.worlds[STORE_ALL].tier
    assert world.total_hits == counters["lookup_hit_pages"]
    assert world.total_writes == counters["stores_completed"]


def test_a_backup_before_any_query_is_written(backends: Any, tmp_path: Path) -> None:
    """A prompt below the prefetch threshold: its pages are backed up unqueried."""
    pool = HostPool(pages=16)
    pool.fill(list(range(16)), seed=5)
    keys = [page_hash(i) for i in range(4)]
    written = {}
    for admission in ("none", "recommended"):
        backend = _backend(backends, tmp_path, pool, admission)
        assert backend.batch_set_v1(keys, pool.indices(range(4))) == [True] * 4
        written[admission] = _written(backend)
    assert written == {"none": 4, "recommended": 4}
    _check_store_all_world(backend)


def test_pages_past_a_batch_that_missed_are_written(
    backends: Any, sglang: dict[str, Any], tmp_path: Path
) -> None:
    """A 200-page prompt: the query stops at its first 128-page batch, which misses, so the
    72 pages past it are never asked about; all 200 are backed up."""
    pool = HostPool(pages=200)
    pool.fill(list(range(200)), seed=6)
    keys = [page_hash(i) for i in range(200)]
    written = {}
    for admission in ("none", "recommended"):
        backend = _backend(backends, tmp_path, pool, admission)
        assert _query(backend, sglang, keys, []) == 0
        _backup(backend, sglang, pool, keys, [])
        written[admission] = _written(backend)
    assert written == {"none": 200, "recommended": 200}
    _check_store_all_world(backend)


def test_generated_pages_are_written_and_a_recomputed_page_is_no_hit(
    backends: Any, sglang: dict[str, Any], tmp_path: Path
) -> None:
    """A prompt queried and backed up, then its generated pages backed up unqueried (the
    prompt passed before them); then the prompt again, below the prefetch threshold: not
    queried, so recomputed and backed up again, which no world may count as an L3 hit."""
    pool = HostPool(pages=16)
    pool.fill(list(range(16)), seed=7)
    prompt = [page_hash(i) for i in range(6)]
    generated = [page_hash(100 + i) for i in range(3)]
    written = {}
    for admission in ("none", "recommended"):
        backend = _backend(backends, tmp_path, pool, admission)
        assert _query(backend, sglang, prompt, []) == 0
        _backup(backend, sglang, pool, prompt, [])
        _backup(backend, sglang, pool, generated, prompt)
        written[admission] = _written(backend)
        _backup(backend, sglang, pool, prompt, [])
    assert written == {"none": 9, "recommended": 9}
    _check_store_all_world(backend)
