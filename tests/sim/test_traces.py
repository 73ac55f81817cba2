"""Trace readers: both schemas, block size, and malformed input reported by file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoffload import block_id_key
from kvoffload.core.errors import KVOffloadError
from kvoffload.sim.traces import TraceFormatError, detect_format, read_trace

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


def test_block_size_is_a_parameter(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", MOONCAKE)
    assert read_trace(path, "mooncake", block_tokens=256).block_tokens == 256


def test_qwen_jsonl_and_csv_read_the_same(tmp_path: Path) -> None:
    records = [dict(zip(QWEN_FIELDS, row, strict=True)) for row in QWEN]
    from_jsonl = read_trace(write_jsonl(tmp_path / "q.jsonl", records))
    from_csv = read_trace(write_qwen_csv(tmp_path / "q.csv"))
    assert from_jsonl.block_tokens == from_csv.block_tokens == 16
    assert from_jsonl.requests == from_csv.requests
    assert [r.arrival_s for r in from_csv.requests] == [0.5, 1.25]
    assert from_csv.requests[1].keys[:2] == from_csv.requests[0].keys


def test_format_detection(tmp_path: Path) -> None:
    records = [dict(zip(QWEN_FIELDS, row, strict=True)) for row in QWEN]
    assert detect_format(write_jsonl(tmp_path / "m.jsonl", MOONCAKE)) == "mooncake"
    assert detect_format(write_jsonl(tmp_path / "q.jsonl", records)) == "qwen"
    assert detect_format(write_qwen_csv(tmp_path / "q.csv")) == "qwen"


def test_a_forced_format_that_does_not_match_is_refused(tmp_path: Path) -> None:
    mooncake = write_jsonl(tmp_path / "m.jsonl", MOONCAKE)
    with pytest.raises(TraceFormatError, match="looks like a mooncake trace, not qwen"):
        read_trace(mooncake, "qwen")
    with pytest.raises(TraceFormatError, match="looks like a qwen trace, not mooncake"):
        read_trace(write_qwen_csv(tmp_path / "q.csv"), "mooncake")
    assert read_trace(mooncake, "mooncake").block_tokens == 512


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


def test_csv_row_with_wrong_field_count(tmp_path: Path) -> None:
    path = write_qwen_csv(tmp_path / "q.csv")
    path.write_text(path.read_text() + "1,2,3\n")
    with pytest.raises(TraceFormatError, match=r"q\.csv:4: expected 8 CSV fields, found 3"):
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


def test_public_mooncake_trace_figures(mooncake_trace: Path) -> None:
    workload = read_trace(mooncake_trace)
    keys = [key for req in workload.requests for key in req.keys]
    assert (len(workload.requests), len(keys), len(set(keys))) == (3993, 121_877, 43_924)
