"""Handing read blocks to their destination from an I/O thread, without ever raising there.

An exception in an I/O thread would leave the read's future unresolved and
the promotion waiting forever; a block that cannot be delivered is a failed
read instead.
"""

from __future__ import annotations

from kvoffload.managers.tiered import Sink


def deliver(sink: Sink, index: int, payload: memoryview) -> bool:
    """``sink(index, payload)``; whether it succeeded."""
    try:
        sink(index, payload)
    except Exception:  # the destination's failure is this block's failed read, nothing more
        return False
    return True
