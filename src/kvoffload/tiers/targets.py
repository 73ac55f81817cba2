"""Reading into a block's destination from an I/O thread, without ever raising there.

An exception in an I/O thread would leave the read's future unresolved and
the promotion waiting forever; a block that cannot be delivered is a failed
read instead. A destination may be one buffer or, for a payload stored from
parts (:data:`~kvoffload.tiers.format.Parts`), a list of buffers filled in
order, so nothing has to scatter a staging copy afterwards.
"""

from __future__ import annotations

from kvoffload.core.tier_protocol import Target


def destination_parts(
    target: Target, index: int, size: int | None = None
) -> list[memoryview] | None:
    """``target(index)`` as writable byte views in order (one for a single buffer), if
    they hold ``size`` bytes together (any size when ``None``), else ``None``."""
    try:
        got: object = target(index)
        parts: list[memoryview] = []
        for view in got if isinstance(got, list | tuple) else [got]:
            if not isinstance(view, memoryview) or view.readonly:
                return None
            flat = view.format == "B" and view.ndim == 1
            parts.append(view if flat else view.cast("B"))  # a page's rows read as its bytes
    except Exception:  # the destination's failure is this block's failed read, nothing more
        return None
    if size is not None and sum(part.nbytes for part in parts) != size:
        return None
    return parts
