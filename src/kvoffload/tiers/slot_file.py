"""The disk tier's slot file: its format, its crash-safe writes, and every rule for the file system.

``DIR/<fingerprint hex>/blocks.kvs`` starts with a checksummed superblock
(magic, version, fingerprint, slot stride, payload length); slot ``i`` lies
at ``SUPER_BYTES + i * stride`` and holds one block exactly as the shared
tier stores it (:mod:`kvoffload.tiers.format`: header, key, payload). The
layout is fixed by the first write (the payload size is constant per
fingerprint) and the file stays sparse: it grows only where slots are
written, so a full disk shows up as a failed store.

Crash safety without temporary files: a slot is written payload first, with
its old header zeroed in the same call, and its new header last, in a second
call. A process killed between the two leaves a slot without a valid header,
which a restart does not index; never an old header over new bytes. With
``fsync=True`` a batch's payloads are synced before its headers are written,
and the headers after (power-loss safety); on start, so are the directories
holding the names of the file, its directory, and ``DIR`` or its parents when
start-up made them. A file per block with temp file +
rename gives the same guarantee at the cost of an inode and a rename per
block (30-50% of the store time in the kernel on the dev VM); an append-only
segment needs compaction.

What is not ours is never touched. The directory tree is opened one level at
a time, each with ``O_NOFOLLOW`` relative to the one above, so nothing is
created or written outside ``DIR``: ``DIR``, the fingerprint directory and the
files in it must each be what they claim (a directory, a regular file with a
single link), not a symbolic link, and owned by the running user. What this
class creates is private (directories 0700, files 0600). An exclusive
``flock`` on ``lock`` (which names the holder's pid) and one on the slot file
itself (``lock`` may be deleted under its holder) keep a second process from
wiping the first one's slots; a child the holder forks lets go of both. Other
layouts' slot files in ``DIR`` that no running tier holds (an earlier model's)
are emptied, oldest first, only while the file system lacks room for this
tier's file when full (:meth:`SlotFile._make_room`).

File I/O runs on single-threaded stripes keyed by slot (slot % stripes), so
a read of a slot and a later write into that slot, reused by another key,
happen in call order without locks. Every job has a deadline
(:mod:`.deadline`), and nothing lands in the caller's buffer once its job was
given up on, so a call stuck in a hung file system can never write into a
buffer that has since been reused. A read goes chunk by chunk, each under the
job's lock after checking it was not given up on: what the page cache holds
is read straight into the caller's buffer with ``RWF_NOWAIT``, a call that
never waits for the device (so it cannot hang holding the lock); the rest
(or everything, where the file system cannot read that way) is read into a
small buffer of the stripe outside the lock and copied out under it, a second
copy that the page cache's reads save (see docs/tiers.md, "Speed"). All
runtime failures pass through :meth:`SlotFile._guard`.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import functools
import logging
import os
import re
import stat
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, TypeVar

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import OffloadKey
from kvoffload.core.tier_protocol import Target
from kvoffload.tiers.breaker import CircuitBreaker
from kvoffload.tiers.deadline import DeadlineStripes, Job, done_future
from kvoffload.tiers.format import (
    HEADER_BYTES,
    CorruptBlockError,
    CutShortError,
    Payload,
    encode_header,
    parse_header,
    payload_digest,
    payload_hasher,
    payload_parts,
    payload_size,
)
from kvoffload.tiers.targets import destination_parts

logger = logging.getLogger(__name__)

SLOT_FILE = "blocks.kvs"
LOCK_FILE = "lock"
MAX_KEY_BYTES = 256
"""The longest key a slot reserves room for (vLLM's keys have 36 bytes)."""
ALIGN = 4096
SUPER_BYTES = ALIGN
"""Room before slot 0 for the superblock: slots start page-aligned."""
SUPER_MAGIC = b"KVOS"
SUPER_VERSION = 2
DEFAULT_DEADLINE_S = 10.0
"""How long one I/O job may take, plus :data:`SLOWEST_BYTES_PER_S` for its bytes."""
SLOWEST_BYTES_PER_S = 50e6
"""A device slower than this (50 MB/s) counts as failing."""
READ_CHUNK_BYTES = 256 * 2**10
"""Reads not served straight from the page cache pass through a buffer of this size per
stripe, each chunk hashed while in cache."""
CACHED_READ_BYTES = 8 * 2**20
"""The most one read straight from the page cache takes, holding its job's lock (a few
milliseconds, that the deadline may wait): a 2 MiB block in one call loads 10-15% faster
than in 256 KiB chunks hashed in cache."""


def _iov_max() -> int:
    """Buffers one ``preadv`` or ``pwritev`` may take (1024 on Linux; the POSIX floor, 16,
    where the system does not say): past it the call fails with EINVAL."""
    try:
        limit = os.sysconf("SC_IOV_MAX")
    except (ValueError, OSError):
        limit = -1
    return limit if limit > 0 else 16


IOV_MAX = _iov_max()
"""A block stored from more parts than this (many layers, K and V each split) is written
and read in calls of at most this many buffers each."""

_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT})
"""What a file system without a block to spare for the running user answers."""
_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)
_NOT_CACHED = frozenset({errno.EAGAIN, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS})
"""A ``RWF_NOWAIT`` read's errors that say only "not from the cache": read it the slow way."""

_SUPER = struct.Struct("<4sHH16sQQ")
"""magic, version, reserved, fingerprint, stride, payload length; a CRC32 of these follows."""
_CRC = struct.Struct("<I")
_SCANNED_BYTES = HEADER_BYTES + MAX_KEY_BYTES + 1
"""What a start reads of each slot: the header, the room of the longest key, and one byte
more, so that a payload put down behind a zeroed header (a store cut short) shows for
every key length: behind the longest key's, the room held zeros alone (counted blank).
Within every slot, a stride being whole pages (:func:`slot_stride`)."""
_ZERO_HEADER = bytes(_SCANNED_BYTES)
"""Written over a slot's start to blank it, as much as a start reads of it: a slot blanked
reads blank, so each dropped slot is counted once."""
_OWNER_WRITES = stat.S_IWUSR | stat.S_IXUSR
"""What creating a file in a directory takes of its owner's permissions."""
_HELD_LOCKS: set[int] = set()
"""This process's locked descriptors (``lock``, slot files), which a forked child must not keep."""

T = TypeVar("T")


class DiskTierError(InvalidArgumentError):
    """The disk tier cannot start: an unsafe or busy directory, or a file system not answering."""


class Outcome(enum.Enum):
    OK = "ok"
    FAILED = "failed"
    """An I/O error, a deadline missed, or the breaker open: the read did not happen."""
    UNDELIVERED = "undelivered"
    """The block is fine but its destination did not take it (the caller's failure)."""
    CORRUPT = "corrupt"
    """The slot holds no valid block of this key and layout (now blanked)."""


@dataclass
class Recovery:
    """What the start-up scan found: blocks indexed again and slots dropped, by reason."""

    recovered: int = 0
    torn: int = 0
    """Writes cut short: a payload without its header, or a block cut by the end of the file."""
    foreign: int = 0
    """Blocks of another layout fingerprint (a whole file of another layout: all its slots)."""
    corrupt: int = 0
    """Headers that fail their checks, announce another payload length than the layout's,
    or cannot be read (EIO: a bad sector)."""
    duplicate: int = 0
    """Further intact copies of a key found in more than one slot (a slot whose block was
    evicted keeps it until its next write lands, and the key may since have been stored
    again elsewhere): the lowest slot within the capacity is kept, the others dropped. A
    key names its content (a hash of the tokens under the layout's fingerprint), so any
    intact copy is a right one."""
    beyond_capacity: int = 0
    """Intact blocks in slots past a capacity smaller than the file's, cut off with them."""

    def as_dict(self) -> dict[str, int]:
        return {
            "recovered": self.recovered,
            "dropped_torn": self.torn,
            "dropped_foreign": self.foreign,
            "dropped_corrupt": self.corrupt,
            "dropped_duplicate": self.duplicate,
            "dropped_beyond_capacity": self.beyond_capacity,
        }


def slot_stride(payload_bytes: int) -> int:
    """Bytes per slot for payloads of ``payload_bytes``: header and longest key, page-aligned."""
    return -(-(HEADER_BYTES + MAX_KEY_BYTES + payload_bytes) // ALIGN) * ALIGN


def slot_start(slot: int, stride: int) -> int:
    """Where ``slot`` starts in the slot file."""
    return SUPER_BYTES + slot * stride


def footprint(num_slots: int, payload_bytes: int) -> int:
    """Bytes a full slot file of ``num_slots`` slots takes on disk."""
    return SUPER_BYTES + num_slots * slot_stride(payload_bytes)


def slots_within(total_bytes: int, payload_bytes: int) -> int:
    """How many slots of ``payload_bytes`` a slot file may have to take at most
    ``total_bytes`` when full: an engine's byte size is the file's, headers and alignment
    included, not the payloads' (their sum grew the file to twice it at 4 KiB payloads)."""
    return max(0, total_bytes - SUPER_BYTES) // slot_stride(payload_bytes)


def slot_note(payload_bytes: int) -> str:
    """Why a size an engine gives holds fewer payloads of ``payload_bytes`` than its
    quotient says: each slot takes its stride, after the superblock."""
    return (
        f"a disk slot takes {slot_stride(payload_bytes)} bytes, after a "
        f"{SUPER_BYTES}-byte superblock"
    )


def encode_superblock(fingerprint: bytes, stride: int, payload_bytes: int) -> bytes:
    fields = _SUPER.pack(SUPER_MAGIC, SUPER_VERSION, 0, fingerprint, stride, payload_bytes)
    return fields + _CRC.pack(zlib.crc32(fields))


@dataclass(frozen=True)
class Superblock:
    """A superblock as found: ``ours`` if it names this fingerprint and format version."""

    ours: bool
    stride: int
    payload_bytes: int
    fingerprint: bytes


def parse_superblock(data: bytes, fingerprint: bytes) -> Superblock | None:
    """The superblock at the start of ``data``; ``None`` unless intact (magic, CRC, stride)."""
    if len(data) < _SUPER.size + _CRC.size:
        return None
    magic, version, _, found, stride, payload = _SUPER.unpack_from(data)
    (crc,) = _CRC.unpack_from(data, _SUPER.size)
    if zlib.crc32(data[: _SUPER.size]) != crc or magic != SUPER_MAGIC:
        return None
    if stride <= 0 or stride % ALIGN:
        return None
    ours = version == SUPER_VERSION and found == fingerprint and slot_stride(payload) == stride
    return Superblock(ours, int(stride), int(payload), bytes(found))


class FileLayer:
    """The system calls on an open slot file, in one place (tests slow or break them here)."""

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        return os.pread(fd, size, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview | bytearray], offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def preadv_cached(self, fd: int, buffers: Sequence[memoryview | bytearray], offset: int) -> int:
        """What the page cache holds of the range, never waiting for the device
        (``RWF_NOWAIT``): 0 where nothing is cached or the file system cannot tell."""
        if _NOWAIT is None:
            return 0
        try:
            return os.preadv(fd, buffers, offset, _NOWAIT)
        except OSError as exc:
            if exc.errno in _NOT_CACHED:
                return 0
            raise

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def pwritev(self, fd: int, buffers: Sequence[bytes | memoryview], offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def ftruncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def fstat(self, fd: int) -> os.stat_result:
        return os.fstat(fd)

    def free_bytes(self, fd: int) -> int:
        """Bytes the running user may still take in the file system holding ``fd``."""
        info = os.fstatvfs(fd)
        return info.f_bavail * info.f_frsize


@dataclass
class _Opened:
    """The files start-up opened and locked, and the slot file's size and superblock as
    found (``None``: none intact)."""

    fd: int
    lock_fd: int
    root_fd: int
    directory_fd: int
    made: list[Path]
    """``DIR`` and those of its parents that start-up made (with ``fsync`` only)."""
    size: int
    found_super: Superblock | None

    @property
    def fds(self) -> list[int]:
        """Every descriptor held, the slot file's first."""
        return [self.fd, self.lock_fd, self.root_fd, self.directory_fd]

    @property
    def slots(self) -> int:
        """Slots the scan reads a header of: none in a file it starts over."""
        found = self.found_super
        if found is None or not found.ours:
            return 0
        return -(-max(self.size - SUPER_BYTES, 0) // found.stride)


@dataclass
class _Scanned:
    found: list[tuple[OffloadKey, int]]
    recovery: Recovery
    superblock: Superblock | None


class SlotFile:
    """The slot file of ``fingerprint`` under ``root``, opened, locked and scanned.

    :attr:`found` lists the intact blocks found, ``(key, slot)`` in slot
    order, and :attr:`recovery` what the scan counted. Raises
    :class:`DiskTierError` with a one-line reason when the directory is
    unsafe, held by another process, or does not answer within the deadline.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        fingerprint: bytes,
        capacity: int,
        *,
        io_threads: int,
        fsync: bool,
        deadline_s: float,
        breaker: CircuitBreaker,
        layer: FileLayer,
    ) -> None:
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.capacity = capacity
        self.directory = self.root / fingerprint.hex()
        self.path = self.directory / SLOT_FILE
        self.layer = layer
        self.stride: int | None = None
        self.payload_bytes: int | None = None
        self._fsync = fsync
        self._chunks = threading.local()
        self.stripes = DeadlineStripes(
            io_threads, "kvoffload-disk", deadline_s, breaker, SLOWEST_BYTES_PER_S
        )
        opened = self.stripes.submit(0, self._open, None, 0).result()
        if not isinstance(opened, _Opened):
            self._refuse_start(opened, _nothing)  # a start-up given up on closes its own files
        # A job of its own, which may take the time its header reads take, a page a slot
        # within the capacity: a file whose size is bogus (holes) is refused at its deadline.
        scan = functools.partial(self._start, opened)
        reads = min(opened.slots, capacity) * ALIGN
        scanned = self.stripes.submit(0, scan, None, reads).result()
        if not isinstance(scanned, _Scanned):
            self._refuse_start(scanned, functools.partial(_close_all, opened.fds))
        self._fd, self._lock_fd, self._root_fd = opened.fd, opened.lock_fd, opened.root_fd
        self.found, self.recovery = scanned.found, scanned.recovery
        self._superblock: Future[bool] | None = None
        if scanned.superblock is not None:
            self.stride = scanned.superblock.stride
            self.payload_bytes = scanned.superblock.payload_bytes
            self._superblock = done_future(True)

    def _refuse_start(self, reason: str | None, release: Callable[[], None]) -> NoReturn:
        """Stop the stripes, ``release`` what start-up kept open once no thread is inside
        it, and raise the one-line ``reason`` (``None``: the job did not run to its end, its
        deadline passed or the breaker refused it)."""
        self.stripes.close(release)
        if reason is None:
            reason = (
                f"disk tier directory {self.directory} did not answer within "
                f"{self.stripes.deadline_s:g} s"
                if self.stripes.expired
                else f"cannot open the disk tier in {self.directory}"
            )
        raise DiskTierError(reason)

    def fix_layout(self, payload_bytes: int) -> None:
        """The first write fixes the layout (a file found on start has fixed it already)."""
        if self.stride is None:
            self.stride = slot_stride(payload_bytes)
            self.payload_bytes = payload_bytes

    def read(
        self, keys: Sequence[OffloadKey], slots: Sequence[int], target: Target
    ) -> Future[list[Outcome]]:
        """Read ``keys`` from their ``slots`` into ``target`` (all stripes in parallel)."""
        groups = self._by_stripe(slots)
        payload = self.payload_bytes or 0

        def job_for(positions: list[int]) -> Callable[[Job[list[Outcome]]], list[Outcome]]:
            return lambda job: [self._read(job, i, keys[i], slots[i], target) for i in positions]

        return self._gather(
            len(keys), groups, job_for, Outcome.FAILED, lambda n: n * (payload + ALIGN)
        )

    def write(
        self, keys: Sequence[OffloadKey], slots: Sequence[int], payloads: Sequence[Payload]
    ) -> Future[list[bool]]:
        """Write ``keys`` into ``slots`` (payloads first, headers last); per key, whether it did."""
        superblock = self._superblock_written()
        groups = self._by_stripe(slots)
        size = max((payload_size(p) for p in payloads), default=0)

        def job_for(positions: list[int]) -> Callable[[Job[list[bool]]], list[bool]]:
            return lambda job: self._write(job, superblock, positions, keys, slots, payloads)

        return self._gather(len(keys), groups, job_for, False, lambda n: n * (size + ALIGN))

    def close(self, empty: bool = False) -> None:
        """Finish or expire every job, then close the file and its lock (after the last
        call stuck in the file returns, if one is). ``empty``: truncate the file first,
        through the descriptor opened here, so that the next tier on the directory starts
        with nothing (a reset); by its path, a link planted since could send it elsewhere."""
        if self._fd < 0:
            return
        emptying = self.layer if empty else None
        held = [self._fd, self._lock_fd, self._root_fd]
        self.stripes.close(functools.partial(_close_all, held, emptying))
        self._fd = -1

    # The calling thread's side: jobs out, futures back.

    def _superblock_written(self) -> Future[bool]:
        """The superblock's write, queued again if the last one failed."""
        done = self._superblock
        if done is None or (done.done() and not done.result()):
            assert self.stride is not None and self.payload_bytes is not None
            data = encode_superblock(self.fingerprint, self.stride, self.payload_bytes)
            done = self.stripes.submit(0, lambda job: self._put_superblock(data), False, len(data))
            self._superblock = done
        return done

    def _by_stripe(self, slots: Sequence[int]) -> dict[int, list[int]]:
        """Positions of the slots (``-1``: none) by the stripe that owns them."""
        stripes = len(self.stripes)
        groups: dict[int, list[int]] = {}
        for i, slot in enumerate(slots):
            if slot >= 0:
                groups.setdefault(slot % stripes, []).append(i)
        return groups

    def _gather(
        self,
        n: int,
        groups: dict[int, list[int]],
        job_for: Callable[[list[int]], Callable[[Job[list[T]]], list[T]]],
        failed: T,
        nbytes: Callable[[int], int],
    ) -> Future[list[T]]:
        """One future for the jobs of all stripes; positions without a slot get ``failed``."""
        result: Future[list[T]] = Future()
        outcome = [failed] * n
        if not groups:
            result.set_result(outcome)
            return result
        remaining = [len(groups)]
        lock = threading.Lock()

        def part_done(positions: list[int], part: Future[list[T]]) -> None:
            for i, value in zip(positions, part.result(), strict=True):
                outcome[i] = value
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            result.set_result(outcome)

        for stripe, positions in groups.items():
            part = self.stripes.submit(
                stripe, job_for(positions), [failed] * len(positions), nbytes(len(positions))
            )
            part.add_done_callback(functools.partial(part_done, positions))
        return result

    # I/O threads from here on: the file only.

    def _guard(self, step: Callable[[], Outcome]) -> Outcome:
        """The one place where a runtime failure becomes an outcome: I/O errors fail the
        block, a block that is not what its slot should hold is corrupt."""
        try:
            return step()
        except CorruptBlockError:
            return Outcome.CORRUPT
        except OSError:
            return Outcome.FAILED

    def _read(
        self, job: Job[list[Outcome]], index: int, key: OffloadKey, slot: int, target: Target
    ) -> Outcome:
        if job.abandoned:
            return Outcome.FAILED
        outcome = self._guard(functools.partial(self._fetch, job, index, key, slot, target))
        if outcome is Outcome.CORRUPT:
            self._guard(functools.partial(self._blank, slot))
        return outcome

    def _fetch(
        self, job: Job[list[Outcome]], index: int, key: OffloadKey, slot: int, target: Target
    ) -> Outcome:
        """Read ``key``'s block into its target chunk by chunk, hashing each as it comes;
        raises if the slot does not hold it intact.

        Each chunk lands under the job's lock, after checking that the deadline
        has not given the job up, so a read stuck in the file system never lands
        in a buffer its caller has been told is free: read there straight from
        the page cache, or else read into the stripe's chunk buffer outside the
        lock and copied out under it. A chunk through the buffer is hashed
        there, while in cache; one read straight into the target, once it landed.
        """
        assert self.stride is not None
        size = self.payload_bytes or 0
        start = slot_start(slot, self.stride)
        header = parse_header(self.layer.pread(self._fd, HEADER_BYTES + len(key), start))
        header.check(key, self.fingerprint)
        if header.payload_bytes != size:
            # Refused before reading: a length that is not the layout's is never read.
            raise CorruptBlockError(
                f"slot of {key!r} announces {header.payload_bytes} payload bytes, "
                f"the layout has {size}"
            )
        parts = destination_parts(target, index, size)
        if parts is None:
            return Outcome.UNDELIVERED
        chunk = self._chunk_buffer()
        digest = payload_hasher()
        whole: int | None = None
        done = 0
        cursor = (0, 0)
        while done < size:
            at = start + header.size + done
            with job.lock:  # the deadline takes this lock too
                if job.abandoned:
                    return Outcome.FAILED
                ahead, _ = _views_from(parts, cursor, min(CACHED_READ_BYTES, size - done))
                got = self.layer.preadv_cached(self._fd, ahead[:IOV_MAX], at)
            if got:
                landed, cursor = _views_from(parts, cursor, got)
                if got == size:  # the usual case: hashed as a store hashes it (many small
                    whole = payload_digest(parts)  # parts with the GIL released)
                else:
                    for view in landed:
                        digest.update(view)
                done += got
                continue
            piece = chunk[: min(len(chunk), size - done)]
            if self.layer.preadv(self._fd, [piece], at) != len(piece):
                raise CorruptBlockError(f"slot of {key!r} is torn")
            digest.update(piece)
            with job.lock:
                if job.abandoned:
                    return Outcome.FAILED
                cursor = _spread(parts, cursor, piece)
            done += len(piece)
        if job.abandoned:  # the hash may have read the caller's new bytes: no verdict
            return Outcome.FAILED
        header.verify_digest(digest.intdigest() if whole is None else whole)
        return Outcome.OK

    def _chunk_buffer(self) -> memoryview:
        """This stripe thread's read buffer, small enough to stay in cache."""
        buffer: bytearray | None = getattr(self._chunks, "buffer", None)
        if buffer is None:
            buffer = self._chunks.buffer = bytearray(READ_CHUNK_BYTES)
        return memoryview(buffer)

    def _blank(self, slot: int) -> Outcome:
        """Make a broken slot empty, so that a restart does not index or count it again."""
        assert self.stride is not None
        self.layer.pwrite(self._fd, _ZERO_HEADER, slot_start(slot, self.stride))
        return Outcome.OK

    def _put_superblock(self, data: bytes) -> bool:
        self._make_room(self._root_fd, self._fd, self.payload_bytes or 0)

        def put() -> Outcome:
            written = self.layer.pwrite(self._fd, data, 0)
            if self._fsync:
                self.layer.fdatasync(self._fd)
            return Outcome.OK if written == len(data) else Outcome.FAILED

        return self._guard(put) is Outcome.OK

    def _write(
        self,
        job: Job[list[bool]],
        superblock: Future[bool],
        positions: list[int],
        keys: Sequence[OffloadKey],
        slots: Sequence[int],
        payloads: Sequence[Payload],
    ) -> list[bool]:
        """Payloads first (over zeroed old headers), then the headers: see the module docstring."""
        failed = [False] * len(positions)
        if not superblock.result() or any(
            self._guard(check) is not Outcome.OK for check in (self._linked, self._superblock_kept)
        ):
            return failed
        headers: list[bytes | None] = []
        for i in positions:
            key, payload = keys[i], payloads[i]
            if (
                job.abandoned
                or len(key) > MAX_KEY_BYTES
                or payload_size(payload) != self.payload_bytes
            ):
                headers.append(None)
                continue
            header = encode_header(key, self.fingerprint, payload)
            start = slot_start(slots[i], self.stride or 0)
            step = self._guard(functools.partial(self._put, start, header, payload))
            headers.append(header if step is Outcome.OK else None)
        if self._fsync and self._guard(self._sync) is not Outcome.OK:
            return failed
        ok = failed.copy()
        for n, (i, written) in enumerate(zip(positions, headers, strict=True)):
            if written is None or job.abandoned:
                continue
            start = slot_start(slots[i], self.stride or 0)
            ok[n] = self._guard(functools.partial(self._put, start, written)) is Outcome.OK
        if self._fsync and self._guard(self._sync) is not Outcome.OK:
            return failed
        return ok

    def _put(self, start: int, header: bytes, payload: Payload | None = None) -> Outcome:
        """The header alone, or the payload behind a zeroed header of the same length: its
        parts in one ``pwritev``, or one per :data:`IOV_MAX` of them."""
        if payload is None:
            written = self.layer.pwrite(self._fd, header, start) == len(header)
            return Outcome.OK if written else Outcome.FAILED
        blank = memoryview(_ZERO_HEADER)[: len(header)]
        buffers = [blank, *(memoryview(part) for part in payload_parts(payload))]
        at = start
        for first in range(0, len(buffers), IOV_MAX):
            group = buffers[first : first + IOV_MAX]
            size = sum(buffer.nbytes for buffer in group)
            if self.layer.pwritev(self._fd, group, at) != size:
                return Outcome.FAILED
            at += size
        return Outcome.OK

    def _sync(self) -> Outcome:
        self.layer.fdatasync(self._fd)
        return Outcome.OK

    def _linked(self) -> Outcome:
        """Whether the slot file still has a name: a removed one is a failing disk."""
        return Outcome.OK if self.layer.fstat(self._fd).st_nlink > 0 else Outcome.FAILED

    def _superblock_kept(self) -> Outcome:
        """The superblock, put back if the file was emptied under the tier (``truncate``
        by another process): a start drops a file without one, and with it every slot
        written since."""
        assert self.stride is not None and self.payload_bytes is not None
        data = encode_superblock(self.fingerprint, self.stride, self.payload_bytes)
        if self.layer.pread(self._fd, len(data), 0) == data:
            return Outcome.OK
        return Outcome.OK if self.layer.pwrite(self._fd, data, 0) == len(data) else Outcome.FAILED

    # Start-up, on stripe 0 under the deadline: open and lock, then scan.

    def _open(self, job: Job[_Opened | str | None]) -> _Opened | str:
        """The opened and locked file, or the one-line reason it cannot be used."""
        fds: list[int] = []
        made = _missing(self.root) if self._fsync else []
        try:
            root = _open_dir(self.root, None, self.root.name or str(self.root))
            fds.append(root)
            directory = self._open_layout_directory(root)
            fds.append(directory)
            lock_fd = _open_file(self.directory / LOCK_FILE, directory)
            fds.append(lock_fd)
            _lock(lock_fd, self.directory)
            fd = _open_file(self.path, directory)
            fds.append(fd)
            _lock_slot_file(fd, self.directory)
            _name_holder(lock_fd, self.directory / LOCK_FILE)
            size = self.layer.fstat(fd).st_size
            head = self.layer.pread(fd, _SUPER.size + _CRC.size, 0)
        except DiskTierError as exc:
            _close_all(fds)
            return str(exc)
        except OSError as exc:
            _close_all(fds)
            return self._unusable(exc)
        if not job.claim():  # too late: the caller has given up; keep nothing open
            _close_all(fds)
        found_super = parse_superblock(head, self.fingerprint)
        return _Opened(fd, lock_fd, root, directory, made, size, found_super)

    def _start(self, opened: _Opened, job: Job[_Scanned | str | None]) -> _Scanned | str | None:
        """The blocks the scan found, the names made durable and room made; or the one-line
        reason the file cannot be used, or ``None`` once given up on (the caller closes what
        ``opened`` holds)."""
        try:
            scanned = self._scan(job, opened.fd, opened.size, opened.found_super)
            if scanned is None:
                return None
            if self._fsync:
                self._sync_entries(opened.root_fd, opened.directory_fd, opened.made)
            if scanned.superblock is not None:
                self._make_room(opened.root_fd, opened.fd, scanned.superblock.payload_bytes)
        except OSError as exc:
            return self._unusable(exc)
        if job.claim():  # ``DIR`` stays open: other layouts' files are found there
            _close_all([opened.directory_fd])
        return scanned

    def _open_layout_directory(self, root: int) -> int:
        """The fingerprint directory in ``DIR`` (``root``), made if missing.

        A file system full to the last block cannot make it (ENOSPC, EDQUOT: ext4 is so
        for all but root once only its reserved blocks are left), though other layouts'
        files may fill it: those no running tier holds are emptied, written longest ago
        first, until it can be made, as :meth:`_make_room` would at the first write (not
        when it is out of inodes, which no emptied file gives back).
        """
        stale: Iterator[tuple[str, float]] | None = None
        why = ""
        while True:
            try:
                return _open_dir(self.directory, root, self.directory.name)
            except OSError as exc:
                if exc.errno not in _NO_ROOM:
                    raise
                full = exc
            if stale is None:
                inodes = os.fstatvfs(root)
                if inodes.f_files > 0 and inodes.f_favail == 0:  # no files: inodes uncounted
                    stale, why = iter([]), ", out of inodes"
                else:
                    stale = iter(_other_layouts(root, self.directory.name))
                    why = (
                        f", and {self.root} holds no other layout's slot file that no "
                        "running tier holds to empty"
                    )
            for name, written in stale:
                freed = _empty_if_stale(root, name)
                if freed is not None:
                    logger.warning(
                        "disk tier: emptied %s, freeing %s bytes: a slot file of another "
                        "layout that no running tier holds, last written %s ago, while the "
                        "file system had no room left to make %s",
                        self.root / name / SLOT_FILE,
                        f"{freed:,}",
                        _age(written),
                        self.directory,
                    )
                    break
            else:
                raise _no_room(self.directory, full, why)

    def _unusable(self, exc: OSError) -> str:
        return f"cannot use disk tier directory {self.directory}: {exc.strerror or exc}"

    def _make_room(self, root: int, fd: int, payload_bytes: int) -> None:
        """Empty other layouts' slot files in ``DIR`` (``root``) that no running tier holds,
        those written longest ago first, while the file system has less room than this
        tier's file (``fd``) may still take when full; each emptied is one logged line.

        Nothing is touched while there is room: a rank or engine sharing ``DIR`` that has
        not started yet, or a model switched back to, finds its blocks again. Run on
        stripe 0 once the layout is known (on start if the file has one, else before the
        superblock's first write); a failure to look only warns.
        """
        try:
            wanted = footprint(self.capacity, payload_bytes) - _allocated(self.layer.fstat(fd))
            free = self.layer.free_bytes(fd)
            if wanted <= free:
                return
            for name, written in _other_layouts(root, self.directory.name):
                freed = _empty_if_stale(root, name)
                if freed is None:
                    continue
                logger.warning(
                    "disk tier: emptied %s, freeing %s bytes: a slot file of another layout "
                    "that no running tier holds, last written %s ago, while this tier's file "
                    "may take %s bytes more and %s were free",
                    self.root / name / SLOT_FILE,
                    f"{freed:,}",
                    _age(written),
                    f"{wanted:,}",
                    f"{free:,}",
                )
                free += freed
                if wanted <= free:
                    return
        except OSError as exc:
            logger.warning(
                "disk tier: could not look for other layouts' slot files in %s: %s",
                self.root,
                exc.strerror or exc,
            )

    def _sync_entries(self, root: int, directory: int, made: list[Path]) -> None:
        """Make the names the tier may just have made durable: the slot file's in its
        directory, the directory's in ``DIR``, and those of ``DIR`` and its parents if
        start-up ``made`` them. Synced data under a name a power loss takes back is lost
        all the same; the file is never renamed, so once is enough."""
        for fd in (directory, root):
            self._sync_directory(fd)
        for path in made:
            try:
                above = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            except PermissionError:  # may be written in but not read: nothing to sync with
                continue
            try:
                self._sync_directory(above)
            finally:
                os.close(above)

    def _sync_directory(self, fd: int) -> None:
        try:
            self.layer.fsync(fd)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: the file system syncs no directory
                raise

    def _scan(
        self, job: Job[_Scanned | str | None], fd: int, size: int, found_super: Superblock | None
    ) -> _Scanned | None:
        """The intact blocks in the file of ``size`` bytes, in slot order, within the
        capacity and each key in one slot; a foreign or broken file starts over empty.
        ``None`` once ``job`` is given up on: it stops there, as a kill would (what it
        blanked stays blank, the next start goes on), rather than keep a core and the
        directory's lock for every slot left."""
        recovery = Recovery()
        layer = self.layer
        if found_super is None or not found_super.ours:
            if size:
                if found_super is None:
                    recovery.corrupt += 1  # the file as a whole: its layout is unknown
                else:
                    recovery.foreign += -(-max(size - SUPER_BYTES, 0) // found_super.stride)
                layer.ftruncate(fd, 0)
            return _Scanned([], recovery, None)
        stride, payload = found_super.stride, found_super.payload_bytes
        intact: list[tuple[OffloadKey, int]] = []  # in slot order
        for slot in range(-(-max(size - SUPER_BYTES, 0) // stride)):
            if job.abandoned:
                return None
            start = slot_start(slot, stride)
            try:
                head = layer.pread(fd, _SCANNED_BYTES, start)
            except OSError as exc:
                if exc.errno != errno.EIO:
                    raise
                head = None  # a bad sector: its slot is lost, not the tier
            kind = "corrupt" if head is None else self._classify(head, payload)
            if isinstance(kind, bytes):
                if start + HEADER_BYTES + len(kind) + payload > size:
                    kind = "torn"
                else:
                    intact.append((OffloadKey(kind), slot))
                    continue
            elif kind is None:
                continue
            setattr(recovery, kind, getattr(recovery, kind) + 1)
            if slot < self.capacity:  # past it, the file is cut off below
                self._blank_found(fd, start)
        held: set[OffloadKey] = set()
        found = []
        for key, slot in intact:
            if slot >= self.capacity:
                recovery.beyond_capacity += 1
            elif key in held:
                recovery.duplicate += 1
                self._blank_found(fd, slot_start(slot, stride))
            else:
                held.add(key)
                found.append((key, slot))
        limit = slot_start(self.capacity, stride)
        if size > limit:
            layer.ftruncate(fd, limit)
        recovery.recovered = len(found)
        return _Scanned(found, recovery, found_super)

    def _blank_found(self, fd: int, start: int) -> None:
        """Blank a slot the scan drops, so that it is counted once; a disk failing there
        (EIO) leaves it to be dropped again by the next start, the tier starting all the
        same."""
        try:
            self.layer.pwrite(fd, _ZERO_HEADER, start)
        except OSError as exc:
            if exc.errno != errno.EIO:
                raise

    def _classify(self, head: bytes, payload: int) -> bytes | str | None:
        """A slot's key if its header is intact, ``None`` if blank, else why it is dropped."""
        if not any(head[:HEADER_BYTES]):
            return "torn" if any(head) else None
        try:
            header = parse_header(head)
        except CutShortError:  # torn if the file ends inside the header or key (read short)
            return "torn" if len(head) < _SCANNED_BYTES else "corrupt"
        except CorruptBlockError:
            return "corrupt"
        if header.fingerprint != self.fingerprint:
            return "foreign"
        if header.payload_bytes != payload or len(header.key) > MAX_KEY_BYTES:
            return "corrupt"
        return header.key


_LAYOUT_NAME = re.compile(r"[0-9a-f]{32}")
"""A fingerprint directory's name: 16 bytes in lowercase hex."""


def _allocated(info: os.stat_result) -> int:
    """Bytes a file takes on disk (a sparse file: fewer than its size)."""
    return info.st_blocks * 512


def _age(written: float) -> str:
    """How long ago ``written`` (a modification time) was, for a log line."""
    seconds = max(0.0, time.time() - written)
    for unit, length in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= length:
            return f"{seconds / length:.1f} {unit}"
    return f"{seconds:.0f} s"


def _other_layouts(root: int, own: str) -> list[tuple[str, float]]:
    """The fingerprint directories in ``root`` but ``own`` that hold a slot file, with the
    file's modification time, written longest ago first; links are not followed."""
    found = []
    for name in os.listdir(root):
        if name == own or not _LAYOUT_NAME.fullmatch(name):
            continue
        try:
            directory = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root)
        except OSError:  # a link, a file, gone since: not a tier's
            continue
        try:
            info = os.stat(SLOT_FILE, dir_fd=directory, follow_symlinks=False)
        except OSError:
            continue
        finally:
            os.close(directory)
        if stat.S_ISREG(info.st_mode) and info.st_size:
            found.append((name, info.st_mtime))
    return sorted(found, key=lambda entry: entry[1])


def _empty_if_stale(root: int, name: str) -> int | None:
    """Empty the slot file in ``root``/``name`` if it is a tier's and no running tier holds
    it; the bytes it took on disk, or ``None`` where it was left alone.

    A tier's: a directory and regular files of the running user, opened without following
    a link, the file with one link and an intact superblock that names the directory's
    fingerprint. Held: either lock taken (``lock``, or the slot file's own, which a tier
    whose ``lock`` was removed still holds). Emptied through the descriptor that was
    checked, under both locks, never by its name; its directory and ``lock`` stay (a
    start of that layout at this moment finds a file, empty, rather than none).
    """
    fds: list[int] = []
    try:
        fds.append(os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root))
        if os.fstat(fds[0]).st_uid != os.geteuid():
            return None
        for file in (LOCK_FILE, SLOT_FILE):
            flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            try:
                fds.append(os.open(file, flags, dir_fd=fds[0]))
            except FileNotFoundError:
                if file == SLOT_FILE:
                    return None
                continue  # ``lock`` removed: the slot file's own lock still tells
            info = os.fstat(fds[-1])
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                return None
            if info.st_nlink != 1:
                return None
            try:
                fcntl.flock(fds[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a running tier's
                return None
        slot = fds[-1]
        found = parse_superblock(os.pread(slot, _SUPER.size + _CRC.size, 0), b"")
        if found is None or found.fingerprint.hex() != name:
            return None
        freed = _allocated(os.fstat(slot))
        os.ftruncate(slot, 0)
        return freed
    except OSError:  # a link (ELOOP), not a directory, gone since, not ours to open
        return None
    finally:
        for fd in fds:
            os.close(fd)


def _missing(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist (yet: start-up makes them)."""
    return [p for p in (path, *path.parents) if not os.path.lexists(p)]


def _open_dir(path: Path, parent: int | None, name: str) -> int:
    """``path`` (``name`` in ``parent``), made 0700 if missing; a directory of ours, no link.

    ``DIR`` itself (no ``parent``) may also be root's, as a mount point an
    administrator made: everything below it is opened through descriptors
    and must be ours, so its owner cannot swap what we use. One found below it
    loses its group and other permissions but never gains one: a directory its
    owner may not write in was made so on purpose, and is refused, as it is.
    """
    where = name if parent is not None else str(path)
    made = False
    try:
        if parent is None:
            path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(where, 0o700, dir_fd=parent)
        made = True
    except FileExistsError:
        pass
    except FileNotFoundError:
        raise DiskTierError(f"disk tier directory {path}: its parent does not exist") from None
    except PermissionError as exc:  # ``DIR``'s parents are made by name: the one refused
        raise _cannot_create(Path(exc.filename) if parent is None else path) from None
    except OSError as exc:
        if exc.errno in _NO_ROOM and parent is None:
            raise _no_room(Path(exc.filename), exc) from None
        raise
    try:
        fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            _refuse(path, "is not a directory (or is a symbolic link, which is never followed)")
        if isinstance(exc, PermissionError):
            raise _denied(path, parent, where, "read, write and search (rwx)") from None
        raise
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid() and (parent is not None or info.st_uid != 0):
            _refuse(path, f"is owned by uid {info.st_uid}, not by the running user")
        mode = stat.S_IMODE(info.st_mode)
        if parent is not None and not made and mode & _OWNER_WRITES != _OWNER_WRITES:
            _refuse(path, f"is not writable by its owner (mode {mode:04o})")
        if mode & 0o077 and parent is not None:
            os.fchmod(fd, mode & 0o700)  # ours: private, as if just made
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_file(path: Path, parent: int) -> int:
    """``path`` in ``parent``, made 0600 if missing; a regular file of ours with one link."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path.name, flags, 0o600, dir_fd=parent)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            _refuse(path, "is a symbolic link, which is never followed")
        if exc.errno in (errno.EISDIR, errno.ENXIO, errno.ENODEV):  # a directory, socket, device
            _refuse(path, "is not a regular file")
        if isinstance(exc, PermissionError):
            raise _denied(path, parent, path.name, "read and write (rw)") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            _refuse(path, "is not a regular file")
        if info.st_uid != os.geteuid():
            _refuse(path, f"is owned by uid {info.st_uid}, not by the running user")
        if info.st_nlink != 1:
            _refuse(path, f"has {info.st_nlink} hard links; a slot file has one")
        if info.st_mode & 0o077:
            os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _cannot_create(path: Path) -> DiskTierError:
    """The one line for a directory the running user may not make: where, and what to do."""
    return DiskTierError(
        f"disk tier directory {path} cannot be created: the running user (uid {os.geteuid()}) "
        f"may not write in {path.parent}{_owner_and_mode(path.parent)}; give that user write "
        "permission there, or choose another disk directory"
    )


def _no_room(path: Path, exc: OSError, why: str = "") -> DiskTierError:
    """The one line for a directory a full file system cannot make."""
    return DiskTierError(
        f"disk tier directory {path} cannot be created: its file system is full "
        f"({exc.strerror}){why}; free room there, or choose another disk directory"
    )


def _denied(path: Path, parent: int | None, name: str, needs: str) -> DiskTierError:
    """The one line for ``path`` (``name`` in ``parent``) that the running user may not open:
    whose it is, or the permission its owner lacks, and what to do."""
    uid = os.geteuid()
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except OSError:  # a directory above it may not be searched
        return DiskTierError(
            f"disk tier path {path} cannot be reached by the running user (uid {uid}): "
            "permission denied on a directory above it; give that user search permission (x) "
            "on each, or choose another disk directory"
        )
    if info.st_uid != uid:
        return DiskTierError(
            f"disk tier path {path} is owned by uid {info.st_uid}, not by the running user "
            f"(uid {uid}); chown it to that user, or choose another disk directory"
        )
    return DiskTierError(
        f"disk tier path {path} cannot be opened by its owner, the running user (uid {uid}): "
        f"permission denied (mode {stat.S_IMODE(info.st_mode):04o}); give its owner {needs} "
        "permission, or choose another disk directory"
    )


def _owner_and_mode(path: Path) -> str:
    """`` (owner uid U, mode M)`` of ``path`` for an error line; empty if it cannot be read."""
    try:
        info = os.stat(path)
    except OSError:
        return ""
    return f" (owner uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o})"


def _lock(fd: int, directory: Path) -> None:
    """Hold ``lock``'s exclusive lock (``fd``) for the tier's life, or name its holder."""
    if not _locked(fd):
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        raise _in_use(directory, f"process {holder}")


def _lock_slot_file(fd: int, directory: Path) -> None:
    """Hold the slot file's own exclusive lock (``fd``) for the tier's life.

    ``lock`` may be deleted under its holder, and the next process then locks a new
    file of that name: the slot file's lock is what keeps it from writing the same
    slots. Its holder is not named (the ``lock`` that named it is gone).
    """
    if not _locked(fd):
        raise _in_use(directory, "another process, whose lock file was removed")


def _locked(fd: int) -> bool:
    """Whether ``fd``'s exclusive lock is now ours (``False``: another holds it)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    _HELD_LOCKS.add(fd)
    return True


def _in_use(directory: Path, holder: str) -> DiskTierError:
    """The one error of a directory another process holds, whichever lock says so."""
    return DiskTierError(
        f"disk tier directory {directory} is in use by {holder}; "
        "give each process its own disk directory"
    )


def _name_holder(fd: int, path: Path) -> None:
    """Write this process's pid in ``lock`` (``fd``, at ``path``), once the tier holds the
    directory.

    Only a name for the refusal of a second process: the ``flock`` is what holds the
    directory, so a pid that cannot be written (a disk full to the last block, whose
    other layouts' files the tier's first write may yet empty) only warns, the file
    emptied so that it names no process that has ended. Written over the old one before
    the file is cut to its length, so a page the file has is reused.
    """
    pid = f"{os.getpid()}\n".encode()
    try:
        os.pwrite(fd, pid, 0)
        os.ftruncate(fd, len(pid))
    except OSError as exc:
        with contextlib.suppress(OSError):  # cutting a file takes no room
            os.ftruncate(fd, 0)
        logger.warning(
            "disk tier: could not write this process's pid in %s (%s); a second process "
            "is refused all the same, naming no holder",
            path,
            exc.strerror or exc,
        )


def _drop_inherited_locks() -> None:
    """In a forked child: let go of the parent's locks, whose files the child shares.

    A ``flock`` lasts while any process holds its file open, so a child that outlives
    a crashed parent (a worker pool's) would otherwise keep the directory locked,
    naming a dead pid. Each descriptor is pointed at ``/dev/null`` rather than closed,
    so its number stays taken and a copy of the tier closing it later closes nothing
    of the child's own.
    """
    if not _HELD_LOCKS:
        return
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    for fd in _HELD_LOCKS:
        os.dup2(null, fd, inheritable=False)
    os.close(null)
    _HELD_LOCKS.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


def _refuse(path: Path, why: str) -> None:
    raise DiskTierError(f"disk tier path {path} {why}; refusing to use it")


def _close_all(fds: list[int], emptying: FileLayer | None = None) -> None:
    """Close ``fds``, the slot file's first; ``emptying``: truncate that file first, by it."""
    if emptying is not None:
        try:
            emptying.ftruncate(fds[0], 0)
        except OSError as exc:  # its blocks stay, each still intact under its own key
            logger.warning("disk tier file could not be emptied on close: %s", exc)
    for fd in fds:
        _HELD_LOCKS.discard(fd)
        os.close(fd)


def _nothing() -> None:
    """Nothing to release."""


def _spread(parts: list[memoryview], cursor: tuple[int, int], piece: memoryview) -> tuple[int, int]:
    """Copy ``piece`` into ``parts`` from ``cursor`` (part, offset in it) on; the cursor after."""
    views, after = _views_from(parts, cursor, len(piece))
    taken = 0
    for view in views:
        view[:] = piece[taken : taken + view.nbytes]
        taken += view.nbytes
    return after


def _views_from(
    parts: list[memoryview], cursor: tuple[int, int], size: int
) -> tuple[list[memoryview], tuple[int, int]]:
    """The next ``size`` bytes of ``parts`` from ``cursor`` (part, offset in it) on, as
    views in order, and the cursor after them."""
    part, at = cursor
    views = []
    while size > 0 and part < len(parts):
        view = parts[part][at : at + size]
        views.append(view)
        size -= view.nbytes
        at += view.nbytes
        if at == parts[part].nbytes:
            part, at = part + 1, 0
    return views, (part, at)
