"""The data plane's CPU slots as bytes: snapshots copy, views write in place."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvoffload.core.errors import InvalidArgumentError  # noqa: E402
from kvoffload.core.layout import layout_preset  # noqa: E402
from kvoffload.dataplane.cpu_store import CPUBlockStore  # noqa: E402
from kvoffload.dataplane.slot_bytes import StoreSlotBytes  # noqa: E402


def test_a_view_fills_one_slot_and_a_snapshot_outlives_it() -> None:
    store = CPUBlockStore(layout_preset("tiny").with_block_size(4), 3, pin_memory=False)
    store.data.zero_()
    slots = StoreSlotBytes(store)
    size = slots.slot_bytes
    assert size == store.slot_bytes
    slots.view(1)[:] = bytes(range(256)) * (size // 256) + bytes(size % 256)
    before = slots.snapshot([1, 2])
    assert before[0][:3] == b"\x00\x01\x02" and before[1] == bytes(size)
    assert store.block(1).flatten()[1].item() == 1 and store.block(0).sum().item() == 0
    slots.view(1)[:] = bytes(size)
    assert before[0][:3] == b"\x00\x01\x02"  # the snapshot was a copy
    with pytest.raises(InvalidArgumentError, match="no CPU slot 3"):
        slots.view(3)


@pytest.mark.parametrize("slot", [-1, 3])
def test_a_snapshot_of_a_slot_the_store_lacks_is_refused_naming_it(slot: int) -> None:
    """numpy would read slot -1 as the last slot (another block's bytes) and fail past the
    end with an IndexError of its own."""
    store = CPUBlockStore(layout_preset("tiny").with_block_size(4), 3, pin_memory=False)
    with pytest.raises(InvalidArgumentError, match=f"no CPU slot {slot}; the store has 3"):
        StoreSlotBytes(store).snapshot([0, slot])
