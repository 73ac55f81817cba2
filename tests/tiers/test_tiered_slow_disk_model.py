"""Model-based test of the stack over a slow, failing disk: its I/O stays in flight across
the engine's calls until the test lets the disk catch up.

The other stack models let every read and write finish before the next call; here a
promotion or a demotion's write may still run while other requests look up, load, store
and evict around it, and the disk may fail any of its reads and writes (EIO) or a block
on it rot (its read fails, and the tier removes it) on the way.
The disk is the real tier on a temporary directory; only its file calls are held (a gate
in the tier's own :class:`~kvoffload.tiers.slot_file.FileLayer`) or failed.

Beside the stack runs what the engine knows: its loads and stores in flight, and each
block's bytes (derived from its key). After every step: every block the CPU tier holds
ready has its own bytes, so a hit loads exactly what was stored (a block is loaded with
the right bytes or reported missing, never wrong bytes); a loaded block keeps its slot
and bytes until its load completes (never evicted while loaded); reference counts are
the loads in flight plus the reservations (never negative, nothing leaked); a pending
slot is a store or a promotion in flight; and replaying the CPU and disk events gives
exactly what each tier holds. Once the disk catches up, every lookup is answered.
"""

from __future__ import annotations

import errno
import itertools
import shutil
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from tier_helpers import ByteSlots, content, flip_byte, pins_of

from kvoffload import CPUOffloadingManager, OffloadKey, block_id_key
from kvoffload.core.layout import layout_preset
from kvoffload.core.manager import OffloadingEvent
from kvoffload.core.specs import CPULoadStoreSpec
from kvoffload.managers.tiered import TieredOffloadingManager, TierSettings
from kvoffload.policies import PENDING_STORE, available_policies
from kvoffload.tiers import DiskTier, layout_fingerprint
from kvoffload.tiers.format import HEADER_BYTES
from kvoffload.tiers.slot_file import FileLayer

SIZE = 48
UNIVERSE = [block_id_key(i) for i in range(7)]
PROMPTS = [UNIVERSE[:4], UNIVERSE[:2] + UNIVERSE[4:6], [UNIVERSE[6], UNIVERSE[2]]]
"""Requests' block chains: shared prefixes, as a prefix cache sees them."""
KEY_LISTS = st.builds(
    lambda prompt, start, length: prompt[start : start + length] or prompt[-1:],
    st.sampled_from(PROMPTS),
    st.integers(0, 3),
    st.integers(1, 4),
) | st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=5)
"""Mostly requests' chains; now and then any keys, a key listed twice included."""
GARBAGE = b"\xee" * SIZE
RUNS = itertools.count()


class SlowDisk(FileLayer):
    """File calls of the tier's I/O threads wait while :attr:`gate` is clear (a disk that
    has not answered yet), then the next :attr:`failures` of them fail with EIO. The gate
    is clear but while the test lets the disk catch up, so whether a read or write has
    finished never depends on the threads' timing, as Hypothesis needs to replay a run.

    Only the calls made before a read lands in its target or a write's bytes reach the
    file are held, so a held read never holds the lock its job's deadline takes."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.failures = 0

    def _check(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            self.gate.wait()
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EIO, "injected I/O error")

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        self._check()
        return super().pread(fd, size, offset)

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        self._check()
        return super().pwrite(fd, data, offset)

    def pwritev(self, fd: int, buffers: Sequence[bytes | memoryview], offset: int) -> int:
        self._check()
        return super().pwritev(fd, buffers, offset)


class SlowDiskStackMachine(RuleBasedStateMachine):
    @initialize(
        cpu=st.integers(1, 4),
        disk=st.integers(1, 6),
        policy=st.sampled_from(sorted(available_policies())),
        write_through=st.booleans(),
        reserve_lookups=st.integers(1, 4),
    )
    def setup(
        self,
        cpu: int,
        disk: int,
        policy: str,
        write_through: bool,
        reserve_lookups: int,
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvoffload-slow-disk-"))
        self.cpu_capacity, self.disk_capacity = cpu, disk
        self.policy = policy
        self.tier_settings = TierSettings(write_through=write_through)
        self.reserve_lookups = reserve_lookups
        self.fingerprint = layout_fingerprint(f"slow-{next(RUNS)}", layout_preset("tiny"), SIZE)
        self.layer = SlowDisk()
        self.slots = ByteSlots(cpu, SIZE)
        self.rotten: set[OffloadKey] = set()
        """Blocks a byte of which flipped on disk (perhaps rewritten whole since)."""
        self.open()

    def open(self) -> None:
        """Start the stack (again) on the same directory; nothing in flight."""
        self.slots.data[:] = b"\xdd" * len(self.slots.data)  # a new process's memory
        self.layer.gate.set()  # the tier opens its file on its own threads
        self.disk = DiskTier(
            self.dir,
            self.disk_capacity,
            self.fingerprint,
            self.policy,
            io_threads=1,  # the injected failures hit the same calls in every run
            enable_events=True,
            deadline_s=600.0,  # slow, never late: a gate held past a deadline is another test
            file_layer=self.layer,
        )
        self.layer.gate.clear()
        self.m = TieredOffloadingManager(
            CPUOffloadingManager(self.cpu_capacity, self.policy, enable_events=True),
            [(self.disk, self.tier_settings)],
            self.slots,
            reserve_lookups=self.reserve_lookups,
        )
        self.loads: list[list[OffloadKey]] = []
        self.stores: list[tuple[list[OffloadKey], list[int]]] = []
        self.parked: list[tuple[list[OffloadKey], bool, str]] = []
        self.cpu_events: set[OffloadKey] = set()
        self.disk_events: set[OffloadKey] = set()
        self.replay(self.m.take_events())
        assert self.disk_events == set(self.disk._index._blocks)  # the blocks found on start

    def teardown(self) -> None:
        if hasattr(self, "m"):
            self.layer.failures = 0
            self.layer.gate.set()
            self.m.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def ready_run(self, keys: list[OffloadKey]) -> int:
        run = 0
        while run < len(keys):
            block = self.m.cpu.block_status(keys[run])
            if block is None or block.ref_cnt < 0:
                break
            run += 1
        return run

    @rule(
        keys=KEY_LISTS,
        load=st.booleans(),
        outcome=st.sampled_from(["lands", "lands", "fails", "in flight"]),
        on_none=st.sampled_from(["comes back later", "is aborted"]),
    )
    def request(self, keys: list[OffloadKey], load: bool, outcome: str, on_none: str) -> None:
        """A request as the connector serves it: look up, load the hits, store the rest; a
        ``None`` parks it (the disk is slow: asking again at once would get ``None`` again)
        or it is aborted."""
        self.serve(keys, load, outcome, on_none)

    @precondition(lambda self: self.parked)
    @rule(data=st.data())
    def come_back(self, data: st.DataObject) -> None:
        keys, load, outcome = self.parked.pop(data.draw(st.integers(0, len(self.parked) - 1)))
        self.serve(keys, load, outcome, "comes back later")

    def serve(self, keys: list[OffloadKey], load: bool, outcome: str, on_none: str) -> None:
        self.m.touch(keys)
        found = self.m.lookup(keys)
        if found is None:
            assert self.m.promotions_in_flight > 0
            if on_none == "comes back later":
                self.parked.append((keys, load, outcome))
            return
        assert found == self.ready_run(keys)
        if load and found:
            spec = self.m.prepare_load(keys[:found])
            assert isinstance(spec, CPULoadStoreSpec)
            for key, slot in zip(keys[:found], spec.block_ids.tolist(), strict=True):
                assert bytes(self.slots.view(slot)) == content(key, SIZE), key
            self.loads.append(keys[:found])
        if found < len(keys):
            self.store(keys[found:], outcome)

    def store(self, keys: list[OffloadKey], outcome: str) -> None:
        held = {key for key in keys if self.m.holds(key)}
        output = self.m.prepare_store(keys)
        if output is None:
            return
        assert held.isdisjoint(output.keys_to_store)
        assert set(output.evicted_keys).isdisjoint(keys)
        for keys_loading in self.loads:
            assert set(output.evicted_keys).isdisjoint(keys_loading)
        if output.keys_to_store:
            assert isinstance(output.store_spec, CPULoadStoreSpec)
            ids = output.store_spec.block_ids.tolist()
            for slot in ids:  # the transfer into the slot has not landed yet
                self.slots.view(slot)[:] = GARBAGE
            self.stores.append((output.keys_to_store, ids))
            if outcome != "in flight":
                self.finish(len(self.stores) - 1, outcome == "lands")

    def finish(self, index: int, success: bool) -> None:
        keys, ids = self.stores.pop(index)
        if success:
            for key, slot in zip(keys, ids, strict=True):
                self.slots.view(slot)[:] = content(key, SIZE)
        self.m.complete_store(keys, success)

    @precondition(lambda self: self.stores)
    @rule(data=st.data(), success=st.booleans())
    def finish_store(self, data: st.DataObject, success: bool) -> None:
        self.finish(data.draw(st.integers(0, len(self.stores) - 1)), success)

    @precondition(lambda self: self.loads)
    @rule(data=st.data())
    def finish_load(self, data: st.DataObject) -> None:
        """The load's transfer ends: its blocks kept their slots and bytes meanwhile."""
        keys = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        for key in keys:
            block = self.m.cpu.block_status(key)
            assert block is not None and block.ref_cnt > 0, key
            assert bytes(self.slots.view(block.block_id)) == content(key, SIZE), key
        self.m.complete_load(keys)

    @rule(failures=st.integers(1, 3))
    def disk_fails(self, failures: int) -> None:
        """The disk's next ``failures`` calls, those already made and waiting included,
        fail."""
        self.layer.failures = failures

    def whole_on_disk(self) -> list[OffloadKey]:
        return sorted(
            key
            for key, block in self.disk._index._blocks.items()
            if block.ref_cnt >= 0 and key not in self.rotten
        )

    @precondition(lambda self: self.whole_on_disk())
    @rule(data=st.data(), spot=st.integers(0, 2**16))
    def a_block_on_disk_rots(self, data: st.DataObject, spot: int) -> None:
        """A byte (header, key or payload) of a block whole on disk flips, perhaps under a
        promotion's read held in flight: the read fails rather than land it, and the tier
        removes the block, announced, at its next poll."""
        key = data.draw(st.sampled_from(self.whole_on_disk()))
        flip_byte(self.disk, key, spot % (HEADER_BYTES + len(key) + SIZE))
        self.rotten.add(key)

    @rule()
    def disk_catches_up(self) -> None:
        """Every call the disk holds finishes: the next call of the stack finds the work
        done (finished work is applied by the stack's calls, not here)."""
        self.catch_up()

    def catch_up(self) -> None:
        """Let the disk answer every call made so far, then hold the next ones again."""
        self.layer.gate.set()
        for promotion in self.m._promotions:
            promotion.result.exception()
        for _, job in self.disk._writes:
            job.exception()
        self.layer.gate.clear()

    @precondition(lambda self: self.parked)
    @rule()
    def parked_requests_are_answered_once_the_disk_answers(self) -> None:
        """Every request asking again, the disk keeping up, gets an answer (``None`` means a
        promotion in flight, and each promotion lands)."""
        self.catch_up()
        self.layer.failures = 0
        while self.parked:
            keys, _, _ = self.parked.pop(0)
            for _ in range(len(keys) + 1):
                self.m.touch(keys)
                found = self.m.lookup(keys)
                if found is not None:
                    break
                self.catch_up()
            assert found is not None, "a retried lookup waits forever"
            assert found == self.ready_run(keys)

    @rule()
    def poll(self) -> None:
        self.m.poll()

    @rule(wipe=st.booleans())
    def restart(self, wipe: bool) -> None:
        """The engine stops, its promotions and writes still in flight (a reset empties the
        disk), and starts again on the same directory: every whole block that was on disk,
        written or promoted meanwhile, is found again."""
        self.layer.gate.set()  # closing waits for the disk
        self.layer.failures = 0  # a failing start is the disk tier's own tests'
        self.disk.empty_on_close = wipe
        self.m.close()
        assert not self.m.promotions_in_flight and not self.m._reserved
        self.replay(self.m.take_events())
        kept = {k for k, b in self.disk._index._blocks.items() if b.ref_cnt >= 0}
        assert self.disk_events == kept
        self.open()
        if wipe:
            assert not self.disk_events
        else:  # more is possible: a block evicted whose slot's next write failed is whole
            assert kept - self.rotten <= self.disk_events

    def replay(self, events: list[OffloadingEvent]) -> None:
        replayed = {"CPU": self.cpu_events, "DISK": self.disk_events}
        for event in events:
            target = replayed[event.medium]
            if event.removed:
                target.difference_update(event.keys)
            else:
                target.update(event.keys)

    @invariant()
    def capacities_hold(self) -> None:
        if hasattr(self, "m"):
            assert len(self.m.cpu._blocks) <= self.cpu_capacity
            assert len(self.disk) <= self.disk_capacity

    @invariant()
    def ready_blocks_hold_their_own_bytes(self) -> None:
        if hasattr(self, "m"):
            for key, block in self.m.cpu._blocks.items():
                if block.ref_cnt >= 0:
                    assert bytes(self.slots.view(block.block_id)) == content(key, SIZE), key

    @invariant()
    def pins_are_the_loads_in_flight_and_the_reservations(self) -> None:
        if not hasattr(self, "m"):
            return
        pins = pins_of(self.loads)
        in_flight = {key for keys, _ in self.stores for key in keys}
        for key, block in self.m.cpu._blocks.items():
            assert block.ref_cnt >= PENDING_STORE
            if block.ref_cnt == PENDING_STORE:
                assert (key in in_flight) != self.m.is_promoting(key), key
                assert not self.m.is_reserved(key)
            else:
                assert not self.m.is_promoting(key)
                assert block.ref_cnt == pins.get(key, 0) + self.m.is_reserved(key), key
        assert all(self.m.holds(key) for key in self.m._reserved)

    @invariant()
    def events_replay_to_the_tiers(self) -> None:
        if not hasattr(self, "m"):
            return
        self.replay(self.m.take_events())
        assert self.cpu_events == {k for k, b in self.m.cpu._blocks.items() if b.ref_cnt >= 0}
        assert self.disk_events == {
            k for k, b in self.disk._index._blocks.items() if b.ref_cnt >= 0
        }


SlowDiskStackMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestSlowDiskStack = SlowDiskStackMachine.TestCase
