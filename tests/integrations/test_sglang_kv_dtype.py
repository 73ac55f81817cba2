"""Which fp8 format a page is in: SGLang's host pools store every fp8 KV cache as bytes.

SGLang keeps ``--kv-cache-dtype fp8_e4m3`` and ``fp8_e5m2`` pages alike as ``torch.uint8``
in its host pool (its device pool's ``store_dtype``), so the pool's dtype cannot tell the
two apart; the same bytes read in the other format are other numbers. A server restarted
with the other format over its disk tier, or two servers of either format on one Valkey
server, must never read each other's pages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (CI installs it --no-deps)")

from sglang_helpers import HostPool, page_hash, sglang_model_config

from kvoffload.tiers.slot_file import footprint
from tier_servers import ValkeyProcess

torch = pytest.importorskip("torch")

KEYS = [page_hash(7000 + i) for i in range(3)]


@pytest.mark.parametrize("tier", ["disk", "valkey"])
def test_pages_of_one_fp8_format_are_never_read_as_the_other(
    backends: Any, tmp_path: Path, valkey_server: ValkeyProcess, tier: str
) -> None:
    pool = HostPool(dtype=torch.uint8)
    if tier == "disk":
        extra: dict[str, Any] = {
            "kvoffload.disk_dir": str(tmp_path / "l3"),
            "kvoffload.disk_bytes": footprint(16, len(pool.page_bytes(0))),
        }
    else:
        extra = {"kvoffload.remote_url": valkey_server.url}
    extra["interface_v1"] = 1
    pool.fill([0, 1, 2], seed=5)

    def serve(kv_cache_dtype: str) -> Any:
        with sglang_model_config(kv_cache_dtype=kv_cache_dtype):
            return backends(extra, pool, model=f"fp8-{tier}")

    first = serve("fp8_e4m3")
    assert first.batch_set_v1(KEYS, pool.indices([0, 1, 2])) == [True] * 3
    first.close()  # a restart: the disk tier is one process's at a time
    other = serve("fp8_e5m2")
    assert other.batch_exists(KEYS) == 0
    assert other.batch_get_v1(KEYS, pool.indices([3, 4, 5])) == [False] * 3
    other.close()
    same = serve("fp8_e4m3")
    assert same.batch_exists(KEYS) == 3
