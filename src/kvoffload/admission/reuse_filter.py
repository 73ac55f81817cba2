"""Admission by reuse: store only blocks that lookups have seen often enough.

One-shot blocks are most of many workloads; writing them wastes transfer
bandwidth and pushes out blocks that would have been hit. This decorator
counts lookups per key and lets ``prepare_store`` offer the backing manager
only keys counted at least ``store_threshold`` times.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import SINGLE_KEY_TYPES, OffloadKey, refuse_single_key
from kvoffload.core.manager import OffloadingEvent, OffloadingManager, PrepareStoreOutput
from kvoffload.core.specs import LoadStoreSpec


class FilterReusedOffloadingManager(OffloadingManager):
    """Wraps ``backing``; intercepts ``lookup`` (to count) and ``prepare_store`` (to filter).

    The tracker is an LRU table of at most ``max_tracker_size`` keys ordered by
    last lookup: a plain dict while it fills (moving a key to the end of a dict
    is cheaper than of an ``OrderedDict``, but a dict cannot drop its oldest key
    cheaply), an ``OrderedDict`` from the first lookup that could overflow it,
    in the same order; the counts are the same either way. Filtering happens
    before delegation so skipped blocks never take room in the tier; an empty
    offer is delegated too, and the backing manager answers it with an empty
    output. ``stores_skipped`` counts offered keys that the filter held back.
    """

    def __init__(
        self,
        backing: OffloadingManager,
        store_threshold: int = 2,
        max_tracker_size: int = 64_000,
    ):
        for name, value in (
            ("store_threshold", store_threshold),
            ("max_tracker_size", max_tracker_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgumentError(
                    f"FilterReusedOffloadingManager {name} must be an integer, got {value!r}"
                )
        if store_threshold < 2:
            raise InvalidArgumentError(
                f"FilterReusedOffloadingManager store_threshold must be >= 2, got {store_threshold}"
            )
        if max_tracker_size < 1:
            raise InvalidArgumentError(
                "FilterReusedOffloadingManager max_tracker_size must be >= 1, "
                f"got {max_tracker_size}"
            )
        self._backing = backing
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self.counts: dict[OffloadKey, int] = {}
        self.stores_skipped = 0

    @property
    def backing(self) -> OffloadingManager:
        return self._backing

    def lookup(self, keys: Iterable[OffloadKey]) -> int | None:
        if isinstance(keys, SINGLE_KEY_TYPES):
            refuse_single_key(keys, "lookup")
        keys = keys if type(keys) is list else list(keys)
        counts = self.counts
        if not isinstance(counts, OrderedDict):
            if len(keys) <= self.max_tracker_size - len(counts):
                # Filling: no key can leave. Popped and reinserted at the end, each key
                # keeps a plain dict's insertion order equal to the recency order.
                pop = counts.pop
                for key in keys:
                    counts[key] = pop(key, 0) + 1
                return self._backing.lookup(keys)
            # This call may overflow the table: an OrderedDict from now on, same order.
            counts = self.counts = OrderedDict(counts)
        get = counts.get
        move_to_end = counts.move_to_end
        # Free places in the tracker: only a new key changes its size, so no len() per key.
        room = self.max_tracker_size - len(counts)
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
        return self._backing.lookup(keys)

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        if isinstance(keys, SINGLE_KEY_TYPES):
            refuse_single_key(keys, "prepare_store")
        keys = keys if type(keys) is list else list(keys)
        get = self.counts.get
        threshold = self.store_threshold
        eligible = [key for key in keys if get(key, 0) >= threshold]
        self.stores_skipped += len(keys) - len(eligible)
        return self._backing.prepare_store(eligible)

    def prepare_load(self, keys: Iterable[OffloadKey]) -> LoadStoreSpec:
        return self._backing.prepare_load(keys)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        self._backing.touch(keys)

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        self._backing.complete_load(keys)

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        self._backing.complete_store(keys, success)

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self._backing.take_events()
