"""The CPU block store's slots as bytes, for tiers that write them out and read them back.

A slot is one contiguous byte range of the store (see :mod:`.cpu_store`), so
a snapshot is one copy and a fill one copy, with no tensor per block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.dataplane.cpu_store import CPUBlockStore


class StoreSlotBytes:
    """:class:`~kvoffload.managers.tiered.SlotBytes` over a :class:`CPUBlockStore`."""

    def __init__(self, store: CPUBlockStore) -> None:
        self._slots = store.data.numpy().reshape(store.num_blocks, -1)

    @property
    def slot_bytes(self) -> int:
        return int(self._slots.shape[1])

    def snapshot(self, slots: Sequence[int]) -> list[bytes]:
        return [self._slots[slot].tobytes() for slot in slots]

    def write(self, slot: int, payload: memoryview) -> None:
        if len(payload) != self._slots.shape[1]:
            raise InvalidArgumentError(
                f"a CPU slot holds {self._slots.shape[1]} bytes, got a payload of {len(payload)}"
            )
        self._slots[slot] = np.frombuffer(payload, dtype=np.uint8)
