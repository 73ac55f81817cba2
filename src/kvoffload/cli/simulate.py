"""``kvoffload simulate``: one configuration over one workload, as a table, JSON or CSV."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from kvoffload.admission import available_admissions, resolve_admission
from kvoffload.cli import observe_options, options, output, tier_options
from kvoffload.cli.progress import FollowingBar, ProgressBar
from kvoffload.core.errors import InsufficientMemoryError, KVOffloadError
from kvoffload.core.layout import layout_preset
from kvoffload.policies import available_policies, resolve_policy
from kvoffload.sim.run import RunReport, SimConfig, blocks_for_gib, simulate

DATA_PLANE_LAYOUT = "tiny"
"""Default layout with ``--data-plane``: real bytes are moved, so keep blocks small."""
DATA_PLANE_DEVICE = "cpu"
"""Default ``--device`` of the data plane's GPU blocks: runs on any machine."""


class DataPlaneMismatchError(KVOffloadError):
    """Loaded blocks did not hold the bytes that were stored."""


@dataclass(frozen=True)
class DataPlaneCounts:
    """What the data plane checked during a ``--data-plane`` run."""

    verified_blocks: int
    mismatched_blocks: int
    failed_jobs: int


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "simulate",
        help="replay a workload through a GPU prefix cache and an offload tier",
        description="Replay a trace or a synthetic mix through a GPU prefix cache in front of "
        "an offload tier, and report hit ratios, write traffic and prefill time saved.",
    )
    options.add_workload_arguments(parser)
    tier = parser.add_argument_group("GPU cache and offload tier")
    options.add_gpu_arguments(tier)
    cpu = tier.add_mutually_exclusive_group()
    cpu.add_argument(
        "--cpu-blocks",
        type=options.BLOCKS_OR_NONE,
        metavar="N",
        help="offload (CPU RAM) tier size in blocks; 0: no tier",
    )
    cpu.add_argument(
        "--cpu-gb",
        type=options.SIZE_GIB,
        metavar="X",
        help=f"offload (CPU RAM) tier size in GiB of KV (default: {options.DEFAULT_CPU_GIB:g})",
    )
    tier.add_argument(
        "--policy",
        default="lru",
        help="eviction policy, one of "
        f"{output.choices(available_policies(), resolve_policy)} (default: lru)",
    )
    tier.add_argument(
        "--admission",
        default="none",
        help="admission layer, one of "
        f"{output.choices(available_admissions(), resolve_admission)} (default: none)",
    )
    options.add_admission_param_argument(tier)
    options.add_write_budget_arguments(tier)
    tier.add_argument(
        "--store-threshold",
        type=options.STORE_THRESHOLD,
        default=0,
        help="store a block only after this many lookups; below 2: no filter (default: 0)",
    )
    options.add_engine_arguments(parser)
    tier_options.add_tier_arguments(parser)
    parser.add_argument(
        "--no-bound",
        action="store_true",
        help="skip the Belady bound and the extra pass over the workload it takes",
    )
    plane = parser.add_argument_group("data plane")
    plane.add_argument(
        "--data-plane",
        action="store_true",
        help=f"move and verify real KV bytes (default layout then: {DATA_PLANE_LAYOUT}, "
        "default capacities the same block counts as without it)",
    )
    plane.add_argument(
        "--device", help=f"device for GPU blocks, with --data-plane (default: {DATA_PLANE_DEVICE})"
    )
    parser.add_argument(
        "--json", metavar="PATH", help="write the run as one JSON object (- stdout)"
    )
    parser.add_argument("--csv", metavar="PATH", help="write the run as one CSV row (- stdout)")
    observe_options.add_observe_arguments(parser)
    options.add_progress_argument(parser)
    parser.set_defaults(run=run)


@dataclass(frozen=True)
class _Sizes:
    """How the GPU cache's and the offload tier's sizes were given (an option as typed, or
    the default), for the data plane's errors to name."""

    gpu: str
    cpu: str


def _sizes(args: argparse.Namespace) -> _Sizes:
    """``args``' sizes as typed: called before the data plane's defaults fill them in."""
    typed = args.cpu_blocks is not None or args.cpu_gb is not None
    return _Sizes(
        options.gpu_size(args), _cpu_option(args) if typed else "the default offload tier"
    )


@dataclass(frozen=True)
class _DataPlane:
    """The data plane's backend module and where its GPU blocks go, found before the
    workload loads: torch missing, or a ``--device`` it does not have, is refused then,
    not once a large trace has been read."""

    module: ModuleType
    device: str
    on_cpu: bool


def _data_plane_checked(device: str) -> _DataPlane:
    """Import the data plane (it needs torch) and resolve ``device``."""
    try:
        module = importlib.import_module("kvoffload.sim.dataplane_backend")
        allocation = importlib.import_module("kvoffload.dataplane.allocation")
    except ModuleNotFoundError as exc:
        if exc.name in ("kvoffload.sim.dataplane_backend", "kvoffload.dataplane"):
            raise KVOffloadError(
                "--data-plane needs kvoffload's data plane, not installed"
            ) from None
        raise KVOffloadError(
            f"--data-plane needs {exc.name}; install it with: pip install 'kvoffload[torch]'"
        ) from None
    return _DataPlane(module, device, options.device_on_cpu(allocation, device))


def _data_plane(plane: _DataPlane, config: SimConfig, block_tokens: int, sizes: _Sizes) -> Any:
    """The data plane's ``DataPlaneBackend``, its buffers checked against memory first."""
    layout = config.kv_layout(block_tokens)
    block = layout.bytes_per_block
    options.check_kv_buffers_fit(
        options.KVBuffer(config.gpu_blocks, block, sizes.gpu),
        options.KVBuffer(config.cpu_blocks, block, sizes.cpu),
        plane.on_cpu,
        " with --data-plane",
    )
    try:
        return plane.module.DataPlaneBackend(
            layout, config.gpu_blocks, config.cpu_blocks, plane.device
        )
    except InsufficientMemoryError as exc:  # the device's own memory (or pinning) refused
        raise InsufficientMemoryError(
            f"{sizes.gpu} and {sizes.cpu} with --data-plane: {exc}"
        ) from None


def _default_capacities_in_blocks(args: argparse.Namespace, block_tokens: int) -> None:
    """Give the data plane the default model's block counts, not its GiB of a tiny layout.

    The hit ratios then match a run without ``--data-plane``, and the real
    buffers stay small.
    """
    default = options.DEFAULT_LAYOUT
    if args.gpu_blocks is None and args.gpu_gb is None:
        args.gpu_blocks = blocks_for_gib(options.DEFAULT_GPU_GIB, default, block_tokens)
    if args.cpu_blocks is None and args.cpu_gb is None:
        args.cpu_blocks = blocks_for_gib(options.DEFAULT_CPU_GIB, default, block_tokens)


_NO_TIER = "--data-plane moves bytes to an offload tier, and {option} leaves none"


def _cpu_option(args: argparse.Namespace) -> str:
    if args.cpu_blocks is not None:
        return f"--cpu-blocks {args.cpu_blocks}"
    return f"--cpu-gb {args.cpu_gb:g}"


def _check_cpu_tier(args: argparse.Namespace, cpu_blocks: int | None) -> None:
    """Refuse a run that needs a CPU tier (the data plane's bytes, or lower tiers beneath
    it) and has none: called with ``--cpu-blocks`` before the workload loads, and with the
    blocks ``--cpu-gb`` makes once its block size is known."""
    if cpu_blocks != 0:
        return
    if args.data_plane:
        raise KVOffloadError(_NO_TIER.format(option=_cpu_option(args)))
    if args.disk_dir is not None or args.remote is not None:
        raise KVOffloadError(tier_options.NO_CPU_TIER.format(option=_cpu_option(args)))


def run(args: argparse.Namespace) -> int:
    if options.wants_param_list(args):
        output.show(options.param_list(args.admission))
        return 0
    table = tier_options.param_list_wanted(args)
    if table is not None:
        output.show(table)
        return 0
    options.check_before_work(args)
    if args.device is not None and not args.data_plane:  # it would be ignored, unsaid
        raise KVOffloadError(
            f"--device {args.device} places the data plane's GPU blocks: it needs --data-plane"
        )
    _check_cpu_tier(args, args.cpu_blocks)
    tier_options.check_before_work(args)
    options.check_tracker_size_used(args, [args.store_threshold], "--store-threshold 2 or more")
    options.check_name(args.policy, "--policy", resolve_policy)
    options.check_name(args.admission, "--admission", resolve_admission)
    options.check_write_budget_runs(args)
    if args.layout is not None:  # else the data plane's or the default model's
        options.check_name(args.layout, "--layout", layout_preset)
    params = options.admission_param_pairs(args)
    typed_blocks = args.cpu_blocks is not None  # else the tier's blocks need the block size
    if typed_blocks:
        options.check_admission_fits(
            args.admission, params, args.cpu_blocks, _cpu_option(args), "--admission"
        )
    observe_options.check_before_work(args)
    plane = _data_plane_checked(args.device or DATA_PLANE_DEVICE) if args.data_plane else None
    workload = options.load_workload(options.workload_source(args), args.progress)
    bt = workload.block_tokens
    sizes = _sizes(args)
    if args.data_plane:
        _default_capacities_in_blocks(args, bt)
    config = options.base_config(
        args, bt, DATA_PLANE_LAYOUT if args.data_plane else options.DEFAULT_LAYOUT
    )
    options.check_gpu_holds_requests(args, workload, config.gpu_blocks)
    cpu = options.cpu_blocks(args.cpu_blocks, args.cpu_gb, config, bt)
    _check_cpu_tier(args, cpu)
    if not typed_blocks:
        size = _cpu_option(args) if args.cpu_gb is not None else "the default offload tier"
        options.check_admission_fits(
            args.admission, params, cpu, f"{size} ({output.counted(cpu, 'block')})", "--admission"
        )
    config = options.with_offload(config, cpu, args.policy, args.store_threshold)
    options.check_simulated_time(workload, config, transfers=cpu > 0)
    # The tiers first: a budget in drive writes per day is checked at once, and without
    # --drive-bytes it counts against the disk tier's size.
    config = tier_options.with_tiers(config, args, bt)
    config = dataclasses.replace(
        config,
        admission=args.admission,
        write_budget=args.write_budget,
        drive_bytes=args.drive_bytes,
        admission_params=params,
    )
    if args.no_bound:
        config = dataclasses.replace(config, bound=False)
    # The data plane's backend is duck-typed: a TransferBackend plus its check counters.
    backend: Any = _data_plane(plane, config, bt, sizes) if plane is not None else None
    wanted = ProgressBar.wanted(args.progress)
    bar = ProgressBar("simulate", wanted)
    # The bound's passes take a fifth as long again, silent once the replay's bar was full.
    bound_bar = FollowingBar("Belady bound", wanted, bar)
    with observe_options.observing(args, bt) as observing:
        try:
            report = simulate(workload, config, backend, bar, observing.observers, bound_bar)
        finally:
            bar.close()
            bound_bar.close()
        observing.settle()
        # Inside: results are written while the events and metrics endpoints are still up.
        _write_results(args, report, backend, workload.trace_format)
    return 0


def _write_results(
    args: argparse.Namespace, report: RunReport, backend: Any, trace_format: str | None
) -> None:
    data = report.as_dict()
    plane = None
    if backend is not None:
        plane = DataPlaneCounts(
            int(backend.verified_blocks), int(backend.mismatched_blocks), int(backend.failed_jobs)
        )
        data.update(dataclasses.asdict(plane))
    # A key of its own, last: tools read ``workload`` as the trace's file name, and a CSV's
    # columns by their place.
    data["trace_format"] = trace_format
    if args.json:
        output.write_json(args.json, data)
    if args.csv:
        output.write_csv(args.csv, [data])
    if "-" not in (args.json, args.csv):
        output.show(format_report(report, plane, trace_format))
    if plane is not None and plane.mismatched_blocks:
        raise DataPlaneMismatchError(
            f"data plane: {plane.mismatched_blocks} loaded blocks did not hold what was stored"
        )


def _bound(value: float | None) -> str:
    return f"   (Belady bound {value:.3f})" if value is not None else ""


def _blocks_and_bytes(blocks: int, num_bytes: int) -> str:
    return f"{blocks:,} blocks ({output.size(num_bytes)})"


def format_report(
    report: RunReport, plane: DataPlaneCounts | None = None, trace_format: str | None = None
) -> str:
    """The run as a table for people; ``trace_format``: the format the trace was read in
    (``None``: a synthetic workload)."""
    r = report
    workload = r.workload if trace_format is None else f"{r.workload} ({trace_format} trace)"
    admission = (
        f"store threshold {r.store_threshold}" if r.store_threshold >= 2 else "no store filter"
    )
    if r.admission != "none":
        admission += f", admission {r.admission}"
    tier = "none"
    if r.cpu_blocks:
        tier = (
            f"{output.size(r.cpu_gib * 2**30)} ({output.counted(r.cpu_blocks, 'block')}), "
            f"{r.policy}, {admission}"
        )
    rows = [
        ("workload", workload),
        (
            "",
            f"{output.counted(r.requests, 'request')}, {output.counted(r.refs, 'block ref')}, "
            f"{output.counted(r.unique_blocks, 'unique block')} "
            f"of {output.counted(r.block_tokens, 'token')}",
        ),
        ("KV layout", f"{r.layout}, {output.size(r.bytes_per_block)} per block"),
        (
            "GPU prefix cache",
            f"{output.size(r.gpu_gib * 2**30)} ({output.counted(r.gpu_blocks, 'block')})",
        ),
        ("offload tier", tier),
        ("concurrency", str(r.concurrency)),
        ("", ""),
        ("total hit ratio", f"{r.total_hit_ratio:.3f}{_bound(r.belady_total_hit_ratio)}"),
        ("  from GPU cache", f"{r.gpu_hit_ratio:.3f}"),
        ("  from offload tier", f"{r.offload_hit_ratio:.3f}{_bound(r.belady_offload_hit_ratio)}"),
        ("writes per block ref", f"{r.writes_per_ref:.3f}"),
        ("offload written", _blocks_and_bytes(r.offload_blocks_written, r.offload_bytes_written)),
        ("offload read", _blocks_and_bytes(r.offload_blocks_read, r.offload_bytes_read)),
        ("skipped by admission", output.counted(r.stores_skipped_by_admission, "block")),
        *_admission_rows(r),
        ("rejected (tier full)", output.counted(r.stores_rejected, "block")),
        ("failed stores / loads", f"{r.stores_failed:,} / {r.loads_failed:,} blocks"),
        ("offload evictions", output.counted(r.offload_evictions, "block")),
        (
            "prefill time saved",
            f"{output.seconds(r.prefill_seconds_saved)} of "
            f"{output.seconds(r.prefill_seconds_baseline)} (offload tier: "
            f"{output.seconds(r.prefill_seconds_saved_by_offload)} net of loads)",
        ),
        ("manager time", f"{r.manager_us_per_block:.2f} us per block ref"),
        ("replay", f"{r.wall_seconds:.2f} s, {r.refs_per_second:,.0f} block refs/s"),
    ]
    rows += tier_options.tier_rows(r)
    if plane is not None:
        rows.append(
            (
                "data plane",
                f"{plane.verified_blocks:,} blocks verified, "
                f"{plane.mismatched_blocks:,} mismatched, {plane.failed_jobs:,} failed jobs",
            )
        )
    return output.key_value_table(rows)


def _admission_rows(r: RunReport) -> list[tuple[str, str]]:
    """The admission layer's counters, when there is one (the seed filter, ``filter``,
    keeps none: its held-back blocks are the "skipped by admission" row)."""
    if r.admission == "none" or not r.cpu_blocks or r.admission_bytes_per_key is None:
        return []
    control = "-" if r.admission_control is None else f"{r.admission_control:.2f}"
    memory = "-" if r.admission_bytes_per_key is None else f"{r.admission_bytes_per_key:.1f}"
    return [
        (
            f"admission {r.admission}",
            f"{r.admission_admitted:,} of {r.admission_offers:,} offers admitted, "
            f"{r.admission_ghost_hits:,} ghost hits",
        ),
        ("  control, memory", f"{control}, {memory} bytes per tracked key"),
        *output.whatif_rows(r.admission_candidate, r.admission_switches, r.whatif),
    ]
