"""The scheduler's view of the workers' CPU slots, through their shared regions.

One region per worker rank (see :mod:`.shared_region`); a slot's bytes are
the ranks' bytes of that slot in rank order, which is what a lower tier
stores. The regions are mapped on first use, because vLLM starts its
workers and its scheduler in no order this side can rely on; until every
rank's region is there, reading or filling a slot fails and is counted, never raised into
the engine.

Ordering. The tier stack snapshots a slot only when its block is ready
(its store's completion was reported by the worker) and either being
evicted (before the slot is handed to a new store) or just completed
(write-through), so the worker never writes a slot the scheduler is
reading. A promotion fills a slot whose block is pending; the stack makes it
loadable only after :meth:`landed` (which, with several ranks, copies the
staged bytes into place), so the worker never loads a slot before its bytes
are in.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.tier_protocol import SlotBytesUnavailableError
from kvoffload.dataplane.shared_region import map_live_region

logger = logging.getLogger(__name__)

SPARE_BUFFERS = 64
"""Staging buffers kept for reuse with several ranks (each one block of every rank)."""


class SharedSlotBytes:
    """:class:`~kvoffload.core.tier_protocol.SlotBytes` over ``paths`` (one region per rank,
    rank order), each of ``num_blocks`` slots of ``rank_slot_bytes``.

    ``unavailable``: blocks not written down or not promoted because a region
    was missing or unusable.
    """

    def __init__(self, paths: Sequence[Path], num_blocks: int, rank_slot_bytes: int) -> None:
        if not paths:
            raise InvalidArgumentError("shared slot bytes need at least one region")
        for name, value in (("num_blocks", num_blocks), ("rank_slot_bytes", rank_slot_bytes)):
            if value < 1:
                raise InvalidArgumentError(f"{name} must be >= 1, got {value}")
        self.paths = list(paths)
        self.num_blocks = num_blocks
        self.rank_slot_bytes = rank_slot_bytes
        self.unavailable = 0
        self._maps: list[mmap.mmap] = []
        self._ranks: list[npt.NDArray[np.uint8]] = []
        self._staged: dict[int, bytearray] = {}
        self._spare: list[bytearray] = []
        """Staging buffers of landed promotions, reused (fresh ones cost page faults)."""
        self._lock = threading.Lock()  # views are taken on tier I/O threads
        self._reason = ""

    @property
    def slot_bytes(self) -> int:
        return self.rank_slot_bytes * len(self.paths)

    @property
    def mapped(self) -> bool:
        return bool(self._ranks)

    def snapshot(self, slots: Sequence[int]) -> list[bytes]:
        for slot in slots:
            # numpy would read slot -1 as the last one, another block's bytes.
            if not 0 <= slot < self.num_blocks:
                raise InvalidArgumentError(
                    f"no CPU slot {slot}; the regions have {self.num_blocks}"
                )
        ranks = self._regions(len(slots))
        if len(ranks) == 1:
            rows = ranks[0]
            return [rows[slot].tobytes() for slot in slots]
        return [b"".join([rows[slot] for rows in ranks]) for slot in slots]

    def view(self, slot: int) -> memoryview:
        ranks = self._regions(1)
        if not 0 <= slot < self.num_blocks:
            raise InvalidArgumentError(f"no CPU slot {slot}; the regions have {self.num_blocks}")
        if len(ranks) == 1:
            return memoryview(ranks[0][slot])
        with self._lock:
            staged = self._spare.pop() if self._spare else bytearray(self.slot_bytes)
            self._staged[slot] = staged
        return memoryview(staged)

    def landed(self, slots: Sequence[int], intact: Sequence[bool]) -> None:
        """Copy each intact staged slot to its ranks; drop the staging of the others."""
        if len(self._ranks) < 2:
            return
        size = self.rank_slot_bytes
        for slot, ok in zip(slots, intact, strict=True):
            with self._lock:
                staged = self._staged.pop(slot, None)
            if staged is None:
                continue
            if ok:
                source = np.frombuffer(staged, dtype=np.uint8)
                for rank, rows in enumerate(self._ranks):
                    rows[slot] = source[rank * size : (rank + 1) * size]
            with self._lock:
                if len(self._spare) < SPARE_BUFFERS:
                    self._spare.append(staged)

    def close(self) -> None:
        """Unmap the regions (the workers own and unlink them)."""
        with self._lock:
            self._ranks = []
            self._staged.clear()
            self._spare.clear()
            maps, self._maps = self._maps, []
        for region in maps:
            try:
                region.close()
            except BufferError:  # a tier still holds a view; unmapped when it lets go
                logger.debug("kvoffload: a shared KV buffer is still viewed at close")

    def _regions(self, blocks: int) -> list[npt.NDArray[np.uint8]]:
        """The ranks' slots, mapping them on first use; counts ``blocks`` as unavailable
        and raises :class:`SlotBytesUnavailableError` while that is not possible."""
        with self._lock:
            if not self._ranks:
                self._map_all()
            if self._ranks:
                return self._ranks
            self.unavailable += blocks
            reason = self._reason
        raise SlotBytesUnavailableError(reason)

    def _map_all(self) -> None:
        size = self.num_blocks * self.rank_slot_bytes
        maps: list[mmap.mmap] = []
        try:
            for path in self.paths:
                maps.append(map_live_region(path, size))
        except (OSError, InvalidArgumentError) as exc:
            for region in maps:
                region.close()
            reason = f"the workers' shared KV buffers are not usable yet: {exc}"
            if reason != self._reason:
                logger.warning("kvoffload: %s; blocks are not moved to or from lower tiers", reason)
                self._reason = reason
            return
        self._maps = maps
        self._ranks = [
            np.frombuffer(region, dtype=np.uint8).reshape(self.num_blocks, self.rank_slot_bytes)
            for region in maps
        ]
        self._reason = ""
        logger.info("kvoffload: mapped the workers' shared KV buffers %s", self.paths)
