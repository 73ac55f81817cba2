"""The local-disk tier: one slot file of fixed-size slots, indexed in memory.

``DIR/<fingerprint hex>/blocks.kvs`` starts with a checksummed superblock
(magic, version, fingerprint, slot stride); slot ``i`` lies at
``SUPER_BYTES + i * stride`` and holds one block exactly as the shared tier
stores it (:mod:`kvoffload.tiers.format`: header, key, payload). The stride
is fixed by the first write (the payload size is constant per fingerprint)
and the file stays sparse: it grows only where slots are written, so a full
disk shows up as a failed store.

Crash safety without temporary files: a slot is written payload first, with
its old header zeroed in the same call, and its new header last, in a second
call. A process killed mid-write leaves a slot without a valid header, which
a restart does not index; never an old header over new bytes. With
``fsync=True`` a batch's payloads are synced before its headers are written,
and the headers after (power-loss safety). A file per block with temp file +
rename gives the same guarantee at the cost of an inode and a rename per
block (30-50% of the store time in the kernel on the dev VM); an append-only
segment needs compaction. Eviction is free: the slot is reused, nothing is
unlinked.

File I/O runs on single-threaded stripes keyed by slot (slot % stripes), so
a read of a slot and a later write into that slot, reused by another key,
happen in call order without locks. The index, the free slots and the
eviction policy belong to the caller's thread; I/O threads only report back.
"""

from __future__ import annotations

import functools
import os
import queue
import struct
import threading
import zlib
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import EventLog, OffloadingEvent
from kvoffload.managers.tiered import Target, TierStats
from kvoffload.policies import PENDING_STORE, BlockStatus, create_cache_policy
from kvoffload.tiers.format import (
    FINGERPRINT_BYTES,
    HEADER_BYTES,
    CorruptBlockError,
    Header,
    encode_header,
    parse_header,
)
from kvoffload.tiers.targets import destination

MEDIUM = "DISK"
SLOT_FILE = "blocks.kvs"
MAX_KEY_BYTES = 256
"""The longest key a slot reserves room for (vLLM's keys have 36 bytes)."""
ALIGN = 4096
SUPER_BYTES = ALIGN
"""Room before slot 0 for the superblock: slots start page-aligned."""
SUPER_MAGIC = b"KVOS"
SUPER_VERSION = 1

_SUPER = struct.Struct("<4sHH16sQ")
"""magic, version, reserved, fingerprint, stride; a CRC32 of these follows."""
_CRC = struct.Struct("<I")
_ZERO_HEADER = bytes(HEADER_BYTES + MAX_KEY_BYTES)

T = TypeVar("T")


def slot_stride(payload_bytes: int) -> int:
    """Bytes per slot for payloads of ``payload_bytes``: header and longest key, page-aligned."""
    return -(-(HEADER_BYTES + MAX_KEY_BYTES + payload_bytes) // ALIGN) * ALIGN


def slot_start(slot: int, stride: int) -> int:
    """Where ``slot`` starts in the slot file."""
    return SUPER_BYTES + slot * stride


def encode_superblock(fingerprint: bytes, stride: int) -> bytes:
    fields = _SUPER.pack(SUPER_MAGIC, SUPER_VERSION, 0, fingerprint, stride)
    return fields + _CRC.pack(zlib.crc32(fields))


def parse_superblock(data: bytes, fingerprint: bytes) -> int | None:
    """The stride recorded in ``data``, or ``None`` unless it is an intact superblock of ours."""
    if len(data) < _SUPER.size + _CRC.size:
        return None
    magic, version, _, found, stride = _SUPER.unpack_from(data)
    (crc,) = _CRC.unpack_from(data, _SUPER.size)
    if zlib.crc32(data[: _SUPER.size]) != crc or magic != SUPER_MAGIC:
        return None
    if version != SUPER_VERSION or found != fingerprint or stride <= 0 or stride % ALIGN:
        return None
    return int(stride)


class DiskTier:
    """Up to ``capacity_blocks`` blocks in ``directory/<fingerprint hex>/blocks.kvs``.

    ``fsync`` makes each batch durable before its headers make it visible
    (power-loss safety, at a cost in write speed); without it a process crash
    still never exposes a torn block. A full or failing disk (ENOSPC, EIO),
    a removed file or a block too large for the slots turns into counted
    failed stores, never an exception for the caller.
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
    ) -> None:
        if capacity_blocks < 1:
            raise InvalidArgumentError(f"disk capacity must be >= 1 block, got {capacity_blocks}")
        if io_threads < 1:
            raise InvalidArgumentError(f"io_threads must be >= 1, got {io_threads}")
        if len(fingerprint) != FINGERPRINT_BYTES:
            raise InvalidArgumentError(
                f"a fingerprint has {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}"
            )
        self._policy = create_cache_policy(cache_policy, capacity_blocks)
        self.capacity_blocks = capacity_blocks
        self.fingerprint = fingerprint
        self.directory = Path(directory) / fingerprint.hex()
        self.path = self.directory / SLOT_FILE
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise InvalidArgumentError(
                f"cannot use disk tier directory {directory}: {exc}"
            ) from None
        self.stats = TierStats()
        self._fsync = fsync
        self._index: dict[OffloadKey, BlockStatus] = {}
        self._free: list[int] = []
        self._stride: int | None = None
        self._superblock: Future[bool] | None = None
        self._stripes = [ThreadPoolExecutor(1, f"kvoffload-disk-{i}") for i in range(io_threads)]
        self._writes: list[tuple[list[OffloadKey], Future[list[bool]]]] = []
        self._broken: queue.SimpleQueue[tuple[OffloadKey, int]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._events = EventLog(enable_events)
        self._rebuild()

    def __len__(self) -> int:
        return len(self._index)

    @property
    def stride(self) -> int | None:
        """Bytes per slot, once the first write (or the file found on start) fixed it."""
        return self._stride

    def slot_offset(self, key: OffloadKey) -> int | None:
        """Where ``key``'s slot starts in :attr:`path`, if the tier holds it."""
        block = self._index.get(key)
        if block is None or self._stride is None:
            return None
        return slot_start(block.block_id, self._stride)

    def present(self, keys: Sequence[OffloadKey]) -> int:
        index = self._index
        run = 0
        for key in keys:
            block = index.get(key)
            if block is None or block.ref_cnt == PENDING_STORE:
                break
            run += 1
        return run

    def read(self, keys: Sequence[OffloadKey], target: Target) -> Future[list[bool]]:
        """Read ``keys`` (all stripes in parallel); a missing or broken block reads as ``False``."""
        keys = list(keys)
        self._policy.touch(reversed(keys))
        index = self._index
        slots = [-1 if (block := index.get(key)) is None else block.block_id for key in keys]
        groups = self._by_stripe(slots)
        result: Future[list[bool]] = Future()
        outcome = [False] * len(keys)
        if not groups or self._stride is None:
            result.set_result(outcome)
            return result
        stride = self._stride
        remaining = [len(groups)]

        def gather(positions: list[int], part: Future[list[bool]]) -> None:
            for i, ok in zip(positions, _outcome(part, len(positions), False), strict=True):
                outcome[i] = ok
            with self._lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
                self.stats.hit_blocks += sum(outcome)
            result.set_result(outcome)

        for s, positions in groups.items():
            jobs = [(i, keys[i], slots[i]) for i in positions]
            part = self._stripes[s].submit(self._read_slots, jobs, stride, target)
            part.add_done_callback(functools.partial(gather, positions))
        return result

    def write(self, keys: Sequence[OffloadKey], payloads: Sequence[bytes]) -> None:
        """Queue writes of the keys not held yet, evicting to make room where possible."""
        index = self._index
        offered = {key: payload for key, payload in zip(keys, payloads, strict=True)}
        new = [key for key in offered if key not in index]
        if not new:
            return
        if self._stride is None:
            self._stride = slot_stride(len(offered[new[0]]))
        if self._superblock is None:
            header = encode_superblock(self.fingerprint, self._stride)
            self._superblock = self._stripes[0].submit(self._write_superblock, header)
        room = self.capacity_blocks - len(index)
        if len(new) > room:
            victims = self._policy.evict(len(new) - room, offered)
            if victims is None:
                fit = max(room, 0)
                self.stats.rejected += len(new) - fit
                new = new[:fit]
            else:
                self._evict([key for key, _ in victims])
        if not new:
            return
        blocks = [BlockStatus(self._free.pop()) for _ in new]
        index.update(zip(new, blocks, strict=True))
        self._policy.insert(new, blocks)
        slots = [block.block_id for block in blocks]
        for s, positions in self._by_stripe(slots).items():
            batch = [new[i] for i in positions]
            job = self._stripes[s].submit(
                self._write_slots,
                [slots[i] for i in positions],
                batch,
                [offered[key] for key in batch],
                self._stride,
                self._superblock,
            )
            self._writes.append((batch, job))

    def poll(self, wait: bool) -> None:
        """Forget blocks found broken, make finished writes readable, free failed ones."""
        broken = []
        while not self._broken.empty():
            key, slot = self._broken.get()
            self.stats.corrupt += 1
            block = self._index.get(key)
            if block is not None and block.block_id == slot and block.ref_cnt != PENDING_STORE:
                broken.append(key)
        if broken:
            self._forget(broken)
            self._events.record(broken, MEDIUM, removed=True)
        running = []
        landed: list[OffloadKey] = []
        for batch, job in self._writes:
            if not (wait or job.done()):
                running.append((batch, job))
                continue
            written = _outcome(job, len(batch), False)
            stored = [key for key, ok in zip(batch, written, strict=True) if ok]
            failed = [key for key, ok in zip(batch, written, strict=True) if not ok]
            for key in stored:
                self._index[key].ref_cnt = 0
            landed += stored
            if failed:
                self.stats.failed += len(failed)
                self._forget(failed)
        self._writes = running
        self.stats.stored_blocks += len(landed)
        if landed:
            self._events.record(landed, MEDIUM, removed=False)
        superblock = self._superblock
        if superblock is not None and superblock.done() and not _succeeded(superblock):
            self._superblock = None  # written again with the next batch

    def take_events(self) -> list[OffloadingEvent]:
        return self._events.take()

    def close(self) -> None:
        """Finish the writes in flight and close the file; closing twice is harmless."""
        if self._fd < 0:
            return
        self.poll(wait=True)
        for stripe in self._stripes:
            stripe.shutdown(wait=True)
        os.close(self._fd)
        self._fd = -1

    def _by_stripe(self, slots: Sequence[int]) -> dict[int, list[int]]:
        """Positions of the held slots (``-1``: not held) by the stripe that owns them."""
        stripes = len(self._stripes)
        groups: dict[int, list[int]] = {}
        for i, slot in enumerate(slots):
            if slot >= 0:
                groups.setdefault(slot % stripes, []).append(i)
        return groups

    def _evict(self, keys: list[OffloadKey]) -> None:
        """Drop ``keys`` from the index; their slots are free at once (nothing to delete)."""
        index = self._index
        self._free.extend(index.pop(key).block_id for key in keys)
        self.stats.evicted += len(keys)
        self._events.record(keys, MEDIUM, removed=True)

    def _forget(self, keys: list[OffloadKey]) -> None:
        index = self._index
        self._free.extend(index.pop(key).block_id for key in keys)
        self._policy.remove(keys)

    # I/O threads from here on: the file only, never the index.

    def _write_superblock(self, data: bytes) -> bool:
        try:
            written = os.pwrite(self._fd, data, 0)
            if self._fsync:
                os.fdatasync(self._fd)
        except OSError:
            return False
        return written == len(data)

    def _write_slots(
        self,
        slots: list[int],
        keys: list[OffloadKey],
        payloads: list[bytes],
        stride: int,
        superblock: Future[bool],
    ) -> list[bool]:
        """Payloads first (over zeroed old headers), then the headers: see the module docstring."""
        ok = [False] * len(slots)
        if not _succeeded(superblock) or not self._linked():
            return ok
        fd = self._fd
        headers: list[bytes | None] = []
        for slot, key, payload in zip(slots, keys, payloads, strict=True):
            header = encode_header(key, self.fingerprint, payload)
            if len(header) > HEADER_BYTES + MAX_KEY_BYTES or len(header) + len(payload) > stride:
                headers.append(None)
                continue
            blank = memoryview(_ZERO_HEADER)[: len(header)]
            try:
                done = os.pwritev(fd, [blank, payload], slot_start(slot, stride))
            except OSError:
                done = -1
            headers.append(header if done == len(header) + len(payload) else None)
        if self._fsync and not _synced(fd):
            return ok
        for i, (slot, written) in enumerate(zip(slots, headers, strict=True)):
            if written is None:
                continue
            try:
                ok[i] = os.pwrite(fd, written, slot_start(slot, stride)) == len(written)
            except OSError:
                continue
        if self._fsync and not _synced(fd):
            return [False] * len(slots)
        return ok

    def _linked(self) -> bool:
        """Whether the slot file still has a name: a removed one is a failing disk."""
        try:
            return os.fstat(self._fd).st_nlink > 0
        except OSError:
            return False

    def _read_slots(
        self, jobs: list[tuple[int, OffloadKey, int]], stride: int, target: Target
    ) -> list[bool]:
        return [self._read_slot(i, key, slot, stride, target) for i, key, slot in jobs]

    def _read_slot(
        self, index: int, key: OffloadKey, slot: int, stride: int, target: Target
    ) -> bool:
        """Read ``key``'s payload straight into its target, then check it there."""
        start = slot_start(slot, stride)
        try:
            header = parse_header(os.pread(self._fd, HEADER_BYTES + len(key), start))
            header.check(key, self.fingerprint)
            view = destination(target, index, header.payload_bytes)
            if view is None:
                return False
            if header.payload_bytes and os.preadv(self._fd, [view], start + header.size) != len(
                view
            ):
                raise CorruptBlockError(f"slot of {key!r} is torn")
            header.verify(view)
        except CorruptBlockError:
            self._zero_header(slot, stride)
            self._broken.put((key, slot))
            return False
        except OSError:
            return False
        return True

    def _zero_header(self, slot: int, stride: int) -> None:
        """Make a broken slot empty, so that a restart does not index it again."""
        try:
            os.pwrite(self._fd, _ZERO_HEADER, slot_start(slot, stride))
        except OSError:
            return

    def _rebuild(self) -> None:
        """Index the intact blocks already in the file (on an I/O thread), in slot order."""
        found = self._stripes[0].submit(self._scan).result()
        found.sort(key=lambda item: item[1])
        keys = [key for key, _ in found]
        blocks = [BlockStatus(slot) for _, slot in found]
        for block in blocks:
            block.ref_cnt = 0
        self._index.update(zip(keys, blocks, strict=True))
        self._policy.insert(keys, blocks)
        used = {block.block_id for block in blocks}
        # Popped from the end: the lowest free slot first, keeping the file compact.
        self._free = [slot for slot in range(self.capacity_blocks - 1, -1, -1) if slot not in used]

    def _scan(self) -> list[tuple[OffloadKey, int]]:
        """(key, slot) of each intact-looking slot; a foreign or broken file starts over empty."""
        fd = self._fd
        try:
            size = os.fstat(fd).st_size
            stride = parse_superblock(os.pread(fd, _SUPER.size + _CRC.size, 0), self.fingerprint)
            if stride is None:
                if size:
                    os.ftruncate(fd, 0)
                return []
            limit = slot_start(self.capacity_blocks, stride)
            if size > limit:
                os.ftruncate(fd, limit)
                size = limit
        except OSError:
            return []
        self._stride = stride
        found: dict[OffloadKey, int] = {}
        for slot in range(min(self.capacity_blocks, -(-max(size - SUPER_BYTES, 0) // stride))):
            header = self._check_slot(slot, stride, size)
            if header is None:
                self.stats.corrupt += 1
            elif header is not _EMPTY:
                found.setdefault(OffloadKey(header.key), slot)
        return [(key, slot) for key, slot in found.items()]

    def _check_slot(self, slot: int, stride: int, size: int) -> Header | None:
        """The slot's header if it looks intact, ``_EMPTY`` if blank, ``None`` if broken."""
        start = slot_start(slot, stride)
        try:
            head = os.pread(self._fd, HEADER_BYTES + MAX_KEY_BYTES, start)
        except OSError:
            return None
        if not any(head[:HEADER_BYTES]):
            return _EMPTY
        try:
            header = parse_header(head)
        except CorruptBlockError:
            return None
        if header.fingerprint != self.fingerprint:
            return None
        end = header.size + header.payload_bytes
        if end > stride or start + end > size:
            return None
        return header


_EMPTY = Header(b"", b"", 0, 0)
"""What :meth:`DiskTier._check_slot` finds in a slot never written or zeroed."""


def _succeeded(job: Future[bool]) -> bool:
    try:
        return job.result()
    except Exception:  # as in _outcome: a failure, not the engine's problem
        return False


def _synced(fd: int) -> bool:
    try:
        os.fdatasync(fd)
    except OSError:
        return False
    return True


def _outcome(job: Future[list[T]], n: int, failed: T) -> list[T]:
    """The I/O thread's per-block results; ``failed`` for all if it died unexpectedly."""
    try:
        return job.result()
    except Exception:  # an I/O thread's surprise is a failed batch, not the engine's problem
        return [failed] * n
