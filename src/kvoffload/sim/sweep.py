"""Many independent runs over capacities x policies x thresholds, in parallel processes.

Each configuration is a separate process-pool task that builds its own copy
of the workload from a :class:`WorkloadSource`; the Belady bound depends only
on the capacities, so it is computed once per offload capacity and attached
to every run with that capacity.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, as_completed

from kvoffload.core.errors import InvalidArgumentError
from kvoffload.sim.belady import BeladyResult, belady_bound
from kvoffload.sim.run import RunReport, SimConfig, simulate
from kvoffload.sim.sources import WorkloadSource
from kvoffload.sim.workload import Workload

Task = tuple[WorkloadSource, SimConfig, bool]
"""(workload, configuration, whether this task computes the bound instead of a run)."""


@functools.lru_cache(maxsize=1)
def _workload(source: WorkloadSource) -> Workload:
    return source.load()


def _run_task(task: Task) -> RunReport | BeladyResult:
    source, config, is_bound = task
    workload = _workload(source)
    if is_bound:
        return belady_bound(workload.requests, config.gpu_blocks, config.cpu_blocks)
    return simulate(workload, config)


def sweep_configs(
    base: SimConfig,
    cpu_blocks: Sequence[int],
    policies: Sequence[str],
    thresholds: Sequence[int],
    admissions: Sequence[str] = ("none",),
) -> list[SimConfig]:
    """Every combination, in (admission, policy, threshold, capacity) order, without bounds."""
    if not cpu_blocks or not policies or not thresholds or not admissions:
        raise InvalidArgumentError(
            "a sweep needs at least one capacity, policy, threshold and admission"
        )
    return [
        dataclasses.replace(
            base,
            cpu_blocks=blocks,
            policy=policy,
            store_threshold=threshold,
            bound=False,
            admission=admission,
        )
        for admission in admissions
        for policy in policies
        for threshold in thresholds
        for blocks in cpu_blocks
    ]


def run_sweep(
    source: WorkloadSource,
    configs: Sequence[SimConfig],
    jobs: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> list[RunReport]:
    """Run ``configs`` on ``jobs`` processes (1: in this process); reports keep ``configs`` order.

    Every report gains the Belady bound of its offload capacity.
    """
    if jobs < 1:
        raise InvalidArgumentError(f"jobs must be >= 1, got {jobs}")
    capacities = sorted({c.cpu_blocks for c in configs})
    tasks: list[Task] = [(source, c, False) for c in configs]
    tasks += [(source, dataclasses.replace(configs[0], cpu_blocks=c), True) for c in capacities]
    results: list[RunReport | BeladyResult | None] = [None] * len(tasks)
    if jobs == 1:
        try:
            for index, task in enumerate(tasks):
                results[index] = _run_task(task)
                if progress is not None:
                    progress(index + 1, len(tasks))
        finally:
            _workload.cache_clear()
    else:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            _collect(pool, tasks, results, progress)
    bounds = dict(zip(capacities, results[len(configs) :], strict=True))
    reports = []
    for report in results[: len(configs)]:
        if not isinstance(report, RunReport):
            raise TypeError(f"a sweep run returned {report!r}")
        bound = bounds[report.cpu_blocks]
        if not isinstance(bound, BeladyResult):
            raise TypeError(f"a bound task returned {bound!r}")
        reports.append(
            dataclasses.replace(
                report,
                belady_total_hit_ratio=bound.total_hit_ratio,
                belady_offload_hit_ratio=bound.offload_hit_ratio,
            )
        )
    return reports


def _collect(
    pool: Executor,
    tasks: Sequence[Task],
    results: list[RunReport | BeladyResult | None],
    progress: Callable[[int, int], None] | None,
) -> None:
    futures: dict[Future[RunReport | BeladyResult], int] = {
        pool.submit(_run_task, task): index for index, task in enumerate(tasks)
    }
    for done, future in enumerate(as_completed(futures), start=1):
        results[futures[future]] = future.result()
        if progress is not None:
            progress(done, len(tasks))
