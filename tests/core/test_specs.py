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
