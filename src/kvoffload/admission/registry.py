"""Admission layers by name, so configurations and the CLI can pick one with a string.

``none`` stores every offered block. ``recommended`` is an alias of the
configuration this project recommends.
"""

from __future__ import annotations

from collections.abc import Callable

from kvoffload.admission.base import AdmissionLayer
from kvoffload.admission.feedback import FeedbackAdmission
from kvoffload.admission.optimiser import OptimisingAdmission
from kvoffload.admission.seen_twice import SketchAdmission
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.manager import OffloadingManager

AdmissionFactory = Callable[[OffloadingManager, int], AdmissionLayer]

NO_ADMISSION = "none"
_LAYERS: dict[str, AdmissionFactory] = {
    "feedback": FeedbackAdmission,
    "optimiser": OptimisingAdmission,
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


def wrap_with_admission(name: str, backing: OffloadingManager, capacity: int) -> OffloadingManager:
    """``backing`` behind the admission layer ``name`` (unchanged for ``none``)."""
    canonical = resolve_admission(name)
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
