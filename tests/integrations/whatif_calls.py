"""Which what-if figures an engine's per-step stats ask the optimiser for."""

from __future__ import annotations

from typing import Any

import pytest

from kvoffload.admission import OptimisingAdmission


def record_whatif_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The ``cumulative`` argument of each later :meth:`OptimisingAdmission.whatif` call,
    in order: a step that asks for ``True`` computes the figures only the simulator's
    report reads."""
    asked: list[bool] = []
    whatif = OptimisingAdmission.whatif

    def recorded(layer: OptimisingAdmission, cumulative: bool = False) -> Any:
        asked.append(cumulative)
        return whatif(layer, cumulative)

    monkeypatch.setattr(OptimisingAdmission, "whatif", recorded)
    return asked
