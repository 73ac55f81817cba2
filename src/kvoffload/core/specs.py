"""Descriptions of where blocks live, handed from the manager to the workers.

A transfer is a ``(source, destination)`` pair of specs; workers route it by
the pair of ``medium()`` names.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import numpy.typing as npt

from kvoffload.core.errors import InvalidArgumentError


class LoadStoreSpec(ABC):
    """Where a batch of blocks is read from or written to."""

    @staticmethod
    @abstractmethod
    def medium() -> str:
        """Name of the storage medium, used to route transfers."""


class BlockIDsLoadStoreSpec(LoadStoreSpec, ABC):
    """A spec that names blocks by integer slot ids within one medium.

    The int64 array is built on first use of ``block_ids``: the scheduler makes
    a spec per call, and only a worker that moves bytes needs the array. An
    iterator (a generator) is read into a list at once, as it can be read once
    only and NumPy takes it for a single object.
    """

    def __init__(self, block_ids: Sequence[int] | npt.ArrayLike | Iterator[int]) -> None:
        self._ids = list(block_ids) if isinstance(block_ids, Iterator) else block_ids
        self._array: npt.NDArray[np.int64] | None = None

    @property
    def block_ids(self) -> npt.NDArray[np.int64]:
        if self._array is None:
            self._array = _int_ids(self._ids)
        return self._array

    def __repr__(self) -> str:
        # Invalid ids are shown as given: a repr that raised failed the log line or the
        # error message showing the spec.
        try:
            ids: object = self.block_ids.tolist()
        except InvalidArgumentError:
            ids = self._ids
        return f"{type(self).__name__}({ids!r})"


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Slots of the CPU tier, one per offloaded block."""

    @staticmethod
    def medium() -> str:
        return "CPU"


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """GPU block ids of every KV group, concatenated group after group.

    ``group_sizes[i]`` is how many ids belong to group ``i``. For loads and stores,
    ``block_indices[i]`` is the position within the request of group ``i``'s
    first GPU block, which tells the worker how much of the first offloaded
    block to skip when a transfer does not start on an offloaded-block boundary.
    """

    def __init__(
        self,
        block_ids: Sequence[int] | npt.ArrayLike | Iterator[int],
        group_sizes: Sequence[int],
        block_indices: Sequence[int] | None = None,
    ) -> None:
        super().__init__(block_ids)
        self.group_sizes = _whole_numbers("group_sizes", group_sizes, "block counts")
        if sum(self.group_sizes) != len(self.block_ids):
            raise InvalidArgumentError(
                f"group_sizes {self.group_sizes} add up to {sum(self.group_sizes)}, "
                f"but {len(self.block_ids)} block ids were given"
            )
        # Python's modulo would turn -1 into a valid-looking skip of factor - 1 pages.
        self.block_indices = (
            None
            if block_indices is None
            else _whole_numbers("block_indices", block_indices, "positions within a request")
        )
        if self.block_indices is not None and len(self.block_indices) != len(self.group_sizes):
            raise InvalidArgumentError(
                f"block_indices has {len(self.block_indices)} entries for "
                f"{len(self.group_sizes)} groups"
            )

    @staticmethod
    def medium() -> str:
        return "GPU"

    def __repr__(self) -> str:
        return (
            f"GPULoadStoreSpec({self.block_ids.tolist()}, group_sizes={self.group_sizes}, "
            f"block_indices={self.block_indices})"
        )


def _whole_numbers(name: str, values: Iterable[int], meaning: str) -> tuple[int, ...]:
    """``values`` as a tuple of ints >= 0 (any integer type: vLLM's may be NumPy's), or
    :class:`InvalidArgumentError` naming ``name``: a negative group size that the sum still
    matched, a float or ``True`` taken as a position, or no sequence at all were accepted,
    or a ``TypeError`` from deep inside."""
    try:
        numbers = tuple(-1 if isinstance(v, bool) else operator.index(v) for v in values)
    except TypeError:
        numbers = (-1,)
    if any(n < 0 for n in numbers):
        raise InvalidArgumentError(f"{name} are {meaning}, integers >= 0, got {values!r}")
    return numbers


_INT64 = np.iinfo(np.int64)
"""The range of a spec's block ids: int64, the index type of the copies."""


def _int_ids(ids: Sequence[int] | npt.ArrayLike) -> npt.NDArray[np.int64]:
    """``ids`` as a flat int64 array, refusing anything but integers: a cast alone
    would truncate ``1.7`` (or ``True``) to block 1 and move bytes into it. Unsigned ids
    past int64 are refused here, by their value: the cast would wrap them negative, and
    the data plane's range error would show the wrapped ids."""
    raw = np.asarray(ids)
    if raw.ndim == 0:  # a set, a dict or a number: NumPy's "object of shape ()" named nothing
        raise InvalidArgumentError(
            f"block ids must be a flat sequence of integers, got {type(ids).__name__} {ids!r}"
        )
    if raw.ndim != 1 or (raw.size and raw.dtype.kind not in "iu"):
        _refuse_out_of_range(ids)
        raise InvalidArgumentError(
            f"block ids must be a flat sequence of integers, got {raw.dtype} of shape {raw.shape}"
        )
    if raw.dtype.kind == "u" and raw.size and raw.max() > _INT64.max:
        _refuse_out_of_range(raw.tolist())
    return raw.astype(np.int64, copy=False)


def _refuse_out_of_range(ids: object) -> None:
    """:class:`InvalidArgumentError` showing the ids past int64, if ``ids`` is a list or
    tuple of ints with some (NumPy makes such a list uint64, float64 or object)."""
    if not isinstance(ids, list | tuple):
        return
    if all(type(i) is int for i in ids):
        beyond = [i for i in ids if not _INT64.min <= i <= _INT64.max]
        if beyond:
            raise InvalidArgumentError(f"block ids must fit in int64, got {beyond}")


TransferSpec = tuple[LoadStoreSpec, LoadStoreSpec]
"""A (source, destination) pair."""

TransferType = tuple[str, str]
"""A (source medium, destination medium) pair."""
