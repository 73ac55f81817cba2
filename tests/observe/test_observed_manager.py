"""ObservedManager changes no answer, and its counters add up to what the calls did."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvoffload import OffloadingEvent, block_id_key, build_manager
from kvoffload.managers.tiered import TieredOffloadingManager
from kvoffload.observe import ObservedManager, Observers
from kvoffload.sim.run import SimConfig, simulate
from kvoffload.sim.traces import read_trace
from kvoffload.sim.workload import Request, Workload

keys = st.lists(st.integers(0, 15), min_size=1, max_size=6, unique=True).map(
    lambda ids: [block_id_key(i) for i in ids]
)


class ObservedBesideBare(RuleBasedStateMachine):
    """The same calls on a bare manager and on an observed twin."""

    def __init__(self) -> None:
        super().__init__()
        self.bare = build_manager(6, "lru", 2, 32, enable_events=True)
        self.events: list[OffloadingEvent] = []
        self.observed = ObservedManager(
            build_manager(6, "lru", 2, 32, enable_events=True), 100, [self.events.extend]
        )
        self.pending: list[list[bytes]] = []
        self.model = {
            "offered": 0,
            "admitted": 0,
            "skipped": 0,
            "evicted": 0,
            "completed": 0,
            "failed": 0,
        }

    @rule(ks=keys)
    def lookup(self, ks: list[bytes]) -> None:
        assert self.observed.lookup(ks) == self.bare.lookup(ks)

    @rule(ks=keys)
    def store(self, ks: list[bytes]) -> None:
        ours, theirs = self.observed.prepare_store(ks), self.bare.prepare_store(ks)
        self.model["offered"] += len(ks)
        assert (ours is None) == (theirs is None)
        if ours is not None and theirs is not None:
            assert ours.keys_to_store == theirs.keys_to_store
            assert ours.evicted_keys == theirs.evicted_keys
            self.model["admitted"] += len(ours.keys_to_store)
            self.model["evicted"] += len(ours.evicted_keys)
            cpu = self.bare.backing  # type: ignore[attr-defined]
            self.model["skipped"] += sum(
                1 for k in ks if k not in ours.keys_to_store and not cpu.holds(k)
            )
            if ours.keys_to_store:
                self.pending.append(list(ours.keys_to_store))

    @rule(success=st.booleans())
    def complete(self, success: bool) -> None:
        if not self.pending:
            return
        done = self.pending.pop(0)
        self.observed.complete_store(done, success)
        self.bare.complete_store(done, success)
        self.model["completed" if success else "failed"] += len(done)

    @rule(ks=keys)
    def load(self, ks: list[bytes]) -> None:
        hits = self.bare.lookup(ks)
        assert self.observed.lookup(ks) == hits
        if hits:
            assert self.observed.prepare_load(ks[:hits]).block_ids.tolist() == (
                self.bare.prepare_load(ks[:hits]).block_ids.tolist()
            )
            self.observed.complete_load(ks[:hits])
            self.bare.complete_load(ks[:hits])

    @invariant()
    def counters_and_events_agree(self) -> None:
        c, m = self.observed.counters, self.model
        assert c.stores_skipped == m["skipped"]
        assert (c.stores_offered, c.stores_admitted, c.evictions) == (
            m["offered"],
            m["admitted"],
            m["evicted"],
        )
        assert (c.stores_completed, c.stores_failed) == (m["completed"], m["failed"])
        assert c.held_blocks == m["admitted"] - m["evicted"] - m["failed"]
        assert c.bytes_stored == 100 * m["completed"]
        assert list(self.observed.take_events()) == []
        theirs = list(self.bare.take_events())
        ours, self.events[:] = list(self.events), []
        assert [(e.keys, e.removed) for e in ours] == [(e.keys, e.removed) for e in theirs]


ObservedBesideBare.TestCase.settings = settings(max_examples=40, stateful_step_count=30)
TestObservedBesideBare = ObservedBesideBare.TestCase


@pytest.mark.parametrize(
    ("admission", "threshold", "disk"),
    [
        ("none", 0, False),
        ("none", 2, False),
        ("feedback", 0, False),
        ("sketch", 0, False),
        ("recommended", 0, False),
        ("recommended", 0, True),
    ],
)
def test_skipped_blocks_are_the_reports_for_every_admission(
    mooncake_trace: Path, tmp_path: Path, admission: str, threshold: int, disk: bool
) -> None:
    """Every admission layer's refusals reach ``stores_skipped``, not just the reuse filter's;
    with a disk tier too, whose promotions evict CPU blocks the engine stored (the report
    took them as still held, and undercounted)."""
    workload = read_trace(mooncake_trace)
    workload.requests = workload.requests[:1500]
    config = SimConfig(
        gpu_blocks=878,
        cpu_blocks=2196,
        bound=False,
        admission=admission,
        store_threshold=threshold,
        disk_dir=str(tmp_path / "disk") if disk else None,
        disk_blocks=4392 if disk else 0,
    )
    observed: list[ObservedManager] = []
    report = simulate(workload, config, observers=Observers(on_manager=[observed.append]))
    skipped = observed[0].counters.stores_skipped
    assert skipped == report.stores_skipped_by_admission
    assert (skipped > 0) == (admission != "none" or threshold > 0)


def test_a_subscriber_ends_with_what_each_tier_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Events a tiered manager makes in ``lookup`` (promotions, landed tier writes) reach the
    sinks in that step, and those of closing it at the end: the third request is served by
    promotion alone, the last one leaves demotions in flight when the run ends."""

    def request(at: float, ids: range) -> Request:
        return Request(at, len(ids) * 16, 1, [block_id_key(i) for i in ids])

    requests = [request(0, range(1, 21)), request(100, range(100, 140))]
    requests += [request(200, range(1, 21)), request(300, range(200, 240))]
    config = SimConfig(
        gpu_blocks=41, cpu_blocks=40, bound=False, disk_dir=str(tmp_path), disk_blocks=200
    )
    published: dict[str, Counter[bytes]] = {}

    def sink(events: list[OffloadingEvent]) -> None:
        for event in events:
            held = published.setdefault(event.medium, Counter())
            held.update({key: -1 if event.removed else 1 for key in event.keys})

    observed: list[ObservedManager] = []
    left_by_lookups: list[OffloadingEvent] = []

    def watch(manager: ObservedManager) -> None:
        observed.append(manager)
        lookup = manager.lookup

        def lookup_then_look(keys: list[bytes]) -> int | None:
            hits = lookup(keys)
            left_by_lookups.extend(manager.backing.take_events())
            return hits

        monkeypatch.setattr(manager, "lookup", lookup_then_look)

    report = simulate(
        Workload("w", 16, requests), config, observers=Observers(sinks=[sink], on_manager=[watch])
    )
    assert left_by_lookups == []
    assert report.tiers["disk"]["hit_blocks"] > 0
    tiered = observed[0].backing
    assert isinstance(tiered, TieredOffloadingManager)
    [disk] = tiered.tiers
    every_key = [key for r in requests for key in r.keys]
    on_disk = {key for key, held in zip(every_key, disk.held(every_key), strict=True) if held}
    cpu_ready = {key for key in every_key if tiered.cpu.lookup([key])}
    assert {key for key, n in published["CPU"].items() if n > 0} == cpu_ready
    assert {key for key, n in published[disk.medium].items() if n > 0} == on_disk
    assert list(tiered.take_events()) == []


def test_blocks_promoted_by_lookups_are_held_and_their_evictions_counted(tmp_path: Path) -> None:
    """A tiered manager places and evicts CPU blocks in ``lookup`` (promotions from disk),
    outside any ``prepare_store``: the gauge and the eviction count see them too."""

    def request(at: float, ids: range) -> Request:
        return Request(at, len(ids) * 16, 1, [block_id_key(i) for i in ids])

    config = SimConfig(
        gpu_blocks=41, cpu_blocks=50, bound=False, disk_dir=str(tmp_path), disk_blocks=200
    )
    # The first run leaves blocks 1..20 on disk (evicted from the CPU tier, written back).
    first = [request(0, range(1, 21))]
    first += [request(100 + j, range(100 + 40 * j, 140 + 40 * j)) for j in range(3)]
    simulate(Workload("w", 16, first), config)
    # The second fills the CPU tier, then finds them on disk: promoted, evicting for room.
    second = [request(0, range(300, 340)), request(100, range(1, 21))]
    observed: list[ObservedManager] = []
    report = simulate(
        Workload("w", 16, second), config, observers=Observers(on_manager=[observed.append])
    )
    assert report.tiers["disk"]["hit_blocks"] > 0
    tiered = observed[0].backing
    assert isinstance(tiered, TieredOffloadingManager)
    counters = observed[0].counters
    assert counters.held_blocks == tiered.cpu.num_blocks - tiered.cpu.num_free_blocks
    # The report's evictions are the CPU tier's own count too, promotions' included.
    assert counters.evictions == report.tiers["cpu"]["evicted"] == report.offload_evictions > 0


def test_the_counters_read_are_a_snapshot_later_calls_leave_alone() -> None:
    """A metrics scrape reads ``counters`` on its own thread: it got the live totals, which
    the engine's calls kept adding to while it read them, and it wrote the CPU tier's figures
    into them, racing the calls' own additions (an evictions total read between a store's
    eviction and its count was counted twice, then went down at the next scrape)."""
    observed = ObservedManager(build_manager(6, "lru", 2, 32), 100)
    before = observed.counters
    observed.lookup([block_id_key(1)])
    observed.prepare_store([block_id_key(i) for i in range(3)])
    assert (before.lookups, before.stores_offered) == (0, 0)
    after = observed.counters
    assert (after.lookups, after.stores_offered) == (1, 3)


def test_a_sink_that_raises_fails_no_call_and_the_others_get_every_batch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(events: list[OffloadingEvent]) -> None:
        raise RuntimeError("the consumer is down")

    batches: list[list[OffloadingEvent]] = []
    observed = ObservedManager(
        build_manager(2, "lru", enable_events=True), 100, [broken, batches.append]
    )
    for first in (0, 2):  # the second store evicts the first: a stored and a removed batch
        keys = [block_id_key(first), block_id_key(first + 1)]
        output = observed.prepare_store(keys)
        assert output is not None and output.keys_to_store == keys
        observed.complete_store(keys)
    events = [event for batch in batches for event in batch]
    assert [(len(e.keys), e.removed) for e in events] == [(2, False), (2, True), (2, False)]
    assert observed.lookup([block_id_key(2), block_id_key(3)]) == 2
    assert observed.sink_failures == len(batches) == 3
    failures = [r for r in caplog.records if "KV event sink" in r.getMessage()]
    assert len(failures) == 1
    assert failures[0].exc_info is not None and "consumer is down" in str(failures[0].exc_info[1])


@pytest.mark.parametrize("tiered", [False, True])
def test_a_store_completed_twice_or_never_offered_is_counted_as_the_tier_settled_it(
    tmp_path: Path, tiered: bool
) -> None:
    """``complete_store`` counted every key it was given: a key completed again, listed
    twice, or never offered added completed (and stored bytes) or failed stores, though
    the tier settled no store for it and announced nothing."""
    from kvoffload import CPUOffloadingManager, OffloadingManager
    from kvoffload.managers.tiered import TierSettings
    from kvoffload.tiers.disk import DiskTier

    cpu = CPUOffloadingManager(4, enable_events=True)
    manager: OffloadingManager = cpu
    if tiered:
        disk = DiskTier(tmp_path, 8, b"f" * 16)
        manager = TieredOffloadingManager(cpu, [(disk, TierSettings())], wait_for_tiers=True)
    events: list[OffloadingEvent] = []
    observed = ObservedManager(manager, 100, [events.extend])
    a, b, c = (block_id_key(i) for i in (1, 2, 3))
    observed.prepare_store([a, b])
    observed.complete_store([a, a])
    observed.complete_store([a])
    observed.complete_store([b, c], success=False)
    observed.complete_store([c], success=False)
    observed.flush()
    counters = observed.counters
    stored = [key for event in events if not event.removed for key in event.keys]
    assert stored == [a]
    assert (counters.stores_completed, counters.bytes_stored) == (1, 100)
    assert (counters.stores_failed, counters.held_blocks) == (1, 1)
    if isinstance(manager, TieredOffloadingManager):
        manager.close()
