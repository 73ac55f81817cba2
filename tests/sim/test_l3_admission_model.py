"""The SGLang-shaped replay of ``benchmarks/l3_admission.py`` runs on a small workload: its
key-only L3 model answers every call the backend's tier path makes (a model missing one,
``held``, once made the whole benchmark fail)."""

from __future__ import annotations

import sys

import pytest
from benchmark_scripts import BENCHMARKS, load_benchmark

from kvoffload.core.tier_protocol import LowerTier
from kvoffload.sim.generators import generate


@pytest.fixture(scope="module")
def l3_admission():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(BENCHMARKS))  # it imports admission_table beside it
    try:
        yield load_benchmark("l3_admission")
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.parametrize("admission", ["none", "recommended"])
def test_the_l3_replay_counts_hits_and_writes(l3_admission, admission: str) -> None:  # type: ignore[no-untyped-def]
    workload = generate({"chat": 0.5, "rag": 0.5}, num_requests=120, seed=3, block_tokens=256)
    figures = l3_admission.replay(workload, gpu=64, host=128, l3=512, admission=admission)
    assert 0.0 < figures["l3 hit"] <= 1.0
    assert 0.0 < figures["l3 writes"] <= figures["offers"]
    if admission == "none":
        assert figures["l3 writes"] == pytest.approx(figures["offers"], abs=0.02)


def test_the_key_only_l3_model_has_every_call_of_a_lower_tier(l3_admission) -> None:  # type: ignore[no-untyped-def]
    """The backend asks a tier ``held`` only when some pages of a batch were stored and
    others not, which small runs seldom reach: every call of the protocol is checked."""
    calls = [name for name, member in vars(LowerTier).items() if callable(member)]
    assert "held" in calls and "present" in calls
    missing = [
        name
        for name in calls
        if not name.startswith("_") and not hasattr(l3_admission.KeyTier, name)
    ]
    assert not missing, f"KeyTier lacks {missing}"
