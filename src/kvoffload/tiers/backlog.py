"""A lower tier's bound on the bytes of its writes not yet done.

The tiered manager never waits on a lower tier's writes in a live engine, so a tier
slower than the write-back (a healthy but slow server, a slow file system) would queue
payloads without end. A write offered while the bytes queued are at the bound is dropped
at once instead, as a cache may drop a store, and counted by its tier.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvoffload.core.errors import check_integer

PIPELINES_PER_THREAD = 2
"""Writes each I/O thread may have queued by default: one under way, one ready behind it,
so the thread never idles between two while a tier keeps up."""
WRITE_CHUNK_BYTES = 256 * 2**20
"""The shared tier's default pipeline, and the disk tier's unit for its default bound."""


def default_pending_bytes(io_threads: int, chunk_bytes: int = WRITE_CHUNK_BYTES) -> int:
    """The default bound: :data:`PIPELINES_PER_THREAD` writes of ``chunk_bytes`` per thread."""
    return PIPELINES_PER_THREAD * io_threads * chunk_bytes


class WriteBacklog:
    """Bytes of the writes queued or under way, against ``max_bytes``.

    Thread-safe: writes are held on the caller's thread and released on I/O threads.
    """

    def __init__(self, max_bytes: int | None, default_bytes: int) -> None:
        """``max_bytes`` as its tier was given it; ``None``: ``default_bytes``."""
        max_bytes = default_bytes if max_bytes is None else max_bytes
        check_integer("max_pending_write_bytes", max_bytes, 1)
        self.max_bytes = max_bytes
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def pending_bytes(self) -> int:
        return self._bytes

    @property
    def is_full(self) -> bool:
        """Whether the bytes queued are at the bound: a write offered now is dropped. A write
        offered to an empty backlog is taken however large, so a batch past the bound is not
        refused for good."""
        return self._bytes >= self.max_bytes

    def hold(self, nbytes: int) -> Callable[[], None]:
        """Count ``nbytes`` of a write queued; the function returned takes them out again on
        its first call only, so a write's finish and its poll may both call it."""
        with self._lock:
            self._bytes += nbytes
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if not released:
                    released = True
                    self._bytes -= nbytes

        return release


class BacklogFigures:
    """What a tier with a :class:`WriteBacklog` (its ``_backlog``) shows of it."""

    _backlog: WriteBacklog

    @property
    def pending_write_bytes(self) -> int:
        """Payload bytes of the writes queued or under way."""
        return self._backlog.pending_bytes

    @property
    def max_pending_write_bytes(self) -> int:
        return self._backlog.max_bytes
