"""The contract between the tier stack and the tiers below the CPU tier.

It lives in ``core`` because both sides need it: the stack
(:mod:`kvoffload.managers.tiered`) calls tiers, the tiers
(:mod:`kvoffload.tiers`) and the data plane's slot stores implement it, and
managers may not import tiers nor tiers import managers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from kvoffload.core.errors import InvalidArgumentError, KVOffloadError, is_number
from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import OffloadingEvent

MAX_IO_THREADS = 256
"""The most I/O threads (the shared tier's connections) a lower tier takes: the tiers start
them all at once, so a byte count typed for a thread count started threads until the
system refused one, and those already started were never stopped."""


def check_io_threads(value: object, name: str = "io_threads") -> None:
    """:class:`InvalidArgumentError` naming ``name`` unless ``value`` is an int from 1 to
    :data:`MAX_IO_THREADS`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_IO_THREADS:
        raise InvalidArgumentError(
            f"{name} must be an integer from 1 to {MAX_IO_THREADS}, got {value!r}"
        )


MIN_DEADLINE_S, MAX_DEADLINE_S = 0.001, 600.0
"""The bounds of a lower tier's I/O deadline: under a millisecond every job would miss it
and count as failed; past 10 minutes a hung call would hold the engine that long."""


def check_deadline_s(value: object, name: str) -> None:
    """:class:`InvalidArgumentError` naming ``name`` unless ``value`` is a number of seconds
    from :data:`MIN_DEADLINE_S` to :data:`MAX_DEADLINE_S` (nan fails both comparisons)."""
    if not is_number(value) or not MIN_DEADLINE_S <= value <= MAX_DEADLINE_S:
        raise InvalidArgumentError(
            f"{name} must be from {MIN_DEADLINE_S:g} s to {MAX_DEADLINE_S:.0f} s, got {value!r}"
        )


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

    def held(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """Per key, whether this tier holds it ready to read, keys in any order (vLLM asks
        a sliding-window layer's keys from the newest back)."""
        ...

    def read(self, keys: Sequence[OffloadKey], target: Target) -> Future[list[bool]]:
        """Read ``keys`` in the background into ``target``; per key, whether it arrived intact."""
        ...

    def write(self, keys: Sequence[OffloadKey], payloads: Sequence[bytes]) -> int:
        """Store ``keys`` in the background (keys already held are skipped); returns how many
        blocks it set out to write, what a write budget is charged for."""
        ...

    def poll(self, wait: bool) -> None:
        """Apply finished background writes; with ``wait``, first wait for all of them."""
        ...

    def wait_written(self) -> None:
        """Wait until the writes queued so far are done or past their deadline, applying
        none (that is :meth:`poll`'s). It changes nothing the other calls read, so a caller
        that serialises the tier's calls under a lock waits here without it, its look-ups
        and reads going on, then polls under it; a tier whose writes are done when
        :meth:`write` returns has nothing to wait for."""
        ...

    def has_pending_work(self) -> bool:
        """Whether :meth:`poll` has work still to apply: writes queued, under way, or
        finished and not yet polled."""
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
