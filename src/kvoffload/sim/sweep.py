"""Many independent runs over capacities x policies x thresholds, in parallel processes.

Each configuration is a separate process-pool task that builds its own copy
of the workload from a :class:`WorkloadSource`; the Belady bound of sequential
runs depends only on the GPU and offload capacities and the partial block mode,
so it is computed once per such combination and attached to every run with it
(a sweep of :func:`sweep_configs` has one per offload capacity). Overlapping requests
(``concurrency > 1``) give each run its own GPU hits, so each run computes
its own bound.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import signal
from collections.abc import Callable, Sequence

from kvoffload.core.errors import InvalidArgumentError, KVOffloadError
from kvoffload.sim.belady import BeladyResult
from kvoffload.sim.run import RunReport, SimConfig, bound_of, simulate
from kvoffload.sim.sources import WorkloadSource
from kvoffload.sim.workload import Workload

Task = tuple[WorkloadSource, SimConfig, bool]
"""(workload, configuration, whether this task computes the bound instead of a run)."""

BoundKey = tuple[int, int, str]
"""What a sequential run's bound depends on besides the workload: (GPU blocks, offload
blocks, partial block mode)."""


@functools.lru_cache(maxsize=1)
def _workload(source: WorkloadSource) -> Workload:
    return source.load()


def _run_task(task: Task) -> RunReport | BeladyResult:
    source, config, is_bound = task
    return _run_on(_workload(source), config, is_bound)


def _run_on(workload: Workload, config: SimConfig, is_bound: bool) -> RunReport | BeladyResult:
    if is_bound:
        return bound_of(workload, config)
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


class SweepInterrupted(KVOffloadError):
    """Ctrl-C stopped a sweep; ``reports`` holds the runs that had finished, in order."""

    def __init__(self, reports: list[RunReport], total: int) -> None:
        super().__init__(f"sweep interrupted after {len(reports)} of {total} runs")
        self.reports = reports
        self.total = total


def run_sweep(
    source: WorkloadSource,
    configs: Sequence[SimConfig],
    jobs: int = 1,
    progress: Callable[[int, int], None] | None = None,
    loaded: Workload | None = None,
) -> list[RunReport]:
    """Run ``configs`` on ``jobs`` processes (1: in this process); reports keep ``configs`` order.

    ``loaded``, the workload ``source`` gives if the caller has already built it, serves
    the runs in this process: reading a large trace again would double its load time.
    Worker processes (``jobs`` > 1) each build their own from ``source``.

    Every report gains the Belady bound of its capacities and partial block mode (none
    with lower tiers, see :attr:`SimConfig.bounded`). On Ctrl-C,
    pending runs are cancelled, workers stopped at once, and
    :class:`SweepInterrupted` carries the finished runs (without a bound
    where their bound had not finished).
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise InvalidArgumentError(f"jobs must be an integer >= 1, got {jobs!r}")
    if all(c.concurrency == 1 and not c.has_lower_tiers for c in configs):
        bound_configs: dict[BoundKey, SimConfig] = {}
        for config in configs:
            bound_configs.setdefault(_bound_key(config), config)
        bound_keys = sorted(bound_configs)
        tasks: list[Task] = [(source, c, False) for c in configs]
        tasks += [(source, bound_configs[key], True) for key in bound_keys]
    else:  # each run its own bound, or none
        bound_keys = []
        tasks = [(source, dataclasses.replace(c, bound=True), False) for c in configs]
    results: list[RunReport | BeladyResult | None] = [None] * len(tasks)
    try:
        if jobs == 1:
            workload = source.load() if loaded is None else loaded
            for index, (_, config, is_bound) in enumerate(tasks):
                results[index] = _run_on(workload, config, is_bound)
                if progress is not None:
                    progress(index + 1, len(tasks))
        else:
            _run_parallel(tasks, results, jobs, progress)
    except KeyboardInterrupt:
        finished = _with_bounds(results, len(configs), bound_keys)
        raise SweepInterrupted(finished, len(configs)) from None
    reports = _with_bounds(results, len(configs), bound_keys)
    if len(reports) != len(configs):
        raise RuntimeError("a sweep run returned no report")
    return reports


def _bound_key(run: SimConfig | RunReport) -> BoundKey:
    return run.gpu_blocks, run.cpu_blocks, run.partial_block


def _with_bounds(
    results: Sequence[RunReport | BeladyResult | None], num_runs: int, bound_keys: list[BoundKey]
) -> list[RunReport]:
    """The finished runs, each given its bound if that finished too (a run with no bound
    task keeps its own)."""
    bounds = dict(zip(bound_keys, results[num_runs:], strict=True))
    reports = []
    for report in results[:num_runs]:
        if report is None:
            continue
        if not isinstance(report, RunReport):
            raise TypeError(f"a sweep run returned {report!r}")
        key = _bound_key(report)
        if key not in bounds:
            reports.append(report)
            continue
        bound = bounds[key]
        if bound is not None and not isinstance(bound, BeladyResult):
            raise TypeError(f"a bound task returned {bound!r}")
        reports.append(
            dataclasses.replace(
                report,
                belady_total_hit_ratio=None if bound is None else bound.total_hit_ratio,
                belady_offload_hit_ratio=None if bound is None else bound.offload_hit_ratio,
            )
        )
    return reports


def _ignore_sigint() -> None:
    """Workers leave Ctrl-C to the parent, which stops them: no traceback from each."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _indexed_task(item: tuple[int, Task]) -> tuple[int, RunReport | BeladyResult]:
    index, task = item
    return index, _run_task(task)


def _run_parallel(
    tasks: Sequence[Task],
    results: list[RunReport | BeladyResult | None],
    jobs: int,
    progress: Callable[[int, int], None] | None,
) -> None:
    context = multiprocessing.get_context("spawn")
    pool = context.Pool(min(jobs, len(tasks)), initializer=_ignore_sigint)
    try:
        finished = pool.imap_unordered(_indexed_task, enumerate(tasks))
        for done, (index, result) in enumerate(finished, start=1):
            results[index] = result
            if progress is not None:
                progress(done, len(tasks))
        pool.close()
    finally:
        pool.terminate()
        pool.join()
