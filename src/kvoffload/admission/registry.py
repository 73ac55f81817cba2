"""Admission layers by name, so configurations and the CLI can pick one with a string.

``none`` stores every offered block. ``recommended`` is an alias of the
configuration this project recommends.
"""

from __future__ import annotations

from collections.abc import Callable

from kvoffload.admission.base import AdmissionLayer
from kvoffload.admission.budget import WriteBudget, check_write_budget
from kvoffload.admission.feedback import FeedbackAdmission
from kvoffload.admission.optimiser import OptimisingAdmission
from kvoffload.admission.seen_twice import SketchAdmission
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.manager import OffloadingManager

AdmissionFactory = Callable[[OffloadingManager, int], AdmissionLayer]

NO_ADMISSION = "none"
OPTIMISER = "optimiser"
_LAYERS: dict[str, AdmissionFactory] = {
    "feedback": FeedbackAdmission,
    OPTIMISER: OptimisingAdmission,
    "sketch": SketchAdmission,
}
ALIASES = {"recommended": "optimiser"}


def available_admissions() -> list[str]:
    """Valid admission names, aliases included, sorted."""
    return sorted([NO_ADMISSION, *_LAYERS, *ALIASES])


def resolve_admission(name: str) -> str:
    """The canonical name of ``name``; the error for an unknown one lists the valid names."""
    name = ALIASES.get(name, name)
    if name != NO_ADMISSION and name not in _LAYERS:
        raise InvalidArgumentError(
            f"unknown admission {name!r}; known: {', '.join(available_admissions())}"
        )
    return name


def wrap_with_admission(
    name: str,
    backing: OffloadingManager,
    capacity: int,
    write_budget: float | WriteBudget | None = None,
) -> OffloadingManager:
    """``backing`` behind the admission layer ``name`` (unchanged for ``none``).

    A ``write_budget`` (writes per block reference, or a :class:`WriteBudget`) needs
    the optimiser, the only layer that can keep to one.
    """
    canonical = resolve_admission(name)
    check_write_budget(write_budget)
    if write_budget is not None:
        if canonical != OPTIMISER:
            raise InvalidArgumentError(
                f"a write budget needs admission 'recommended' (the optimiser), not {name!r}"
            )
        return OptimisingAdmission(backing, capacity, write_budget=write_budget)
    if canonical == NO_ADMISSION:
        return backing
    return _LAYERS[canonical](backing, capacity)


def find_admission(manager: OffloadingManager) -> AdmissionLayer | None:
    """The first admission layer in a stack of decorators, following ``backing``."""
    current: object = manager
    while current is not None:
        if isinstance(current, AdmissionLayer):
            return current
        current = getattr(current, "backing", None)
    return None
