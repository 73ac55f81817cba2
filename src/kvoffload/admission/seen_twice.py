"""Sketch admission: the seed filter's rule, counted where it matters and in fixed memory.

A block is stored once the frequency sketch has seen it in ``threshold``
requests. Unlike the seed filter it counts once per request (not per lookup
re-poll), counts blocks the GPU cache holds, and forgets by halving instead
of by a fixed-size LRU table. Rejected keys go into a ghost, whose returns
are counted as ghost hits (the admission the threshold cost).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.admission.base import AdmissionLayer, AdmissionStats
from kvoffload.admission.feedback import MIN_SAMPLE, SAMPLE_FACTOR
from kvoffload.admission.ghost import GhostRecords
from kvoffload.admission.sketch import FrequencySketch, RequestHashes
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import OffloadingManager


class SketchAdmission(AdmissionLayer):
    """Stores a block once seen in ``threshold`` requests."""

    def __init__(self, backing: OffloadingManager, capacity: int, threshold: int = 2) -> None:
        if threshold < 1:
            raise InvalidArgumentError(f"sketch admission threshold must be >= 1, got {threshold}")
        super().__init__(backing, capacity)
        self.threshold = threshold
        self.sketch = FrequencySketch(max(MIN_SAMPLE, SAMPLE_FACTOR * capacity))
        self.ghost = GhostRecords(capacity)
        self._hashes = RequestHashes()

    def _sighting(self, keys: Sequence[OffloadKey]) -> None:
        self.sketch.increment(self._hashes.of_request(keys))
        if len(self.ghost):
            self.ghost_hits += len(self.ghost.take_all(keys))

    def _admit(self, offered: Sequence[OffloadKey], prefix: int) -> list[OffloadKey]:
        eligible = self.sketch.estimate(self._hashes.of_offer(offered)) >= self.threshold
        admitted = [key for key, ok in zip(offered, eligible, strict=True) if ok]
        self.ghost.add_all([key for key, ok in zip(offered, eligible, strict=True) if not ok], 0)
        return admitted

    def stats(self) -> AdmissionStats:
        return AdmissionStats(
            offers=self.offers,
            admitted=self.admitted,
            rejected=self.offers - self.admitted,
            ghost_hits=self.ghost_hits,
            control=float(self.threshold),
            memory_bytes=self.sketch.memory_bytes + self.ghost.memory_bytes,
            tracked_keys=self.sketch.sample_size + self.ghost.capacity,
        )
