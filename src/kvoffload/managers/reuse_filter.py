"""The seed's reuse filter, which lives with the other admission rules in ``admission``."""

from kvoffload.admission.reuse_filter import FilterReusedOffloadingManager

__all__ = ["FilterReusedOffloadingManager"]
