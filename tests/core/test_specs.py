import numpy as np
import pytest

from kvoffload import CPULoadStoreSpec, GPULoadStoreSpec, InvalidArgumentError


def test_media_and_ids() -> None:
    cpu = CPULoadStoreSpec([3, 1])
    assert cpu.medium() == "CPU"
    assert cpu.block_ids.dtype == np.int64 and cpu.block_ids.tolist() == [3, 1]
    gpu = GPULoadStoreSpec([5, 6, 7], group_sizes=[3], block_indices=[2])
    assert gpu.medium() == "GPU" and gpu.block_indices == (2,)


def test_group_sizes_must_cover_the_ids() -> None:
    with pytest.raises(InvalidArgumentError, match="add up to 2"):
        GPULoadStoreSpec([1, 2, 3], group_sizes=[2])
    with pytest.raises(InvalidArgumentError, match="block_indices"):
        GPULoadStoreSpec([1, 2], group_sizes=[2], block_indices=[0, 1])


@pytest.mark.parametrize("ids", [[1.7], [True], [[1]]], ids=["float", "bool", "nested"])
def test_block_ids_that_are_not_flat_integers_are_refused(ids: list[object]) -> None:
    # A cast would truncate 1.7 (or True) to block 1, and a worker would move bytes into it.
    with pytest.raises(InvalidArgumentError, match="flat sequence of integers"):
        _ = CPULoadStoreSpec(ids).block_ids
    assert CPULoadStoreSpec(np.array([2], dtype=np.uint32)).block_ids.tolist() == [2]
    assert CPULoadStoreSpec([]).block_ids.dtype == np.int64


def test_a_negative_block_index_is_refused() -> None:
    # -1 % factor would read as a valid skip of factor - 1 sub-blocks.
    with pytest.raises(InvalidArgumentError, match="positions within a request"):
        GPULoadStoreSpec([30], group_sizes=[1], block_indices=[-1])


@pytest.mark.parametrize(
    ("ids", "beyond"),
    [
        (np.array([3, 2**63 + 5], dtype=np.uint64), 2**63 + 5),
        ([3, 2**63 + 5], 2**63 + 5),  # NumPy: uint64
        ([-1, 2**63 + 5], 2**63 + 5),  # float64
        ([2**64 + 5], 2**64 + 5),  # object
        ([-(2**63) - 5], -(2**63) - 5),  # object
    ],
    ids=["uint64 array", "list past int64", "mixed signs", "past uint64", "below int64"],
)
def test_block_ids_past_int64_are_refused_showing_their_value(ids: object, beyond: int) -> None:
    """Not cast to int64: ``2**63 + 5`` wrapped to a negative id, which the data plane
    refused as out of range showing the wrapped value, not the one the caller gave."""
    with pytest.raises(InvalidArgumentError, match=rf"must fit in int64, got \[{beyond}\]"):
        _ = CPULoadStoreSpec(ids).block_ids  # type: ignore[arg-type]
    assert CPULoadStoreSpec(np.array([2**63 - 1], np.uint64)).block_ids.tolist() == [2**63 - 1]
