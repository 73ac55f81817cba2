"""Tables for people, JSON and CSV for programs.

Scripts should read ``--json`` or ``--csv``; the table layout may change.
``-`` as a path means standard output.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import secrets
import shutil
import stat
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kvoffload.core.errors import InvalidArgumentError, KVOffloadError
from kvoffload.core.units import binary_size

Value = str | int | float | None
Row = Mapping[str, Value]
NestedRow = Mapping[str, "Value | NestedRow"]
"""A row whose values may be objects themselves (a run's ``tiers``)."""


def choices(names: Sequence[str], resolve: Callable[[str], str]) -> str:
    """Registry names for an option's help, an alias beside what it stands for
    (``recommended (= lru)``): the report shows the name it resolves to."""
    return ", ".join(
        name if resolve(name) == name else f"{name} (= {resolve(name)})" for name in names
    )


def count(value: Value) -> str:
    return f"{value:,}" if isinstance(value, int) else "-"


def counted(number: int, noun: str) -> str:
    """``number`` of ``noun`` in the plural unless one: "1 requests" reads as a slip."""
    return f"{number:,} {noun}" if number == 1 else f"{number:,} {noun}s"


def ratio(value: Value) -> str:
    return f"{value:.3f}" if isinstance(value, int | float) else "-"


LONGEST_PLAIN_SECONDS = 1e12
"""About 31,700 years: a longer span (a far-off timestamp in a trace, a prefill rate or a
tier's bandwidth near zero) is shown in scientific notation, not as every digit of it
(hundreds near a float's limit)."""


def seconds(value: Value, places: int = 1) -> str:
    """A time in seconds with ``places`` decimals and thousands separated, in scientific
    notation from :data:`LONGEST_PLAIN_SECONDS` on (either sign: a tier slower than
    recomputing saves a negative time); ``-`` where unknown."""
    if not isinstance(value, int | float):
        return "-"
    if abs(value) >= LONGEST_PLAIN_SECONDS:
        return f"{value:.3g} s"
    return f"{value:,.{places}f} s"


def size(num_bytes: Value) -> str:
    """Bytes in binary units (:func:`~kvoffload.core.units.binary_size`); ``-`` where
    unknown."""
    if not isinstance(num_bytes, int | float):
        return "-"
    return binary_size(num_bytes)


NARROW = 50
"""Below this many columns, a label goes on its own line, its value indented under it."""


def terminal_width() -> int | None:
    """Columns of the terminal stdout writes to; ``None`` for a file or a pipe (no wrapping)."""
    if sys.stdout is None or not sys.stdout.isatty():  # None: started with stdout closed
        return None
    return shutil.get_terminal_size((80, 24)).columns


def key_value_table(rows: Sequence[tuple[str, str]], width: int | None = None) -> str:
    """Labels in one column, values in the next.

    ``width`` (default: the terminal's, none for files and pipes) wraps long
    values under their column, or, when narrower than :data:`NARROW`, puts
    each value on its own indented line under its label.
    """
    label_width = max(len(label) for label, _ in rows)
    width = terminal_width() if width is None else width
    if width is None or all(label_width + 2 + len(value) <= width for _, value in rows):
        return "\n".join(f"{label:<{label_width}}  {value}".rstrip() for label, value in rows)
    lines: list[str] = []
    if width < NARROW:
        for label, value in rows:
            if label:
                lines.append(label)
            # Under a nested label ("  from GPU cache"), indent further than the label.
            pad = " " * (len(label) - len(label.lstrip()) + 2)
            lines += textwrap.wrap(value, width, initial_indent=pad, subsequent_indent=pad)
        return "\n".join(lines)
    indent = " " * (label_width + 2)
    for label, value in rows:
        wrapped = textwrap.wrap(value, width - len(indent)) or [""]
        lines.append(f"{label:<{label_width}}  {wrapped[0]}".rstrip())
        lines += [indent + part for part in wrapped[1:]]
    return "\n".join(lines)


WhatIfTable = Mapping[str, Mapping[str, Mapping[str, float | None]]]
"""An optimiser's what-if figures as a run reports them: candidate -> capacity factor
(as text) -> ``hit_ratio``, ``writes_per_ref``, ...; ``None`` for a figure not known yet."""


def switches(count: int) -> str:
    """How often an optimiser changed the rule it follows, in words."""
    return "never switched" if not count else f"{count:,} switch{'es' if count > 1 else ''}"


def whatif_figure(value: float | None) -> str:
    """A what-if figure, ``-`` while unknown (nothing sampled), as the control's row shows."""
    return "-" if value is None else f"{value:.3f}"


def whatif_rows(candidate: str, switch_count: int, whatif: WhatIfTable) -> list[tuple[str, str]]:
    """An optimiser's choice and its what-if table, as :func:`key_value_table` rows: hit
    ratio / writes per block reference of each candidate at each capacity factor, over
    the whole run (none for a layer without what-if figures). Shared by the CPU tier's
    optimiser and each lower tier's own."""
    if not whatif:
        return []
    factors = list(next(iter(whatif.values())))
    rows = [
        ("  following", f"{candidate} ({switches(switch_count)})"),
        ("  what-if (hit / writes)", "   ".join(f"{f + 'x':>13}" for f in factors)),
    ]
    for name, by_factor in whatif.items():
        cells = (
            f"{whatif_figure(by_factor[f]['hit_ratio'])} / "
            f"{whatif_figure(by_factor[f]['writes_per_ref'])}"
            for f in factors
        )
        rows.append((f"    {name}", "   ".join(f"{c:>13}" for c in cells)))
    return rows


def column_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns right-aligned except the first, with a rule under the header (and no more
    with no rows)."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        first = f"{cells[0]:<{widths[0]}}"
        rest = (f"{c:>{w}}" for c, w in zip(cells[1:], widths[1:], strict=True))
        return "  ".join((first, *rest))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def show(text: str) -> None:
    """Print ``text`` to standard output in one write, its newline included. ``print``
    writes the two apart: at once under ``PYTHONUNBUFFERED=1`` (common in containers), and
    for a text past the stream's buffer (a long sweep table) the newline only at exit. A
    reader that took what it wanted and went (``| head -1``) then failed the run, the latter
    with "Exception ignored ... BrokenPipeError" and status 120. Nothing where standard
    output was closed at start (``>&-``), as ``print``."""
    if sys.stdout is not None:
        sys.stdout.write(text + "\n")


def one_line(text: str) -> str:
    """``text`` with line breaks and other unprintable characters escaped as Python writes
    them (``\\n``): an error stays one line when a path or an argument holds a newline."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def names_standard_output(path: str | None) -> bool:
    """Whether ``path`` is standard output under another name (``/dev/stdout``,
    ``/proc/self/fd/1``): written there as ``-`` is, the table is left out, so that what
    a script reads from stdout is the JSON or CSV alone."""
    if path is None or path == "-" or sys.stdout is None:
        return path == "-"
    try:
        return os.path.samestat(os.fstat(sys.stdout.fileno()), os.stat(path))
    except (OSError, ValueError):  # not there, or stdout is no file (captured)
        return False


def check_writable_file(path: str, option: str) -> None:
    """:class:`InvalidArgumentError` unless ``path`` (``-``: stdout) can be written."""
    if path == "-":
        if sys.stdout is None:
            raise InvalidArgumentError(f"{option} -: standard output is closed")
        return
    try:
        _check_writable_path(path, option)
    except OSError as exc:  # a name too long to look up: the error names no option
        raise InvalidArgumentError(f"{option} {path}: {exc.strerror or exc}") from None


def _check_writable_path(path: str, option: str) -> None:
    target = Path(path)
    if target.is_dir():
        raise InvalidArgumentError(f"{option} {path}: is a directory")
    if path.endswith((os.sep, f"{os.sep}.")):  # Path() drops it: "out/" wrote a file "out"
        raise InvalidArgumentError(
            f"{option} {path}: names a directory, which does not exist; give a file's name"
        )
    if not target.exists():  # a new file, made where a (dangling) symbolic link leads
        target = Path(os.path.realpath(path))
    parent = target.parent
    if not parent.is_dir():
        raise InvalidArgumentError(f"{option} {path}: no such directory: {parent}")
    if not os.access(target if target.exists() else parent, os.W_OK):
        raise InvalidArgumentError(f"{option} {path}: not writable")
    if not target.exists() or target.is_file():
        _probe_directory(Path(os.path.realpath(path)).parent, path, option)


def _probe_directory(directory: Path, path: str, option: str) -> None:
    """Make and remove a file where :func:`write_file` will make its own: a directory that
    takes no new file (``/proc``, a read-only mount, for root as for anyone) passed
    ``os.access`` and failed the write once the whole run was done."""
    probe = directory / f".{secrets.token_hex(4)}.probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as exc:
        raise InvalidArgumentError(
            f"{option} {path}: cannot write a file in {directory}: {exc.strerror or exc}"
        ) from None
    with contextlib.suppress(OSError):
        os.unlink(probe)


def same_file(first: str, second: str) -> bool:
    """Whether two paths name one file (through links too; a file not there yet by name)."""
    try:
        return os.path.samefile(first, second)
    except OSError:
        return os.path.realpath(first) == os.path.realpath(second)


def check_distinct_outputs(
    outputs: Sequence[tuple[str, str]], inputs: Sequence[tuple[str, str]]
) -> None:
    """:class:`InvalidArgumentError` if two ``(option, path)`` outputs would write one file
    (or both standard output), or an output is an input file, which it would overwrite."""
    for index, (option, path) in enumerate(outputs):
        for other, other_path in outputs[index + 1 :]:
            if path == other_path == "-":
                raise InvalidArgumentError(
                    f"{option} - and {other} - would both write to standard output; "
                    "send one to a file"
                )
            if "-" not in (path, other_path) and same_file(path, other_path):
                raise InvalidArgumentError(
                    f"{option} {path} and {other} {other_path} are one file; give each its own"
                )
        for source, source_path in inputs:
            if path != "-" and same_file(path, source_path):
                raise InvalidArgumentError(
                    f"{option} {path} is the {source} file being read; write elsewhere"
                )


def check_writable_dir(path: str, option: str) -> None:
    """:class:`InvalidArgumentError` unless ``path`` is, or can be made, a writable directory.
    A symbolic link that leads nowhere, as ``path`` or above it, is refused here: making the
    directory fails on it ("File exists"), once the whole sweep has run."""
    target = Path(path)
    existing = target
    missing: list[str] = []
    while not os.path.lexists(existing):  # also where a name is too long to look up
        if existing.parent == existing:
            break
        missing.append(existing.name)
        existing = existing.parent
    if existing.is_symlink() and not existing.exists():
        raise InvalidArgumentError(
            f"{option} {path}: {existing} is a symbolic link to {os.readlink(existing)}, "
            "which does not exist"
        )
    if not existing.is_dir():
        raise InvalidArgumentError(f"{option} {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK):
        raise InvalidArgumentError(f"{option} {path}: {existing} is not writable")
    _check_name_lengths(path, option, existing, missing)


def _check_name_lengths(path: str, option: str, existing: Path, missing: Sequence[str]) -> None:
    """Refuse a directory still to be made whose name its file system cannot hold: found only
    as it is made, once the whole sweep has run, and then in a line that named no option."""
    try:
        longest = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):  # no limit the file system tells
        return
    for name in missing:
        if len(os.fsencode(name)) > longest:
            raise InvalidArgumentError(
                f"{option} {path}: the name {name[:16]}... is longer than the "
                f"{longest} bytes its file system takes"
            )


class OutputError(KVOffloadError):
    """A result file could not be written (disk full, file size limit, I/O error)."""


def _write_text(path: str, text: str, option: str) -> None:
    """Write ``text`` to ``path`` as :func:`write_file` does; ``-`` is standard output."""
    if path == "-":
        sys.stdout.write(text)
        return
    write_file(path, text.encode("utf-8"), option)


def write_file(path: str, data: bytes, option: str) -> None:
    """Write ``data`` whole or not at all: into a new file beside ``path``, synced, then
    renamed over it, so a failed write leaves an earlier file as it was. A device or a
    pipe (``/dev/stdout``) is written in place: it cannot be renamed over. Every result
    file of the command line is written here; an error names ``option`` and ``path``."""
    try:
        if os.path.exists(path) and not os.path.isfile(path):
            Path(path).write_bytes(data)
            return
        # Through a symbolic link, the file it names is replaced (the link stays).
        _replace(os.path.realpath(path), data)
    except OSError as exc:
        raise OutputError(f"{option} {path}: cannot write: {exc.strerror or exc}") from None


def _replace(target: str, data: bytes) -> None:
    directory, name = os.path.split(target)
    temporary = os.path.join(directory, f".{name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # umask applies
    try:
        with os.fdopen(fd, "wb") as file:
            with contextlib.suppress(FileNotFoundError):  # an existing file keeps its mode
                os.chmod(temporary, stat.S_IMODE(os.stat(target).st_mode))
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def write_json(path: str, data: object, option: str = "--json") -> None:
    _write_text(path, json.dumps(data, indent=2) + "\n", option)


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


def columns(rows: Sequence[Mapping[str, Value]]) -> list[str]:
    """Every row's keys, a key first seen in a later row placed after the key it follows
    there: rows differ (an admission rule adds its own counters), and an optimiser's
    what-if columns then sit where a run of its own has them, not after ``trace_format``,
    which stays last."""
    fields: list[str] = []
    known: set[str] = set()
    for row in rows:
        if known.issuperset(row):
            continue
        position = 0
        for key in row:
            if key in known:
                position = fields.index(key) + 1
                continue
            fields.insert(position, key)
            known.add(key)
            position += 1
    return fields


def write_csv(path: str, rows: Sequence[NestedRow], option: str = "--csv") -> None:
    """One header line (:func:`columns`), then one line per row (nested: flattened); a row
    without a column leaves it empty."""
    flat = [flatten(row) for row in rows]
    fields = columns(flat)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=fields, restval="", lineterminator="\n")
    writer.writeheader()
    writer.writerows(flat)
    _write_text(path, buffer.getvalue(), option)
