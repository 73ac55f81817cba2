"""The simulator's data-plane mode: real KV bytes, really copied, every load verified.

``compute`` fills each block with content derived from its key alone, so the
expected bytes of any loaded block can be regenerated at ``finish`` and
compared bit for bit, wherever in the CPU tier the block has been, and
whichever lower tier (disk, remote) it was promoted back from.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import OffloadKey
from kvoffload.core.layout import KVLayout
from kvoffload.core.specs import GPULoadStoreSpec, LoadStoreSpec, TransferSpec
from kvoffload.dataplane import (
    CPUBlockStore,
    FaultHook,
    OffloadingWorker,
    PagedKVCache,
    cpu_gpu_handlers,
)
from kvoffload.dataplane.kv_cache import widest_element
from kvoffload.dataplane.slot_bytes import StoreSlotBytes

_SEED_BITS = 31
"""Per-key coefficients stay below 2**31, so ``a * i + b`` fits in int64 for any block size."""


class DataPlaneBackend:
    """A :class:`~kvoffload.sim.transfers.TransferBackend` over a real KV cache and CPU tier.

    Stores and loads run through an :class:`OffloadingWorker` with one
    thread (or CUDA stream) per direction, so jobs overlap with each other
    and with the engine. A load that fails or returns wrong bytes makes
    ``finish`` return ``False``. The GPU blocks of a store must not be
    recomputed before ``finish`` of that store, as in a real engine.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        device: str = "cpu",
        *,
        fault_hook: FaultHook | None = None,
    ):
        self.kv_cache = PagedKVCache(layout, num_gpu_blocks, device)
        self.store = CPUBlockStore(layout, num_cpu_blocks)
        self.slot_bytes = StoreSlotBytes(self.store)
        """The CPU slots' bytes, for lower tiers: promotions fill slots the loads then verify."""
        self.worker = OffloadingWorker(
            cpu_gpu_handlers(self.kv_cache.layers, self.store, fault_hook=fault_hook)
        )
        # The model's view of each layer: [K/V, block, page], independent of the copy path.
        pages = [layer.flatten(2).view(torch.uint8) for layer in self.kv_cache.layers]
        element = widest_element(pages)
        # Compared as integers: a float compare would call a NaN pattern unequal to itself.
        self._element = torch.int64 if element == torch.complex128 else element
        self._pages = [layer.view(self._element) for layer in pages]
        self._pages_per_block = 2 * layout.num_layers
        self._device = self.kv_cache.device
        self._block_bytes = layout.bytes_per_block
        self._loads: dict[int, tuple[list[OffloadKey], list[int]]] = {}
        self._results: dict[int, bool] = {}
        self.verified_blocks = 0
        self.mismatched_blocks = 0
        self.failed_jobs = 0

    def compute(self, keys: Sequence[OffloadKey], gpu_block_ids: Sequence[int]) -> None:
        if not keys:
            return
        content = self.content(keys)
        ids = self._ids(gpu_block_ids)
        for pages, expected in self._by_layer(content):
            pages.index_copy_(1, ids, expected)

    def submit_store(
        self,
        job_id: int,
        keys: Sequence[OffloadKey],
        gpu_block_ids: Sequence[int],
        dst: LoadStoreSpec,
    ) -> None:
        self._submit(job_id, (_gpu_spec(gpu_block_ids), dst))

    def submit_load(
        self,
        job_id: int,
        keys: Sequence[OffloadKey],
        src: LoadStoreSpec,
        gpu_block_ids: Sequence[int],
    ) -> None:
        self._loads[job_id] = (list(keys), list(gpu_block_ids))
        self._submit(job_id, (src, _gpu_spec(gpu_block_ids)))

    def _submit(self, job_id: int, spec: TransferSpec) -> None:
        """Hand ``spec`` to the worker; a refused job is failed at once."""
        if not self.worker.transfer_async(job_id, spec):
            self._results[job_id] = False

    def finish(self, job_id: int) -> bool:
        if job_id not in self._results:
            self.worker.wait({job_id})
            self._collect()
        if job_id not in self._results:
            raise InvalidArgumentError(f"job {job_id} was never submitted")
        success = self._results.pop(job_id)
        load = self._loads.pop(job_id, None)
        if not success:
            self.failed_jobs += 1
            return False
        if load is None:
            return True
        mismatched = self._count_mismatches(*load)
        self.verified_blocks += len(load[0]) - mismatched
        self.mismatched_blocks += mismatched
        return mismatched == 0

    def close(self) -> None:
        self.worker.close()
        self._collect()

    def content(self, keys: Sequence[OffloadKey]) -> torch.Tensor:
        """``[len(keys), 2 * num_layers, page elements]``: each key's deterministic block.

        Word ``i`` of a block is ``a * i + b`` with ``a`` (odd) and ``b`` taken
        from a hash of the key: cheap to generate for many keys at once, and
        different keys, layers and positions get different bytes.
        """
        coefficients = [_coefficients(key) for key in keys]
        a = torch.tensor([c[0] for c in coefficients], device=self._device).unsqueeze(1)
        b = torch.tensor([c[1] for c in coefficients], device=self._device).unsqueeze(1)
        words = -(-self._block_bytes // 8)
        index = torch.arange(words, dtype=torch.int64, device=self._device)
        raw = (a * index + b).view(torch.uint8)[:, : self._block_bytes]
        pages = raw.reshape(len(keys), self._pages_per_block, -1)
        return pages.view(self._element)

    def _count_mismatches(self, keys: list[OffloadKey], gpu_block_ids: list[int]) -> int:
        ids = self._ids(gpu_block_ids)
        wrong = torch.zeros(len(keys), dtype=torch.bool, device=self._device)
        for pages, expected in self._by_layer(self.content(keys)):
            wrong |= (pages.index_select(1, ids) != expected).any(dim=2).any(dim=0)
        return int(wrong.sum().item())

    def _by_layer(self, content: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's pages beside its part of ``content``, both ``[2, blocks, W]``."""
        return [
            (pages, content[:, 2 * layer : 2 * layer + 2].transpose(0, 1))
            for layer, pages in enumerate(self._pages)
        ]

    def _ids(self, gpu_block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(gpu_block_ids), dtype=torch.int64, device=self._device)

    def _collect(self) -> None:
        for result in self.worker.get_finished():
            self._results[result.job_id] = result.success


def _gpu_spec(gpu_block_ids: Sequence[int]) -> GPULoadStoreSpec:
    """The engine's side of a job: these GPU blocks, all in KV group 0."""
    return GPULoadStoreSpec(list(gpu_block_ids), [len(gpu_block_ids)])


def _coefficients(key: bytes) -> tuple[int, int]:
    digest = hashlib.blake2b(key, digest_size=8).digest()
    mask = (1 << _SEED_BITS) - 1
    a = int.from_bytes(digest[:4], "little") & mask | 1
    b = int.from_bytes(digest[4:], "little") & mask
    return a, b
