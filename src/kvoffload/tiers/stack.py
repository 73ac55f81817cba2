"""The one builder of a manager stack with its lower tiers: a :class:`StackConfig` in, a
:class:`Stack` out, with named handles to every part.

The simulator, ``build_manager``, the vLLM spec and the adapter all build
through here (or :func:`~kvoffload.managers.stack.build_cpu_stack` when no
lower tier is configured), so a block a simulated run writes to a shared server
and one a vLLM instance writes there follow the same rules; only the
fingerprint (what the blocks' bytes mean) differs. It lives in ``tiers``
because it opens tiers, which managers may not import.
"""

from __future__ import annotations

from kvoffload.core.tier_protocol import LowerTier
from kvoffload.managers.cpu import CPUOffloadingManager
from kvoffload.managers.stack import Stack, StackConfig, assemble, build_cpu_stack
from kvoffload.managers.tiered import TieredOffloadingManager, TierSettings
from kvoffload.tiers.disk import DiskTier
from kvoffload.tiers.remote import RemoteTier
from kvoffload.tiers.slot_file import DEFAULT_DEADLINE_S


def build_stack(config: StackConfig) -> Stack:
    """The stack ``config`` describes: the disk tier is write-back, the shared one
    write-through (others see a block as soon as it is stored). Tiers opened before a
    failure are closed again."""
    if not config.has_lower_tiers:
        return build_cpu_stack(config)
    cpu = CPUOffloadingManager(config.cpu_blocks, config.policy, config.enable_events)
    stack = Stack(cpu, cpu)
    stack.tiered = _tiered(config, cpu, stack)
    return assemble(config, stack)


def _tiered(
    config: StackConfig, cpu: CPUOffloadingManager, stack: Stack
) -> TieredOffloadingManager:
    tiers: list[tuple[LowerTier, TierSettings]] = []
    try:
        if config.disk_dir is not None:
            disk = DiskTier(
                config.disk_dir,
                config.disk_blocks,
                config.fingerprint,
                config.disk_policy or config.policy,
                enable_events=config.enable_events,
                deadline_s=config.disk_deadline_s or DEFAULT_DEADLINE_S,
            )
            settings = TierSettings(
                False,
                config.tier_store_threshold,
                config.disk_admission,
                config.disk_write_budget,
                config.disk_blocks,
            )
            tiers.append((disk, settings))
            stack.disk = disk
        if config.remote_url is not None:
            remote = RemoteTier(
                config.remote_url, config.fingerprint, enable_events=config.enable_events
            )
            settings = TierSettings(
                True,
                config.tier_store_threshold,
                config.remote_admission,
                config.remote_write_budget,
                config.remote_blocks,
            )
            tiers.append((remote, settings))
            stack.remote = remote
        return TieredOffloadingManager(
            cpu,
            tiers,
            config.slot_bytes,
            wait_for_tiers=config.wait_for_tiers,
        )
    except BaseException:
        for tier, _ in tiers:
            tier.close()
        raise


__all__ = ["Stack", "StackConfig", "build_stack"]
