"""A host KV pool with SGLang's page layouts, and the backend built through SGLang's factory.

SGLang's own host pools (``sglang.srt.mem_cache.pool_host``) do not import on
a CPU-only install: the package pulls ``torchvision`` through its model
configs. :class:`HostPool` is ours (the benchmark's :class:`BenchPool`), with
the same buffer shapes and the same ``get_page_buffer_meta`` / flat-page
methods as SGLang's MHA and MLA host pools in the ``layer_first`` and
``page_first`` layouts, which is all the backend uses of a pool.
"""

from __future__ import annotations

import hashlib
import importlib
from types import ModuleType
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvoffload.integrations.sglang.bench import BenchPool  # noqa: E402

MODULES = (
    "sglang.srt.mem_cache.hicache_storage",
    "sglang.srt.mem_cache.storage.backend_factory",
)
BACKEND = {
    "backend_name": "kvoffload",
    "module_path": "kvoffload.integrations.sglang",
    "class_name": "KVOffloadStorage",
}


BAD_CONFIGS = [
    ({"kvoffload.disk_dri": "/tmp/x"}, "kvoffload.disk_dri"),
    ({"disk_dir": "/tmp/x"}, "disk_dir"),
    ({"kvoffload.disk_dir": "/tmp/x"}, "kvoffload.disk_bytes"),
    ({"kvoffload.disk_dir": "/tmp/x", "kvoffload.disk_bytes": -1}, "kvoffload.disk_bytes"),
    ({"kvoffload.disk_dir": "/tmp/x", "kvoffload.disk_bytes": "lots"}, "kvoffload.disk_bytes"),
    ({"kvoffload.disk_dir": "", "kvoffload.disk_bytes": 1}, "kvoffload.disk_dir"),
    (
        {"kvoffload.disk_dir": "/tmp/x", "kvoffload.disk_bytes": 9, "kvoffload.disk_policy": "x"},
        "kvoffload.disk_policy",
    ),
    (
        {"kvoffload.remote_url": "redis://h:1", "kvoffload.remote_admission": "sketchy"},
        "kvoffload.remote_admission",
    ),
    (
        {"kvoffload.remote_url": "redis://h:1", "kvoffload.remote_admission": "sketch"},
        "kvoffload.remote_bytes",
    ),
    ({"kvoffload.remote_url": "http://h:1"}, "kvoffload.remote_url"),
    ({"kvoffload.remote_url": "redis://h:1", "kvoffload.metrics_port": 70000}, "metrics_port"),
    ({"kvoffload.remote_url": "redis://h:1", "interface_v1": "yes"}, "interface_v1"),
    ({}, "kvoffload.disk_dir"),
]
"""Extra configs that must stop start-up, and the key each error must name."""


def import_sglang() -> dict[str, ModuleType]:
    pytest.importorskip("sglang", reason="SGLang is not installed (CI installs it --no-deps)")
    return {name: importlib.import_module(name) for name in MODULES}


def page_hash(i: int) -> str:
    """A page key as SGLang makes them: a SHA-256 hex digest."""
    return hashlib.sha256(f"page-{i}".encode()).hexdigest()


class HostPool(BenchPool):
    """``pages`` pages of ``page_size`` tokens; MHA (K and V) or MLA (one latent vector):
    the benchmark's host pool with small test-sized defaults."""

    def __init__(
        self,
        layout: str = "page_first",
        pages: int = 16,
        page_size: int = 4,
        layers: int = 3,
        heads: int = 2,
        head_dim: int = 8,
        mla: bool = False,
        dtype: Any = None,
    ) -> None:
        super().__init__(
            layout, mla, pages, layers, page_size, heads, head_dim, dtype or torch.bfloat16
        )

    def fill(self, pages: list[int], seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for p in pages:
            page = self.get_data_page(p * self.page_size)
            self.set_from_flat_data_page(
                p * self.page_size, torch.randn(page.shape, generator=generator).to(self.dtype)
            )

    def zero(self) -> None:
        self.kv_buffer.zero_()


def storage_config(
    modules: dict[str, ModuleType],
    extra: dict[str, Any],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    metrics: bool = False,
    model: str = "test/tiny-model",
) -> Any:
    config_class = modules["sglang.srt.mem_cache.hicache_storage"].HiCacheStorageConfig
    return config_class(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=metrics,
        is_page_first_layout=True,
        model_name=model,
        extra_config={**BACKEND, **extra},
    )


def create_backend(
    modules: dict[str, ModuleType], extra: dict[str, Any], pool: HostPool | None, **kwargs: Any
) -> Any:
    """The backend as SGLang's cache controller makes it: the factory, then the host pool."""
    factory = modules["sglang.srt.mem_cache.storage.backend_factory"].StorageBackendFactory
    backend = factory.create_backend("dynamic", storage_config(modules, extra, **kwargs), pool)
    if pool is not None:
        backend.register_mem_pool_host(pool)
    return backend
