"""Readers for public serving traces that carry per-block hash ids.

Three schemas are understood: Mooncake's (``timestamp`` in milliseconds,
``input_length``, ``output_length``, ``hash_ids``; 512-token blocks, which
Dynamo's data generator and aiperf also write with 16- to 64-token blocks),
LMCache's LMBench traces (Mooncake's keys, ``timestamp`` nanoseconds since an
epoch, as a string or a number, newest first) and Alibaba's Qwen/Bailian traces (the same fields
plus ``chat_id``, ``parent_chat_id``, ``type`` and ``turn``; ``timestamp`` in
seconds; 16-token blocks), the latter as JSON lines or CSV. Every problem is
reported with the file and line it was found on. One line may cost at most
``MAX_LINE_CHARS`` characters (a longer one, or an endless stream such as
``/dev/zero``, is an error, not a hang), and a record's ``hash_ids`` must
cover its ``input_length`` in the trace's block size (the format's, or the
one the caller names; the last block may be partial and keyed or not).

A KV cache keys a block by its whole prefix. Mooncake's ids are prefix-chained
(an id names its prefix, so it always follows the same id), and each becomes a
key as it is. Ids that are not (one follows two different ids, or starts one
request and follows another in the next: content hashes of single blocks, as
Bailian's description can be read) are chained on reading, block ``i`` keyed by
ids ``0..i``, so that a block hits only after the same prefix.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import hashlib
import io
import itertools
import json
import math
import os
import shlex
import stat
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePath
from typing import Any

from kvoffload.core.errors import InvalidArgumentError, KVOffloadError, brief
from kvoffload.core.keys import OffloadKey, block_id_key
from kvoffload.sim.workload import Progress, Request, Workload

TRACE_FORMATS = ("mooncake", "lmbench", "qwen")
DEFAULT_BLOCK_TOKENS = {"mooncake": 512, "lmbench": 512, "qwen": 16}
_SECONDS_PER_UNIT = {"mooncake": 1e-3, "lmbench": 1e-9, "qwen": 1.0}
_COMMON_BLOCK_TOKENS = (16, 32, 64, 128, 256, 512, 1024)
"""Block sizes suggested when a record's ``hash_ids`` do not fit the one in use."""
_MAX_BLOCK_ID = 2**64 - 1
_MAX_NANOSECONDS = 2**64 - 1
"""An LMBench timestamp's bound: the year 2554, and a float holds any distance below it."""
PROGRESS_LINES = 4096
"""Lines read between two reports to a progress callback."""
PROGRESS_CHARS = 4 * 2**20
"""Characters read between two reports at most: long lines (a million-token prompt is half a
MiB of 16-token blocks' ids) make 4096 of them gigabytes."""
MAX_LINE_CHARS = 16 * 2**20
"""16 Mi characters: a million-token prompt in 16-token blocks takes well under 1 Mi."""


READ_BYTES_PER_REF = 32
READ_BYTES_PER_BLOCK = 200
"""Peak memory reading a trace takes, per block reference (its key in its request's list)
and per distinct block (its key and the reader's tables): 26 and 196 bytes measured with
``tracemalloc`` on JSON-lines traces of shared and of unique blocks, which the public
Mooncake trace's peak fits to within 1%; a Qwen CSV takes less. Rounded up."""


def estimated_read_bytes(workload: Workload) -> int:
    """The memory reading ``workload``'s trace again takes at its peak, as each worker
    process of a sweep does before its first run."""
    return workload.num_refs * READ_BYTES_PER_REF + workload.unique_blocks * READ_BYTES_PER_BLOCK


class TraceFormatError(KVOffloadError, ValueError):
    """A trace file is missing, unreadable or has a malformed record."""


NANOSECOND_EPOCH_FLOOR = 10**16
"""A numeric timestamp from here on is nanoseconds since an epoch (LMBench's, written as a
number; 10^16 ns is 1970-04-26), never Mooncake's milliseconds (10^16 ms is 317,000
years)."""


def detect_format(path: Path) -> str:
    """``"qwen"`` if the file is CSV or its first record has a ``chat_id``, ``"lmbench"`` if
    its timestamp is a string or a whole number of nanoseconds since an epoch, else
    ``"mooncake"``."""
    if path.suffix.lower() == ".csv":
        return "qwen"
    return _format_of(path, next(_json_records(path), None))


def _format_of(path: Path, first: tuple[int, Mapping[str, Any]] | None) -> str:
    """The JSON-lines format ``first`` (a trace's first record) has."""
    if first is None:
        raise TraceFormatError(f"{path}: the trace has no records")
    record = first[1]
    if "chat_id" in record:
        return "qwen"
    return _format_of_stamp(record.get("timestamp"))


def _format_of_stamp(stamp: object) -> str:
    """``"lmbench"`` or ``"mooncake"``: which of the two a record without ``chat_id`` is, by
    its timestamp."""
    if isinstance(stamp, str):
        return "lmbench"
    if isinstance(stamp, int) and not isinstance(stamp, bool) and stamp >= NANOSECOND_EPOCH_FLOOR:
        return "lmbench"  # read as milliseconds, its gaps would stretch a million times
    return "mooncake"


_TELLS = {
    "qwen": "has 'chat_id'",
    "lmbench": "string timestamps, or nanoseconds since an epoch",
    "mooncake": "no 'chat_id', numeric timestamps below 10^16: Mooncake's milliseconds",
}
_CSV_TELLS = "named *.csv, and a CSV trace is read as Qwen's"
"""Why a CSV trace reads as ``qwen`` whatever its columns (it need not have ``chat_id``)."""


def read_trace(
    path: str | Path,
    fmt: str = "auto",
    block_tokens: int | None = None,
    progress: Progress | None = None,
) -> Workload:
    """Read a trace file into a :class:`Workload` sorted by arrival time.

    ``fmt`` is ``"mooncake"``, ``"qwen"`` or ``"auto"``; ``block_tokens``
    defaults to the format's native block size. ``progress(done, total)`` is told the
    bytes read of a regular file's size now and then, and its size at the end (a pipe,
    of unknown size, tells it nothing).
    """
    if not isinstance(path, str | PurePath):
        raise InvalidArgumentError(f"a trace path is a str or a Path, got {path!r}")
    if "\0" in str(path):  # open() would raise a bare ValueError
        raise TraceFormatError(f"{str(path)!r}: cannot read trace: a path holds no NUL character")
    if not str(path):  # Path("") is the current directory: "Is a directory" would puzzle
        raise TraceFormatError("cannot read trace: its path is empty")
    path = Path(path)
    if block_tokens is not None and (
        isinstance(block_tokens, bool) or not isinstance(block_tokens, int)
    ):
        raise InvalidArgumentError(f"block size must be an integer, got {block_tokens!r}")
    if fmt != "auto" and fmt not in TRACE_FORMATS:
        raise InvalidArgumentError(
            f"unknown trace format {fmt!r}; known: auto, {', '.join(TRACE_FORMATS)}"
        )
    # One pass: the first record, detected, goes back in front of the rest, so a pipe
    # (read once) loses nothing.
    csv_file = path.suffix.lower() == ".csv"
    name = _workload_name(path)  # before reading: a pipe's descriptor may close once read
    records = _csv_records(path, progress) if csv_file else _json_records(path, progress)
    if csv_file:
        detected = "qwen"
    else:
        first = next(records, None)
        detected = _format_of(path, first)
        records = itertools.chain([first] if first is not None else [], records)
    if fmt == "auto":
        fmt = detected
    elif fmt != detected:
        # The schemas differ in time unit and block size: a mix-up would run, wrongly. A
        # CSV trace is Qwen's by its name, whatever its columns: "has 'chat_id'" was said
        # of CSV files without one.
        tells = _CSV_TELLS if csv_file else _TELLS[detected]
        raise TraceFormatError(
            f"{path}: looks like a {detected} trace, not {fmt} ({tells}); "
            f"pass --format {detected} or auto"
        )
    block_tokens = DEFAULT_BLOCK_TOKENS[fmt] if block_tokens is None else block_tokens
    if block_tokens < 1:
        raise InvalidArgumentError(f"block size must be >= 1 token, got {block_tokens}")
    keys_by_id: dict[int, OffloadKey] = {}
    exact = fmt == "lmbench"
    stamped = [_to_request(path, line, rec, fmt, block_tokens, keys_by_id) for line, rec in records]
    if not stamped:
        raise TraceFormatError(f"{path}: the trace has no records")
    if not _prefix_chained(req.keys for _, req in stamped):
        stamped = [(stamp, _chained(req)) for stamp, req in stamped]
    # Nanoseconds since the epoch lose precision as floats: times start at the first request.
    start = min(stamp for stamp, _ in stamped) if exact else 0
    unit = _SECONDS_PER_UNIT[fmt]
    requests = [
        Request((stamp - start) * unit, req.input_tokens, req.output_tokens, req.keys)
        for stamp, req in stamped
    ]
    requests.sort(key=lambda r: r.arrival_s)
    return Workload(name, block_tokens, requests, trace_format=fmt)


_OPEN_FILE_DIRS = ("/dev/fd", "/proc/self/fd")


def _workload_name(path: Path) -> str:
    """The trace's file name, as the reports show it; a trace read through an open file
    descriptor (``--trace <(cat t.jsonl)`` reads ``/dev/fd/63``) is named for what the
    descriptor holds, since its bare number ("63") tells an operator nothing."""
    fd_dir = str(path.parent)
    if fd_dir not in _OPEN_FILE_DIRS and not (
        fd_dir.startswith("/proc/") and fd_dir.endswith("/fd")
    ):
        return path.name
    try:
        target = os.readlink(path)
    except OSError:
        return str(path)
    if target.startswith("pipe:"):
        return f"pipe {path}"
    return Path(target).name if target.startswith("/") else str(path)


def _open_lines(path: Path, progress: Progress | None = None) -> Iterator[tuple[int, str]]:
    try:
        # utf-8-sig: a byte order mark (Windows editors write one) is not part of line 1.
        line_no = 0
        with (
            path.open("rb") as raw,
            io.TextIOWrapper(raw, encoding="utf-8-sig", newline="") as lines,
        ):
            status = os.fstat(raw.fileno())
            size = status.st_size if stat.S_ISREG(status.st_mode) else 0
            if not size:
                progress = None
            unreported = 0  # characters read since the last report
            while line := lines.readline(MAX_LINE_CHARS + 1):
                if progress is not None and (
                    not line_no % PROGRESS_LINES or unreported >= PROGRESS_CHARS
                ):
                    # The bytes under the text reader: at most one chunk ahead of the line.
                    progress(min(raw.tell(), size), size)
                    unreported = 0
                unreported += len(line)
                line_no += 1
                if len(line) > MAX_LINE_CHARS:
                    raise TraceFormatError(
                        f"{path}:{line_no}: line longer than {MAX_LINE_CHARS:,} characters; "
                        "not a trace of one request per line"
                    )
                yield line_no, line
            if progress is not None:
                progress(size, size)
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot read trace: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise TraceFormatError(_not_utf8(path, exc, line_no)) from None


_NOT_TEXT = (
    (b"\x1f\x8b", "gzip-compressed", "zcat"),
    (b"\xfd7zXZ\x00", "xz-compressed", "xzcat"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed", "zstdcat"),
    (b"BZh", "bzip2-compressed", "bzcat"),
    (b"PK\x03\x04", "a zip archive", "unzip -p"),
)
"""What a trace that does not decode may be, told by its first bytes, and the command that
reads it out through a pipe."""


def _not_utf8(path: Path, exc: UnicodeDecodeError, lines_read: int) -> str:
    """Why ``path`` does not decode, with the line of the first bad byte where the file can
    be read again: the text reader decodes ahead of the line it returns, so ``exc`` does
    not say which line that is."""
    if lines_read == 0 and exc.object[:2] in (b"\xff\xfe", b"\xfe\xff"):
        return f"{path}: not a UTF-8 text file (a UTF-16 byte order mark; save it as UTF-8)"
    for magic, kind, reader in _NOT_TEXT:
        if lines_read == 0 and exc.object.startswith(magic):
            return (
                f"{path}: not a UTF-8 text file ({kind}); decompress it first, "
                f"or read it through a pipe: <({reader} {shlex.quote(str(path))})"
            )
    line_no = _undecodable_line(path)
    where = f"{path}:{line_no}" if line_no is not None else str(path)
    return f"{where}: not a UTF-8 text file ({exc.reason})"


def _undecodable_line(path: Path) -> int | None:
    """The line of ``path``'s first byte that is not UTF-8, or ``None`` for a pipe or a
    device (not to be read twice) or a file that has changed since."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            return None
        with path.open("rb") as raw:
            decoder = codecs.getincrementaldecoder("utf-8")()
            line_no = 1
            after_cr = False
            while chunk := raw.read(2**20):
                held = len(decoder.getstate()[0])  # a character split across chunks
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as exc:
                    return line_no + _line_ends(chunk[: max(0, exc.start - held)], after_cr)
                line_no += _line_ends(chunk, after_cr)
                after_cr = chunk.endswith(b"\r")
    except OSError:
        return None
    return None


def _line_ends(data: bytes, after_cr: bool) -> int:
    """How many lines ``data`` ends where the text reader ends them: at a line feed, a
    carriage return, or the two in a row (``after_cr``: the bytes before ``data`` ended in a
    carriage return, so a line feed opening ``data`` ends no line)."""
    ends = data.count(b"\n") + data.count(b"\r") - data.count(b"\r\n")
    return ends - (after_cr and data.startswith(b"\n"))


class _RepeatedField(Exception):
    """A JSON object names a field twice (its name is the argument)."""


def _fields_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's fields, refusing one given twice: ``json`` keeps the last silently
    (``{"timestamp": 0, "timestamp": 5}`` read as 5), where a CSV header naming a column
    twice is refused."""
    record = dict(pairs)
    if len(record) != len(pairs):
        raise _RepeatedField(
            next(name for name, _ in pairs if sum(n == name for n, _ in pairs) > 1)
        )
    return record


def _json_records(
    path: Path, progress: Progress | None = None
) -> Iterator[tuple[int, Mapping[str, Any]]]:
    first = True
    for line_no, line in _open_lines(path, progress):
        if not line.strip():
            continue
        try:
            record = json.loads(line, object_pairs_hook=_fields_once)
        except _RepeatedField as exc:
            raise TraceFormatError(
                f"{path}:{line_no}: the record names field {brief(exc.args[0])} twice"
            ) from None
        except json.JSONDecodeError as exc:
            hint = (
                "; a CSV trace is read as CSV when named *.csv"
                if first and _csv_header(line)
                else ""
            )
            raise TraceFormatError(f"{path}:{line_no}: invalid JSON: {exc.msg}{hint}") from None
        except RecursionError:
            raise TraceFormatError(f"{path}:{line_no}: JSON nested too deeply") from None
        except ValueError:  # not a JSONDecodeError: an integer longer than Python converts
            raise TraceFormatError(
                f"{path}:{line_no}: invalid JSON: an integer of more than "
                f"{sys.get_int_max_str_digits():,} digits"
            ) from None
        if not isinstance(record, dict):
            raise TraceFormatError(f"{path}:{line_no}: expected a JSON object per line")
        first = False
        yield line_no, record


def _csv_header(line: str) -> bool:
    """Whether ``line`` reads as a CSV trace's header (its columns include ``hash_ids``)."""
    return "hash_ids" in (name.strip() for name in line.split(","))


def _csv_records(
    path: Path, progress: Progress | None = None
) -> Iterator[tuple[int, Mapping[str, Any]]]:
    # Long prompts make long hash_ids fields; the line bound is the real limit.
    csv.field_size_limit(max(csv.field_size_limit(), MAX_LINE_CHARS))
    header: list[str] | None = None
    for line_no, line in _open_lines(path, progress):
        if not line.strip():
            continue
        try:
            # strict: a quote left open or text after a closing quote is an error, not a
            # field cut short (a quoted field over two lines lost the second) or run on.
            row = next(csv.reader([line], strict=True))
        except csv.Error as exc:
            reason = str(exc)
            if reason == "unexpected end of data":  # csv's words for a quote left open
                reason = "a quoted field not closed on its line"
            raise TraceFormatError(f"{path}:{line_no}: invalid CSV: {reason}") from None
        if header is None:
            if line.lstrip().startswith("{"):  # else "missing field 'timestamp'" on line 2
                raise TraceFormatError(
                    f"{path}:{line_no}: a JSON object, not a CSV header; a trace named *.csv "
                    "is read as CSV: name a JSON-lines trace *.jsonl"
                )
            header = [name.strip() for name in row]
            twice = next((name for name in header if header.count(name) > 1), None)
            if twice is not None:  # the last column of the name would win, silently
                raise TraceFormatError(f"{path}:{line_no}: CSV header names {brief(twice)} twice")
            continue
        if len(row) != len(header):
            raise TraceFormatError(
                f"{path}:{line_no}: expected {len(header)} CSV fields, found {len(row)}"
            )
        yield line_no, dict(zip(header, row, strict=True))


def _to_request(
    path: Path,
    line_no: int,
    record: Mapping[str, Any],
    fmt: str,
    block_tokens: int,
    keys_by_id: dict[int, OffloadKey],
) -> tuple[float | int, Request]:
    """The record's timestamp in its own unit, and its request (arrival not set yet)."""
    where = f"{path}:{line_no}"
    timestamp = _timestamp(record, fmt, where)
    input_tokens = int(_number(record, "input_length", where, integer=True))
    output_tokens = int(_number(record, "output_length", where, integer=True))
    block_ids = _block_ids(record, where)
    if not _covers(len(block_ids), input_tokens, block_tokens):
        full, partial = divmod(input_tokens, block_tokens)
        expected = f"{full}" if not partial else f"{full} or {full + 1}"
        fitting = [b for b in _COMMON_BLOCK_TOKENS if _covers(len(block_ids), input_tokens, b)]
        hint = f"; pass --block-size {fitting[0]} if the trace was keyed so" if fitting else ""
        raise TraceFormatError(
            f"{where}: {len(block_ids)} hash_ids for an input_length of {input_tokens} tokens; "
            f"{block_tokens}-token blocks make that {expected}{hint}"
        )
    keys = []
    for block_id in block_ids:
        key = keys_by_id.get(block_id)
        if key is None:
            key = keys_by_id[block_id] = block_id_key(block_id)
        keys.append(key)
    return timestamp, Request(0.0, input_tokens, output_tokens, keys)


def _prefix_chained(requests: Iterator[list[OffloadKey]]) -> bool:
    """Whether every key always follows the same key (or always starts a request)."""
    after: dict[OffloadKey, OffloadKey | None] = {}
    for keys in requests:
        previous: OffloadKey | None = None
        for key in keys:
            if after.setdefault(key, previous) != previous:
                return False
            previous = key
    return True


def _chained(request: Request) -> Request:
    """``request`` with block ``i`` keyed by its ids ``0..i`` (an 8-byte digest of the
    previous block's key and its own id)."""
    keys = []
    previous = b""
    for key in request.keys:
        digest = hashlib.blake2b(previous + key, digest_size=8).digest()
        previous = block_id_key(int.from_bytes(digest, "big"))
        keys.append(previous)
    return Request(request.arrival_s, request.input_tokens, request.output_tokens, keys)


def _covers(num_ids: int, input_tokens: int, block_tokens: int) -> bool:
    """Whether ``num_ids`` keys are the prompt's full blocks, with or without its partial one."""
    full, partial = divmod(input_tokens, block_tokens)
    return full <= num_ids <= full + (partial > 0)


def _timestamp(record: Mapping[str, Any], fmt: str, where: str) -> float | int:
    """The record's timestamp in ``fmt``'s unit. One that detection would take for another
    format's (two traces joined) is refused: read in this one's unit, a Mooncake stamp among
    LMBench's put its request 1.7e9 s before the others, and an LMBench one among Mooncake's
    1.7e15 s after."""
    stamp = _whole(record, where) if fmt == "lmbench" else _number(record, "timestamp", where)
    raw = record["timestamp"]
    if fmt != "qwen" and (looks := _format_of_stamp(raw)) != fmt:
        raise TraceFormatError(
            f"{where}: field 'timestamp' {brief(raw)} looks like a {looks} trace's "
            f"({_TELLS[looks]}), but the trace reads as {fmt}; are two traces joined?"
        )
    return stamp


def _whole(record: Mapping[str, Any], where: str) -> int:
    """An LMBench timestamp: a whole number of nanoseconds, as a string or an integer."""
    if "timestamp" not in record:
        raise TraceFormatError(f"{where}: missing field 'timestamp'")
    raw = record["timestamp"]
    value = raw.strip() if isinstance(raw, str) else raw
    if isinstance(value, str):
        # int() refuses some digits isdigit() accepts ('²'), and more than 4300 of them.
        with contextlib.suppress(ValueError):
            value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceFormatError(
            f"{where}: field 'timestamp' must be a whole number of nanoseconds, got {brief(raw)}"
        )
    if value < 0:
        raise TraceFormatError(f"{where}: field 'timestamp' must be non-negative, got {brief(raw)}")
    if value > _MAX_NANOSECONDS:  # its distance from the first would overflow a float
        raise TraceFormatError(
            f"{where}: field 'timestamp' must be at most 2**64-1 nanoseconds, got {brief(raw)}"
        )
    return value


def _number(record: Mapping[str, Any], name: str, where: str, integer: bool = False) -> float:
    if name not in record:
        raise TraceFormatError(f"{where}: missing field {name!r}")
    raw = record[name]
    value = _finite(raw)
    if value is None:
        raise TraceFormatError(f"{where}: field {name!r} is not a number: {brief(raw)}")
    if value < 0 or (integer and value != int(value)):
        kind = "a non-negative integer" if integer else "non-negative"
        raise TraceFormatError(f"{where}: field {name!r} must be {kind}, got {brief(raw)}")
    return value


def _finite(raw: object) -> float | None:
    """``raw`` (a number, or its text) if it is a finite number: ``None`` for other text, a
    bool, nan, an infinity, or an integer beyond any float."""
    try:
        value = float(raw) if isinstance(raw, str) else raw
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        return value if math.isfinite(value) else None
    except (ValueError, OverflowError):
        return None


def _block_ids(record: Mapping[str, Any], where: str) -> list[int]:
    if "hash_ids" not in record:
        raise TraceFormatError(f"{where}: missing field 'hash_ids'")
    raw = record["hash_ids"]
    if isinstance(raw, str):
        raw = raw.strip().strip("[]").replace(",", " ").split()
    if not isinstance(raw, list):
        raise TraceFormatError(f"{where}: 'hash_ids' must be a list of integers")
    ids = []
    for item in raw:
        try:
            block_id = int(item) if isinstance(item, str) else item
        except ValueError:
            block_id = None
        if isinstance(block_id, bool) or not isinstance(block_id, int):
            raise TraceFormatError(f"{where}: 'hash_ids' holds a non-integer {brief(item)}")
        if not 0 <= block_id <= _MAX_BLOCK_ID:
            raise TraceFormatError(f"{where}: hash id {brief(block_id)} is outside 0 .. 2**64-1")
        ids.append(block_id)
    return ids
