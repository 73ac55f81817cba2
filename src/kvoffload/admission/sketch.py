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
from kvoffload.core.memory import check_fits

try:
    from kvoffload.admission import _sketch as compiled
except ImportError:  # installed without a C compiler: the numpy path alone
    compiled = None  # type: ignore[assignment]

ROWS = 4
TAIL_BYTES = 12
"""Hashed part of a key: the end of its block hash and its 4-byte group index."""
DOOR_BITS = 4
"""The doorkeeper has ``2**DOOR_BITS`` cells per counter column."""
MAX_COUNT = 15
_MIX1 = np.array(0xBF58476D1CE4E5B9, dtype=np.uint64)
_MIX2 = np.array(0x94D049BB133111EB, dtype=np.uint64)
_SHIFTS = [np.array(bits, dtype=np.uint64) for bits in (30, 27, 31)]
"""Mixing constants as 0-d arrays: numpy converts those faster than scalars, per call."""
_UINT64 = np.dtype(np.uint64)
_DOOR_SEED = 0x2545F4914F6CDD1D
_ROW_SEEDS = [0x9E3779B97F4A7C15, 0xD6E8FEB86659FD93, 0xC2B2AE3D27D4EB4F, 0xFF51AFD7ED558CCD]
_SATURATED_INCREMENT = np.minimum(np.arange(1, MAX_COUNT + 2), MAX_COUNT).astype(np.uint8)
"""``count -> min(count + 1, MAX_COUNT)`` as one table look-up."""


_LAST: list[tuple[list[OffloadKey], np.ndarray]] = [([], np.zeros(0, dtype=np.uint64))]
"""The last list of keys hashed (a copy) and its hashes (read-only)."""


def key_hashes(keys: Sequence[OffloadKey]) -> np.ndarray:
    """64-bit hashes of ``keys`` (see :func:`_hashes`), read-only.

    The last list hashed is remembered: the optimiser's feedback candidate and
    its mini-simulations each ask for a request's hashes, which are then
    computed once. A list equal to the last one (compared key by key, not by
    identity, so a list changed in place since is hashed again) gets the same
    array.
    """
    last_keys, last = _LAST[0]
    if type(keys) is list and keys == last_keys:
        return last
    hashes = _hashes(keys)
    if type(keys) is list:
        _LAST[0] = (keys.copy(), hashes)
    return hashes


def _hashes(keys: Sequence[OffloadKey]) -> np.ndarray:
    """64-bit hashes of ``keys`` (see :func:`numpy_hashes`), read-only: in one C call
    where the package was compiled (an array over the bytes it returns, read-only as
    they are), else by numpy."""
    if compiled is None:
        hashes = numpy_hashes(keys)
        hashes.flags.writeable = False
        return hashes
    return np.frombuffer(compiled.hash_keys(keys), _UINT64)


def numpy_hashes(keys: Sequence[OffloadKey]) -> np.ndarray:
    """64-bit hashes of ``keys``: their last 12 bytes folded to 64 bits, then mixed (splitmix64).

    The fold of the 96-bit tail ``a b c`` (three 32-bit words) is ``b`` over
    ``c ^ a``, that is the big-endian 64-bit word ``b c`` xor ``a``. Keys of one
    length of at least 12 bytes (the usual case) are read in one vectorised
    pass, as two strided views of the joined keys (those two words of each key);
    any other batch key by key, with the same result.
    """
    n = len(keys)
    width = len(keys[0]) if n else 0
    data = b"".join(keys)
    raw: np.ndarray
    # Every length, not the joined total: keys of other lengths can add up to ``width * n``.
    if width >= TAIL_BYTES and len(data) == width * n and set(map(len, keys)) == {width}:
        last_two = np.ndarray((n,), ">u8", data, width - 8, (width,))
        first_word = np.ndarray((n,), ">u4", data, width - TAIL_BYTES, (width,))
        raw = last_two ^ first_word
    else:
        raw = np.fromiter((_fold(key) for key in keys), dtype=np.uint64, count=n)
    first, second, third = _SHIFTS
    mixed = raw >> first
    raw ^= mixed
    raw *= _MIX1
    np.right_shift(raw, second, out=mixed)
    raw ^= mixed
    raw *= _MIX2
    np.right_shift(raw, third, out=mixed)
    raw ^= mixed
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
        self._cells: np.ndarray | None = None

    def of_request(self, keys: Sequence[OffloadKey]) -> np.ndarray:
        """Hash a request's keys and remember them."""
        self._keys, self._hashes = keys, key_hashes(keys)
        self._cells = None
        return self._hashes

    def cells(self, sketch: FrequencySketch) -> np.ndarray | None:
        """The last request's cells in ``sketch`` (always the same sketch), computed once;
        ``None`` where the compiled sketch finds them itself."""
        if sketch.compiled:
            return None
        if self._cells is None:
            self._cells = sketch.cells(self._hashes)
        return self._cells

    def _offer_start(self, offered: Sequence[OffloadKey]) -> int:
        """Where ``offered`` starts in the last request when it ends that request, else -1."""
        last = self._keys
        start = len(last) - len(offered)
        if start < 0:
            return -1
        if type(last) is list and type(offered) is list:
            same = last[start:] == offered
        else:
            same = list(last[start:]) == list(offered)
        return start if same else -1

    def of_offer(self, offered: Sequence[OffloadKey]) -> np.ndarray:
        """Hashes of ``offered``: a slice of the last request's when it ends that request."""
        start = self._offer_start(offered)
        return self._hashes[start:] if start >= 0 else key_hashes(offered)

    def offer(
        self, offered: Sequence[OffloadKey], sketch: FrequencySketch
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Hashes of ``offered`` and their ``sketch`` cells (``None``: see :meth:`cells`):
        slices of the last request's when it ends that request (a cell depends on the hash
        alone)."""
        start = self._offer_start(offered)
        if start >= 0:
            cells = self.cells(sketch)
            return self._hashes[start:], None if cells is None else cells[:, start:]
        hashes = key_hashes(offered)
        return hashes, None if sketch.compiled else sketch.cells(hashes)


class FrequencySketch:
    """Approximate sighting counts of the last ``sample_size`` sightings, in fixed memory.

    Counters: ``ROWS`` rows of the power of two at or above ``sample_size``
    one-byte cells. Doorkeeper: a two-hash Bloom filter of sixteen times as
    many one-byte cells, so that about one first sighting in a hundred (at
    the end of a sample, fewer before) is mistaken for a second one.

    Both live in one flat byte table (the doorkeeper's two cells of a hash
    first, then its four counter cells, each row at its own offset), so that
    one multiply, shift and add give all six cells of a batch of hashes and
    one gather reads them: a request's tens of keys cost a handful of numpy
    calls, not one per row.
    """

    def __init__(self, sample_size: int, use_compiled: bool = True) -> None:
        if sample_size < 1:
            raise InvalidArgumentError(f"sample_size must be >= 1, got {sample_size}")
        self.sample_size = sample_size
        self.compiled = use_compiled and compiled is not None
        """Whether increments and estimates run in C (``_sketch.c``), not in numpy."""
        bits = max(4, (sample_size - 1).bit_length())
        self._bits = bits
        self.width = 1 << bits
        counters = ROWS * self.width
        table_bytes = counters + (self.width << DOOR_BITS)
        # Asked first: numpy would refuse a huge table with a bare ValueError, or hand out
        # pages that the increments then touch until the machine swaps.
        check_fits(table_bytes, f"an admission frequency sketch of {sample_size:,} sightings")
        self._table = np.zeros(table_bytes, dtype=np.uint8)
        self._counts = self._table[:counters]
        self._door = self._table[counters:]
        door_shift, shift = 64 - bits - DOOR_BITS, 64 - bits
        multipliers = [1, _DOOR_SEED, *_ROW_SEEDS]
        self._multipliers = np.array(multipliers, dtype=np.uint64)[:, None]
        self._shifts = np.array([door_shift] * 2 + [shift] * ROWS, dtype=np.uint64)[:, None]
        offsets = [counters, counters] + [row * self.width for row in range(ROWS)]
        self._offsets = np.array(offsets, dtype=np.intp)[:, None]
        self._added = 0
        self.resets = 0

    @property
    def memory_bytes(self) -> int:
        return int(self._table.nbytes)

    def cells(self, hashes: np.ndarray) -> np.ndarray:
        """Table positions of each hash: two doorkeeper rows, then ``ROWS`` counter rows
        (one column per hash)."""
        cells: np.ndarray = ((hashes * self._multipliers) >> self._shifts).view(np.intp)
        cells += self._offsets
        return cells

    def increment(self, hashes: np.ndarray, cells: np.ndarray | None = None) -> None:
        """Count one sighting of each hash (a hash repeated in one call counts once);
        ``cells``: their :meth:`cells`, if known.

        One write covers the counter cells of the batch: a seen hash's get
        their read value plus one, an unseen hash's write is redirected to its
        own first doorkeeper cell, which the doorkeeper update then sets, as
        it would anyway.
        """
        if not len(hashes):
            return
        if self.compiled:
            compiled.increment(self._table, hashes, self._bits)
        else:
            self._increment(hashes, self.cells(hashes) if cells is None else cells)
        self._added += len(hashes)
        if self._added >= self.sample_size:
            self._age()

    def _increment(self, hashes: np.ndarray, cells: np.ndarray) -> None:
        table = self._table
        values = table[cells]
        seen = values[0] & values[1]
        table[np.where(seen, cells[2:], cells[0])] = _SATURATED_INCREMENT[values[2:]]
        table[cells[:2]] = 1

    def estimate(self, hashes: np.ndarray, cells: np.ndarray | None = None) -> np.ndarray:
        """Estimated sightings per hash: the doorkeeper bit plus the smallest row counter
        (``cells``: their :meth:`cells`, if known).

        One byte each (at most ``MAX_COUNT + 1``), so no widening copy is made.
        """
        if not len(hashes):
            return np.zeros(0, dtype=np.uint8)
        if self.compiled:
            return np.frombuffer(compiled.estimate(self._table, hashes, self._bits), np.uint8)
        values = self._table[self.cells(hashes) if cells is None else cells]
        result: np.ndarray = np.minimum.reduce(values[2:], 0)
        result += values[0] & values[1]
        return result

    def seen_at_least(
        self, hashes: np.ndarray, threshold: int, cells: np.ndarray | None = None
    ) -> list[bool]:
        """Per hash, whether its :meth:`estimate` reaches ``threshold`` (one C call where
        compiled: no array made)."""
        if self.compiled and len(hashes):
            return compiled.seen_at_least(self._table, hashes, self._bits, threshold)
        result: list[bool] = (self.estimate(hashes, cells) >= threshold).tolist()
        return result

    def _age(self) -> None:
        """Halve every counter and clear the doorkeeper: old popularity fades."""
        self._counts >>= 1
        self._door[:] = 0
        self._added = 0
        self.resets += 1
