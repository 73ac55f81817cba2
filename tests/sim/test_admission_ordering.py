"""The recommended admission's claimed ordering, on small seeded workloads, same engine, same run.

Store-everything is LRU without a filter, the seed filter is LRU with store
threshold 2; the recommended configuration is ``--admission recommended
--policy recommended``. The tier holds 10% of each workload's unique blocks
unless a test says otherwise.
"""

from __future__ import annotations

from kvoffload.core.keys import OffloadKey
from kvoffload.sim.generators import generate
from kvoffload.sim.run import RunReport, SimConfig, simulate
from kvoffload.sim.workload import Request, Workload


def unique_blocks(workload: Workload) -> int:
    return len({key for request in workload.requests for key in request.keys})


def run_three(workload: Workload, share: float = 0.1) -> tuple[RunReport, RunReport, RunReport]:
    """Store-everything, the seed filter and the recommended configuration."""
    unique = unique_blocks(workload)
    gpu = max(max(len(r.keys) for r in workload.requests), unique // 50)
    base = SimConfig(gpu_blocks=gpu, cpu_blocks=max(1, int(unique * share)), bound=False)
    everything = simulate(workload, base)
    seed = simulate(workload, SimConfig(**{**base.__dict__, "store_threshold": 2}))
    ours = simulate(
        workload,
        SimConfig(**{**base.__dict__, "admission": "recommended", "policy": "recommended"}),
    )
    return everything, seed, ours


def tagged(workload: Workload, tag: int, start_s: float) -> list[Request]:
    """The requests of ``workload`` with keys of their own and arrivals shifted to ``start_s``."""
    prefix = bytes([tag])
    return [
        Request(
            start_s + r.arrival_s,
            r.input_tokens,
            r.output_tokens,
            [OffloadKey(prefix + key) for key in r.keys],
        )
        for r in workload.requests
    ]


def test_on_a_one_shot_scan_it_writes_as_store_everything_unless_a_budget_caps_it() -> None:
    """No block is ever read again, so no world hits and no rule's saving of writes has
    been measured: store-everything is followed (a rule that writes less would lose every
    hit a later reuse brings), never writing more; a write budget caps the writes."""
    workload = generate({"oneshot": 1.0}, num_requests=300, seed=1)
    everything, _, ours = run_three(workload)
    assert everything.writes_per_ref > 0.9
    assert ours.admission == "optimiser" and ours.policy == "lru"
    assert ours.writes_per_ref <= everything.writes_per_ref
    assert ours.writes_per_ref > 0.9 * everything.writes_per_ref
    unique = unique_blocks(workload)
    budgeted = simulate(
        workload,
        SimConfig(
            gpu_blocks=max(max(len(r.keys) for r in workload.requests), unique // 50),
            cpu_blocks=int(unique * 0.1),
            bound=False,
            admission="recommended",
            policy="recommended",
            write_budget=0.1,
        ),
    )
    assert budgeted.writes_per_ref <= 0.1 + 0.01
    assert budgeted.admission_rejected > 0.8 * budgeted.admission_offers


def test_on_chat_it_beats_the_seed_filters_hit_ratio_writing_no_more_than_storing_all() -> None:
    everything, seed, ours = run_three(generate({"chat": 1.0}, num_requests=600, seed=2), 0.25)
    assert seed.total_hit_ratio < everything.total_hit_ratio - 0.03  # the filter's weakness
    assert ours.total_hit_ratio > seed.total_hit_ratio + 0.03
    assert ours.total_hit_ratio >= everything.total_hit_ratio - 0.01
    assert ours.writes_per_ref <= everything.writes_per_ref


def test_on_alternating_traffic_it_follows_the_better_setting() -> None:
    phases: list[Request] = []
    for phase in range(4):
        kind = "chat" if phase % 2 == 0 else "oneshot"
        part = generate({kind: 1.0}, num_requests=300, seed=10 + phase)
        start = phases[-1].arrival_s + 1.0 if phases else 0.0
        phases += tagged(part, phase, start)
    everything, seed, ours = run_three(Workload("alternating", 16, phases))
    # Chat phases want store-everything's hit ratio, one-shot phases the filter's writes.
    assert ours.total_hit_ratio > seed.total_hit_ratio + 0.01
    assert ours.total_hit_ratio >= everything.total_hit_ratio - 0.01
    assert ours.writes_per_ref <= everything.writes_per_ref


def test_on_a_mix_of_applications_it_beats_both_settings() -> None:
    """Chat, RAG, agent and one-shot traffic in one stream: each application's first-seen
    blocks are judged on its own returns (pooled, the mix lost to store-everything)."""
    margins = []
    for seed in (5, 6, 7):
        everything, seed_filter, ours = run_three(generate(None, num_requests=1000, seed=seed))
        better = max(everything.total_hit_ratio, seed_filter.total_hit_ratio)
        margins.append(ours.total_hit_ratio - better)
        assert ours.writes_per_ref < 0.75 * everything.writes_per_ref
    assert sum(margins) / len(margins) > 0.005


def test_overlapping_requests_and_the_seed_filter_stacked_keep_the_counts_consistent() -> None:
    workload = generate(None, num_requests=300, seed=4)
    unique = unique_blocks(workload)
    gpu = max(max(len(r.keys) for r in workload.requests), unique // 50)
    for threshold in (0, 2):
        config = SimConfig(
            gpu_blocks=gpu,
            cpu_blocks=unique // 10,
            concurrency=8,
            store_threshold=threshold,
            admission="recommended",
            bound=False,
        )
        report = simulate(workload, config)
        assert report.admission_offers == report.admission_admitted + report.admission_rejected
        assert report.offload_blocks_written <= report.admission_admitted
        assert report.stores_failed == report.loads_failed == 0
        if threshold == 0:
            assert report.admission_offers == report.stores_offered
        else:  # the filter in front only passes on what it lets through
            assert report.admission_offers <= report.stores_offered


def test_the_seed_filter_alone_reports_its_offers_and_refusals() -> None:
    """``--admission filter`` (or a store threshold alone) is no admission layer, yet its
    report says what it was offered, let through and held back (it said 0, 0, 0)."""
    workload = generate(None, num_requests=300, seed=4)
    for extra in ({"admission": "filter"}, {"store_threshold": 2}):
        config = SimConfig(gpu_blocks=2000, cpu_blocks=2000, bound=False, **extra)  # type: ignore[arg-type]
        report = simulate(workload, config)
        assert report.admission_offers == report.stores_offered > 0
        assert report.admission_rejected == report.stores_skipped_by_admission > 0
        assert report.admission_admitted == report.admission_offers - report.admission_rejected
    unfiltered = simulate(workload, SimConfig(gpu_blocks=2000, cpu_blocks=2000, bound=False))
    assert unfiltered.admission_offers == 0
