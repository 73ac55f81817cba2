"""Hostile trace files: each reads into a sound workload or fails in one short line that
names the file, whatever its bytes (fields of any JSON type, stray bytes, cut lines)."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.sim.traces import TraceFormatError, read_trace

FIELDS = ["timestamp", "input_length", "output_length", "hash_ids"]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=6,
)
CSV_CELLS = ["0", "-1", "1.5", "nan", "inf", "", "1e400", "[0, 1]", "0 1", "abc", '"', "["]


@st.composite
def jsonl_traces(draw: st.DrawFn) -> bytes:
    """Records of each format, some with a field of another type or missing."""
    lines = []
    for _ in range(draw(st.integers(0, 5))):
        stamp = draw(st.sampled_from([0, 5, 1.5, "1718000000000000001", 10**17]))
        ids = draw(st.lists(st.integers(0, 5), min_size=2, max_size=2))
        record = {"timestamp": stamp, "input_length": 1024, "output_length": 3, "hash_ids": ids}
        if draw(st.booleans()):
            record[draw(st.sampled_from([*FIELDS, "chat_id"]))] = draw(JSON_VALUES)
        if draw(st.integers(0, 5)) == 0:
            del record[draw(st.sampled_from(FIELDS))]
        lines.append(json.dumps(record))
    return ("\n".join(lines) + draw(st.sampled_from(["", "\n", "\r\n"]))).encode()


@st.composite
def csv_traces(draw: st.DrawFn) -> bytes:
    """Qwen CSV rows, some with an odd cell or too few."""
    rows = ["chat_id,timestamp,input_length,output_length,hash_ids"]
    for index in range(draw(st.integers(0, 4))):
        row = [str(index), "0.5", "32", "1", '"[1, 2]"']
        for _ in range(draw(st.integers(0, 2))):
            row[draw(st.integers(0, 4))] = draw(st.sampled_from(CSV_CELLS))
        rows.append(",".join(row[: draw(st.sampled_from([5, 5, 5, 3]))]))
    return ("\n".join(rows) + draw(st.sampled_from(["", "\n", "\r\n"]))).encode()


@st.composite
def damaged(draw: st.DrawFn, traces: st.SearchStrategy[bytes]) -> bytes:
    """A trace with a few bytes put in, or its end cut off."""
    data = draw(traces)
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(data)))
        if draw(st.booleans()):
            data = data[:at] + draw(st.binary(min_size=1, max_size=4)) + data[at:]
        else:
            data = data[:at]
    return data


def read_or_refuse(data: bytes, suffix: str, fmt: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"t{suffix}"
        path.write_bytes(data)
        try:
            workload = read_trace(path, fmt)
        except TraceFormatError as exc:
            message = str(exc)
            assert message.startswith(f"{path}") and "\n" not in message
            assert len(message) < len(str(path)) + 300
            return
    for request in workload.requests:
        assert math.isfinite(request.arrival_s) and request.arrival_s >= 0
        assert isinstance(request.input_tokens, int) and request.input_tokens >= 0
        assert isinstance(request.output_tokens, int) and request.output_tokens >= 0


@settings(max_examples=300, deadline=None)
@given(data=damaged(jsonl_traces()), fmt=st.sampled_from(["auto", "mooncake", "lmbench", "qwen"]))
def test_a_damaged_jsonl_trace_reads_or_is_refused_in_one_line(data: bytes, fmt: str) -> None:
    read_or_refuse(data, ".jsonl", fmt)


@settings(max_examples=300, deadline=None)
@given(data=damaged(csv_traces()), fmt=st.sampled_from(["auto", "qwen"]))
def test_a_damaged_csv_trace_reads_or_is_refused_in_one_line(data: bytes, fmt: str) -> None:
    read_or_refuse(data, ".csv", fmt)
