"""CPU slot bytes in a plain bytearray (a CPU tier's memory, without torch); a disk byte flipper;
the shared tier's fault tests' store, read-back and stall guard."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from kvoffload import OffloadKey
from kvoffload.core.layout import layout_preset
from kvoffload.tiers import DiskTier, RemoteTier, layout_fingerprint

STALL_S = 20.0
"""Longer than any deadline in the tier tests by far: reaching it means the call stalled."""
SMALL_BLOCK = 32


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


def tiny_fingerprint(name: str, size: int = SMALL_BLOCK) -> bytes:
    """The fingerprint of model ``name``'s blocks of ``size`` bytes in the tiny layout."""
    return layout_fingerprint(name, layout_preset("tiny"), size)


def finishes(call: Callable[[], object]) -> object:
    """``call()`` in a thread; fails the test if it has not returned within STALL_S."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(STALL_S)
    assert not thread.is_alive(), "the call stalled"
    return result[0]


def remote_read(tier: RemoteTier, keys: list[OffloadKey], size: int = SMALL_BLOCK) -> list[bool]:
    """Which keys loaded; every one that did holds its own bytes."""
    buffers = [bytearray(size) for _ in keys]
    ok = tier.read(keys, lambda i: memoryview(buffers[i])).result(timeout=STALL_S)
    assert all(bytes(buffers[i]) == content(k, size) for i, k in enumerate(keys) if ok[i])
    return ok


def remote_store(tier: RemoteTier, keys: list[OffloadKey], size: int = SMALL_BLOCK) -> None:
    """Write ``keys`` with their own bytes and wait until the tier has them (or failed)."""
    tier.write(keys, [content(key, size) for key in keys])
    tier.poll(wait=True)


def remote_preload(
    url: str, fingerprint: bytes, keys: list[OffloadKey], size: int = SMALL_BLOCK
) -> None:
    """Write ``keys`` through a tier of their own at ``url`` (the generous test deadline)
    and check that all landed: a test's short deadline is for what it tests, and its
    set-up may outlast it on a loaded machine."""
    writer = RemoteTier(url, fingerprint)
    try:
        remote_store(writer, keys, size)
        assert writer.stats.stored_blocks == len(keys), writer.stats
    finally:
        writer.close()


def pins_of(loads: Iterable[Sequence[OffloadKey]]) -> Counter[OffloadKey]:
    """How many of the loads in flight pin each key (a key listed twice in one, twice)."""
    return Counter(key for keys in loads for key in keys)
