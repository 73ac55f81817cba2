"""Admission by store offers, as vLLM 0.33 counts them (not by lookups, as the seed does).

vLLM 0.33 moved the reuse count from ``lookup`` to ``prepare_store`` (a
lookup stops at the first miss, so a long prefix needed about twice as many
repetitions to warm up). Inside vLLM the adapter follows vLLM, so this is the
filter it uses; the seed's :class:`~kvoffload.managers.FilterReusedOffloadingManager`
stays the reference for the batch API.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.admission.reuse_counts import MAX_STORE_THRESHOLD, reuse_counts
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import OffloadKey


class OfferCountFilter:
    """A :class:`~kvoffload.admission.reuse_counts.ReuseCounts` table of at most
    ``max_tracker_size`` keys, counting how often each was offered.

    A key already tracked in an offer is protected from being pushed out by
    the offer's new keys, so an offer larger than the table still counts
    something. The threshold applies to new store candidates only.
    """

    def __init__(self, store_threshold: int, max_tracker_size: int = 64_000) -> None:
        if not 2 <= store_threshold <= MAX_STORE_THRESHOLD:
            raise InvalidArgumentError(
                f"the offer filter's store_threshold must be from 2 to {MAX_STORE_THRESHOLD}, "
                f"got {store_threshold}; a threshold of 0 or 1 means no filter: build none"
            )
        if max_tracker_size < 1:
            raise InvalidArgumentError(f"max_tracker_size must be >= 1, got {max_tracker_size}")
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self.reuse = reuse_counts(max_tracker_size)

    @property
    def counts(self) -> dict[OffloadKey, int]:
        """The table, least recently offered key first."""
        return self.reuse.counts

    def record(self, keys: Sequence[OffloadKey]) -> None:
        """Count one offer of ``keys``."""
        self.reuse.count_shielded(keys)

    def admit(self, candidates: Sequence[OffloadKey]) -> list[OffloadKey]:
        """The candidates offered at least ``store_threshold`` times, in order."""
        return self.reuse.at_least(candidates, self.store_threshold)
