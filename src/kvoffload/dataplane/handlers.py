"""Transfer handlers: the worker-side contract, and its CPU<->GPU implementation.

A handler accepts a ``(source, destination)`` spec pair and a job id, copies
asynchronously, and later reports the job as a :class:`TransferResult`. A
failed copy is a result with ``success=False``, never an exception in the
engine's loop: the engine then drops the half-written store
(``complete_store(keys, success=False)``) or recomputes the half-loaded blocks.
"""

from __future__ import annotations

import functools
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.specs import (
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    LoadStoreSpec,
    TransferSpec,
    TransferType,
)
from kvoffload.dataplane.cpu_store import CPUBlockStore
from kvoffload.dataplane.kv_cache import page_groups, widest_element
from kvoffload.dataplane.pagecopy import copy_direct, copy_staged
from kvoffload.dataplane.plan import PageMapping, map_load, map_store
from kvoffload.dataplane.runners import CudaStreamRunner, JobRunner, ThreadRunner

FaultHook = Callable[[int, int], None]
"""Called as ``hook(job_id, step)`` before each batched op of a job (steps count
from 0); an exception it raises fails the job midway, as a copy error would."""


@dataclass(frozen=True)
class TransferResult:
    """A finished job: bytes moved and seconds spent, as the reference reports them."""

    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None
    transfer_type: TransferType | None = None


class OffloadingHandler(ABC):
    """Moves blocks between two media, asynchronously."""

    @abstractmethod
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Start the transfer; ``True`` once it is submitted."""

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Transfers finished since the last call."""

    @abstractmethod
    def wait(self, job_ids: Collection[int]) -> None:
        """Block until these jobs are finished; ids of other handlers are ignored."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Finish everything in flight and release threads or streams."""


class CPUGPUHandler(OffloadingHandler):
    """One direction between the engine's per-layer KV tensors and a CPU block store.

    CPU tensors are copied on a background thread with direct batched
    gathers/scatters; CUDA tensors on a dedicated stream, staged on the GPU so
    that each run of adjacent CPU slots crosses the bus in one copy. ``staged``
    forces either path (tests run both on CPU).
    """

    def __init__(
        self,
        gpu_layers: Sequence[torch.Tensor],
        store: CPUBlockStore,
        to_cpu: bool,
        *,
        staged: bool | None = None,
        runner: JobRunner | None = None,
        fault_hook: FaultHook | None = None,
        scratch_bytes: int = 4 << 20,
        min_run_bytes: int = 128 << 10,
        staging_bytes: int = 256 << 20,
    ):
        gpu_bytes = page_groups(gpu_layers)
        cpu_bytes = store.rows()
        num_gpu_blocks, page_bytes = gpu_layers[0].shape[1], gpu_bytes[0].shape[1]
        pages_per_block = sum(group.shape[0] for group in gpu_bytes) // num_gpu_blocks
        if (pages_per_block, page_bytes) != cpu_bytes.shape[1:]:
            raise InvalidArgumentError(
                f"the KV tensors have {pages_per_block} pages of {page_bytes} bytes per block, "
                f"the CPU store expects {tuple(cpu_bytes.shape[1:])}"
            )
        element = widest_element([*gpu_bytes, cpu_bytes])
        self._gpu = [group.view(element) for group in gpu_bytes]
        self._cpu = cpu_bytes.view(element)
        self._num_gpu_blocks = num_gpu_blocks
        self._block_bytes = pages_per_block * page_bytes
        self._store = store
        self._to_cpu = to_cpu
        self.transfer_type: TransferType = ("GPU", "CPU") if to_cpu else ("CPU", "GPU")
        device = self._gpu[0].device
        self._staged = device != self._cpu.device if staged is None else staged
        if runner is None:
            runner = CudaStreamRunner(device) if device.type == "cuda" else ThreadRunner()
        self._runner = runner
        self._fault_hook = fault_hook
        self._min_run_bytes = min_run_bytes
        self._staging_pages = max(1, staging_bytes // self._block_bytes)
        scratch_rows = 0 if self._staged else max(1, scratch_bytes // page_bytes)
        self._scratch = torch.empty(
            (scratch_rows, self._cpu.shape[2]), dtype=element, device=device
        )
        self._sizes: dict[int, int] = {}

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        mapping = self._map(*spec)
        if job_id in self._sizes:
            raise InvalidArgumentError(f"job {job_id} is already in flight")
        job = functools.partial(self._copy, job_id, mapping)
        # Both directions wait for the work queued on the compute stream: a store reads
        # blocks the model may still be writing, and a load writes blocks whose earlier
        # writes (vLLM zeroes a reallocated block there) must not land after it.
        self._runner.submit(job_id, job, after_compute=True)
        # Recorded once the runner took the job (only get_finished, on this thread, reads
        # it): a refused submission must not leave its id looking in flight forever.
        self._sizes[job_id] = len(mapping) * self._block_bytes
        return True

    def get_finished(self) -> list[TransferResult]:
        return [
            TransferResult(
                done.job_id,
                done.success,
                self._sizes.pop(done.job_id),
                done.seconds,
                self.transfer_type,
            )
            for done in self._runner.poll()
        ]

    def wait(self, job_ids: Collection[int]) -> None:
        self._runner.wait(job_ids)

    def close(self) -> None:
        self._runner.close()

    def _map(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> PageMapping:
        num_gpu, num_cpu, factor = (
            self._num_gpu_blocks,
            self._store.num_blocks,
            self._store.block_size_factor,
        )
        if self._to_cpu:
            if isinstance(src, GPULoadStoreSpec) and isinstance(dst, CPULoadStoreSpec):
                return map_store(src, dst, factor, num_gpu, num_cpu)
        elif isinstance(src, CPULoadStoreSpec) and isinstance(dst, GPULoadStoreSpec):
            return map_load(src, dst, factor, num_gpu, num_cpu)
        raise InvalidArgumentError(
            f"a {self.transfer_type[0]}->{self.transfer_type[1]} handler cannot copy "
            f"{type(src).__name__} -> {type(dst).__name__}"
        )

    def _copy(self, job_id: int, mapping: PageMapping) -> None:
        steps = itertools.count()
        hook = self._fault_hook

        def before_step() -> None:
            step = next(steps)
            if hook is not None:
                hook(job_id, step)

        if self._staged:
            copy_staged(
                self._gpu, self._cpu, mapping, self._to_cpu, self._staging_pages, before_step
            )
        else:
            copy_direct(
                self._gpu,
                self._cpu,
                mapping,
                self._to_cpu,
                self._scratch,
                self._min_run_bytes,
                before_step,
            )


def cpu_gpu_handlers(
    gpu_layers: Sequence[torch.Tensor],
    store: CPUBlockStore,
    *,
    staged: bool | None = None,
    fault_hook: FaultHook | None = None,
) -> list[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
    """The store and load handlers for ``store``, as ``(src, dst, handler)`` for a worker.

    Each handler has its own thread or stream, so stores and loads overlap.
    """
    store_handler = CPUGPUHandler(
        gpu_layers, store, to_cpu=True, staged=staged, fault_hook=fault_hook
    )
    load_handler = CPUGPUHandler(
        gpu_layers, store, to_cpu=False, staged=staged, fault_hook=fault_hook
    )
    return [
        (GPULoadStoreSpec, CPULoadStoreSpec, store_handler),
        (CPULoadStoreSpec, GPULoadStoreSpec, load_handler),
    ]
