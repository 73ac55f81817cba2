"""One bounded reuse counter: how often each recent key was seen, in at most ``max_keys`` keys.

It is the table behind every "seen N times" rule: the seed filter (counts
lookups), vLLM's offer filter (counts store offers) and the tiered
manager's lower-tier threshold (counts lookups). An LRU table ordered by
last count: a plain dict while it fills (moving a key to the end of a dict
is cheaper than of an ``OrderedDict``, but a dict cannot drop its oldest key
cheaply), an ``OrderedDict`` from the first count that could overflow it, in
the same order; the counts are the same either way.

Where the package was built with a C compiler, :func:`reuse_counts` gives the same
table in C (``_reuse_counts.c``): the same counts and order, in a compact table that a
lookup of tens of keys crosses without a cache miss per key.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Sequence

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import OffloadKey
from kvoffload.core.memory import check_fits

try:
    from kvoffload.admission._reuse_counts import ReuseCounter
except ImportError:  # installed without a C compiler: the Python table alone
    ReuseCounter = None  # type: ignore[assignment,misc]

MAX_TRACKED_KEYS = sys.maxsize // 16
"""The largest table either version takes (the compiled one sizes its arrays up front)."""
MAX_STORE_THRESHOLD = 2**62
"""The largest "seen N times" threshold a rule takes: the compiled table compares counts as
C ``long long``, and no key is counted anywhere near this often."""
BYTES_PER_COUNTED_KEY = 120
"""Approximate CPython cost of one tracked key in the Python table (the compiled table
counts its own arrays, about 60 bytes a key)."""
COMPILED_BYTES_PER_KEY = 73
"""The most the compiled table takes a key, all of it up front: 2 to 4 hash slots and four
other arrays of 8 bytes, a count and a flag."""


class ReuseCounts:
    """Counts of at most ``max_keys`` keys; the least recently counted key leaves first."""

    def __init__(self, max_keys: int) -> None:
        if (
            isinstance(max_keys, bool)
            or not isinstance(max_keys, int)
            or not 1 <= max_keys <= MAX_TRACKED_KEYS
        ):
            raise InvalidArgumentError(
                f"max tracked keys must be an int from 1 to {MAX_TRACKED_KEYS}, got {max_keys!r}"
            )
        self.max_keys = max_keys
        self._counts: dict[OffloadKey, int] = {}

    @property
    def counts(self) -> dict[OffloadKey, int]:
        """The table, least recently counted key first."""
        return self._counts

    @property
    def memory_bytes(self) -> int:
        """Approximate bytes of the full table (:data:`BYTES_PER_COUNTED_KEY` a key)."""
        return BYTES_PER_COUNTED_KEY * self.max_keys

    def __len__(self) -> int:
        return len(self._counts)

    def get(self, key: OffloadKey) -> int:
        return self._counts.get(key, 0)

    def at_least(self, keys: Sequence[OffloadKey], threshold: int) -> list[OffloadKey]:
        """The ``keys`` counted at least ``threshold`` times, in order."""
        get = self._counts.get
        return [key for key in keys if get(key, 0) >= threshold]

    def count(self, keys: Sequence[OffloadKey]) -> None:
        """Count each of ``keys`` once more, in order (a repeated key twice); a new key
        pushes out the least recently counted one when the table is full."""
        counts = self._counts
        if not isinstance(counts, OrderedDict):
            if len(keys) <= self.max_keys - len(counts):
                # Filling: no key can leave. Popped and reinserted at the end, each key
                # keeps a plain dict's insertion order equal to the recency order.
                pop = counts.pop
                for key in keys:
                    counts[key] = pop(key, 0) + 1
                return
            counts = self._ordered()
        get = counts.get
        move_to_end = counts.move_to_end
        # Free places in the table: only a new key changes its size, so no len() per key.
        room = self.max_keys - len(counts)
        # One probe to read the count; hash probes, not bytecodes, are the cost here.
        for key in keys:
            seen = get(key)
            if seen is not None:
                counts[key] = seen + 1
                move_to_end(key)
            else:
                if room > 0:
                    room -= 1
                else:
                    counts.popitem(False)
                counts[key] = 1

    def count_shielded(self, keys: Sequence[OffloadKey]) -> None:
        """Count ``keys``, tracked keys first: a key already tracked is shielded from being
        pushed out by the batch's new keys, so a batch larger than the table still counts
        something (vLLM's offer filter). As vLLM 0.33 counts an offer, a tracked key listed
        twice gains 2 and a new key listed twice enters once, at 1."""
        counts = self._ordered()
        shielded: set[OffloadKey] = set()
        for key in keys:
            if key in counts:
                counts[key] += 1
                counts.move_to_end(key)
                shielded.add(key)
        unshielded = len(counts) - len(shielded)
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= self.max_keys:
                if unshielded == 0:
                    continue
                counts.popitem(last=False)
                unshielded -= 1
            counts[key] = 1

    def _ordered(self) -> OrderedDict[OffloadKey, int]:
        """The table as an ``OrderedDict`` (converted once, same order)."""
        counts = self._counts
        if not isinstance(counts, OrderedDict):
            counts = self._counts = OrderedDict(counts)
        return counts


CompiledReuseCounts: type[ReuseCounts] | None = None
"""The table in C, where the package was built with a compiler; ``None`` where not."""
if ReuseCounter is not None:

    class _CompiledReuseCounts(ReuseCounter, ReuseCounts):
        """:class:`ReuseCounts` with every operation in C; :attr:`counts` is a copy."""

        def __init__(self, max_keys: int) -> None:
            """The C type's constructor made (and checked) the table."""
            self.max_keys = max_keys

        @property
        def counts(self) -> dict[OffloadKey, int]:
            """A copy of the table, least recently counted key first."""
            return OrderedDict(self.items())

    CompiledReuseCounts = _CompiledReuseCounts


def reuse_counts(max_keys: int) -> ReuseCounts:
    """A table of at most ``max_keys`` counts: in C where it was built, else in Python."""
    if CompiledReuseCounts is None:
        return ReuseCounts(max_keys)
    # Asked first: the C type fills its arrays as it makes them, so a size beyond the
    # machine was a bare MemoryError, or pages touched until the process was killed.
    if isinstance(max_keys, int) and max_keys <= MAX_TRACKED_KEYS:
        check_fits(max_keys * COMPILED_BYTES_PER_KEY, f"a reuse count table of {max_keys:,} keys")
    return CompiledReuseCounts(max_keys)
