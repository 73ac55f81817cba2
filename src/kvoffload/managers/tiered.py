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
caller that asked) until an answered lookup reaches any block of it, so the
promotions of other waiting requests cannot evict it before its requester
asks again: a caller that retries always finds what was promoted for it, and
every promoted block is read from its tier once. A lookup that answers it as
hits claims it instead, pinned until the caller's load: vLLM 0.33 asks one
key at a time. A reservation nobody reaches or loads ends after
``reserve_lookups`` further lookups. A block whose promotion failed
answers a miss to the next lookup that reaches it rather than being promoted
again at once, so a caller that retries on ``None`` never waits forever for
a block its tier cannot deliver.

Blocks reach a lower tier either when the CPU tier evicts them (write-back)
or as soon as their CPU store completes (write-through), each tier behind
its own admission: a lookup threshold, and optionally an admission layer
(``kvoffload.admission``, the optimiser included) over a decision book
(:func:`~kvoffload.managers.admit_all.admission_book`) that judges what this
tier sees: the stores offered to it and the lookups that reach it (the keys
past the CPU tier's hit). Lower tiers are duck-typed (:class:`LowerTier`):
this module moves no bytes itself and imports no tier.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import cast

from kvoffload.admission import AdmissionLayer, WriteBudget, resolve_admission
from kvoffload.admission.reuse_counts import MAX_TRACKED_KEYS, reuse_counts
from kvoffload.core.errors import BlockNotPinnedError, InvalidArgumentError, check_integer
from kvoffload.core.keys import SINGLE_KEY_TYPES, OffloadKey, refuse_single_key
from kvoffload.core.manager import OffloadingEvent, OffloadingManager, PrepareStoreOutput
from kvoffload.core.recent import RecentKeys
from kvoffload.core.specs import CPULoadStoreSpec, LoadStoreSpec
from kvoffload.core.tier_protocol import (
    LowerTier,
    SlotBytes,
    SlotBytesUnavailableError,
    Target,
    TierStats,
)
from kvoffload.managers.admit_all import admission_book
from kvoffload.managers.cpu import CPUOffloadingManager
from kvoffload.policies import PENDING_STORE
from kvoffload.policies.base import CachePolicy


@dataclass(frozen=True)
class TierSettings:
    """How blocks reach one lower tier.

    ``write_through``: as soon as their CPU store completes; otherwise when
    the CPU tier evicts them. ``store_threshold``: a block is written only
    once lookups have seen it this many times (below 2: every block); a lookup
    retried after ``None`` is not counted again, as for the admission layers.
    ``admission``: then an admission layer by name decides among those
    (``none``: all pass), modelling a tier of ``capacity`` blocks and keeping,
    with the optimiser, to ``write_budget`` (writes per block reference that
    reaches this tier, or a sized :class:`~kvoffload.admission.WriteBudget`);
    ``admission_params``: the rule's parameters. ``size_key``: the caller's key of
    ``capacity``, which memory the admission layer needs and the machine lacks names.
    """

    write_through: bool = False
    store_threshold: int = 0
    admission: str = "none"
    write_budget: float | WriteBudget | None = None
    capacity: int = 0
    admission_params: object | None = field(default=None, compare=False)
    size_key: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.write_through, bool):
            raise InvalidArgumentError(
                f"a tier's write_through must be true or false, got {self.write_through!r}"
            )
        for name in ("store_threshold", "capacity"):
            check_integer(f"a tier's {name}", getattr(self, name), 0)
        if resolve_admission(self.admission) != "none" and self.capacity < 1:
            raise InvalidArgumentError(
                f"a tier's admission {self.admission!r} needs its capacity (>= 1 block), "
                f"got {self.capacity}"
            )


class _BookSpec(LoadStoreSpec):
    """What a lower tier's decision book hands out: nothing anybody loads."""

    @staticmethod
    def medium() -> str:
        return "TIER"


_Demotion = tuple[int, list[OffloadKey], list[bytes] | None]
"""What one write-back tier takes of the blocks the CPU tier evicted: the tier's index, the
keys, and copies of their bytes (empty ones when keeping books only, ``None`` when the
bytes could not be read)."""


@dataclass
class _Promotion:
    keys: list[OffloadKey]
    result: Future[list[bool]]


RESERVE_LOOKUPS = 1024
"""The default ``reserve_lookups`` (lookups after which a reservation nobody reached or
loaded ends), or twice the CPU tier's blocks where that is more: a caller that looks a
request up one key at a time (vLLM's adapter does where vLLM recorded no key positions, or
scans from the last key back) claims early in its scan, and the claim must outlive the
rest of it, up to a CPU tier's worth of keys. At 1,024 a claim expired mid-scan, the
scan's last promotion evicted it, and a request with more blocks on a lower tier than the
CPU tier had room for was read again scan after scan and ended a miss."""


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
        reserve_lookups: int | None = None,
    ) -> None:
        check_integer("max_tracker_size", max_tracker_size, 1, MAX_TRACKED_KEYS)
        if reserve_lookups is None:
            reserve_lookups = max(RESERVE_LOOKUPS, 2 * cpu.num_blocks)
        check_integer("reserve_lookups", reserve_lookups, 1)
        self.cpu = cpu
        self.tiers = [tier for tier, _ in tiers]
        self._settings = [settings for _, settings in tiers]
        self._slot_bytes = slot_bytes
        self._wait = wait_for_tiers
        self._counting = any(s.store_threshold >= 2 for s in self._settings)
        self._seen = reuse_counts(max_tracker_size)
        self._slots: dict[OffloadKey, int] = {}
        self._promotions: list[_Promotion] = []
        self._promoting: dict[OffloadKey, int] = {}
        self._reserved: dict[OffloadKey, tuple[int, list[OffloadKey]]] = {}
        """Landed promotions pinned for their requester: per key, the lookup count at landing
        and the keys that landed with it (released together)."""
        self._reserve_lookups = reserve_lookups
        self._lookups = 0
        self._failed = RecentKeys(max_tracker_size)
        """Blocks whose promotion failed since a lookup last reached them (capped)."""
        self.cpu_stats = TierStats()
        self.promotion_batches = [0] * len(self.tiers)
        """Reads started per lower tier (each one batch of blocks)."""
        self.admissions: list[AdmissionLayer | None] = [
            admission_book(
                s.admission,
                _BookSpec(),
                s.capacity,
                s.write_budget,
                _policy_of(tier),
                s.admission_params,
                s.size_key,
            )
            for tier, s in zip(self.tiers, self._settings, strict=True)
        ]
        """Per lower tier, its admission layer (``None``: its threshold alone decides)."""
        self._judging = any(layer is not None for layer in self.admissions)
        self._sighted = [RecentKeys(max_tracker_size) for _ in self.tiers]
        """Per lower tier, the last keys of lookups answered ``None`` whose keys its book saw:
        their retries are not new to it. Per tier: a request whose ``tiers`` differ (vLLM's
        ``kv_load_tiers``) is new to a tier the first one could not read."""
        self._counted = RecentKeys(max_tracker_size)
        """The last keys of lookups answered ``None`` whose keys the tiers' thresholds counted:
        their retries are not counted again."""
        self._waiters: dict[OffloadKey, set[Hashable]] = {}
        """Per last key of lookups answered ``None``, the requests (as callers name them)
        whose retries that key's records in ``_sighted`` and ``_counted`` are kept for:
        requests with one prompt share them, and they end with the last such request
        (:meth:`request_finished`) if no answer ended them first."""
        self.offered_blocks = [0] * len(self.tiers)
        self.admitted_blocks = [0] * len(self.tiers)
        """Per lower tier, blocks offered for writing and those its admission let through."""
        self.judged_blocks = 0
        """Block references the lower tiers' admission layers saw (lookups past the CPU hit,
        a retry not counted again): what their write budgets are per."""

    @property
    def tier_settings(self) -> list[TierSettings]:
        """Each lower tier's settings, in tier order."""
        return list(self._settings)

    @property
    def promotions_in_flight(self) -> int:
        return len(self._promoting)

    def is_reserved(self, key: OffloadKey) -> bool:
        """Whether ``key`` is a landed promotion pinned until a lookup claims it."""
        return key in self._reserved

    def is_promoting(self, key: OffloadKey) -> bool:
        """Whether ``key``'s promotion into the CPU tier is in flight (its slot is pending;
        a pending slot that is not promoting is a CPU store in flight)."""
        return key in self._promoting

    def promoting_from(self, key: OffloadKey) -> str | None:
        """The medium of the lower tier ``key``'s promotion in flight reads from (``None``:
        none in flight), for callers that report where a hit came from."""
        index = self._promoting.get(key)
        return None if index is None else self.tiers[index].medium

    def holds(self, key: OffloadKey) -> bool:
        """Whether the CPU tier has a slot for ``key`` (ready, pinned or pending)."""
        return self.cpu.holds(key)

    def lookup(
        self,
        keys: Iterable[OffloadKey],
        tiers: Collection[int] | None = None,
        *,
        request: Hashable | None = None,
    ) -> int | None:
        """The seed's lookup; ``tiers``: the indices of the lower tiers it may promote from
        and whose admission layers it counts in (``None``: every one), as a caller's request
        may name them (vLLM's per-request ``kv_load_tiers``). The CPU tier always answers.
        ``request``: the caller's name for the request, whose :meth:`request_finished`
        then ends what its ``None`` answers recorded for a retry that will not come."""
        if type(keys) is not list and isinstance(keys, SINGLE_KEY_TYPES):
            refuse_single_key(keys, "lookup")
        keys = list(keys)
        self._drain()
        self._lookups += 1
        if self._reserved:
            self._expire()
        hits = self._lookup(keys, tiers)
        if self._counting and keys:
            _remember_unanswered(self._counted, keys[-1], hits is None)
        if self._judging and keys and hits is not None:
            # Answered, on any path (a retry the promotions it waited for answer from the
            # CPU tier alone as well): the request's next lookup is a new reference.
            for sighted in self._sighted:
                sighted.discard(keys[-1])
        if request is not None and keys and (self._counting or self._judging):
            self._note_waiter(keys[-1], request, hits is None)
        if hits is not None and self._reserved:
            self._release_reached(keys, keys[:hits])
        return hits

    def _lookup(self, keys: list[OffloadKey], tiers: Collection[int] | None) -> int | None:
        """:meth:`lookup`'s answer, once the finished promotions have landed."""
        if self._counting and keys and keys[-1] not in self._counted:
            self._count(keys)
        hits = self.cpu.lookup(keys)
        if hits == len(keys) or not self.tiers or (tiers is not None and not tiers):
            return hits
        if keys[hits] in self._promoting:
            return None
        if self._judging:
            return self._judged(keys, hits, tiers)
        return self._reach(keys, hits, tiers)

    def _reach(
        self, keys: list[OffloadKey], hits: int, tiers: Collection[int] | None
    ) -> int | None:
        """The lookup past the CPU tier's ``hits``: promote what the lower tiers hold."""
        rest = keys[hits:]
        if self._failed and keys[hits] in self._failed:
            for key in rest:
                self._failed.discard(key)
            return hits
        sources: list[tuple[int, list[OffloadKey]]] = []
        found = 0
        while found < len(rest):
            for index, tier in enumerate(self.tiers):
                if tiers is not None and index not in tiers:
                    continue
                held = tier.present(rest[found:])
                if held:
                    sources.append((index, rest[found : found + held]))
                    found += held
                    break
            else:
                break
        if not found:
            return hits
        # Offering the CPU hits too shields them from the eviction that makes room, and so
        # are the request's CPU blocks after the run, which its hit run reaches once this
        # and any later promotion land (a caller that touched none of its keys, as vLLM's
        # scheduler, would otherwise see them evicted as the coldest, written down and read
        # back); if that leaves no room, they are not shielded.
        holds = self.cpu.holds
        after = [key for key in keys[hits + found :] if holds(key)]
        output = self.cpu.prepare_store(keys[: hits + found] + after) if after else None
        if output is None:
            output = self.cpu.prepare_store(keys[: hits + found])
        if output is None:
            fit = self._fitting(keys[: hits + found], rest[:found])
            output = self.cpu.prepare_store(keys[: hits + fit]) if fit else None
            if output is None:
                return hits
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
        return None if started else self.cpu.lookup(keys)

    def _judged(
        self, keys: list[OffloadKey], hits: int, tiers: Collection[int] | None
    ) -> int | None:
        """:meth:`_reach`, first showing the books of the lower tiers it may read (``tiers``;
        a tier the request may not read serves none of it) the keys this lookup takes past
        the CPU tier, once per request: a retry after ``None`` is no new reference.
        The retry is known by its last key (per tier: a tier the request's first try could
        not read has not seen it), which (keys chain their prefix) names the
        request's prompt whatever its first: vLLM re-matches the GPU prefix on each try, so
        a retry may start elsewhere, and known by its keys' count too it was counted again.
        No offer follows such a sighting (the tier's stores come from the CPU tier's
        write-back), so whether the tier served it does not matter to the book."""
        request = keys[-1]
        rest = keys[hits:]
        shown = [
            (index, layer)
            for index, layer in enumerate(self.admissions)
            if layer is not None
            and (tiers is None or index in tiers)
            and request not in self._sighted[index]
        ]
        if shown:
            self.judged_blocks += len(rest)
            for _, layer in shown:
                layer.begin_request(rest, will_offer=False)
        found = self._reach(keys, hits, tiers)
        if found is None:
            for index, _ in shown:
                self._sighted[index].add(request)
        return found

    def release_reservations(self, keys: Iterable[OffloadKey]) -> None:
        """The requester that looked ``keys`` up has gone (finished or aborted): end every
        reservation they reach, as an answered lookup that reaches one without hitting it
        does. An aborted request's promotion would otherwise stay pinned for
        ``reserve_lookups`` lookups, and on a small CPU tier refuse stores meanwhile."""
        if self._reserved:
            self._release_reached(list(keys), [])

    def request_waits(self, request: Hashable, keys: Sequence[OffloadKey]) -> None:
        """Name ``request`` as the one whose lookup of ``keys`` was just answered ``None``,
        as :meth:`lookup`'s ``request`` does, for a caller whose lookups reach this manager
        through layers that pass no name on (the simulator's engine under a reuse filter,
        an admission layer or observers): its :meth:`request_finished` then ends the
        records kept for its retry."""
        if keys and (self._counting or self._judging):
            self._note_waiter(keys[-1], request, True)

    def request_finished(self, request: Hashable) -> None:
        """The request named ``request`` in its lookups has gone (finished or aborted): the
        retry its ``None`` answers were recorded for will not come. Each record it shares
        with no other waiting request ends; left, it took the next new request with that
        prompt for the retry, hidden from the lower tiers' admission layers and thresholds.
        A record another request with the same prompt waits on stays: that one's retry is
        still no new reference."""
        if not self._waiters:
            return
        ended = []
        for last, waiters in self._waiters.items():
            waiters.discard(request)
            if not waiters:
                ended.append(last)
        for last in ended:
            del self._waiters[last]
            self._counted.discard(last)
            for sighted in self._sighted:
                sighted.discard(last)

    def prepare_load(self, keys: Iterable[OffloadKey]) -> LoadStoreSpec:
        """Pin ``keys`` for a load; the reservations a lookup claimed for it pass to the load."""
        if not isinstance(keys, SINGLE_KEY_TYPES):  # refused by the CPU tier
            keys = list(keys)
        spec = self.cpu.prepare_load(keys)
        if self._reserved:
            self._release_reached(keys, [])
        self.cpu_stats.add(hit_blocks=len(spec.block_ids))
        return spec

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        self.cpu.touch(keys)

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        """Unpin ``keys``. The pin a reservation holds is not the caller's: releasing it
        is :class:`BlockNotPinnedError`, as for any key no load holds, and changes nothing
        (taken, it made the reservation's own release fail in a later lookup and leave the
        other blocks it held pinned for good)."""
        if self._reserved and not isinstance(keys, SINGLE_KEY_TYPES):
            keys = list(keys)
            self._refuse_reserved_pins(keys)
        self.cpu.complete_load(keys)

    def _refuse_reserved_pins(self, keys: list[OffloadKey]) -> None:
        """Raise for the first of ``keys`` listed more often than loads pin it beside its
        reservation."""
        reserved, status = self._reserved, self.cpu.block_status
        released: dict[OffloadKey, int] = {}
        for key in keys:
            if key in reserved:
                released[key] = count = released.get(key, 0) + 1
                block = status(key)
                if block is None or block.ref_cnt - 1 < count:
                    raise BlockNotPinnedError(
                        f"cannot complete a load of {key!r}: no load holds it", key
                    )

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        self._drain()
        output = self.cpu.prepare_store(keys)
        if output is not None:
            self._demote(self._placed(output))
        return output

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        # One key alone: its bytes, as keys, would complete nothing.
        if type(keys) is not list and isinstance(keys, SINGLE_KEY_TYPES):
            refuse_single_key(keys, "complete_store")
        # Each key once: a key listed twice lands once, and is counted and written once.
        landing = [
            key
            for key in dict.fromkeys(keys)
            if self._is_pending(key) and key not in self._promoting
        ]
        self.cpu.complete_store(landing, success)
        if not success:
            for key in landing:
                self._slots.pop(key, None)
            return
        self.cpu_stats.add(stored_blocks=len(landing))
        for index, settings in enumerate(self._settings):
            if settings.write_through and landing:
                self._write(index, landing)

    def take_events(self) -> list[OffloadingEvent]:
        events = list(self.cpu.take_events())
        for tier in self.tiers:
            events += tier.take_events()
        return events

    def poll(self) -> None:
        """Apply the promotions and tier writes that have finished (all of them when waiting)."""
        self._drain()

    def has_pending_work(self) -> bool:
        """Whether a promotion or a tier write is in flight or not yet applied by :meth:`poll`."""
        return bool(self._promotions) or any(tier.has_pending_work() for tier in self.tiers)

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

    def _note_waiter(self, last: OffloadKey, request: Hashable, unanswered: bool) -> None:
        """Keep ``request`` among the waiters of ``last``'s records while its lookups are
        answered ``None``; an answer ends the records, and so their waiters."""
        if not unanswered:
            self._waiters.pop(last, None)
            return
        waiters = self._waiters.get(last)
        if waiters is None:
            self._waiters[last] = {request}
        else:
            waiters.add(request)

    def _count(self, keys: list[OffloadKey]) -> None:
        self._seen.count(keys)

    def _placed(self, output: PrepareStoreOutput) -> list[_Demotion]:
        """Record new slots; ask each write-back tier which of the blocks evicted for them
        it takes, and copy out the bytes of those alone (a block no tier takes, as every
        block where the lower tiers are write-through, is never copied)."""
        keys = output.evicted_keys
        demotions: list[_Demotion] = []
        if keys:
            self.cpu_stats.add(evicted=len(keys))
            slots = [self._slots.pop(key) for key in keys] if self._slot_bytes is not None else []
            chosen_by_tier = [
                (index, chosen)
                for index, settings in enumerate(self._settings)
                if not settings.write_through and (chosen := self._admitted(index, keys))
            ]
            copies: dict[int, bytes] | None = None
            wanted = sorted({i for _, chosen in chosen_by_tier for i in chosen})
            if self._slot_bytes is not None and wanted:
                try:
                    snapshot = self._slot_bytes.snapshot([slots[i] for i in wanted])
                    copies = dict(zip(wanted, snapshot, strict=True))
                except SlotBytesUnavailableError:
                    pass
            for index, chosen in chosen_by_tier:
                payloads: list[bytes] | None
                if self._slot_bytes is None:
                    payloads = [b""] * len(chosen)
                else:
                    payloads = None if copies is None else [copies[i] for i in chosen]
                demotions.append((index, [keys[i] for i in chosen], payloads))
        if self._slot_bytes is not None and output.keys_to_store:
            ids = cast(CPULoadStoreSpec, output.store_spec).block_ids.tolist()
            self._slots.update(zip(output.keys_to_store, ids, strict=True))
        return demotions

    def _demote(self, demotions: list[_Demotion]) -> None:
        """Write evicted blocks to the write-back tiers that took them."""
        for index, keys, payloads in demotions:
            tier = self.tiers[index]
            if payloads is None:
                tier.stats.add(failed=len(keys))
            else:
                self._wrote(index, tier.write(keys, payloads))

    def _write(self, index: int, keys: Sequence[OffloadKey]) -> None:
        """Write ``keys``, ready in CPU slots, to lower tier ``index`` (write-through)."""
        tier = self.tiers[index]
        chosen = [keys[i] for i in self._admitted(index, keys)]
        if not chosen:
            return
        if self._slot_bytes is None:
            self._wrote(index, tier.write(chosen, [b""] * len(chosen)))
            return
        try:
            payloads = self._slot_bytes.snapshot([self._slots[key] for key in chosen])
        except SlotBytesUnavailableError:
            tier.stats.add(failed=len(chosen))
            return
        self._wrote(index, tier.write(chosen, payloads))

    def _wrote(self, index: int, blocks: int) -> None:
        """Charge lower tier ``index``'s admission layer for the ``blocks`` its tier set out
        to write: not the blocks it admitted, of which the tier skips those it holds (a
        write budget charged for these was left a quarter unspent on a disk run)."""
        layer = self.admissions[index]
        if layer is not None:
            layer.wrote(blocks)

    def _admitted(self, index: int, keys: Sequence[OffloadKey]) -> list[int]:
        """Positions of the ``keys`` that lower tier ``index``'s admission lets in: its
        threshold, then its admission layer."""
        settings = self._settings[index]
        if settings.store_threshold < 2:
            chosen = list(range(len(keys)))
        else:
            seen, threshold = self._seen.get, settings.store_threshold
            chosen = [i for i, key in enumerate(keys) if seen(key) >= threshold]
        layer = self.admissions[index]
        if layer is not None and chosen:
            # Charged by _wrote for what the tier writes of these, once it has written.
            stored = set(layer.admit(list(dict.fromkeys(keys[i] for i in chosen))))
            chosen = [i for i in chosen if keys[i] in stored]
        self.offered_blocks[index] += len(keys)
        self.admitted_blocks[index] += len(chosen)
        return chosen

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

    def _release_reached(self, keys: list[OffloadKey], hits: list[OffloadKey]) -> None:
        """End every reservation that ``keys``, answered, reach a block of, all of its
        blocks; one that the answer's ``hits`` reach is claimed instead (stamped anew, it
        waits for the caller's load or ``reserve_lookups`` lookups).

        Reached but not hit, it is of no use to this lookup, which is its requester's retry
        started elsewhere (vLLM's scheduler re-matches the GPU prefix on each try: past
        blocks the GPU cached meanwhile, or before a block it evicted and no tier holds) or
        another request of the same prefix; kept pinned until it was hit, such reservations
        filled a small CPU tier. Hit, it is kept for the load: vLLM 0.33 looks a request up
        one key at a time and scans on, and a block released by its one-key hit was evicted
        by the promotion the scan's next key started. A lookup answered ``None`` releases
        nothing: it waits for a promotion in front of them, and its request will ask again.
        """
        reserved = self._reserved
        reached = {id(reserved[key][1]): reserved[key][1] for key in keys if key in reserved}
        if not reached:
            return
        claimed = set(hits)
        for batch in reached.values():  # each once, however many of its keys are reached
            held = [key for key in batch if key in reserved]
            if claimed.isdisjoint(batch):
                self._release(held)
            else:  # moved to the end: the order of reservations is their stamps' order
                for key in held:
                    del reserved[key]
                reserved.update(dict.fromkeys(held, (self._lookups, batch)))

    def _expire(self) -> None:
        """Unpin the reservations no lookup claimed within ``reserve_lookups`` lookups."""
        oldest = self._lookups - self._reserve_lookups
        expired = []
        for key, (stamp, _) in self._reserved.items():
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

        self._promoting.update(dict.fromkeys(keys, index))
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
        for key in keys:
            self._promoting.pop(key, None)
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
                batch = keys[:usable]
                self._reserved.update(dict.fromkeys(batch, (self._lookups, batch)))
        if bad:
            self.cpu.complete_store(bad, False)
            for key in bad:
                self._slots.pop(key, None)
            self._failed.add_all(bad)


def _remember_unanswered(table: RecentKeys, request: OffloadKey, unanswered: bool) -> None:
    """Keep ``request`` (a lookup's last key) in ``table`` while its lookups are answered
    ``None``; forget it once answered."""
    if unanswered:
        table.add(request)
    else:
        table.discard(request)


def _policy_of(tier: LowerTier) -> CachePolicy | None:
    """The eviction policy a tier keeps its index by, if it has one (the disk tier does;
    the shared server evicts by its own rules)."""
    policy = getattr(tier, "policy", None)
    return policy if isinstance(policy, CachePolicy) else None


_NOTHING = memoryview(bytearray(0))


def _no_bytes(index: int) -> memoryview:
    """The target of a bookkeeping-only stack: blocks have empty payloads."""
    return _NOTHING
