"""The CPU block store's slots as bytes, for tiers that write them out and read them back.

A slot is one contiguous byte range of the store (see :mod:`.cpu_store`), so
a snapshot is one copy, and a tier reads straight into a slot's view.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.dataplane.cpu_store import CPUBlockStore


class StoreSlotBytes:
    """:class:`~kvoffload.core.tier_protocol.SlotBytes` over a :class:`CPUBlockStore`."""

    def __init__(self, store: CPUBlockStore) -> None:
        self._slots = store.data.numpy().reshape(store.num_blocks, -1)

    @property
    def slot_bytes(self) -> int:
        return int(self._slots.shape[1])

    def snapshot(self, slots: Sequence[int]) -> list[bytes]:
        count = len(self._slots)
        for slot in slots:
            # numpy would read slot -1 as the last one, another block's bytes.
            if not 0 <= slot < count:
                raise InvalidArgumentError(f"no CPU slot {slot}; the store has {count}")
        return [self._slots[slot].tobytes() for slot in slots]

    def view(self, slot: int) -> memoryview:
        if not 0 <= slot < len(self._slots):
            raise InvalidArgumentError(f"no CPU slot {slot}; the store has {len(self._slots)}")
        return memoryview(self._slots[slot])

    def landed(self, slots: Sequence[int], intact: Sequence[bool]) -> None:
        """Nothing to do: tiers read straight into the slots."""
