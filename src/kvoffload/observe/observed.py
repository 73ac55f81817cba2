"""A manager decorator that counts every call and forwards the manager's events.

The simulator and the CLI wrap the manager they build in it, so that metrics
and KV events need no hooks inside the engine or the managers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import (
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    stack_layers,
)
from kvoffload.core.specs import LoadStoreSpec
from kvoffload.core.tier_protocol import TierStats
from kvoffload.observe.counters import ManagerCounters
from kvoffload.observe.transfers import ObservedWorker

logger = logging.getLogger(__name__)

EventSink = Callable[[list[OffloadingEvent]], None]
"""Receives each batch of events drained from the manager, in order."""


class _BlockStatus(Protocol):
    @property
    def is_ready(self) -> bool: ...


@runtime_checkable
class _CPUTier(Protocol):
    """What is read of a CPU tier's manager (``managers.cpu``, a layer above this one)."""

    num_blocks: int

    @property
    def num_free_blocks(self) -> int: ...

    def holds(self, key: OffloadKey) -> bool: ...

    def block_status(self, key: OffloadKey) -> _BlockStatus | None: ...

    def take_events(self) -> Iterable[OffloadingEvent]: ...


@runtime_checkable
class _Tiered(Protocol):
    """What is read of a tiered manager (``managers.tiered``): its CPU tier and counts."""

    cpu_stats: TierStats

    @property
    def cpu(self) -> _CPUTier: ...

    def take_events(self) -> Iterable[OffloadingEvent]: ...


class ObservedManager(OffloadingManager):
    """Wraps ``backing`` without changing any answer; counts into :attr:`counters`.

    When ``sinks`` are given, the backing manager's events are drained after
    every call (a tiered manager's ``lookup`` starts and lands promotions and
    finishes tier writes, not only its stores) and handed to each sink, so they
    reach the outside world in the step that made them; :meth:`flush` hands
    over the last ones, and :meth:`take_events` then returns nothing. Without sinks it
    passes ``take_events`` through. A sink that raises loses that batch, not the call:
    the others still get it, :attr:`sink_failures` counts it, and each sink's first
    failure is logged with its traceback.

    ``stores_skipped`` counts, as the simulator's ``stores_skipped_by_admission``
    does, the offered blocks a store gave no slot that the CPU tier does not
    hold (whichever layer held them back). The CPU tier is found by following
    ``backing``; ``held_blocks`` is then read from it, and under a tiered
    manager ``evictions`` is its CPU tier's count (the run's
    ``tiers.cpu.evicted``), promotions' evictions included, and a
    ``complete_store`` counts the blocks whose store it settled (a key
    completed twice, or never offered, is none). For a manager whose CPU tier
    is out of reach, ``held_blocks`` counts admitted blocks less evicted and
    failed ones, every offered block not given a slot counts as skipped, and
    every key given to ``complete_store`` as completed or failed.
    """

    def __init__(
        self,
        backing: OffloadingManager,
        bytes_per_block: int = 0,
        sinks: Sequence[EventSink] = (),
    ) -> None:
        self._backing = backing
        self._bytes_per_block = bytes_per_block
        self._sinks = tuple(sinks)
        self._failed_sinks: set[int] = set()
        self.sink_failures = 0
        """Batches a sink raised on, one per sink and batch (the call went on)."""
        self._counters = ManagerCounters()
        self._tiered: _Tiered | None = None
        self._cpu: _CPUTier | None = None
        self._take: Callable[[], Iterable[OffloadingEvent]] = backing.take_events
        """Where events come from: straight from the tiers when reached (the layers above
        pass ``take_events`` through), a drain with nothing to hand costing next to nothing."""
        for found in stack_layers(backing):
            if isinstance(found, _Tiered):
                self._tiered, self._cpu, self._take = found, found.cpu, found.take_events
                break
            if isinstance(found, _CPUTier):
                self._cpu, self._take = found, found.take_events
                break

    @property
    def backing(self) -> OffloadingManager:
        return self._backing

    @property
    def counters(self) -> ManagerCounters:
        """A snapshot of the totals so far, with the CPU tier's own figures read now where it
        is reached: a tiered manager also fills and evicts CPU slots in ``lookup``
        (promotions). A copy, as a scrape reads it on another thread: the calls do not
        change it while it is read, and it writes nothing into the totals they add to."""
        c, cpu = self._counters.copy(), self._cpu
        if cpu is not None:
            c.held_blocks = cpu.num_blocks - cpu.num_free_blocks
        if self._tiered is not None:
            c.evictions = self._tiered.cpu_stats.evicted
        return c

    def lookup(self, keys: Iterable[OffloadKey]) -> int | None:
        hits = self._backing.lookup(keys)
        self._counters.lookups += 1
        if hits:
            self._counters.lookup_hit_blocks += hits
        self._drain()
        return hits

    def prepare_load(self, keys: Iterable[OffloadKey]) -> LoadStoreSpec:
        keys = list(keys)
        spec = self._backing.prepare_load(keys)
        self._counters.loads += len(keys)
        self._counters.bytes_loaded += len(keys) * self._bytes_per_block
        self._drain()
        return spec

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        self._backing.touch(keys)
        self._drain()

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        self._backing.complete_load(keys)
        self._drain()

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        offered = list(keys)
        output = self._backing.prepare_store(offered)
        c = self._counters
        c.stores_offered += len(offered)
        if output is None:
            c.stores_rejected += len(offered)
        else:
            admitted = len(output.keys_to_store)
            evicted = len(output.evicted_keys)
            c.stores_admitted += admitted
            c.evictions += evicted
            c.held_blocks += admitted - evicted
            if admitted != len(offered):
                c.stores_skipped += self._skipped(offered, output.keys_to_store)
        self._drain()
        return output

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        keys = list(keys)
        pending = self._pending(keys)
        self._backing.complete_store(keys, success)
        still = self._pending(pending or [])
        settled = len(keys) if pending is None else len(pending) - len(still or ())
        c = self._counters
        if success:
            c.stores_completed += settled
            c.bytes_stored += settled * self._bytes_per_block
        else:
            c.stores_failed += settled
            c.held_blocks -= settled
        self._drain()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._sinks:
            return ()
        return self._backing.take_events()

    def flush(self) -> None:
        """Hand the sinks what the manager produced since the last call: closing a tiered
        manager lands the promotions and tier writes still in flight."""
        self._drain()

    def _skipped(self, offered: list[OffloadKey], stored: list[OffloadKey]) -> int:
        """Offered blocks given no slot and not held: admission held them back (a held one
        may also be a block a lookup promoted, not stored by the engine)."""
        cpu, chosen = self._cpu, set(stored)
        if cpu is None:
            return sum(1 for key in offered if key not in chosen)
        return sum(1 for key in offered if key not in chosen and not cpu.holds(key))

    def _pending(self, keys: list[OffloadKey]) -> list[OffloadKey] | None:
        """The distinct ``keys`` whose store the CPU tier holds in flight (``None`` when the
        tier is out of reach): a store completes, or fails, those only. A key completed
        twice, or never offered, counted as a completed (or failed) store, though the tier
        changed nothing and announced nothing."""
        cpu = self._cpu
        if cpu is None:
            return None
        status = cpu.block_status
        return [
            key
            for key in dict.fromkeys(keys)
            if (block := status(key)) is not None and not block.is_ready
        ]

    def _drain(self) -> None:
        if not self._sinks:
            return
        events = list(self._take())
        if events:
            for index, sink in enumerate(self._sinks):
                try:
                    sink(events)
                except Exception:  # a broken consumer must not fail the engine's call
                    self.sink_failures += 1
                    if index not in self._failed_sinks:
                        self._failed_sinks.add(index)
                        logger.exception(
                            "KV event sink %r failed; the batches it fails on are dropped "
                            "for it alone and counted in sink_failures",
                            sink,
                        )


@dataclass(frozen=True)
class Observers:
    """What a run attaches to the manager it builds: event sinks, and hooks given the wrapper.

    ``on_manager`` hooks receive the :class:`ObservedManager` once it exists,
    e.g. to register its counters with a metrics endpoint.
    """

    sinks: Sequence[EventSink] = ()
    on_manager: Sequence[Callable[[ObservedManager], None]] = ()
    on_transfers: Sequence[Callable[[ObservedWorker], None]] = ()

    def wrap(self, manager: OffloadingManager, bytes_per_block: int) -> ObservedManager:
        observed = ObservedManager(manager, bytes_per_block, self.sinks)
        for hook in self.on_manager:
            hook(observed)
        return observed

    def watch_transfers(self, backend: object) -> None:
        """Put an :class:`ObservedWorker` in front of a data-plane backend's ``worker``.

        Backends without a worker (the default one moves no bytes) have no
        transfer latency to report and are left alone.
        """
        if not self.on_transfers or not hasattr(backend, "worker"):
            return
        observed = ObservedWorker(backend.worker)
        backend.worker = observed
        for hook in self.on_transfers:
            hook(observed)
