"""Paired miniature tiers: does writing first-seen blocks pay on this traffic, right now?

Two small LRU shadows of the tier see the same hash-sampled subset of the
tier's references (SHARDS-style spatial sampling: keys whose hash has its
low ``bits`` bits zero, each shadow holding ``capacity >> bits`` keys).
Shadow A admits what the feedback layer would write (seen-before blocks,
and first-seen ones its controller admits); shadow B admits seen-before
blocks only. Because both see the same references, their difference is
free of the traffic's own epoch-to-epoch variation: only references that
hit in one shadow and not the other count, and those are compared with a
sign test. First-seen writes stay allowed while A is not clearly (``Z_OFF``
standard deviations) behind B, and are allowed again once A has caught up.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

from kvoffload.core.errors import InvalidArgumentError

TARGET_SAMPLED = 256
"""Sample at the lowest rate (a power of two) that leaves each shadow this many keys."""
MAX_BITS = 6
"""At most one key in 64 is sampled: a larger tier only gets a larger shadow."""
Z_OFF = 2.0
"""First-seen writes stop once B's extra hits exceed A's by two standard deviations
of a fair coin over the references where they disagree (a ~2% false alarm per test)."""
Z_ON = 0.0
"""They resume once A no longer trails: the gap between the two gives hysteresis."""
MIN_DISAGREEMENTS = 8.0
"""Fewer disagreeing references than this are no evidence either way."""
BYTES_PER_KEY = 100
"""Approximate CPython cost of one ordered-dict entry holding an int key."""


def sampling_bits(capacity: int) -> int:
    """Low hash bits that must be zero for a key to be sampled, for a tier of ``capacity``."""
    if capacity < 1:
        raise InvalidArgumentError(f"shadow capacity must be >= 1, got {capacity}")
    return min(MAX_BITS, max(0, (capacity // TARGET_SAMPLED).bit_length() - 1))


class ShadowTiers:
    """Two sampled LRU shadows of a tier of ``capacity`` blocks, and the choice between them."""

    def __init__(self, capacity: int) -> None:
        self.bits = sampling_bits(capacity)
        self.mask = np.uint64((1 << self.bits) - 1)
        self.capacity = max(1, capacity >> self.bits)
        self._a: OrderedDict[int, None] = OrderedDict()
        self._b: OrderedDict[int, None] = OrderedDict()
        self.only_a = 0.0
        """Decayed count of sampled references that hit in A but not in B."""
        self.only_b = 0.0
        self.references = 0
        self.hits_a = 0
        self.hits_b = 0
        self.first_sight = True
        """The current choice: whether first-seen blocks may be written."""
        self.flips = 0
        self._since_halving = 0

    @property
    def rate(self) -> float:
        """The share of keys sampled."""
        return 1.0 / (1 << self.bits)

    @property
    def memory_bytes(self) -> int:
        return 2 * self.capacity * BYTES_PER_KEY

    def __len__(self) -> int:
        return max(len(self._a), len(self._b))

    def sample(self, hashes: np.ndarray) -> np.ndarray:
        """Positions of the sampled ones among ``hashes``."""
        if not self.bits:
            return np.arange(len(hashes))
        return np.flatnonzero((hashes & self.mask) == 0)

    def reference(self, hashes: np.ndarray, admit_a: np.ndarray, admit_b: np.ndarray) -> None:
        """Sampled keys looked up in the tier, in order; a miss is offered to each shadow,
        which inserts it if its rule (``admit_a``, ``admit_b``) admits it."""
        a, b, capacity = self._a, self._b, self.capacity
        only_a = only_b = hits_a = hits_b = 0
        for key, to_a, to_b in zip(
            hashes.tolist(), admit_a.tolist(), admit_b.tolist(), strict=True
        ):
            in_a = _access(a, key, to_a, capacity)
            in_b = _access(b, key, to_b, capacity)
            hits_a += in_a
            hits_b += in_b
            if in_a != in_b:
                only_a += in_a
                only_b += in_b
        self.hits_a += hits_a
        self.hits_b += hits_b
        self.only_a += only_a
        self.only_b += only_b
        self.references += len(hashes)
        self._since_halving += len(hashes)
        if self._since_halving >= capacity:
            self.only_a /= 2
            self.only_b /= 2
            self._since_halving = 0
        self._choose()

    def _choose(self) -> None:
        disagreements = self.only_a + self.only_b
        if disagreements < MIN_DISAGREEMENTS:
            return
        lead_b = (self.only_b - self.only_a) / math.sqrt(disagreements)
        choice = lead_b <= Z_ON if not self.first_sight else lead_b <= Z_OFF
        if choice != self.first_sight:
            self.first_sight = choice
            self.flips += 1


def _access(lru: OrderedDict[int, None], key: int, admit: bool, capacity: int) -> bool:
    """Look ``key`` up in ``lru``: a hit is made recent; a miss is inserted if ``admit``."""
    if key in lru:
        lru.move_to_end(key)
        return True
    if admit:
        lru[key] = None
        if len(lru) > capacity:
            lru.popitem(False)
    return False
