"""The admission optimiser: which rule it follows, how fast it turns, how close its what-ifs are.

Workloads are small seeded generator runs replayed through the serving engine
model (sequential), with tiers under 2,048 blocks so every key is sampled,
except where sampling itself is under test.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvoffload import CPUOffloadingManager, InvalidArgumentError, OffloadKey, block_id_key
from kvoffload.admission import MiniSimulation, MiniTier, Objective, OptimisingAdmission
from kvoffload.admission.budget import BURST_REFS as BUDGET_BURST_REFS
from kvoffload.admission.budget import check_write_budget
from kvoffload.admission.minisim import sampling_bits
from kvoffload.admission.optimiser import FEEDBACK, FILTER, STORE_ALL, OptimiserParams
from kvoffload.managers import build_manager
from kvoffload.policies.lru import LRUCachePolicy
from kvoffload.sim.engine import EngineConfig, ServingEngine
from kvoffload.sim.generators import generate
from kvoffload.sim.workload import Request, Workload

LONGCHAT = {"longchat": 1.0}
ONE_SHOT_HEAVY = {"oneshot": 0.8, "rag": 0.2}


def replay(
    workload: Workload, capacity: int, **kwargs: object
) -> tuple[float, float, OptimisingAdmission | None]:
    """Total hit ratio and writes per reference of one run, and its optimiser if any."""
    manager = build_manager(capacity, "lru", **kwargs)  # type: ignore[arg-type]
    gpu = 2 * max(len(r.keys) for r in workload.requests)
    engine = ServingEngine(EngineConfig(gpu, 1, workload.block_tokens), manager)
    stats = engine.run(workload.requests)
    layer = manager if isinstance(manager, OptimisingAdmission) else None
    return (
        (stats.gpu_hit_blocks + stats.offload_hit_blocks) / stats.refs,
        (stats.stored_blocks / stats.refs),
        layer,
    )


def longchat(requests: int = 1500) -> Workload:
    return generate(LONGCHAT, num_requests=requests, seed=0, block_tokens=512, rate=0.3)


def one_shot_heavy(requests: int = 1500) -> Workload:
    return generate(ONE_SHOT_HEAVY, num_requests=requests, seed=0, block_tokens=256, rate=3.0)


def test_follows_store_everything_on_chat_like_traffic() -> None:
    workload = longchat()
    everything, everything_writes, _ = replay(workload, 2000)
    feedback, _, _ = replay(workload, 2000, admission="feedback")
    hit, writes, layer = replay(workload, 2000, admission="recommended")
    assert layer is not None and layer.chosen == STORE_ALL
    assert everything - feedback > 0.05  # the case the feedback layer alone loses
    assert hit >= everything - 0.005
    assert writes <= everything_writes


def test_follows_the_filter_on_a_one_shot_heavy_mix() -> None:
    workload = one_shot_heavy()
    everything, everything_writes, _ = replay(workload, 300)
    filtered, _, _ = replay(workload, 300, store_threshold=2)
    hit, writes, layer = replay(workload, 300, admission="recommended")
    assert layer is not None and layer.chosen == FILTER
    assert filtered - everything > 0.05
    assert hit >= filtered - 0.005
    assert writes < 0.2 * everything_writes


def shifted(workload: Workload, tag: bytes, start_s: float) -> list[Request]:
    """``workload``'s requests with keys of their own and arrivals from ``start_s``."""
    return [
        Request(
            start_s + r.arrival_s,
            r.input_tokens,
            r.output_tokens,
            [OffloadKey(tag + key) for key in r.keys],
        )
        for r in workload.requests
    ]


def test_switches_within_a_bounded_number_of_references_after_the_traffic_changes() -> None:
    first = longchat(800)
    second = one_shot_heavy(3000)
    change_s = first.requests[-1].arrival_s + 1.0
    requests = shifted(first, b"a", 0.0) + shifted(second, b"b", change_s)
    capacity, window_tiers = 1000, 4.0
    cpu = CPUOffloadingManager(capacity)
    layer = OptimisingAdmission(cpu, capacity, window_tiers=window_tiers)
    engine = ServingEngine(EngineConfig(2 * max(len(r.keys) for r in requests), 1, 512), layer)
    engine.run(requests[: len(first.requests)])
    assert layer.chosen == STORE_ALL
    refs_at_change = engine.stats.refs
    switched_after: int | None = None
    for request in requests[len(first.requests) :]:
        engine.run([request])
        if layer.chosen != STORE_ALL:
            switched_after = engine.stats.refs - refs_at_change
            break
    # Bounded by the evidence window: the old traffic's counts halve every window.
    bound = 3 * window_tiers * capacity
    assert switched_after is not None and switched_after <= bound
    assert layer.chosen in (FILTER, FEEDBACK)


def _first_choice_at(
    layer: OptimisingAdmission, engine: ServingEngine, requests: list[Request]
) -> float:
    """Sampled references the layer had seen when it first left its starting rule."""
    for request in requests:
        engine.run([request])
        if layer.switches:
            return layer.minisim.seen
    raise AssertionError("the layer never switched")


def test_the_warm_up_is_a_parameter() -> None:
    """No switch before ``warmup_tiers + settle_tiers`` 1x mini-tier-fulls of sampled
    references; a shorter warm-up leaves the starting rule sooner on traffic where the
    filter wins."""
    capacity = 300
    workload = one_shot_heavy(1500)
    longest = max(len(r.keys) for r in workload.requests)
    first: dict[float, float] = {}
    for warmup, settle in ((0.0, 0.0), (2.0, 0.5), (4.0, 1.0)):
        layer = OptimisingAdmission(
            CPUOffloadingManager(capacity),
            capacity,
            params=OptimiserParams(warmup_tiers=warmup, settle_tiers=settle),
        )
        engine = ServingEngine(EngineConfig(2 * longest, 1, workload.block_tokens), layer)
        first[warmup + settle] = _first_choice_at(layer, engine, workload.requests)
        assert layer.minisim.bits == 0
        assert first[warmup + settle] >= (warmup + settle) * capacity
    assert first[0.0] < min(first[2.5], first[5.0])


def test_the_dwell_after_a_switch_is_a_parameter() -> None:
    """With a dwell longer than the run, the choice made on long chat survives the change
    to one-shot traffic that makes the default dwell switch again."""
    first, second = longchat(800), one_shot_heavy(3000)
    change_s = first.requests[-1].arrival_s + 1.0
    requests = shifted(first, b"a", 0.0) + shifted(second, b"b", change_s)
    gpu = 2 * max(len(r.keys) for r in requests)
    switches = {}
    for dwell in (2.0, 1000.0):
        capacity = 1000
        layer = OptimisingAdmission(
            CPUOffloadingManager(capacity),
            capacity,
            window_tiers=4.0,
            params=OptimiserParams(dwell_tiers=dwell),
        )
        ServingEngine(EngineConfig(gpu, 1, 512), layer).run(requests)
        switches[dwell] = (layer.switches, layer.chosen)
    assert switches[1000.0] == (1, STORE_ALL)
    assert switches[2.0][0] >= 2 and switches[2.0][1] in (FILTER, FEEDBACK)


@pytest.mark.parametrize(
    ("mix", "block_tokens", "rate"),
    [(LONGCHAT, 512, 0.3), (ONE_SHOT_HEAVY, 256, 3.0), ({"chat": 0.6, "rag": 0.4}, 64, 4.0)],
)
def test_what_if_figures_match_full_runs(
    mix: dict[str, float], block_tokens: int, rate: float
) -> None:
    """Store-everything and the filter do not depend on the tier they write to, so their
    mini-tiers match full runs of those sizes: within 0.01 hit ratio and 0.02 writes per
    reference with every key sampled (here 0.5x and 1x), 0.04 and 0.06 at 1 in 8 or more
    often (the what-if tiers of 2x and 4x)."""
    workload = generate(mix, num_requests=800, seed=3, block_tokens=block_tokens, rate=rate)
    capacity = 600
    _, _, layer = replay(workload, capacity, admission="recommended")
    assert layer is not None and layer.minisim.bits == 0
    figures = {(f.candidate, f.capacity_factor): f for f in layer.minisim.figures(True)}
    for factor in (0.5, 1.0, 2.0, 4.0):
        size = int(capacity * factor)
        for name, kwargs in ((STORE_ALL, {}), (FILTER, {"store_threshold": 2})):
            hit, writes, _ = replay(workload, size, **kwargs)
            figure = figures[name, factor]
            exact = figure.sampling_rate == 1.0
            assert exact == (factor <= 1) and figure.sampling_rate >= 1 / 8
            assert figure.hit_ratio == pytest.approx(hit, abs=0.01 if exact else 0.04)
            assert figure.writes_per_ref == pytest.approx(writes, abs=0.02 if exact else 0.06)


def test_sampled_what_if_figures_stay_close_to_full_runs() -> None:
    """At a sampling rate of 1 in 4 the 1x store-everything figure is within 0.02."""
    workload = generate(
        {"chat": 0.7, "rag": 0.3}, num_requests=1000, seed=5, block_tokens=16, rate=4.0
    )
    capacity = 4200
    assert sampling_bits(capacity) == 2
    hit, writes, layer = replay(workload, capacity, admission="recommended")
    assert layer is not None
    everything, everything_writes, _ = replay(workload, capacity)
    figures = {(f.candidate, f.capacity_factor): f for f in layer.minisim.figures(True)}
    assert figures[STORE_ALL, 1.0].sampling_rate == 0.25
    assert figures[STORE_ALL, 1.0].hit_ratio == pytest.approx(everything, abs=0.02)
    assert figures[STORE_ALL, 1.0].writes_per_ref == pytest.approx(everything_writes, abs=0.04)
    assert writes <= everything_writes and hit > 0


def test_objective_hits_first_then_fewer_writes_and_never_above_store_everything() -> None:
    objective = Objective(hit_tolerance=0.002, switch_margin=0.003, write_margin=0.1)
    scores = {STORE_ALL: (0.30, 0.60), FILTER: (0.299, 0.10), FEEDBACK: (0.25, 0.05)}
    assert objective.choose(scores, STORE_ALL) == FILTER  # tied on hits, far fewer writes
    scores = {STORE_ALL: (0.30, 0.60), FILTER: (0.29, 0.10), FEEDBACK: (0.25, 0.05)}
    assert objective.choose(scores, FEEDBACK) == STORE_ALL  # hits first
    assert objective.choose(scores, FILTER) == STORE_ALL
    # Hysteresis: the current rule stays while within tolerance plus margin.
    scores = {STORE_ALL: (0.300, 0.60), FILTER: (0.296, 0.10), FEEDBACK: (0.25, 0.05)}
    assert objective.choose(scores, FILTER) == FILTER
    # A rule writing more than store-everything is never chosen, whatever its hits.
    scores = {STORE_ALL: (0.30, 0.60), FILTER: (0.20, 0.10), FEEDBACK: (0.40, 0.70)}
    assert objective.choose(scores, FEEDBACK) == STORE_ALL
    budgeted = replace(objective, write_budget=0.2)
    assert budgeted.choose({**scores, FEEDBACK: (0.25, 0.30)}, STORE_ALL) == FILTER
    assert budgeted.choose({STORE_ALL: (0.3, 0.6), FILTER: (0.2, 0.25)}, STORE_ALL) == FILTER


def test_mini_tier_counts_a_hit_only_in_the_leading_run_and_not_behind_a_gap() -> None:
    tier = MiniTier(4, LRUCachePolicy)
    a, b, c, d = (block_id_key(i) for i in range(4))
    assert tier.store([a, b, c], [False, False, True]) == 3  # c follows a block left out
    assert tier.hit_run([a, b, c, d]) == 2
    assert tier.store([c]) == 0  # stored again without a gap: revived, not rewritten
    assert tier.hit_run([a, b, c, d]) == 3
    assert tier.hit_run([d, a]) == 0
    assert tier.writes == 3 and tier.hits == 5


def test_mini_simulation_checks_its_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="include 1"):
        MiniSimulation(100, LRUCachePolicy, [STORE_ALL], (0.5, 2.0))
    with pytest.raises(InvalidArgumentError, match="window_tiers"):
        MiniSimulation(100, LRUCachePolicy, [STORE_ALL], window_tiers=0.0)
    assert sampling_bits(100_000) == 6 and sampling_bits(1000) == 0
    assert sampling_bits(10**9) == 8


@pytest.mark.parametrize("budget", [float("nan"), -0.1, float("inf"), "0.5", True])
def test_write_budget_errors(budget: object) -> None:
    with pytest.raises(InvalidArgumentError, match="write budget"):
        check_write_budget(budget)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="write budget"):
        OptimisingAdmission(CPUOffloadingManager(8), 8, write_budget=budget)  # type: ignore[arg-type]


@pytest.mark.parametrize("budget", [0.02, 0.1, 0.3])
def test_a_write_budget_is_never_exceeded_over_any_window(budget: float) -> None:
    """Writes up to any point stay within the budget's references; over any span they exceed
    it by at most the burst the layer allows (``BUDGET_BURST_REFS`` references' worth)."""
    workload = longchat(600)
    capacity = 1000
    layer = OptimisingAdmission(CPUOffloadingManager(capacity), capacity, write_budget=budget)
    engine = ServingEngine(
        EngineConfig(2 * max(len(r.keys) for r in workload.requests), 1, 512), layer
    )
    refs, writes = [0], [0]
    for request in workload.requests:
        engine.run([request])
        refs.append(engine.stats.refs)
        writes.append(engine.stats.stored_blocks)
    burst = budget * BUDGET_BURST_REFS
    for end in range(1, len(refs)):
        assert writes[end] <= budget * refs[end] + 1e-9
        for start in range(max(0, end - 40), end):
            span = refs[end] - refs[start]
            assert writes[end] - writes[start] <= budget * span + burst + 1e-9
    if budget < 0.05:  # below every candidate's writes: the budget is used, not just kept
        assert writes[-1] >= 0.5 * budget * refs[-1]


def test_a_budget_above_every_candidate_changes_nothing() -> None:
    workload = one_shot_heavy(800)
    free = replay(workload, 300, admission="recommended")[:2]
    assert replay(workload, 300, admission="recommended", write_budget=1.0)[:2] == free
    with pytest.raises(InvalidArgumentError, match="needs admission 'recommended'"):
        build_manager(300, admission="feedback", write_budget=0.5)


def test_stats_numbers_are_the_numeric_counters_only() -> None:
    """Engines put ``numbers()`` into float-only stats dictionaries (SGLang's, vLLM's)."""
    workload = longchat()
    _, _, layer = replay(workload, 2000, admission="recommended")
    assert layer is not None
    stats = layer.stats()
    assert stats.candidate and stats.whatif
    numbers = stats.numbers()
    assert all(isinstance(value, float) for value in numbers.values())
    assert numbers["offers"] == stats.offers and numbers["admitted"] == stats.admitted
    assert numbers["rejected"] == stats.rejected and numbers["control"] == stats.control
    assert numbers["memory_bytes"] == stats.memory_bytes > 0
