"""``kvoffload bench transfer``: the data plane's copy benchmark, run from the command line.

The benchmark lives with the data plane (``kvoffload.dataplane.bench``) and
needs torch, so it is imported only when this command is chosen; it adds
its own options to the parser and returns its results as a dictionary.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from kvoffload.cli import options, output, tier_options
from kvoffload.cli.progress import ProgressBar
from kvoffload.core.errors import InsufficientMemoryError, InvalidArgumentError, KVOffloadError
from kvoffload.core.layout import layout_preset

BENCH_MODULE = "kvoffload.dataplane.bench"
ALLOCATION_MODULE = "kvoffload.dataplane.allocation"


def register(commands: Any) -> argparse.ArgumentParser:
    """Add ``bench transfer``; its options come later, from :func:`add_transfer_options`."""
    bench = commands.add_parser("bench", help="micro-benchmarks", description="Micro-benchmarks.")
    kinds = bench.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    transfer: argparse.ArgumentParser = kinds.add_parser(
        "transfer",
        help="GPU<->CPU block copy throughput of the data plane (needs torch)",
        description="Measure the data plane's block copy throughput.",
    )
    transfer.set_defaults(run=run)
    tiers = kinds.add_parser(
        "tiers",
        help="store and load GB/s of the disk and shared tiers against plain file and socket I/O",
        description="Measure the disk tier against a plain sequential file write/read of the same "
        "bytes, and the shared tier (with --remote) against pipelined SET/GET on a raw socket "
        "per node, each GET reply read with recv_into straight into its buffer.",
    )
    tiers.add_argument(
        "--blocks", type=options.BLOCKS, default=128, help="blocks per round (default: 128)"
    )
    tiers.add_argument(
        "--block-mib",
        type=options.number(0.0, allow_minimum=False, maximum=options.MAX_BLOCK_MIB),
        default=2.0,
        help="MiB per block (default: 2, an 8B model's)",
    )
    tiers.add_argument(
        "--rounds", type=options.POSITIVE_INT, default=3, help="best of this many (default: 3)"
    )
    tiers.add_argument("--dir", help="directory for the disk tier (default: a temporary one)")
    tiers.add_argument("--remote", metavar="URL", help="also measure the shared tier at URL")
    tiers.add_argument(
        "--fsync",
        action="store_true",
        help="the disk tier syncs each batch, the plain file once written (power-loss safety)",
    )
    tier_options.add_disk_timeout_argument(tiers)
    tiers.add_argument(
        "--sglang",
        nargs="?",
        const="v1,copy",
        metavar="INTERFACES",
        help="instead, pages through the SGLang HiCache backend (v1, copy or both, the default) "
        "against the same bytes stored plainly (the disk tier with one buffer per page, "
        "pipelined SET/GET on a raw socket for the shared tier), for MHA "
        "page_first/layer_first and MLA; --blocks pages of about --block-mib each",
    )
    tiers.add_argument("--json", metavar="PATH", help="write the results as JSON (- stdout)")
    options.add_progress_argument(tiers)
    tiers.set_defaults(run=run_tiers)
    return transfer


def _bench_module() -> ModuleType:
    try:
        return importlib.import_module(BENCH_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name is not None and BENCH_MODULE.startswith(exc.name):
            raise KVOffloadError(
                "the transfer benchmark needs kvoffload's data plane, which is not installed"
            ) from None
        raise KVOffloadError(
            f"the transfer benchmark needs {exc.name}; install it with: "
            "pip install 'kvoffload[torch]'"
        ) from None


def add_transfer_options(parser: argparse.ArgumentParser) -> None:
    """Import the benchmark and let it register its options, then add ``--json`` and
    ``--progress``."""
    _bench_module().add_cli_arguments(parser, options.integer)
    with contextlib.suppress(argparse.ArgumentError):  # unless the benchmark has its own
        parser.add_argument("--json", metavar="PATH", help="write the results as JSON (- stdout)")
    with contextlib.suppress(argparse.ArgumentError):
        options.add_progress_argument(parser)


def _check_dir(path: str | None) -> None:
    """``bench tiers --dir``: an existing writable directory, where its scratch directory
    is made (named by the error otherwise, as "Not a directory: DIR/kvoffload-bench-...")."""
    if path is None:
        return
    if not os.path.isdir(path):
        raise InvalidArgumentError(f"--dir {path}: not an existing directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise InvalidArgumentError(f"--dir {path}: not writable")


def _check_json(args: argparse.Namespace) -> None:
    """A benchmark takes minutes: an unwritable ``--json`` is refused before it starts."""
    path = getattr(args, "json", None)
    if path:
        output.check_writable_file(path, "--json")


def _check_transfer(args: argparse.Namespace) -> None:
    """Refuse, naming the options, what the benchmark refuses naming its parameters ("512
    CPU blocks of 1 GPU blocks do not fit in 512 GPU blocks") or torch only as it allocates
    (and fills: a buffer beyond memory is the kernel's out-of-memory kill)."""
    options.check_name(args.layout, "--layout", layout_preset)
    gpu, cpu, factor = args.gpu_blocks, args.cpu_blocks, args.block_size_factor
    if cpu * factor > gpu:
        raise InvalidArgumentError(
            f"--cpu-blocks {cpu} of --block-size-factor {factor} GPU blocks each take "
            f"{cpu * factor:,} GPU blocks, more than --gpu-blocks {gpu}"
        )
    on_cpu = options.device_on_cpu(importlib.import_module(ALLOCATION_MODULE), args.device)
    block = layout_preset(args.layout).bytes_per_block
    options.check_kv_buffers_fit(
        options.KVBuffer(gpu, block, f"--gpu-blocks {gpu}"),
        options.KVBuffer(cpu, factor * block, f"--cpu-blocks {cpu}"),
        on_cpu,
    )


def run(args: argparse.Namespace) -> int:
    _check_json(args)
    _check_transfer(args)
    bar = ProgressBar("bench transfer", ProgressBar.wanted(args.progress))
    try:
        results: dict[str, Any] = _bench_module().run_from_args(args, bar)
    finally:
        bar.close()
    _report(args, results)
    return 0


def _report(args: argparse.Namespace, results: dict[str, Any]) -> None:
    path = getattr(args, "json", None)
    if path:
        output.write_json(path, results)
    if path != "-":
        output.show(transfer_table(results))


TRANSFER_FIGURES = (
    "layout",
    "device",
    "threads",
    "block_bytes",
    "block_size_factor",
    "bytes_per_job",
    "jobs_per_round",
    "rounds",
    "store_gbps",
    "load_gbps",
    "copy_gbps",
    "store_vs_copy",
    "load_vs_copy",
)
"""The transfer benchmark's figures that :func:`transfer_table` words; any other it
returns is shown as it is named, after them."""


def transfer_table(results: dict[str, Any]) -> str:
    """The transfer benchmark's figures for people, as ``bench tiers`` shows its own: sizes
    in binary units, rates in GB/s beside the plain copy's (its keys and bare numbers,
    ``bytes_per_job 262144``, were the table)."""
    worded = all(name in results for name in TRANSFER_FIGURES)  # else each as it is named
    rest = [
        (str(name), value if isinstance(value, str) else json.dumps(value))
        for name, value in results.items()
        if not (worded and name in TRANSFER_FIGURES)
    ]
    if not worded:
        return output.key_value_table(rest) if rest else "(no results)"
    r = results
    offloaded = r["block_bytes"] * r["block_size_factor"]
    per_job = r["bytes_per_job"] // offloaded if offloaded else 0
    gpu_blocks = output.counted(r["block_size_factor"], "GPU block")
    rows = [
        ("layout", f"{r['layout']}, {output.size(r['block_bytes'])} per GPU block"),
        ("device", f"{r['device']}, {output.counted(r['threads'], 'torch thread')}"),
        ("offloaded block", f"{output.size(offloaded)} ({gpu_blocks})"),
        (
            "job",
            f"{output.size(r['bytes_per_job'])} ({output.counted(per_job, 'block')}), "
            f"{r['jobs_per_round']:,} per round",
        ),
        ("rounds", f"median of {r['rounds']:,}, after one warm-up round"),
        ("store", f"{r['store_gbps']:.3f} GB/s, {r['store_vs_copy']:.3f} of a plain copy's"),
        ("load", f"{r['load_gbps']:.3f} GB/s, {r['load_vs_copy']:.3f} of a plain copy's"),
        ("plain copy", f"{r['copy_gbps']:.3f} GB/s"),
    ]
    return output.key_value_table(rows + rest)


def _check_block_mib(block_mib: float) -> None:
    """Refuse a block below the benchmark's least, naming ``--block-mib``."""
    from kvoffload.tiers.bench import MIB, MIN_BLOCK_BYTES

    size = int(block_mib * MIB)
    if size < MIN_BLOCK_BYTES:
        raise InvalidArgumentError(
            f"--block-mib {block_mib:g} is a block of {size} bytes: at least {MIN_BLOCK_BYTES} "
            f"({MIN_BLOCK_BYTES / MIB:g} MiB) are needed"
        )


@contextlib.contextmanager
def _sized_by_blocks(args: argparse.Namespace) -> Iterator[None]:
    """A benchmark's buffers beyond memory named by the options that size them (the
    benchmark names only its figures: "100000 blocks of 1024 MiB would need ...")."""
    try:
        yield
    except InsufficientMemoryError as exc:
        raise InsufficientMemoryError(
            f"--blocks {args.blocks} --block-mib {args.block_mib:g}: {exc}"
        ) from None


def run_tiers(args: argparse.Namespace) -> int:
    """``bench tiers``: torch-free; the shared tier's client is needed only with ``--remote``."""
    from kvoffload.tiers.bench import measure_tiers
    from kvoffload.tiers.disk import DEFAULT_TIMEOUT_MS

    _check_json(args)
    _check_dir(args.dir)
    if args.remote is not None:  # else found only after the disk tier's rounds
        tier_options.check_remote(args.remote)
    if args.sglang is not None:
        return _run_sglang(args)
    _check_block_mib(args.block_mib)
    bar = ProgressBar("bench tiers", ProgressBar.wanted(args.progress))
    try:
        with _sized_by_blocks(args):
            results = measure_tiers(
                args.blocks,
                args.block_mib,
                args.rounds,
                args.dir,
                args.remote,
                fsync=args.fsync,
                disk_timeout_ms=args.disk_timeout_ms or DEFAULT_TIMEOUT_MS,
                progress=bar,
            )
    finally:
        bar.close()
    if args.json:
        output.write_json(args.json, results)
    if args.json != "-":
        output.show(tier_table(results))
    return 0


def _run_sglang(args: argparse.Namespace) -> int:
    """``bench tiers --sglang``: needs torch and SGLang's storage modules, imported only here."""
    if args.fsync:
        raise KVOffloadError(
            "bench tiers: --fsync is for the plain tier benchmark; --sglang measures the "
            "backend's disk tier as SGLang runs it (no --fsync)"
        )
    if args.disk_timeout_ms is not None:  # it would be ignored, unsaid
        raise KVOffloadError(
            "bench tiers: --disk-timeout-ms is for the plain tier benchmark; --sglang measures "
            "the backend's disk tier with its default deadline"
        )
    try:
        from kvoffload.integrations.sglang.bench import (
            SHAPES,
            check_page_mib,
            measure_sglang,
            parse_interfaces,
            table_rows,
        )
    except ImportError as exc:
        raise KVOffloadError(f"bench tiers --sglang needs {exc.name}; see docs/sglang.md") from None
    interfaces = parse_interfaces(args.sglang)
    try:
        check_page_mib(args.block_mib)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"--block-mib {args.block_mib:g}: {exc}") from None
    bar = ProgressBar("bench tiers --sglang", ProgressBar.wanted(args.progress))
    total = len(SHAPES) * len(interfaces) * (1 if args.remote is None else 2)
    started = 0

    def row_starts(row: str) -> None:
        nonlocal started
        bar(started, total)
        started += 1

    try:
        with _sized_by_blocks(args):
            results = measure_sglang(
                args.blocks,
                args.block_mib,
                args.rounds,
                args.dir,
                args.remote,
                interfaces,
                row_starts,
            )
        bar(total, total)
    finally:
        bar.close()
    if args.json:
        output.write_json(args.json, results)
    if args.json != "-":
        headers, rows, note = table_rows(results)
        output.show(output.column_table(headers, rows) + "\n" + note)
    return 0


def tier_table(results: dict[str, Any]) -> str:
    """One row per measured tier: its GB/s beside the plain baseline's, and the ratios."""
    from kvoffload.tiers.bench import shown_figure

    headers = ["tier", "store GB/s", "plain", "ratio", "median"]
    headers += ["load GB/s", "plain", "ratio", "median"]
    figures = ["store_gbps", "plain_write_gbps", "store_ratio", "store_ratio_median"]
    figures += ["load_gbps", "plain_read_gbps", "load_ratio", "load_ratio_median"]
    rows = [
        [tier, *(shown_figure(results[f"{tier}_{figure}"]) for figure in figures)]
        for tier in ("disk", "remote")
        if f"{tier}_store_gbps" in results
    ]
    size = output.size(results["block_bytes"])
    rounds = results["rounds"]
    note = (
        f"{output.counted(results['blocks'], 'block')} of {size}; rates and ratios of the "
        f"best of {rounds} round{'s' * (rounds != 1)}, median of the rounds' own ratios"
    )
    if results.get("fsync"):
        note += "; synced to disk"
    return output.column_table(headers, rows) + "\n" + note
