"""Admission by reuse: store only blocks that lookups have seen often enough.

One-shot blocks are most of many workloads; writing them wastes transfer
bandwidth and pushes out blocks that would have been hit. This decorator
counts lookups per key and lets ``prepare_store`` offer the backing manager
only keys counted at least ``store_threshold`` times. Registered as admission
``filter`` (alias ``reuse``); it is the reference class the other rules are
measured against, so its semantics are the seed's exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvoffload.admission.params import check_params, param
from kvoffload.admission.registry import register_admission
from kvoffload.admission.reuse_counts import MAX_STORE_THRESHOLD, MAX_TRACKED_KEYS, reuse_counts
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import SINGLE_KEY_TYPES, OffloadKey, refuse_single_key
from kvoffload.core.manager import OffloadingEvent, OffloadingManager, PrepareStoreOutput
from kvoffload.core.specs import LoadStoreSpec


@dataclass(frozen=True)
class FilterParams:
    """What a user may set of the seed filter (``--admission-param key=value``)."""

    store_threshold: int = param(
        2, 2, MAX_STORE_THRESHOLD, "lookups a block must be counted in to be stored"
    )
    max_tracker_size: int = param(64_000, 1, MAX_TRACKED_KEYS, "keys the LRU count table holds")

    def __post_init__(self) -> None:
        check_params(self, "filter")


@register_admission("filter", params=FilterParams)
class FilterReusedOffloadingManager(OffloadingManager):
    """Wraps ``backing``; intercepts ``lookup`` (to count) and ``prepare_store`` (to filter).

    The tracker is an LRU table of at most ``max_tracker_size`` keys ordered by
    last lookup (:class:`~kvoffload.admission.reuse_counts.ReuseCounts`, the one
    bounded counter every "seen N times" rule uses). Filtering happens
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
        if not 2 <= store_threshold <= MAX_STORE_THRESHOLD:
            raise InvalidArgumentError(
                "FilterReusedOffloadingManager store_threshold must be from 2 to "
                f"{MAX_STORE_THRESHOLD}, got {store_threshold}; a threshold of 0 or 1 means "
                "no filter: the backing manager unwrapped"
            )
        if max_tracker_size < 1:
            raise InvalidArgumentError(
                "FilterReusedOffloadingManager max_tracker_size must be >= 1, "
                f"got {max_tracker_size}"
            )
        if max_tracker_size > MAX_TRACKED_KEYS:
            raise InvalidArgumentError(
                "FilterReusedOffloadingManager max_tracker_size must be at most "
                f"{MAX_TRACKED_KEYS:,} (the reuse table's limit), got {max_tracker_size}"
            )
        self._backing = backing
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self.reuse = reuse_counts(max_tracker_size)
        self.stores_skipped = 0

    @classmethod
    def from_params(cls, backing: OffloadingManager, capacity: int, params: Any) -> Any:
        """The filter as the admission registry builds it (``capacity`` is not used)."""
        return cls(backing, params.store_threshold, params.max_tracker_size)

    @property
    def backing(self) -> OffloadingManager:
        return self._backing

    @property
    def counts(self) -> dict[OffloadKey, int]:
        """The tracker's table, least recently looked-up key first."""
        return self.reuse.counts

    def lookup(self, keys: Iterable[OffloadKey]) -> int | None:
        if type(keys) is not list and isinstance(keys, SINGLE_KEY_TYPES):
            refuse_single_key(keys, "lookup")
        keys = keys if type(keys) is list else list(keys)
        self.reuse.count(keys)
        return self._backing.lookup(keys)

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        if type(keys) is not list and isinstance(keys, SINGLE_KEY_TYPES):
            refuse_single_key(keys, "prepare_store")
        keys = keys if type(keys) is list else list(keys)
        return self._backing.prepare_store(self.admit(keys))

    def admit(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        """The offered ``keys`` that :meth:`prepare_store` passes on, counted as skipped
        or not (the optimiser's candidate calls it alone)."""
        eligible = self.reuse.at_least(keys, self.store_threshold)
        self.stores_skipped += len(keys) - len(eligible)
        return eligible

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
