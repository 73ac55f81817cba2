"""Small workloads built from block-id lists."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvoffload import block_id_key
from kvoffload.sim.workload import Request, Workload

MakeWorkload = Callable[..., Workload]


def _workload(*requests: list[int], block_tokens: int = 16) -> Workload:
    return Workload(
        "test",
        block_tokens,
        [
            Request(float(i), len(ids) * block_tokens, 1, [block_id_key(b) for b in ids])
            for i, ids in enumerate(requests)
        ],
    )


@pytest.fixture
def make_workload() -> MakeWorkload:
    """Build a workload from block-id lists: one request a second, prompts filling the blocks."""
    return _workload
