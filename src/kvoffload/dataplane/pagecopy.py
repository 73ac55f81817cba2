"""Batched page copies between the engine's page groups and the CPU store's rows.

``cpu`` is the store as ``[num_cpu_rows, T, W]``: CPU row ``r`` holds one GPU
block's pages of all ``T`` canonical tensors. ``groups`` comes from
:func:`~kvoffload.dataplane.kv_cache.page_groups`: either one group holding
all ``T`` tensors (row ``t * num_gpu_blocks + b``) or ``T`` groups of one. In
both cases a group's pages of CPU row ``r`` are rows ``r * k .. r * k + k - 1``
of a 2-D view of ``cpu``, so every copy is one row-indexed torch op (the
fastest kind on CPU) per group and per run or chunk, never one per page.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvoffload.dataplane.plan import PageMapping

BeforeStep = Callable[[], None]
"""Called before each batched op of a job; an exception stops the job there."""


def copy_direct(
    groups: Sequence[torch.Tensor],
    cpu: torch.Tensor,
    mapping: PageMapping,
    to_cpu: bool,
    scratch: torch.Tensor,
    min_run_bytes: int,
    before_step: BeforeStep,
) -> None:
    """Copy when both sides live on one device.

    A run of adjacent CPU rows worth at least ``min_run_bytes`` per group is
    one gather or scatter straight between the two tensors. The remaining
    pages, whose CPU rows are scattered, go through ``scratch`` (rows small
    enough in total to stay in cache), chunk by chunk.
    """
    k, num_blocks = _group_shape(groups, cpu)
    row_bytes = cpu.shape[2] * cpu.element_size()
    min_run = -(-min_run_bytes // (k * row_bytes))
    runs = mapping.runs()
    gpu_rows = torch.from_numpy(_gpu_rows(mapping.gpu_ids, k, num_blocks))
    long_runs = [
        (start * k, n * k, int(mapping.cpu_rows[start]) * k) for start, n in runs if n >= min_run
    ]
    short = [np.arange(start, start + n) for start, n in runs if n < min_run]
    rest = mapping.select(np.concatenate(short)) if short else mapping.select(_NONE)
    rest_gpu = torch.from_numpy(_gpu_rows(rest.gpu_ids, k, num_blocks))
    rest_cpu = torch.from_numpy(_cpu_rows(rest.cpu_rows, k))
    chunk = scratch.shape[0]
    for index, pages in enumerate(groups):
        rows = _cpu_view(cpu, index, k)
        for start, n, row in long_runs:
            before_step()
            ids = gpu_rows[start : start + n]
            if to_cpu:
                torch.index_select(pages, 0, ids, out=rows[row : row + n])
            else:
                pages.index_copy_(0, ids, rows[row : row + n])
        for start in range(0, len(rest_gpu), chunk):
            before_step()
            g_ids, c_ids = rest_gpu[start : start + chunk], rest_cpu[start : start + chunk]
            buf = scratch[: len(g_ids)]
            if to_cpu:
                torch.index_select(pages, 0, g_ids, out=buf)
                rows.index_copy_(0, c_ids, buf)
            else:
                torch.index_select(rows, 0, c_ids, out=buf)
                pages.index_copy_(0, g_ids, buf)


def copy_staged(
    groups: Sequence[torch.Tensor],
    cpu: torch.Tensor,
    mapping: PageMapping,
    to_cpu: bool,
    max_pages: int,
    before_step: BeforeStep,
) -> None:
    """Copy across devices, ``max_pages`` pages at a time.

    The GPU side gathers (or scatters) its pages through a staging tensor on
    its own device, laid out like the chunk's CPU rows, so every run of
    adjacent CPU rows crosses the bus as one asynchronous copy of whole
    blocks instead of one small copy per page and tensor.
    """
    k, num_blocks = _group_shape(groups, cpu)
    device = groups[0].device
    for first in range(0, len(mapping), max_pages):
        part = mapping.select(np.arange(first, min(first + max_pages, len(mapping))))
        staging = torch.empty((len(part), *cpu.shape[1:]), dtype=cpu.dtype, device=device)
        ids = torch.from_numpy(_gpu_rows(part.gpu_ids, k, num_blocks)).to(device, non_blocking=True)
        runs = [(start, n, int(part.cpu_rows[start])) for start, n in part.runs()]
        if not to_cpu:
            for start, n, row in runs:
                before_step()
                staging[start : start + n].copy_(cpu[row : row + n], non_blocking=True)
        for index, pages in enumerate(groups):
            before_step()
            staged = _cpu_view(staging, index, k)
            if to_cpu:
                torch.index_select(pages, 0, ids, out=staged)
            else:
                pages.index_copy_(0, ids, staged)
        if to_cpu:
            for start, n, row in runs:
                before_step()
                cpu[row : row + n].copy_(staging[start : start + n], non_blocking=True)


def _group_shape(groups: Sequence[torch.Tensor], cpu: torch.Tensor) -> tuple[int, int]:
    """Canonical tensors per group, and GPU blocks per canonical tensor."""
    k = cpu.shape[1] // len(groups)
    return k, groups[0].shape[0] // k


def _cpu_view(cpu: torch.Tensor, index: int, k: int) -> torch.Tensor:
    """Group ``index``'s 2-D rows of ``cpu`` (``[rows, T, W]``)."""
    return cpu.flatten(0, 1) if k > 1 else cpu[:, index]


def _gpu_rows(gpu_ids: npt.NDArray[np.int64], k: int, num_blocks: int) -> npt.NDArray[np.int64]:
    """Group rows of these blocks' pages, each block's ``k`` pages in tensor order."""
    if k == 1:
        return gpu_ids
    return (gpu_ids[:, None] + num_blocks * np.arange(k, dtype=np.int64)).ravel()


def _cpu_rows(cpu_rows: npt.NDArray[np.int64], k: int) -> npt.NDArray[np.int64]:
    if k == 1:
        return cpu_rows
    return (cpu_rows[:, None] * k + np.arange(k, dtype=np.int64)).ravel()


_NONE = np.empty(0, dtype=np.int64)
