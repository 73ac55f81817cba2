"""``kvoffload sweep``: offload capacities x policies x thresholds, in parallel, with plots."""

from __future__ import annotations

import argparse
import dataclasses
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvoffload.admission import available_admissions, resolve_admission
from kvoffload.admission.registry import NO_ADMISSION, ParamPairs
from kvoffload.admission.reuse_counts import MAX_STORE_THRESHOLD
from kvoffload.cli import options, output, tier_options
from kvoffload.cli.progress import ProgressBar
from kvoffload.core.cpus import usable_cpus
from kvoffload.core.errors import InsufficientMemoryError, InvalidArgumentError, KVOffloadError
from kvoffload.core.layout import layout_preset
from kvoffload.core.memory import check_fits
from kvoffload.policies import available_policies, resolve_policy
from kvoffload.sim.plots import lower_tiers
from kvoffload.sim.run import RunReport, SimConfig
from kvoffload.sim.sweep import (
    SweepFailed,
    SweepInterrupted,
    SweepStopped,
    run_sweep,
    sweep_configs,
    worker_processes,
)
from kvoffload.sim.traces import estimated_read_bytes
from kvoffload.sim.workload import Workload

DEFAULT_FACTORS = (1, 2, 4, 8)
"""Offload capacities swept by default, in GPU caches."""


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "sweep",
        help="compare offload capacities, policies, store thresholds and admission layers",
        description="Run every combination of offload capacity, policy, store threshold and "
        "admission layer on one workload, in parallel processes, each beside its Belady bound "
        "(none with a disk or shared tier).",
    )
    options.add_workload_arguments(parser)
    options.add_gpu_arguments(parser)
    cpu = parser.add_mutually_exclusive_group()
    cpu.add_argument(
        "--cpu-blocks",
        metavar="N,N,...",
        help="offload (CPU RAM) tier capacities in blocks (0: no tier)",
    )
    cpu.add_argument(
        "--cpu-gb",
        metavar="X,X,...",
        help="offload (CPU RAM) tier capacities in GiB of KV (default: 1, 2, 4 and 8 times the "
        "GPU cache)",
    )
    parser.add_argument(
        "--policies",
        default="lru,arc",
        help="eviction policies, from "
        f"{output.choices(available_policies(), resolve_policy)} (default: lru,arc)",
    )
    parser.add_argument(
        "--thresholds", default="0,2", help="store thresholds; below 2: no filter (default: 0,2)"
    )
    parser.add_argument(
        "--admissions",
        default="none",
        help="admission layers, from "
        f"{output.choices(available_admissions(), resolve_admission)} (default: none)",
    )
    options.add_admission_param_argument(parser, "each --admissions rule but none")
    options.add_engine_arguments(parser)
    tier_options.add_tier_arguments(parser)
    parser.add_argument(
        "--jobs",
        type=options.POSITIVE_INT,
        default=usable_cpus(),
        help="parallel processes, at most the CPUs this process may run on (default: all of them)",
    )
    parser.add_argument("--plot-dir", metavar="DIR", help="write PNG plots into DIR")
    parser.add_argument("--json", metavar="PATH", help="write every run as a JSON list (- stdout)")
    parser.add_argument("--csv", metavar="PATH", help="write every run as a CSV row (- stdout)")
    options.add_progress_argument(parser)
    parser.set_defaults(run=run)


def _capacities(
    args: argparse.Namespace, gpu_blocks: int, layout: str, bt: int
) -> list[tuple[int, str]]:
    """Each offload capacity in blocks, and how the command line gave it."""
    if args.cpu_blocks is not None:
        blocks = options.parse_ints(args.cpu_blocks, "--cpu-blocks", maximum=options.MAX_BLOCKS)
        return [(n, f"--cpu-blocks {n}") for n in blocks]
    if args.cpu_gb is not None:
        capacities = []
        for gib in options.parse_floats(args.cpu_gb, "--cpu-gb", options.MAX_GIB):
            n = options.cpu_blocks_for_gib(gib, layout, bt)
            capacities.append((n, f"--cpu-gb {gib:g} ({n:,} blocks)"))
        return capacities
    return [
        (gpu_blocks * f, f"the default offload tier of {f} GPU caches ({gpu_blocks * f:,} blocks)")
        for f in DEFAULT_FACTORS
    ]


def _check_admissions_fit(
    typed: list[str], params: ParamPairs, capacities: list[tuple[int, str]]
) -> None:
    """Refuse, before the first run, a run whose admission layer (with ``params``) the
    machine cannot hold: it failed only as it started, after the runs before it. Each rule
    is named as ``typed`` first names it (``recommended``, not ``optimiser``)."""
    named = _first_names(typed).values()
    for blocks, size in dict.fromkeys(capacities):
        for admission in named:
            options.check_admission_fits(admission, params, blocks, size, "--admissions")


def _first_names(typed: list[str]) -> dict[str, str]:
    """Each rule of ``typed`` (``--admissions``) by its name, as typed first."""
    first: dict[str, str] = {}
    for name in typed:
        first.setdefault(resolve_admission(name), name)
    return first


def _parameterised(typed: list[str]) -> list[str]:
    """The rules ``--admission-param`` sets, as typed: each of ``--admissions`` but
    ``none``, which takes no parameters; ``none`` when it is the only one (it refuses any,
    as ``simulate --admission none`` does)."""
    first = _first_names(typed)
    return [name for rule, name in first.items() if rule != NO_ADMISSION] or list(first.values())


def _admission_params(args: argparse.Namespace, typed: list[str]) -> ParamPairs:
    """``--admission-param``, checked as ``simulate``'s is against each rule it sets: a key
    one of them lacks is refused, naming that rule."""
    checked = [
        options.checked_param_pairs(rule, args.admission_param, "--admission-param")
        for rule in _parameterised(typed)
    ]
    return checked[0]


def _with_params(configs: list[SimConfig], params: ParamPairs) -> list[SimConfig]:
    """The runs of a rule with parameters given ``params``; ``none``'s take none."""
    if not params:
        return configs
    return [
        config
        if config.admission == NO_ADMISSION
        else dataclasses.replace(config, admission_params=params)
        for config in configs
    ]


def _distinct(names: list[str], resolve: Callable[[str], str]) -> list[str]:
    """The rules ``names`` stand for, each once, in the order first named: an alias
    (``recommended``, ``reuse``) runs its rule, which a run with the rule's name already
    covers."""
    return list(dict.fromkeys(resolve(name) for name in names))


def _check_cpu_tier(args: argparse.Namespace) -> None:
    """Refuse a capacity of no CPU tier beside a disk or shared tier, as ``simulate`` does:
    they sit below the CPU tier, so its row would run without them, unsaid. Only a 0 gives
    none (a positive --cpu-gb under one block is refused, and the GPU holds a block)."""
    if args.disk_dir is None and args.remote is None:
        return
    if args.cpu_blocks is not None:
        option = "--cpu-blocks"
        no_cpu_tier = 0 in options.parse_ints(args.cpu_blocks, option, maximum=options.MAX_BLOCKS)
    elif args.cpu_gb is not None:
        option = "--cpu-gb"
        no_cpu_tier = 0 in options.parse_floats(args.cpu_gb, option, options.MAX_GIB)
    else:
        return
    if no_cpu_tier:
        refusal = tier_options.NO_CPU_TIER.format(option=f"{option} 0")
        raise InvalidArgumentError(f"{refusal}: drop 0 from {option}")


def _jobs_within_cpus(jobs: int) -> int:
    """At most the CPUs this process may use, said once on stderr when fewer than asked:
    more workers than CPUs only take turns, each holding its own copy of the workload
    (``--jobs 1000`` on 2 CPUs started a pool of up to 1000 processes)."""
    cpus = usable_cpus()
    if jobs <= cpus:
        return jobs
    note = f"kvoffload: --jobs {jobs}: using {cpus}, the CPUs this process may use"
    print(note, file=sys.stderr)
    return cpus


def _check_trace_rereadable(trace: str | None, jobs: int) -> None:
    """Each worker process (``--jobs`` above 1) reads the trace anew, after this process
    has: a pipe would give this one its records and the workers none. With ``--jobs 1``
    the runs use the workload read here, so a pipe is read once, as ``simulate`` reads it
    (it was refused all the same)."""
    if trace is None or jobs == 1:
        return
    try:
        mode = os.stat(trace).st_mode
    except OSError:
        return  # reading it reports what is wrong
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise InvalidArgumentError(
            f"--trace {trace}: with --jobs {jobs} each worker process reads the trace again, "
            "and a pipe or device can be read only once; save it to a file first, or pass "
            "--jobs 1"
        )


def _check_trace_copies_fit(args: argparse.Namespace, workload: Workload, workers: int) -> None:
    """Refuse a sweep whose worker processes (``--jobs`` above 1) cannot each read the
    trace again, as a synthetic workload drawn by each is refused: they read it at once,
    at up to some 20 times its file's size each, and nothing checked that they fit. With
    ``--jobs 1`` the runs use the copy read here."""
    if args.trace is None or not workers:
        return
    what = f"--jobs {args.jobs}: the trace {args.trace}, read again by each of {workers} workers,"
    try:
        check_fits(workers * estimated_read_bytes(workload), what)
    except InsufficientMemoryError as exc:
        raise InsufficientMemoryError(
            f"{exc}; pass a smaller --jobs (with --jobs 1 the runs use the copy read here)"
        ) from None


def run(args: argparse.Namespace) -> int:
    if options.wants_param_list(args):
        named = options.parse_names(args.admissions, "--admissions", resolve_admission)
        tables = (
            options.param_list(rule, "--admissions", "--admission-param")
            for rule in _parameterised(named)
        )
        output.show("\n\n".join(tables))
        return 0
    table = tier_options.param_list_wanted(args)
    if table is not None:
        output.show(table)
        return 0
    args.jobs = _jobs_within_cpus(args.jobs)
    options.check_before_work(args)
    _check_cpu_tier(args)  # before the tiers' checks, which reach a --remote server
    tier_options.check_before_work(args)
    _check_trace_rereadable(args.trace, args.jobs)
    thresholds = options.parse_ints(args.thresholds, "--thresholds", maximum=MAX_STORE_THRESHOLD)
    # 0 and 1 both mean no filter, an alias is its rule (the report names the rule), and a
    # value given twice is the same run: each distinct setting runs once.
    thresholds = list(dict.fromkeys(0 if value < 2 else value for value in thresholds))
    options.check_tracker_size_used(args, thresholds, "a threshold of 2 or more in --thresholds")
    policies = options.parse_names(args.policies, "--policies", resolve_policy)
    policies = _distinct(policies, resolve_policy)
    typed_admissions = options.parse_names(args.admissions, "--admissions", resolve_admission)
    admissions = _distinct(typed_admissions, resolve_admission)
    params = _admission_params(args, typed_admissions)
    if args.layout is not None:
        options.check_name(args.layout, "--layout", layout_preset)
    # Parsed once now only to refuse a bad list before the workload is built.
    capacities = len(DEFAULT_FACTORS)
    if args.cpu_blocks is not None:  # checked now: no block size needed
        typed = _capacities(args, 0, options.DEFAULT_LAYOUT, 1)
        capacities = len(set(typed))
        _check_admissions_fit(typed_admissions, params, typed)
    if args.cpu_gb is not None:
        capacities = len(set(options.parse_floats(args.cpu_gb, "--cpu-gb", options.MAX_GIB)))
    runs = capacities * len(policies) * len(thresholds) * len(admissions)
    # Sizes in GiB may round to one block count (one run): counted again once sized.
    tier_options.check_one_run_with_remote(
        args, runs if args.cpu_gb is None else runs // capacities
    )
    # Each worker draws its own copy of a synthetic workload (at most one a run).
    source = options.workload_source(args, 0 if args.jobs == 1 else min(args.jobs, runs))
    workload = options.load_workload(source, args.progress)
    bt = workload.block_tokens
    base = options.base_config(args, bt, options.DEFAULT_LAYOUT)
    options.check_gpu_holds_requests(args, workload, base.gpu_blocks)
    base = tier_options.with_tiers(base, args, bt)
    sized = _capacities(args, base.gpu_blocks, base.layout, bt)
    options.check_simulated_time(workload, base, transfers=any(blocks for blocks, _ in sized))
    if args.cpu_blocks is None:
        _check_admissions_fit(typed_admissions, params, sized)
    configs = sweep_configs(
        base,
        list(dict.fromkeys(blocks for blocks, _ in sized)),
        policies,
        thresholds,
        admissions,
    )
    configs = _with_params(configs, params)
    tier_options.check_one_run_with_remote(args, len(configs))
    _check_trace_copies_fit(args, workload, worker_processes(configs, args.jobs))
    configs = tier_options.separate_disk_dirs(configs)
    bar = ProgressBar("sweep", ProgressBar.wanted(args.progress))
    try:
        reports = run_sweep(source, configs, jobs=args.jobs, progress=bar, loaded=workload)
    except SweepInterrupted as stop:
        bar.close()
        return _keep_finished(args, stop, "interrupted", 130, workload.trace_format)
    except SweepFailed as stop:
        bar.close()
        return _keep_finished(args, stop, "error", 1, workload.trace_format)
    finally:
        bar.close()
    _write(args, reports, workload.trace_format)
    shown = "-" not in (args.json, args.csv)
    plots: list[Path] = []
    if args.plot_dir:
        try:
            plots = _plot(reports, args.plot_dir, plots)
        except (KVOffloadError, KeyboardInterrupt) as stop:
            # Every run is done: a plot that cannot be written, or Ctrl-C as the plots are
            # drawn, does not hide their table nor what was written.
            if shown:
                output.show(format_sweep(reports))
            if not isinstance(stop, KeyboardInterrupt):
                raise
            written = " and ".join(str(path) for path in plots) or "no plot"
            finished = output.counted(len(reports), "run")
            print(
                output.one_line(
                    f"kvoffload: interrupted: sweep interrupted while plotting, after its "
                    f"{finished}; {_kept(args)}; {written} {'were' if len(plots) > 1 else 'was'} "
                    "written"
                ),
                file=sys.stderr,
            )
            return 130
    if shown:
        output.show("\n".join([format_sweep(reports), *(f"plot: {path}" for path in plots)]))
    return 0


def _plot(reports: list[RunReport], plot_dir: str, written: list[Path]) -> list[Path]:
    """Write the sweep's plots into ``plot_dir``, adding each to ``written`` once it is (an
    interrupted sweep names them); an error names ``--plot-dir``."""
    from kvoffload.sim.plots import plot_sweep

    def write(path: Path, png: bytes) -> None:
        output.write_file(str(path), png, "--plot-dir")
        written.append(path)

    try:
        return plot_sweep(reports, plot_dir, write)
    except OSError as exc:
        made = Path(plot_dir)
        if exc.filename is None or Path(exc.filename) not in (made, *made.parents):
            raise  # not making the directory (a font matplotlib could not read, say)
        raise output.OutputError(
            f"--plot-dir {plot_dir}: cannot write: {exc.strerror or exc}"
        ) from None


def _write(args: argparse.Namespace, reports: list[RunReport], trace_format: str | None) -> None:
    """Each run's row, with the format the trace was read in as simulate's JSON has it
    (``None``: a synthetic workload)."""
    rows = [{**report.as_dict(), "trace_format": trace_format} for report in reports]
    if args.json:
        output.write_json(args.json, rows)
    if args.csv and rows:
        output.write_csv(args.csv, rows)


def _keep_finished(
    args: argparse.Namespace, stop: SweepStopped, label: str, status: int, trace_format: str | None
) -> int:
    """Keep what finished: write and show it, then say on one line why the sweep stopped
    (``kvoffload: {label}: ...``) and return ``status``: an hour of finished runs is not lost
    to Ctrl-C nor to one run that fails. With nothing finished nothing is written, so the
    files of an earlier sweep stay as they were."""
    reports = stop.reports
    if not reports:
        kept = "no run had finished"
        written = _result_files(args)
        if written:
            kept += f"; {' and '.join(written)} not written"
    else:
        _write(args, reports, trace_format)
        if "-" not in (args.json, args.csv):
            output.show(format_sweep(reports))
        kept = _kept(args, "the finished runs")
    print(output.one_line(f"kvoffload: {label}: {stop}; {kept}"), file=sys.stderr)
    return status


def _result_files(args: argparse.Namespace) -> list[str]:
    """The files ``--json`` and ``--csv`` name (not standard output)."""
    return [path for path in (args.json, args.csv) if path and path != "-"]


def _kept(args: argparse.Namespace, runs: str = "the runs") -> str:
    """Where the written ``runs`` are, for the line that says why a sweep stopped."""
    written = _result_files(args)
    if written:
        return f"{runs} were written to {' and '.join(written)}"
    return f"{runs} are shown above"


def format_sweep(reports: list[RunReport]) -> str:
    headers = ["admission", "policy", "threshold", "offload", "blocks", "total hit", "Belady"]
    headers += ["offload hit", "writes/ref", "skipped", "refs/s"]
    rows = [
        [
            r.admission,
            r.policy,
            str(r.store_threshold),
            output.size(r.cpu_gib * 2**30),
            f"{r.cpu_blocks:,}",
            f"{r.total_hit_ratio:.3f}",
            output.ratio(r.belady_total_hit_ratio),
            f"{r.offload_hit_ratio:.3f}",
            f"{r.writes_per_ref:.3f}",
            f"{r.stores_skipped_by_admission:,}",
            f"{r.refs_per_second:,.0f}",
        ]
        for r in reports
    ]
    first = reports[0]
    title = (
        f"{first.workload}: {output.counted(first.refs, 'block ref')}; "
        f"GPU {output.size(first.gpu_gib * 2**30)} "
        f"({output.counted(first.gpu_blocks, 'block')}), layout {first.layout}"
    )
    below = lower_tiers(first)
    if below:  # their hits are in "total hit", their capacity in no column
        title += f"; {below} each offload tier"
    return title + "\n\n" + output.column_table(headers, rows)
