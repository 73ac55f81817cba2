"""PNG plots of a sweep. Needs the optional ``plot`` extra (matplotlib), imported on first use."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvoffload.core.errors import KVOffloadError
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
    threshold = report.store_threshold
    admission = f"store threshold {threshold}" if threshold >= 2 else "no filter"
    if report.admission != "none":
        admission += f", {report.admission} admission"
    return f"{report.policy}, {admission}"


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


def sweep_title(report: RunReport) -> str:
    """The plots' title: the workload and its GPU cache, in three significant digits
    (whole GiB from 999.5 on, where ``.3g`` turns to ``1e+03``)."""
    gib = report.gpu_gib
    size = f"{gib:.3g}" if gib < 999.5 else f"{gib:,.0f}"
    return f"{report.workload}, GPU {size} GiB"


def plot_sweep(reports: Sequence[RunReport], out_dir: str | Path) -> list[Path]:
    """Write :data:`PLOT_FILES` into ``out_dir``; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = _lines(reports)
    title = sweep_title(reports[0])

    capacity = _figure()
    axes = capacity.add_subplot()
    for label, line in lines.items():
        axes.plot(
            _floats(line, "cpu_gib"), _floats(line, "total_hit_ratio"), marker="o", label=label
        )
    bound_line = next(iter(lines.values()))
    axes.plot(
        _floats(bound_line, "cpu_gib"),
        _floats(bound_line, "belady_total_hit_ratio"),
        linestyle="--",
        color="black",
        label="Belady bound",
    )
    axes.set(
        xlabel="offload tier capacity (GiB)", ylabel="total hit ratio (GPU + offload)", title=title
    )
    axes.grid(alpha=0.3)
    axes.legend()
    capacity_path = out / CAPACITY_PLOT
    capacity.savefig(capacity_path, dpi=120)

    tradeoff = _figure()
    axes = tradeoff.add_subplot()
    for label, line in lines.items():
        axes.plot(
            _floats(line, "writes_per_ref"),
            _floats(line, "total_hit_ratio"),
            marker="o",
            label=label,
        )
    axes.set(
        xlabel="offload writes per block reference",
        ylabel="total hit ratio (GPU + offload)",
        title=f"{title}: each point one capacity",
    )
    axes.grid(alpha=0.3)
    axes.legend()
    tradeoff_path = out / WRITES_PLOT
    tradeoff.savefig(tradeoff_path, dpi=120)
    return [capacity_path, tradeoff_path]
