"""Spec pairs to page index arrays: alignment, skips, validation, runs."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.specs import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.dataplane.plan import PageMapping, map_load, map_store


def pairs(mapping: PageMapping) -> list[tuple[int, int]]:
    return list(zip(mapping.gpu_ids.tolist(), mapping.cpu_rows.tolist(), strict=True))


def test_store_expands_slots_into_factor_rows_sorted_by_cpu_row() -> None:
    mapping = map_store(GPULoadStoreSpec([10, 11, 12, 13], [4]), CPULoadStoreSpec([5, 2]), 2, 20, 8)
    assert pairs(mapping) == [(12, 4), (13, 5), (10, 10), (11, 11)]
    assert mapping.runs() == [(0, 2), (2, 2)]


def test_store_must_cover_whole_offloaded_blocks() -> None:
    with pytest.raises(InvalidArgumentError, match="needs 4 GPU blocks"):
        map_store(GPULoadStoreSpec([1, 2, 3], [3]), CPULoadStoreSpec([0, 1]), 2, 8, 8)


def test_unaligned_load_skips_leading_sub_blocks_by_default() -> None:
    # 5 GPU blocks from 2 slots of 4: the load ends on a boundary, so it skips 3.
    mapping = map_load(CPULoadStoreSpec([1, 0]), GPULoadStoreSpec([7, 8, 9, 3, 4], [5]), 4, 16, 2)
    assert mapping.cpu_rows.tolist() == [0, 1, 2, 3, 7]
    assert mapping.gpu_ids.tolist() == [8, 9, 3, 4, 7]


def test_load_skip_comes_from_block_indices() -> None:
    # The request's block 5 with factor 4 is sub-block 1; 2 GPU blocks, 1 slot: pages 1 and 2.
    spec = GPULoadStoreSpec([30, 31], [2], block_indices=[5])
    mapping = map_load(CPULoadStoreSpec([3]), spec, 4, 40, 4)
    assert pairs(mapping) == [(30, 13), (31, 14)]


@pytest.mark.parametrize(
    ("slots", "gpu", "indices"),
    [
        ([0, 1], [1, 2, 3], [0]),  # 3 pages fit in slot 0: slot 1 is unused
        ([0], [1, 2, 3], [2]),  # 2 + 3 pages overflow one slot of 4
    ],
)
def test_load_must_use_every_listed_slot(
    slots: list[int], gpu: list[int], indices: list[int]
) -> None:
    with pytest.raises(InvalidArgumentError, match="do not fill"):
        map_load(CPULoadStoreSpec(slots), GPULoadStoreSpec(gpu, [len(gpu)], indices), 4, 8, 4)


@pytest.mark.parametrize(
    ("gpu", "slots", "message"),
    [
        ([0, 8], [0, 1], r"GPU block ids must lie in \[0, 8\)"),
        ([0, 1], [0, 4], r"CPU block ids must lie in \[0, 4\)"),
        # A negative id would index from the end: another block's page, silently.
        ([-1, 1], [0, 1], r"GPU block ids must lie in \[0, 8\)"),
        ([0, 1], [0, -1], r"CPU block ids must lie in \[0, 4\)"),
        ([0, 1], [2, 2], "CPU block ids must be distinct"),
        ([3, 3], [0, 1], "GPU block ids must be distinct"),
    ],
)
def test_ids_are_checked(gpu: list[int], slots: list[int], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        map_store(GPULoadStoreSpec(gpu, [2]), CPULoadStoreSpec(slots), 1, 8, 4)


def test_one_kv_group_only() -> None:
    with pytest.raises(InvalidArgumentError, match="one KV cache group"):
        map_store(GPULoadStoreSpec([0, 1], [1, 1]), CPULoadStoreSpec([0, 1]), 1, 8, 4)


def test_runs_split_where_cpu_rows_jump() -> None:
    mapping = PageMapping(
        np.arange(6, dtype=np.int64), np.array([0, 1, 2, 5, 6, 9], dtype=np.int64)
    )
    assert mapping.runs() == [(0, 3), (3, 2), (5, 1)]
    assert PageMapping(np.empty(0, np.int64), np.empty(0, np.int64)).runs() == []


def test_a_store_starting_inside_an_offloaded_block_fills_it_from_that_sub_block() -> None:
    # The request's block 1 is sub-block 1 of 2 (vLLM left block 0 out of the store):
    # copied to sub-block 0 it would be misplaced. The store still ends on a boundary.
    spec = GPULoadStoreSpec([11], [1], block_indices=[1])
    assert pairs(map_store(spec, CPULoadStoreSpec([3]), 2, 20, 8)) == [(11, 7)]
    with pytest.raises(InvalidArgumentError, match="needs 1 GPU blocks"):
        map_store(GPULoadStoreSpec([10, 11], [2], [1]), CPULoadStoreSpec([0]), 2, 20, 8)
    aligned = GPULoadStoreSpec([10, 11], [2], block_indices=[2])
    assert pairs(map_store(aligned, CPULoadStoreSpec([0]), 2, 20, 8)) == [(10, 0), (11, 1)]
