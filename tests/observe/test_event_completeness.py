"""A router that applies a tiered manager's events holds, per medium, what each tier serves.

After every call, the blocks announced stored and not removed since are exactly the
loadable ones: no store announced twice, no removal of a block never announced, across
stores that fail, promotions, evictions and broken disk blocks.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoffload import CPUOffloadingManager, block_id_key
from kvoffload.core.keys import OffloadKey
from kvoffload.managers.tiered import TieredOffloadingManager, TierSettings
from kvoffload.tiers.disk import DiskTier

SLOT = 64
ALL = [block_id_key(i) for i in range(12)]
keys = st.lists(st.sampled_from(ALL), min_size=1, max_size=4, unique=True)


class _Slots:
    """The CPU tier's slots as bytes, so that promotions and demotions move real payloads."""

    def __init__(self, n: int) -> None:
        self.buffer = bytearray(SLOT * n)

    def snapshot(self, slots: list[int]) -> list[bytes]:
        return [bytes(self.buffer[s * SLOT : (s + 1) * SLOT]) for s in slots]

    def view(self, slot: int) -> memoryview:
        return memoryview(self.buffer)[slot * SLOT : (slot + 1) * SLOT]

    def landed(self, slots: list[int], intact: list[bool]) -> None:
        pass


class EventsBesideTiers(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.mkdtemp()
        self.cpu = CPUOffloadingManager(4, enable_events=True)
        self.disk = DiskTier(self.directory, 6, b"f" * 16, enable_events=True)
        self.slots = _Slots(4)
        self.manager = TieredOffloadingManager(
            self.cpu, [(self.disk, TierSettings())], self.slots, wait_for_tiers=True
        )
        self.announced: dict[str, Counter[OffloadKey]] = {"CPU": Counter(), "DISK": Counter()}
        self.pending: list[list[OffloadKey]] = []

    @rule(ks=keys)
    def lookup_and_load(self, ks: list[OffloadKey]) -> None:
        hits = self.manager.lookup(ks)
        if hits:
            self.manager.prepare_load(ks[:hits])
            self.manager.complete_load(ks[:hits])

    @rule(ks=keys)
    def store(self, ks: list[OffloadKey]) -> None:
        output = self.manager.prepare_store(ks)
        if output is not None and output.keys_to_store:
            slots = output.store_spec.block_ids.tolist()
            for key, slot in zip(output.keys_to_store, slots, strict=True):
                self.slots.buffer[slot * SLOT : (slot + 1) * SLOT] = (key * SLOT)[:SLOT]
            self.pending.append(output.keys_to_store)

    @precondition(lambda self: bool(self.pending))
    @rule(success=st.booleans())
    def complete(self, success: bool) -> None:
        self.manager.complete_store(self.pending.pop(0), success)

    @rule(which=st.integers(0, 11))
    def break_on_disk(self, which: int) -> None:
        """Overwrite a disk block's slot: the next read of it finds it corrupt."""
        offset, stride = self.disk.slot_offset(ALL[which]), self.disk.stride
        if offset is not None and stride is not None:
            with open(self.disk.path, "r+b") as file:
                file.seek(offset)
                file.write(b"\xff" * stride)

    @invariant()
    def announced_is_loadable(self) -> None:
        self.manager.poll()
        for event in self.manager.take_events():
            announced = self.announced[event.medium]
            for key in event.keys:
                if event.removed:
                    assert announced[key] == 1, f"{key!r} removed, not announced"
                    del announced[key]
                else:
                    assert announced[key] == 0, f"{key!r} announced twice"
                    announced[key] = 1
        on_cpu = {key for key in ALL if (block := self.cpu.block_status(key)) and block.is_ready}
        on_disk = {key for key, held in zip(ALL, self.disk.held(ALL), strict=True) if held}
        assert set(self.announced["CPU"]) == on_cpu
        assert set(self.announced["DISK"]) == on_disk

    def teardown(self) -> None:
        self.manager.close()
        shutil.rmtree(self.directory)


EventsBesideTiers.TestCase.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None
)
TestEventsBesideTiers = EventsBesideTiers.TestCase
