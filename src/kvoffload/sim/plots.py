"""PNG plots of a sweep. Needs the optional ``plot`` extra (matplotlib), imported on first use."""

from __future__ import annotations

import io
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvoffload.core.errors import InvalidArgumentError, KVOffloadError
from kvoffload.core.units import binary_size
from kvoffload.sim.run import RunReport

CAPACITY_PLOT = "hit_ratio_vs_capacity.png"
WRITES_PLOT = "hit_ratio_vs_writes.png"
PLOT_FILES = (CAPACITY_PLOT, WRITES_PLOT)
"""The files :func:`plot_sweep` writes into its directory."""


class PlotUnavailableError(KVOffloadError, ImportError):
    """matplotlib is not installed."""


def _figure() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailableError(
            "plots need matplotlib; install it with: pip install 'kvoffload[plot]'"
        ) from None
    return Figure(figsize=(7.0, 4.5), layout="constrained")


def _label(report: RunReport) -> str:
    """``lru, no filter``, ``lru, store threshold 2``, ``lru, feedback admission``: "no
    filter" only where nothing judges the writes (beside an admission layer it read as
    that layer being off)."""
    parts = [report.policy]
    if report.store_threshold >= 2:
        parts.append(f"store threshold {report.store_threshold}")
    if report.admission != "none":
        parts.append(f"{report.admission} admission")
    if len(parts) == 1:
        parts.append("no filter")
    return ", ".join(parts)


def _lines(reports: Sequence[RunReport]) -> dict[str, list[RunReport]]:
    """Reports grouped by configuration (policy and threshold), each sorted by capacity."""
    lines: dict[str, list[RunReport]] = {}
    for report in reports:
        lines.setdefault(_label(report), []).append(report)
    for line in lines.values():
        line.sort(key=lambda r: r.cpu_blocks)
    return lines


def _floats(line: Sequence[RunReport], name: str) -> list[float]:
    values = (getattr(r, name) for r in line)
    return [float("nan") if v is None else float(v) for v in values]


COLOURS = (
    "tab:blue",
    "tab:orange",
    "tab:green",
    "tab:red",
    "tab:purple",
    "tab:brown",
    "tab:pink",
    "tab:gray",
    "tab:olive",
    "tab:cyan",
)
LINE_STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "v", "D", "P")
"""Each configuration's colour, line and marker, hollow: two rules with the same figures
drew one line over the other, and the plot showed one of them. Dashes let the line beneath
show through, and hollow markers of different shapes both show at a shared point. The
colours are named here, not taken from matplotlib's settings (whose cycle may be shorter
than 10); the three cycles give 60 configurations a combination of their own, and the two
lines of a colour among the first 20 differ in both dash and marker."""


def _line_style(index: int) -> dict[str, str]:
    """The colour, line style, marker and fill of the ``index``-th configuration's line."""
    return {
        "color": COLOURS[index % len(COLOURS)],
        "linestyle": LINE_STYLES[index % len(LINE_STYLES)],
        "marker": MARKERS[index % len(MARKERS)],
        "fillstyle": "none",
    }


TITLE_CHARS = 64
"""Characters of a title line that fit above the plot: a longer title (the synthetic mix's
name, a long trace path) is wrapped, not cut off at both edges."""


def _title(text: str) -> str:
    return "\n".join(textwrap.wrap(text, TITLE_CHARS))


LEGEND_INSIDE = 6
"""Legend entries that fit inside the axes without hiding the lines: more go beside them
(a sweep of three admissions, three policies and two thresholds draws 18 lines, whose
legend covered the points and the title and ran off the figure's top edge)."""
LEGEND_ROWS = 20
"""Entries in one column of a legend beside the axes; more make more columns."""
LEGEND_ROW_INCHES = 0.22
LEGEND_CHAR_INCHES = 0.075
LEGEND_HANDLE_INCHES = 0.8
"""A legend entry's height, a label character's width and a line sample's width with its
padding, at the default font: the figure grows by what the legend beside it takes, so the
axes keep their size."""


def _legend(figure: Any, axes: Any) -> None:
    """The legend inside ``axes`` for a few lines, else beside them, in as many columns of
    :data:`LEGEND_ROWS` as it needs, ``figure`` made wide and tall enough to hold it."""
    labels = axes.get_legend_handles_labels()[1]
    if len(labels) <= LEGEND_INSIDE:
        axes.legend()
        return
    columns = -(-len(labels) // LEGEND_ROWS)
    rows = -(-len(labels) // columns)
    width, height = figure.get_size_inches()
    column_inches = LEGEND_HANDLE_INCHES + LEGEND_CHAR_INCHES * max(map(len, labels))
    figure.set_size_inches(
        width + columns * column_inches, max(height, LEGEND_ROW_INCHES * rows + 1.5)
    )
    axes.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0, ncols=columns)


def _set_title(axes: Any, text: str) -> None:
    """Title ``axes`` with ``text`` as written: matplotlib reads a text between two dollar
    signs as math, and a trace named ``price_$5_to_$6.jsonl`` failed the plot (a parser's
    traceback, after the whole sweep) or, where it parsed, showed a name it does not have."""
    axes.set_title(_title(text), parse_math=False)


LOWER_TIER_NAMES = {"disk": "disk", "remote": "shared"}
"""The tiers below the offload (CPU) tier, by their key in a run's ``tiers``, as the
command line names them."""


def lower_tiers(report: RunReport) -> str:
    """``a disk tier below``, ``disk and shared tiers below``, or empty: their hits count
    in the total hit ratio (promoted through the offload tier), while the capacity axis and
    the table's ``offload`` are the offload tier's alone."""
    names = [name for key, name in LOWER_TIER_NAMES.items() if key in report.tiers]
    if not names:
        return ""
    if len(names) == 1:
        return f"a {names[0]} tier below"
    return f"{' and '.join(names)} tiers below"


def sweep_title(report: RunReport) -> str:
    """The plots' title: the workload and the size of its GPU cache, and the tiers below
    the offload tier, if any: a sweep with a disk tier plotted as one without."""
    below = lower_tiers(report)
    title = f"{report.workload}, GPU {binary_size(report.gpu_gib * 2**30)}"
    return title + (f", {below} the offload tier" if below else "")


def _plain_ticks(axes: Any) -> None:
    """Tick labels that read as the numbers they are: the tiny layout's capacities (about
    1e-5 GiB) were ticked 1.0 to 3.0, their ``1e-5`` alone at the axis's far corner, and
    figures close together got an offset (``+4.62e-1``) the same way."""
    axes.ticklabel_format(style="plain", useOffset=False)


def _bound_line(reports: Sequence[RunReport]) -> tuple[list[float], list[float]]:
    """The Belady bound to draw: per capacity with a known bound, the highest of its runs'.

    A sequential sweep gives every run of a capacity the same bound; overlapping runs
    (``concurrency > 1``) each get the bound of their own GPU hits, so one run's bound
    need not cover another's point, and the highest covers them all."""
    highest: dict[int, tuple[float, float]] = {}
    for report in reports:
        bound = report.belady_total_hit_ratio
        if bound is None:
            continue
        known = highest.get(report.cpu_blocks)
        if known is None or bound > known[1]:
            highest[report.cpu_blocks] = (report.cpu_gib, bound)
    points = [highest[blocks] for blocks in sorted(highest)]
    return [gib for gib, _ in points], [bound for _, bound in points]


def _capacity_figure(reports: Sequence[RunReport]) -> Any:
    """Total hit ratio against offload capacity, one line per configuration, beside the
    Belady bound where one is known."""
    figure = _figure()
    axes = figure.add_subplot()
    for index, (label, line) in enumerate(_lines(reports).items()):
        axes.plot(
            _floats(line, "cpu_gib"),
            _floats(line, "total_hit_ratio"),
            label=label,
            **_line_style(index),
        )
    capacities, bounds = _bound_line(reports)
    if bounds:  # none with lower tiers, or runs without one: no empty legend entry
        axes.plot(
            capacities,
            bounds,
            linestyle="--",
            # A line of one point draws nothing: mark it.
            marker="_" if len(bounds) == 1 else "",
            markersize=20,
            color="black",
            label="Belady bound",
        )
    axes.set(xlabel="offload tier capacity (GiB)", ylabel="total hit ratio (GPU + offload)")
    _plain_ticks(axes)
    _set_title(axes, sweep_title(reports[0]))
    axes.grid(alpha=0.3)
    _legend(figure, axes)
    return figure


def _writes_figure(reports: Sequence[RunReport]) -> Any:
    """Total hit ratio against offload writes per block reference, each point a capacity."""
    figure = _figure()
    axes = figure.add_subplot()
    for index, (label, line) in enumerate(_lines(reports).items()):
        axes.plot(
            _floats(line, "writes_per_ref"),
            _floats(line, "total_hit_ratio"),
            label=label,
            **_line_style(index),
        )
    axes.set(xlabel="offload writes per block reference", ylabel="total hit ratio (GPU + offload)")
    _plain_ticks(axes)
    _set_title(axes, f"{sweep_title(reports[0])}: each point one capacity")
    axes.grid(alpha=0.3)
    _legend(figure, axes)
    return figure


def reuse_png(distances: Sequence[int], refs: int, unique_blocks: int, title: str) -> bytes:
    """:func:`reuse_figure` as a PNG."""
    return _png(reuse_figure(distances, refs, unique_blocks, title))


def reuse_figure(distances: Sequence[int], refs: int, unique_blocks: int, title: str) -> Any:
    """The hit ratio an LRU cache of each size would give on a trace's block references
    (ignoring the prefix rule): a reference hits a cache of more blocks than its reuse
    distance, so the curve is the share of ``refs`` whose (sorted) ``distances`` are below
    each size, up to the repeat fraction, which a cache of every ``unique_blocks`` reaches."""
    figure = _figure()
    axes = figure.add_subplot()
    sizes = [1]
    ratios = [0.0]
    per_ref = 1.0 / refs if refs else 0.0
    for index, distance in enumerate(distances):
        if distance + 1 != sizes[-1]:
            sizes.append(distance + 1)
            ratios.append(ratios[-1])
        ratios[-1] = (index + 1) * per_ref
    last = max(unique_blocks, sizes[-1], 2)
    axes.step(
        [*sizes, last], [*ratios, ratios[-1]], where="post", label="LRU cache, by reuse distance"
    )
    axes.axhline(
        ratios[-1], color="black", linestyle="--", label=f"unbounded cache ({ratios[-1]:.3f})"
    )
    axes.set_xscale("log")
    axes.set(
        xlabel="cache capacity (blocks, log scale)",
        ylabel="hit ratio of block references",
        ylim=(0, max(ratios[-1] * 1.1, 0.05)),
    )
    _set_title(axes, title)
    axes.grid(alpha=0.3)
    _legend(figure, axes)
    return figure


def plot_sweep(
    reports: Sequence[RunReport],
    out_dir: str | Path,
    write: Callable[[Path, bytes], object] = Path.write_bytes,
) -> list[Path]:
    """Write :data:`PLOT_FILES` into ``out_dir`` with ``write(path, png)``; return their
    paths. The command line passes a ``write`` that replaces a file whole or not at all:
    saved straight to its path, a plot cut short (a full disk, Ctrl-C) stayed truncated,
    over the earlier sweep's. Every plot is drawn before any is written: drawing takes
    the time, and a Ctrl-C then left the first plot beside the earlier sweep's second."""
    if not reports:
        raise InvalidArgumentError("a plot needs at least one run")
    out = Path(out_dir)
    paths = [out / CAPACITY_PLOT, out / WRITES_PLOT]
    pngs = [_png(_capacity_figure(reports)), _png(_writes_figure(reports))]
    out.mkdir(parents=True, exist_ok=True)
    for path, png in zip(paths, pngs, strict=True):
        write(path, png)
    return paths


def _png(figure: Any) -> bytes:
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=120)
    return png.getvalue()
