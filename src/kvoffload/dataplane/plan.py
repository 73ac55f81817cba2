"""Which GPU page goes to which CPU page: a transfer spec turned into index arrays.

The copy unit is one GPU block of one canonical tensor (a *page*). A CPU slot
holds ``factor`` consecutive pages, so slot ``s`` sub-block ``j`` is CPU row
``s * factor + j``. Pairs are sorted by CPU row: the order of independent
copies does not matter, and sorting turns slots that the manager handed out
together (in any order) into runs the copy can move in one piece.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.specs import CPULoadStoreSpec, GPULoadStoreSpec

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class PageMapping:
    """Pairs ``(gpu_ids[i], cpu_rows[i])``, sorted by CPU row."""

    gpu_ids: IntArray
    cpu_rows: IntArray

    def __len__(self) -> int:
        return len(self.gpu_ids)

    def runs(self) -> list[tuple[int, int]]:
        """``(start, length)`` of each maximal stretch of consecutive CPU rows."""
        if len(self.cpu_rows) == 0:
            return []
        breaks = np.flatnonzero(np.diff(self.cpu_rows) != 1) + 1
        starts = np.concatenate(([0], breaks))
        ends = np.concatenate((breaks, [len(self.cpu_rows)]))
        return [(int(s), int(e - s)) for s, e in zip(starts, ends, strict=True)]

    def select(self, positions: IntArray) -> PageMapping:
        return PageMapping(self.gpu_ids[positions], self.cpu_rows[positions])


def map_store(
    src: GPULoadStoreSpec, dst: CPULoadStoreSpec, factor: int, num_gpu: int, num_cpu: int
) -> PageMapping:
    """Pages of a GPU->CPU store, which ends on an offloaded-block boundary.

    It starts on one too, unless the spec gives its position in the request: then at
    sub-block ``block_indices[0] % factor`` of the first slot, as vLLM stores a sliding-window
    or Mamba group whose leading blocks are out of reach (its loads skip them too); the
    sub-blocks before it keep what they held.
    """
    gpu_ids = _single_group(src)
    slots = dst.block_ids
    skip = 0 if src.block_indices is None else src.block_indices[0] % factor
    if skip + len(gpu_ids) != len(slots) * factor:
        raise InvalidArgumentError(
            f"a store of {len(slots)} CPU blocks needs {len(slots) * factor - skip} GPU blocks "
            f"(block_size_factor {factor}, starting at sub-block {skip}), got {len(gpu_ids)}"
        )
    return _mapping(gpu_ids, slots, skip, factor, num_gpu, num_cpu)


def map_load(
    src: CPULoadStoreSpec, dst: GPULoadStoreSpec, factor: int, num_gpu: int, num_cpu: int
) -> PageMapping:
    """Pages of a CPU->GPU load, skipping the leading pages the GPU already holds.

    The skip is ``block_indices[0] % factor`` when the spec gives the load's
    position in its request, else ``(-num_gpu_blocks) % factor`` (the load
    then ends on an offloaded-block boundary). Every listed slot must be used.
    """
    gpu_ids = _single_group(dst)
    slots = src.block_ids
    if dst.block_indices is not None:
        skip = dst.block_indices[0] % factor
    else:
        skip = -len(gpu_ids) % factor
    pages = skip + len(gpu_ids)
    if not (len(slots) - 1) * factor < pages <= len(slots) * factor:
        raise InvalidArgumentError(
            f"{len(gpu_ids)} GPU blocks starting at sub-block {skip} do not fill "
            f"{len(slots)} CPU blocks of {factor} sub-blocks"
        )
    return _mapping(gpu_ids, slots, skip, factor, num_gpu, num_cpu)


def _single_group(spec: GPULoadStoreSpec) -> IntArray:
    if len(spec.group_sizes) != 1:
        raise InvalidArgumentError(
            f"one KV cache group is supported, the spec has {len(spec.group_sizes)}"
        )
    return spec.block_ids


def _mapping(
    gpu_ids: IntArray, slots: IntArray, skip: int, factor: int, num_gpu: int, num_cpu: int
) -> PageMapping:
    _check_ids("GPU block", gpu_ids, num_gpu)
    _check_ids("CPU block", slots, num_cpu)
    rows = (slots[:, None] * factor + np.arange(factor, dtype=np.int64)).ravel()
    rows = rows[skip : skip + len(gpu_ids)]
    order = np.argsort(rows, kind="stable")
    return PageMapping(np.ascontiguousarray(gpu_ids[order]), rows[order])


def _check_ids(what: str, ids: IntArray, limit: int) -> None:
    if len(ids) and (ids.min() < 0 or ids.max() >= limit):
        raise InvalidArgumentError(f"{what} ids must lie in [0, {limit}), got {ids.tolist()}")
    if len(np.unique(ids)) != len(ids):
        raise InvalidArgumentError(f"{what} ids must be distinct, got {ids.tolist()}")
