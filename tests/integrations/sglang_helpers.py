"""A host KV pool with SGLang's page layouts, and the backend built through SGLang's factory.

SGLang's own host pools (``sglang.srt.mem_cache.pool_host``) do not import on
a CPU-only install: the package pulls ``torchvision`` through its model
configs. :class:`HostPool` is ours, with the same buffer shapes and the same
``get_page_buffer_meta`` / flat-page methods as SGLang's MHA and MLA host
pools in the ``layer_first`` and ``page_first`` layouts, which is all the
backend uses of a pool.
"""

from __future__ import annotations

import hashlib
import importlib
from types import ModuleType
from typing import Any

import pytest

torch = pytest.importorskip("torch")

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


class HostPool:
    """``pages`` pages of ``page_size`` tokens; MHA (K and V) or MLA (one latent vector)."""

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
        self.layout = layout
        self.page_size = page_size
        self.size = pages * page_size
        self.layer_num = layers
        self.head_num = 1 if mla else heads
        self.head_dim = head_dim
        self.mla = mla
        self.dtype = dtype or torch.bfloat16
        self.kv_buffer = torch.zeros(self._dims(), dtype=self.dtype)

    def _dims(self) -> tuple[int, ...]:
        tokens, layers, heads, dim = self.size, self.layer_num, self.head_num, self.head_dim
        if self.layout == "layer_first":
            inner: tuple[int, ...] = (layers, tokens, heads, dim)
        elif self.layout == "page_first":
            inner = (tokens, layers, heads, dim)
        else:
            raise ValueError(self.layout)
        return inner if self.mla else (2, *inner)

    def _token_slice(self, index: int) -> tuple[slice, ...]:
        tokens = slice(index, index + self.page_size)
        lead = () if self.mla else (slice(None),)
        if self.layout == "layer_first":
            return (*lead, slice(None), tokens)
        return (*lead, tokens)

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        page = self.kv_buffer[self._token_slice(int(index))]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> Any:
        return torch.zeros_like(self.get_data_page(0)).flatten()

    def set_from_flat_data_page(self, index: int, data_page: Any) -> None:
        view = self.kv_buffer[self._token_slice(int(index))]
        view.copy_(data_page.reshape(view.shape))

    def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
        """(pointer, size) segments of each page, in SGLang's order for these layouts."""
        assert len(indices) % self.page_size == 0
        item = self.dtype.itemsize
        row = self.head_num * self.head_dim * item  # one token of one layer
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

    def indices(self, pages: list[int]) -> Any:
        """Host token indices of whole pages, as SGLang hands them to the backend."""
        return torch.cat(
            [torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in pages]
        )

    def fill(self, pages: list[int], seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for p in pages:
            page = self.get_data_page(p * self.page_size)
            self.set_from_flat_data_page(
                p * self.page_size, torch.randn(page.shape, generator=generator).to(self.dtype)
            )

    def page_bytes(self, page: int) -> bytes:
        flat = self.get_data_page(page * self.page_size).contiguous()
        return bytes(flat.view(torch.uint8).numpy())

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
