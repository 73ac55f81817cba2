"""Reading into a block's destination from an I/O thread, without ever raising there.

An exception in an I/O thread would leave the read's future unresolved and
the promotion waiting forever; a block that cannot be delivered is a failed
read instead.
"""

from __future__ import annotations

from kvoffload.core.tier_protocol import Target


def destination(target: Target, index: int, size: int) -> memoryview | None:
    """``target(index)`` if it gives a buffer of ``size`` bytes, else ``None``."""
    try:
        view = target(index)
    except Exception:  # the destination's failure is this block's failed read, nothing more
        return None
    return view if view.nbytes == size and not view.readonly else None


def byte_view(target: Target, index: int) -> memoryview | None:
    """``target(index)`` as writable bytes, to receive into; ``None`` if it gives none."""
    try:
        view = target(index)
        return None if view.readonly else view.cast("B")
    except Exception:  # the destination's failure is this block's failed read, nothing more
        return None
