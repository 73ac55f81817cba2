"""Model-based test of the stack driven the way vLLM's connector drives it.

Several requests are interleaved. Each one, when scheduled, touches all of its
blocks and looks up the blocks past its GPU prefix (in one lookup, as the seed's
connector does, or one key at a time, as vLLM's, answered as kvoffload's adapter
answers them: one batch lookup at the scan's first key, the later keys from what
the CPU tier then holds); a ``None`` parks it, and its
retry comes with a GPU prefix that may have grown or shrunk meanwhile (vLLM
re-matches the prefix cache on every try), or it is aborted and never asks
again. Hits are loaded (pinned until the load completes), the rest is stored a
few blocks per step, each store completing (or failing) when the test says.
The engine calls the stack's outermost manager (the CPU tier's own admission
layer or reuse filter, if any, over the tiered manager). Below the CPU tier sit
one or two in-memory tiers, written back or through, behind an optional lookup
threshold and admission layer, whose reads land, fail or half fail whenever the
test says (without ``wait_for_tiers``): promotions land at arbitrary times, before,
between or after their requesters' retries. The tiers are in memory rather than
on disk because only there can a test hold a read for as long as it likes.

A request may read only some lower tiers (vLLM's ``kv_load_tiers``), and a block
may rot in a lower tier (its next read fails, and the tier removes it). Each lookup
the tiered manager answers is checked against a plain model of what each lower
tier's admission layer must be shown (a retry after ``None`` is no new reference
to a tier that saw its first try; any answer ends that, and so does the finish of
the last request with that prompt that waits for its retry, as kvoffload's adapter
tells the manager of each request it named in its lookups).

After every step: every pin is a load in flight or a reservation (which a later
lookup ends); every block the CPU tier holds ready, and every block a lower tier
holds, has its key's bytes, so a load reads exactly what was stored; events
replay to what each tier holds; the counters match what the engine saw. And
whenever the engine drains (every request finished, every transfer landed), a
bounded number of lookups leaves every CPU block evictable: the tier never wedges.

``KVOFFLOAD_HUNT_EXAMPLES`` (e.g. 5000) and ``KVOFFLOAD_HUNT_STEPS`` (e.g. 100) run a long hunt
instead of the default (600 examples of 40 steps, 200 of the machine with held reads).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from tier_helpers import ByteSlots, content, pins_of

from kvoffload import CPUOffloadingManager, OffloadKey, block_id_key
from kvoffload.core.manager import OffloadingEvent
from kvoffload.core.specs import CPULoadStoreSpec
from kvoffload.core.tier_protocol import Target, TierStats
from kvoffload.managers.stack import Stack, StackConfig, assemble
from kvoffload.managers.tiered import TieredOffloadingManager, TierSettings
from kvoffload.policies import PENDING_STORE

SIZE = 32
UNIVERSE = [block_id_key(i) for i in range(9)]
PROMPTS = [
    UNIVERSE[:5],
    UNIVERSE[:2] + UNIVERSE[5:7],
    [*UNIVERSE[:3], UNIVERSE[7]],
    [UNIVERSE[8], UNIVERSE[3]],
]
"""Requests' block chains: shared prefixes, as a prefix cache sees them."""
ELSEWHERE = block_id_key(1000)
"""A key no request holds: the lookups of unrelated traffic."""
GARBAGE = b"\xee" * SIZE
READ_OUTCOMES = st.sampled_from(["intact", "intact", "fails", "half fails"])
ADMISSIONS = ["none", "none", "feedback", "filter"]
"""A lower tier's admission layer over its threshold."""
LOAD_TIERS = st.sampled_from([None, None, None, (), (0,), (1,), (0, 1)])
"""A request's ``kv_load_tiers``, as lower tiers' indices (a missing tier is dropped)."""
MEANWHILE = st.sampled_from(
    [""] * 8
    + ["a parked request is aborted", "a tier forgets a block", "unrelated lookups"]
    + ["the engine drains"]
)


@dataclass
class Read:
    """A lower tier's read in flight: the bytes it found when it started, delivered later."""

    keys: list[OffloadKey]
    payloads: list[bytes | None]
    target: Target
    result: Future[list[bool]] = field(default_factory=Future)

    def land(self, outcome: str) -> list[bool]:
        intact = []
        for index, payload in enumerate(self.payloads):
            ok = payload is not None and not (
                outcome == "fails" or (outcome == "half fails" and index >= len(self.keys) // 2)
            )
            if ok:
                assert payload is not None
                self.target(index)[:] = payload
            intact.append(ok)
        self.result.set_result(intact)
        return intact


class HeldTier:
    """A lower tier in memory (the :class:`LowerTier` protocol), LRU over ``capacity``
    blocks. With ``gated``, its reads wait for :meth:`land`; writes apply at ``poll``."""

    def __init__(self, medium: str, capacity: int, gated: bool) -> None:
        self.medium = medium
        self.stats = TierStats()
        self.capacity = capacity
        self.gated = gated
        self.blocks: OrderedDict[OffloadKey, bytes] = OrderedDict()
        self.writes: list[tuple[list[OffloadKey], list[bytes]]] = []
        self.reads: list[Read] = []
        self.events: list[OffloadingEvent] = []
        self.reads_started = 0
        self.written_blocks = 0
        self.intact_reads = 0
        self.rotten: set[OffloadKey] = set()
        """Blocks whose bytes no longer match their checksum: a read finds them broken."""
        self.found_broken: list[OffloadKey] = []
        """Blocks a read found broken, removed at the next :meth:`poll` (as the disk tier)."""

    def present(self, keys: Sequence[OffloadKey]) -> int:
        run = 0
        while run < len(keys) and keys[run] in self.blocks:
            run += 1
        return run

    def held(self, keys: Sequence[OffloadKey]) -> list[bool]:
        return [key in self.blocks for key in keys]

    def read(self, keys: Sequence[OffloadKey], target: Target) -> Future[list[bool]]:
        self.reads_started += 1
        for key in keys:
            if key in self.blocks:
                self.blocks.move_to_end(key)
        read = Read(
            list(keys),
            [None if key in self.rotten else self.blocks.get(key) for key in keys],
            target,
        )
        self.found_broken += [key for key in keys if key in self.rotten]
        if self.gated:
            self.reads.append(read)
        else:
            self.land(read, "intact")
        return read.result

    def land(self, read: Read, outcome: str) -> None:
        self.intact_reads += sum(read.land(outcome))

    def write(self, keys: Sequence[OffloadKey], payloads: Sequence[bytes]) -> int:
        self.written_blocks += len(keys)
        self.writes.append((list(keys), list(payloads)))
        return len(keys)

    def has_pending_work(self) -> bool:
        return bool(self.writes)

    def wait_written(self) -> None:
        return None  # nothing under way: queued writes apply at poll

    def poll(self, wait: bool) -> None:
        broken = [key for key in dict.fromkeys(self.found_broken) if key in self.blocks]
        self.found_broken.clear()
        if broken:
            self.forget(broken)
        writes, self.writes = self.writes, []
        for keys, payloads in writes:
            stored = [key for key in dict.fromkeys(keys) if key not in self.blocks]
            self.blocks.update((key, payloads[keys.index(key)]) for key in stored)
            evicted = []
            while len(self.blocks) > self.capacity:
                evicted.append(self.blocks.popitem(last=False)[0])
                self.rotten.discard(evicted[-1])
            if stored:
                self.events.append(OffloadingEvent(stored, self.medium, removed=False))
            if evicted:
                self.events.append(OffloadingEvent(evicted, self.medium, removed=True))

    def forget(self, keys: list[OffloadKey]) -> None:
        """Remove ``keys``, held, with their event."""
        for key in keys:
            del self.blocks[key]
            self.rotten.discard(key)
        self.events.append(OffloadingEvent(keys, self.medium, removed=True))

    def take_events(self) -> list[OffloadingEvent]:
        events, self.events = self.events, []
        return events

    def close(self) -> None:
        assert not self.reads, "the stack closed with a read in flight"


@dataclass
class Request:
    keys: list[OffloadKey]
    gpu: int
    """Blocks the GPU prefix cache holds: the lookup starts past them."""
    tiers: tuple[int, ...] | None = None
    """The lower tiers it may read (vLLM's ``kv_load_tiers``; ``None``: every one)."""
    next_store: int = 0
    loading: list[OffloadKey] | None = None
    running: bool = False
    name: int = field(default_factory=count().__next__)
    """What the engine calls it in the lookups it names it in (as vLLM's request id)."""


class ConnectorMachine(RuleBasedStateMachine):
    @initialize(
        cpu=st.integers(1, 4),
        capacities=st.tuples(st.integers(1, 6), st.integers(1, 6)),
        policy=st.sampled_from(["lru", "arc"]),
        tiers=st.lists(
            st.tuples(st.booleans(), st.sampled_from([0, 2]), st.sampled_from(ADMISSIONS)),
            min_size=1,
            max_size=2,
        ),
        wait=st.booleans(),
        reserve_lookups=st.integers(1, 5),
        outer=st.sampled_from(["none", "none", "filter", "feedback"]),
        per_key=st.booleans(),
    )
    def setup(
        self,
        cpu: int,
        capacities: tuple[int, int],
        policy: str,
        tiers: list[tuple[bool, int, str]],
        wait: bool,
        reserve_lookups: int,
        outer: str,
        per_key: bool,
    ) -> None:
        self.cpu_capacity, self.reserve_lookups = cpu, reserve_lookups
        self.per_key = per_key
        self.slots = ByteSlots(cpu, SIZE)
        self.tiers = [
            HeldTier(f"T{index}", capacity, gated=not wait)
            for index, capacity in zip(range(len(tiers)), capacities, strict=False)
        ]
        self.m = TieredOffloadingManager(
            CPUOffloadingManager(cpu, policy, enable_events=True),
            [
                (
                    tier,
                    TierSettings(
                        write_through=through,
                        store_threshold=threshold,
                        admission=admission,
                        capacity=tier.capacity,
                    ),
                )
                for tier, (through, threshold, admission) in zip(self.tiers, tiers, strict=True)
            ],
            self.slots,
            wait_for_tiers=wait,
            reserve_lookups=reserve_lookups,
        )
        self.watch_the_lower_tiers_books()
        self.stack = assemble(
            StackConfig(
                cpu,
                policy,
                store_threshold=2 if outer == "filter" else 0,
                admission="none" if outer == "filter" else outer,
            ),
            Stack(self.m, self.m.cpu, tiered=self.m),
        )
        self.outer = self.stack.manager
        assert self.stack.direct is self.m
        """What the engine calls: the stack's own admission and reuse filter, if any, over
        the tiered manager, as :func:`~kvoffload.managers.stack.assemble` orders them."""
        self.requests: list[Request] = []
        self.stores: list[tuple[list[OffloadKey], list[int]]] = []
        self.loads: list[list[OffloadKey]] = []
        self.replayed: dict[str, set[OffloadKey]] = {"CPU": set()}
        self.replayed.update((tier.medium, set()) for tier in self.tiers)
        self.hit_blocks = 0
        self.stored_blocks = 0
        self.evicted_blocks = 0
        self.cpu_removed = 0

    def teardown(self) -> None:
        if hasattr(self, "m"):
            self.drain()
            self.m.close()

    def watch_the_lower_tiers_books(self) -> None:
        """Record what each lower tier's admission layer is shown, and check each lookup
        the tiered manager answers (the engine's, those of its stack's outer layers, and
        unrelated ones) against a plain model of it: a lookup that goes past the CPU tier's
        hit, to a block no promotion is bringing, shows the keys past that hit to the layer
        of every lower tier the lookup may read, unless that tier was shown the same prompt
        (known by its last key) by a lookup answered ``None`` that no answered lookup of the
        prompt has followed since: that is the request's retry, no new reference. Unless
        every request named in lookups of the prompt answered ``None`` since has finished:
        a retry that will never come."""
        self.shown: list[tuple[int, list[OffloadKey]]] = []
        self.waiting: list[set[OffloadKey]] = [set() for _ in self.tiers]
        """Per lower tier, the prompts shown to it and answered ``None`` since."""
        self.waiters: dict[OffloadKey, set[int]] = {}
        """Per prompt, the requests named in its lookups answered ``None`` since."""
        self.judged_blocks = 0
        for index, layer in enumerate(self.m.admissions):
            if layer is not None:
                begin = layer.begin_request

                def record(
                    keys: Sequence[OffloadKey],
                    *,
                    index: int = index,
                    begin: Callable[..., None] = begin,
                    **options: Any,
                ) -> None:
                    assert options.get("will_offer") is False, "no offer follows a sighting"
                    self.shown.append((index, list(keys)))
                    begin(keys, **options)

                layer.begin_request = record  # type: ignore[method-assign]
        lookup = self.m.lookup

        def checked(
            keys: Iterable[OffloadKey],
            tiers: Collection[int] | None = None,
            *,
            request: int | None = None,
        ) -> int | None:
            keys = list(keys)
            self.m.poll()  # the lookup's own first step: the model sees what it will see
            hits = self.ready_run(keys)
            reaches = (
                hits < len(keys)
                and (tiers is None or len(tiers) > 0)
                and not self.m.is_promoting(keys[hits])
            )
            prompt = keys[-1]
            expected = [
                (index, keys[hits:])
                for index, layer in enumerate(self.m.admissions)
                if reaches
                and layer is not None
                and (tiers is None or index in tiers)
                and prompt not in self.waiting[index]
            ]
            self.shown.clear()
            found = lookup(keys, tiers, request=request)
            assert self.shown == expected, (keys, tiers, found)
            if expected:
                self.judged_blocks += len(keys) - hits
            for index, waiting in enumerate(self.waiting):
                if found is not None:
                    waiting.discard(prompt)
                elif any(shown == index for shown, _ in expected):
                    waiting.add(prompt)
            if found is not None:
                self.waiters.pop(prompt, None)
            elif request is not None:
                self.waiters.setdefault(prompt, set()).add(request)
            return found

        self.m.lookup = checked  # type: ignore[method-assign]

    # The engine's side.

    @rule(
        prompt=st.sampled_from(PROMPTS),
        gpu=st.integers(0, 5),
        meanwhile=MEANWHILE,
        tiers=LOAD_TIERS,
    )
    def arrive(
        self, prompt: list[OffloadKey], gpu: int, meanwhile: str, tiers: tuple[int, ...] | None
    ) -> None:
        """A new request is scheduled for the first time; meanwhile, now and then, something
        rarer happens (a parameter, not a rule of its own, so that it stays rare). Now and
        then it may read only some lower tiers, or none."""
        if tiers is not None:
            tiers = tuple(index for index in tiers if index < len(self.tiers))
        request = Request(prompt, min(gpu, len(prompt)), tiers)
        self.requests.append(request)
        self.schedule(request, 0)
        self.happens(meanwhile)

    @precondition(lambda self: self.parked())
    @rule(data=st.data(), gpu_change=st.integers(-2, 2))
    def retry(self, data: st.DataObject, gpu_change: int) -> None:
        """A parked request asks again: its GPU prefix may have grown (another request
        computed those blocks) or shrunk (the GPU evicted them)."""
        self.schedule(data.draw(st.sampled_from(self.parked())), gpu_change)

    @precondition(lambda self: self.parked())
    @rule(data=st.data())
    def retry_until_answered(self, data: st.DataObject) -> None:
        """A parked request asks again at once each time, its reads landing in between: it
        is answered within as many tries as it has blocks (never waits forever)."""
        request = data.draw(st.sampled_from(self.parked()))
        for _ in range(len(request.keys) + 1):
            for tier in self.tiers:
                while tier.reads:
                    tier.land(tier.reads.pop(0), "intact")
            self.schedule(request, 0)
            if request.running:
                return
        raise AssertionError("a retried lookup waits forever")

    @precondition(lambda self: self.parked())
    @rule(data=st.data(), gpu_change=st.integers(-2, 2), meanwhile=MEANWHILE)
    def retry_later(self, data: st.DataObject, gpu_change: int, meanwhile: str) -> None:
        """:meth:`retry` after something rarer (a second rule: retries are most of what a
        parked request does)."""
        self.happens(meanwhile)
        if self.parked():  # unless it was aborted or the engine drained
            self.retry(data, gpu_change)

    def parked(self) -> list[Request]:
        return [r for r in self.requests if not r.running]

    def schedule(self, request: Request, gpu_change: int) -> None:
        """What the connector does for a waiting request: touch all of its blocks, look up
        those past its GPU prefix, load the hits; on ``None`` it stays parked."""
        keys = request.keys
        request.gpu = max(0, min(len(keys), request.gpu + gpu_change))
        self.outer.touch(keys)
        if request.gpu == len(keys):
            request.running, request.next_store = True, len(keys)
            return
        past_gpu = keys[request.gpu :]
        if self.per_key:
            found = self.scan(past_gpu, request)
        elif request.tiers is None:
            found = self.outer.lookup(past_gpu)
        else:  # as kvoffload's adapter: the tiered manager, told which tiers
            found = self.m.lookup(past_gpu, request.tiers, request=request.name)
        if found is None:
            # Asked again only while a promotion runs (its read was started, not held back).
            assert self.m.promotions_in_flight > 0
            return
        assert found == self.ready_run(past_gpu)
        if found:
            spec = self.outer.prepare_load(past_gpu[:found])
            assert isinstance(spec, CPULoadStoreSpec)
            for key, slot in zip(past_gpu, spec.block_ids.tolist(), strict=False):
                assert bytes(self.slots.view(slot)) == content(key, SIZE), key
            self.hit_blocks += found
            request.loading = past_gpu[:found]
            self.loads.append(request.loading)
        request.running, request.next_store = True, request.gpu + found

    def scan(self, keys: list[OffloadKey], request: Request) -> int | None:
        """vLLM's lookup (``_maximal_prefix_lookup``: one key at a time, on past a deferred
        key until a miss; ``None`` if any was deferred) as kvoffload's adapter answers it:
        the scan's first key looks the request up in one batch, past the stack's admission,
        and each key is answered from what the CPU tier then holds: ready, a hit; promoting,
        deferred, and so is a key it lacks behind a deferred one; otherwise a miss (a store
        in flight too: vLLM would wait for it, which this engine does not model)."""
        self.m.lookup(keys, request.tiers, request=request.name)
        hits, deferred = 0, False
        for key in keys:
            block = self.m.cpu.block_status(key)
            if block is not None and block.is_ready:
                hits += 1
            elif self.m.is_promoting(key) or (block is None and deferred):
                deferred = True
            else:
                break
        return None if deferred else hits

    @precondition(lambda self: any(r.running for r in self.requests))
    @rule(data=st.data(), blocks=st.integers(1, 5), outcome=st.sampled_from(["lands", "later"]))
    def step(self, data: st.DataObject, blocks: int, outcome: str) -> None:
        """A running request computes up to ``blocks`` more blocks and offers them for
        storing (refused: offered again next step); done, it leaves once its load has."""
        request = data.draw(st.sampled_from([r for r in self.requests if r.running]))
        keys = request.keys
        if request.next_store < len(keys):
            offered = keys[request.next_store : request.next_store + blocks]
            held = {key for key in offered if self.m.holds(key)}
            output = self.outer.prepare_store(offered)
            if output is None:
                return
            request.next_store += len(offered)
            self.evicted_blocks += len(output.evicted_keys)
            assert held.isdisjoint(output.keys_to_store)
            if output.keys_to_store:
                self.outer.touch(keys[: request.next_store])
                assert isinstance(output.store_spec, CPULoadStoreSpec)
                ids = output.store_spec.block_ids.tolist()
                for slot in ids:  # the transfer into the slot has not landed yet
                    self.slots.view(slot)[:] = GARBAGE
                self.stores.append((output.keys_to_store, ids))
                if outcome == "lands":
                    self.finish_store_at(len(self.stores) - 1, True)
        elif request.loading is None:
            self.finish(request)

    @precondition(lambda self: self.stores)
    @rule(data=st.data(), success=st.sampled_from([True, True, False]))
    def finish_store(self, data: st.DataObject, success: bool) -> None:
        self.finish_store_at(data.draw(st.integers(0, len(self.stores) - 1)), success)

    def finish_store_at(self, index: int, success: bool) -> None:
        keys, ids = self.stores.pop(index)
        if success:
            for key, slot in zip(keys, ids, strict=True):
                self.slots.view(slot)[:] = content(key, SIZE)
            self.stored_blocks += len(keys)
        self.outer.complete_store(keys, success)

    @precondition(lambda self: any(r.loading is not None for r in self.requests))
    @rule(data=st.data())
    def finish_load(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from([r for r in self.requests if r.loading is not None]))
        assert request.loading is not None
        self.outer.complete_load(request.loading)
        self.loads.remove(request.loading)
        request.loading = None

    def finish(self, request: Request) -> None:
        """The request leaves (done or aborted): the manager is told, as vLLM's adapter
        tells it, and the model's waiting prompts no request waits on any more end."""
        self.requests.remove(request)
        self.m.request_finished(request.name)
        for prompt, waiters in list(self.waiters.items()):
            waiters.discard(request.name)
            if not waiters:
                del self.waiters[prompt]
                for waiting in self.waiting:
                    waiting.discard(prompt)

    def happens(self, meanwhile: str) -> None:
        if meanwhile == "a parked request is aborted" and self.parked():
            self.finish(self.parked()[0])
        elif meanwhile == "a tier forgets a block":
            # Its own eviction, a server restart: perhaps a block a lookup just found there,
            # whose promotion's read then fails.
            for tier in self.tiers:
                if tier.blocks:
                    tier.forget([next(iter(reversed(tier.blocks)))])
                    break
        elif meanwhile == "unrelated lookups":
            for _ in range(self.reserve_lookups):
                assert self.outer.lookup([ELSEWHERE]) == 0
        elif meanwhile == "the engine drains":
            self.engine_drains()

    # The lower tiers' side.

    @precondition(lambda self: any(tier.reads for tier in self.tiers))
    @rule(data=st.data(), outcome=READ_OUTCOMES)
    def land_read(self, data: st.DataObject, outcome: str) -> None:
        tier = data.draw(st.sampled_from([tier for tier in self.tiers if tier.reads]))
        tier.land(tier.reads.pop(data.draw(st.integers(0, len(tier.reads) - 1))), outcome)

    @precondition(lambda self: any(tier.blocks for tier in self.tiers))
    @rule(data=st.data())
    def a_block_rots(self, data: st.DataObject) -> None:
        """A block's bytes in a lower tier stop matching their checksum: the next read of it
        fails, and the tier removes it (announced) at its next poll."""
        tier = data.draw(st.sampled_from([tier for tier in self.tiers if tier.blocks]))
        tier.rotten.add(data.draw(st.sampled_from(sorted(tier.blocks))))

    def engine_drains(self) -> None:
        """Every request finishes, every transfer lands; then, after ``reserve_lookups``
        lookups of other blocks, every CPU block is evictable again."""
        self.drain()
        for _ in range(self.reserve_lookups):
            assert self.outer.lookup([ELSEWHERE]) == 0
        self.m.poll()
        assert not self.m._reserved
        assert not self.m._waiters, "a finished request still waits for its retry"
        stuck = {k: b.ref_cnt for k, b in self.m.cpu._blocks.items() if b.ref_cnt != 0}
        assert not stuck, f"the CPU tier wedged: {stuck}"
        assert self.m.cpu.num_evictable_blocks(()) + self.m.cpu.num_free_blocks == (
            self.cpu_capacity
        )

    def drain(self) -> None:
        for request in list(self.requests):
            if request.loading is not None:
                self.outer.complete_load(request.loading)
            self.finish(request)
        self.loads.clear()
        while self.stores:
            self.finish_store_at(0, True)
        for tier in self.tiers:
            while tier.reads:
                tier.land(tier.reads.pop(0), "intact")
        self.m.poll()
        assert not self.m.promotions_in_flight

    # Invariants.

    def ready_run(self, keys: list[OffloadKey]) -> int:
        run = 0
        while run < len(keys):
            block = self.m.cpu.block_status(keys[run])
            if block is None or block.ref_cnt < 0:
                break
            run += 1
        return run

    @invariant()
    def every_pin_has_a_holder(self) -> None:
        """A pin is a load in flight or a reservation that a later lookup ends; a pending
        block is a store in flight or a promotion."""
        if not hasattr(self, "m"):
            return
        pins = pins_of(self.loads)
        storing = {key for keys, _ in self.stores for key in keys}
        for key, block in self.m.cpu._blocks.items():
            if block.ref_cnt == PENDING_STORE:
                assert key in storing or self.m.is_promoting(key)
                assert not self.m.is_reserved(key)
            else:
                assert block.ref_cnt == pins.get(key, 0) + self.m.is_reserved(key), key
        oldest = self.m._lookups - self.reserve_lookups
        for key, (stamp, batch) in self.m._reserved.items():
            assert key in batch and self.m.holds(key)
            assert stamp > oldest, "a reservation outlived reserve_lookups lookups"

    @invariant()
    def every_block_holds_its_own_bytes(self) -> None:
        if not hasattr(self, "m"):
            return
        assert len(self.m.cpu._blocks) <= self.cpu_capacity
        for key, block in self.m.cpu._blocks.items():
            if block.ref_cnt >= 0:
                assert bytes(self.slots.view(block.block_id)) == content(key, SIZE), key
        for tier in self.tiers:
            for keys, payloads in tier.writes:
                for key, payload in zip(keys, payloads, strict=True):
                    assert payload == content(key, SIZE), (tier.medium, key)
            for key, payload in tier.blocks.items():
                assert payload == content(key, SIZE), (tier.medium, key)

    @invariant()
    def events_replay_to_the_tiers(self) -> None:
        if hasattr(self, "m"):
            self.replay()
            ready = {k for k, b in self.m.cpu._blocks.items() if b.ref_cnt >= 0}
            assert self.replayed["CPU"] == ready
            for tier in self.tiers:
                assert self.replayed[tier.medium] == set(tier.blocks)

    def replay(self) -> None:
        self.m.poll()
        for event in self.m.take_events():
            if event.removed:
                if event.medium == "CPU":
                    assert self.replayed["CPU"].issuperset(event.keys), event
                    self.cpu_removed += len(event.keys)
                self.replayed[event.medium].difference_update(event.keys)
            else:
                assert self.replayed[event.medium].isdisjoint(event.keys), event
                self.replayed[event.medium].update(event.keys)

    @invariant()
    def counters_match_the_engine(self) -> None:
        if not hasattr(self, "m"):
            return
        self.replay()
        stats = self.m.cpu_stats
        assert stats.hit_blocks == self.hit_blocks
        promoted = sum(tier.intact_reads for tier in self.tiers)
        assert stats.stored_blocks == self.stored_blocks + promoted
        for index, tier in enumerate(self.tiers):
            assert self.m.promotion_batches[index] == tier.reads_started
            assert self.m.admitted_blocks[index] <= self.m.offered_blocks[index]
            assert tier.written_blocks == self.m.admitted_blocks[index]
        assert self.m.judged_blocks == self.judged_blocks
        assert stats.evicted >= self.evicted_blocks
        assert stats.evicted == self.cpu_removed


THROUGH = st.sampled_from([True, True, False])
"""Mostly write-through: the lower tiers fill, and lookups find blocks there to promote."""
LAYERS = ["feedback", "filter"]
"""Every lower tier behind a layer: what one tier was shown another may not have been."""


class AsyncBooksMachine(ConnectorMachine):
    """The same engine over two lower tiers whose reads land when the test says, each
    behind an admission layer, which another engine sharing them fills too: lookups
    answered ``None`` and their retries, beside new requests of the same prompts and
    requests that may read only some tiers, are much of what the lower tiers' books see
    (a few dozen in the machine above's whole run, too few to tell the tiers apart)."""

    @initialize(
        cpu=st.integers(2, 4),
        capacities=st.tuples(st.integers(2, 6), st.integers(2, 6)),
        policy=st.sampled_from(["lru", "arc"]),
        tiers=st.tuples(*[st.tuples(THROUGH, st.just(0), st.sampled_from(LAYERS))] * 2),
        reserve_lookups=st.integers(1, 5),
        per_key=st.booleans(),
    )
    def setup(  # type: ignore[override]
        self,
        cpu: int,
        capacities: tuple[int, int],
        policy: str,
        tiers: tuple[tuple[bool, int, str], ...],
        reserve_lookups: int,
        per_key: bool,
    ) -> None:
        super().setup(cpu, capacities, policy, list(tiers), False, reserve_lookups, "none", per_key)

    @precondition(lambda self: self.parked())
    @rule(data=st.data(), gpu=st.integers(0, 5), tiers=LOAD_TIERS, aborted=st.booleans())
    def the_same_prompt_arrives(
        self, data: st.DataObject, gpu: int, tiers: tuple[int, ...] | None, aborted: bool
    ) -> None:
        """A new request of a parked request's prompt, perhaps reading other tiers: a new
        reference to the tiers it may read that the parked one's lookups did not show it
        to (the lower tiers know a request by its prompt alone). Then perhaps the parked
        one is aborted: the new one, if parked too, still waits for its retry."""
        first = data.draw(st.sampled_from(self.parked()))
        self.arrive(first.keys, gpu, "", tiers)
        if aborted:
            self.finish(first)

    @rule(data=st.data(), prompt=st.sampled_from(PROMPTS), blocks=st.integers(1, 5))
    def another_engine_writes(
        self, data: st.DataObject, prompt: list[OffloadKey], blocks: int
    ) -> None:
        """Another engine sharing a lower tier writes the first ``blocks`` of a prompt there
        (past this stack's admission): requests find blocks to promote."""
        tier = data.draw(st.sampled_from(self.tiers))
        keys = prompt[:blocks]
        tier.writes.append((keys, [content(key, SIZE) for key in keys]))

    @rule(blocks=st.integers(1, 4))
    def other_traffic_evicts(self, blocks: int) -> None:
        """Requests this engine does not model offer ``blocks`` blocks whose stores then
        fail: the CPU tier evicts room for them (written back to the lower tiers that take
        them) and keeps none, so requests find more of their blocks in the lower tiers."""
        keys = [block_id_key(2000 + index) for index in range(blocks)]
        output = self.outer.prepare_store(keys)
        if output is None:
            return
        self.evicted_blocks += len(output.evicted_keys)
        if output.keys_to_store:
            assert isinstance(output.store_spec, CPULoadStoreSpec)
            self.stores.append((output.keys_to_store, output.store_spec.block_ids.tolist()))
            self.finish_store_at(len(self.stores) - 1, False)


HUNT = int(os.environ.get("KVOFFLOAD_HUNT_EXAMPLES", "0"))
ConnectorMachine.TestCase.settings = settings(
    max_examples=HUNT or 600,
    stateful_step_count=int(os.environ.get("KVOFFLOAD_HUNT_STEPS", "40")),
    deadline=None,
)
TestConnector = ConnectorMachine.TestCase
AsyncBooksMachine.TestCase.settings = settings(
    ConnectorMachine.TestCase.settings, max_examples=HUNT or 200
)
TestAsyncBooks = AsyncBooksMachine.TestCase
