"""Draw docs/admission.md's admission table as one hit-versus-writes panel per workload.

Reads the rows that ``benchmarks/admission_table.py --json PATH`` writes. In
each panel every configuration is a line through its capacities (the label
at each point is the tier's share of unique blocks), so where the
recommended line sits above and left of both baselines it has more hits for
fewer writes; the Belady bound at each capacity is a dashed grey level.

    python benchmarks/admission_table.py --json rows.json
    python benchmarks/admission_plot.py rows.json docs/img/admission/table.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

CONFIGS = {"store-all": "tab:red", "seed filter": "tab:blue", "recommended": "tab:green"}
COLUMNS = 3


def load_rows(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The table's rows grouped by workload, each group sorted by capacity."""
    try:
        rows = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise SystemExit(f"error: cannot read rows from {path}: {error}") from None
    needed = {"workload", "share", "belady hit"} | {
        f"{label} {field}" for label in CONFIGS for field in ("hit", "writes")
    }
    if not isinstance(rows, list) or not rows:
        raise SystemExit(f"error: {path} holds no rows of admission_table.py --json")
    by_workload: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for index, row in enumerate(rows):
        missing = needed - set(row) if isinstance(row, dict) else needed
        if missing:
            raise SystemExit(f"error: row {index} of {path} lacks {', '.join(sorted(missing))}")
        by_workload[row["workload"]].append(row)
    return {name: sorted(group, key=lambda r: r["share"]) for name, group in by_workload.items()}


def point_labels(points: list[tuple[float, float, float]]) -> dict[tuple[float, float], str]:
    """Capacity labels by point; capacities that land on one point share one label."""
    shares: dict[tuple[float, float], list[str]] = defaultdict(list)
    for share, writes, hit in points:
        shares[round(writes, 3), round(hit, 3)].append(f"{share:.0%}")
    return {point: "/".join(names) for point, names in shares.items()}


def draw(by_workload: dict[str, list[dict[str, Any]]], out: Path) -> None:
    """One panel per workload, written as a PNG to ``out``."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        message = "error: plotting needs matplotlib (pip install 'kvoffload[plot]')"
        raise SystemExit(message) from None
    rows_of_panels = math.ceil(len(by_workload) / COLUMNS)
    figure = Figure(figsize=(4.2 * COLUMNS, 3.6 * rows_of_panels + 0.4), layout="constrained")
    axes = figure.subplots(rows_of_panels, COLUMNS, squeeze=False).ravel()
    for axis, (name, rows) in zip(axes, by_workload.items(), strict=False):
        bounds = point_labels([(r["share"], 0.0, r["belady hit"]) for r in rows])
        for (_, bound), shares in bounds.items():
            axis.axhline(bound, color="0.6", linestyle="--", linewidth=0.8)
            axis.annotate(
                f"Belady {shares}",
                (1.0, bound),
                xycoords=("axes fraction", "data"),
                xytext=(-3, 2),
                textcoords="offset points",
                ha="right",
                fontsize=7,
                color="0.4",
            )
        for label, colour in CONFIGS.items():
            writes = [row[f"{label} writes"] for row in rows]
            hits = [row[f"{label} hit"] for row in rows]
            axis.plot(writes, hits, marker="o", color=colour, label=label)
            points = [(r["share"], x, y) for r, x, y in zip(rows, writes, hits, strict=True)]
            for (x, y), shares in point_labels(points).items():
                axis.annotate(
                    shares,
                    (x, y),
                    textcoords="offset points",
                    xytext=(4, -9),
                    fontsize=7,
                    color=colour,
                )
        axis.set_title(name)
        axis.set_xlabel("offload writes per block reference")
        axis.set_ylabel("total hit ratio")
        axis.grid(alpha=0.3)
    for axis in axes[len(by_workload) :]:
        axis.set_visible(False)
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncols=len(CONFIGS), fontsize=9)
    figure.suptitle(
        "Admission: hit ratio against writes; labels: tier size as a share of unique blocks"
    )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(out, dpi=110)
    except OSError as error:
        raise SystemExit(f"error: cannot write {out}: {error.strerror or error}") from None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("rows", type=Path, help="JSON written by admission_table.py --json")
    parser.add_argument("out", type=Path, help="PNG to write")
    args = parser.parse_args()
    draw(load_rows(args.rows), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
