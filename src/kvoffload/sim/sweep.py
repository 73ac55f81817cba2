"""Many independent runs over capacities x policies x thresholds, in parallel processes.

Each configuration is a separate task, run by one of a few worker processes that
each build their own copy of the workload from a :class:`WorkloadSource`; the
Belady bound of sequential runs depends only on the GPU and offload capacities
and the partial block mode, so it is computed once per such combination and
attached to every run with it (a sweep of :func:`sweep_configs` has one per
offload capacity). Overlapping requests (``concurrency > 1``) give each run its
own GPU hits, so each run computes its own bound.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import signal
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from kvoffload.core.errors import InvalidArgumentError, KVOffloadError
from kvoffload.sim.belady import BeladyResult
from kvoffload.sim.run import RunReport, SimConfig, bound_of, simulate
from kvoffload.sim.sources import WorkloadSource
from kvoffload.sim.workload import Workload

Task = tuple[WorkloadSource, SimConfig, bool]
"""(workload, configuration, whether this task computes the bound instead of a run)."""

Answer = tuple[int, RunReport | BeladyResult | None, str | None]
"""A worker's answer: (task index, its result, or None and why it failed)."""

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


class SweepStopped(KVOffloadError):
    """A sweep stopped before its end; ``reports`` holds the runs that had finished, in
    order (without a bound where their bound had not finished)."""

    def __init__(self, message: str, reports: list[RunReport], total: int) -> None:
        super().__init__(message)
        self.reports = reports
        self.total = total


class SweepInterrupted(SweepStopped):
    """Ctrl-C stopped a sweep."""

    def __init__(self, reports: list[RunReport], total: int) -> None:
        super().__init__(f"sweep interrupted after {len(reports)} of {total} runs", reports, total)


class SweepFailed(SweepStopped):
    """A run of a sweep raised, or its worker process died: the sweep stops there, as on
    Ctrl-C, and ``failed`` names the configuration (``reason`` says what went wrong)."""

    def __init__(self, reports: list[RunReport], total: int, failed: str, reason: str) -> None:
        super().__init__(
            f"sweep stopped after {len(reports)} of {total} runs: {failed} failed: {reason}",
            reports,
            total,
        )
        self.failed = failed
        self.reason = reason


class _TaskFailed(Exception):
    """Task ``index`` raised, or the process running it died, for ``reason``."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(index, reason)
        self.index = index
        self.reason = reason


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
    with lower tiers, see :attr:`SimConfig.bounded`). On Ctrl-C, pending runs are
    cancelled, workers stopped at once, and :class:`SweepInterrupted` carries the finished
    runs (without a bound where their bound had not finished); when a run raises or its
    worker process dies (the kernel's out-of-memory killer), the same happens with
    :class:`SweepFailed`, which names the run and why.
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise InvalidArgumentError(f"jobs must be an integer >= 1, got {jobs!r}")
    tasks, bound_keys = _tasks(source, configs)
    results: list[RunReport | BeladyResult | None] = [None] * len(tasks)
    try:
        if jobs == 1:
            workload = source.load() if loaded is None else loaded
            for index, (_, config, is_bound) in enumerate(tasks):
                try:
                    results[index] = _run_on(workload, config, is_bound)
                except Exception as exc:
                    raise _TaskFailed(index, _reason(exc)) from exc
                if progress is not None:
                    progress(index + 1, len(tasks))
        else:
            _run_parallel(tasks, results, jobs, progress)
    except KeyboardInterrupt:
        finished = _with_bounds(results, len(configs), bound_keys)
        raise SweepInterrupted(finished, len(configs)) from None
    except _TaskFailed as failure:
        finished = _with_bounds(results, len(configs), bound_keys)
        what = _describe(tasks[failure.index], failure.index, len(configs))
        raise SweepFailed(finished, len(configs), what, failure.reason) from failure.__cause__
    reports = _with_bounds(results, len(configs), bound_keys)
    if len(reports) != len(configs):
        raise RuntimeError("a sweep run returned no report")
    return reports


def _tasks(
    source: WorkloadSource, configs: Sequence[SimConfig]
) -> tuple[list[Task], list[BoundKey]]:
    """The runs of ``configs`` and the bounds they share, and the keys of those bounds
    (none where each run computes its own bound, or has none)."""
    if all(c.concurrency == 1 and not c.has_lower_tiers for c in configs):
        bound_configs: dict[BoundKey, SimConfig] = {}
        for config in configs:
            bound_configs.setdefault(_bound_key(config), config)
        bound_keys = sorted(bound_configs)
        tasks: list[Task] = [(source, c, False) for c in configs]
        tasks += [(source, bound_configs[key], True) for key in bound_keys]
        return tasks, bound_keys
    return [(source, dataclasses.replace(c, bound=True), False) for c in configs], []


def worker_processes(configs: Sequence[SimConfig], jobs: int) -> int:
    """How many worker processes :func:`run_sweep` starts for ``configs`` on ``jobs``,
    each building its own copy of the workload (none with ``jobs`` 1)."""
    return 0 if jobs == 1 else min(jobs, len(_tasks(WorkloadSource(), configs)[0]))


def _reason(exc: Exception) -> str:
    """What went wrong, in the words the command line uses for the same error alone."""
    if isinstance(exc, KVOffloadError):
        return str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f": {exc.filename}" if exc.filename else "")
    if isinstance(exc, MemoryError):
        return "out of memory"
    return f"{type(exc).__name__}: {exc}"  # a bug: its kind helps a report of it


def _describe(task: Task, index: int, num_runs: int) -> str:
    """The run (or bound) of ``task`` as its row of the sweep's table shows it."""
    _, config, is_bound = task
    if is_bound:
        return (
            f"the Belady bound of {_blocks(config.cpu_blocks, 'offload block')} "
            f"(GPU {_blocks(config.gpu_blocks, 'block')})"
        )
    return (
        f"run {index + 1} of {num_runs} (admission {config.admission}, policy {config.policy}, "
        f"threshold {config.store_threshold}, {_blocks(config.cpu_blocks, 'offload block')})"
    )


def _blocks(number: int, noun: str) -> str:
    """``number`` of ``noun``, in the plural unless one ("1 offload blocks" reads as a slip)."""
    return f"{number:,} {noun}" if number == 1 else f"{number:,} {noun}s"


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


def _serve(connection: Connection) -> None:
    """A worker: run each task index and task the parent sends, answer with the index and
    its result or what went wrong, until the parent sends ``None`` or goes. Ctrl-C is left
    to the parent, which stops the workers: no traceback from each."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            item = connection.recv()
        except EOFError:
            return
        if item is None:
            return
        index, task = item
        answer: Answer
        try:
            answer = (index, _run_task(task), None)
        except Exception as exc:
            answer = (index, None, _reason(exc))
        connection.send(answer)


@dataclasses.dataclass
class _Worker:
    """A worker process, the parent's end of its pipe, and the task it runs."""

    process: BaseProcess
    connection: Connection
    task: int | None = None
    """The index of the task it runs, if any."""


def _run_parallel(
    tasks: Sequence[Task],
    results: list[RunReport | BeladyResult | None],
    jobs: int,
    progress: Callable[[int, int], None] | None,
) -> None:
    """Run ``tasks`` on ``jobs`` worker processes, one task each at a time.

    Not a ``multiprocessing.Pool``: a pool replaces a worker that died (killed for memory)
    and waits forever for the task it had; here the death is seen (the process's sentinel)
    and named as the failure of that task (:class:`_TaskFailed`).
    """
    context = multiprocessing.get_context("spawn")
    pending = iter(enumerate(tasks))
    workers: list[_Worker] = []
    done = 0
    try:
        for _ in range(min(jobs, len(tasks))):
            ours, theirs = context.Pipe()
            process = context.Process(target=_serve, args=(theirs,), daemon=True)
            try:
                process.start()
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            worker = _Worker(process, ours)
            workers.append(worker)
            _give_next(worker, pending)
        while busy := [w for w in workers if w.task is not None]:
            wait([w.connection for w in busy] + [w.process.sentinel for w in busy])
            for worker in busy:
                if not worker.connection.poll() and worker.process.is_alive():
                    continue
                index, result = _answer(worker)
                results[index] = result
                done += 1
                if progress is not None:
                    progress(done, len(tasks))
                _give_next(worker, pending)
    finally:
        for worker in workers:
            worker.process.terminate()
        for worker in workers:
            worker.process.join()
            worker.connection.close()


def _give_next(worker: _Worker, pending: Iterator[tuple[int, Task]]) -> None:
    """Send ``worker`` the next task, or ``None`` (stop) when there is none left."""
    item = next(pending, None)
    worker.task = None if item is None else item[0]
    try:
        worker.connection.send(item)
    except OSError:  # it died since its last answer
        if item is not None:
            raise _TaskFailed(item[0], _death(worker.process)) from None


def _answer(worker: _Worker) -> tuple[int, RunReport | BeladyResult]:
    """The task ``worker`` has finished and its result; :class:`_TaskFailed` if the task
    raised, or the worker died before it answered."""
    index = worker.task
    if index is None:
        raise RuntimeError("an idle sweep worker was asked for an answer")
    try:
        answer: Answer = worker.connection.recv()
    except (EOFError, OSError):
        raise _TaskFailed(index, _death(worker.process)) from None
    worker.task = None
    answered, result, reason = answer
    if result is None:
        raise _TaskFailed(answered, reason or "no result")
    return answered, result


def _death(process: BaseProcess) -> str:
    """How a worker process ended, for the failure of the task it ran."""
    process.join()
    code = process.exitcode
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        oom = " (as the kernel's out-of-memory killer does)" if -code == signal.SIGKILL else ""
        return f"its worker process was killed by {name}{oom}"
    return f"its worker process exited with status {code}"
