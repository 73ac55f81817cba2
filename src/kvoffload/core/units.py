"""Byte counts as people read them, one way everywhere: the CLI's tables and the plots'
titles showed the same GPU cache as "1,024 KiB" and "1 MiB"."""

from __future__ import annotations

import math

BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
MOST_WHOLE_EIB = 1e6
"""Beyond a million EiB (no memory or disk, an overflowed count) a size is shown in
scientific notation, not as every digit of it."""


def binary_size(num_bytes: float) -> str:
    """``num_bytes`` in the largest binary unit it fills once rounded to three significant
    digits (1023.9 KiB reads "1 MiB"), whole units from 999.5 on, where ``.3g`` would print
    "1e+03"."""
    value = float(num_bytes)
    if not math.isfinite(value):
        return f"{value} B"
    index = 0
    while index < len(BINARY_UNITS) - 1 and float(f"{abs(value) / 1024:.3g}") >= 1:
        value /= 1024
        index += 1
    unit = BINARY_UNITS[index]
    if unit == "B":
        return f"{round(value):,} B"
    if abs(value) < 999.5 or abs(value) >= MOST_WHOLE_EIB:
        return f"{value:.3g} {unit}"
    return f"{value:,.0f} {unit}"
