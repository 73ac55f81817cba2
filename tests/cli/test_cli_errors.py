"""Bad input ends with one line on stderr and exit status 1, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import one_line_error

from kvoffload.cli.main import main

SMALL = ["simulate", "--requests", "50", "--no-progress"]


def test_malformed_trace_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n{')
    assert main(["simulate", "--trace", str(trace)]) == 1
    assert f"{trace}:2: invalid JSON" in one_line_error(capsys)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policy", "fifo"], "unknown cache policy 'fifo'"),
        (["--layout", "gpt-9"], "unknown KV layout"),
        (["--mix", "video=1"], "unknown workload kind"),
        (["--gpu-blocks", "3"], "cannot fit in a GPU cache of 3 blocks"),
        (["--trace", "/nonexistent/trace.jsonl", "--format", "mooncake"], "cannot read trace"),
        (["--json", "/nonexistent/dir/out.json"], "/nonexistent/dir/out.json"),
    ],
)
def test_bad_arguments(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, *args]) == 1
    assert message in one_line_error(capsys)


def test_sweep_bad_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", "--requests", "20", "--cpu-blocks", "10,lots", "--jobs", "1"]) == 1
    assert "comma-separated integers" in one_line_error(capsys)


def test_usage_errors_are_argparse_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--no-such-flag"]) == 2
    assert "unrecognized arguments: --no-such-flag" in one_line_error(capsys)
    assert main([]) == 2
    assert "required: COMMAND" in one_line_error(capsys)
