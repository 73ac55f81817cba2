"""A host KV pool with SGLang's page layouts, and the backend built through SGLang's factory.

SGLang's own host pools (``sglang.srt.mem_cache.pool_host``) do not import on
a CPU-only install: the package pulls ``torchvision`` through its model
configs. :class:`HostPool` is ours (the benchmark's :class:`BenchPool`), with
the same buffer shapes and the same ``get_page_buffer_meta`` / flat-page
methods as SGLang's MHA and MLA host pools in the ``layer_first`` and
``page_first`` layouts, which is all the backend uses of a pool.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import socket
import threading
from collections.abc import Iterable, Iterator
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
    # Past any 64-bit size: refused later, under another key's name, before.
    (
        {"kvoffload.disk_dir": "/tmp/x", "kvoffload.disk_bytes": 10**400},
        "'kvoffload.disk_bytes' must be an integer in 1..9223372036854775807",
    ),
    (
        {"kvoffload.remote_url": "redis://127.0.0.1:1", "kvoffload.remote_bytes": 2**63},
        "'kvoffload.remote_bytes' must be an integer in 1..9223372036854775807",
    ),
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
    (
        {"kvoffload.disk_dir": "/tmp/x", "kvoffload.disk_bytes": 9, "kvoffload.disk_timeout_ms": 0},
        "kvoffload.disk_timeout_ms",
    ),
    (
        {
            "kvoffload.disk_dir": "/tmp/x",
            "kvoffload.disk_bytes": 9,
            "kvoffload.disk_timeout_ms": "x",
        },
        "kvoffload.disk_timeout_ms",
    ),
    ({"kvoffload.remote_url": "redis://h:1", "kvoffload.disk_timeout_ms": 50}, "disk_timeout_ms"),
    # Keys that mean nothing without their tier or endpoint, taken and ignored before.
    ({"kvoffload.remote_url": "redis://h:1", "kvoffload.disk_policy": "zzz"}, "disk_policy"),
    ({"kvoffload.remote_url": "redis://h:1", "kvoffload.disk_admission": "sketch"}, "disk_adm"),
    (
        {"kvoffload.remote_url": "redis://h:1", "kvoffload.disk_write_budget": "0.2"},
        "kvoffload.disk_write_budget' needs 'kvoffload.disk_dir'",
    ),
    (
        {"kvoffload.disk_dir": "/tmp/x", "kvoffload.disk_bytes": 9, "kvoffload.remote_bytes": 9},
        "kvoffload.remote_bytes' needs 'kvoffload.remote_url'",
    ),
    (
        {
            "kvoffload.disk_dir": "/tmp/x",
            "kvoffload.disk_bytes": 9,
            "kvoffload.remote_admission": "sketch",
            "kvoffload.remote_bytes": 9,
        },
        "kvoffload.remote_admission' needs",
    ),
    (
        {"kvoffload.remote_url": "redis://h:1", "kvoffload.kv_events_replay_endpoint": "tcp://*:1"},
        "needs 'kvoffload.kv_events_endpoint'",
    ),
]
"""Extra configs that must stop start-up, and the key each error must name."""


@contextlib.contextmanager
def sglang_model_config(**leaves: Any) -> Iterator[None]:
    """SGLang's process config with these ``model`` leaves (``get_model().kv_cache_dtype``),
    as its scheduler publishes them from the server arguments (which do not import here:
    SGLang's model configs pull ``torchvision``); the process's own config comes back after."""
    context_module = importlib.import_module("sglang.srt.runtime_context")
    context = context_module.RuntimeContext(parallel=context_module.ParallelContext())
    model = context_module._ConfigBag("model")
    for name, value in leaves.items():
        model._set(name, value)
    context._config_bags = {"model": model}
    with context_module.use_context(context):
        yield


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
            start = int(self.indices([p])[0])
            page = self.get_data_page(start)
            self.set_from_flat_data_page(
                start, torch.randn(page.shape, generator=generator).to(self.dtype)
            )

    def zero(self) -> None:
        self.kv_buffer.zero_()


class DcpHostPool(HostPool):
    """An MLA pool under decode context parallelism, as SGLang's ``MLATokenToKVPoolHost``
    with ``dcp_size`` > 1: each rank keeps ``1 / dcp_size`` of every page, so its rows and
    ``page_size`` are physical while host indices (what the backend is handed) are logical,
    ``logical_page_size`` a page, bounded by ``logical_size``."""

    def __init__(self, dcp_size: int, pages: int = 16, logical_page_size: int = 4) -> None:
        super().__init__("page_first", pages, logical_page_size // dcp_size, mla=True)
        self.dcp_size = dcp_size
        self.logical_page_size = logical_page_size
        self.logical_size = self.size * dcp_size

    def _row(self, index: int) -> int:
        """SGLang's ``_storage_page_index``: a logical page start to its physical row."""
        index = int(index)
        if index < 0 or index % self.logical_page_size:
            raise ValueError("DCP L3 page start must be a nonnegative logical page boundary.")
        if index + self.logical_page_size > self.logical_size:
            raise IndexError("DCP L3 page is outside the host pool.")
        return index // self.dcp_size

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return super().get_data_page(self._row(index), flat)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        super().set_from_flat_data_page(self._row(index), data_page)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.logical_page_size == 0
        rows = [self._row(i) for i in indices.tolist()[:: self.logical_page_size]]
        return super().get_page_buffer_meta(
            torch.tensor([r + t for r in rows for t in range(self.page_size)])
        )

    def indices(self, pages: Iterable[int]) -> torch.Tensor:
        size = self.logical_page_size
        return torch.cat([torch.arange(p * size, (p + 1) * size) for p in pages])

    def page_bytes(self, page: int) -> bytes:
        return super().page_bytes(page * self.dcp_size)


class AsymmetricHostPool:
    """An MHA pool whose K and V differ in head dim, as SGLang's
    ``AsymmetricMHATokenToKVPoolHost`` (MiMo-V2) in ``page_first``: K and V in two buffers
    of their own (``kv_buffer`` is the pair), a page's segments its K rows then its V rows,
    of different sizes; it has no flat pages (``get_data_page``, ``get_dummy_flat_data_page``
    and ``set_from_flat_data_page`` raise ``NotImplementedError``)."""

    layout = "page_first"
    layer_num = 3
    head_num = 2

    def __init__(self, pages: int = 16, page_size: int = 4) -> None:
        self.page_size = page_size
        self.size = pages * page_size
        self.dtype = torch.bfloat16
        self.head_dim, self.v_head_dim = 12, 8
        shape = (self.size, self.layer_num, self.head_num)
        self.kv_buffer = (
            torch.zeros((*shape, self.head_dim), dtype=self.dtype),
            torch.zeros((*shape, self.v_head_dim), dtype=self.dtype),
        )

    def _flat_page_unsupported(self) -> NotImplementedError:
        return NotImplementedError("Models with head_dim != v_head_dim: no flat pages")

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        raise self._flat_page_unsupported()

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        raise self._flat_page_unsupported()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        raise self._flat_page_unsupported()

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        pointers: list[int] = []
        sizes: list[int] = []
        for start in indices.tolist()[:: self.page_size]:
            for buffer in self.kv_buffer:
                pointers.append(buffer[start].data_ptr())
                sizes.append(buffer[0 : self.page_size].numel() * buffer.element_size())
        return pointers, sizes

    def indices(self, pages: Iterable[int]) -> torch.Tensor:
        size = self.page_size
        return torch.cat([torch.arange(p * size, (p + 1) * size) for p in pages])

    def fill(self, pages: list[int], seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for p in pages:
            for buffer in self.kv_buffer:
                rows = buffer[p * self.page_size : (p + 1) * self.page_size]
                rows.copy_(torch.randn(rows.shape, generator=generator).to(self.dtype))

    def zero(self) -> None:
        for buffer in self.kv_buffer:
            buffer.zero_()

    def page_bytes(self, page: int) -> bytes:
        rows = slice(page * self.page_size, (page + 1) * self.page_size)
        return b"".join(bytes(b[rows].view(torch.uint8).numpy()) for b in self.kv_buffer)


def storage_config(
    modules: dict[str, ModuleType],
    extra: dict[str, Any],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    metrics: bool = False,
    model: str = "test/tiny-model",
    dcp_pool: DcpHostPool | None = None,
) -> Any:
    """SGLang's storage config for one rank; ``dcp_pool``: that rank's DCP shard of an MLA
    model (``tp_rank`` modulo its ``dcp_size``), as SGLang's controller describes it."""
    config_class = modules["sglang.srt.mem_cache.hicache_storage"].HiCacheStorageConfig
    dcp: dict[str, Any] = {}
    if dcp_pool is not None:
        dcp = {
            "dcp_size": dcp_pool.dcp_size,
            "dcp_rank": tp_rank % dcp_pool.dcp_size,
            "logical_page_size": dcp_pool.logical_page_size,
        }
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
        **dcp,
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


class HeldLink:
    """A TCP relay on 127.0.0.1 to a real server on ``port`` whose client-to-server
    direction can be held: after :meth:`hold`, the next bytes a client sends wait in the
    relay (:attr:`holding` is then set) until :meth:`release`, as on a link that stopped
    moving. The server's replies always pass."""

    def __init__(self, port: int) -> None:
        self._server = ("127.0.0.1", port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.holding = threading.Event()
        self._moving = threading.Event()
        self._moving.set()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def hold(self) -> None:
        self._moving.clear()

    def release(self) -> None:
        self._moving.set()

    def stop(self) -> None:
        """Release what is held and close every connection."""
        self._stopping.set()
        self.release()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for one in sockets:
            with contextlib.suppress(OSError):
                one.shutdown(socket.SHUT_RDWR)
            one.close()
        for thread in list(self._threads):
            thread.join(5)

    def _accept(self) -> None:
        self._listener.settimeout(0.05)  # a closed listener does not wake accept()
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            server = socket.create_connection(self._server)
            with self._lock:
                self._sockets += [client, server]
            for source, sink, holdable in ((client, server, True), (server, client, False)):
                thread = threading.Thread(
                    target=self._pump, args=(source, sink, holdable), daemon=True
                )
                self._threads.append(thread)
                thread.start()

    def _pump(self, source: socket.socket, sink: socket.socket, holdable: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                if holdable and not self._moving.is_set():
                    self.holding.set()
                    self._moving.wait()
                sink.sendall(data)
