"""Managers: own the blocks of a tier (slots, reference counts, events) or wrap one."""

from __future__ import annotations

from kvoffload.admission import WriteBudget, resolve_admission, wrap_with_admission
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.manager import OffloadingManager
from kvoffload.managers.cpu import CPUOffloadingManager
from kvoffload.managers.reuse_filter import FilterReusedOffloadingManager
from kvoffload.managers.tiered import TieredOffloadingManager, TierSettings


def build_manager(
    num_blocks: int,
    cache_policy: str = "lru",
    store_threshold: int = 0,
    max_tracker_size: int = 64_000,
    enable_events: bool = False,
    admission: str = "none",
    write_budget: float | WriteBudget | None = None,
) -> OffloadingManager:
    """A CPU tier manager, behind the admission layer ``admission`` and then the reuse
    filter when ``store_threshold >= 2`` (the filter is outermost: it sees calls first).

    ``write_budget`` (writes per block reference, or a :class:`WriteBudget`) needs
    ``admission="recommended"``.
    Thresholds 0 and 1 mean "no filter", as in vLLM's configuration; anything but an
    integer >= 0 is refused, so that ``1.5`` or ``"2"`` is not silently "no filter".
    """
    if isinstance(store_threshold, bool) or not isinstance(store_threshold, int):
        raise InvalidArgumentError(
            f"store_threshold must be an integer >= 0, got {store_threshold!r}"
        )
    if store_threshold < 0:
        raise InvalidArgumentError(f"store_threshold must be >= 0, got {store_threshold}")
    resolve_admission(admission)
    manager: OffloadingManager = CPUOffloadingManager(num_blocks, cache_policy, enable_events)
    manager = wrap_with_admission(admission, manager, num_blocks, write_budget)
    if store_threshold >= 2:
        manager = FilterReusedOffloadingManager(manager, store_threshold, max_tracker_size)
    return manager


__all__ = [
    "CPUOffloadingManager",
    "FilterReusedOffloadingManager",
    "TierSettings",
    "TieredOffloadingManager",
    "build_manager",
]
