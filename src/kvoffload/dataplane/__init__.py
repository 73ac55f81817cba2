"""The data plane: real KV bytes moved between the engine's KV cache and the CPU tier.

Needs torch (the ``[torch]`` extra); nothing outside this package and the
simulator's data-plane backend imports it.
"""

from kvoffload.dataplane.cpu_store import CPUBlockStore
from kvoffload.dataplane.handlers import (
    CPUGPUHandler,
    FaultHook,
    OffloadingHandler,
    TransferResult,
    cpu_gpu_handlers,
)
from kvoffload.dataplane.kv_cache import TORCH_DTYPES, PagedKVCache
from kvoffload.dataplane.worker import OffloadingWorker

__all__ = [
    "TORCH_DTYPES",
    "CPUBlockStore",
    "CPUGPUHandler",
    "FaultHook",
    "OffloadingHandler",
    "OffloadingWorker",
    "PagedKVCache",
    "TransferResult",
    "cpu_gpu_handlers",
]
