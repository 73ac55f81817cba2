"""The shared Mooncake trace, skipped when absent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def mooncake_trace() -> Path:
    env = os.environ.get("KVOFFLOAD_SHARED")
    shared = Path(env) if env else Path(__file__).resolve().parents[2] / ".." / "shared"
    path = shared / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
    if not path.is_file():
        pytest.skip(f"the Mooncake trace is not at {path} (set KVOFFLOAD_SHARED)")
    return path
