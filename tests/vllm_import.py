"""vLLM imported for the tests that hold us to it, skipped cleanly where it is not installed."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Sequence
from types import ModuleType

import pytest

VLLM_MODULES = (
    "vllm.v1.kv_offload.base",
    "vllm.v1.kv_offload.config",
    "vllm.v1.kv_offload.factory",
    "vllm.v1.kv_offload.cpu.manager",
    "vllm.distributed.kv_events",
)
"""What the integration tests use of vLLM (about 10 s to import, once per process)."""


def import_vllm(names: Sequence[str] = VLLM_MODULES) -> dict[str, ModuleType]:
    """vLLM's modules ``names``; torch's own deprecation warnings from that import are not
    ours."""
    pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it)")
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*torch\.jit\.script_method.*", category=DeprecationWarning
        )
        return {name: importlib.import_module(name) for name in names}
