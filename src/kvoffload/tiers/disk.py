"""The local-disk tier: a slot index over one slot file.

The index is a :class:`~kvoffload.managers.cpu.CPUOffloadingManager`: the
same free list, eviction policy and pending stores as the CPU tier, over
index ids that a permutation fixed at start maps to slots of the file (the
blocks found on restart keep their slots). A store is pending until its
write lands; a read never pins, because a slot's read and a later write into
it, reused by another key, run in call order on that slot's stripe. All file
I/O, its rules and its failures are :class:`~kvoffload.tiers.slot_file.SlotFile`'s.
The index, the free slots and the policy belong to the caller's thread; I/O
threads only report back.
"""

from __future__ import annotations

import bisect
import os
import queue
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import cast

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import EventLog, OffloadingEvent
from kvoffload.core.specs import CPULoadStoreSpec
from kvoffload.core.tier_protocol import (
    MAX_DEADLINE_S,
    MIN_DEADLINE_S,
    Target,
    TierStats,
    check_deadline_s,
    check_io_threads,
)
from kvoffload.managers.cpu import CPUOffloadingManager
from kvoffload.policies import CachePolicy
from kvoffload.tiers.backlog import BacklogFigures, WriteBacklog, default_pending_bytes
from kvoffload.tiers.breaker import CircuitBreaker
from kvoffload.tiers.format import check_fingerprint, payload_size
from kvoffload.tiers.slot_file import (
    DEFAULT_DEADLINE_S,
    FileLayer,
    Outcome,
    Recovery,
    SlotFile,
    footprint,
    slot_start,
)

MEDIUM = "DISK"
MIN_TIMEOUT_MS, MAX_TIMEOUT_MS = MIN_DEADLINE_S * 1000, MAX_DEADLINE_S * 1000
"""A disk operation's deadline bounds in milliseconds, as for the shared tier."""
DEFAULT_TIMEOUT_MS = DEFAULT_DEADLINE_S * 1000
MAX_FILE_BYTES = 2**63 - 1
"""The largest file offset (``off_t``): the full slot file of a tier must stay within it."""


def check_timeout_ms(value: object, what: str) -> float:
    """``value`` (a number, or a numeric string as JSON from a command line holds) as a
    disk deadline in milliseconds, from :data:`MIN_TIMEOUT_MS` to :data:`MAX_TIMEOUT_MS`;
    :class:`InvalidArgumentError` naming ``what`` otherwise."""
    number: float | None = None
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            number = float(value)
        except (ValueError, OverflowError):  # an int past any float: no deadline either
            number = None
    if number is None or not MIN_TIMEOUT_MS <= number <= MAX_TIMEOUT_MS:  # nan fails both
        raise InvalidArgumentError(
            f"{what} must be a number of milliseconds from {MIN_TIMEOUT_MS:.0f} to "
            f"{MAX_TIMEOUT_MS:.0f} (10 minutes), got {value!r}"
        )
    return number


def check_capacity(capacity_blocks: int) -> None:
    """:class:`InvalidArgumentError` unless a full tier's slot file, at the smallest slot
    stride, stays within the largest file offset (the file grows as slots are written; it
    is never allocated up front)."""
    smallest = footprint(capacity_blocks, 0)
    if smallest > MAX_FILE_BYTES:
        raise InvalidArgumentError(
            f"a disk tier of {capacity_blocks:,} blocks needs a slot file of at least "
            f"{smallest:,} bytes when full, past the largest file size (2^63 - 1 bytes)"
        )


class _SlotMap:
    """Index id -> slot: the blocks found on start keep their slots (ids ``0..F-1``), then
    the free slots in order, lowest first, so the file stays compact.

    Computed per id, not listed: a list of every slot takes memory in proportion to the
    capacity, which need not fit (the file is only as long as the slots written).
    """

    def __init__(self, found_slots: list[int]) -> None:
        self._found = found_slots
        used = sorted(found_slots)
        # The k-th free slot is k + j, j the used slots below it: those whose free slots
        # before them (slot - position) are at most k.
        self._free_before = [slot - position for position, slot in enumerate(used)]

    def __getitem__(self, block_id: int) -> int:
        if block_id < len(self._found):
            return self._found[block_id]
        free = block_id - len(self._found)
        return free + bisect.bisect_right(self._free_before, free)


class DiskTier(BacklogFigures):
    """Up to ``capacity_blocks`` blocks in ``directory/<fingerprint hex>/blocks.kvs``.

    ``fsync`` makes each batch durable before its headers make it visible
    (power-loss safety, at a cost in write speed); without it a process crash
    still never exposes a torn block. A full or failing disk (ENOSPC, EIO),
    a removed file, a block too large for the slots or a file system that
    does not answer within ``deadline_s`` turns into counted failed stores
    and reads, never an exception or a wait for the caller; deadline misses
    open ``breaker``, which then refuses disk I/O at once until a trial gets
    through. A write offered while ``max_pending_write_bytes`` of them are queued or under
    way (default: two of 256 MiB per I/O thread) is dropped at once, before any eviction
    for it, counted in ``failed`` and :attr:`skipped_backlog`: a file system slower than
    the write-back never grows the queue without end (the deadline alone let it grow for
    ``deadline_s``). :attr:`recovery` says what the start-up scan found; with
    ``enable_events`` the blocks it recovered are the first event, a store on the tier's
    medium.
    Other layouts' slot files under ``directory`` that no running tier holds (an earlier
    model's) are emptied, oldest first, only while the file system lacks room for this
    tier's full file (see docs/tiers.md, "Slot files of other layouts").
    An empty ``directory`` is refused: as a path it is the working directory, which a
    setting left blank never meant. Start-up raises
    :class:`~kvoffload.tiers.slot_file.DiskTierError` for an unsafe or busy directory.

    Threads: the index is not locked here. :meth:`read`, :meth:`write`, :meth:`poll`,
    :meth:`present`, :meth:`held`, :meth:`take_events`, :meth:`slot_offset` and
    :meth:`close` must run one at a time: callers on several threads hold one lock around
    each call. Not around what they wait for: a read's future and :meth:`wait_written`
    (which touches no index) are resolved by the I/O threads, which change only what is
    thread-safe (``stats``, the backlog, the queue of broken slots), so a writer waits for
    its batch without the lock, its readers going on, and polls under it. Reading
    ``stats``, ``len()`` or :attr:`pending_write_bytes` needs none (a figure of the moment).
    """

    medium = MEDIUM

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity_blocks: int,
        fingerprint: bytes,
        cache_policy: str = "lru",
        *,
        io_threads: int = 2,
        fsync: bool = False,
        enable_events: bool = False,
        deadline_s: float = DEFAULT_DEADLINE_S,
        breaker: CircuitBreaker | None = None,
        file_layer: FileLayer | None = None,
        max_pending_write_bytes: int | None = None,
    ) -> None:
        if (
            isinstance(capacity_blocks, bool)
            or not isinstance(capacity_blocks, int)
            or capacity_blocks < 1
        ):
            raise InvalidArgumentError(
                f"disk capacity must be an integer >= 1 block, got {capacity_blocks!r}"
            )
        if not os.fspath(directory):
            raise InvalidArgumentError(
                f"the disk tier directory must be a non-empty path, got {directory!r}"
            )
        check_io_threads(io_threads)
        if not isinstance(fsync, bool):
            raise InvalidArgumentError(f"fsync must be True or False, got {fsync!r}")
        if breaker is not None and not isinstance(breaker, CircuitBreaker):
            raise InvalidArgumentError(
                f"breaker must be a CircuitBreaker, got {type(breaker).__name__}"
            )
        if file_layer is not None and not isinstance(file_layer, FileLayer):
            raise InvalidArgumentError(
                f"file_layer must be a FileLayer, got {type(file_layer).__name__}"
            )
        check_fingerprint(fingerprint)
        check_deadline_s(deadline_s, "the disk deadline")
        check_capacity(capacity_blocks)
        self._backlog = WriteBacklog(max_pending_write_bytes, default_pending_bytes(io_threads))
        self._index = CPUOffloadingManager(capacity_blocks, cache_policy)
        self._events = EventLog(enable_events)  # checked before any file, lock or thread
        self.capacity_blocks = capacity_blocks
        self.fingerprint = fingerprint
        self.breaker = breaker or CircuitBreaker()
        self._file = SlotFile(
            directory,
            fingerprint,
            capacity_blocks,
            io_threads=io_threads,
            fsync=fsync,
            deadline_s=deadline_s,
            breaker=self.breaker,
            layer=file_layer or FileLayer(),
        )
        self.directory = self._file.directory
        self.path = self._file.path
        self.stats = TierStats()
        self.skipped_backlog = 0
        """Blocks dropped unwritten as they were offered, the writes queued or under way being
        at ``max_pending_write_bytes`` (:attr:`pending_write_bytes`); they count in ``failed``
        too."""
        self.empty_on_close = False
        """Set before a closing that resets the tier (an engine's cache reset): set here, not
        passed to :meth:`close`, as whatever owns the tier (the tiered manager) closes it."""
        self._writes: list[tuple[list[OffloadKey], Future[list[bool]]]] = []
        self._held: dict[Future[list[bool]], Callable[[], None]] = {}
        """What takes each write job's bytes out of the backlog, until a poll counts it."""
        self._broken: queue.SimpleQueue[tuple[OffloadKey, int]] = queue.SimpleQueue()
        found = self._file.found
        self._slot_of = _SlotMap([slot for _, slot in found])
        keys = [key for key, _ in found]
        if keys:
            self._index.prepare_store(keys)
            self._index.complete_store(keys)
            # Announced as stores: a router learns what a restarted tier serves from its
            # first events on, as it learns of blocks written since.
            self._events.record(keys, MEDIUM, removed=False)

    def __len__(self) -> int:
        return self.capacity_blocks - self._index.num_free_blocks

    @property
    def recovery(self) -> Recovery:
        """Blocks recovered and slots dropped (torn, foreign, corrupt, duplicate, beyond the
        capacity) when the tier started."""
        return self._file.recovery

    @property
    def policy(self) -> CachePolicy:
        """The eviction policy instance (for inspection and tests)."""
        return self._index.policy

    @property
    def deadline_s(self) -> float:
        """The deadline of each I/O job, before the time its bytes may take."""
        return self._file.stripes.deadline_s

    @property
    def deadline_misses(self) -> int:
        """I/O jobs failed because the file system did not answer in time."""
        return self._file.stripes.expired

    @property
    def stride(self) -> int | None:
        """Bytes per slot, once the first write (or the file found on start) fixed it."""
        return self._file.stride

    def slot_offset(self, key: OffloadKey) -> int | None:
        """Where ``key``'s slot starts in :attr:`path`, if the tier holds it."""
        block = self._index.block_status(key)
        if block is None or self.stride is None:
            return None
        return slot_start(self._slot_of[block.block_id], self.stride)

    def present(self, keys: Sequence[OffloadKey]) -> int:
        return self._index.lookup(keys)

    def held(self, keys: Sequence[OffloadKey]) -> list[bool]:
        status = self._index.block_status
        return [(block := status(key)) is not None and block.is_ready for key in keys]

    def read(self, keys: Sequence[OffloadKey], target: Target) -> Future[list[bool]]:
        """Read ``keys``; a missing, broken, failed or late block reads as ``False``."""
        keys = list(keys)
        self._index.touch(keys)
        slots = [self._slot(key) for key in keys]
        result: Future[list[bool]] = Future()

        def landed(done: Future[list[Outcome]]) -> None:
            outcomes = done.result()
            ok = [outcome is Outcome.OK for outcome in outcomes]
            corrupt = 0
            for key, slot, outcome in zip(keys, slots, outcomes, strict=True):
                if outcome is Outcome.CORRUPT:
                    self._broken.put((key, slot))
                    corrupt += 1
            failed = sum(
                1
                for slot, outcome in zip(slots, outcomes, strict=True)
                if slot >= 0 and outcome is Outcome.FAILED
            )
            self.stats.add(hit_blocks=sum(ok), corrupt=corrupt, failed=failed)
            result.set_result(ok)

        self._file.read(keys, slots, target).add_done_callback(landed)
        return result

    def _slot(self, key: OffloadKey) -> int:
        """The slot of ``key`` if it is held and written, else ``-1``."""
        block = self._index.block_status(key)
        if block is None or block.ref_cnt < 0:
            return -1
        return self._slot_of[block.block_id]

    def write(self, keys: Sequence[OffloadKey], payloads: Sequence[bytes]) -> int:
        """Queue writes of the keys not held yet, evicting to make room where possible;
        none while the writes not done yet are at ``max_pending_write_bytes`` or the
        breaker would refuse them (counted failed). Returns how many it queued."""
        index = self._index
        offered = {key: payload for key, payload in zip(keys, payloads, strict=True)}
        new = [key for key in offered if not index.holds(key)]
        if not new:
            return 0
        if self._backlog.is_full:
            self.skipped_backlog += len(new)
            self.stats.add(failed=len(new))
            return 0
        if self.breaker.refuses:  # refused before evicting blocks to make room for it
            self.stats.add(failed=len(new))
            return 0
        size = payload_size(offered[new[0]])
        self._file.fix_layout(size)
        output = index.prepare_store(offered)
        if output is None:
            fit = index.num_free_blocks + index.num_evictable_blocks(offered)
            self.stats.add(rejected=len(new) - fit)
            left_out = set(new[fit:])
            output = index.prepare_store([key for key in offered if key not in left_out])
            if output is None:
                return 0
        if output.evicted_keys:
            self.stats.add(evicted=len(output.evicted_keys))
            self._events.record(output.evicted_keys, MEDIUM, removed=True)
        batch = output.keys_to_store
        if not batch:
            return 0
        ids = cast(CPULoadStoreSpec, output.store_spec).block_ids.tolist()
        slots = [self._slot_of[i] for i in ids]
        job = self._file.write(batch, slots, [offered[k] for k in batch])
        release = self._backlog.hold(size * len(batch))
        job.add_done_callback(lambda _: release())
        self._held[job] = release
        self._writes.append((batch, job))
        return len(batch)

    def has_pending_work(self) -> bool:
        """Writes not yet polled, or blocks found broken and not yet forgotten."""
        return bool(self._writes) or not self._broken.empty()

    def poll(self, wait: bool) -> None:
        """Forget blocks found broken, make finished writes readable, free failed ones."""
        broken = []
        while not self._broken.empty():
            key, slot = self._broken.get()
            block = self._index.block_status(key)
            if block is not None and self._slot_of[block.block_id] == slot:
                broken.append(key)
        removed = self._index.remove(broken) if broken else []
        if removed:
            self._events.record(removed, MEDIUM, removed=True)
        running = []
        landed: list[OffloadKey] = []
        for batch, job in self._writes:
            if not (wait or job.done()):
                running.append((batch, job))
                continue
            written = job.result()
            self._held.pop(job)()  # a waiting poll may return before the job's callback ran
            stored = [key for key, ok in zip(batch, written, strict=True) if ok]
            failed = [key for key, ok in zip(batch, written, strict=True) if not ok]
            self._index.complete_store(stored, True)
            landed += stored
            if failed:
                self.stats.add(failed=len(failed))
                self._index.complete_store(failed, False)
        self._writes = running
        if landed:
            self.stats.add(stored_blocks=len(landed))
            self._events.record(landed, MEDIUM, removed=False)

    def wait_written(self) -> None:
        """Wait until the writes queued so far are done or past their deadline. Unlike
        :meth:`poll` it touches no index, so it may run on a thread of its own while the
        caller's thread goes on: a caller that serialises the tier's calls under a lock
        waits here without it (its readers go on), then polls under it."""
        for _, job in list(self._writes):
            job.result()

    def take_events(self) -> list[OffloadingEvent]:
        return self._events.take()

    def close(self) -> None:
        """Finish the writes in flight and close the file; closing twice is harmless. With
        :attr:`empty_on_close` set, the file is emptied first (through its open descriptor,
        never by path), so that a tier opened on the directory next starts empty."""
        self.poll(wait=True)
        self._file.close(empty=self.empty_on_close)
