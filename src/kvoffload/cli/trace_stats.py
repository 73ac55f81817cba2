"""``kvoffload trace-stats``: how much reuse a trace has, before replaying it."""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

from kvoffload.cli import options, output
from kvoffload.cli.progress import ProgressBar
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.sim.sources import WorkloadSource
from kvoffload.sim.trace_stats import TraceStats, stats_and_distances


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "trace-stats",
        help="requests, block references, reuse and reuse distances of a trace",
        description="Summarise a trace's block references: how many repeat, how many blocks "
        "are used only once, and how far apart reuses are (in distinct blocks).",
    )
    parser.add_argument("path", help="trace file (JSON lines, or Qwen CSV)")
    options.add_trace_format_arguments(parser)
    parser.add_argument("--json", metavar="PATH", help="write the statistics as JSON (- stdout)")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="write a PNG of the hit ratio an LRU cache of each size (in blocks) would give, "
        "by reuse distance",
    )
    options.add_progress_argument(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    options.check_trace_file(args.path, "trace")
    # Checked first, so a typo costs no pass over the trace.
    if output.names_standard_output(args.plot):  # its bytes would run into the table
        raise InvalidArgumentError(
            f"--plot {args.plot}: a PNG is not written to standard output; name a file"
        )
    outputs = [
        (option, path) for option, path in (("--json", args.json), ("--plot", args.plot)) if path
    ]
    for option, path in outputs:
        output.check_writable_file(path, option)
    output.check_distinct_outputs(outputs, [("trace", args.path)])
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise InvalidArgumentError(
            "--plot needs matplotlib; install it with: pip install 'kvoffload[plot]'"
        )
    source = WorkloadSource(trace=args.path, fmt=args.format, block_tokens=args.block_size)
    workload = options.load_workload(source, args.progress)
    bar = ProgressBar("reuse distances", ProgressBar.wanted(args.progress))
    try:
        stats, distances = stats_and_distances(workload, bar)
    finally:
        bar.close()
    png = None
    if args.plot:  # drawn before anything is written: a failure leaves no result half made
        from kvoffload.sim.plots import reuse_png

        title = f"{stats.workload}, {stats.block_tokens}-token blocks"
        png = reuse_png(distances, stats.refs, stats.unique_blocks, title)
    if args.json:
        output.write_json(args.json, stats.as_dict())
    if png is not None:
        output.write_file(args.plot, png, "--plot")
    if args.json != "-":
        shown = format_stats(stats)
        output.show(shown if png is None else f"{shown}\nplot: {args.plot}")
    return 0


def format_stats(s: TraceStats) -> str:
    rows = [
        ("trace", s.workload),
        ("tokens per block", str(s.block_tokens)),
        ("requests", f"{s.requests:,}"),
        ("block references", f"{s.refs:,}"),
        ("unique blocks", f"{s.unique_blocks:,}"),
        ("repeat fraction", f"{s.repeat_fraction:.3f}  (hit ratio of an unbounded cache)"),
        ("one-hit-wonder fraction", f"{s.one_hit_wonder_fraction:.3f}  (of unique blocks)"),
        (
            "blocks per request",
            f"{s.mean_blocks_per_request:.1f} mean, {s.max_blocks_per_request:,} max",
        ),
        ("duration", _seconds(s.duration_seconds)),
        ("reuse distance p50", _distance(s.reuse_distance_p50)),
        ("reuse distance p90", _distance(s.reuse_distance_p90)),
        ("reuse distance p99", _distance(s.reuse_distance_p99)),
    ]
    return output.key_value_table(rows)


SPAN_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns"))
"""Units for a span, the largest it fills first: in tenths of a second alone, a real
trace of 30 ms read ``0.0 s``, as if all its requests arrived at once."""


def _seconds(value: float) -> str:
    """A span in plain digits when it is short enough to read that way, in the largest unit
    it fills (``30.0 ms``; one it rounds up to, ``1.0 s`` for 0.99996 s, not ``1000.0 ms``)."""
    if value >= output.LONGEST_PLAIN_SECONDS:
        return output.seconds(value)
    for scale, unit in SPAN_UNITS:
        if round(value / scale, 1) >= 1:
            return f"{value / scale:,.1f} {unit}"
    # None (a single request), or under a nanosecond: finer than any trace's clock.
    return "0.0 s" if value == 0 else f"{value:.3g} s"


def _distance(blocks: int | None) -> str:
    """A trace with no reuse has no distance; "0 blocks" would be the closest reuse."""
    return "none (no block reused)" if blocks is None else output.counted(blocks, "block")
