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


@pytest.mark.parametrize(
    ("group_sizes", "block_indices", "named"),
    [
        ([3, -1], None, "group_sizes"),  # adds up to the 2 ids: once accepted
        ([1.5, 0.5], None, "group_sizes"),
        ([True, 1], None, "group_sizes"),
        (None, None, "group_sizes"),  # once a TypeError: not iterable
        ([2], [0.5], "block_indices"),  # once a skip of half a page
        ([2], [True], "block_indices"),  # once position 1
        ([2], ["0"], "block_indices"),  # once a TypeError from the sign check
        ([2], [-1], "block_indices"),
    ],
)
def test_group_sizes_and_block_indices_must_be_whole_numbers(
    group_sizes: object, block_indices: object, named: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=f"{named} are .*, integers >= 0"):
        GPULoadStoreSpec([4, 5], group_sizes, block_indices)  # type: ignore[arg-type]


def test_any_integer_type_counts_as_a_group_size_or_position() -> None:
    spec = GPULoadStoreSpec([4, 5], np.array([1, 1]), (np.int64(0), 3))
    assert spec.group_sizes == (1, 1) and spec.block_indices == (0, 3)
    assert all(type(n) is int for n in (*spec.group_sizes, *spec.block_indices))


@pytest.mark.parametrize("ids", [[1.5], [[1]], {3}], ids=["float", "nested", "set"])
def test_a_spec_with_invalid_ids_still_has_a_repr(ids: object) -> None:
    # The repr raised the ids' error, so a log line or an error message showing it failed.
    spec = CPULoadStoreSpec(ids)  # type: ignore[arg-type]
    assert repr(spec) == f"CPULoadStoreSpec({ids!r})"
    assert repr(CPULoadStoreSpec(np.array([4, 2]))) == "CPULoadStoreSpec([4, 2])"


def test_block_ids_may_come_from_a_generator() -> None:
    # NumPy took the generator for one object: refused as "object of shape ()".
    assert CPULoadStoreSpec(i for i in (3, 1)).block_ids.tolist() == [3, 1]
    gpu = GPULoadStoreSpec((i for i in (5, 6)), group_sizes=[2])
    assert gpu.block_ids.tolist() == [5, 6] and repr(gpu).startswith("GPULoadStoreSpec([5, 6]")


@pytest.mark.parametrize("ids", [{3, 4}, 7], ids=["set", "number"])
def test_block_ids_that_are_no_sequence_are_refused_by_type(ids: object) -> None:
    # The message said "object of shape ()" (or "int64 of shape ()"), naming nothing given.
    name = type(ids).__name__
    with pytest.raises(InvalidArgumentError, match=f"flat sequence of integers, got {name} "):
        _ = CPULoadStoreSpec(ids).block_ids  # type: ignore[arg-type]
