"""Options of the tiers below the CPU tier, shared by ``simulate`` and ``sweep``."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from kvoffload.admission import available_admissions, resolve_admission
from kvoffload.admission.params import read_number
from kvoffload.admission.registry import ParamPairs
from kvoffload.cli import options, output
from kvoffload.core.errors import InvalidArgumentError, KVOffloadError
from kvoffload.core.layout import KVLayout
from kvoffload.policies import resolve_policy
from kvoffload.sim import tier_model
from kvoffload.sim.run import RunReport, SimConfig, blocks_for_gib
from kvoffload.tiers.disk import (
    DEFAULT_TIMEOUT_MS,
    MAX_TIMEOUT_MS,
    MIN_TIMEOUT_MS,
    check_capacity,
    check_timeout_ms,
)
from kvoffload.tiers.format import FINGERPRINT_BYTES, layout_fingerprint
from kvoffload.tiers.slot_file import SLOT_FILE, DiskTierError, footprint, slot_stride

NO_CPU_TIER = (
    "a disk or shared tier (--disk-dir, --remote) sits below the CPU tier, and {option} leaves none"
)
"""The refusal of lower tiers without a CPU tier (``simulate`` and ``sweep``)."""
MIN_TIER_GB_PER_S = 1e-9
"""A modelled tier's least bandwidth, a byte per second: a run's bytes over it take a finite
time; over 1e-308 GB/s they took ``inf`` seconds, and the report said "-inf s" saved."""
MAX_TIER_LATENCY_MS = 7 * 24 * 3600 * 1000.0
"""A modelled tier's most latency per read batch, a week: a run's batches at it take a
finite time; at 1e308 ms they took ``inf`` seconds, written to JSON as ``Infinity``."""


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "tiers below the CPU tier (blocks promoted back through the CPU tier on a hit)"
    )
    group.add_argument(
        "--disk-dir", metavar="PATH", help="local-disk tier in this directory (kept across runs)"
    )
    size = group.add_mutually_exclusive_group()
    size.add_argument(
        "--disk-gb", type=options.POSITIVE_GIB, metavar="X", help="disk tier size in GiB"
    )
    size.add_argument(
        "--disk-blocks", type=options.BLOCKS, metavar="N", help="disk tier size in blocks"
    )
    group.add_argument(
        "--disk-policy", help="disk tier eviction policy (default: the CPU tier's --policy)"
    )
    add_disk_timeout_argument(group)
    group.add_argument(
        "--remote",
        metavar="URL",
        help="shared Valkey/Redis tier, e.g. redis://[user:pass@]host:port/0, rediss:// for "
        "TLS, or redis://host:port,host:port,... for a Cluster's seed nodes",
    )
    group.add_argument(
        "--tier-store-threshold",
        type=options.STORE_THRESHOLD,
        default=0,
        help="write a block to disk/remote only after this many lookups; below 2: all (default: 0)",
    )
    for tier in ("disk", "remote"):
        group.add_argument(
            f"--{tier}-admission",
            default="none",
            metavar="NAME",
            help=f"the {tier} tier's own admission layer after --tier-store-threshold, one of "
            f"{output.choices(available_admissions(), resolve_admission)} (default: none)",
        )
        group.add_argument(
            f"--{tier}-admission-param",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help=f"a parameter of the --{tier}-admission rule, repeatable, as --admission-param "
            f"is the CPU tier's; 'help' lists the rule's parameters",
        )
        group.add_argument(
            f"--{tier}-write-budget",
            type=options.WRITE_BUDGET,
            default=None,
            metavar="W",
            help=f"with --{tier}-admission recommended: at most W {tier} writes per block "
            f"reference reaching the {tier} tier (0.05), bytes per second (200MB/s) or drive "
            "writes per day (1dwpd)",
        )
    group.add_argument(
        "--remote-blocks",
        type=options.BLOCKS,
        metavar="N",
        help="the shared tier's size in blocks as --remote-admission models it (required with it)",
    )
    latency = options.number(0.0, maximum=MAX_TIER_LATENCY_MS)
    for name, what, default, kind in (
        ("disk-gb-per-s", "modelled disk bandwidth, GB/s", tier_model.DISK_GB_PER_S, None),
        ("disk-latency-ms", "modelled disk latency per read batch", tier_model.DISK_LATENCY_MS, 0),
        ("remote-gb-per-s", "modelled remote bandwidth, GB/s", tier_model.REMOTE_GB_PER_S, None),
        (
            "remote-latency-ms",
            "modelled remote latency per read batch",
            tier_model.REMOTE_LATENCY_MS,
            0,
        ),
    ):
        group.add_argument(  # no default here: given without its tier, it is refused
            f"--{name}",
            type=options.number(MIN_TIER_GB_PER_S) if kind is None else latency,
            help=f"{what} (default: {default:g})",
        )


def add_disk_timeout_argument(group: argparse._ActionsContainer) -> None:
    """``--disk-timeout-ms``, for ``simulate``, ``sweep`` and ``bench tiers``."""
    group.add_argument(
        "--disk-timeout-ms",
        type=disk_timeout_ms,
        metavar="MS",
        help="deadline of each disk tier operation, plus its bytes at 50 MB/s; past it the "
        f"operation fails, counted, and the engine goes on (default: {DEFAULT_TIMEOUT_MS:g}, "
        f"from {MIN_TIMEOUT_MS:.0f} to {MAX_TIMEOUT_MS:.0f})",
    )


def disk_timeout_ms(text: str) -> float:
    """An argparse ``type`` for ``--disk-timeout-ms``: the tier's range, judged as written
    (``0.99999999999999999999`` is below 1 ms, though its float is 1.0)."""
    try:
        check_timeout_ms(text, "it")
        return read_number(text, MIN_TIMEOUT_MS, MAX_TIMEOUT_MS)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("it ")) from None


def param_list_wanted(args: argparse.Namespace) -> str | None:
    """The parameter table ``--disk-admission-param help`` (or the remote tier's) asked for
    instead of a run, if one did."""
    for tier in ("disk", "remote"):
        if options.PARAM_LIST in getattr(args, f"{tier}_admission_param"):
            return options.param_list(getattr(args, f"{tier}_admission"), f"--{tier}-admission")
    return None


def check_before_work(args: argparse.Namespace) -> None:
    """Refuse tier options that would fail only once the workload is built: a size or
    policy without a disk tier, an unusable directory, a server that cannot be reached.
    """
    disk_options = [
        option
        for option, value in (
            ("--disk-gb", args.disk_gb),
            ("--disk-blocks", args.disk_blocks),
            ("--disk-policy", args.disk_policy),
            ("--disk-timeout-ms", args.disk_timeout_ms),
            ("--disk-gb-per-s", args.disk_gb_per_s),
            ("--disk-latency-ms", args.disk_latency_ms),
        )
        if value is not None
    ]
    if args.disk_dir is None:
        if disk_options:
            raise InvalidArgumentError(f"{disk_options[0]} needs --disk-dir")
    else:
        if args.disk_gb is None and args.disk_blocks is None:
            raise InvalidArgumentError("--disk-dir needs a size: --disk-gb or --disk-blocks")
        answered_in_time(lambda: _check_disk_dir(args.disk_dir), args)
        if args.disk_blocks is not None:  # --disk-gb needs the block size: checked later
            _check_capacity(args.disk_blocks, "--disk-blocks")
        if args.disk_policy is not None:
            options.check_name(args.disk_policy, "--disk-policy", resolve_policy)
    params: dict[str, ParamPairs] = {}
    for tier, present in (("disk", args.disk_dir is not None), ("remote", args.remote is not None)):
        admission, budget = (
            getattr(args, f"{tier}_admission"),
            getattr(args, f"{tier}_write_budget"),
        )
        options.check_name(admission, f"--{tier}-admission", resolve_admission)
        given = getattr(args, f"{tier}_admission_param")
        if not present and (admission != "none" or budget is not None or given):
            option = (
                f"--{tier}-admission"
                if admission != "none"
                else f"--{tier}-write-budget"
                if budget is not None
                else f"--{tier}-admission-param"
            )
            raise InvalidArgumentError(
                f"{option} needs {'--disk-dir' if tier == 'disk' else '--remote'}"
            )
        params[tier] = options.admission_param_pairs(args, tier)
        if budget is not None and resolve_admission(admission) != "optimiser":
            raise InvalidArgumentError(
                f"--{tier}-write-budget needs --{tier}-admission recommended (the optimiser), "
                f"not {admission!r}"
            )
    if args.remote_admission != "none" and args.remote_blocks is None:
        raise InvalidArgumentError(
            "--remote-admission needs --remote-blocks (the shared tier's size it models)"
        )
    # Each read by a lower tier only: without one it would be ignored, unsaid.
    if args.remote_blocks is not None and args.remote_admission == "none":
        raise InvalidArgumentError(
            "--remote-blocks is the shared tier's size as --remote-admission models it "
            "(the server's own size is unknown): it needs --remote and --remote-admission"
        )
    if args.tier_store_threshold >= 2 and args.disk_dir is None and args.remote is None:
        raise InvalidArgumentError(
            "--tier-store-threshold filters writes to the tiers below the CPU tier: "
            "it needs --disk-dir or --remote"
        )
    remote_model = [
        option
        for option, value in (
            ("--remote-gb-per-s", args.remote_gb_per_s),
            ("--remote-latency-ms", args.remote_latency_ms),
        )
        if value is not None
    ]
    if remote_model and args.remote is None:
        raise InvalidArgumentError(f"{remote_model[0]} models the remote tier: it needs --remote")
    for tier, blocks in (("disk", args.disk_blocks), ("remote", args.remote_blocks)):
        if blocks is not None:  # --disk-gb needs the block size: checked in with_tiers
            options.check_admission_fits(
                getattr(args, f"{tier}_admission"),
                params[tier],
                blocks,
                f"--{tier}-blocks {blocks}",
                f"--{tier}-admission",
            )
    if args.remote is not None:
        check_remote(args.remote)


def _check_capacity(disk_blocks: int, option: str) -> None:
    try:
        check_capacity(disk_blocks)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{option}: {exc}") from None


def answered_in_time(check: Callable[[], None], args: argparse.Namespace) -> None:
    """Run ``check``, file-system calls on ``--disk-dir``, by the disk tier's deadline
    (``--disk-timeout-ms``): on a file system that stops answering (an NFS server gone, a
    FUSE daemon hung) they waited without end on the main thread, before the tier, whose
    own start ends by that deadline, was made. The thread left behind is a daemon."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            check()
        except BaseException as exc:  # handed to the caller's thread, raised there
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=run, name="kvoffload-disk-dir-check", daemon=True)
    thread.start()
    timeout_s = (args.disk_timeout_ms or DEFAULT_TIMEOUT_MS) / 1000
    thread.join(timeout_s)
    if not outcome:
        raise DiskTierError(f"--disk-dir {args.disk_dir}: did not answer within {timeout_s:g} s")
    if outcome[0] is not None:
        raise outcome[0]


def _check_disk_dir(path: str) -> None:
    """An existing writable directory, or one that can be made in an existing one (not
    ``""``, which as a path is the working directory)."""
    if not path:
        raise InvalidArgumentError("--disk-dir must be a non-empty path, got ''")
    target = Path(path)
    if target.exists():
        if not target.is_dir():
            raise InvalidArgumentError(f"--disk-dir {path}: is not a directory")
        place = target
    else:
        place = target.parent
        if not place.is_dir():
            raise InvalidArgumentError(f"--disk-dir {path}: {place} is not an existing directory")
    if not os.access(place, os.W_OK | os.X_OK):
        raise InvalidArgumentError(f"--disk-dir {path}: {place} is not writable")


def check_remote(url: str) -> None:
    """Connect once (the URL's own timeout bounds it), so a typo costs no run."""
    from kvoffload.tiers import RemoteTier

    try:
        RemoteTier(url, bytes(FINGERPRINT_BYTES)).close()
    except KVOffloadError as exc:
        raise type(exc)(f"--remote: {exc}") from None


def check_disk_fits(disk_dir: str, disk_blocks: int, payload_bytes: int, reused: Path) -> None:
    """The full slot file (slots of their stride, not of their payload) must fit in the file
    system's free space, plus what ``reused`` (this tier's file from an earlier run) holds."""
    place = Path(disk_dir)
    while not place.exists():
        place = place.parent
    free = shutil.disk_usage(place).free
    with contextlib.suppress(OSError):  # without an earlier file there is nothing to reuse
        free += reused.lstat().st_blocks * 512
    need = footprint(disk_blocks, payload_bytes)
    if need > free:
        raise InvalidArgumentError(
            f"a disk tier of {disk_blocks:,} blocks takes {output.size(need)} "
            f"(slots of {output.size(slot_stride(payload_bytes))}) and does not fit the "
            f"{output.size(free)} free in the file system of --disk-dir {disk_dir}"
        )


def _check_disk_space(
    args: argparse.Namespace, disk_blocks: int, name: str, layout: KVLayout
) -> None:
    """With ``--data-plane`` the disk tier holds real bytes: it must fit the file system."""
    if not getattr(args, "data_plane", False):
        return
    payload = layout.bytes_per_block
    fingerprint = layout_fingerprint(name, layout, payload)  # as the run names its directory
    reused = Path(args.disk_dir) / fingerprint.hex() / SLOT_FILE
    answered_in_time(lambda: check_disk_fits(args.disk_dir, disk_blocks, payload, reused), args)


def with_tiers(config: SimConfig, args: argparse.Namespace, block_tokens: int) -> SimConfig:
    """``config`` with the lower tiers the options ask for."""
    disk_params = options.admission_param_pairs(args, "disk")
    disk_blocks = 0
    if args.disk_dir is not None:
        disk_blocks = args.disk_blocks or 0
        if args.disk_gb is not None:
            disk_blocks = blocks_for_gib(args.disk_gb, config.layout, block_tokens)
            if disk_blocks == 0:  # else "needs a size of >= 1 block", as if none were given
                block = config.kv_layout(block_tokens).bytes_per_block
                raise InvalidArgumentError(
                    f"--disk-gb {args.disk_gb:g} holds no block of {output.size(block)} "
                    f"({config.layout}, {block_tokens} tokens); give the disk tier at least one"
                )
            options.check_admission_fits(
                args.disk_admission,
                disk_params,
                disk_blocks,
                f"--disk-gb {args.disk_gb:g} ({disk_blocks:,} blocks)",
                "--disk-admission",
            )
        _check_capacity(disk_blocks, "--disk-gb" if args.disk_gb is not None else "--disk-blocks")
        _check_disk_space(args, disk_blocks, config.layout, config.kv_layout(block_tokens))
    return dataclasses.replace(
        config,
        disk_dir=args.disk_dir,
        disk_blocks=disk_blocks,
        remote_url=args.remote,
        tier_store_threshold=args.tier_store_threshold,
        disk_admission=args.disk_admission,
        disk_write_budget=args.disk_write_budget,
        disk_admission_params=disk_params,
        remote_admission=args.remote_admission,
        remote_write_budget=args.remote_write_budget,
        remote_admission_params=options.admission_param_pairs(args, "remote"),
        remote_blocks=args.remote_blocks or 0,
        disk_policy=args.disk_policy,
        disk_timeout_ms=args.disk_timeout_ms or DEFAULT_TIMEOUT_MS,
        disk_gb_per_s=_given_or(args.disk_gb_per_s, tier_model.DISK_GB_PER_S),
        disk_latency_ms=_given_or(args.disk_latency_ms, tier_model.DISK_LATENCY_MS),
        remote_gb_per_s=_given_or(args.remote_gb_per_s, tier_model.REMOTE_GB_PER_S),
        remote_latency_ms=_given_or(args.remote_latency_ms, tier_model.REMOTE_LATENCY_MS),
    )


def _given_or(value: float | None, default: float) -> float:
    return default if value is None else value


def separate_disk_dirs(configs: list[SimConfig]) -> list[SimConfig]:
    """One disk subdirectory per configuration, so no run reads another's blocks and
    parallel runs never share files: named by every setting a sweep varies (the admission
    by its canonical name), and numbered from the second on when two runs share those."""
    separate = []
    seen: dict[str, int] = {}
    for config in configs:
        if config.disk_dir is None:
            separate.append(config)
            continue
        name = (
            f"cpu{config.cpu_blocks}-{config.policy}-t{config.store_threshold}"
            f"-{resolve_admission(config.admission)}"
        )
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            name += f"-{seen[name]}"
        separate.append(dataclasses.replace(config, disk_dir=str(Path(config.disk_dir) / name)))
    return separate


def check_one_run_with_remote(args: argparse.Namespace, runs: int) -> None:
    """A shared tier is shared by the runs of a sweep too: each would hit the blocks the
    others stored, and its row would be wrong. Refused unless the sweep is one run."""
    if args.remote is not None and runs > 1:
        raise InvalidArgumentError(
            f"--remote: the {runs} runs of this sweep would share the server's blocks and "
            "read each other's; sweep one configuration with --remote, or run simulate "
            "once per configuration against an emptied server"
        )


def tier_rows(report: RunReport) -> list[tuple[str, str]]:
    """Table rows for the lower tiers of a run (none without them)."""
    rows = []
    for name, entry in report.tiers.items():
        if name == "cpu":
            continue
        rows.append(
            (
                f"{name} tier",
                f"{output.count(entry['hit_blocks'])} blocks hit "
                f"({output.size(entry['read_bytes'])}, modelled "
                f"{output.seconds(entry.get('read_seconds'), 3)}), "
                f"{output.count(entry['stored_blocks'])} stored "
                f"({output.size(entry['written_bytes'])}), "
                f"{output.count(entry['failed'])} failed, {output.count(entry['corrupt'])} corrupt",
            )
        )
        if entry.get("admission", "none") != "none":
            rows.append(
                (
                    "",
                    f"admission {entry['admission']}: {output.count(entry['admitted_blocks'])} "
                    f"of {output.count(entry['offered_blocks'])} offered blocks admitted",
                )
            )
        if "recovered" in entry:
            rows.append(
                (
                    "",
                    f"on start: {output.count(entry['recovered'])} blocks recovered, dropped "
                    f"{output.count(entry['dropped_torn'])} torn, "
                    f"{output.count(entry['dropped_foreign'])} foreign, "
                    f"{output.count(entry['dropped_corrupt'])} corrupt, "
                    f"{output.count(entry['dropped_duplicate'])} duplicate, "
                    f"{output.count(entry['dropped_beyond_capacity'])} beyond capacity",
                )
            )
        if "whatif" in entry:  # the tier's own optimiser
            rows += output.whatif_rows(
                entry["admission_candidate"], entry["admission_switches"], entry["whatif"]
            )
    return rows
