"""The engine model announces request boundaries to the admission layer, and the explicit
boundaries give the decisions the seed-style guessing gave on the same call order."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest

from kvoffload.admission import AdmissionLayer, find_admission, wrap_with_admission
from kvoffload.core.keys import OffloadKey
from kvoffload.managers import CPUOffloadingManager, FilterReusedOffloadingManager
from kvoffload.sim.engine import EngineConfig, ServingEngine
from kvoffload.sim.generators import generate

WORKLOAD = generate(None, num_requests=120, seed=5)
UNIQUE = len({key for request in WORKLOAD.requests for key in request.keys})
CONFIG = EngineConfig(
    gpu_blocks=max(max(len(r.keys) for r in WORKLOAD.requests), UNIQUE // 50),
    bytes_per_block=1 << 16,
    block_tokens=WORKLOAD.block_tokens,
    concurrency=4,
)


def _engine(admission: str, announce: bool = True, seed_filter: bool = False) -> Any:
    manager = wrap_with_admission(admission, CPUOffloadingManager(UNIQUE // 10), UNIQUE // 10)
    if seed_filter:
        manager = FilterReusedOffloadingManager(manager)
    engine = ServingEngine(CONFIG, manager)
    if not announce:  # a bare seed-style driver: the layer falls back to guessing
        engine._layer = None
    return engine, find_admission(manager)


def _record(layer: AdmissionLayer) -> list[tuple[str, int, bool]]:
    calls: list[tuple[str, int, bool]] = []
    begin, end = layer.begin_request, layer.end_request

    def begin_request(keys: Sequence[OffloadKey], **kwargs: Any) -> None:
        calls.append(("begin", len(keys), kwargs.get("lookup_follows", False)))
        begin(keys, **kwargs)

    def end_request(keys: Sequence[OffloadKey]) -> None:
        calls.append(("end", len(keys), False))
        end(keys)

    layer.begin_request = begin_request  # type: ignore[method-assign]
    layer.end_request = end_request  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("seed_filter", [False, True])
def test_every_request_is_begun_before_its_lookup_and_ended_after_its_offer(
    seed_filter: bool,
) -> None:
    engine, layer = _engine("feedback", seed_filter=seed_filter)
    calls = _record(layer)
    stats = engine.run(WORKLOAD.requests)
    begins = [call for call in calls if call[0] == "begin"]
    ends = [call for call in calls if call[0] == "end"]
    assert len(begins) == len(ends) == stats.requests == len(WORKLOAD.requests)
    assert all(follows for _, _, follows in begins)
    assert sorted(n for _, n, _ in begins) == sorted(n for _, n, _ in ends)
    assert layer.announced
    assert not layer._requests._open  # every request was closed by its end


@pytest.mark.parametrize("admission", ["feedback", "sketch", "optimiser"])
def test_explicit_boundaries_decide_as_the_guessed_ones_did(admission: str) -> None:
    """On the engine's call order the fallback guessed every boundary right, so the
    figures measured with it hold; the explicit calls must not change a decision."""
    announced, layer = _engine(admission)
    guessed, fallback = _engine(admission, announce=False)
    explicit = dataclasses.asdict(announced.run(WORKLOAD.requests))
    inferred = dataclasses.asdict(guessed.run(WORKLOAD.requests))
    for stats in (explicit, inferred):
        stats.pop("manager_seconds")
    assert layer.announced and not fallback.announced
    assert explicit == inferred
    assert layer.stats() == fallback.stats()
    assert explicit["stores_skipped_by_admission"] > 0


def test_behind_the_seed_filter_each_request_is_one_sighting() -> None:
    """The filter in front offers the layer a subset of the request; guessed boundaries
    took the touch after such a store for a new request. Announced ones count it once."""
    engine, layer = _engine("sketch", seed_filter=True)
    sightings = [0]
    sighting = layer._sighting

    def counted(keys: Sequence[OffloadKey]) -> None:
        sightings[0] += 1
        sighting(keys)

    layer._sighting = counted  # type: ignore[method-assign]
    stats = engine.run(WORKLOAD.requests)
    assert 0 < layer.offers < stats.store_offered_blocks  # the filter held some back
    assert sightings[0] == stats.requests
