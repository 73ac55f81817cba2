"""CPU slot bytes in a plain bytearray: what a CPU tier's memory is, without torch."""

from __future__ import annotations

from collections.abc import Sequence


class ByteSlots:
    """``num_slots`` slots of ``slot_bytes`` bytes (the :class:`SlotBytes` protocol)."""

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.data = bytearray(num_slots * slot_bytes)

    def view(self, slot: int) -> memoryview:
        return memoryview(self.data)[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]

    def snapshot(self, slots: Sequence[int]) -> list[bytes]:
        return [bytes(self.view(slot)) for slot in slots]

    def landed(self, slots: Sequence[int], intact: Sequence[bool]) -> None:
        """Reads go straight into the slots: nothing to finish."""


def content(key: bytes, size: int) -> bytes:
    """A block's bytes, derived from its key alone."""
    return (key * (size // len(key) + 1))[:size]
