"""The real tier's per-key loops as this installation runs them: compiled where ``pip``
found a C compiler (``_block_loops.c``), else their Python reference (:mod:`block_loops`)."""

from __future__ import annotations

try:
    from kvoffload.policies._block_loops import (
        claim_pending,
        distinct,
        drop_victims,
        front_victims,
        leading_ready,
        mark_ready,
        move_recent,
        pin_all,
        store_pairs,
        unpin_all,
    )
except ImportError:  # built without a C compiler: the same steps in Python
    from kvoffload.policies.block_loops import (
        claim_pending,
        distinct,
        drop_victims,
        front_victims,
        leading_ready,
        mark_ready,
        move_recent,
        pin_all,
        store_pairs,
        unpin_all,
    )

__all__ = [
    "claim_pending",
    "distinct",
    "drop_victims",
    "front_victims",
    "leading_ready",
    "mark_ready",
    "move_recent",
    "pin_all",
    "store_pairs",
    "unpin_all",
]
