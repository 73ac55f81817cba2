"""Each lower tier's own admission layer: it judges the stores offered to its tier and the
lookups that reach it, writes fewer blocks than writing everything on one-shot traffic, and
keeps to its own write budget."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload import block_id_key
from kvoffload.admission import (
    AdmissionLayer,
    OptimisingAdmission,
    WriteBudget,
    available_admissions,
)
from kvoffload.admission.budget import BURST_REFS as BUDGET_BURST_REFS
from kvoffload.admission.optimiser import tier_policy
from kvoffload.managers import CPUOffloadingManager
from kvoffload.managers.stack import Stack, StackConfig
from kvoffload.managers.tiered import TieredOffloadingManager, TierSettings
from kvoffload.sim.engine import EngineConfig, ServingEngine
from kvoffload.sim.run import SimConfig, simulate
from kvoffload.sim.sources import WorkloadSource
from kvoffload.sim.workload import Request
from kvoffload.tiers import DiskTier, build_stack

ONE_SHOT_HEAVY = WorkloadSource(mix=(("oneshot", 0.7), ("chat", 0.3)), requests=300)


def _disk_run(
    tmp_path: Path, admission: str, source: WorkloadSource = ONE_SHOT_HEAVY
) -> dict[str, object]:
    config = SimConfig(
        gpu_blocks=600,
        cpu_blocks=1000,
        bound=False,
        disk_dir=str(tmp_path / admission),
        disk_blocks=5000,
        disk_admission=admission,
    )
    return simulate(source.load(), config).as_dict()


def test_the_optimiser_keeps_the_disk_tiers_hits_at_no_more_writes(tmp_path: Path) -> None:
    """Hits first: on a one-shot-heavy mix it hits as the better of writing everything and
    the seed filter does, and never writes more than writing everything."""
    every, judged = _disk_run(tmp_path, "none"), _disk_run(tmp_path, "recommended")
    filtered = _disk_run(tmp_path, "filter")
    disk_all, disk_judged = every["tiers"]["disk"], judged["tiers"]["disk"]  # type: ignore[index]
    assert disk_all["admission"] == "none" and disk_judged["admission"] == "optimiser"
    assert disk_all["admitted_blocks"] == disk_all["offered_blocks"] > 0
    better = max(every["total_hit_ratio"], filtered["total_hit_ratio"])  # type: ignore[type-var]
    assert judged["total_hit_ratio"] >= better - 0.003  # type: ignore[operator]
    assert disk_judged["stored_blocks"] <= disk_all["stored_blocks"]
    # Above the disk tier nothing changed: the CPU tier admitted the same way in both runs.
    assert judged["admission"] == every["admission"] == "none"


def test_on_one_shot_traffic_the_disk_tier_stops_writing_once_it_has_chosen(
    tmp_path: Path,
) -> None:
    """Store-everything through the warm-up (no hit says what a refusal costs), then,
    every candidate tied at no hit, the rule that writes least."""
    source = WorkloadSource(mix=(("oneshot", 1.0),), requests=300)
    every = _disk_run(tmp_path, "none", source)["tiers"]["disk"]  # type: ignore[index]
    judged = _disk_run(tmp_path, "recommended", source)["tiers"]["disk"]  # type: ignore[index]
    assert every["stored_blocks"] > 5000  # more than the disk tier holds
    assert judged["stored_blocks"] < 0.5 * every["stored_blocks"]


@pytest.mark.parametrize("budget", [0.02, 0.1])
def test_a_disk_write_budget_holds_over_every_window(tmp_path: Path, budget: float) -> None:
    """Disk writes over any span of requests exceed ``budget`` times the references that
    reached the disk tier in it by at most the burst the layer allows."""
    workload = ONE_SHOT_HEAVY.load()
    config = StackConfig(
        200,
        disk_dir=str(tmp_path),
        disk_blocks=2000,
        disk_admission="recommended",
        disk_write_budget=budget,
        wait_for_tiers=True,
        fingerprint=bytes(16),
    )
    stack = build_stack(config)
    assert stack.tiered is not None and isinstance(stack.disk_admission, OptimisingAdmission)
    tiered, disk = stack.tiered, stack.disk
    assert disk is not None
    longest = max(len(request.keys) for request in workload.requests)
    engine = ServingEngine(
        EngineConfig(longest + 50, 1, workload.block_tokens), stack.manager, holds=stack.holds
    )
    refs, writes = [0], [0]
    try:
        for request in workload.requests:
            engine.run([request])
            disk.poll(wait=True)
            refs.append(tiered.judged_blocks)
            # What the disk wrote: admitted blocks it held already are skipped, not charged.
            writes.append(disk.stats.stored_blocks)
    finally:
        stack.close()
    assert refs[-1] > 0 and writes[-1] > 0
    burst = budget * BUDGET_BURST_REFS
    for start in range(len(refs)):
        for end in range(start + 1, len(refs)):
            spent = writes[end] - writes[start]
            assert spent <= budget * (refs[end] - refs[start]) + burst + 1
    assert writes[-1] <= budget * refs[-1] + 1


FOUR = [block_id_key(i) for i in range(4)]


def three_blocks_on_disk(
    tmp_path: Path, cpu_blocks: int = 8, admission: str = "none", store_threshold: int = 0
) -> tuple[Stack, TieredOffloadingManager]:
    """A stack whose disk tier, behind the feedback rule, holds the first 3 of :data:`FOUR`,
    and its tiered manager (under the CPU tier's ``admission`` and ``store_threshold``)."""
    config = StackConfig(
        cpu_blocks,
        store_threshold=store_threshold,
        admission=admission,
        disk_dir=str(tmp_path),
        disk_blocks=8,
        disk_admission="feedback",
        wait_for_tiers=True,
        fingerprint=bytes(16),
    )
    stack = build_stack(config)
    assert stack.tiered is not None and stack.disk is not None
    stack.disk.write(FOUR[:3], [b""] * 3)
    stack.disk.poll(wait=True)
    return stack, stack.tiered


def test_a_retried_lookup_is_one_reference_to_the_tier(tmp_path: Path) -> None:
    """The retry after ``None`` (the same keys, past the promoted blocks) is not shown to the
    tier's layer again; the same keys asked by a later request are."""
    stack, tiered = three_blocks_on_disk(tmp_path)
    try:
        assert tiered.lookup(FOUR) is None and tiered.judged_blocks == 4
        assert tiered.lookup(FOUR) == 3 and tiered.judged_blocks == 4
        assert tiered.lookup(FOUR) == 3 and tiered.judged_blocks == 5
    finally:
        stack.close()


def test_a_retry_that_starts_elsewhere_is_no_new_reference_either(tmp_path: Path) -> None:
    """vLLM re-matches a parked request's GPU prefix on each try: the retry after ``None``
    may start past blocks the GPU cached meanwhile. Known by its keys' count as well as its
    last key, it was shown to the tier's layer again as a new request."""
    stack, tiered = three_blocks_on_disk(tmp_path)
    try:
        assert tiered.lookup(FOUR) is None and tiered.judged_blocks == 4
        assert tiered.lookup(FOUR[1:]) == 2 and tiered.judged_blocks == 4
    finally:
        stack.close()


def test_the_disk_tiers_optimiser_models_the_disk_tiers_policy(tmp_path: Path) -> None:
    config = StackConfig(
        8,
        disk_dir=str(tmp_path),
        disk_blocks=8,
        disk_policy="arc",
        disk_admission="recommended",
        fingerprint=bytes(16),
    )
    stack = build_stack(config)
    try:
        assert stack.disk is not None and stack.disk_admission is not None
        assert tier_policy(stack.disk_admission.backing).__name__ == "ARCCachePolicy"
    finally:
        stack.close()


@pytest.mark.parametrize(
    ("admission", "budget", "written"), [("none", None, 4), ("recommended", 0.0, 0)]
)
def test_a_write_through_tier_writes_what_its_own_layer_admits(
    tmp_path: Path, admission: str, budget: float | None, written: int
) -> None:
    """Completed CPU stores offered to a write-through tier pass its layer first: a zero
    budget writes none of them, no layer all of them; the CPU tier stores them either way."""
    disk = DiskTier(tmp_path, 8, bytes(16))
    settings = TierSettings(True, admission=admission, write_budget=budget, capacity=8)
    tiered = TieredOffloadingManager(
        CPUOffloadingManager(8), [(disk, settings)], wait_for_tiers=True
    )
    keys = [block_id_key(i) for i in range(4)]
    try:
        assert tiered.lookup(keys) == 0
        assert tiered.prepare_store(keys) is not None
        tiered.complete_store(keys)
        tiered.poll()
        assert tiered.cpu.lookup(keys) == 4
        assert (tiered.offered_blocks, tiered.admitted_blocks) == ([4], [written])
        assert disk.stats.stored_blocks == written
    finally:
        tiered.close()


def test_a_disk_budget_in_bytes_per_second_holds_on_trace_time(tmp_path: Path) -> None:
    """``--disk-write-budget 5MB/s``: the disk tier's writes, in the run's block bytes,
    stay within the rate times the simulated run's duration plus the bank (10 s of budget)."""
    workload = ONE_SHOT_HEAVY.load()
    config = SimConfig(
        gpu_blocks=600,
        cpu_blocks=1000,
        bound=False,
        disk_dir=str(tmp_path / "budget"),
        disk_blocks=5000,
        disk_admission="recommended",
        disk_write_budget=WriteBudget.parse("5MB/s"),
    )
    report = simulate(workload, config).as_dict()
    unlimited = _disk_run(tmp_path, "recommended")
    block_bytes = config.engine_config(workload.block_tokens).bytes_per_block
    seconds = report["simulated_seconds"]
    assert isinstance(seconds, float) and seconds > 0
    written = report["tiers"]["disk"]["admitted_blocks"] * block_bytes  # type: ignore[index]
    assert 0 < written <= 5e6 * (seconds + 10) + block_bytes
    assert written < unlimited["tiers"]["disk"]["admitted_blocks"] * block_bytes  # type: ignore[index]


@pytest.mark.parametrize("name", [name for name in available_admissions() if name != "none"])
def test_every_accepted_disk_admission_is_the_disk_tiers_layer_and_judges_its_writes(
    tmp_path: Path, name: str
) -> None:
    """``--disk-admission NAME`` as the simulator builds it: the disk tier's handle is that
    rule's layer (the seed filter's too, as a book that counts requests), and the disk
    tier writes only what it admits."""
    workload = ONE_SHOT_HEAVY.load()
    config = SimConfig(
        gpu_blocks=600,
        cpu_blocks=200,
        disk_dir=str(tmp_path),
        disk_blocks=2000,
        disk_admission=name,
    )
    stack = build_stack(config.stack_config(bytes(16)))
    layer, tiered = stack.disk_admission, stack.tiered
    assert isinstance(layer, AdmissionLayer) and tiered is not None
    assert tiered.admissions == [layer] and stack.remote_admission is None
    assert stack.admission is None  # the CPU tier's own stays "none"
    longest = max(len(request.keys) for request in workload.requests)
    engine = ServingEngine(
        EngineConfig(longest + 50, 1, workload.block_tokens), stack.manager, holds=stack.holds
    )
    try:
        engine.run(workload.requests)
    finally:
        stack.close()
    assert layer.offers == tiered.offered_blocks[0] > 0
    assert 0 < layer.admitted == tiered.admitted_blocks[0] < layer.offers
    assert layer.stats().offers == layer.offers


def test_a_parked_request_is_one_request_to_the_cpu_tiers_optimiser(tmp_path: Path) -> None:
    """A lookup parked while the disk tier promotes is retried with the same keys: the
    CPU tier's optimiser runs its worlds and earns its write budget on it once, so the
    budget holds on the references the run had (it earned on every retry before)."""
    workload = WorkloadSource(mix=(("chat", 1.0),), requests=300, seed=1).load()
    budget = 0.03
    config = SimConfig(
        gpu_blocks=600,
        cpu_blocks=400,
        bound=False,
        admission="recommended",
        write_budget=budget,
        disk_dir=str(tmp_path),
        disk_blocks=20_000,
    )
    report = simulate(workload, config)
    assert report.lookups_deferred > 0
    assert report.offload_blocks_written <= budget * (report.refs + BUDGET_BURST_REFS)


def test_a_request_gone_while_it_waited_hides_no_later_request_with_its_prompt(
    tmp_path: Path,
) -> None:
    """The record that kept a retry from counting again outlived a request aborted while
    it waited for its promotion: the next request with the prompt was taken for that
    retry and never shown to the tier's layer."""
    stack, tiered = three_blocks_on_disk(tmp_path)
    try:
        assert tiered.lookup(FOUR, request="gone") is None and tiered.judged_blocks == 4
        tiered.request_finished("gone")  # aborted: its retry never comes
        assert tiered.lookup(FOUR, request="next") == 3 and tiered.judged_blocks == 5
    finally:
        stack.close()


@pytest.mark.parametrize(
    ("admission", "store_threshold"),
    [("none", 0), ("feedback", 0), ("none", 2)],
    ids=["bare", "cpu-admission", "reuse-filter"],
)
def test_a_request_out_of_retries_hides_no_later_request_with_its_prompt(
    tmp_path: Path, admission: str, store_threshold: int
) -> None:
    """The engine's request that gives up on its retries (none allowed here) proceeds
    without its promotion; its record as one waiting for a retry outlived it, and the next
    request with the prompt was taken for that retry: the disk tier's layer never saw it.

    The CPU tier's 3 slots take the promotion of :data:`FOUR`'s first 3 blocks, reserved
    for the request that gave up, so nothing else is stored there: the filler (4 other
    blocks) only evicts the prompt from the 4-block GPU cache, and the prompt's next
    request hits the 3 promoted blocks and shows the disk's layer its last one. Whatever
    layers the stack puts over the tiered manager, which pass no request's name on."""
    stack, tiered = three_blocks_on_disk(tmp_path, 3, admission, store_threshold)
    filler = [block_id_key(i) for i in range(10, 14)]
    requests = [
        Request(0.0, 64, 1, FOUR),
        Request(10.0, 64, 1, filler),
        Request(20.0, 64, 1, FOUR),
    ]
    engine_config = EngineConfig(4, 1000, 16, max_lookup_retries=0)
    try:
        stats = ServingEngine(engine_config, stack.manager).run(requests)
    finally:
        stack.close()
    assert stats.lookups_deferred == 1 and stats.offload_hit_blocks == 3
    assert tiered.judged_blocks == 4 + 4 + 1


def test_a_parked_request_whose_retry_looks_nothing_up_hides_no_later_request(
    tmp_path: Path,
) -> None:
    """A parked request whose retry finds its whole prompt in the GPU cache (a longer
    request with its prefix computed it meanwhile) looks nothing up again: no answer ends
    its record as one waiting for a retry, and the prompt's next request was taken for
    that retry, never shown to the disk tier's layer.

    FOUR (0.0 s) starts the promotion of its 3 blocks on disk and parks for 0.1 s; FIVE,
    the same prefix and one block more, starts beside it, loads the 3 promoted blocks,
    computes the other 2 and is done long before the retry, which the GPU then answers
    whole. The filler evicts the GPU cache (its 5 blocks do not fit the 3-slot CPU tier,
    which keeps block 0 and FIVE's last 2); FOUR again (2.0 s) hits block 0 there, parks
    while blocks 1 and 2 come back from disk, and is shown to the layer once, the 3
    blocks past its CPU hit: 4 + 2 + 5 + 3 blocks."""
    stack, tiered = three_blocks_on_disk(tmp_path, cpu_blocks=3)
    five = [block_id_key(i) for i in range(5)]
    filler = [block_id_key(i) for i in range(10, 15)]
    requests = [
        Request(0.0, 64, 1, FOUR),
        Request(0.0, 80, 1, five),
        Request(1.0, 80, 1, filler),
        Request(2.0, 64, 1, FOUR),
    ]
    engine = ServingEngine(
        EngineConfig(5, 1000, 16, concurrency=2, lookup_retry_s=0.1), stack.manager
    )
    try:
        stats = engine.run(requests)
    finally:
        stack.close()
    assert engine.gpu_hits_by_start == [0, 4, 0, 0] and stats.lookups == 5
    assert tiered.judged_blocks == 4 + 2 + 5 + 3
