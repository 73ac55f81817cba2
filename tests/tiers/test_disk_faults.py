"""The disk tier under a hung file system, a crash between a slot's two writes, and bad headers.

A hung file system is a :class:`FileLayer` whose calls, once it is stalled,
wait until it is released, as calls into an NFS mount whose server stopped
answering do; the slot file under it is real.
"""

from __future__ import annotations

import errno
import functools
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path
from types import FrameType

import pytest
from tier_helpers import ByteSlots, content, flip_byte

from kvoffload import CPUOffloadingManager, OffloadKey, block_id_key
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.layout import layout_preset
from kvoffload.managers.tiered import TieredOffloadingManager, TierSettings
from kvoffload.tiers import CircuitBreaker, DiskTier, layout_fingerprint
from kvoffload.tiers.format import HEADER_BYTES, encode_header
from kvoffload.tiers.slot_file import DiskTierError, FileLayer, Recovery, SlotFile

SIZE = 64
FP = layout_fingerprint("disk-faults", layout_preset("tiny"), SIZE)
KEYS = [block_id_key(i) for i in range(8)]
TraceFunction = Callable[[FrameType, str, object], object]


class StalledLayer(FileLayer):
    """System calls that, while :attr:`answering` is clear, wait for it: a hung mount."""

    def __init__(self) -> None:
        self.answering = threading.Event()
        self.answering.set()
        self.calls = 0

    def _call(self) -> None:
        self.calls += 1
        self.answering.wait()

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        self._call()
        return super().pread(fd, size, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview | bytearray], offset: int) -> int:
        self._call()
        return super().preadv(fd, buffers, offset)

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        self._call()
        return super().pwrite(fd, data, offset)

    def pwritev(self, fd: int, buffers: Sequence[bytes | memoryview], offset: int) -> int:
        self._call()
        return super().pwritev(fd, buffers, offset)

    def fstat(self, fd: int) -> os.stat_result:
        self._call()
        return super().fstat(fd)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def layer() -> Iterator[StalledLayer]:
    stalled = StalledLayer()
    yield stalled
    stalled.answering.set()  # let stuck threads finish before the next test


def read(tier: DiskTier, keys: list[OffloadKey]) -> tuple[list[bool], list[bytearray]]:
    buffers = [bytearray(SIZE) for _ in keys]
    ok = tier.read(keys, lambda i: memoryview(buffers[i])).result(timeout=30)
    tier.poll(wait=True)
    return ok, buffers


def test_a_hung_file_system_fails_calls_by_their_deadline_and_opens_the_breaker(
    tmp_path: Path, layer: StalledLayer
) -> None:
    clock = Clock()
    breaker = CircuitBreaker(threshold=2, cooldown_s=60, clock=clock)
    tier = DiskTier(
        tmp_path, 8, FP, io_threads=1, deadline_s=0.2, breaker=breaker, file_layer=layer
    )
    try:
        tier.write(KEYS[:3], [content(key, SIZE) for key in KEYS[:3]])
        tier.poll(wait=True)
        layer.answering.clear()
        # KEYS[0]'s bytes are all zero, like a fresh buffer: a late landing would not show
        ok, buffers = read(tier, KEYS[2:3])  # waits for its deadline, not for the mount
        assert ok == [False] and tier.deadline_misses == 1 and not breaker.is_open
        tier.write(KEYS[3:4], [content(KEYS[3], SIZE)])
        tier.poll(wait=True)
        assert tier.present(KEYS[3:4]) == 0 and breaker.is_open
        assert tier.stats.failed == 2 and tier.deadline_misses == 2
        calls = layer.calls
        assert read(tier, KEYS[1:3])[0] == [False, False]  # refused at once: no call made
        tier.write(KEYS[4:5], [content(KEYS[4], SIZE)])
        tier.poll(wait=True)
        assert layer.calls == calls and tier.stats.failed == 5
        layer.answering.set()  # the mount answers again; the stuck read finishes, too late
        clock.now = 61
        ok, again = read(tier, KEYS[1:3])  # the trial goes through and closes the breaker
        assert ok == [True, True] and not breaker.is_open
        assert [bytes(b) for b in again] == [content(key, SIZE) for key in KEYS[1:3]]
        assert bytes(buffers[0]) == bytes(SIZE)  # the late read never landed in its buffer
    finally:
        layer.answering.set()
        tier.close()


def test_writes_offered_while_the_breaker_is_open_evict_nothing(tmp_path: Path) -> None:
    """A write the open breaker will refuse is dropped before any eviction for it: the full
    tier keeps every block it held (it evicted a batch's worth of its oldest, then failed
    the write); once the breaker lets a trial through, the write evicts and lands."""
    clock = Clock()
    breaker = CircuitBreaker(threshold=1, cooldown_s=60, clock=clock)
    tier = DiskTier(tmp_path, 4, FP, io_threads=1, breaker=breaker, enable_events=True)
    try:
        tier.write(KEYS[4:8], [content(key, SIZE) for key in KEYS[4:8]])
        tier.poll(wait=True)
        tier.take_events()
        opening = breaker.allow()
        assert opening is not None
        breaker.failure(opening)
        tier.write(KEYS[:2], [content(key, SIZE) for key in KEYS[:2]])
        tier.poll(wait=True)
        assert tier.held(KEYS[4:8]) == [True] * 4 and tier.held(KEYS[:2]) == [False] * 2
        assert tier.stats.evicted == 0 and tier.stats.failed == 2
        assert tier.take_events() == []
        clock.now = 61
        tier.write(KEYS[:2], [content(key, SIZE) for key in KEYS[:2]])
        tier.poll(wait=True)
        assert tier.held(KEYS[:2]) == [True] * 2 and not breaker.is_open
        assert tier.stats.evicted == 2 and tier.stats.stored_blocks == 6
    finally:
        tier.close()


def test_writes_offered_while_the_backlog_is_full_are_dropped_and_counted(
    tmp_path: Path, layer: StalledLayer
) -> None:
    """A file system slower than the write-back (here it holds every write until let go,
    well within the deadline) had every write queued with its payload until the deadline
    failed it: ``deadline_s`` of the write-back's bytes. A write offered while
    ``max_pending_write_bytes`` are queued or under way is dropped at once, before any
    eviction for it, counted, and its blocks are not in the tier; once the writes under way
    land, writes are taken again."""
    bound = 2 * SIZE
    tier = DiskTier(
        tmp_path,
        4,
        FP,
        io_threads=1,
        deadline_s=60,
        file_layer=layer,
        max_pending_write_bytes=bound,
    )
    try:
        tier.write(KEYS[4:8], [content(key, SIZE) for key in KEYS[4:8]])
        tier.poll(wait=True)
        layer.answering.clear()
        for key in KEYS[:4]:
            tier.write([key], [content(key, SIZE)])
            tier.poll(wait=False)
        assert tier.pending_write_bytes == bound
        assert tier.skipped_backlog == 2 and tier.stats.failed == 2
        assert tier.stats.evicted == 2 and tier.held(KEYS[6:8]) == [True] * 2
        layer.answering.set()
        tier.poll(wait=True)
        assert tier.pending_write_bytes == 0 and tier.stats.stored_blocks == 6
        assert tier.held(KEYS[:4]) == [True] * 2 + [False] * 2
        assert read(tier, KEYS[2:4])[0] == [False] * 2
        tier.write(KEYS[:4], [content(key, SIZE) for key in KEYS[:4]])  # past the bound,
        tier.poll(wait=True)  # into an empty backlog: taken
        assert tier.stats.stored_blocks == 8 and tier.skipped_backlog == 2
        ok, buffers = read(tier, KEYS[:4])
        assert ok == [True] * 4
        assert [bytes(b) for b in buffers] == [content(key, SIZE) for key in KEYS[:4]]
        assert tier.deadline_misses == 0 and tier.stats.failed == 2
    finally:
        layer.answering.set()
        tier.close()


def test_the_disk_write_backlog_bound_is_two_chunks_per_thread_and_checked(
    tmp_path: Path,
) -> None:
    with pytest.raises(InvalidArgumentError, match="max_pending_write_bytes"):
        DiskTier(tmp_path, 8, FP, max_pending_write_bytes=0)
    tier = DiskTier(tmp_path, 8, FP, io_threads=3)
    try:
        assert tier.max_pending_write_bytes == 2 * 3 * 256 * 2**20
    finally:
        tier.close()


def test_a_caller_told_of_an_outcome_finds_the_breaker_and_counts_updated(
    tmp_path: Path, layer: StalledLayer
) -> None:
    """When a read's future tells of a deadline miss, the miss is counted and the breaker
    has heard of it; when it tells of the trial that got through, the breaker is closed.
    A caller that acts at once (here a done callback, run as the future is resolved) is
    neither let through to a hung disk nor refused a working one."""
    clock = Clock()
    breaker = CircuitBreaker(threshold=1, cooldown_s=60, clock=clock)
    tier = DiskTier(
        tmp_path, 8, FP, io_threads=1, deadline_s=0.2, breaker=breaker, file_layer=layer
    )
    told: list[tuple[list[bool], int, bool]] = []

    def on_told(outcome: Future[list[bool]]) -> None:
        told.append((outcome.result(), tier.deadline_misses, breaker.is_open))

    buffers = [bytearray(SIZE) for _ in range(2)]
    try:
        tier.write(KEYS[:1], [content(KEYS[0], SIZE)])
        tier.poll(wait=True)
        layer.answering.clear()
        missed = tier.read(KEYS[:1], lambda i: memoryview(buffers[0]))
        missed.add_done_callback(on_told)
        missed.result(timeout=30)
        clock.now = 61
        trial = tier.read(KEYS[:1], lambda i: memoryview(buffers[1]))  # queued, still hung
        trial.add_done_callback(on_told)
        layer.answering.set()
        trial.result(timeout=30)
        assert told == [([False], 1, True), ([True], 1, False)]
    finally:
        layer.answering.set()
        tier.close()


class AllCached(FileLayer):
    """A page cache that holds every range: each read lands whole, then is hashed."""

    def preadv_cached(self, fd: int, buffers: Sequence[memoryview | bytearray], offset: int) -> int:
        return os.preadv(fd, buffers, offset)


def test_a_read_given_up_on_while_hashing_keeps_its_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read whose deadline passes as it hashes the bytes that landed hashes the caller's
    buffer, which the caller, told of the miss, may already fill with other bytes: no
    verdict then, so the intact block is not dropped as corrupt."""
    import kvoffload.tiers.slot_file as slot_file

    reused, hashed = threading.Event(), threading.Event()
    digest = slot_file.payload_digest

    def hash_after_reuse(parts: Sequence[memoryview]) -> int:
        reused.wait(30)
        try:
            return digest(parts)
        finally:
            hashed.set()

    tier = DiskTier(tmp_path, 8, FP, io_threads=1, deadline_s=0.2, file_layer=AllCached())
    try:
        tier.write(KEYS[1:2], [content(KEYS[1], SIZE)])
        tier.poll(wait=True)
        monkeypatch.setattr(slot_file, "payload_digest", hash_after_reuse)
        buffer = bytearray(SIZE)
        assert tier.read(KEYS[1:2], lambda i: memoryview(buffer)).result(timeout=30) == [False]
        buffer[:] = b"\xff" * SIZE  # the caller, told of the miss, reuses its buffer
        reused.set()
        assert hashed.wait(30), "the read never hashed what it had read"
        monkeypatch.undo()
        tier.poll(wait=True)
        ok, again = read(tier, KEYS[1:2])
        assert ok == [True] and bytes(again[0]) == content(KEYS[1], SIZE)
        assert tier.stats.corrupt == 0
    finally:
        reused.set()
        tier.close()


def test_closing_over_a_hung_file_system_returns(tmp_path: Path, layer: StalledLayer) -> None:
    tier = DiskTier(tmp_path, 8, FP, io_threads=2, deadline_s=0.2, file_layer=layer)
    tier.write(KEYS[:4], [content(key, SIZE) for key in KEYS[:4]])
    tier.poll(wait=True)
    layer.answering.clear()
    tier.write(KEYS[4:6], [content(key, SIZE) for key in KEYS[4:6]])
    tier.close()  # both writes expire; the stuck threads are left behind, the caller is not
    assert tier.stats.failed == 2 and tier.stats.stored_blocks == 4


def test_a_tier_closed_over_a_stuck_call_frees_its_directory_once_the_call_returns(
    tmp_path: Path, layer: StalledLayer
) -> None:
    """The file stays open while a call is stuck in it, then closes: its lock held for the
    life of the process would refuse every later tier on the directory (a reset, a restart
    of the tier), even long after the file system answers again."""
    tier = DiskTier(tmp_path, 8, FP, io_threads=1, deadline_s=0.2, file_layer=layer)
    tier.write(KEYS[:2], [content(key, SIZE) for key in KEYS[:2]])
    tier.poll(wait=True)
    layer.answering.clear()
    tier.write(KEYS[2:3], [content(KEYS[2], SIZE)])
    tier.close()  # the write expires; its thread is stuck inside the file
    with pytest.raises(DiskTierError, match="is in use by process"):
        DiskTier(tmp_path, 8, FP)
    layer.answering.set()
    again = None
    for _ in range(300):  # the stuck thread leaves, then the file closes: within 30 s
        try:
            again = DiskTier(tmp_path, 8, FP)
            break
        except DiskTierError:
            threading.Event().wait(0.1)
    assert again is not None, "the directory stays locked after the stuck call returned"
    try:  # the late write, given up on before its payload, left nothing behind
        assert again.recovery == Recovery(recovered=2) and again.present(KEYS[2:3]) == 0
        ok, buffers = read(again, KEYS[:2])
        assert all(ok) and [bytes(b) for b in buffers] == [content(k, SIZE) for k in KEYS[:2]]
    finally:
        again.close()


def test_calls_on_a_closed_tier_fail_at_once_and_a_second_close_returns(tmp_path: Path) -> None:
    """No thread runs a job queued after close and no watchdog expires it: such a job
    fails at once, where its future (and a later close waiting on it) would never end."""
    tier = DiskTier(tmp_path, 8, FP, io_threads=2, deadline_s=5.0)
    tier.write(KEYS[:2], [content(key, SIZE) for key in KEYS[:2]])
    tier.close()
    assert tier.read(KEYS[:2], lambda i: memoryview(bytearray(SIZE))).result(timeout=10) == [
        False,
        False,
    ]
    tier.write(KEYS[2:4], [content(key, SIZE) for key in KEYS[2:4]])
    closing = threading.Thread(target=tier.close, daemon=True)
    closing.start()
    closing.join(timeout=10)
    assert not closing.is_alive()
    assert tier.stats.stored_blocks == 2 and tier.stats.failed == 4  # two reads, two writes


def two_slot_stack(disk: DiskTier) -> tuple[TieredOffloadingManager, ByteSlots]:
    """A CPU tier of two slots with real bytes over ``disk``: a third block falls to it."""
    slots = ByteSlots(2, SIZE)
    manager = TieredOffloadingManager(
        CPUOffloadingManager(2), [(disk, TierSettings())], slots, wait_for_tiers=True
    )
    return manager, slots


def store_block(m: TieredOffloadingManager, slots: ByteSlots, key: OffloadKey) -> None:
    """Store ``key`` with its content in its slot, as a worker would."""
    output = m.prepare_store([key])
    assert output is not None
    slot = int(output.store_spec.block_ids[0])  # type: ignore[attr-defined]
    slots.view(slot)[:] = content(key, SIZE)
    m.complete_store([key])


def first_key_on_disk(
    m: TieredOffloadingManager, slots: ByteSlots, disk: DiskTier
) -> Callable[[OffloadKey], None]:
    """Store ``KEYS[:3]`` in the two-slot stack, so that ``KEYS[0]`` falls to the disk;
    the stack's store of one more key back."""
    store = functools.partial(store_block, m, slots)
    for key in KEYS[:3]:
        store(key)
    m.poll()
    assert disk.present(KEYS[:1]) == 1
    return store


def test_the_engine_goes_on_when_the_disk_hangs(tmp_path: Path, layer: StalledLayer) -> None:
    """A promotion from a hung disk is a miss by its deadline; demotions fail and are counted."""
    disk = DiskTier(tmp_path, 8, FP, deadline_s=0.2, file_layer=layer)
    m, slots = two_slot_stack(disk)
    try:
        store = first_key_on_disk(m, slots, disk)
        layer.answering.clear()
        assert m.lookup(KEYS[:1]) is None  # the promotion starts
        assert m.lookup(KEYS[:1]) == 0  # and fails by its deadline: a miss
        for key in KEYS[3:6]:
            store(key)  # more blocks fall; their writes fail by their deadline
        m.poll()
        assert disk.stats.failed >= 2 and disk.deadline_misses >= 2
        assert m.lookup(KEYS[4:6]) == 2  # the CPU tier serves on
    finally:
        layer.answering.set()
        m.close()


def test_start_up_on_a_hung_file_system_is_one_clear_error(
    tmp_path: Path, layer: StalledLayer
) -> None:
    DiskTier(tmp_path, 8, FP).close()
    layer.answering.clear()
    with pytest.raises(Exception, match=r"did not answer within 0\.2 s"):
        DiskTier(tmp_path, 8, FP, deadline_s=0.2, file_layer=layer)


class ScanStalls(FileLayer):
    """Reads of the slot file after the first (the superblock's) wait for
    :attr:`answering`: a file system that stops answering as the start-up scan begins."""

    def __init__(self) -> None:
        self.answering = threading.Event()
        self.reads = 0

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        self.reads += 1
        if self.reads > 1:
            self.answering.wait()
        return super().pread(fd, size, offset)


def test_a_scan_that_hangs_is_one_clear_error_and_frees_the_directory_once_it_returns(
    tmp_path: Path,
) -> None:
    """The scan is a job of its own: past its deadline the start is refused in one line,
    the files stay open (and locked) while a call is stuck in them, and close once it
    returns, the blocks untouched."""
    first = DiskTier(tmp_path, 8, FP)
    first.write(KEYS[:2], [content(key, SIZE) for key in KEYS[:2]])
    first.close()
    stalls = ScanStalls()
    try:
        with pytest.raises(DiskTierError, match=r"did not answer within 0\.2 s"):
            DiskTier(tmp_path, 8, FP, deadline_s=0.2, file_layer=stalls)
        with pytest.raises(DiskTierError, match="is in use by process"):
            DiskTier(tmp_path, 8, FP)
    finally:
        stalls.answering.set()
    again = None
    for _ in range(300):  # the stuck thread leaves, then the files close: within 30 s
        try:
            again = DiskTier(tmp_path, 8, FP)
            break
        except DiskTierError:
            threading.Event().wait(0.1)
    assert again is not None, "the directory stays locked after the stuck scan returned"
    try:
        assert again.recovery == Recovery(recovered=2)
        ok, buffers = read(again, KEYS[:2])
        assert all(ok) and [bytes(b) for b in buffers] == [content(k, SIZE) for k in KEYS[:2]]
    finally:
        again.close()


@pytest.mark.parametrize("step", [SlotFile._open, SlotFile._start], ids=["open", "scan"])
def test_a_start_up_whose_deadline_passes_as_it_returns_leaves_nothing_locked(
    tmp_path: Path, step: Callable[..., object]
) -> None:
    """The file opened and locked, or then scanned, the deadline passes just before that
    job hands it over: the start-up succeeds or fails, and if it fails it keeps nothing
    open, so the directory is free again (a result dropped unclaimed would hold its lock
    for the life of the process).

    The stripe thread is held where the job returns, as by a debugger's breakpoint,
    until the deadline has failed the job (or, if it can no longer fail it, for a while).
    """
    open_job = step.__code__
    resumed = threading.Event()

    def hold_on_return(frame: FrameType, event: str, _: object) -> TraceFunction:
        if event == "return":
            futures.wait([frame.f_locals["job"].future], timeout=1.0)
            resumed.set()
        return hold_on_return

    def trace(frame: FrameType, event: str, _: object) -> TraceFunction | None:
        return hold_on_return if event == "call" and frame.f_code is open_job else None

    before = threading.gettrace()
    threading.settrace(trace)
    try:
        DiskTier(tmp_path, 8, FP, io_threads=1, deadline_s=0.2).close()
    except DiskTierError as exc:
        assert "did not answer within 0.2 s" in str(exc)
    finally:
        threading.settrace(before)
    assert resumed.wait(timeout=30)
    DiskTier(tmp_path, 8, FP).close()


CRASHER = """
import errno
import os
import sys
from kvoffload import block_id_key
from kvoffload.tiers import DiskTier
from kvoffload.tiers.slot_file import FileLayer


class DieBefore(FileLayer):
    '''The process dies just before its n-th write to the slot file, as a kill would.'''

    def __init__(self, n):
        self.left = n

    def count(self):
        self.left -= 1
        if self.left == 0:
            os._exit(9)

    def pwrite(self, fd, data, offset):
        self.count()
        return super().pwrite(fd, data, offset)

    def pwritev(self, fd, buffers, offset):
        self.count()
        return super().pwritev(fd, buffers, offset)


tier = DiskTier(sys.argv[1], 1, bytes.fromhex(sys.argv[2]), io_threads=1,
                file_layer=DieBefore(int(sys.argv[3])))
for i in range(2):  # one slot: the second block reuses the first one's
    key = block_id_key(i)
    tier.write([key], [bytes([0xA0 + i]) * 64])
    tier.poll(wait=True)
tier.close()
"""


@pytest.mark.parametrize(
    ("die_before", "held", "torn"),
    [
        (1, [], 0),  # the superblock
        (2, [], 0),  # the first block's payload
        (3, [], 1),  # its header: a payload without one
        (4, [0], 0),  # the second block's payload, over the first block
        (5, [], 1),  # its header: the first block's header went with the payload write
        (6, [1], 0),  # no crash
    ],
)
def test_a_crash_between_any_two_writes_leaves_only_intact_blocks(
    tmp_path: Path, die_before: int, held: list[int], torn: int
) -> None:
    """Deterministic: the child dies at one chosen write, so a wrong order fails every time."""
    child = subprocess.run(
        [sys.executable, "-c", CRASHER, str(tmp_path), FP.hex(), str(die_before)],
        capture_output=True,
        check=False,
        timeout=60,
    )
    assert child.returncode == (0 if die_before == 6 else 9), child.stderr
    tier = DiskTier(tmp_path, 1, FP)
    try:
        keys = [block_id_key(i) for i in held]
        assert [k for k in map(block_id_key, range(2)) if tier.present([k])] == keys
        assert tier.recovery == Recovery(recovered=len(held), torn=torn)
        ok, buffers = read(tier, keys)
        assert all(ok) and [bytes(b) for b in buffers] == [bytes([0xA0 + i]) * 64 for i in held]
    finally:
        tier.close()


class CountingLayer(FileLayer):
    """Records the sizes of the payload reads (``preadv``, ``preadv_cached``) made."""

    def __init__(self) -> None:
        self.payload_reads: list[int] = []

    def preadv(self, fd: int, buffers: Sequence[memoryview | bytearray], offset: int) -> int:
        self.payload_reads.append(sum(len(b) for b in buffers))
        return super().preadv(fd, buffers, offset)

    def preadv_cached(self, fd: int, buffers: Sequence[memoryview | bytearray], offset: int) -> int:
        self.payload_reads.append(sum(len(b) for b in buffers))
        return super().preadv_cached(fd, buffers, offset)


def plant_short_block(tier: DiskTier, key: OffloadKey, size: int) -> None:
    """A valid header (key, fingerprint, checksums) announcing ``size`` payload bytes."""
    start = tier.slot_offset(key)
    assert start is not None
    short = content(key, size)
    with open(tier.path, "r+b") as file:
        file.seek(start)
        file.write(encode_header(key, FP, short) + short)


def test_a_valid_header_of_another_length_is_corrupt_and_dropped_before_reading(
    tmp_path: Path,
) -> None:
    layer = CountingLayer()
    tier = DiskTier(tmp_path, 8, FP, file_layer=layer)
    try:
        tier.write(KEYS[:2], [content(key, SIZE) for key in KEYS[:2]])
        tier.poll(wait=True)
        plant_short_block(tier, KEYS[1], SIZE // 2)
        ok, _ = read(tier, KEYS[:2])
        assert ok == [True, False] and layer.payload_reads == [SIZE]  # KEYS[1]'s: never read
        assert tier.stats.corrupt == 1 and tier.present(KEYS[1:2]) == 0
        assert read(tier, KEYS[1:2])[0] == [False] and tier.stats.corrupt == 1  # not again
    finally:
        tier.close()
    again = DiskTier(tmp_path, 8, FP)
    try:  # blanked: a restart neither indexes nor counts it
        assert again.recovery == Recovery(recovered=1) and again.present(KEYS[1:2]) == 0
    finally:
        again.close()


def test_a_restart_drops_a_header_of_another_length(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 8, FP)
    tier.write(KEYS[:3], [content(key, SIZE) for key in KEYS[:3]])
    tier.poll(wait=True)
    plant_short_block(tier, KEYS[2], SIZE * 2)
    tier.close()
    again = DiskTier(tmp_path, 8, FP)
    try:
        assert again.recovery == Recovery(recovered=2, corrupt=1)
        assert again.present(KEYS[:3]) == 2 and again.present(KEYS[2:3]) == 0
    finally:
        again.close()


@pytest.mark.parametrize("position", range(HEADER_BYTES - 4, HEADER_BYTES))
def test_a_flipped_byte_in_the_headers_own_checksum_is_caught(
    tmp_path: Path, position: int
) -> None:
    tier = DiskTier(tmp_path, 8, FP)
    try:
        tier.write(KEYS[:2], [content(key, SIZE) for key in KEYS[:2]])
        tier.poll(wait=True)
        flip_byte(tier, KEYS[0], position)
        assert read(tier, KEYS[:2])[0] == [False, True] and tier.stats.corrupt == 1
        flip_byte(tier, KEYS[1], position)
    finally:
        tier.close()
    again = DiskTier(tmp_path, 8, FP)
    try:  # KEYS[0] was blanked when read; KEYS[1] is found by the scan
        assert again.recovery == Recovery(corrupt=1) and len(again) == 0
    finally:
        again.close()


class FullFor(FileLayer):
    """Payload writes of :attr:`refused` fail with ENOSPC before writing a byte, as a
    full disk refuses a sparse slot."""

    def __init__(self, refused: bytes) -> None:
        self.refused = refused

    def pwritev(self, fd: int, buffers: Sequence[bytes | memoryview], offset: int) -> int:
        if bytes(buffers[-1]) == self.refused:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().pwritev(fd, buffers, offset)


def test_a_key_intact_in_two_slots_is_served_from_one_after_a_restart(
    tmp_path: Path,
) -> None:
    """A key names its content, so either intact copy is a right one: the lowest slot is
    kept and the other blanked and counted. (Dropping both lost a block for nothing, and a
    restart with a smaller capacity then lost a key whose other copy lay past it.)"""
    first, second, refused = b"o" * SIZE, b"n" * SIZE, b"x" * SIZE
    a, b, c, d, x = KEYS[:5]
    tier = DiskTier(tmp_path, 3, FP, file_layer=FullFor(refused))
    try:
        for key, data in ((a, first), (b, content(b, SIZE)), (c, content(c, SIZE))):
            tier.write([key], [data])
            tier.poll(wait=True)
        old_slot = tier.slot_offset(a)
        tier.write([d], [refused])  # evicts a; d's write into a's slot fails, a stays there
        tier.poll(wait=True)
        tier.write([a, x], [second, refused])  # a again, into b's slot; x into a's old one fails
        tier.poll(wait=True)
        assert tier.stats.failed == 2 and tier.slot_offset(a) not in (None, old_slot)
    finally:
        tier.close()
    again = DiskTier(tmp_path, 3, FP)
    try:  # the bytes differ here only to show which copy is served: the lowest slot's
        assert again.present([a]) == 1 and again.present([c]) == 1
        assert again.slot_offset(a) == old_slot and read(again, [a])[1][0] == first
        assert again.recovery == Recovery(recovered=2, duplicate=1)
    finally:
        again.close()
    third = DiskTier(tmp_path, 3, FP)
    try:  # the other copy was blanked: counted once
        assert third.recovery == Recovery(recovered=2) and third.present([a]) == 1
    finally:
        third.close()


class BuggyLayer(FileLayer):
    """Reads that raise what no I/O error is, once :attr:`broken`: a bug under the file."""

    def __init__(self) -> None:
        self.broken = False

    def preadv(self, fd: int, buffers: Sequence[memoryview | bytearray], offset: int) -> int:
        if self.broken:
            raise ValueError("a bug below the slot file")
        return super().preadv(fd, buffers, offset)

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        if self.broken:
            raise ValueError("a bug below the slot file")
        return super().pread(fd, size, offset)


def test_a_job_that_raises_a_bug_fails_its_blocks_instead_of_leaving_callers_waiting(
    tmp_path: Path,
) -> None:
    """The stripes' funnel: a job that raises reads as failed blocks, so a promotion is a
    miss rather than "ask again" for good, and the tier still closes."""
    layer = BuggyLayer()
    disk = DiskTier(tmp_path, 8, FP, file_layer=layer)
    m, slots = two_slot_stack(disk)
    try:
        store = first_key_on_disk(m, slots, disk)
        layer.broken = True
        direct = disk.read(KEYS[:1], lambda i: memoryview(bytearray(SIZE)))
        assert direct.result(timeout=30) == [False]
        assert m.lookup(KEYS[:1]) is None  # the promotion starts
        assert m.lookup(KEYS[:1]) == 0  # and is a miss, not a question asked for ever
        store(KEYS[3])
        assert m.lookup(KEYS[3:4]) == 1  # the CPU tier serves on
    finally:
        m.close()  # returns: no job is left unsettled


def test_a_scan_given_up_on_stops_and_frees_the_directory(tmp_path: Path) -> None:
    """A slot file grown to 1 TiB of holes (a bogus size: no tier of 8 slots wrote it) is
    refused at the deadline as before: the scan's allowance counts the slots within the
    capacity only, not the file's 268 million. The scan then stops at its next slot rather
    than read every header, which kept a core busy and the directory locked for minutes,
    refusing a tier opened on it again in the same process."""
    first = DiskTier(tmp_path, 8, FP)
    first.write(KEYS[:2], [content(key, SIZE) for key in KEYS[:2]])
    first.close()
    os.truncate(first.path, 2**40)
    with pytest.raises(DiskTierError, match=r"did not answer within 0\.2 s"):
        DiskTier(tmp_path, 8, FP, deadline_s=0.2)
    os.truncate(first.path, 4 * 2**20)  # a size a tier of 8 slots may leave
    again = None
    for _ in range(300):  # the scan stops, then the files close: within 30 s
        try:
            again = DiskTier(tmp_path, 8, FP)
            break
        except DiskTierError:
            threading.Event().wait(0.1)
    assert again is not None, "the directory stays locked by a scan given up on"
    try:
        assert again.recovery.recovered == 2
    finally:
        again.close()
