"""Admission: which offered blocks are worth writing to the offload tier.

Each layer wraps any :class:`~kvoffload.core.manager.OffloadingManager`,
keeps bounded memory sized from the tier's capacity, and reports its
counters through :class:`AdmissionStats`.
"""

from kvoffload.admission.base import AdmissionLayer, AdmissionStats
from kvoffload.admission.budget import (
    BudgetCredit,
    WriteBudget,
    attach_clock,
    check_write_budget,
    parse_bytes,
)
from kvoffload.admission.controller import ReuseController
from kvoffload.admission.feedback import FeedbackAdmission
from kvoffload.admission.ghost import GhostRecords
from kvoffload.admission.minisim import MiniSimulation, MiniTier, WhatIf
from kvoffload.admission.optimiser import Objective, OptimisingAdmission
from kvoffload.admission.registry import (
    available_admissions,
    find_admission,
    resolve_admission,
    wrap_with_admission,
)
from kvoffload.admission.requests import RequestTracker
from kvoffload.admission.seen_twice import SketchAdmission
from kvoffload.admission.sketch import FrequencySketch, key_hashes

__all__ = [
    "AdmissionLayer",
    "AdmissionStats",
    "BudgetCredit",
    "FeedbackAdmission",
    "FrequencySketch",
    "GhostRecords",
    "MiniSimulation",
    "MiniTier",
    "Objective",
    "OptimisingAdmission",
    "RequestTracker",
    "ReuseController",
    "SketchAdmission",
    "WhatIf",
    "WriteBudget",
    "attach_clock",
    "available_admissions",
    "check_write_budget",
    "find_admission",
    "key_hashes",
    "parse_bytes",
    "resolve_admission",
    "wrap_with_admission",
]
