"""Identities every run must keep, over random small workloads and configurations (the
Belady bound has its own property test in ``test_belady.py``)."""

from __future__ import annotations

from collections.abc import Iterable

from hypothesis import given, settings
from hypothesis import strategies as st
from pin_probe import PinProbe
from tree_workloads import tree_workloads

from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import OffloadingManager, PrepareStoreOutput
from kvoffload.managers.cpu import CPUOffloadingManager
from kvoffload.managers.stack import build_cpu_stack
from kvoffload.sim.engine import EngineStats, ServingEngine
from kvoffload.sim.run import SimConfig, simulate
from kvoffload.sim.workload import Workload


class EventCount(PinProbe):
    """:class:`PinProbe` that also counts the CPU tier's store and removal events."""

    def __init__(self, inner: OffloadingManager, cpu: CPUOffloadingManager) -> None:
        super().__init__(inner)
        self.cpu = cpu
        self.stored = self.removed = 0

    def _take_events(self) -> None:
        for event in self.cpu.take_events():
            if event.removed:
                self.removed += len(event.keys)
            else:
                self.stored += len(event.keys)

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        output = super().prepare_store(keys)
        self._take_events()
        return output

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        super().complete_store(keys, success)
        self._take_events()


def counts(stats: EngineStats) -> dict[str, int]:
    return {name: value for name, value in vars(stats).items() if isinstance(value, int)}


@settings(max_examples=150, deadline=None)
@given(
    workload=tree_workloads(),
    concurrency=st.integers(1, 4),
    spare_gpu=st.integers(0, 5),
    cpu_blocks=st.integers(0, 6),
    policy=st.sampled_from(["lru", "arc", "s3fifo"]),
    admission=st.sampled_from(["none", "recommended"]),
    partial_block=st.sampled_from(["cache", "drop"]),
    link_gb_per_s=st.sampled_from([1e-3, 25.0]),
)
def test_every_run_keeps_the_identities(
    workload: Workload,
    concurrency: int,
    spare_gpu: int,
    cpu_blocks: int,
    policy: str,
    admission: str,
    partial_block: str,
    link_gb_per_s: float,
) -> None:
    longest = max(len(r.keys) for r in workload.requests)
    config = SimConfig(
        max(1, longest + spare_gpu),
        cpu_blocks,
        policy=policy,
        admission=admission,
        concurrency=concurrency,
        partial_block=partial_block,
        layout="tiny",
        prefill_tokens_per_s=1600.0,
        transfer_gb_per_s=link_gb_per_s,
    )
    report = simulate(workload, config)
    refs = sum(len(r.keys) for r in workload.requests)
    assert report.refs == refs and report.requests == len(workload.requests)
    assert report.gpu_hit_blocks + report.offload_hit_blocks + report.computed_blocks == refs
    assert report.offload_blocks_read == report.offload_hit_blocks  # no load fails here
    assert report.stores_offered >= (
        report.offload_blocks_written + report.stores_skipped_by_admission + report.stores_rejected
    )
    for ratio in (report.gpu_hit_ratio, report.offload_hit_ratio, report.total_hit_ratio):
        assert 0 <= ratio <= 1
    assert 0 <= report.writes_per_ref <= 1
    # Loads slower than recomputing make the tier's net saving negative; the GPU's never is.
    saved_by_gpu = report.prefill_seconds_saved - report.prefill_seconds_saved_by_offload
    assert saved_by_gpu >= -1e-12
    assert report.prefill_seconds_saved <= report.prefill_seconds_baseline + 1e-12
    if cpu_blocks == 0:
        assert report.offload_hit_blocks == report.offload_blocks_written == 0
        return
    # The same run again, its tier's events counted: the same figures, writes = stored events.
    stack = build_cpu_stack(
        config.stack_config(enable_events=True, bytes_per_block=report.bytes_per_block)
    )
    probe = EventCount(stack.manager, stack.cpu)
    engine = ServingEngine(
        config.engine_config(16), probe, holds=stack.holds, admission=stack.admission
    )
    stats = engine.run(workload.requests)
    assert (stats.gpu_hit_blocks, stats.offload_hit_blocks) == (
        report.gpu_hit_blocks,
        report.offload_hit_blocks,
    )
    assert stats.stored_blocks == report.offload_blocks_written == probe.stored
    assert stats.offload_evictions == report.offload_evictions == probe.removed
    assert probe.pinned == 0 and not probe.pending
    fresh = build_cpu_stack(config.stack_config())
    again = ServingEngine(
        config.engine_config(16), fresh.manager, holds=fresh.holds, admission=fresh.admission
    )
    assert counts(again.run(workload.requests)) == counts(stats)
