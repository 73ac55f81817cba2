"""What the tiers below the CPU tier cost in a simulated run (built by ``kvoffload.tiers``).

Lower tiers are real (files in a directory, blocks on a Valkey/Redis
server), so two runs against the same server share blocks. Their cost is
modelled, not timed: a tier read of ``n`` blocks takes
``latency + n * bytes_per_block / bandwidth`` (defaults below, overridable
in :class:`~kvoffload.sim.run.SimConfig`); writes count the bandwidth term
alone, since the run keeps no count of their batches. The model adds to the
report (the prefill time saved is net of the reads); it does not delay the
replay: the engine's lookup retry does that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvoffload.admission import resolve_admission
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.tier_protocol import TierStats
from kvoffload.managers.tiered import TieredOffloadingManager

DISK_GB_PER_S = 3.0
"""A PCIe 4 NVMe SSD, sequential."""
DISK_LATENCY_MS = 0.1
REMOTE_GB_PER_S = 5.0
"""About half of a 100 Gb/s link, for a shared server under load."""
REMOTE_LATENCY_MS = 0.5

Scalar = str | int | float | None


@dataclass(frozen=True)
class TierCost:
    """Bandwidth (GB/s, 1e9 bytes) and per-batch latency of one tier."""

    gb_per_s: float
    latency_ms: float

    def __post_init__(self) -> None:
        if not 0 < self.gb_per_s < math.inf:
            raise InvalidArgumentError(
                f"a tier bandwidth must be a finite number > 0 GB/s, got {self.gb_per_s}"
            )
        if not 0 <= self.latency_ms < math.inf:
            raise InvalidArgumentError(
                f"a tier latency must be a finite number >= 0 ms, got {self.latency_ms}"
            )

    def seconds(self, batches: int, blocks: int, bytes_per_block: int) -> float:
        return batches * self.latency_ms / 1000 + blocks * bytes_per_block / (self.gb_per_s * 1e9)


def tier_report(
    stats: TierStats, bytes_per_block: int, cost: TierCost | None, batches: int
) -> dict[str, Scalar]:
    """One tier's entry of the report's ``tiers`` object."""
    entry: dict[str, Scalar] = {
        "hit_blocks": stats.hit_blocks,
        "stored_blocks": stats.stored_blocks,
        "read_bytes": stats.hit_blocks * bytes_per_block,
        "written_bytes": stats.stored_blocks * bytes_per_block,
        "failed": stats.failed,
        "corrupt": stats.corrupt,
        "evicted": stats.evicted,
        "rejected": stats.rejected,
    }
    if cost is not None:
        entry["read_seconds"] = cost.seconds(batches, stats.hit_blocks, bytes_per_block)
        entry["write_seconds"] = cost.seconds(0, stats.stored_blocks, bytes_per_block)
    return entry


def tiers_report(
    tiered: TieredOffloadingManager | None,
    cpu: TierStats,
    bytes_per_block: int,
    costs: dict[str, TierCost],
) -> dict[str, dict[str, Scalar]]:
    """``{"cpu": ..., "disk": ..., "remote": ...}``: the tiers this run had; a tier that
    recovers blocks on start (the disk tier) adds ``recovered`` and ``dropped_*``."""
    report = {"cpu": tier_report(cpu, bytes_per_block, None, 0)}
    if tiered is not None:
        for index, tier in enumerate(tiered.tiers):
            name = tier.medium.lower()
            batches = tiered.promotion_batches[index]
            report[name] = tier_report(tier.stats, bytes_per_block, costs.get(name), batches)
            report[name].update(recovery_counts(tier))
            report[name].update(admission_counts(tiered, index))
    return report


def read_seconds(tiers: dict[str, dict[str, Scalar]]) -> float:
    """The lower tiers' modelled read time in a ``tiers`` report (the CPU tier has none)."""
    return sum(float(entry.get("read_seconds") or 0.0) for entry in tiers.values())


def admission_counts(tiered: TieredOffloadingManager, index: int) -> dict[str, Scalar]:
    """Lower tier ``index``'s admission: its layer's name, the blocks offered for writing
    to it and those admitted (after its threshold and its layer)."""
    return {
        "admission": resolve_admission(tiered.tier_settings[index].admission),
        "offered_blocks": tiered.offered_blocks[index],
        "admitted_blocks": tiered.admitted_blocks[index],
    }


def recovery_counts(tier: object) -> dict[str, int]:
    """What ``tier`` found on start (``recovered``, ``dropped_torn`` ...); none if it keeps
    nothing across runs."""
    recovery = getattr(tier, "recovery", None)
    counts = getattr(recovery, "as_dict", None)
    return dict(counts()) if callable(counts) else {}
