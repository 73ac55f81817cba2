"""Open requests, keyed by their last key; and, for bare callers, boundaries guessed.

Drivers that know request boundaries announce them
(:meth:`~kvoffload.admission.base.AdmissionLayer.begin_request` /
``end_request``), which only :meth:`RequestTracker.open` and
:meth:`RequestTracker.close` an entry. The rest of this module is the
fallback for a bare seed-style caller that announces nothing, where the
boundaries are inferred from the manager calls, without changing the
contract. An engine ``touch``-es a request's full key list before its ``lookup``, and
after a non-empty store touches the same list once more. The tracker keys an
open request by its last key (a store's offer always ends there), so that

* the first touch (or, for a driver that never touches, the first lookup) of
  a request counts as one sighting, and re-polled lookups do not count again;
* ``prepare_store`` learns how many leading blocks of the request were not
  offered (its known prefix: GPU or tier hits);
* the touch that follows a non-empty store is recognised and not counted;
* ``prepare_store`` learns the request's first key (its root prefix) and
  whether the tier's lookup served any of it.

Nothing here is required for correctness: a driver with another call order
only makes the counts coarser. At most ``capacity`` requests are open.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvoffload.core.keys import OffloadKey

OPEN, STORED = 0, 1
"""An open request's state: counted, or counted and awaiting its post-store touch."""

Entry = tuple[OffloadKey, int, int, bool, bool]
"""``(first key, length, state, counted by touch, tier served a hit)``."""


class RequestTracker:
    """Open requests by last key."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._open: OrderedDict[OffloadKey, Entry] = OrderedDict()

    def on_touch(self, keys: Sequence[OffloadKey]) -> bool:
        """Whether this touch starts a request (count it) rather than closing a store."""
        last = keys[-1]
        entry = self._open.get(last)
        if (
            entry is not None
            and entry[2] == STORED
            and entry[0] == keys[0]
            and entry[1] == len(keys)
        ):
            del self._open[last]
            return False
        self._put(last, (keys[0], len(keys), OPEN, True, False))
        return True

    def on_lookup(self, keys: Sequence[OffloadKey]) -> bool:
        """Whether this lookup is the first sighting of its request (no touch came before)."""
        if keys[-1] in self._open:
            return False
        self._put(keys[-1], (keys[0], len(keys), OPEN, False, False))
        return True

    def open(self, keys: Sequence[OffloadKey], touched: bool = False) -> None:
        """Open a request a driver announces itself (already counted by it), replacing any
        entry with the same last key; ``touched``: its touches go through the layer."""
        self._put(keys[-1], (keys[0], len(keys), OPEN, touched, False))

    def close(self, keys: Sequence[OffloadKey]) -> None:
        """Forget the open request that ends at ``keys[-1]`` (the request, or its offer)."""
        self._open.pop(keys[-1], None)

    def on_hit(self, keys: Sequence[OffloadKey]) -> None:
        """The tier's lookup of ``keys`` (a request's suffix past the GPU hit) found blocks."""
        entry = self._open.get(keys[-1])
        if entry is not None:
            self._open[keys[-1]] = (entry[0], entry[1], entry[2], entry[3], True)

    def origin(self, offered: Sequence[OffloadKey]) -> tuple[OffloadKey | None, bool]:
        """The offer's request: its first key (``None`` when unknown), and whether the tier
        served part of it."""
        entry = self._open.get(offered[-1])
        return (None, False) if entry is None else (entry[0], entry[4])

    def prefix_length(self, offered: Sequence[OffloadKey]) -> int:
        """Blocks of the request before the offered ones (0 when the request is unknown)."""
        entry = self._open.get(offered[-1])
        if entry is None:
            return 0
        before = entry[1] - len(offered)
        return before if before > 0 else 0  # not max(): a builtin call costs more, every offer

    def on_store(self, offered: Sequence[OffloadKey], stored_any: bool) -> None:
        """A store was prepared: await the post-store touch, or close the request."""
        last = offered[-1]
        entry = self._open.get(last)
        if entry is None:
            return
        if stored_any and entry[3]:
            self._open[last] = (entry[0], entry[1], STORED, True, entry[4])
        else:
            del self._open[last]

    def _put(self, last: OffloadKey, entry: Entry) -> None:
        self._open[last] = entry
        self._open.move_to_end(last)
        if len(self._open) > self.capacity:
            self._open.popitem(False)
