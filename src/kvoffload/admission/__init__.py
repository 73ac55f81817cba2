"""Admission: which offered blocks are worth writing to the offload tier.

Each layer wraps any :class:`~kvoffload.core.manager.OffloadingManager`,
keeps bounded memory sized from the tier's capacity, and reports its
counters through :class:`AdmissionStats`. Every rule registers itself by
name with its parameters dataclass (:func:`register_admission`).
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
from kvoffload.admission.feedback import FeedbackAdmission, FeedbackParams
from kvoffload.admission.ghost import GhostRecords
from kvoffload.admission.minisim import MiniSimulation, MiniTier, WhatIf
from kvoffload.admission.optimiser import Objective, OptimiserParams, OptimisingAdmission
from kvoffload.admission.params import NoParams, param, parse_pairs
from kvoffload.admission.registry import (
    admission_params,
    available_admissions,
    config_params,
    find_admission,
    params_class,
    register_admission,
    resolve_admission,
    wrap_with_admission,
)
from kvoffload.admission.requests import RequestTracker
from kvoffload.admission.reuse_filter import FilterParams, FilterReusedOffloadingManager
from kvoffload.admission.seen_twice import SketchAdmission, SketchParams
from kvoffload.admission.sketch import FrequencySketch, key_hashes

__all__ = [
    "AdmissionLayer",
    "AdmissionStats",
    "BudgetCredit",
    "FeedbackAdmission",
    "FeedbackParams",
    "FilterParams",
    "FilterReusedOffloadingManager",
    "FrequencySketch",
    "GhostRecords",
    "MiniSimulation",
    "MiniTier",
    "NoParams",
    "Objective",
    "OptimiserParams",
    "OptimisingAdmission",
    "RequestTracker",
    "ReuseController",
    "SketchAdmission",
    "SketchParams",
    "WhatIf",
    "WriteBudget",
    "admission_params",
    "attach_clock",
    "available_admissions",
    "check_write_budget",
    "config_params",
    "find_admission",
    "key_hashes",
    "param",
    "params_class",
    "parse_bytes",
    "parse_pairs",
    "register_admission",
    "resolve_admission",
    "wrap_with_admission",
]
