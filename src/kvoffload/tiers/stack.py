"""The one builder of a tier stack: CPU, then disk (write-back), then the shared tier.

The simulator and the vLLM spec both call it, so a block a simulated run
writes to a shared server and one a vLLM instance writes there follow the
same rules; only the fingerprint (what the blocks' bytes mean) differs.
"""

from __future__ import annotations

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.managers.cpu import CPUOffloadingManager
from kvoffload.managers.tiered import LowerTier, SlotBytes, TieredOffloadingManager, TierSettings
from kvoffload.tiers.disk import DiskTier
from kvoffload.tiers.remote import RemoteTier
from kvoffload.tiers.slot_file import DEFAULT_DEADLINE_S


def build_tiered_manager(
    cpu: CPUOffloadingManager,
    fingerprint: bytes,
    *,
    disk_dir: str | None,
    disk_blocks: int,
    remote_url: str | None,
    disk_policy: str,
    store_threshold: int,
    slot_bytes: SlotBytes | None,
    wait_for_tiers: bool,
    enable_events: bool = False,
    disk_deadline_s: float = DEFAULT_DEADLINE_S,
) -> TieredOffloadingManager:
    """``cpu`` over the configured lower tiers; the shared one is write-through, so others
    see a block as soon as it is stored. Tiers opened before a failure are closed again.
    """
    tiers: list[tuple[LowerTier, TierSettings]] = []
    try:
        if disk_dir is not None:
            if disk_blocks < 1:
                raise InvalidArgumentError(f"a disk tier needs >= 1 block, got {disk_blocks}")
            disk = DiskTier(
                disk_dir,
                disk_blocks,
                fingerprint,
                disk_policy,
                enable_events=enable_events,
                deadline_s=disk_deadline_s,
            )
            tiers.append((disk, TierSettings(False, store_threshold)))
        if remote_url is not None:
            remote = RemoteTier(remote_url, fingerprint, enable_events=enable_events)
            tiers.append((remote, TierSettings(True, store_threshold)))
    except BaseException:
        for tier, _ in tiers:
            tier.close()
        raise
    return TieredOffloadingManager(cpu, tiers, slot_bytes, wait_for_tiers=wait_for_tiers)
