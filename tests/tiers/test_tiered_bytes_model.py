"""Model-based test of the stack with real bytes: CPU slots, a disk tier that fails and
restarts, and the shared tier on a real server, each lower tier written back or through,
behind a threshold and an admission layer (the optimiser included).

The engine's side is modelled as vLLM's connector drives it: a store's slots hold
garbage until its transfer lands (then the block's own bytes, derived from its key), a
failed store leaves the garbage, loads pin until they complete, a lookup answered
``None`` is asked again at once, after other requests, or never. Now and then the disk
fails a few reads and writes (EIO), a block rots on disk or on the server, the server
forgets everything, the CPU slots cannot be copied, and the stack restarts on the same
directory (keeping the disk) or is reset (emptying it). After every step: every block
the CPU tier holds ready has its own bytes in its slot, so a hit loads exactly what was
stored; ``prepare_store`` never offers a key already held; pins are the loads in flight
plus the reservations (nothing negative, nothing leaked); capacities hold; and replaying
the CPU and disk events gives exactly what each tier holds, a restarted disk announcing
what it found.
"""

from __future__ import annotations

import errno
import itertools
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from tier_helpers import ByteSlots, content, flip_byte, pins_of

from kvoffload import CPUOffloadingManager, OffloadKey, block_id_key
from kvoffload.core.layout import layout_preset
from kvoffload.core.manager import OffloadingEvent
from kvoffload.core.specs import CPULoadStoreSpec
from kvoffload.core.tier_protocol import SlotBytesUnavailableError
from kvoffload.managers.tiered import TieredOffloadingManager, TierSettings
from kvoffload.policies import PENDING_STORE
from kvoffload.tiers import DiskTier, RemoteTier, layout_fingerprint
from kvoffload.tiers.format import HEADER_BYTES
from kvoffload.tiers.slot_file import FileLayer
from tier_servers import ValkeyProcess

SIZE = 64
UNIVERSE = [block_id_key(i) for i in range(7)]
PROMPTS = [UNIVERSE[:4], UNIVERSE[:2] + UNIVERSE[4:6], [UNIVERSE[6], UNIVERSE[2]]]
"""Requests' block chains: shared prefixes, as a prefix cache sees them."""
KEY_LISTS = st.builds(
    lambda prompt, start, length: prompt[start : start + length] or prompt[-1:],
    st.sampled_from(PROMPTS),
    st.integers(0, 3),
    st.integers(1, 3),
)
ADMISSIONS: list[tuple[str, float | None]] = [
    ("none", None),
    ("feedback", None),
    ("sketch", None),
    ("filter", None),
    ("optimiser", None),
    ("optimiser", 0.5),
]
"""Each admission layer, with the write budget it takes (only the optimiser takes one)."""
TIER_CHOICES = st.tuples(st.booleans(), st.sampled_from([0, 2]), st.sampled_from(ADMISSIONS))
"""A lower tier's write-through, store threshold, and admission."""
GARBAGE = b"\xee" * SIZE
REMOTE_BLOCKS = 4
CALLS_BEFORE_RESTART = 6
MISHAPS = st.sampled_from(
    [""] * 6
    + ["disk fails", "a block on disk rots", "a block on the server rots", "server forgets"]
    + ["slots unreachable"]
)


class FlakyDisk(FileLayer):
    """The next :attr:`failures` reads and writes of the slot file fail with EIO."""

    failures = 0

    def _check(self) -> None:
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EIO, "injected I/O error")

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        self._check()
        return super().pread(fd, size, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview | bytearray], offset: int) -> int:
        self._check()
        return super().preadv(fd, buffers, offset)

    def preadv_cached(self, fd: int, buffers: Sequence[memoryview | bytearray], offset: int) -> int:
        self._check()
        return super().preadv_cached(fd, buffers, offset)

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        self._check()
        return super().pwrite(fd, data, offset)

    def pwritev(self, fd: int, buffers: Sequence[bytes | memoryview], offset: int) -> int:
        self._check()
        return super().pwritev(fd, buffers, offset)


class GatedSlots(ByteSlots):
    """CPU slots whose copies cannot be taken while :attr:`reachable` is clear (a worker's
    buffer not mapped yet): the blocks evicted or written through then are not written."""

    reachable = True

    def snapshot(self, slots: Sequence[int]) -> list[bytes]:
        if not self.reachable:
            raise SlotBytesUnavailableError("not mapped")
        return super().snapshot(slots)


class BytesStackMachine(RuleBasedStateMachine):
    @initialize(
        cpu=st.integers(1, 4),
        disk=st.integers(1, 6),
        policy=st.sampled_from(["lru", "arc"]),
        tiers=st.lists(TIER_CHOICES, min_size=2, max_size=2),
        wait=st.booleans(),
        reserve_lookups=st.integers(1, 4),
    )
    def setup(
        self,
        cpu: int,
        disk: int,
        policy: str,
        tiers: list[tuple[bool, int, tuple[str, float | None]]],
        wait: bool,
        reserve_lookups: int,
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvoffload-bytes-model-"))
        self.cpu_capacity, self.disk_capacity, self.policy = cpu, disk, policy
        self.wait, self.reserve_lookups = wait, reserve_lookups
        self.settings = [
            TierSettings(
                write_through=through,
                store_threshold=threshold,
                admission=admission,
                write_budget=budget,
                capacity=capacity,
            )
            for capacity, (through, threshold, (admission, budget)) in zip(
                [disk, REMOTE_BLOCKS], tiers, strict=True
            )
        ]
        self.fingerprint = layout_fingerprint(f"bytes-{next(RUNS)}", layout_preset("tiny"), SIZE)
        self.layer = FlakyDisk()
        self.slots = GatedSlots(cpu, SIZE)
        self.stored: set[OffloadKey] = set()  # every key whose CPU store landed, ever
        self.rotten: set[OffloadKey] = set()  # flipped on disk, not written there since
        self.open()

    def open(self) -> None:
        """Start the stack (again) on the same directory and server; nothing in flight."""
        self.slots.data[:] = b"\xdd" * len(self.slots.data)  # a new process's memory
        self.disk = DiskTier(
            self.dir,
            self.disk_capacity,
            self.fingerprint,
            self.policy,
            io_threads=1,  # the injected failures hit the same calls in every run
            enable_events=True,
            file_layer=self.layer,
        )
        self.remote = RemoteTier(SERVER["server"].url, self.fingerprint, enable_events=True)
        self.m = TieredOffloadingManager(
            CPUOffloadingManager(self.cpu_capacity, self.policy, enable_events=True),
            list(zip([self.disk, self.remote], self.settings, strict=True)),
            self.slots,
            wait_for_tiers=self.wait,
            reserve_lookups=self.reserve_lookups,
        )
        self.calls = 0
        self.parked: list[tuple[list[OffloadKey], bool, str]] = []
        self.loads: list[list[OffloadKey]] = []
        self.stores: list[tuple[list[OffloadKey], list[int]]] = []
        self.cpu_events: set[OffloadKey] = set()
        self.disk_events: set[OffloadKey] = set()
        self.remote_events: set[OffloadKey] = set()
        self.replay(self.m.take_events())
        assert self.disk_events == set(self.disk._index._blocks)  # the blocks found on start

    def teardown(self) -> None:
        if hasattr(self, "m"):
            self.m.close()
            self.remote.delete_all()
            self.remote.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def ready(self, key: OffloadKey) -> bool:
        block = self.m.cpu.block_status(key)
        return block is not None and block.ref_cnt >= 0

    def slot_bytes(self, key: OffloadKey) -> bytes:
        block = self.m.cpu.block_status(key)
        assert block is not None
        return bytes(self.slots.view(block.block_id))

    @rule(
        keys=KEY_LISTS,
        load=st.booleans(),
        outcome=st.sampled_from(["lands", "lands", "fails", "in flight"]),
        mishap=MISHAPS,
        on_none=st.sampled_from(["asks again", "asks again", "comes back later", "is aborted"]),
        spot=st.integers(0, 2**16),
    )
    def request(
        self,
        keys: list[OffloadKey],
        load: bool,
        outcome: str,
        mishap: str,
        on_none: str,
        spot: int,
    ) -> None:
        """A request as the connector serves it: look up (while the answer is ``None``,
        again at once, after other requests, or never: aborted), load the hits, store the
        rest; first, now and then, something the engine does not do (a parameter, not a
        rule of its own, so that it stays rare)."""
        self.calls += 1
        if mishap == "disk fails":  # a block's read or write may take two calls
            self.layer.failures = 2
        elif mishap == "a block on disk rots":
            self.rot_on_disk(keys, spot)
        elif mishap == "a block on the server rots":
            self.rot_on_server(keys, spot)
        elif mishap == "server forgets":
            self.remote.poll(wait=True)
            self.remote.delete_all()
        self.slots.reachable = mishap != "slots unreachable"
        try:
            self.serve(keys, load, outcome, on_none)
        finally:
            self.slots.reachable = True
        self.settle()

    @precondition(lambda self: self.parked)
    @rule(data=st.data())
    def come_back(self, data: st.DataObject) -> None:
        """A request whose lookup answered ``None`` asks again, other requests served since."""
        keys, load, outcome = self.parked.pop(data.draw(st.integers(0, len(self.parked) - 1)))
        self.serve(keys, load, outcome, "asks again")
        self.settle()

    def serve(self, keys: list[OffloadKey], load: bool, outcome: str, on_none: str) -> None:
        self.m.touch(keys)
        found = self.m.lookup(keys)
        for _ in keys:
            if found is not None:
                break
            assert self.m.promotions_in_flight > 0
            self.settle()
            if on_none == "comes back later":
                self.parked.append((keys, load, outcome))
            if on_none != "asks again":
                return
            found = self.m.lookup(keys)
        assert found is not None, "a retried lookup waits forever"
        run = 0
        while run < len(keys) and self.ready(keys[run]):
            run += 1
        assert found == run
        if load and found:
            spec = self.m.prepare_load(keys[:found])
            assert isinstance(spec, CPULoadStoreSpec)
            for key, slot in zip(keys[:found], spec.block_ids.tolist(), strict=True):
                assert bytes(self.slots.view(slot)) == content(key, SIZE), key
            self.loads.append(keys[:found])
        if found < len(keys):
            self.store(keys[found:], outcome)

    def settle(self) -> None:
        """Let the I/O in flight finish without applying it: the next call applies it.

        Without ``wait_for_tiers`` the asynchronous path is taken (finished work found by
        ``done()``), yet every run of an example behaves alike, as Hypothesis needs."""
        if self.wait:
            return
        for promotion in self.m._promotions:
            promotion.result.exception()
        for _, job in self.disk._writes:
            job.exception()
        self.remote.poll(wait=True)

    @precondition(lambda self: self.loads)
    @rule(data=st.data())
    def finish_load(self, data: st.DataObject) -> None:
        self.m.complete_load(self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1))))

    def store(self, keys: list[OffloadKey], outcome: str) -> None:
        held = {key for key in keys if self.m.holds(key)}
        output = self.m.prepare_store(keys)
        if output is None:
            return
        assert held.isdisjoint(output.keys_to_store)
        assert len(set(output.keys_to_store)) == len(output.keys_to_store)
        if output.keys_to_store:
            assert isinstance(output.store_spec, CPULoadStoreSpec)
            ids = output.store_spec.block_ids.tolist()
            for slot in ids:  # the transfer into the slot has not landed yet
                self.slots.view(slot)[:] = GARBAGE
            self.stores.append((output.keys_to_store, ids))
            if outcome != "in flight":
                self.finish(len(self.stores) - 1, outcome == "lands")

    @precondition(lambda self: self.stores)
    @rule(data=st.data(), success=st.booleans())
    def finish_store(self, data: st.DataObject, success: bool) -> None:
        self.finish(data.draw(st.integers(0, len(self.stores) - 1)), success)
        self.settle()

    def finish(self, index: int, success: bool) -> None:
        keys, ids = self.stores.pop(index)
        if success:
            for key, slot in zip(keys, ids, strict=True):
                self.slots.view(slot)[:] = content(key, SIZE)
            self.stored.update(keys)
        self.m.complete_store(keys, success)

    def rot_on_disk(self, keys: list[OffloadKey], spot: int) -> None:
        """Flip a byte (header, key or payload) of the first of ``keys`` whole on disk: its
        read must fail, never land in a slot."""
        self.m.poll()
        for key, held in zip(keys, self.disk.held(keys), strict=True):
            if held and key not in self.rotten:
                flip_byte(self.disk, key, spot % (HEADER_BYTES + len(key) + SIZE))
                self.rotten.add(key)
                return

    def rot_on_server(self, keys: list[OffloadKey], spot: int) -> None:
        """Flip a byte of the first of ``keys`` the server holds."""
        self.remote.poll(wait=True)
        client = SERVER["server"].client()
        for key in keys:
            value = client.get(self.remote.name(key))
            if isinstance(value, bytes):
                rotten = bytearray(value)
                rotten[spot % len(rotten)] ^= 0x10
                client.set(self.remote.name(key), bytes(rotten))
                return

    @precondition(lambda self: self.calls >= CALLS_BEFORE_RESTART)
    @rule(wipe=st.booleans())
    def restart(self, wipe: bool) -> None:
        """The engine stops (a reset empties the disk) and starts again; its requests are gone.
        Not before a few calls, so that the tiers have something to keep."""
        self.layer.failures = 0
        self.disk.empty_on_close = wipe
        self.m.close()
        self.replay(self.m.take_events())
        whole = set(self.disk._index._blocks) - self.rotten
        self.remote.close()
        self.open()
        if wipe:
            assert not self.disk_events
        else:  # more is possible: a block evicted whose slot's next write failed is whole
            assert whole <= self.disk_events

    def replay(self, events: list[OffloadingEvent]) -> None:
        replayed = {"CPU": self.cpu_events, "DISK": self.disk_events, "REMOTE": self.remote_events}
        for event in events:
            target = replayed[event.medium]
            if event.removed:
                assert event.medium != "REMOTE"
                target.difference_update(event.keys)
            else:
                target.update(event.keys)
                if event.medium == "DISK":
                    self.rotten.difference_update(event.keys)

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
                    assert self.slot_bytes(key) == content(key, SIZE), key

    @invariant()
    def pins_are_the_loads_in_flight(self) -> None:
        if not hasattr(self, "m"):
            return
        pins = pins_of(self.loads)
        in_flight = {key for keys, _ in self.stores for key in keys}
        for key, block in self.m.cpu._blocks.items():
            if block.ref_cnt == PENDING_STORE:
                assert key in in_flight or self.m.promotions_in_flight
                assert not self.m.is_reserved(key)
            else:
                assert block.ref_cnt == pins.get(key, 0) + self.m.is_reserved(key)
        assert all(self.m.holds(key) for key in self.m._reserved)

    @invariant()
    def events_replay_to_the_tiers(self) -> None:
        if not hasattr(self, "m"):
            return
        self.m.poll()
        self.replay(self.m.take_events())
        assert self.cpu_events == {k for k, b in self.m.cpu._blocks.items() if b.ref_cnt >= 0}
        assert self.disk_events == {
            k for k, b in self.disk._index._blocks.items() if b.ref_cnt >= 0
        }
        assert self.remote_events <= self.stored


RUNS = itertools.count()
SERVER: dict[str, ValkeyProcess] = {}


@pytest.fixture(autouse=True)
def _server(valkey_server: ValkeyProcess) -> None:
    SERVER["server"] = valkey_server


BytesStackMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None
)
TestBytesStack = BytesStackMachine.TestCase
