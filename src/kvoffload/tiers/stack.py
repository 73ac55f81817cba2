"""The one builder of a manager stack with its lower tiers: a :class:`StackConfig` in, a
:class:`Stack` out, with named handles to every part.

The simulator, ``build_manager``, the vLLM spec and the adapter all build
through here (or :func:`~kvoffload.managers.stack.build_cpu_stack` when no
lower tier is configured), so a block a simulated run writes to a shared server
and one a vLLM instance writes there follow the same rules; only the
fingerprint (what the blocks' bytes mean) differs. It lives in ``tiers``
because it opens tiers, which managers may not import.

SGLang's L3 backend has no CPU tier of ours (SGLang's host pool is above it): it takes
only the lower tiers from here, each as an opener and its admission book
(:func:`lower_tiers`), from the same :class:`LowerTierConfig` the stack's own are opened by.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvoffload.admission import AdmissionLayer
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.specs import LoadStoreSpec
from kvoffload.core.tier_protocol import LowerTier
from kvoffload.managers.admit_all import admission_book
from kvoffload.managers.cpu import CPUOffloadingManager
from kvoffload.managers.stack import (
    DISK,
    LowerTierConfig,
    Stack,
    StackConfig,
    assemble,
    build_cpu_stack,
)
from kvoffload.managers.tiered import TieredOffloadingManager, TierSettings
from kvoffload.policies.base import CachePolicy
from kvoffload.tiers.disk import DiskTier
from kvoffload.tiers.remote import RemoteTier, RemoteTierError
from kvoffload.tiers.slot_file import DEFAULT_DEADLINE_S

Opener = Callable[[], LowerTier]
"""Opens a tier; each call opens it anew (SGLang reopens a disk tier it emptied)."""


def tier_opener(
    config: LowerTierConfig, fingerprint: bytes, *, enable_events: bool = False
) -> Opener:
    """What opens the tier ``config`` describes, its blocks meaning ``fingerprint``. With
    ``config.where`` set (an engine's own keys), a tier that cannot open raises its own
    error with the location's key in front; without it, the error as it is."""
    where = f"{config.where}{config.key('location')}"
    if config.kind == DISK:
        blocks = config.blocks
        if blocks is None:
            raise InvalidArgumentError(f"{where}: the disk tier's size is not known yet")

        def open_disk() -> LowerTier:
            try:
                return DiskTier(
                    config.location,
                    blocks,
                    fingerprint,
                    config.policy,
                    io_threads=config.io_threads,
                    fsync=config.fsync,
                    enable_events=enable_events,
                    deadline_s=config.deadline_s or DEFAULT_DEADLINE_S,
                    max_pending_write_bytes=config.max_pending_write_bytes,
                )
            except InvalidArgumentError as exc:
                if not config.where:
                    raise
                raise type(exc)(f"{where}: {exc}") from None

        return open_disk

    def open_remote() -> LowerTier:
        try:
            return RemoteTier(
                config.location,
                fingerprint,
                io_threads=config.io_threads,
                enable_events=enable_events,
                max_pending_write_bytes=config.max_pending_write_bytes,
            )
        except (InvalidArgumentError, RemoteTierError) as exc:
            if not config.where:
                raise
            raise type(exc)(f"{where}: {exc}") from None

    return open_remote


def tier_book(
    config: LowerTierConfig, spec: LoadStoreSpec, policy: CachePolicy | None = None
) -> AdmissionLayer | None:
    """The admission book of the tier ``config`` describes (``None``: every offer is
    written), handing out ``spec``; ``policy``: the tier's eviction policy, if modelled.
    The tiered manager builds the same from :meth:`LowerTierConfig.tier_settings`. With
    ``config.where`` set, memory the tier's size asks of its layer and the machine lacks
    names the size's key."""
    return admission_book(
        config.admission,
        spec,
        config.blocks or 0,
        config.write_budget,
        policy,
        config.admission_params,
        config.size_name if config.where else "",
    )


@dataclass(frozen=True)
class LowerTierParts:
    """One lower tier, not yet open: its settings, its opener and its admission book."""

    config: LowerTierConfig
    open: Opener
    book: AdmissionLayer | None


@dataclass(frozen=True)
class LowerTiers:
    """The lower tiers by name (``None``: not configured), for an engine that has its own
    top tier (SGLang's host pool) and opens them when it is ready."""

    disk: LowerTierParts | None = None
    remote: LowerTierParts | None = None


def lower_tiers(
    disk: LowerTierConfig | None,
    remote: LowerTierConfig | None,
    fingerprint: bytes,
    spec: LoadStoreSpec,
    *,
    enable_events: bool = False,
) -> LowerTiers:
    """The openers and admission books of the tiers ``disk`` / ``remote`` describe."""

    def parts(config: LowerTierConfig | None) -> LowerTierParts | None:
        if config is None:
            return None
        opener = tier_opener(config, fingerprint, enable_events=enable_events)
        return LowerTierParts(config, opener, tier_book(config, spec))

    return LowerTiers(parts(disk), parts(remote))


def build_stack(config: StackConfig) -> Stack:
    """The stack ``config`` describes, its lower tiers as :class:`LowerTierConfig` says
    (write-back to disk, write-through to the shared tier). Tiers opened before a failure
    are closed again."""
    if not config.has_lower_tiers:
        return build_cpu_stack(config)
    cpu = CPUOffloadingManager(config.cpu_blocks, config.policy, config.enable_events)
    stack = Stack(cpu, cpu)
    stack.tiered = _tiered(config, cpu, stack)
    try:
        return assemble(config, stack)
    except BaseException:  # the CPU tier's admission layer, built last
        stack.close()
        raise


def _tiered(
    config: StackConfig, cpu: CPUOffloadingManager, stack: Stack
) -> TieredOffloadingManager:
    tiers: list[tuple[LowerTier, TierSettings]] = []
    try:
        for tier_config in (config.disk_tier, config.remote_tier):
            if tier_config is None:
                continue
            opener = tier_opener(
                tier_config, config.fingerprint, enable_events=config.enable_events
            )
            tier = opener()
            tiers.append((tier, tier_config.tier_settings(config.tier_store_threshold)))
            if tier_config.kind == DISK:
                stack.disk = tier
            else:
                stack.remote = tier
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


__all__ = [
    "LowerTierConfig",
    "LowerTierParts",
    "LowerTiers",
    "Stack",
    "StackConfig",
    "build_stack",
    "lower_tiers",
    "tier_book",
    "tier_opener",
]
