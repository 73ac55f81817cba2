"""Running totals of what a manager did, in blocks, shared by every exporter."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class ManagerCounters:
    """Cumulative counts since the manager was built; ``held_blocks`` is a level.

    Prometheus reads them as counters, vLLM's stats take the difference since
    the last report, and the simulator's JSON reports the same quantities,
    so each one is named after what it counts, not after an exporter.
    """

    lookups: int = 0
    """``lookup`` calls (a batch call and a per-key call count one each)."""
    lookup_hit_blocks: int = 0
    stores_offered: int = 0
    stores_admitted: int = 0
    """Offered blocks given a slot by ``prepare_store``."""
    stores_skipped: int = 0
    """Offered blocks held back by admission (not counting those already held)."""
    stores_rejected: int = 0
    """Offered blocks of a ``prepare_store`` that found no room (returned ``None``)."""
    stores_completed: int = 0
    stores_failed: int = 0
    evictions: int = 0
    loads: int = 0
    """Blocks pinned for loading by ``prepare_load``."""
    bytes_stored: int = 0
    """Bytes of completed stores (device to tier)."""
    bytes_loaded: int = 0
    """Bytes of loads (tier to device)."""
    held_blocks: int = 0

    def as_dict(self) -> dict[str, int]:
        """Every counter by name. A shallow copy of the fields: read on every engine step,
        where ``dataclasses.asdict`` (a deep copy of each) took 15x as long."""
        return dict(vars(self))

    def minus(self, earlier: ManagerCounters) -> ManagerCounters:
        """The increments since ``earlier`` (``held_blocks`` stays the current level)."""
        now, then = self.as_dict(), earlier.as_dict()
        delta = {name: now[name] - then[name] for name in now}
        delta["held_blocks"] = self.held_blocks
        return ManagerCounters(**delta)

    def copy(self) -> ManagerCounters:
        return dataclasses.replace(self)


COUNTER_DOCS: dict[str, str] = {
    "lookups": "Lookup calls made to the offloading manager.",
    "lookup_hit_blocks": "Blocks found ready in the offload tier by lookups.",
    "stores_offered": "Blocks offered for storing in the offload tier.",
    "stores_admitted": "Offered blocks given a slot in the offload tier.",
    "stores_skipped": "Offered blocks held back by the admission policy.",
    "stores_rejected": "Offered blocks not stored because the tier had no room.",
    "stores_completed": "Blocks whose store into the offload tier completed.",
    "stores_failed": "Blocks whose store into the offload tier failed.",
    "evictions": "Blocks evicted from the offload tier.",
    "loads": "Blocks loaded from the offload tier.",
    "bytes_stored": "Bytes written into the offload tier (device to tier).",
    "bytes_loaded": "Bytes read from the offload tier (tier to device).",
}
"""Help text of every cumulative counter; ``held_blocks`` is a gauge."""


LATENCY_BUCKETS: tuple[float, ...] = (
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip
"""Upper bounds in seconds: a block copy takes from tens of microseconds to a second or so."""


@dataclass
class LatencyHistogram:
    """Cumulative counts of observations at or below each bucket's bound, plus their sum."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = dataclasses.field(default_factory=list)
    count: int = 0
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        """Count ``value``: the total count first, then the buckets from the widest down,
        so that a scrape from another thread, at any moment, reads cumulative counts that
        never decrease with the bound (Prometheus's rule for a histogram's buckets)."""
        self.count += 1
        counts, bounds = self.counts, self.bounds
        for i in range(len(bounds) - 1, -1, -1):
            if value > bounds[i]:
                break
            counts[i] += 1
        self.total += value
