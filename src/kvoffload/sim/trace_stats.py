"""Summary statistics of a workload's block references, to judge its reuse before replaying.

The reuse distance of a reference is the number of distinct blocks used
since the previous use of the same block: an LRU cache of more than that
many blocks would hit it (ignoring the prefix rule). Distances are found
with a Fenwick tree over reference positions, O(n log n) overall.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvoffload.core.keys import OffloadKey
from kvoffload.sim.workload import Progress, Workload

PERCENTILES = (50, 90, 99)
PROGRESS_REFS = 2**16
"""References measured between two reports to a progress callback."""


def reuse_distances(workload: Workload, progress: Progress | None = None) -> list[int]:
    """Reuse distance of every reference that repeats an earlier block, in trace order;
    ``progress(done, total)`` is told the references measured now and then."""
    keys = [key for req in workload.requests for key in req.keys]
    size = len(keys)
    tree = [0] * (size + 1)

    def add(position: int, delta: int) -> None:
        position += 1
        while position <= size:
            tree[position] += delta
            position += position & -position

    def prefix_sum(position: int) -> int:
        """Sum over positions ``0 .. position-1``."""
        total = 0
        while position > 0:
            total += tree[position]
            position -= position & -position
        return total

    last_seen: dict[OffloadKey, int] = {}
    distances: list[int] = []
    for position, key in enumerate(keys):
        if progress is not None and not position % PROGRESS_REFS:
            progress(position, size)
        previous = last_seen.get(key)
        if previous is not None:
            distances.append(prefix_sum(position) - prefix_sum(previous + 1))
            add(previous, -1)
        add(position, 1)
        last_seen[key] = position
    if progress is not None:
        progress(size, size)
    return distances


def _percentile(sorted_values: list[int], percent: int) -> int:
    """Nearest-rank percentile of an ascending list."""
    rank = max(1, -(-percent * len(sorted_values) // 100))
    return sorted_values[rank - 1]


@dataclass(frozen=True)
class TraceStats:
    """A workload's reuse at a glance; distances are in distinct blocks (see the module doc)."""

    workload: str
    block_tokens: int
    requests: int
    refs: int
    unique_blocks: int
    repeat_fraction: float
    """References to a block seen before: the hit ratio of an unbounded cache."""
    one_hit_wonder_fraction: float
    """Unique blocks referenced exactly once."""
    mean_blocks_per_request: float
    max_blocks_per_request: int
    duration_seconds: float
    reuse_distance_p50: int | None
    """None where no block is used twice: there is no distance, and 0 would read as
    the closest reuse there is."""
    reuse_distance_p90: int | None
    reuse_distance_p99: int | None

    def as_dict(self) -> dict[str, str | int | float | None]:
        return dataclasses.asdict(self)


def trace_stats(workload: Workload, progress: Progress | None = None) -> TraceStats:
    """Requests, references, unique blocks, repeat and one-hit fractions, reuse distances;
    ``progress`` follows the reuse distances, the long part (see :func:`reuse_distances`)."""
    return stats_and_distances(workload, progress)[0]


def stats_and_distances(
    workload: Workload, progress: Progress | None = None
) -> tuple[TraceStats, list[int]]:
    """:func:`trace_stats` and the sorted reuse distances it summarises (a plot draws them
    all), from one pass."""
    counts: dict[OffloadKey, int] = {}
    for req in workload.requests:
        for key in req.keys:
            counts[key] = counts.get(key, 0) + 1
    refs = sum(counts.values())
    unique = len(counts)
    requests = workload.requests
    distances = sorted(reuse_distances(workload, progress))
    p50, p90, p99 = (_percentile(distances, p) if distances else None for p in PERCENTILES)
    stats = TraceStats(
        workload=workload.name,
        block_tokens=workload.block_tokens,
        requests=len(requests),
        refs=refs,
        unique_blocks=unique,
        repeat_fraction=(refs - unique) / refs if refs else 0.0,
        one_hit_wonder_fraction=(
            sum(1 for c in counts.values() if c == 1) / unique if unique else 0.0
        ),
        mean_blocks_per_request=refs / len(requests) if requests else 0.0,
        max_blocks_per_request=max((len(r.keys) for r in requests), default=0),
        duration_seconds=requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0,
        reuse_distance_p50=p50,
        reuse_distance_p90=p90,
        reuse_distance_p99=p99,
    )
    return stats, distances
