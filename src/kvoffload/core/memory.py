"""How much memory the machine can still give, checked before a large allocation.

A size typed by an operator (GPU slots, requests to generate) can be far
beyond the machine; asking first turns an out-of-memory crash, or a machine
that swaps to a halt, into one clear error. Torch-free, for the simulator.
"""

from __future__ import annotations

import os

from kvoffload.core.errors import InsufficientMemoryError


def available_bytes() -> int | None:
    """Memory available to new allocations (``MemAvailable``), or ``None`` if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def check_fits(num_bytes: float, what: str) -> None:
    """:class:`InsufficientMemoryError` if ``num_bytes`` for ``what`` exceed available memory."""
    available = available_bytes()
    if available is not None and num_bytes > available:
        raise InsufficientMemoryError(
            f"{what} would need about {num_bytes / 2**30:,.1f} GiB of memory, "
            f"more than the {available / 2**30:,.1f} GiB available"
        )
