"""Sketch admission: the seed filter's rule, counted where it matters and in fixed memory.

A block is stored once the frequency sketch has seen it in ``threshold``
requests. Unlike the seed filter it counts once per request (not per lookup
re-poll), counts blocks the GPU cache holds, and forgets by halving instead
of by a fixed-size LRU table. Rejected keys go into a ghost, whose returns
are counted as ghost hits (the admission the threshold cost).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload.admission.base import AdmissionLayer, AdmissionStats
from kvoffload.admission.feedback import MIN_SAMPLE, SAMPLE_FACTOR
from kvoffload.admission.ghost import ghost_records
from kvoffload.admission.params import check_params, given_or_default, param
from kvoffload.admission.registry import register_admission
from kvoffload.admission.sketch import FrequencySketch, RequestHashes
from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import OffloadingManager


@dataclass(frozen=True)
class SketchParams:
    """What a user may set of the sketch rule (``--admission-param key=value``)."""

    threshold: int = param(2, 1, 15, "requests a block must be seen in to be stored")
    sample_factor: int = param(SAMPLE_FACTOR, 1, 1000, "sketch sample size in tier-fulls")
    min_sample: int = param(MIN_SAMPLE, 1, 1 << 30, "smallest sketch sample size, in keys")

    def __post_init__(self) -> None:
        check_params(self, "sketch")


@register_admission("sketch", params=SketchParams)
class SketchAdmission(AdmissionLayer):
    """Stores a block once seen in ``threshold`` requests."""

    def __init__(
        self, backing: OffloadingManager, capacity: int, params: SketchParams | None = None
    ) -> None:
        super().__init__(backing, capacity)
        self.params = p = given_or_default(params, SketchParams, "sketch")
        self.threshold = p.threshold
        self.sketch = FrequencySketch(max(p.min_sample, p.sample_factor * capacity))
        self.ghost = ghost_records(capacity)
        self._hashes = RequestHashes()

    def _sighting(self, keys: Sequence[OffloadKey]) -> None:
        self.sketch.increment(self._hashes.of_request(keys))
        if len(self.ghost):
            self.ghost_hits += len(self.ghost.take_all(keys))

    def _admit(self, offered: Sequence[OffloadKey], prefix: int) -> list[OffloadKey]:
        eligible = self.sketch.seen_at_least(self._hashes.of_offer(offered), self.threshold)
        admitted = [key for key, ok in zip(offered, eligible, strict=True) if ok]
        self.ghost.add_all([key for key, ok in zip(offered, eligible, strict=True) if not ok], 0)
        return admitted

    def stats(self) -> AdmissionStats:
        return self._stats(
            float(self.threshold),
            self.sketch.memory_bytes + self.ghost.memory_bytes,
            self.sketch.sample_size + self.ghost.capacity,
        )
