"""Overlapping requests: real pending stores and pinned loads, and safe use of GPU slots."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest
from pin_probe import PinProbe

from kvoffload.core.keys import OffloadKey
from kvoffload.core.manager import OffloadingManager, PrepareStoreOutput
from kvoffload.core.specs import BlockIDsLoadStoreSpec, LoadStoreSpec
from kvoffload.managers import build_manager
from kvoffload.sim.engine import EngineConfig, EngineStats, ServingEngine
from kvoffload.sim.generators import generate

GPU_BLOCKS = 1200


class CheckingBackend:
    """Models block contents to check the engine never reads or overwrites a busy slot."""

    def __init__(self) -> None:
        self.gpu: dict[int, OffloadKey] = {}
        self.cpu: dict[int, OffloadKey] = {}
        self.busy: dict[int, int] = {}
        self.jobs: dict[int, tuple[str, list[OffloadKey], list[int], list[int]]] = {}
        self.finished: set[int] = set()
        self.closed = 0

    def _claim(self, job_id: int, slots: Sequence[int]) -> None:
        for slot in slots:
            assert 0 <= slot < GPU_BLOCKS
            assert slot not in self.busy, f"slot {slot} reused while job {self.busy.get(slot)} runs"
            self.busy[slot] = job_id

    def compute(self, keys: Sequence[OffloadKey], gpu_block_ids: Sequence[int]) -> None:
        for key, slot in zip(keys, gpu_block_ids, strict=True):
            assert 0 <= slot < GPU_BLOCKS and slot not in self.busy
            self.gpu[slot] = key

    def submit_store(
        self,
        job_id: int,
        keys: Sequence[OffloadKey],
        gpu_block_ids: Sequence[int],
        dst: LoadStoreSpec,
    ) -> None:
        for key, slot in zip(keys, gpu_block_ids, strict=True):
            assert self.gpu.get(slot) == key, "stored a slot that does not hold the block"
        self._claim(job_id, gpu_block_ids)
        assert isinstance(dst, BlockIDsLoadStoreSpec)
        self.jobs[job_id] = ("store", list(keys), list(gpu_block_ids), dst.block_ids.tolist())

    def submit_load(
        self,
        job_id: int,
        keys: Sequence[OffloadKey],
        src: LoadStoreSpec,
        gpu_block_ids: Sequence[int],
    ) -> None:
        assert isinstance(src, BlockIDsLoadStoreSpec)
        for key, cpu_slot in zip(keys, src.block_ids.tolist(), strict=True):
            assert self.cpu.get(cpu_slot) == key, "loaded a CPU slot that does not hold the block"
        self._claim(job_id, gpu_block_ids)
        self.jobs[job_id] = ("load", list(keys), list(gpu_block_ids), src.block_ids.tolist())

    def finish(self, job_id: int) -> bool:
        assert job_id not in self.finished
        self.finished.add(job_id)
        kind, keys, gpu_slots, cpu_slots = self.jobs.pop(job_id)
        for slot in gpu_slots:
            del self.busy[slot]
        for key, gpu_slot, cpu_slot in zip(keys, gpu_slots, cpu_slots, strict=True):
            if kind == "store":
                self.cpu[cpu_slot] = key
            else:
                self.gpu[gpu_slot] = key
        return True

    def close(self) -> None:
        self.closed += 1


class OverlapProbe(PinProbe):
    """Counts calls made while other stores are pending or loads pinned."""

    def __init__(self, inner: OffloadingManager) -> None:
        super().__init__(inner)
        self.stores_while_pinned = 0
        self.lookups_while_pending = 0

    def lookup(self, keys: Iterable[OffloadKey]) -> int | None:
        self.lookups_while_pending += bool(self.pending)
        return super().lookup(keys)

    def prepare_store(self, keys: Iterable[OffloadKey]) -> PrepareStoreOutput | None:
        self.stores_while_pinned += self.pinned > 0
        return super().prepare_store(keys)


def run(
    concurrency: int, cpu_blocks: int = 4000, bandwidth: float = 2e9
) -> tuple[EngineStats, OverlapProbe, CheckingBackend]:
    workload = generate({"agent": 2, "chat": 1}, num_requests=300, seed=5, rate=20.0)
    probe = OverlapProbe(build_manager(cpu_blocks))
    backend = CheckingBackend()
    config = EngineConfig(
        gpu_blocks=GPU_BLOCKS,
        bytes_per_block=2 << 20,
        block_tokens=16,
        concurrency=concurrency,
        transfer_bytes_per_s=bandwidth,
    )
    stats = ServingEngine(config, probe, backend).run(workload.requests)
    return stats, probe, backend


@pytest.mark.parametrize("concurrency", [1, 8])
def test_gpu_slots_never_reused_while_a_transfer_uses_them(concurrency: int) -> None:
    stats, probe, backend = run(concurrency)
    assert stats.requests == 300
    assert not backend.jobs and not backend.busy and backend.closed == 1
    assert probe.pinned == 0 and not probe.pending
    assert stats.offload_hit_blocks > 0


def test_sequential_replay_has_no_overlap() -> None:
    _, probe, _ = run(1)
    assert probe.lookups_while_pending == 0
    assert probe.stores_while_pinned == 0


def test_concurrent_replay_meets_pending_stores_and_pinned_loads() -> None:
    stats, probe, _ = run(8)
    assert probe.lookups_while_pending > 0
    assert probe.stores_while_pinned > 0
    assert stats.peak_pending_store_blocks > 0 and stats.peak_pinned_blocks > 0
    assert stats.simulated_seconds < run(1)[0].simulated_seconds


def test_a_small_tier_rejects_stores_only_under_concurrency() -> None:
    """Pending and pinned blocks cannot be evicted, so overlapping stores can find no room."""
    sequential, _, _ = run(1, cpu_blocks=600, bandwidth=5e8)
    concurrent, _, _ = run(8, cpu_blocks=600, bandwidth=5e8)
    assert sequential.stores_rejected == 0
    assert concurrent.stores_rejected > 0
