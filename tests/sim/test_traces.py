"""Trace readers: both schemas, block size, and malformed input reported by file and line."""

from __future__ import annotations

import bz2
import gzip
import itertools
import json
import lzma
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from kvoffload import block_id_key
from kvoffload.core.errors import InvalidArgumentError, KVOffloadError
from kvoffload.sim.traces import (
    PROGRESS_CHARS,
    PROGRESS_LINES,
    TraceFormatError,
    detect_format,
    read_trace,
)
from kvoffload.sim.workload import Workload

MOONCAKE = [
    {"timestamp": 2000, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 3]},
    {"timestamp": 0, "input_length": 1024, "output_length": 9, "hash_ids": [0, 1]},
]
QWEN_FIELDS = ["chat_id", "parent_chat_id", "timestamp", "input_length", "output_length"]
QWEN_FIELDS += ["type", "turn", "hash_ids"]
QWEN = [
    [7, -1, 0.5, 40, 12, "text", 1, [10, 11]],
    [8, 7, 1.25, 70, 3, "text", 2, [10, 11, 12, 13]],
]


def write_jsonl(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_qwen_csv(path: Path) -> Path:
    lines = [",".join(QWEN_FIELDS)]
    for row in QWEN:
        *fields, ids = row
        lines.append(",".join(map(str, fields)) + ',"' + json.dumps(ids) + '"')
    path.write_text("\n".join(lines) + "\n")
    return path


def test_mooncake_requests_sorted_with_seconds_and_keys_per_id(tmp_path: Path) -> None:
    workload = read_trace(write_jsonl(tmp_path / "t.jsonl", MOONCAKE))
    assert workload.block_tokens == 512
    first, second = workload.requests
    assert (first.arrival_s, second.arrival_s) == (0.0, 2.0)
    assert first.keys == [block_id_key(0), block_id_key(1)]
    assert second.keys[:2] == first.keys
    assert len(set(second.keys)) == 3
    assert (second.input_tokens, second.output_tokens) == (1100, 5)


def small_block_mooncake(block_tokens: int) -> list[dict[str, object]]:
    """A Mooncake-format trace keyed per ``block_tokens`` tokens (Dynamo's generator, aiperf)."""
    return [
        {"timestamp": 0, "input_length": 5 * block_tokens, "output_length": 3,
         "hash_ids": [0, 1, 2, 3, 4]},
        {"timestamp": 40, "input_length": 3 * block_tokens + 1, "output_length": 2,
         "hash_ids": [0, 1, 2, 9]},
    ]  # fmt: skip


@pytest.mark.parametrize("block_tokens", [16, 32, 64])
def test_block_size_reaches_the_consistency_check(tmp_path: Path, block_tokens: int) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", small_block_mooncake(block_tokens))
    workload = read_trace(path, "mooncake", block_tokens=block_tokens)
    assert workload.block_tokens == block_tokens
    assert [len(r.keys) for r in workload.requests] == [5, 4]
    with pytest.raises(TraceFormatError, match=rf"512-token blocks.*--block-size {block_tokens}"):
        read_trace(path)  # the format's 512 tokens: refused, naming the size that fits


@pytest.mark.parametrize("block_tokens", [16.0, True, "16", [16]])
def test_a_block_size_that_is_no_integer_is_refused(tmp_path: Path, block_tokens: object) -> None:
    """16.0 made a workload of 16.0-token blocks; a string or list was a bare TypeError."""
    path = write_jsonl(tmp_path / "t.jsonl", small_block_mooncake(16))
    with pytest.raises(InvalidArgumentError, match="block size must be an integer"):
        read_trace(path, "mooncake", block_tokens=block_tokens)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["trace\0.jsonl", None, 3, ["t.jsonl"]])
def test_a_path_that_cannot_name_a_file_is_refused(path: object) -> None:
    """Not open()'s bare ValueError ("embedded null byte") nor Path()'s TypeError."""
    with pytest.raises(KVOffloadError, match="trace"):
        read_trace(path)  # type: ignore[arg-type]


def test_an_empty_path_is_refused_as_empty_not_as_the_current_directory() -> None:
    """``Path("")`` is ``.``: the error read ". cannot read trace: Is a directory"."""
    with pytest.raises(TraceFormatError, match=r"^cannot read trace: its path is empty$"):
        read_trace("")


def test_a_block_size_the_hash_ids_do_not_cover_is_refused(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", MOONCAKE)
    with pytest.raises(TraceFormatError, match="256-token blocks make that 4 or 5"):
        read_trace(path, "mooncake", block_tokens=256)


def test_qwen_jsonl_and_csv_read_the_same(tmp_path: Path) -> None:
    records = [dict(zip(QWEN_FIELDS, row, strict=True)) for row in QWEN]
    from_jsonl = read_trace(write_jsonl(tmp_path / "q.jsonl", records))
    from_csv = read_trace(write_qwen_csv(tmp_path / "q.csv"))
    assert from_jsonl.block_tokens == from_csv.block_tokens == 16
    assert from_jsonl.requests == from_csv.requests
    assert [r.arrival_s for r in from_csv.requests] == [0.5, 1.25]
    assert from_csv.requests[1].keys[:2] == from_csv.requests[0].keys


def test_a_byte_order_mark_is_not_part_of_the_first_record(tmp_path: Path) -> None:
    """Windows editors start UTF-8 files with one; it made line 1 invalid JSON or renamed
    the first CSV column."""
    records = [dict(zip(QWEN_FIELDS, row, strict=True)) for row in QWEN]
    for path in (write_jsonl(tmp_path / "q.jsonl", records), write_qwen_csv(tmp_path / "q.csv")):
        plain = read_trace(path)
        path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
        assert read_trace(path).requests == plain.requests, path
    mooncake = write_jsonl(tmp_path / "m.jsonl", MOONCAKE)
    mooncake.write_bytes(b"\xef\xbb\xbf" + mooncake.read_bytes())
    assert detect_format(mooncake) == "mooncake" and len(read_trace(mooncake).requests) == 2


LMBENCH = [  # newest first, nanosecond strings (LMCache's LMBench traces)
    {"timestamp": "1718000002500000001", "input_length": 1100, "output_length": 5,
     "hash_ids": [0, 1, 3]},
    {"timestamp": "1718000000000000001", "input_length": 1024, "output_length": 9,
     "hash_ids": [0, 1]},
]  # fmt: skip


def test_lmbench_traces_read_newest_first_in_nanoseconds(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "lmbench.jsonl", LMBENCH)
    assert detect_format(path) == "lmbench"
    workload = read_trace(path)
    assert workload.block_tokens == 512
    first, second = workload.requests
    assert (first.arrival_s, second.arrival_s) == (0.0, 2.5)
    assert (first.output_tokens, second.output_tokens) == (9, 5)
    assert second.keys[:2] == first.keys
    assert read_trace(path, "lmbench", block_tokens=512).requests == workload.requests
    with pytest.raises(TraceFormatError, match="looks like a lmbench trace, not mooncake"):
        read_trace(path, "mooncake")


def test_lmbench_traces_with_numeric_nanoseconds_are_not_read_as_milliseconds(
    tmp_path: Path,
) -> None:
    """LMBench's docs allow a number; detected as Mooncake's milliseconds, the arrivals came
    out at 1.7e15 s and the gaps a million times too long (and --format lmbench was refused)."""
    numeric = [{**record, "timestamp": int(record["timestamp"])} for record in LMBENCH]
    path = write_jsonl(tmp_path / "lmbench.jsonl", numeric)
    assert detect_format(path) == "lmbench"
    arrivals = [r.arrival_s for r in read_trace(path).requests]
    assert arrivals == [0.0, 2.5]
    assert [r.arrival_s for r in read_trace(path, "lmbench").requests] == arrivals


@pytest.mark.parametrize(
    ("timestamp", "message"),
    [("17e17", "whole number of nanoseconds"), ("-5", "non-negative"), (1.5, "whole number")],
)
def test_bad_lmbench_timestamps_name_file_and_line(
    tmp_path: Path, timestamp: object, message: str
) -> None:
    bad = {**LMBENCH[1], "timestamp": timestamp}
    path = write_jsonl(tmp_path / "lmbench.jsonl", [LMBENCH[0], bad])
    with pytest.raises(TraceFormatError, match=message) as info:
        read_trace(path)
    assert f"{path}:2:" in str(info.value)


@pytest.mark.parametrize(
    ("records", "message"),
    [
        (
            [LMBENCH[0], {**MOONCAKE[1], "timestamp": 2000}],
            r"2000 looks like a mooncake trace's \(.*\), but the trace reads as lmbench",
        ),
        (
            [MOONCAKE[1], {**MOONCAKE[0], "timestamp": "1733450000000000000"}],
            r"'1733450000000000000' looks like a lmbench trace's \(.*\), but the trace reads as "
            "mooncake",
        ),
        (
            [MOONCAKE[1], {**MOONCAKE[0], "timestamp": 17334500000000000000}],
            r"17334500000000000000 looks like a lmbench trace's",
        ),
    ],
    ids=["milliseconds-in-lmbench", "string-in-mooncake", "nanoseconds-in-mooncake"],
)
def test_a_record_timed_as_another_format_is_refused(
    tmp_path: Path, records: list[dict[str, object]], message: str
) -> None:
    """Two traces joined were read in the first one's unit: an LMBench trace with one of
    Mooncake's millisecond stamps replayed over 1.7e9 s, though docs/simulate.md says
    --format lmbench refuses a number below 10^16, and the reverse over 1.7e15 s."""
    path = write_jsonl(tmp_path / "t.jsonl", records)
    with pytest.raises(TraceFormatError, match=message) as info:
        read_trace(path)
    assert str(info.value).startswith(f"{path}:2: field 'timestamp' ")


def test_format_detection(tmp_path: Path) -> None:
    records = [dict(zip(QWEN_FIELDS, row, strict=True)) for row in QWEN]
    assert detect_format(write_jsonl(tmp_path / "m.jsonl", MOONCAKE)) == "mooncake"
    assert detect_format(write_jsonl(tmp_path / "q.jsonl", records)) == "qwen"
    assert detect_format(write_qwen_csv(tmp_path / "q.csv")) == "qwen"


def test_a_forced_format_that_does_not_match_is_refused(tmp_path: Path) -> None:
    mooncake = write_jsonl(tmp_path / "m.jsonl", MOONCAKE)
    # It said why in one word, "(numbers)".
    with pytest.raises(
        TraceFormatError, match=r"looks like a mooncake trace, not qwen \(no 'chat_id', numeric"
    ):
        read_trace(mooncake, "qwen")
    with pytest.raises(TraceFormatError, match="looks like a qwen trace, not mooncake"):
        read_trace(write_qwen_csv(tmp_path / "q.csv"), "mooncake")
    assert read_trace(mooncake, "mooncake").block_tokens == 512


def test_a_forced_format_refused_for_a_csv_trace_gives_the_csv_name_as_the_reason(
    tmp_path: Path,
) -> None:
    """A CSV trace reads as Qwen's by its name: the refusal said "(has 'chat_id')" of a CSV
    file with no such column."""
    csv_trace = tmp_path / "m.csv"
    csv_trace.write_text('timestamp,input_length,output_length,hash_ids\n0,1200,50,"0 1 2"\n')
    with pytest.raises(TraceFormatError) as refused:
        read_trace(csv_trace, "mooncake")
    assert "chat_id" not in str(refused.value)
    assert "named *.csv" in str(refused.value)


GOOD = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}'


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"timestamp": 0, "output_length": 1, "hash_ids": [1]}', "input_length"),
        ('{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": []}', "non-neg"),
        ('{"timestamp": "x", "input_length": 5, "output_length": 1, "hash_ids": []}', "number"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "integer"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-1]}', "outside"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": 3}', "list"),
        ('{"timestamp": 0, "input_length": 5.5, "output_length": 1, "hash_ids": []}', "integer"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path: Path, bad_line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{GOOD}\n\n{bad_line}\n{GOOD}\n")
    with pytest.raises(TraceFormatError, match=message) as info:
        read_trace(path, "mooncake")
    assert f"{path}:3:" in str(info.value)
    assert isinstance(info.value, KVOffloadError)


LONG = "9" * 1_000_000
"""A field's text far past any error line: a line holds up to 16 Mi characters."""
DIGITS = LONG[:4000]
"""Digits that still make an int (Python converts at most 4,300)."""


@pytest.mark.parametrize(
    ("fmt", "line", "message"),
    [
        ("mooncake", f'"timestamp": "{LONG}x", "input_length": 5, "hash_ids": [1]', "a number"),
        ("mooncake", f'"timestamp": 0, "input_length": "5.5{LONG}", "hash_ids": [1]', "integer"),
        ("mooncake", f'"timestamp": 0, "input_length": 5, "hash_ids": ["{LONG}x"]', "integer"),
        ("mooncake", f'"timestamp": 0, "input_length": 5, "hash_ids": [{DIGITS}]', "outside"),
        ("lmbench", f'"timestamp": "{DIGITS}", "input_length": 5, "hash_ids": [1]', "2\\*\\*64"),
        ("lmbench", f'"timestamp": "{LONG}x", "input_length": 5, "hash_ids": [1]', "whole"),
    ],
    ids=["text", "fraction", "hash-id-text", "hash-id-range", "nanoseconds", "not-whole"],
)
def test_a_huge_field_is_cut_short_in_its_error(
    tmp_path: Path, fmt: str, line: str, message: str
) -> None:
    """The error printed the field whole: a line of a million characters on the terminal."""
    path = tmp_path / "t.jsonl"
    first = '{"timestamp": "1733450000000000000",' if fmt == "lmbench" else '{"timestamp": 0,'
    head = first + ' "input_length": 5, "output_length": 1, "hash_ids": [1]}'
    path.write_text(f'{head}\n{{{line}, "output_length": 1}}\n')
    with pytest.raises(TraceFormatError, match=message) as info:
        read_trace(path, fmt)
    assert str(info.value).startswith(f"{path}:2: ")
    assert len(str(info.value)) < 300


def test_a_huge_csv_header_name_is_cut_short_in_its_error(tmp_path: Path) -> None:
    path = tmp_path / "q.csv"
    path.write_text(f"{LONG},hash_ids,{LONG}\n")
    with pytest.raises(TraceFormatError, match=r"q\.csv:1: CSV header names '9{10}") as info:
        read_trace(path)
    assert len(str(info.value)) < 300


def test_a_csv_trace_not_named_csv_is_told_how_it_is_read(tmp_path: Path) -> None:
    """It read only "invalid JSON: Expecting value": the format is known by the name."""
    path = tmp_path / "q.txt"
    path.write_text(write_qwen_csv(tmp_path / "q.csv").read_text())
    with pytest.raises(TraceFormatError, match=r"q\.txt:1: invalid JSON: .*named \*\.csv$"):
        read_trace(path)
    path.write_text(json.dumps(MOONCAKE[0]) + "\nchat_id,hash_ids\n")  # a header past line 1
    with pytest.raises(TraceFormatError, match=r"q\.txt:2: invalid JSON: [^;]*$"):
        read_trace(path)


def test_csv_row_with_wrong_field_count(tmp_path: Path) -> None:
    path = write_qwen_csv(tmp_path / "q.csv")
    path.write_text(path.read_text() + "1,2,3\n")
    with pytest.raises(TraceFormatError, match=r"q\.csv:4: expected 8 CSV fields, found 3"):
        read_trace(path)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ('8,7,1.25,70,3,text,2,"[10, 11,\n12, 13]"', "a quoted field not closed on its line"),
        ('8,7,1.25,70,3,text,2,"[10, 11, 12, 13]"5', "',' expected after '\"'"),
    ],
    ids=["quote-left-open", "text-after-quote"],
)
def test_a_malformed_quoted_csv_field_is_refused_on_its_line(
    tmp_path: Path, row: str, message: str
) -> None:
    """A quoted field over two lines was cut at the first (its line's error then counted
    two hash_ids for 70 tokens), and text after a closing quote was joined to the field."""
    path = write_qwen_csv(tmp_path / "q.csv")
    path.write_text(path.read_text() + row + "\n")
    with pytest.raises(TraceFormatError, match=re.escape(f"q.csv:4: invalid CSV: {message}")):
        read_trace(path)


def test_a_csv_header_naming_a_column_twice_is_refused(tmp_path: Path) -> None:
    """The row's last column of the name was read, the first ignored."""
    path = write_qwen_csv(tmp_path / "q.csv")
    header, *rows = path.read_text().splitlines()
    path.write_text("\n".join([header.replace("turn", "timestamp"), *rows]) + "\n")
    with pytest.raises(TraceFormatError, match=r"q\.csv:1: CSV header names 'timestamp' twice"):
        read_trace(path)


def test_missing_empty_and_binary_files(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="cannot read"):
        read_trace(tmp_path / "absent.jsonl", "mooncake")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceFormatError, match="no records"):
        read_trace(tmp_path / "empty.jsonl")
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TraceFormatError, match="UTF-8"):
        read_trace(tmp_path / "bin.jsonl", "mooncake")


@pytest.mark.parametrize(
    ("compress", "reader"),
    [(gzip.compress, "zcat"), (bz2.compress, "bzcat"), (lzma.compress, "xzcat")],
    ids=["gzip", "bzip2", "xz"],
)
def test_a_compressed_trace_is_named_so_with_a_way_to_read_it(
    tmp_path: Path, compress: Callable[[bytes], bytes], reader: str
) -> None:
    """It read "not a UTF-8 text file (invalid start byte)"; docs/simulate.md reads a
    compressed trace through a pipe, and the error now says how."""
    path = tmp_path / "t.jsonl"
    path.write_bytes(compress(json.dumps(MOONCAKE[0]).encode() + b"\n"))
    pipe = re.escape(f"<({reader} {path})")
    with pytest.raises(TraceFormatError, match=rf"compressed\); .*{pipe}$"):
        read_trace(path)


def test_a_byte_that_is_not_utf8_is_named_by_its_line(tmp_path: Path) -> None:
    """The text reader decodes thousands of lines ahead: the error named no line at all."""
    good = json.dumps(MOONCAKE[0]) + "\n"
    path = tmp_path / "t.jsonl"
    path.write_bytes((good * 3000 + "\r\n" + good * 20).encode() + b"\xe9" + good.encode())
    where = re.escape(f"{path}:3022")
    with pytest.raises(TraceFormatError, match=rf"^{where}: not a UTF-8 text file"):
        read_trace(path)


@pytest.mark.parametrize(
    "lines",
    [
        ["good", "good", "bad", "good"],
        ["good", "good", "good", "good", "bad"],
    ],
)
@pytest.mark.parametrize("end", ["\r", "\r\n"], ids=["cr", "crlf"])
def test_a_byte_that_is_not_utf8_is_named_by_its_line_whatever_the_line_ends(
    tmp_path: Path, lines: list[str], end: str
) -> None:
    """The reader ends a line at "\\r" too; the bad byte's line counted only "\\n", so a file
    of "\\r" line ends named line 1. The first line runs to the 1 MiB the search reads at a
    time, its "\\r\\n" split across two reads, which ends one line, not two."""
    good = json.dumps(MOONCAKE[0])
    first = good + " " * (2**20 - len(good) - 1) + end
    text = {"good": good.encode() + end.encode(), "bad": b'{"x": "\xe9"}' + end.encode()}
    path = tmp_path / "t.jsonl"
    path.write_bytes(first.encode() + b"".join(text[kind] for kind in lines[1:]))
    where = re.escape(f"{path}:{lines.index('bad') + 1}")
    with pytest.raises(TraceFormatError, match=rf"^{where}: not a UTF-8 text file"):
        read_trace(path)


def test_reading_reports_its_bytes_from_the_start_to_the_file_size(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    line = json.dumps(MOONCAKE[0]) + "\n"
    path.write_text(line * (3 * PROGRESS_LINES))
    calls: list[tuple[int, int]] = []
    assert len(read_trace(path, progress=lambda *call: calls.append(call)).requests) == len(
        read_trace(path).requests
    )
    size = path.stat().st_size
    assert len(calls) == 4 and calls[-1] == (size, size)  # every 4096 lines, and at the end
    assert all(total == size for _, total in calls)
    done = [d for d, _ in calls]
    assert done == sorted(done) and 0 < done[0] < done[1] < size


def test_reading_long_lines_reports_every_few_mebibytes(tmp_path: Path) -> None:
    """Reports came only every 4096 lines: 200 prompts of a million tokens in 16-token blocks
    (114 MB) showed 0% for 8 s, then 100%."""
    path = tmp_path / "t.jsonl"
    line = json.dumps(MOONCAKE[0])
    line += " " * (2**19 - len(line) - 1) + "\n"  # half a MiB, blank-padded
    path.write_text(line * (4 * PROGRESS_CHARS // len(line)))
    calls: list[tuple[int, int]] = []
    read_trace(path, progress=lambda *call: calls.append(call))
    size = path.stat().st_size
    done = [0] + [d for d, _ in calls]
    assert calls[-1] == (size, size) and done == sorted(done)
    # At most a report's worth, a line and the text reader's chunk between two reports.
    assert max(b - a for a, b in itertools.pairwise(done)) <= PROGRESS_CHARS + len(line) + 2**16


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a named pipe")
def test_reading_a_pipe_of_unknown_size_reports_nothing(tmp_path: Path) -> None:
    fifo = tmp_path / "t.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: write_jsonl(fifo, MOONCAKE))
    writer.start()
    calls: list[tuple[int, int]] = []
    try:
        assert len(read_trace(fifo, progress=lambda *call: calls.append(call)).requests) == 2
    finally:
        writer.join()
    assert calls == []


def test_public_mooncake_trace_figures(mooncake_trace: Path) -> None:
    workload = read_trace(mooncake_trace)
    keys = [key for req in workload.requests for key in req.keys]
    assert (len(workload.requests), len(keys), len(set(keys))) == (3993, 121_877, 43_924)


PUBLISHED = {  # records in the shapes the formats' own READMEs publish (ids shortened or ours)
    "mooncake": [  # kvcache-ai/Mooncake FAST25-release/README.md: ms, 512-token prefix blocks
        {"timestamp": 27482, "input_length": 6955, "output_length": 52,
         "hash_ids": [*range(46, 58), 2353, 2354]},
        {"timestamp": 30535, "input_length": 6472, "output_length": 26,
         "hash_ids": [*range(46, 58), 2366]},
    ],
    "qwen": [  # alibaba-edu/qwen-bailian-usagetraces-anon README.md: seconds, 16-token blocks
        {"chat_id": 0, "parent_chat_id": -1, "timestamp": 0.0, "input_length": 502,
         "output_length": 1494, "type": "thinking", "turn": 1, "hash_ids": list(range(32))},
        {"chat_id": 159, "parent_chat_id": 55, "timestamp": 61.114, "input_length": 521,
         "output_length": 132, "type": "text", "turn": 2,
         "hash_ids": [0, 1, 2, *range(6326, 6355), 13148]},
    ],
}  # fmt: skip


@pytest.mark.parametrize(
    ("fmt", "block_tokens", "arrivals", "shared"),
    [("mooncake", 512, (27.482, 30.535), 12), ("qwen", 16, (0.0, 61.114), 3)],
)
def test_published_records_read_as_their_format_defines(
    tmp_path: Path, fmt: str, block_tokens: int, arrivals: tuple[float, float], shared: int
) -> None:
    """Each format's own example: its time unit, block size, one key per id, a shared prefix."""
    records = PUBLISHED[fmt]
    workload = read_trace(write_jsonl(tmp_path / "t.jsonl", records))
    assert (detect_format(tmp_path / "t.jsonl"), workload.block_tokens) == (fmt, block_tokens)
    assert tuple(r.arrival_s for r in workload.requests) == pytest.approx(arrivals)
    for record, request in zip(records, workload.requests, strict=True):
        assert (request.input_tokens, request.output_tokens) == (
            record["input_length"],
            record["output_length"],
        )
        assert request.keys == [block_id_key(i) for i in record["hash_ids"]]
    first, second = (r.keys for r in workload.requests)
    assert first[:shared] == second[:shared] and first[shared] != second[shared]


def _bailian(tmp_path: Path, *requests: list[int]) -> Workload:
    """Bailian-shaped records of 16-token blocks, one a second, read as ``qwen``."""
    records: list[dict[str, object]] = [
        {
            "chat_id": i,
            "timestamp": i,
            "input_length": 16 * len(ids),
            "output_length": 1,
            "hash_ids": ids,
        }
        for i, ids in enumerate(requests)
    ]
    return read_trace(write_jsonl(tmp_path / "t.jsonl", records), "qwen", block_tokens=16)


def test_ids_that_are_not_prefix_chained_are_chained_on_reading(tmp_path: Path) -> None:
    """Ids of single blocks' contents (block 7 after 1 in one request, first in another)
    would let a block hit after another prefix; keyed by their whole prefix, only the
    shared prefix matches, as in a KV cache."""
    workload = _bailian(tmp_path, [1, 7, 9], [1, 7, 8], [7, 9])
    first, second, third = (r.keys for r in workload.requests)
    assert first[:2] == second[:2] and first[2] != second[2]
    assert not set(third) & set(first)  # 7 and 9 came after another prefix
    assert len({*first, *second, *third}) == 6


def test_prefix_chained_ids_are_keys_as_they_are(tmp_path: Path) -> None:
    requests = [[1, 7, 9], [1, 7], [2, 3]]
    workload = _bailian(tmp_path, *requests)
    assert [r.keys for r in workload.requests] == [
        [block_id_key(i) for i in ids] for ids in requests
    ]
