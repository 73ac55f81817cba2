"""Ghost records: recently decided keys, their class, and when they were decided.

A ghost holds no data, only ``key -> (tag, clock)``. The clock is whatever
the owner counts (here: blocks written to the tier), so a record can expire
once the tier has turned over since it was made: a key that comes back
before that is a *return*, one whose record expires or is pushed out is an
*expiry*. At most ``capacity`` records are kept.

Where the package was built with a C compiler, :func:`ghost_records` gives the same
records in C (``_ghost.c``): the same answers and order, without a Python loop per key.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import OffloadKey

try:
    from kvoffload.admission._ghost import GhostTable
except ImportError:  # installed without a C compiler: the Python records alone
    GhostTable = None  # type: ignore[assignment,misc]

BYTES_PER_RECORD = 160
"""Approximate CPython cost of one ordered-dict entry holding a bytes key and a small tuple
(the compiled records count their own arrays, about 60 bytes a record)."""


class GhostRecords:
    """At most ``capacity`` keys, oldest first, each with a tag and the clock when recorded."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise InvalidArgumentError(f"ghost capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._records: OrderedDict[OffloadKey, tuple[int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: object) -> bool:
        return key in self._records

    @property
    def memory_bytes(self) -> int:
        return self.capacity * BYTES_PER_RECORD

    def add(self, key: OffloadKey, tag: int, clock: int = 0) -> int | None:
        """Record ``key``; return the tag of a record this pushed out, if any."""
        pushed = self.add_all((key,), tag, clock)
        return pushed[0] if pushed else None

    def add_all(self, keys: Iterable[OffloadKey], tag: int, clock: int = 0) -> list[int]:
        """Record each of ``keys`` in turn (a recorded one moves to the newest end with its
        new tag and clock); return the tags of the records pushed out.

        A new key takes a free place while there is one (counted down, not
        measured per key), else it pushes out the oldest record first, which
        is the record that inserting it and then trimming would push out.
        """
        records, record = self._records, (tag, clock)
        free = self.capacity - len(records)
        pushed: list[int] = []
        for key in keys:
            if key in records:
                records.move_to_end(key)
            elif free > 0:
                free -= 1
            else:
                pushed.append(records.popitem(False)[1][0])
            records[key] = record
        return pushed

    def take_all(self, keys: Sequence[OffloadKey]) -> list[int]:
        """Forget those of ``keys`` that are recorded; return their tags, in ``keys`` order."""
        records = self._records
        # Most requests return none: one pass in C says so.
        if records.keys().isdisjoint(keys):
            return []
        pop = records.pop
        return [pop(key)[0] for key in keys if key in records]

    def take(self, key: OffloadKey) -> int | None:
        """Forget ``key`` and return its tag, or ``None`` if it is not recorded."""
        taken = self.take_all((key,))
        return taken[0] if taken else None

    def expire(self, before: int) -> list[int]:
        """Drop the records made at a clock below ``before``; return their tags."""
        records = self._records
        expired: list[int] = []
        while records:
            key = next(iter(records))
            tag, clock = records[key]
            if clock >= before:
                break
            del records[key]
            expired.append(tag)
        return expired


CompiledGhostRecords: type[GhostRecords] | None = None
"""The records in C, where the package was built with a compiler; ``None`` where not."""
if GhostTable is not None:

    class _CompiledGhostRecords(GhostTable, GhostRecords):
        """:class:`GhostRecords` with every operation in C; its records live in C."""

        def __init__(self, capacity: int) -> None:
            """The C type's constructor made (and checked) the records."""

    CompiledGhostRecords = _CompiledGhostRecords


def ghost_records(capacity: int) -> GhostRecords:
    """At most ``capacity`` records: in C where it was built, else in Python."""
    return (CompiledGhostRecords or GhostRecords)(capacity)
