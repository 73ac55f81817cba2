"""Shared fixtures: the public Mooncake trace (skipped when absent) and small workloads."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from kvoffload import block_id_key
from kvoffload.sim.workload import Request, Workload

TRACE_NAME = "mooncake_synthetic_trace.jsonl"


def shared_dir() -> Path:
    """``$KVOFFLOAD_SHARED``, else the ``shared`` folder beside the repository."""
    env = os.environ.get("KVOFFLOAD_SHARED")
    return Path(env) if env else Path(__file__).resolve().parents[2] / ".." / "shared"


@pytest.fixture(scope="session")
def mooncake_trace() -> Path:
    path = shared_dir() / "data" / "traces" / TRACE_NAME
    if not path.is_file():
        pytest.skip(f"{TRACE_NAME} not found at {path} (set KVOFFLOAD_SHARED to its shared/ dir)")
    return path


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
