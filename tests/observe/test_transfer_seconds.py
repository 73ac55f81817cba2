"""``kvoffload_transfer_seconds``: its sum is the seconds the copies took, not their count."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

torch = pytest.importorskip("torch")

from kvoffload.core.layout import KVLayout  # noqa: E402
from kvoffload.core.specs import CPULoadStoreSpec, GPULoadStoreSpec  # noqa: E402
from kvoffload.dataplane import CPUBlockStore, PagedKVCache, cpu_gpu_handlers  # noqa: E402
from kvoffload.observe.counters import LATENCY_BUCKETS, LatencyHistogram  # noqa: E402
from kvoffload.observe.metrics import TransferCollector  # noqa: E402
from kvoffload.observe.transfers import ObservedWorker  # noqa: E402


def test_the_sum_is_the_seconds_of_the_jobs_results() -> None:
    layout = KVLayout(num_layers=2, kv_heads=2, head_dim=16, dtype="float16", tokens_per_block=4)
    layers = PagedKVCache(layout, 8).layers
    (_, _, to_cpu), (_, _, to_gpu) = cpu_gpu_handlers(layers, CPUBlockStore(layout, 8))
    to_gpu.close()
    observed = ObservedWorker(to_cpu)
    registry = CollectorRegistry()
    registry.register(TransferCollector(observed.latency))
    jobs = range(1, 6)
    for job in jobs:
        observed.transfer_async(job, (GPULoadStoreSpec([job], [1]), CPULoadStoreSpec([job])))
    observed.wait(set(jobs))
    results = observed.get_finished()
    assert sorted(r.job_id for r in results) == list(jobs)
    seconds = sum(r.transfer_time for r in results)
    labels = {"direction": "store"}
    total = registry.get_sample_value("kvoffload_transfer_seconds_sum", labels)
    count = registry.get_sample_value("kvoffload_transfer_seconds_count", labels)
    assert count == len(jobs)
    assert total == pytest.approx(seconds) and seconds > 0
    assert total != count  # the copies of five small blocks take far less than 5 s
    observed.close()


class _Watched(list[int]):
    """Bucket counts that check, at every single increment, what a scrape from another
    thread could read at that moment."""

    def __init__(self, size: int) -> None:
        super().__init__([0] * size)
        self.histogram: LatencyHistogram | None = None
        self.steps = 0

    def __setitem__(self, index: Any, value: Any) -> None:
        super().__setitem__(index, value)
        self.steps += 1
        assert self.histogram is not None
        assert all(a <= b for a, b in itertools.pairwise(self)), list(self)
        assert self[-1] <= self.histogram.count


@pytest.mark.parametrize("value", [0.0, 5e-5, 3e-3, 0.07, 5.0, 9.0])
def test_a_scrape_between_any_two_steps_of_observe_reads_cumulative_buckets(
    value: float,
) -> None:
    watched = _Watched(len(LATENCY_BUCKETS))
    histogram = LatencyHistogram(counts=watched)
    watched.histogram = histogram
    for _ in range(3):
        histogram.observe(value)
    within = sum(1 for bound in LATENCY_BUCKETS if value <= bound)
    assert watched.steps == 3 * within
    assert list(watched) == [3 if value <= bound else 0 for bound in LATENCY_BUCKETS]
    assert (histogram.count, histogram.total) == (3, pytest.approx(3 * value))
