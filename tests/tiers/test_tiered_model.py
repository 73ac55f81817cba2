"""Model-based test of the stack: the engine's calls in any order, invariants after each step.

Beside the manager runs a model of what the engine holds (pins, stores in
flight, failed stores) and a replay of every event. After every step:
``lookup`` answers the CPU tier's ready prefix or ``None`` only while a
promotion runs; the CPU and disk tiers stay within capacity; a ``None`` from
``prepare_store`` changes nothing; no slot is pending without an owner;
events replay to exactly what each tier holds; and a block the CPU tier
evicted is on disk unless the disk evicted it or had no room (nothing lost).
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from tier_helpers import pins_of

from kvoffload import BlockStateError, CPUOffloadingManager, OffloadKey, block_id_key
from kvoffload.core.layout import layout_preset
from kvoffload.core.tier_protocol import LowerTier
from kvoffload.managers.tiered import TieredOffloadingManager, TierSettings
from kvoffload.policies import PENDING_STORE
from kvoffload.tiers import DiskTier, RemoteTier, layout_fingerprint
from tier_servers import ValkeyProcess

UNIVERSE = [block_id_key(i) for i in range(6)]
KEY_LISTS = st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=5)
FP = layout_fingerprint("model", layout_preset("tiny"), 0)


class StackMachine(RuleBasedStateMachine):
    wait_for_tiers = True
    with_remote = False
    disk_admission = "none"

    @initialize(
        cpu=st.integers(1, 3), disk=st.integers(1, 4), policy=st.sampled_from(["lru", "arc"])
    )
    def setup(self, cpu: int, disk: int, policy: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvoffload-model-"))
        self.cpu_capacity, self.disk_capacity = cpu, disk
        self.disk = DiskTier(self.dir, disk, FP, policy, enable_events=True)
        disk_settings = TierSettings(admission=self.disk_admission, capacity=disk)
        tiers: list[tuple[LowerTier, TierSettings]] = [(self.disk, disk_settings)]
        self.remote: RemoteTier | None = None
        if self.with_remote:
            fingerprint = layout_fingerprint(f"model-{next(RUNS)}", layout_preset("tiny"), 0)
            self.remote = RemoteTier(SERVER["url"], fingerprint, enable_events=True)
            tiers.append((self.remote, TierSettings(write_through=True)))
        self.m = TieredOffloadingManager(
            CPUOffloadingManager(cpu, policy, enable_events=True),
            tiers,
            wait_for_tiers=self.wait_for_tiers,
        )
        self.remote_events: set[OffloadKey] = set()
        self.stored: set[OffloadKey] = set()
        self.loads: list[list[OffloadKey]] = []
        self.stores: list[list[OffloadKey]] = []
        self.cpu_events: set[OffloadKey] = set()
        self.disk_events: set[OffloadKey] = set()
        self.fell: set[OffloadKey] = set()  # evicted from the CPU, not since dropped by the disk

    def teardown(self) -> None:
        if hasattr(self, "m"):
            if self.remote is not None:
                self.remote.poll(wait=True)
                self.remote.delete_all()
            self.m.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def ready_run(self, keys: list[OffloadKey]) -> int:
        run = 0
        for key in keys:
            block = self.m.cpu.block_status(key)
            if block is None or block.ref_cnt < 0:
                break
            run += 1
        return run

    @rule(keys=KEY_LISTS, load=st.booleans())
    def lookup(self, keys: list[OffloadKey], load: bool) -> None:
        self.m.touch(keys)
        before = self.m.promotions_in_flight
        found = self.m.lookup(keys)
        if found is None:
            assert self.m.promotions_in_flight > 0 or before > 0
            self.settle()
            return
        assert found == self.ready_run(keys)
        if load and found:
            self.m.prepare_load(keys[:found])
            self.loads.append(keys[:found])
        self.settle()

    @precondition(lambda self: self.loads)
    @rule(data=st.data())
    def finish_load(self, data: st.DataObject) -> None:
        self.m.complete_load(self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1))))

    @rule(keys=KEY_LISTS)
    def prepare_store(self, keys: list[OffloadKey]) -> None:
        self.m.poll()
        before = self.snapshot()
        admitted = self.m.admitted_blocks[0]
        output = self.m.prepare_store(keys)
        if output is None:
            assert self.snapshot() == before
            return
        assert set(output.keys_to_store).isdisjoint(output.evicted_keys)
        assert set(output.evicted_keys).isdisjoint(keys)
        # Evicted blocks the disk's own layer held back were never meant to reach it.
        if self.m.admitted_blocks[0] - admitted == len(output.evicted_keys):
            self.fell.update(output.evicted_keys)
        if output.keys_to_store:
            self.stores.append(output.keys_to_store)
        self.settle()

    @precondition(lambda self: self.stores)
    @rule(data=st.data(), success=st.booleans())
    def finish_store(self, data: st.DataObject, success: bool) -> None:
        keys = self.stores.pop(data.draw(st.integers(0, len(self.stores) - 1)))
        self.m.complete_store(keys, success)
        if success:
            self.stored.update(keys)
        self.settle()

    @rule(keys=st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=3), ok=st.booleans())
    def serve_a_request(self, keys: list[OffloadKey], ok: bool) -> None:
        """A request's round as an engine drives it: looked up (again once a promotion has
        landed), its hit loaded, the rest offered and written (or failed). Random calls
        alone promoted one block in a run of 50 examples: offers mostly outgrew the CPU
        tier and were refused, so few blocks were evicted to the disk and read back."""
        loads = len(self.loads)
        self.lookup(keys, load=True)
        if self.m.promotions_in_flight:
            self.lookup(keys, load=True)
        while len(self.loads) > loads:
            self.m.complete_load(self.loads.pop())
        stores = len(self.stores)
        self.prepare_store(keys)
        if len(self.stores) > stores:
            written = self.stores.pop()
            self.m.complete_store(written, ok)
            if ok:
                self.stored.update(written)
            self.settle()

    @rule(key=st.sampled_from(UNIVERSE))
    def a_load_nobody_started_changes_nothing(self, key: OffloadKey) -> None:
        """Not even the pin a reservation holds for a caller that has yet to ask again."""
        if any(key in keys for keys in self.loads):
            return
        self.m.poll()  # a promotion that has finished lands, reserved for its caller
        before = self.snapshot(), self.m.is_reserved(key)
        with pytest.raises(BlockStateError):
            self.m.complete_load([key])
        assert (self.snapshot(), self.m.is_reserved(key)) == before

    def settle(self) -> None:
        """Let the I/O in flight finish without applying it: the next call applies it.

        The asynchronous path is taken (finished work found by ``done()``), yet
        every run of an example behaves alike, as Hypothesis needs to replay it.
        """
        if self.wait_for_tiers:
            return
        for promotion in self.m._promotions:
            promotion.result.exception()
        for tier in self.m.tiers:
            for _, job in tier._writes:  # type: ignore[attr-defined]
                job.exception()

    def snapshot(self) -> object:
        cpu = {k: (b.block_id, b.ref_cnt) for k, b in self.m.cpu._blocks.items()}
        disk = {k: b.ref_cnt for k, b in self.disk._index._blocks.items()}
        return cpu, disk, self.m.promotions_in_flight

    @invariant()
    def capacities_hold(self) -> None:
        if hasattr(self, "m"):
            assert len(self.m.cpu._blocks) <= self.cpu_capacity
            assert len(self.disk) <= self.disk_capacity

    @invariant()
    def pins_and_pending_blocks_have_owners(self) -> None:
        if not hasattr(self, "m"):
            return
        pins = pins_of(self.loads)
        in_flight = {key for keys in self.stores for key in keys}
        for key, block in self.m.cpu._blocks.items():
            if block.ref_cnt == PENDING_STORE:
                assert key in in_flight or self.m.promotions_in_flight
            else:
                # A landed promotion not yet claimed by a lookup holds one pin of its own.
                assert block.ref_cnt == pins.get(key, 0) + self.m.is_reserved(key)

    @invariant()
    def events_replay_to_the_tiers_and_nothing_is_lost(self) -> None:
        if not hasattr(self, "m"):
            return
        self.m.poll()
        for event in self.m.take_events():
            if event.medium == "REMOTE":
                assert not event.removed
                self.remote_events.update(event.keys)
                continue
            target = self.cpu_events if event.medium == "CPU" else self.disk_events
            assert event.medium in ("CPU", "DISK")
            if event.removed:
                target.difference_update(event.keys)
                if event.medium == "DISK":
                    self.fell.difference_update(event.keys)
            else:
                target.update(event.keys)
        ready_cpu = {k for k, b in self.m.cpu._blocks.items() if b.ref_cnt >= 0}
        ready_disk = {k for k, b in self.disk._index._blocks.items() if b.ref_cnt >= 0}
        assert self.cpu_events == ready_cpu
        assert self.disk_events == ready_disk
        if not self.disk.stats.rejected:  # on disk, or being written there
            assert self.fell <= set(self.disk._index._blocks) | ready_cpu
        if self.remote is not None:  # write-through: exactly what completed its CPU store
            self.remote.poll(wait=True)
            self.m.poll()
            for event in self.m.take_events():
                if event.medium == "REMOTE":
                    self.remote_events.update(event.keys)
            assert self.remote_events <= self.stored
            assert all(self.remote.present([key]) for key in self.remote_events)


class AsyncStackMachine(StackMachine):
    """The same calls while promotions and disk writes finish on their own time."""

    wait_for_tiers = False


class AdmittingStackMachine(StackMachine):
    """The same calls with the disk tier behind its own admission layer: every invariant
    holds, and what the layer admitted is not lost."""

    disk_admission = "feedback"


class RemoteStackMachine(StackMachine):
    """CPU, disk (write-back) and the shared tier (write-through) on a real server."""

    with_remote = True


RUNS = itertools.count()
SERVER: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _server_url(valkey_server: ValkeyProcess) -> None:
    SERVER["url"] = valkey_server.url


SETTINGS = settings(max_examples=50, stateful_step_count=30, deadline=None)
StackMachine.TestCase.settings = SETTINGS
AsyncStackMachine.TestCase.settings = SETTINGS
AdmittingStackMachine.TestCase.settings = settings(SETTINGS, max_examples=30)
RemoteStackMachine.TestCase.settings = settings(SETTINGS, max_examples=30)
TestStack = StackMachine.TestCase
TestAsyncStack = AsyncStackMachine.TestCase
TestAdmittingStack = AdmittingStackMachine.TestCase
TestRemoteStack = RemoteStackMachine.TestCase
