"""The local-disk tier: one file per block, written atomically, indexed in memory.

Each block is written to a temporary file and renamed into place, so a crash
leaves either the whole block or a stray temporary file, never a torn block
under a block's name. On start the tier rebuilds its index from the files
whose header matches this tier's fingerprint and whose size matches their
header, and deletes temporary files and broken ones; a flipped byte is caught
by the checksum when the block is read, and the file is deleted then.

File I/O runs on single-threaded stripes (a key always goes to the same
stripe), so a write, a read and a delete of one key happen in call order
without locks, while different keys proceed in parallel. The index and the
eviction policy belong to the caller's thread; I/O threads only report back.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import OffloadingEvent
from kvoffload.managers.tiered import Target, TierStats
from kvoffload.policies import PENDING_STORE, BlockStatus, create_cache_policy
from kvoffload.tiers.format import (
    HEADER_BYTES,
    CorruptBlockError,
    encode_header,
    parse_header,
)
from kvoffload.tiers.targets import destination

MEDIUM = "DISK"
SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"

T = TypeVar("T")


class DiskTier:
    """Up to ``capacity_blocks`` blocks under ``directory/<fingerprint hex>/``.

    ``fsync`` makes each block durable before it is renamed into place (power
    loss safety, at a large cost in write speed); without it a process crash
    still never exposes a torn block. A full or failing disk (ENOSPC, EIO)
    turns into counted failed stores, never an exception for the caller.
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
        self.capacity_blocks = capacity_blocks
        self.fingerprint = fingerprint
        self.directory = Path(directory) / fingerprint.hex()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidArgumentError(
                f"cannot use disk tier directory {directory}: {exc}"
            ) from None
        self.stats = TierStats()
        self._fsync = fsync
        self._policy = create_cache_policy(cache_policy, capacity_blocks)
        self._index: dict[OffloadKey, BlockStatus] = {}
        self._next_id = 0
        self._stripes = [ThreadPoolExecutor(1, f"kvoffload-disk-{i}") for i in range(io_threads)]
        self._writes: list[tuple[list[OffloadKey], Future[list[bool]]]] = []
        self._broken: queue.SimpleQueue[OffloadKey] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._rebuild()

    def __len__(self) -> int:
        return len(self._index)

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
        parts = [
            (positions, self._stripes[s].submit(self._read_files, keys, positions, target))
            for s, positions in self._by_stripe(keys).items()
        ]
        result: Future[list[bool]] = Future()
        outcome = [False] * len(keys)
        remaining = [len(parts)]

        def gather(positions: list[int], part: Future[list[bool]]) -> None:
            for i, ok in zip(positions, _outcome(part, len(positions), False), strict=True):
                outcome[i] = ok
            with self._lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
                self.stats.hit_blocks += sum(outcome)
            result.set_result(outcome)

        for positions, part in parts:
            part.add_done_callback(functools.partial(gather, positions))
        return result

    def write(self, keys: Sequence[OffloadKey], payloads: Sequence[bytes]) -> None:
        """Queue writes of the keys not held yet, evicting to make room where possible."""
        index = self._index
        offered = {key: payload for key, payload in zip(keys, payloads, strict=True)}
        new = [key for key in offered if key not in index]
        if not new:
            return
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
        blocks = [self._new_block() for _ in new]
        index.update(zip(new, blocks, strict=True))
        self._policy.insert(new, blocks)
        for positions in self._by_stripe(new).values():
            batch = [new[i] for i in positions]
            job = self._stripes[self._stripe(batch[0])].submit(
                self._write_files, batch, [offered[key] for key in batch]
            )
            self._writes.append((batch, job))

    def poll(self, wait: bool) -> None:
        """Make finished writes readable, forget failed ones and blocks found broken."""
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
        self.stats.stored_blocks += len(landed)
        if landed and self._events is not None:
            self._events.append(OffloadingEvent(landed, MEDIUM, removed=False))
        self._writes = running
        broken = []
        while not self._broken.empty():
            key = self._broken.get()
            self.stats.corrupt += 1
            block = self._index.get(key)
            if block is not None and block.ref_cnt != PENDING_STORE:  # not a fresh rewrite
                broken.append(key)
        if broken:
            self._forget(broken)
            if self._events is not None:
                self._events.append(OffloadingEvent(broken, MEDIUM, removed=True))

    def take_events(self) -> list[OffloadingEvent]:
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        self.poll(wait=True)
        for stripe in self._stripes:
            stripe.shutdown(wait=True)

    def path(self, key: OffloadKey) -> Path:
        return self.directory / (key.hex() + SUFFIX)

    def _new_block(self) -> BlockStatus:
        self._next_id += 1
        return BlockStatus(self._next_id)

    def _stripe(self, key: OffloadKey) -> int:
        return hash(key) % len(self._stripes)

    def _by_stripe(self, keys: Sequence[OffloadKey]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(self._stripe(key), []).append(i)
        return groups

    def _evict(self, keys: list[OffloadKey]) -> None:
        for key in keys:
            del self._index[key]
        self.stats.evicted += len(keys)
        for positions in self._by_stripe(keys).values():
            batch = [keys[i] for i in positions]
            self._stripes[self._stripe(batch[0])].submit(self._delete_files, batch)
        if self._events is not None:
            self._events.append(OffloadingEvent(keys, MEDIUM, removed=True))

    def _forget(self, keys: list[OffloadKey]) -> None:
        for key in keys:
            del self._index[key]
        self._policy.remove(keys)

    # I/O threads from here on: files only, never the index.

    def _write_files(self, keys: list[OffloadKey], payloads: list[bytes]) -> list[bool]:
        return [self._write_file(key, payload) for key, payload in zip(keys, payloads, strict=True)]

    def _write_file(self, key: OffloadKey, payload: bytes) -> bool:
        final = self.path(key)
        temp = final.with_suffix(TEMP_SUFFIX)
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                data = [encode_header(key, self.fingerprint, payload), payload]
                expected = len(data[0]) + len(payload)
                if os.writev(fd, data) != expected:
                    raise OSError(f"short write of {final}")
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, final)
        except OSError:
            _unlink(temp)
            return False
        return True

    def _read_files(
        self, keys: list[OffloadKey], positions: list[int], target: Target
    ) -> list[bool]:
        return [self._read_file(keys[i], i, target) for i in positions]

    def _read_file(self, key: OffloadKey, index: int, target: Target) -> bool:
        """Read ``key``'s payload straight into its target, then check it there."""
        path = self.path(key)
        try:
            with open(path, "rb", buffering=0) as file:
                head = file.read(HEADER_BYTES + len(key))
                header = parse_header(head)
                header.check(key, self.fingerprint)
                if os.fstat(file.fileno()).st_size != header.size + header.payload_bytes:
                    raise CorruptBlockError(f"block file of {key!r} is torn")
                view = destination(target, index, header.payload_bytes)
                if view is None:
                    return False
                if header.payload_bytes and file.readinto(view) != header.payload_bytes:
                    raise CorruptBlockError(f"block file of {key!r} is torn")
            header.verify(view)
        except CorruptBlockError:
            _unlink(path)
            self._broken.put(key)
            return False
        except OSError:
            return False
        return True

    def _delete_files(self, keys: list[OffloadKey]) -> None:
        for key in keys:
            _unlink(self.path(key))

    def _rebuild(self) -> None:
        """Index the intact blocks already on disk (on an I/O thread), least recent first."""
        found = self._stripes[0].submit(self._scan).result()
        found.sort(key=lambda item: item[1])
        keys = [key for key, _ in found]
        overflow = len(keys) - self.capacity_blocks
        if overflow > 0:
            self._stripes[0].submit(self._delete_files, keys[:overflow]).result()
            keys = keys[overflow:]
        blocks = [self._new_block() for _ in keys]
        for block in blocks:
            block.ref_cnt = 0
        self._index.update(zip(keys, blocks, strict=True))
        self._policy.insert(keys, blocks)

    def _scan(self) -> list[tuple[OffloadKey, float]]:
        found = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(TEMP_SUFFIX):
                _unlink(Path(entry.path))
            elif entry.name.endswith(SUFFIX):
                key = self._check_file(Path(entry.path))
                if key is None:
                    self.stats.corrupt += 1
                    _unlink(Path(entry.path))
                else:
                    found.append((key, entry.stat().st_mtime))
        return found

    def _check_file(self, path: Path) -> OffloadKey | None:
        """The key of an intact-looking block file: header, name and size must agree."""
        try:
            with open(path, "rb") as file:
                head = file.read(HEADER_BYTES + 256)
                size = os.fstat(file.fileno()).st_size
            header = parse_header(head)
        except (OSError, CorruptBlockError):
            return None
        if header.fingerprint != self.fingerprint or path.name != header.key.hex() + SUFFIX:
            return None
        if size != header.size + header.payload_bytes:
            return None
        return OffloadKey(header.key)


def _outcome(job: Future[list[T]], n: int, failed: T) -> list[T]:
    """The I/O thread's per-block results; ``failed`` for all if it died unexpectedly."""
    try:
        return job.result()
    except Exception:  # an I/O thread's surprise is a failed batch, not the engine's problem
        return [failed] * n


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        return
