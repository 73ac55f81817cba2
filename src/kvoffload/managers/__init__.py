"""Managers: own the blocks of a tier (slots, reference counts, events) or wrap one."""

from __future__ import annotations

from kvoffload.admission import WriteBudget
from kvoffload.core.errors import check_integer
from kvoffload.core.manager import OffloadingManager
from kvoffload.managers.cpu import CPUOffloadingManager
from kvoffload.managers.reuse_filter import FilterReusedOffloadingManager
from kvoffload.managers.stack import Stack, StackConfig, build_cpu_stack
from kvoffload.managers.tiered import TieredOffloadingManager, TierSettings
from kvoffload.policies import resolve_policy


def build_manager(
    num_blocks: int,
    cache_policy: str = "lru",
    store_threshold: int = 0,
    max_tracker_size: int = 64_000,
    enable_events: bool = False,
    admission: str = "none",
    write_budget: float | WriteBudget | None = None,
    admission_params: object | None = None,
) -> OffloadingManager:
    """A CPU tier manager, behind the admission layer ``admission`` and then the reuse
    filter when ``store_threshold >= 2`` (the filter is outermost: it sees calls first).

    ``write_budget`` (writes per block reference, or a :class:`WriteBudget`) needs
    ``admission="recommended"``; ``admission_params`` are the rule's parameters (see
    ``wrap_with_admission``).
    Thresholds 0 and 1 mean "no filter", as in vLLM's configuration; anything but an
    integer >= 0 is refused, so that ``1.5`` or ``"2"`` is not silently "no filter".
    """
    # Checked here, as named here: StackConfig's errors name its fields cpu_blocks and policy.
    check_integer("num_blocks", num_blocks, 1)
    resolve_policy(cache_policy)
    config = StackConfig(
        num_blocks,
        cache_policy,
        store_threshold,
        max_tracker_size,
        admission,
        write_budget,
        admission_params=admission_params,
        enable_events=enable_events,
    )
    return build_cpu_stack(config).manager


__all__ = [
    "CPUOffloadingManager",
    "FilterReusedOffloadingManager",
    "Stack",
    "StackConfig",
    "TierSettings",
    "TieredOffloadingManager",
    "build_cpu_stack",
    "build_manager",
]
