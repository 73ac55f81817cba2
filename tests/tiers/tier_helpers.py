"""CPU slot bytes in a plain bytearray (a CPU tier's memory, without torch); a disk byte flipper."""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload import OffloadKey
from kvoffload.tiers import DiskTier


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


def flip_byte(tier: DiskTier, key: bytes, offset: int) -> None:
    """Flip the byte at ``offset`` into ``key``'s slot in the tier's slot file."""
    start = tier.slot_offset(OffloadKey(key))
    assert start is not None, "the tier does not hold this key"
    with open(tier.path, "r+b") as file:
        file.seek(start + offset)
        byte = file.read(1)
        file.seek(start + offset)
        file.write(bytes([byte[0] ^ 0xFF]))
