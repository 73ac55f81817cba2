"""A stack of tiers behind the seed interface: the CPU tier first, then slower ones.

Only the CPU tier is loadable. A block found only in a lower tier (disk, a
shared server) is first promoted into a CPU slot; ``lookup`` answers
``None`` ("ask again later") while that promotion runs, as the seed contract
allows, and the block is a plain CPU hit once it has landed. The promotion
itself is a CPU store: its slot stays pending (neither loadable nor
evictable) until the bytes are in, and a failed read frees the slot, so the
CPU tier's invariants hold across the stack.

A promotion is started once per block run and only for the longest prefix
the CPU tier can take without evicting pinned, pending or reserved blocks.
Once landed, the promoted prefix is *reserved* (pinned on behalf of the
caller that asked) until a lookup reports it as a hit, so the promotions of
other waiting requests cannot evict it before its requester asks again: a
caller that retries always finds what was promoted for it, and every
promoted block is read from its tier once. A reservation nobody claims ends
after ``reserve_lookups`` further lookups. A block whose promotion failed
answers a miss to the next lookup that reaches it rather than being promoted
again at once, so a caller that retries on ``None`` never waits forever for
a block its tier cannot deliver.

Blocks reach a lower tier either when the CPU tier evicts them (write-back)
or as soon as their CPU store completes (write-through), each tier behind
its own admission threshold. Lower tiers are duck-typed (:class:`LowerTier`):
this module moves no bytes itself and imports no tier.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol, cast

from kvoffload.admission.reuse_counts import ReuseCounts
from kvoffload.core.errors import InvalidArgumentError, KVOffloadError
from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import OffloadingEvent, OffloadingManager, PrepareStoreOutput
from kvoffload.core.specs import CPULoadStoreSpec, LoadStoreSpec
from kvoffload.managers.cpu import CPUOffloadingManager
from kvoffload.policies import PENDING_STORE

Target = Callable[[int], memoryview]
"""Where block ``index`` of a read goes: a writable buffer of exactly its payload's size.

Tiers read straight into it and check the bytes there, so a block is copied
once; a block that fails its check leaves garbage in a slot nobody may load.
A target that raises, or has another size, makes that block a failed read.
"""


@dataclass
class TierStats:
    """What one tier did, in blocks. ``failed``: stores or reads that did not happen.

    Written from the scheduler thread and from tiers' I/O threads alike, so
    every write goes through :meth:`add`, under one lock; reading a field
    needs none.
    """

    hit_blocks: int = 0
    stored_blocks: int = 0
    failed: int = 0
    corrupt: int = 0
    evicted: int = 0
    rejected: int = 0
    """Blocks offered for writing that did not fit (everything else was pinned or pending)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        """Add ``counts`` (``failed=2, corrupt=1``) to the named fields, atomically."""
        with self._lock:
            for name, value in counts.items():
                if name.startswith("_") or not hasattr(self, name):
                    raise AttributeError(f"TierStats has no count {name!r}")
                setattr(self, name, getattr(self, name) + value)


class LowerTier(Protocol):
    """A tier below the CPU tier. Called from the scheduler thread only.

    Implementations do their I/O on their own threads and never raise into
    the caller for a failed read or write: they count it in ``stats``.
    """

    medium: str
    stats: TierStats

    def present(self, keys: Sequence[OffloadKey]) -> int:
        """Length of the leading run of ``keys`` this tier holds."""
        ...

    def read(self, keys: Sequence[OffloadKey], target: Target) -> Future[list[bool]]:
        """Read ``keys`` in the background into ``target``; per key, whether it arrived intact."""
        ...

    def write(self, keys: Sequence[OffloadKey], payloads: Sequence[bytes]) -> None:
        """Store ``keys`` in the background (keys already held are skipped)."""
        ...

    def poll(self, wait: bool) -> None:
        """Apply finished background writes; with ``wait``, first wait for all of them."""
        ...

    def take_events(self) -> list[OffloadingEvent]: ...

    def close(self) -> None: ...


class SlotBytesUnavailableError(KVOffloadError):
    """The CPU slots' bytes cannot be reached now (e.g. a worker's buffer is not mapped yet)."""


class SlotBytes(Protocol):
    """The bytes of the CPU tier's slots (the data plane's CPU block store)."""

    def snapshot(self, slots: Sequence[int]) -> list[bytes]:
        """Copies of these slots' bytes, taken now (the slots may be reused next).

        :class:`SlotBytesUnavailableError` if they cannot be read: the stack then
        writes none of these blocks down and counts them as the tiers' failed stores.
        """
        ...

    def view(self, slot: int) -> memoryview:
        """``slot``'s bytes, writable; filled from a tier's I/O threads."""
        ...

    def landed(self, slots: Sequence[int], intact: Sequence[bool]) -> None:
        """A read into these slots' views has finished (in the scheduler thread, before any
        of them becomes loadable); ``intact`` per slot. Views that were staging buffers
        are copied into place here."""
        ...


@dataclass(frozen=True)
class TierSettings:
    """How blocks reach one lower tier.

    ``write_through``: as soon as their CPU store completes; otherwise when
    the CPU tier evicts them. ``store_threshold``: a block is written only
    once lookups have seen it this many times (below 2: every block).
    """

    write_through: bool = False
    store_threshold: int = 0


_Demotion = tuple[list[OffloadKey], list[bytes] | None]
"""Blocks the CPU tier evicted, with copies of their bytes (empty when keeping books only,
``None`` when the bytes could not be read)."""


@dataclass
class _Promotion:
    keys: list[OffloadKey]
    result: Future[list[bool]]


class TieredOffloadingManager(OffloadingManager):
    """The CPU tier plus ``tiers`` in order, e.g. ``[(disk, ...), (remote, ...)]``.

    ``slot_bytes`` gives promotions and demotions real bytes; without it the
    stack keeps books only and lower tiers receive empty payloads.
    ``wait_for_tiers`` makes every call first wait for the I/O started by the
    previous ones: a simulated replay is then deterministic, and a promotion
    always completes by the next call.
    """

    def __init__(
        self,
        cpu: CPUOffloadingManager,
        tiers: Sequence[tuple[LowerTier, TierSettings]] = (),
        slot_bytes: SlotBytes | None = None,
        *,
        wait_for_tiers: bool = False,
        max_tracker_size: int = 64_000,
        reserve_lookups: int = 1024,
    ) -> None:
        if max_tracker_size < 1:
            raise InvalidArgumentError(f"max_tracker_size must be >= 1, got {max_tracker_size}")
        if isinstance(reserve_lookups, bool) or not isinstance(reserve_lookups, int):
            raise InvalidArgumentError(f"reserve_lookups must be an int, got {reserve_lookups!r}")
        if reserve_lookups < 1:
            raise InvalidArgumentError(f"reserve_lookups must be >= 1, got {reserve_lookups}")
        self.cpu = cpu
        self.tiers = [tier for tier, _ in tiers]
        self._settings = [settings for _, settings in tiers]
        self._slot_bytes = slot_bytes
        self._wait = wait_for_tiers
        self._max_tracker = max_tracker_size
        self._counting = any(s.store_threshold >= 2 for s in self._settings)
        self._seen = ReuseCounts(max_tracker_size)
        self._slots: dict[OffloadKey, int] = {}
        self._promotions: list[_Promotion] = []
        self._promoting: set[OffloadKey] = set()
        self._reserved: dict[OffloadKey, int] = {}
        """Landed promotions pinned for their requester, with the lookup count at landing."""
        self._reserve_lookups = reserve_lookups
        self._lookups = 0
        self._failed: OrderedDict[OffloadKey, None] = OrderedDict()
        """Blocks whose promotion failed since a lookup last reached them (capped)."""
        self.cpu_stats = TierStats()
        self.promotion_batches = [0] * len(self.tiers)
        """Reads started per lower tier (each one batch of blocks)."""

    @property
    def promotions_in_flight(self) -> int:
        return len(self._promoting)

    def is_reserved(self, key: OffloadKey) -> bool:
        """Whether ``key`` is a landed promotion pinned until a lookup claims it."""
        return key in self._reserved

    def holds(self, key: OffloadKey) -> bool:
        """Whether the CPU tier has a slot for ``key`` (ready, pinned or pending)."""
        return self.cpu.holds(key)

    def lookup(self, keys: Iterable[OffloadKey]) -> int | None:
        keys = list(keys)
        self._drain()
        self._lookups += 1
        if self._reserved:
            self._expire()
        if self._counting:
            self._count(keys)
        hits = self.cpu.lookup(keys)
        if hits == len(keys) or not self.tiers:
            return self._claim(keys, hits)
        if keys[hits] in self._promoting:
            return None
        rest = keys[hits:]
        if self._failed and keys[hits] in self._failed:
            for key in rest:
                self._failed.pop(key, None)
            return self._claim(keys, hits)
        sources: list[tuple[int, list[OffloadKey]]] = []
        found = 0
        while found < len(rest):
            for index, tier in enumerate(self.tiers):
                held = tier.present(rest[found:])
                if held:
                    sources.append((index, rest[found : found + held]))
                    found += held
                    break
            else:
                break
        if not found:
            return self._claim(keys, hits)
        # Offering the CPU hits too shields them from the eviction that makes room.
        output = self.cpu.prepare_store(keys[: hits + found])
        if output is None:
            fit = self._fitting(keys[: hits + found], rest[:found])
            output = self.cpu.prepare_store(keys[: hits + fit]) if fit else None
            if output is None:
                return self._claim(keys, hits)
        # Evicted bytes are copied out before the promotions may overwrite their slots,
        # and written down after the reads are queued, which then precede any delete.
        demoted = self._placed(output)
        chosen = set(output.keys_to_store)
        started = False
        for index, source in sources:
            wanted = [key for key in dict.fromkeys(source) if key in chosen]
            chosen.difference_update(wanted)  # a key repeated in ``keys`` is read once
            if wanted:
                self._promote(index, wanted)
                started = True
        self._demote(demoted)
        return None if started else self._claim(keys, self.cpu.lookup(keys))

    def prepare_load(self, keys: Iterable[OffloadKey]) -> LoadStoreSpec:
        spec = self.cpu.prepare_load(keys)
        self.cpu_stats.add(hit_blocks=len(spec.block_ids))
        return spec

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        self.cpu.touch(keys)

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        self.cpu.complete_load(keys)

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        self._drain()
        output = self.cpu.prepare_store(keys)
        if output is not None:
            self._demote(self._placed(output))
        return output

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        keys = list(keys)
        landing = [key for key in keys if self._is_pending(key) and key not in self._promoting]
        self.cpu.complete_store(landing, success)
        if not success:
            for key in landing:
                self._slots.pop(key, None)
            return
        self.cpu_stats.add(stored_blocks=len(landing))
        for tier, settings in zip(self.tiers, self._settings, strict=True):
            if settings.write_through:
                self._write(tier, settings, landing)

    def take_events(self) -> list[OffloadingEvent]:
        events = list(self.cpu.take_events())
        for tier in self.tiers:
            events += tier.take_events()
        return events

    def poll(self) -> None:
        """Apply the promotions and tier writes that have finished (all of them when waiting)."""
        self._drain()

    def close(self) -> None:
        """Wait for every promotion and write in flight, then close the tiers."""
        self._drain(wait=True)
        self._release(list(self._reserved))
        for tier in self.tiers:
            tier.poll(wait=True)
            tier.close()

    def _is_pending(self, key: OffloadKey) -> bool:
        block = self.cpu.block_status(key)
        return block is not None and block.ref_cnt == PENDING_STORE

    def _count(self, keys: list[OffloadKey]) -> None:
        self._seen.count(keys)

    def _placed(self, output: PrepareStoreOutput) -> _Demotion:
        """Record new slots; copy out the bytes of the blocks evicted for them."""
        keys = output.evicted_keys
        payloads: list[bytes] | None = []
        if keys:
            self.cpu_stats.add(evicted=len(keys))
            if self._slot_bytes is not None:
                slots = [self._slots.pop(key) for key in keys]
                try:
                    payloads = self._slot_bytes.snapshot(slots)
                except SlotBytesUnavailableError:
                    payloads = None
        if self._slot_bytes is not None and output.keys_to_store:
            ids = cast(CPULoadStoreSpec, output.store_spec).block_ids.tolist()
            self._slots.update(zip(output.keys_to_store, ids, strict=True))
        return keys, payloads

    def _demote(self, demotion: _Demotion) -> None:
        """Write evicted blocks to every write-back tier that admits them."""
        keys, payloads = demotion
        if not keys:
            return
        for tier, settings in zip(self.tiers, self._settings, strict=True):
            if not settings.write_through:
                chosen = self._admitted(settings, keys)
                if chosen and payloads is None:
                    tier.stats.add(failed=len(chosen))
                elif chosen:
                    tier.write(
                        [keys[i] for i in chosen],
                        [payloads[i] for i in chosen] if payloads else [b""] * len(chosen),
                    )

    def _write(self, tier: LowerTier, settings: TierSettings, keys: Sequence[OffloadKey]) -> None:
        """Write ``keys``, ready in CPU slots, to ``tier`` (write-through)."""
        chosen = [keys[i] for i in self._admitted(settings, keys)]
        if not chosen:
            return
        if self._slot_bytes is None:
            tier.write(chosen, [b""] * len(chosen))
            return
        try:
            payloads = self._slot_bytes.snapshot([self._slots[key] for key in chosen])
        except SlotBytesUnavailableError:
            tier.stats.add(failed=len(chosen))
            return
        tier.write(chosen, payloads)

    def _admitted(self, settings: TierSettings, keys: Sequence[OffloadKey]) -> list[int]:
        """Positions of the ``keys`` that ``settings``' admission threshold lets in."""
        if settings.store_threshold < 2:
            return list(range(len(keys)))
        seen, threshold = self._seen.counts, settings.store_threshold
        return [i for i, key in enumerate(keys) if seen.get(key, 0) >= threshold]

    def _fitting(self, protected: list[OffloadKey], run: list[OffloadKey]) -> int:
        """Length of the longest prefix of ``run`` the CPU tier has room to promote."""
        room = self.cpu.num_free_blocks + self.cpu.num_evictable_blocks(set(protected))
        fit = 0
        for key in run:
            if not self.cpu.holds(key):
                if room == 0:
                    break
                room -= 1
            fit += 1
        return fit

    def _claim(self, keys: list[OffloadKey], hits: int) -> int:
        """Answer ``hits``; the reserved blocks among them pass to the caller, unpinned."""
        if self._reserved and hits:
            reserved = self._reserved
            self._release([key for key in dict.fromkeys(keys[:hits]) if key in reserved])
        return hits

    def _expire(self) -> None:
        """Unpin the reservations no lookup claimed within ``reserve_lookups`` lookups."""
        oldest = self._lookups - self._reserve_lookups
        expired = []
        for key, stamp in self._reserved.items():
            if stamp > oldest:
                break
            expired.append(key)
        self._release(expired)

    def _release(self, keys: list[OffloadKey]) -> None:
        if keys:
            for key in keys:
                del self._reserved[key]
            self.cpu.complete_load(keys)

    def _promote(self, index: int, keys: list[OffloadKey]) -> None:
        tier = self.tiers[index]
        self.promotion_batches[index] += 1
        slot_bytes = self._slot_bytes
        target: Target = _no_bytes
        if slot_bytes is not None:
            slots = [self._slots[key] for key in keys]

            def target(index: int) -> memoryview:
                return slot_bytes.view(slots[index])

        self._promoting.update(keys)
        self._promotions.append(_Promotion(keys, tier.read(keys, target)))

    def _drain(self, wait: bool = False) -> None:
        """Finish the promotions whose reads are done (all of them when waiting)."""
        wait = wait or self._wait
        if self._promotions:
            running: list[_Promotion] = []
            for promotion in self._promotions:
                if wait or promotion.result.done():
                    self._land(promotion)
                else:
                    running.append(promotion)
            self._promotions = running
        for tier in self.tiers:
            tier.poll(wait)

    def _land(self, promotion: _Promotion) -> None:
        intact = promotion.result.result()
        keys = promotion.keys
        self._promoting.difference_update(keys)
        if self._slot_bytes is not None:
            self._slot_bytes.landed([self._slots[key] for key in keys], intact)
        good = [key for key, ok in zip(keys, intact, strict=True) if ok]
        bad = [key for key, ok in zip(keys, intact, strict=True) if not ok]
        if good:
            self.cpu.complete_store(good, True)
            self.cpu_stats.add(stored_blocks=len(good))
            # Only the intact prefix serves its requester; the rest are plain CPU blocks.
            usable = intact.index(False) if bad else len(keys)
            if usable:
                self.cpu.prepare_load(keys[:usable])
                stamp = self._lookups
                self._reserved.update((key, stamp) for key in keys[:usable])
        if bad:
            self.cpu.complete_store(bad, False)
            failed = self._failed
            for key in bad:
                self._slots.pop(key, None)
                failed[key] = None
            while len(failed) > self._max_tracker:
                failed.popitem(last=False)


_NOTHING = memoryview(bytearray(0))


def _no_bytes(index: int) -> memoryview:
    """The target of a bookkeeping-only stack: blocks have empty payloads."""
    return _NOTHING
