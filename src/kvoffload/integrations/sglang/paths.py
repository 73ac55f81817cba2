"""One tier below SGLang's host pool, as the backend drives it: lock, admission, counters.

SGLang calls its storage backend from several threads at once (the prefetch
query, the prefetch I/O and the backup thread); our tiers expect one caller
for what changes their state, so that goes through the path's lock (see
:class:`TierPath`). The admission layer
sees what this tier sees: the lookups that reach L3 (sightings) and the
host tier's write-backs (offers); a write-back of pages no lookup asked for (SGLang
queries no prompt whose uncached part is below its prefetch threshold, nor generated
pages, nor a query's batches past one not found whole) is a request of its own, its
pages computed; it sits on an ``AdmitAllManager`` that keeps
nothing, since the tier below decides eviction itself. Tier and layer come from the
stack builder (:func:`kvoffload.tiers.stack.lower_tiers`). No SGLang import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, cast

from kvoffload.admission import AdmissionLayer
from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import OffloadingEvent
from kvoffload.core.recent import RecentKeys
from kvoffload.core.specs import LoadStoreSpec
from kvoffload.core.tier_protocol import LowerTier, Target, TierStats
from kvoffload.tiers.block_sets import Payload
from kvoffload.tiers.deadline import done_future
from kvoffload.tiers.disk import DiskTier
from kvoffload.tiers.remote import RemoteTier

EventSink = Callable[[list[OffloadingEvent]], None]

logger = logging.getLogger(__name__)

LOOKED_UP_PAGES = 1 << 16
"""Pages looked up and not yet written back that a path remembers, the oldest forgotten
first: SGLang writes a query's missed pages back once their prefill is done, so only the
pages of the requests in prefill wait here. One forgotten too early is judged again at its
write-back (a sighting counted twice); nothing is lost."""


@dataclass
class TierCounters:
    """What one tier did for SGLang, in pages, since the backend started."""

    lookups: int = 0
    lookup_hit_pages: int = 0
    stores_offered: int = 0
    stores_admitted: int = 0
    stores_skipped: int = 0
    """Offered pages the admission layer held back (reported stored to SGLang, not written)."""
    stores_completed: int = 0
    stores_failed: int = 0
    loads: int = 0
    """Pages read intact into the host pool."""
    loads_failed: int = 0
    """Pages asked for and not delivered: absent, unreachable, corrupt or evicted meanwhile."""
    bytes_stored: int = 0
    bytes_loaded: int = 0
    evictions: int = 0
    corrupt: int = 0
    unavailable: int = 0
    """Calls refused by the open breaker or failed by the server (the shared tier only)."""
    skipped_full: int = 0
    """Pages not sent, the server resting after refusing a store as full (``OOM``) or unable
    to persist (``MISCONF``); counted in ``stores_failed`` too (the shared tier only)."""
    rejected: int = 0
    held_pages: int = 0
    """Disk: pages in the slot file; shared tier: pages this rank wrote, a rewrite counted
    again (what the server holds is its own to count: not exported as held pages)."""

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class _Spec(LoadStoreSpec):
    @staticmethod
    def medium() -> str:
        return "L3"


L3_SPEC = _Spec()
"""What the L3 tiers' admission books hand out (nothing anybody loads through them)."""


def _outcome(job: Future[list[bool]], n: int) -> list[bool]:
    """A read's per-key results; all failed if its I/O thread died unexpectedly."""
    try:
        return job.result()
    except Exception:  # a tier's surprise is a failed read, never SGLang's exception
        return [False] * n


class WriteBatch:
    """The pages of one write in progress: :meth:`send` hands over their bytes."""

    def __init__(self, keys: Sequence[OffloadKey], admitted: set[OffloadKey]) -> None:
        self.keys = keys
        self.admitted = admitted
        self.result = [True] * len(keys)
        """Per key once the batch is done: ``False`` only for a write that failed."""
        self.holds = [False] * len(keys)
        """Per key once the batch is done: whether the tier is known to hold it (written, or
        held already); a page admission held back counts only where the tier's own index
        says so (the disk tier), as asking a server would cost a round trip."""
        self.stored = 0
        """Pages the tier wrote once the batch is done (not those it held already)."""
        self.sent: list[int] = []
        self.tier: LowerTier | None = None

    def send(self, payloads: Sequence[Payload]) -> None:
        """Write the admitted ones of ``keys`` from ``payloads`` (one buffer or its parts
        each), in the background: the bytes must stay as they are until the batch is done."""
        chosen = [i for i in range(len(payloads)) if self.keys[i] in self.admitted]
        if not chosen or self.tier is None:
            return
        # Both tiers send any buffer, or parts, as they are; the protocol says bytes.
        data = cast(Sequence[bytes], [payloads[i] for i in chosen])
        self.tier.write([self.keys[i] for i in chosen], data)
        self.sent += chosen


class OffTier:
    """A tier that holds nothing: what a disk tier becomes when it cannot reopen after a
    :meth:`TierPath.clear`, so that its reads and look-ups miss and its writes fail, counted,
    rather than raise into SGLang."""

    def __init__(self, medium: str) -> None:
        self.medium = medium
        self.stats = TierStats()

    def present(self, keys: Sequence[OffloadKey]) -> int:
        return 0

    def held(self, keys: Sequence[OffloadKey]) -> list[bool]:
        return [False] * len(keys)

    def read(self, keys: Sequence[OffloadKey], target: Target) -> Future[list[bool]]:
        return done_future([False] * len(keys))

    def write(self, keys: Sequence[OffloadKey], payloads: Sequence[bytes]) -> int:
        return 0

    def poll(self, wait: bool) -> None:
        return None

    def wait_written(self) -> None:
        return None

    def has_pending_work(self) -> bool:
        return False

    def take_events(self) -> list[OffloadingEvent]:
        return []

    def close(self) -> None:
        return None


Opener = Callable[[], LowerTier]
"""Opens the tier (again, after :meth:`TierPath.clear` emptied a disk tier)."""


class TierPath:
    """The tier ``open_tier`` gives, behind the admission layer ``layer`` (``None``: every
    page is written); ``page_bytes`` sizes the byte counts.

    Locks: ``_lock`` serialises what changes the tier's own state (writes, polls, events,
    and for the disk tier every call: its index belongs to one caller), held only for
    those calls, never while a write's I/O is under way (:meth:`LowerTier.wait_written`);
    ``_write_lock`` lets one write batch through at a time, and :meth:`close` waits for it. The
    shared tier's look-ups and reads are thread-safe, so a prefetch never takes ``_lock`` there.
    """

    def __init__(
        self,
        name: str,
        open_tier: Opener,
        layer: AdmissionLayer | None,
        page_bytes: int,
        sink: EventSink | None = None,
    ) -> None:
        self.name = name
        self.page_bytes = page_bytes
        self.layer = layer
        self._counters = TierCounters()
        self._open = open_tier
        self._sink = sink
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._admission_lock = threading.Lock()
        self.tier = open_tier()
        self._lookup_lock: contextlib.AbstractContextManager[Any] = (
            contextlib.nullcontext() if isinstance(self.tier, RemoteTier) else self._lock
        )
        self._seen = (0, 0, 0, 0, 0)
        """The tier's (evicted, corrupt, rejected, unavailable, skipped_full) already in the
        counters."""
        self._looked_up = RecentKeys(LOOKED_UP_PAGES)
        """Pages a lookup asked this tier for, until their write-back (see :meth:`_admit`)."""

    def counters(self) -> TierCounters:
        """A snapshot of the counters, the tier's own counts brought up to date."""
        with self._count_lock:
            self._derive()
            return dataclasses.replace(self._counters)

    def present(self, keys: Sequence[OffloadKey]) -> int:
        """Leading run of ``keys`` this tier holds (counted by :meth:`looked_up`: a look-up
        of SGLang's may ask a tier more than once)."""
        with self._lookup_lock:
            return self.tier.present(keys)

    def looked_up(self, hit_pages: int) -> None:
        """One look-up of SGLang's reached this tier and found ``hit_pages`` of its run here."""
        with self._count_lock:
            self._counters.lookups += 1
            self._counters.lookup_hit_pages += hit_pages

    def sighted(self, request: Sequence[OffloadKey], served: bool, held: int = 0) -> None:
        """A lookup reached L3 for ``request`` past its first ``held`` pages (those held
        above L3, shown for the request's chain but not looked up here); ``served``: this
        tier held part of what was asked. The pages asked for are remembered until their
        write-back, which :meth:`_admit` then knows is no request of its own."""
        if self.layer is None or not request:
            return
        with self._admission_lock:
            self.layer.begin_request(request, tier_hit=served, gpu_held=held)
            self._looked_up.add_all(request[held:])

    def read(self, keys: Sequence[OffloadKey], target: Target) -> list[bool]:
        """Read ``keys`` into ``target`` (per key one buffer or its parts); per key, whether
        it arrived intact."""
        if not keys:
            return []
        with self._lookup_lock:
            job = self.tier.read(keys, target)
        intact = _outcome(job, len(keys))
        if isinstance(self.tier, DiskTier):
            with self._lock:
                self.tier.poll(wait=False)  # forgets the broken slots at once
                self._drain_events()
        got = sum(intact)
        with self._count_lock:
            c = self._counters
            c.loads += got
            c.loads_failed += len(keys) - got
            c.bytes_loaded += got * self.page_bytes
        return intact

    def write(
        self,
        keys: Sequence[OffloadKey],
        payloads: Sequence[Payload],
        prefix: Sequence[OffloadKey] = (),
    ) -> WriteBatch:
        """Offer ``keys`` to admission (``prefix``: the request's pages before them, as
        SGLang passes them) and write the admitted ones, waiting for all (the bytes are the
        tier's until then); the done batch says per key ``False`` only for a write that
        failed (a page held back by admission reads ``True``), and how many pages the tier
        wrote.

        One batch at a time (``_write_lock``), so the tier's stored count moves by this
        batch's pages alone. The path's lock is held to queue the writes and to poll
        them, not while they are under way (:meth:`LowerTier.wait_written`): SGLang's
        prefetch look-ups and reads of the disk tier (a request waits on them) would
        otherwise wait for the whole batch, up to its deadline."""
        batch = WriteBatch(keys, self._admit(keys, prefix) if keys else set())
        with self._write_lock:
            with self._lock:
                tier = batch.tier = self.tier
                stored_before = tier.stats.stored_blocks
                try:
                    batch.send(payloads)
                except BaseException:
                    self._finish(batch, tier, stored_before)  # what was queued, waited for
                    raise
            tier.wait_written()
            with self._lock:
                # A clear or a close meanwhile closed ``tier`` (its writes done): the batch
                # ends on it, as if that came just after.
                self._finish(batch, tier, stored_before)
        return batch

    def _finish(self, batch: WriteBatch, tier: LowerTier, stored_before: int) -> None:
        """Make ``batch``'s writes readable, then its results and counters (under the lock)."""
        tier.poll(wait=True)
        stored = tier.stats.stored_blocks - stored_before
        sent = batch.sent
        keys = batch.keys
        if isinstance(tier, DiskTier):
            # Every key: one that admission held back may be on disk already.
            batch.holds = tier.held(keys)
            outcome = [batch.holds[i] for i in sent]
        elif 0 < stored < len(sent):
            # The shared tier asked only when some pages failed beside others
            # (a Cluster node down): which ones, for the result and the counters.
            outcome = tier.held([keys[i] for i in sent])
        else:
            outcome = [stored == len(sent)] * len(sent)
        self._drain_events()
        batch.stored = stored
        with self._count_lock:
            c = self._counters
            c.stores_completed += stored
            c.stores_failed += outcome.count(False)
            c.bytes_stored += stored * self.page_bytes
        for i, ok in zip(sent, outcome, strict=True):
            batch.result[i] = batch.holds[i] = ok

    def clear(self, announce: Callable[[], None]) -> None:
        """Drop every page of a disk tier (this process's own), then ``announce`` it before
        the tier's lock goes: a page written meanwhile lands, and is announced, after the
        announcement, never before it (a router applying events in order would drop a page
        the tier holds). A shared tier keeps its pages: other instances on the server use
        them and announced them to their routers, and being content-addressed under the
        fingerprint they stay valid."""
        with self._lock:
            tier = self.tier
            if isinstance(tier, DiskTier):
                with self._count_lock:
                    self._derive()
                    tier.empty_on_close = True  # by its open file: a path may be a link now
                    tier.close()
                    self.tier = self._reopened(tier)
                    self._seen = (0, 0, 0, 0, 0)
                    self._derive()
            announce()

    def _reopened(self, closed: DiskTier) -> LowerTier:
        """A new, empty disk tier in place of ``closed``; the tier off (logged) when its file
        or directory cannot be used any more (taken by another process, replaced by a link):
        the closed tier's index would go on claiming pages it can no longer read."""
        try:
            return self._open()
        except Exception as exc:  # once the tier is up, nothing raises into SGLang
            logger.warning(
                "kvoffload %s tier could not reopen after a clear, so it is off until restart: %s",
                self.name,
                exc,
            )
            return OffTier(closed.medium)

    def close(self) -> None:
        """Close the tier once a write batch under way has its outcome: closed beneath it,
        a shared tier's batch that partly failed asked the closed tier which pages landed
        and read every one as failed."""
        with self._write_lock, self._lock:
            self.tier.poll(wait=True)
            self._drain_events()
            self.tier.close()

    def admission_stats(self) -> dict[str, float] | None:
        """The layer's numbers, read at every scheduler step: its step stats, which leave
        out the cumulative what-if figures the numbers do not show."""
        if self.layer is None:
            return None
        with self._admission_lock:
            return self.layer.step_stats().numbers()

    def _admit(self, keys: Sequence[OffloadKey], prefix: Sequence[OffloadKey]) -> set[OffloadKey]:
        """The offered ``keys`` admission passes. Those past the leading run a lookup asked
        for were computed unasked: they are a request of their own, its held part ``prefix``
        and that run, told to the layer before the offer, so that every candidate rule
        judges them (the layer counts only the pages of requests it was told of)."""
        if self.layer is None:
            admitted = set(keys)
        else:
            with self._admission_lock:
                asked = self._looked_up
                covered = 0
                while covered < len(keys) and keys[covered] in asked:
                    covered += 1
                for key in keys:
                    asked.discard(key)
                if covered < len(keys):
                    self.layer.begin_request(
                        [*prefix, *keys], gpu_held=len(prefix) + covered, looked_up=False
                    )
                output = self.layer.prepare_store(keys)
                if keys:
                    self.layer.end_request(keys)
            admitted = set() if output is None else set(output.keys_to_store)
        with self._count_lock:
            c = self._counters
            c.stores_offered += len(keys)
            c.stores_admitted += len(admitted)
            c.stores_skipped += len(set(keys)) - len(admitted)
        return admitted

    def _derive(self) -> None:
        """Add the tier's new counts of its own (under the count lock; they are plain ints)."""
        tier, c = self.tier, self._counters
        unavailable, skipped = (
            (tier.unavailable, tier.skipped_full) if isinstance(tier, RemoteTier) else (0, 0)
        )
        now = (tier.stats.evicted, tier.stats.corrupt, tier.stats.rejected, unavailable, skipped)
        before, self._seen = self._seen, now
        c.evictions += now[0] - before[0]
        c.corrupt += now[1] - before[1]
        c.rejected += now[2] - before[2]
        c.unavailable += now[3] - before[3]
        c.skipped_full += now[4] - before[4]
        if isinstance(tier, DiskTier):
            c.held_pages = len(tier)
        else:
            c.held_pages = tier.stats.stored_blocks

    def _drain_events(self) -> None:
        """Hand the tier's events on (under the lock)."""
        events = self.tier.take_events()
        if events and self._sink is not None:
            self._sink(events)
