"""How a byte count reads, the same in the CLI's tables and in the plots' titles."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.core.units import BINARY_UNITS, binary_size

SIZE = re.compile(r"^(-?[\d,]+(?:\.\d+)?(?:e\+\d+)?) ([KMGTPE]?i?B)$")


@pytest.mark.parametrize(
    ("num_bytes", "shown"),
    [
        (0, "0 B"),
        (256, "256 B"),
        (1023, "1,023 B"),
        (1024, "1 KiB"),
        (1023.9 * 2**10, "1 MiB"),
        (1023.4 * 2**10, "1,023 KiB"),
        (999.4 * 2**20, "999 MiB"),
        (999.5 * 2**30, "1,000 GiB"),
        (1.5 * 2**40, "1.5 TiB"),
        (-3 * 2**50, "-3 PiB"),
        (2**70, "1,024 EiB"),
        (1e30, "8.67e+11 EiB"),
        (math.inf, "inf B"),
    ],
)
def test_a_size_reads_in_the_largest_unit_it_fills(num_bytes: float, shown: str) -> None:
    assert binary_size(num_bytes) == shown


@given(st.floats(min_value=1, max_value=2.0**70, allow_nan=False))
def test_a_size_reads_back_within_its_rounding_and_never_below_one_unit(
    num_bytes: float,
) -> None:
    match = SIZE.match(binary_size(num_bytes))
    assert match is not None, binary_size(num_bytes)
    figure = float(match[1].replace(",", ""))
    scale = 1024 ** BINARY_UNITS.index(match[2])
    assert figure * scale == pytest.approx(num_bytes, rel=5e-3, abs=0.5)
    assert figure >= 1
    assert "e+" not in match[1]
