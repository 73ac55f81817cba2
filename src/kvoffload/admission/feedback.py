"""Feedback admission: store blocks seen before, and first-seen blocks of classes that return.

Blocks the frequency sketch has seen in an earlier request are admitted, as
the seed filter would (but counted once per request, GPU-held blocks
included). A first-seen block is admitted only if its class has recently
been coming back before the tier would have evicted it: every first-seen
offer, admitted or not, is recorded in a ghost under its class; a record
expires once as many blocks as the tier holds have been admitted since. The
:class:`ReuseController` turns returns and expiries into a per-class
decision. Classes split requests by whether they extend a known prefix and
blocks by whether they end the request: one-shot prompts and partial tails
stop being written, continuation turns are written on first sight.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.admission.base import AdmissionLayer, AdmissionStats
from kvoffload.admission.controller import ReuseController
from kvoffload.admission.ghost import GhostRecords
from kvoffload.admission.sketch import FrequencySketch, RequestHashes
from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import OffloadingManager

NUM_CLASSES = 4
DEFAULT_THRESHOLD = 0.5
"""Write a first-seen block when it is more likely than not to be read before it is evicted."""
SAMPLE_FACTOR = 10
"""The sketch remembers about ten tier-fulls of sightings, as W-TinyLFU does."""
MIN_SAMPLE = 1024


def first_seen_class(prefix: int, is_last: bool) -> int:
    """Class of a first-seen block: (request extends a known prefix) x (block ends it)."""
    return (2 if prefix > 0 else 0) + (1 if is_last else 0)


class FeedbackAdmission(AdmissionLayer):
    """Seen-before blocks always; first-seen blocks per class, from ghost feedback."""

    def __init__(
        self, backing: OffloadingManager, capacity: int, threshold: float = DEFAULT_THRESHOLD
    ) -> None:
        super().__init__(backing, capacity)
        self.sketch = FrequencySketch(max(MIN_SAMPLE, SAMPLE_FACTOR * capacity))
        self.ghost = GhostRecords(capacity)
        self._hashes = RequestHashes()
        self.controller = ReuseController(NUM_CLASSES, threshold, window=capacity)
        self.written = 0
        """Blocks admitted so far: the clock by which ghost records age."""

    def _sighting(self, keys: Sequence[OffloadKey]) -> None:
        self.sketch.increment(self._hashes.of_request(keys))
        ghost, controller = self.ghost, self.controller
        if not len(ghost):
            return
        for key in keys:
            if key in ghost:
                cls = ghost.take(key)
                if cls is not None:
                    controller.record(cls, True)
                    self.ghost_hits += 1

    def _admit(self, offered: Sequence[OffloadKey], prefix: int) -> list[OffloadKey]:
        seen = self.sketch.estimate(self._hashes.of_offer(offered)) >= 2
        ghost, controller, clock = self.ghost, self.controller, self.written
        for cls in ghost.expire(clock - self.capacity):
            controller.record(cls, False)
        last = len(offered) - 1
        admitted: list[OffloadKey] = []
        for i, key in enumerate(offered):
            if seen[i]:
                admitted.append(key)
                continue
            cls = first_seen_class(prefix, i == last)
            expired = ghost.add(key, cls, clock)
            if expired is not None:
                controller.record(expired, False)
            if controller.admits(cls):
                admitted.append(key)
        self.written += len(admitted)
        return admitted

    def stats(self) -> AdmissionStats:
        return AdmissionStats(
            offers=self.offers,
            admitted=self.admitted,
            rejected=self.offers - self.admitted,
            ghost_hits=self.ghost_hits,
            control=self.controller.admitting_share,
            memory_bytes=self.sketch.memory_bytes + self.ghost.memory_bytes,
            tracked_keys=self.sketch.sample_size + self.ghost.capacity,
        )
