"""The lower tiers' cost model."""

from __future__ import annotations

import math

import pytest

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.sim.tier_model import TierCost


@pytest.mark.parametrize(
    ("gb_per_s", "latency_ms"), [(math.nan, 0.1), (math.inf, 0.1), (3.0, math.nan), (3.0, -1.0)]
)
def test_a_tier_cost_is_finite(gb_per_s: float, latency_ms: float) -> None:
    # A NaN latency passed the check (NaN < 0 is false) and made every tier time NaN.
    with pytest.raises(InvalidArgumentError, match="must be a finite number"):
        TierCost(gb_per_s, latency_ms)


def test_a_tier_cost_is_latency_plus_bytes_over_bandwidth() -> None:
    assert TierCost(2.0, 0.5).seconds(batches=4, blocks=10, bytes_per_block=10**8) == 0.002 + 0.5
