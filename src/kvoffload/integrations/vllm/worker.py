"""vLLM 0.33's ``OffloadingWorker`` contract on kvoffload's batched CPU<->GPU handlers.

vLLM hands the worker its *canonical* KV caches: one ``[num_blocks, page_bytes]``
byte tensor per distinct KV buffer. Our handlers copy ``[2, num_blocks, ...]``
layers (K and V), so each canonical page is viewed as two halves: no byte
is copied to adapt, and a block's pages still move in batched gathers.
Without CUDA the tensors are CPU tensors and copies run on a thread.

With lower tiers the CPU slots live in a shared region (one file per rank,
:mod:`kvoffload.dataplane.shared_region`), so that the scheduler's tier
stack can write them down and promote blocks back into them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult

from kvoffload.core.errors import InvalidArgumentError, KVOffloadError
from kvoffload.core.layout import KVLayout
from kvoffload.core.specs import CPULoadStoreSpec, GPULoadStoreSpec, TransferSpec
from kvoffload.dataplane import CPUBlockStore, CPUGPUHandler, OffloadingHandler, cpu_gpu_handlers
from kvoffload.dataplane.shared_region import SharedRegion
from kvoffload.dataplane.worker import close_all
from kvoffload.integrations.vllm.spec import check_one_kv_group

logger = logging.getLogger(__name__)

VLLM_ASSERTS_SUCCESS = __debug__
"""Whether vLLM's connector worker stops the engine on a failed job. It supports none:
it asserts that each submission and each result succeeded. Under ``python -O`` those
asserts are stripped, and it would take a failed or refused store as stored (the scheduler
then serves slots never written as KV) and a failed load as loaded (the request runs on
blocks never filled): so with asserts off this worker raises instead of reporting one."""


class KVOffloadWorker(OffloadingWorker):  # type: ignore[misc]
    """Stores and loads for one KV-cache group, into a CPU store of ``num_blocks`` slots.

    ``slot_bytes``: vLLM's bytes per offloaded block on this rank, which sized the
    slots within ``cpu_bytes_to_use``; a slot of ours larger than that is refused (it
    would take more memory than the budget). ``region``: keep the slots in a shared
    region created at this path, whose slots must be exactly ``slot_bytes`` (what the
    scheduler side reads); without one, a smaller slot of ours is fine (vLLM's figure
    may include padding). A job id is refused while a job of that id, in any
    direction, is in flight.
    """

    def __init__(
        self,
        kv_caches: Any,
        num_blocks: int,
        blocks_per_chunk: int = 1,
        region: Path | None = None,
        slot_bytes: int | None = None,
    ) -> None:
        check_one_kv_group(len(kv_caches.group_data_refs))
        pages = [_byte_rows(t.tensor) for t in kv_caches.tensors]
        if not pages or len({p.shape for p in pages}) != 1 or pages[0].shape[1] % 2:
            raise InvalidArgumentError(
                "kvoffload's worker needs canonical KV tensors of one even page size, got "
                f"{[tuple(p.shape) for p in pages]}"
            )
        num_gpu_blocks, page_bytes = pages[0].shape
        halves = [p.view(num_gpu_blocks, 2, page_bytes // 2).transpose(0, 1) for p in pages]
        layout = KVLayout(len(pages), 1, page_bytes // 2, "float8", tokens_per_block=1)
        self.region: SharedRegion | None = None
        self._in_flight: set[int] = set()
        own = blocks_per_chunk * layout.bytes_per_block
        if slot_bytes is not None and own > slot_bytes:
            raise InvalidArgumentError(
                f"kvoffload's worker stores {own} bytes per offloaded block but vLLM "
                f"reported {slot_bytes}: its {num_blocks} CPU slots would take "
                f"{num_blocks * own} bytes, not the {num_blocks * slot_bytes} of "
                f"cpu_bytes_to_use they were sized for"
            )
        if region is not None:
            if slot_bytes is not None and own != slot_bytes:
                raise InvalidArgumentError(
                    f"kvoffload's worker stores {own} bytes per offloaded block but vLLM "
                    f"reported {slot_bytes}; the lower tiers cannot share its CPU slots"
                )
            self.region = SharedRegion(region, num_blocks * own)
        try:
            buffer = None if self.region is None else self.region.tensor
            self.store = CPUBlockStore(layout, num_blocks, blocks_per_chunk, buffer=buffer)
            (_, _, self._store), (_, _, self._load) = cpu_gpu_handlers(halves, self.store)
            # Expedited loads (waited on within the step) get a thread or stream of their
            # own, so that they never queue behind the regular loads.
            self._expedited = CPUGPUHandler(halves, self.store, to_cpu=False)
        except BaseException:
            if self.region is not None:
                self.region.close()
            raise

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._submit(
            self._store, job_id, lambda: (_gpu(src_spec), CPULoadStoreSpec(dst_spec.block_ids))
        )

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        handler = self._expedited if expedited else self._load
        return self._submit(
            handler, job_id, lambda: (CPULoadStoreSpec(src_spec.block_ids), _gpu(dst_spec))
        )

    def get_finished(self) -> list[Any]:
        results = [
            TransferResult(r.job_id, r.success, r.transfer_size, r.transfer_time)
            for handler in self._handlers()
            for r in handler.get_finished()
        ]
        for result in results:
            if not result.success and not VLLM_ASSERTS_SUCCESS:
                raise _unreportable(
                    result.job_id,
                    f"failed (the warning 'transfer job {result.job_id} failed' logged "
                    "above gives the error)",
                )
        self._in_flight.difference_update(r.job_id for r in results)
        return results

    def wait(self, job_ids: Collection[int]) -> None:
        for handler in self._handlers():
            handler.wait(job_ids)

    def shutdown(self) -> None:
        close_all([*self._handlers(), self.region])

    def _handlers(self) -> tuple[OffloadingHandler, ...]:
        return (self._store, self._load, self._expedited)

    def _submit(
        self, handler: OffloadingHandler, job_id: int, spec: Callable[[], TransferSpec]
    ) -> bool:
        """Submit, turning a refused job into ``False`` as vLLM's worker loop expects (an
        error where its asserts are off, see :data:`VLLM_ASSERTS_SUCCESS`).

        ``spec`` converts vLLM's specs into ours inside the ``try``: the conversion
        validates them too, and a bad one must be refused, not raised into vLLM's loop.
        Each direction's handler only knows its own ids, so a reused one is caught here:
        two jobs of one id would report it finished while one of them still runs.
        """
        if job_id in self._in_flight:
            return _refuse(job_id, "a job of this id is in flight")
        try:
            submitted = handler.transfer_async(job_id, spec())
        except Exception as exc:
            return _refuse(job_id, f"{type(exc).__name__}: {exc}", exc)
        if not submitted:
            return _refuse(job_id, "its handler declined it")
        self._in_flight.add(job_id)
        return True


def _refuse(job_id: int, cause: str, error: Exception | None = None) -> bool:
    """``False`` for vLLM's loop, logged; with vLLM's asserts off, an error that stops it.

    Bad input (a spec out of range, a job after shutdown) is one line naming why: the
    traceback from deep inside the data plane buried the reason. Other errors keep theirs.
    """
    if not VLLM_ASSERTS_SUCCESS:
        raise _unreportable(job_id, f"refused ({cause})") from error
    trace = None if isinstance(error, KVOffloadError) else error
    logger.warning("kvoffload: job %d refused, %s", job_id, cause, exc_info=trace)
    return False


def _unreportable(job_id: int, what: str) -> RuntimeError:
    return RuntimeError(
        f"kvoffload: transfer job {job_id} {what}; vLLM running under python -O cannot be "
        "told of a failed transfer (its asserts on each job's success are stripped) and "
        "would go on as if it had succeeded, so the engine stops here"
    )


def _byte_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as one row of bytes per block: always a view, as ``reshape`` would copy a
    tensor whose blocks are not each contiguous, and loads into that copy would never
    reach vLLM's cache."""
    rows = tensor.view(torch.uint8) if tensor.dtype == torch.int8 else tensor
    try:
        return rows.view(rows.shape[0], -1).view(torch.uint8)
    except RuntimeError:
        raise InvalidArgumentError(
            "kvoffload's worker needs each KV block contiguous in memory, got strides "
            f"{tuple(tensor.stride())} for shape {tuple(tensor.shape)}"
        ) from None


def _gpu(spec: Any) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(spec.block_ids, spec.group_sizes, spec.block_indices)
