"""Tables for people, JSON and CSV for programs.

Scripts should read ``--json`` or ``--csv``; the table layout may change.
``-`` as a path means standard output.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

Value = str | int | float | None
Row = Mapping[str, Value]
NestedRow = Mapping[str, "Value | NestedRow"]
"""A row whose values may be objects themselves (a run's ``tiers``)."""


def count(value: Value) -> str:
    return f"{value:,}" if isinstance(value, int) else "-"


def ratio(value: Value) -> str:
    return f"{value:.3f}" if isinstance(value, int | float) else "-"


def size(num_bytes: Value) -> str:
    """Bytes in binary units (KiB, MiB, GiB, TiB)."""
    if not isinstance(num_bytes, int | float):
        return "-"
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.3g} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:,.1f} TiB"


def key_value_table(rows: Sequence[tuple[str, str]]) -> str:
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}".rstrip() for label, value in rows)


def column_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns right-aligned except the first, with a rule under the header."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        first = f"{cells[0]:<{widths[0]}}"
        rest = (f"{c:>{w}}" for c, w in zip(cells[1:], widths[1:], strict=True))
        return "  ".join((first, *rest))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def _write_text(path: str, text: str) -> None:
    if path == "-":
        sys.stdout.write(text)
    else:
        Path(path).write_text(text, encoding="utf-8")


def write_json(path: str, data: object) -> None:
    _write_text(path, json.dumps(data, indent=2) + "\n")


def flatten(row: NestedRow, prefix: str = "") -> dict[str, Value]:
    """Nested objects become dotted columns: ``{"tiers": {"disk": {"hit_blocks": 1}}}``
    gives ``tiers.disk.hit_blocks``."""
    flat: dict[str, Value] = {}
    for name, value in row.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{name}."))
        else:
            flat[prefix + name] = value
    return flat


def write_csv(path: str, rows: Sequence[NestedRow]) -> None:
    """One header line from the first row's keys, then one line per row (nested: flattened)."""
    flat = [flatten(row) for row in rows]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(flat[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(flat)
    _write_text(path, buffer.getvalue())
