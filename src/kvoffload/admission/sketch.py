"""A bounded-memory frequency sketch: count-min with 4-bit counters, a doorkeeper and aging.

The first sighting of a key only sets its doorkeeper bit; later sightings
increment four counters (one per row) that saturate at 15. After
``sample_size`` increments every counter is halved and the doorkeeper
cleared, so old popularity fades. Memory is fixed at construction: one byte
per counter cell and per doorkeeper cell. Keys are hashed deterministically
(not with Python's salted ``hash``), so runs repeat exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.keys import OffloadKey

ROWS = 4
TAIL_BYTES = 12
"""Hashed part of a key: the end of its block hash and its 4-byte group index."""
_LOW32 = np.uint64(0xFFFFFFFF)
_32 = np.uint64(32)
DOOR_BITS = 4
"""The doorkeeper has ``2**DOOR_BITS`` cells per counter column."""
MAX_COUNT = 15
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_DOOR_SEED = np.uint64(0x2545F4914F6CDD1D)
_ROW_SEEDS = np.array(
    [0x9E3779B97F4A7C15, 0xD6E8FEB86659FD93, 0xC2B2AE3D27D4EB4F, 0xFF51AFD7ED558CCD],
    dtype=np.uint64,
)[:, None]


def key_hashes(keys: Sequence[OffloadKey]) -> np.ndarray:
    """64-bit hashes of ``keys``: their last 12 bytes folded to 64 bits, then mixed (splitmix64).

    Keys of one length of at least 12 bytes (the usual case) are read in one
    vectorised pass; any other batch key by key, with the same result.
    """
    n = len(keys)
    width = len(keys[0]) if n else 0
    data = b"".join(keys)
    raw: np.ndarray
    if width >= TAIL_BYTES and len(data) == width * n:
        tail = np.frombuffer(data, dtype=np.uint8).reshape(n, width)[:, width - TAIL_BYTES :]
        high = np.ascontiguousarray(tail[:, :8]).view(">u8").ravel().astype(np.uint64)
        low = np.ascontiguousarray(tail[:, 8:]).view(">u4").ravel().astype(np.uint64)
        raw = ((high & _LOW32) << _32) | low
        raw ^= high >> _32
    else:
        raw = np.fromiter((_fold(key) for key in keys), dtype=np.uint64, count=n)
    raw ^= raw >> np.uint64(30)
    raw *= _MIX1
    raw ^= raw >> np.uint64(27)
    raw *= _MIX2
    raw ^= raw >> np.uint64(31)
    return raw


def _fold(key: bytes) -> int:
    """The last 12 bytes of ``key`` as a 96-bit number, folded to 64 bits."""
    value = int.from_bytes(key[-TAIL_BYTES:], "big")
    return (value ^ (value >> 64)) & 0xFFFFFFFFFFFFFFFF


class RequestHashes:
    """Hashes of the last request seen, so that its offer (a suffix of it) is not hashed again."""

    def __init__(self) -> None:
        self._keys: Sequence[OffloadKey] = ()
        self._hashes = np.zeros(0, dtype=np.uint64)

    def of_request(self, keys: Sequence[OffloadKey]) -> np.ndarray:
        """Hash a request's keys and remember them."""
        self._keys, self._hashes = keys, key_hashes(keys)
        return self._hashes

    def of_offer(self, offered: Sequence[OffloadKey]) -> np.ndarray:
        """Hashes of ``offered``: a slice of the last request's when it ends that request."""
        start = len(self._keys) - len(offered)
        if start >= 0 and list(self._keys[start:]) == list(offered):
            return self._hashes[start:]
        return key_hashes(offered)


class FrequencySketch:
    """Approximate sighting counts of the last ``sample_size`` sightings, in fixed memory.

    Counters: ``ROWS`` rows of the power of two at or above ``sample_size``
    one-byte cells. Doorkeeper: a two-hash Bloom filter of sixteen times as
    many one-byte cells, so that about one first sighting in a hundred (at
    the end of a sample, fewer before) is mistaken for a second one.
    """

    def __init__(self, sample_size: int) -> None:
        if sample_size < 1:
            raise InvalidArgumentError(f"sample_size must be >= 1, got {sample_size}")
        self.sample_size = sample_size
        bits = max(4, (sample_size - 1).bit_length())
        self.width = 1 << bits
        self._shift = np.uint64(64 - bits)
        self._door_shift = np.uint64(64 - bits - DOOR_BITS)
        self._counts = np.zeros((ROWS, self.width), dtype=np.uint8)
        self._door = np.zeros(self.width << DOOR_BITS, dtype=np.bool_)
        self._rows = np.arange(ROWS)[:, None]
        self._added = 0
        self.resets = 0

    @property
    def memory_bytes(self) -> int:
        return int(self._counts.nbytes + self._door.nbytes)

    def _cells(self, hashes: np.ndarray) -> np.ndarray:
        rows: np.ndarray = (hashes[None, :] * _ROW_SEEDS) >> self._shift
        return rows.astype(np.intp)

    def _door_cells(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        first = (hashes >> self._door_shift).astype(np.intp)
        second = ((hashes * _DOOR_SEED) >> self._door_shift).astype(np.intp)
        return first, second

    def increment(self, hashes: np.ndarray) -> None:
        """Count one sighting of each hash (a hash repeated in one call counts once)."""
        if not len(hashes):
            return
        first, second = self._door_cells(hashes)
        seen = self._door[first] & self._door[second]
        self._door[first] = True
        self._door[second] = True
        if seen.any():
            cells = self._cells(hashes[seen])
            current = self._counts[self._rows, cells]
            self._counts[self._rows, cells] = np.minimum(current + 1, MAX_COUNT)
        self._added += len(hashes)
        if self._added >= self.sample_size:
            self._age()

    def estimate(self, hashes: np.ndarray) -> np.ndarray:
        """Estimated sightings per hash: the doorkeeper bit plus the smallest row counter."""
        if not len(hashes):
            return np.zeros(0, dtype=np.int64)
        counts = self._counts[self._rows, self._cells(hashes)].min(axis=0).astype(np.int64)
        first, second = self._door_cells(hashes)
        result: np.ndarray = counts + (self._door[first] & self._door[second])
        return result

    def _age(self) -> None:
        """Halve every counter and clear the doorkeeper: old popularity fades."""
        self._counts >>= 1
        self._door[:] = False
        self._added = 0
        self.resets += 1
