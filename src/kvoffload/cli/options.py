"""Command-line options shared by the subcommands, and their translation into library objects."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

from kvoffload.admission import admission_params, parse_pairs
from kvoffload.admission.budget import DWPD, WriteBudget, parse_bytes
from kvoffload.admission.params import describe_params, read_number
from kvoffload.admission.registry import (
    NO_ADMISSION,
    ParamPairs,
    params_class,
    resolve_admission,
)
from kvoffload.admission.reuse_counts import (
    COMPILED_BYTES_PER_KEY,
    MAX_STORE_THRESHOLD,
    MAX_TRACKED_KEYS,
    CompiledReuseCounts,
)
from kvoffload.cli import output
from kvoffload.cli.progress import ProgressBar
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.core.layout import LAYOUT_PRESETS, layout_preset
from kvoffload.core.memory import check_fits
from kvoffload.core.specs import CPULoadStoreSpec
from kvoffload.managers.admit_all import admission_book
from kvoffload.sim.engine import PARTIAL_BLOCK_MODES
from kvoffload.sim.generators import (
    DEFAULT_BLOCK_TOKENS,
    DEFAULT_MIX,
    DEFAULT_RATE,
    DEFAULT_REQUESTS,
    RateTooLowError,
    estimated_bytes,
    parse_mix,
    rate_too_low,
)
from kvoffload.sim.gpu_cache import BYTES_PER_SLOT
from kvoffload.sim.plots import PLOT_FILES
from kvoffload.sim.run import SimConfig, blocks_for_gib
from kvoffload.sim.sources import WorkloadSource
from kvoffload.sim.traces import TRACE_FORMATS
from kvoffload.sim.workload import Workload

_T = TypeVar("_T")


def integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``minimum`` (and <= ``maximum``), or one clear
    usage error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {value}")
        return value

    return parse


def number(
    minimum: float, allow_minimum: bool = True, maximum: float = math.inf
) -> Callable[[str], float]:
    """An argparse ``type``: a finite number >= (or >) ``minimum`` and <= ``maximum``, as
    written (:func:`~kvoffload.admission.params.read_number`)."""

    def parse(text: str) -> float:
        try:
            return read_number(text, minimum, maximum, above_low=not allow_minimum)
        except InvalidArgumentError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


POSITIVE_INT = integer(1)
COUNT = integer(0)
STORE_THRESHOLD = integer(0, MAX_STORE_THRESHOLD)
TRACKER_SIZE = integer(1, MAX_TRACKED_KEYS)
MAX_GIB = float(2**50)
"""The largest capacity in GiB (a yobibyte): far beyond any machine, and its bytes are finite."""
MAX_BLOCK_TOKENS = 2**20
"""The most tokens per block: a million-token context in one block. Beyond it a block's
bytes soon pass what a float holds, and the sizes in the report with them."""
BLOCK_TOKENS = integer(1, MAX_BLOCK_TOKENS)
MAX_BLOCKS = max(blocks_for_gib(MAX_GIB, layout, 1) for layout in LAYOUT_PRESETS)
"""The most blocks a capacity in blocks may have: what :data:`MAX_GIB` holds in the
smallest block of any layout (one token), the most a capacity in GiB can reach."""
BLOCKS = integer(1, MAX_BLOCKS)
BLOCKS_OR_NONE = integer(0, MAX_BLOCKS)
MAX_BLOCK_MIB = MAX_GIB * 1024
"""The largest block in MiB ``bench tiers`` takes: the largest capacity, in one block."""
POSITIVE = number(0.0, allow_minimum=False)
SIZE_GIB = number(0.0, maximum=MAX_GIB)
POSITIVE_GIB = number(0.0, allow_minimum=False, maximum=MAX_GIB)


def _usage(parse: Callable[[str], _T], prefix: str) -> Callable[[str], _T]:
    """An argparse ``type`` from a library parser: its error becomes the usage error."""

    def parse_text(text: str) -> _T:
        try:
            return parse(text)
        except InvalidArgumentError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(prefix)) from None

    return parse_text


WRITE_BUDGET = _usage(WriteBudget.parse, "write budget: ")
DRIVE_BYTES = _usage(lambda text: parse_bytes(text, "drive size"), "drive size: ")

DEFAULT_GPU_GIB = 24.0
DEFAULT_CPU_GIB = 96.0
DEFAULT_LAYOUT = "llama-3.1-8b"
DEFAULT_MAX_TRACKER_SIZE = SimConfig.max_tracker_size


def add_write_budget_arguments(group: argparse._ArgumentGroup) -> None:
    """``--write-budget`` in one of three units, and the drive size drive writes need."""
    group.add_argument(
        "--write-budget",
        type=WRITE_BUDGET,
        default=None,
        metavar="W",
        help="with --admission recommended: at most W offload writes per block reference "
        "(0.2), bytes per second (200MB/s, 1GiB/s) or drive writes per day (1dwpd)",
    )
    group.add_argument(
        "--drive-bytes",
        type=DRIVE_BYTES,
        default=None,
        metavar="SIZE",
        help="the drive's size for a budget in drive writes per day, e.g. 1.92TB "
        "(default: the disk tier's size)",
    )


def add_trace_format_arguments(group: argparse._ActionsContainer, default_note: str = "") -> None:
    """``--format`` and ``--block-size``, as every command that reads a trace takes them;
    ``default_note`` adds to the block size's default (a synthetic workload's)."""
    group.add_argument(
        "--format",
        default="auto",
        choices=("auto", *TRACE_FORMATS),
        help="trace schema (default: detect; mooncake and lmbench have 512-token blocks, "
        "qwen 16; --block-size names another)",
    )
    group.add_argument(
        "--block-size",
        type=BLOCK_TOKENS,
        metavar="TOKENS",
        help="tokens per block, for a trace the size its hash_ids were keyed with "
        f"(default: the trace format's{default_note})",
    )


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload (a trace, or a synthetic mix by default)")
    group.add_argument("--trace", metavar="PATH", help="replay this trace file")
    add_trace_format_arguments(group, "; 16 for synthetic workloads")
    # Unset by default (None), so that one given with --trace, which it cannot shape, is
    # refused rather than ignored; the defaults are WorkloadSource's.
    mix = ",".join(f"{kind}={weight:g}" for kind, weight in DEFAULT_MIX.items())
    group.add_argument(
        "--mix",
        help="synthetic kinds and weights, from chat, rag, agent, oneshot, longchat "
        f"(default: {mix})",
    )
    group.add_argument(
        "--requests",
        type=POSITIVE_INT,
        help=f"synthetic requests (default: {DEFAULT_REQUESTS})",
    )
    group.add_argument("--seed", type=COUNT, help="synthetic workload seed (default: 0)")
    group.add_argument(
        "--rate",
        type=POSITIVE,
        help=f"synthetic arrivals per second (default: {DEFAULT_RATE:g})",
    )


SYNTHETIC_OPTIONS = ("mix", "requests", "seed", "rate")
"""What shapes a synthetic workload, and nothing of a trace's."""


def workload_source(args: argparse.Namespace, workers: int = 0) -> WorkloadSource:
    """The workload the options describe, a synthetic one refused if the machine cannot
    draw it in this process and in each of ``workers`` (a sweep's, each drawing its own)."""
    given = {name: getattr(args, name) for name in SYNTHETIC_OPTIONS}
    given = {name: value for name, value in given.items() if value is not None}
    if args.trace is not None:
        if given:
            raise InvalidArgumentError(
                f"--{next(iter(given))} shapes a synthetic workload, and --trace replays the "
                "trace's own requests: give one or the other"
            )
        return WorkloadSource(trace=args.trace, fmt=args.format, block_tokens=args.block_size)
    if args.format != "auto":
        raise InvalidArgumentError(f"--format {args.format} names a trace's schema: give --trace")
    if "mix" in given:
        try:
            given["mix"] = tuple(parse_mix(args.mix).items())
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"--mix {args.mix}: {exc}") from None
    _check_synthetic_fits(args, given, workers)
    return WorkloadSource(block_tokens=args.block_size, **given)


def _check_synthetic_fits(args: argparse.Namespace, given: dict[str, Any], workers: int) -> None:
    """Refuse a synthetic workload the machine cannot draw, here and in ``workers`` more
    processes, naming the options that size it (else refused by the generator, naming
    none; a sweep's workers, killed for memory, named nothing)."""
    requests = given.get("requests", DEFAULT_REQUESTS)
    block_tokens = args.block_size or DEFAULT_BLOCK_TOKENS
    count = f"--requests {requests}" if "requests" in given else f"{requests:,} synthetic requests"
    mix = f"--mix {args.mix}" if "mix" in given else "the default mix"
    size = f"--block-size {block_tokens}" if args.block_size else f"{block_tokens} tokens per block"
    what = f"{count} of {mix} at {size}"
    if workers:
        what = f"--jobs {args.jobs}: {what}, drawn by each of {workers} workers and here,"
    check_fits(
        (workers + 1)
        * estimated_bytes(dict(given.get("mix", DEFAULT_MIX.items())), requests, block_tokens),
        what,
    )


def load_workload(source: WorkloadSource, progress: bool | None) -> Workload:
    """``source``'s workload, with a bar while a trace is read or a mix drawn (``--progress``
    as asked, or by default on a terminal): a large one takes minutes before the run's own
    bar starts."""
    label = "reading trace" if source.trace is not None else "generating workload"
    bar = ProgressBar(label, ProgressBar.wanted(progress))
    try:
        return source.load(bar)
    except RateTooLowError:  # found only as arrivals are drawn; named as the generator's
        raise rate_too_low(source.rate, "--rate") from None
    finally:
        bar.close()


def add_gpu_arguments(group: argparse._ActionsContainer) -> None:
    """``--gpu-blocks`` / ``--gpu-gb`` in ``group`` (a parser, or the help's section of
    the GPU cache and its tiers)."""
    gpu = group.add_mutually_exclusive_group()
    gpu.add_argument(
        "--gpu-blocks", type=BLOCKS, metavar="N", help="GPU prefix cache size in blocks"
    )
    gpu.add_argument(
        "--gpu-gb",
        type=POSITIVE_GIB,
        metavar="X",
        help=f"GPU prefix cache size in GiB of KV (default: {DEFAULT_GPU_GIB:g})",
    )


def check_write_budget_runs(args: argparse.Namespace) -> None:
    """``--write-budget`` needs the optimiser, and drive writes per day a drive: refused
    before the workload is built, as a lower tier's budget is (the run's settings refuse
    them too, once the trace has been read)."""
    budget: WriteBudget | None = args.write_budget
    if budget is None:
        return
    if resolve_admission(args.admission) != "optimiser":
        raise InvalidArgumentError(
            f"a write budget needs --admission recommended (the optimiser), not {args.admission!r}"
        )
    if budget.unit == DWPD and args.drive_bytes is None and args.disk_dir is None:
        raise InvalidArgumentError(
            f"a write budget of {budget.describe()} needs the drive's size: --drive-bytes, "
            "or a disk tier (--disk-dir), whose size is taken"
        )


def check_tracker_size_used(args: argparse.Namespace, thresholds: Sequence[int], need: str) -> None:
    """Refuse ``--max-tracker-size`` when no run has a store filter (a threshold of 2 or
    more), whose table it sizes: it would be ignored, unsaid. ``need`` says what to give."""
    if args.max_tracker_size is not None and all(threshold < 2 for threshold in thresholds):
        raise InvalidArgumentError(
            f"--max-tracker-size sizes the store filter's reuse table: it needs {need}"
        )
    if args.max_tracker_size is not None and CompiledReuseCounts is not None:
        # Else refused as the run builds its table (the compiled one fills it up front),
        # naming no option: in a sweep, after the runs before it.
        keys = args.max_tracker_size
        check_fits(
            keys * COMPILED_BYTES_PER_KEY,
            f"--max-tracker-size {keys} (a reuse count table of {keys:,} keys)",
        )


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine model")
    group.add_argument(
        "--layout",
        help="KV layout preset that turns blocks into bytes, one of "
        f"{', '.join(sorted(LAYOUT_PRESETS))} (default: {DEFAULT_LAYOUT})",
    )
    group.add_argument(  # no default here: given with no store filter, it is refused
        "--max-tracker-size",
        type=TRACKER_SIZE,
        help=f"reuse filter's tracked keys (default: {DEFAULT_MAX_TRACKER_SIZE})",
    )
    group.add_argument(
        "--concurrency",
        type=POSITIVE_INT,
        default=1,
        help="requests in flight at once, following arrival times (default: 1, sequential)",
    )
    group.add_argument(
        "--prefill-tokens-per-s",
        type=POSITIVE,
        default=10_000.0,
        help="prefill throughput in tokens per second, from which the report's prefill "
        "times are reckoned (default: 10000)",
    )
    group.add_argument(
        "--decode-tokens-per-s",
        type=POSITIVE,
        default=50.0,
        help="decode speed of one request in tokens per second (default: 50)",
    )
    group.add_argument(
        "--transfer-gb-per-s",
        type=POSITIVE,
        default=25.0,
        help="GPU<->offload bandwidth per direction in GB/s (default: 25)",
    )
    group.add_argument(
        "--partial-block",
        choices=PARTIAL_BLOCK_MODES,
        default="cache",
        help="a prompt's keyed partial last block: cache it like a full one, or drop it as "
        "vLLM does (computed, never cached or offloaded) (default: cache)",
    )


def add_progress_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: only when stderr is a terminal)",
    )


def _blocks(blocks: int | None, gib: float | None, default_gib: float, layout: str, bt: int) -> int:
    if blocks is not None:
        if blocks < 0:
            raise InvalidArgumentError(f"a capacity in blocks must be >= 0, got {blocks}")
        return blocks
    return blocks_for_gib(default_gib if gib is None else gib, layout, bt)


def gpu_size(args: argparse.Namespace) -> str:
    """The GPU prefix cache's size as it was given, for an error to name: the option as
    typed, or the default."""
    if args.gpu_blocks is not None:
        return f"--gpu-blocks {args.gpu_blocks}"
    if args.gpu_gb is not None:
        return f"--gpu-gb {args.gpu_gb:g}"
    return f"the default GPU size, {DEFAULT_GPU_GIB:g} GiB,"


def _gpu_cache_of(size: str, blocks: int) -> str:
    return f"{size} (a GPU prefix cache of {output.counted(blocks, 'block')})"


def base_config(args: argparse.Namespace, block_tokens: int, default_layout: str) -> SimConfig:
    """The run configuration from the engine and GPU options; offload tier still empty."""
    layout = args.layout or default_layout
    gpu_blocks = _blocks(args.gpu_blocks, args.gpu_gb, DEFAULT_GPU_GIB, layout, block_tokens)
    if gpu_blocks == 0:  # only a size in GiB gives none (--gpu-blocks is at least 1)
        block = layout_preset(layout).with_block_size(block_tokens).bytes_per_block
        raise InvalidArgumentError(
            f"{gpu_size(args)} holds no block of {output.size(block)} "
            f"({layout}, {block_tokens} tokens); give the GPU at least one"
        )
    # Else refused by the GPU cache as the run starts, naming no option.
    check_fits(gpu_blocks * BYTES_PER_SLOT, _gpu_cache_of(gpu_size(args), gpu_blocks))
    return SimConfig(
        gpu_blocks=gpu_blocks,
        cpu_blocks=0,
        max_tracker_size=(
            DEFAULT_MAX_TRACKER_SIZE if args.max_tracker_size is None else args.max_tracker_size
        ),
        layout=layout,
        concurrency=args.concurrency,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_tokens_per_s=args.decode_tokens_per_s,
        transfer_gb_per_s=args.transfer_gb_per_s,
        partial_block=args.partial_block,
    )


def check_gpu_holds_requests(args: argparse.Namespace, workload: Workload, gpu_blocks: int) -> None:
    """Refuse a GPU cache smaller than the workload's longest request, naming its size as
    given: the engine refuses it only as the run starts (in a sweep, as the failure of its
    first run, after the workers start), saying only "give the GPU more blocks"."""
    longest = max((len(request.keys) for request in workload.requests), default=0)
    if longest > gpu_blocks:
        raise InvalidArgumentError(
            f"{_gpu_cache_of(gpu_size(args), gpu_blocks)} cannot hold the workload's longest "
            f"request, of {longest:,} blocks; give the GPU at least that many"
        )


def check_simulated_time(workload: Workload, config: SimConfig, transfers: bool) -> None:
    """Refuse a replay whose simulated clock could pass what a float holds, naming the
    options whose times make it: the engine refuses only when its clock gets there (after
    the requests before, in a sweep after the runs before), naming none of them.

    Past the last arrival some prefill, decode, transfer (``transfers``: with an offload
    tier) or retry is always under way, so the clock never passes the last arrival plus
    every request's whole prefill, decode and transfer of all its blocks: while that sum
    is finite, so is the clock. Named are its largest parts that alone pass a float.
    """
    requests = workload.requests
    if not requests:
        return
    engine = config.engine_config(workload.block_tokens)
    prompt = sum(request.input_tokens for request in requests)
    answer = sum(request.output_tokens for request in requests)
    parts = [
        (
            _seconds(prompt, config.prefill_tokens_per_s),
            f"{_count(prompt)} prompt tokens at --prefill-tokens-per-s "
            f"{config.prefill_tokens_per_s:g}",
        ),
        (
            _seconds(answer, config.decode_tokens_per_s),
            f"{_count(answer)} output tokens at --decode-tokens-per-s "
            f"{config.decode_tokens_per_s:g}",
        ),
    ]
    last = max(request.arrival_s for request in requests)
    parts.append((last, f"arrivals until {last:.3g} s"))
    if transfers:
        blocks = sum(len(request.keys) for request in requests)
        parts.append(
            (
                _seconds(blocks * engine.bytes_per_block, engine.transfer_bytes_per_s),
                f"{_count(blocks)} blocks of {output.size(engine.bytes_per_block)} at "
                f"--transfer-gb-per-s {config.transfer_gb_per_s:g}",
            )
        )
    retries = len(requests) * engine.max_lookup_retries * engine.lookup_retry_s
    if math.isfinite(sum(seconds for seconds, _ in parts) + retries):
        return
    named: list[str] = []
    clock = 0.0
    for seconds, what in sorted(parts, key=lambda part: part[0], reverse=True):
        clock += seconds
        named.append(what)
        if math.isinf(clock):
            break
    raise InvalidArgumentError(
        f"the workload's {' and '.join(named)} take more seconds than the simulated clock "
        "(a float) can count"
    )


def _seconds(amount: int, per_second: float) -> float:
    """``amount`` at ``per_second``; ``inf`` past a float (an int past it cannot divide)."""
    try:
        return amount / per_second
    except OverflowError:
        return math.inf


def _count(amount: int) -> str:
    """A count as a reader takes it in: digits up to a quadrillion, beyond it a power of ten."""
    if amount < 10**15:
        return f"{amount:,}"
    return f"about 10^{int((amount.bit_length() - 1) * math.log10(2))}"


def cpu_blocks(blocks: int | None, gib: float | None, config: SimConfig, block_tokens: int) -> int:
    """Offload capacity in blocks, from ``--cpu-blocks`` or ``--cpu-gb`` (or the default)."""
    if blocks is None and gib is not None:
        return cpu_blocks_for_gib(gib, config.layout, block_tokens)
    return _blocks(blocks, gib, DEFAULT_CPU_GIB, config.layout, block_tokens)


def cpu_blocks_for_gib(gib: float, layout: str, block_tokens: int) -> int:
    """The blocks ``--cpu-gb`` gives; a size above 0 that holds none is refused, so a
    typo in the unit does not silently run with no offload tier (0 asks for none)."""
    blocks = blocks_for_gib(gib, layout, block_tokens)
    if blocks == 0 and gib > 0:
        block = layout_preset(layout).with_block_size(block_tokens).bytes_per_block
        raise InvalidArgumentError(
            f"--cpu-gb {gib:g} holds no block of {output.size(block)} "
            f"({layout}, {block_tokens} tokens); give 0 for no offload tier, or more"
        )
    return blocks


def with_offload(config: SimConfig, cpu: int, policy: str, threshold: int) -> SimConfig:
    return dataclasses.replace(config, cpu_blocks=cpu, policy=policy, store_threshold=threshold)


def _parts(text: str, what: str) -> list[str]:
    """The items of a comma-separated list; an empty one (``1,,2``, a trailing comma) is
    refused, as ``--mix`` refuses one, rather than dropped from the runs asked for."""
    parts = [part.strip() for part in text.split(",")]
    if any(parts) and not all(parts):
        raise InvalidArgumentError(f"{what} {text!r} has an empty item between its commas")
    return [part for part in parts if part]


def parse_ints(text: str, what: str, minimum: int = 0, maximum: int | None = None) -> list[int]:
    """A comma-separated list of integers >= ``minimum`` (and <= ``maximum``), e.g. ``"0,2"``;
    a value out of range is named as typed."""
    parts = _parts(text, what)
    try:
        values = [(part, int(part)) for part in parts]
    except ValueError:
        raise InvalidArgumentError(
            f"{what} must be comma-separated integers, got {text!r}"
        ) from None
    bad = next((part for part, value in values if value < minimum), None)
    if bad is not None:
        raise InvalidArgumentError(f"{what} values must be >= {minimum}, got {bad}")
    big = next((part for part, value in values if maximum is not None and value > maximum), None)
    if big is not None:
        raise InvalidArgumentError(f"{what} values must be <= {maximum}, got {big}")
    return _not_empty([value for _, value in values], text, what)


def parse_floats(text: str, what: str, maximum: float = math.inf) -> list[float]:
    """A comma-separated list of finite numbers >= 0 (and <= ``maximum``), e.g. ``"0,16,32.5"``,
    each read as written (``1e309``, not the ``inf`` it reads as)."""
    values = []
    for part in _parts(text, what):
        try:
            values.append(read_number(part, 0.0, maximum))
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{what}: {exc}") from None
    return _not_empty(values, text, what)


PARAM_LIST = "help"
"""The ``--admission-param`` value that lists the rule's parameters."""


def add_admission_param_argument(
    group: argparse._ActionsContainer, rules: str = "the --admission rule"
) -> None:
    """``--admission-param key=value``, repeatable: the parameters of the admission
    ``rules`` (as the help names them)."""
    group.add_argument(
        "--admission-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"a parameter of {rules}, repeatable; 'help' lists the rule's "
        "parameters with their defaults and ranges (docs/admission.md, Parameters)",
    )


def wants_param_list(args: argparse.Namespace) -> bool:
    """Whether ``--admission-param help`` asked for the rule's parameters instead of a run."""
    return PARAM_LIST in args.admission_param


def param_list(rule: str, option: str = "--admission", param_option: str = "") -> str:
    """The parameters of admission ``rule`` (as typed) as a table: name, default, range and
    what each sets; the one line of help each parameter carries is shown nowhere else.
    ``option`` chose the rule (``--disk-admission``: a lower tier's, set by
    ``--disk-admission-param``); ``param_option`` sets them where it is not ``option``'s
    name and ``-param`` (``--admissions``: ``--admission-param``)."""
    check_name(rule, option, resolve_admission)
    rows = describe_params(params_class(rule))
    if not rows:
        return f"{option} {rule} takes no parameters"
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    lines = [f"{option} {rule}: {param_option or option + '-param'} KEY=VALUE, one per key"]
    for *cells, meaning in rows:
        padded = (cell.ljust(width) for cell, width in zip(cells, widths, strict=True))
        lines.append("  " + "  ".join(padded) + "  " + meaning)
    return "\n".join(lines)


def admission_param_pairs(args: argparse.Namespace, tier: str = "") -> ParamPairs:
    """The checked ``--admission-param`` values for ``args.admission``; with ``tier``
    (``disk``, ``remote``) that tier's ``--disk-admission-param`` for ``--disk-admission``."""
    prefix = f"{tier}_" if tier else ""
    option = f"--{tier}-admission-param" if tier else "--admission-param"
    return checked_param_pairs(
        getattr(args, f"{prefix}admission"), getattr(args, f"{prefix}admission_param"), option
    )


def checked_param_pairs(rule: str, given: list[str], option: str) -> ParamPairs:
    """``given`` (``KEY=VALUE`` texts) checked as the parameters of admission ``rule``,
    sorted; an error names ``option``."""
    pairs = parse_pairs(given, option)
    try:
        admission_params(rule, pairs)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{option}: {exc}") from None
    return tuple(sorted(pairs.items()))


def check_admission_fits(
    admission: str, params: ParamPairs, blocks: int, size: str, option: str
) -> None:
    """Refuse a tier of ``blocks`` whose ``admission`` layer the machine cannot hold, naming
    the tier's ``size`` as typed (``--cpu-blocks N``) and the ``option`` that chose the rule.

    The layer's tables grow with the tier and are built as its run starts: the error came
    after the workload was read (in a sweep, after the runs before it had taken their
    time) and named the simulator's field (``cpu_blocks:``). Built here and dropped, it is
    the check each rule makes, with no rule's sizes repeated.
    """
    if blocks == 0 or resolve_admission(admission) == NO_ADMISSION:
        return
    what = f"{size} with {option} {admission}"
    admission_book(admission, CPULoadStoreSpec([]), blocks, params=params, size_key=what)


def parse_names(text: str, what: str, resolve: Callable[[str], str]) -> list[str]:
    """A comma-separated list of registry names, each checked by ``resolve`` (which lists them)."""
    names = _parts(text, what)
    for name in names:
        check_name(name, what, resolve)
    return _not_empty(names, text, what)


def check_name(name: str, what: str, resolve: Callable[[str], object]) -> None:
    """Refuse a name ``resolve`` does not know, naming the option ``what``."""
    try:
        resolve(name)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{what}: {exc}") from None


def _not_empty(values: list[_T], text: str, what: str) -> list[_T]:
    if not values:
        raise InvalidArgumentError(f"{what} needs at least one value, got {text!r}")
    return values


def _check_apart_from_plots(outputs: list[tuple[str, str]], plot_dir: str) -> None:
    """Refuse a result file at the plot directory (its creation would fail after the
    sweep) or at one of its plots (which would overwrite the results)."""
    for option, path in outputs:
        if path == "-":
            continue
        if output.same_file(path, plot_dir):
            raise InvalidArgumentError(f"{option} {path} is the --plot-dir; write elsewhere")
        for name in PLOT_FILES:
            if output.same_file(path, os.path.join(plot_dir, name)):
                raise InvalidArgumentError(
                    f"{option} {path} is the plot {name} that --plot-dir writes; write elsewhere"
                )


def check_trace_file(path: str, what: str) -> None:
    """Refuse ``-``: a trace is read from a file (``sweep`` reads it once per run), never
    from standard input, while an output's ``-`` is standard output."""
    if path == "-":
        raise InvalidArgumentError(
            f"{what} -: a trace must be a file, not standard input; save it to a file first "
            "(./- names a file called -)"
        )


def check_before_work(args: argparse.Namespace) -> None:
    """Refuse what would fail only after the run: unwritable outputs, two outputs to one
    file (or an output over the trace or where the plots go), a GPU beyond memory.

    Called first by ``simulate`` and ``sweep``, so a typo costs no run.
    """
    outputs = [
        (f"--{option}", getattr(args, option))
        for option in ("json", "csv")
        if getattr(args, option, None)
    ]
    for option, path in outputs:
        output.check_writable_file(path, option)
    trace = getattr(args, "trace", None)
    if trace is not None:
        check_trace_file(trace, "--trace")
    output.check_distinct_outputs(outputs, [("--trace", trace)] if trace else [])
    plot_dir = getattr(args, "plot_dir", None)
    if plot_dir:
        output.check_writable_dir(plot_dir, "--plot-dir")
        _check_apart_from_plots(outputs, plot_dir)
        if importlib.util.find_spec("matplotlib") is None:
            raise InvalidArgumentError(
                "--plot-dir needs matplotlib; install it with: pip install 'kvoffload[plot]'"
            )
    gpu_blocks = getattr(args, "gpu_blocks", None)
    if gpu_blocks is not None:
        check_fits(
            gpu_blocks * BYTES_PER_SLOT, _gpu_cache_of(f"--gpu-blocks {gpu_blocks}", gpu_blocks)
        )
    transfer = getattr(args, "transfer_gb_per_s", None)
    if transfer is not None and not math.isfinite(transfer * 1e9):
        # Else refused by the run's settings, naming their field (transfer_gb_per_s).
        raise InvalidArgumentError(
            f"--transfer-gb-per-s {transfer:g}: past what a float holds in bytes per second "
            f"(about {sys.float_info.max / 1e9:.2g} GB/s)"
        )
    # Not --remote-write-budget: the shared tier's drive writes per day count against its
    # own size (--remote-blocks), as vLLM's and SGLang's do; beside it alone, the drive size
    # was taken and ignored.
    budgets: dict[str, WriteBudget | None] = {
        f"--{name.replace('_', '-')}": getattr(args, name, None)
        for name in ("write_budget", "disk_write_budget")
    }
    given = {option: budget for option, budget in budgets.items() if budget is not None}
    if getattr(args, "drive_bytes", None) is None:
        return
    if not given:
        raise InvalidArgumentError(
            "--drive-bytes is the drive a budget in drive writes per day counts against: "
            "it needs --write-budget or --disk-write-budget (--remote-write-budget counts "
            "against the shared tier's own size, --remote-blocks)"
        )
    # Beside budgets in other units alone the drive size was taken and ignored.
    if all(budget.unit != DWPD for budget in given.values()):
        named = ", ".join(f"{option}: {budget.describe()}" for option, budget in given.items())
        raise InvalidArgumentError(
            "--drive-bytes is the drive a budget in drive writes per day counts against, and "
            f"no budget given is one ({named}): give it in drive writes per day (1dwpd) or "
            "leave --drive-bytes out"
        )


@dataclass(frozen=True)
class KVBuffer:
    """A data-plane buffer an option sizes: ``blocks`` of ``block_bytes``, sized by
    ``size`` (the option as typed, or the default) for an error to name."""

    blocks: int
    block_bytes: int
    size: str

    def describe(self, what: str) -> str:
        return f"{what} of {self.blocks:,} blocks of {output.size(self.block_bytes)}"


def device_on_cpu(allocation: ModuleType, device: str) -> bool:
    """Whether ``--device`` (checked by the data plane's ``allocation`` module, which needs
    torch) is the CPU, where the paged KV cache shares host memory with the CPU tier."""
    try:
        return bool(allocation.resolve_device(device).type == "cpu")
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"--device {device}: {exc}") from None


def check_kv_buffers_fit(gpu: KVBuffer, cpu: KVBuffer, on_cpu: bool, context: str = "") -> None:
    """Refuse data-plane buffers beyond the machine's memory, naming the option that sized
    each (torch's refusal names only the buffer, "the CPU block store", and a buffer it
    grants beyond memory ends in the kernel's out-of-memory kill as it fills). The CPU
    block store is in host memory, and so is the paged KV cache on the CPU."""
    store = cpu.describe("a CPU block store")
    check_fits(cpu.blocks * cpu.block_bytes, f"{cpu.size}{context} ({store})")
    if not on_cpu:
        return
    cache = gpu.describe("a paged KV cache") + " on the CPU"
    gpu_bytes = gpu.blocks * gpu.block_bytes
    check_fits(gpu_bytes, f"{gpu.size}{context} ({cache})")
    check_fits(
        gpu_bytes + cpu.blocks * cpu.block_bytes,
        f"{gpu.size} and {cpu.size}{context} ({cache}, and {store})",
    )
