"""Numbers past what a float or Python's int parsing holds, and line breaks in arguments,
still end in one line on stderr: never a traceback, a hang or a second line.

In a subprocess with a timeout where the old behaviour was to loop forever.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import one_line_error

from kvoffload.cli.main import main

CLI = [sys.executable, "-c", "import sys; from kvoffload.cli.main import main; sys.exit(main())"]
SMALL = ["simulate", "--requests", "5", "--no-progress", "--no-bound"]
REST = '"input_length": 1024, "output_length": 1, "hash_ids": [1, 2]'
"""A record's fields after its timestamp."""
TOO_MANY_DIGITS = "9" * 5000
"""More digits than Python turns into an int (4300 by default)."""


@pytest.mark.parametrize(
    ("records", "message"),
    [
        (
            [f'{{"timestamp": {TOO_MANY_DIGITS}, {REST}}}'],
            ":1: invalid JSON: an integer of more than 4,300 digits",
        ),
        (
            [
                '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, '
                f"{TOO_MANY_DIGITS}]}}"
            ],
            ":1: invalid JSON: an integer of more than 4,300 digits",
        ),
        (
            [
                f'{{"timestamp": 0, "input_length": 1024, "output_length": {"9" * 400}, '
                '"hash_ids": [1, 2]}'
            ],
            ":1: field 'output_length' is not a number",
        ),
        ([f'{{"timestamp": "\\u00b2", {REST}}}'], ":1: field 'timestamp' must be a whole number"),
        ([f'{{"timestamp": "--5", {REST}}}'], ":1: field 'timestamp' must be a whole number"),
        (
            [f'{{"timestamp": "{TOO_MANY_DIGITS}", {REST}}}'],
            ":1: field 'timestamp' must be a whole number",
        ),
        (
            [f'{{"timestamp": "{10**400}", {REST}}}', f'{{"timestamp": "1", {REST}}}'],
            ":1: field 'timestamp' must be at most 2**64-1 nanoseconds",
        ),
    ],
)
def test_numbers_python_cannot_convert_are_trace_errors(
    tmp_path: Path, records: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(record + "\n" for record in records))
    assert main(["simulate", "--trace", str(trace), "--no-progress"]) == 1
    assert message in one_line_error(capsys)


def _assert_one_line(result: subprocess.CompletedProcess[str], status: int, message: str) -> None:
    assert result.returncode == status, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert message in result.stderr


@pytest.mark.parametrize(
    ("throughput", "named"),
    [
        (["--decode-tokens-per-s", "1e-306"], "output tokens at --decode-tokens-per-s 1e-306"),
        (
            ["--decode-tokens-per-s", "1e-306", "--concurrency", "3"],
            "output tokens at --decode-tokens-per-s 1e-306",
        ),
        (["--prefill-tokens-per-s", "1e-306"], "prompt tokens at --prefill-tokens-per-s 1e-306"),
    ],
)
def test_a_throughput_whose_times_overflow_is_refused_not_looped(
    throughput: list[str], named: str
) -> None:
    """An event at infinite time was never due, and the engine's loop spun forever."""
    argv = [*SMALL, "--gpu-blocks", "1000", *throughput]
    result = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=60, check=False)
    _assert_one_line(result, 1, named)


def test_a_trace_whose_decode_time_overflows_is_refused_not_looped(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    record = '{{"timestamp": {}, "input_length": 512, "output_length": 1.7e308, "hash_ids": [1]}}'
    trace.write_text(record.format(0) + "\n" + record.format(1) + "\n")
    argv = ["simulate", "--trace", str(trace), "--no-progress", "--decode-tokens-per-s", "0.5"]
    result = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=60, check=False)
    named = "the workload's about 10^308 output tokens at --decode-tokens-per-s 0.5 take more"
    _assert_one_line(result, 1, named)


@pytest.mark.parametrize("command", ["simulate", "sweep"])
def test_a_block_the_default_gpu_cannot_hold_is_named(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The message formatted --gpu-gb, which was not given: a TypeError."""
    argv = [command, "--requests", "5", "--no-progress", "--block-size", "200000"]
    assert main([*argv, *(["--jobs", "1"] if command == "sweep" else [])]) == 1
    assert "the default GPU size, 24 GiB, holds no block of 24.4 GiB" in one_line_error(capsys)


@pytest.mark.parametrize("command", [SMALL, ["trace-stats", "t.jsonl"]])
def test_a_block_size_past_a_million_tokens_is_a_usage_error(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A block of 10^310 tokens had more bytes than a float holds: a traceback."""
    assert main([*command, "--block-size", str(10**310)]) == 2
    assert "--block-size: must be <= 1048576" in one_line_error(capsys)


def test_a_drive_size_past_a_float_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--admission", "recommended", "--write-budget", "1dwpd", "--drive-bytes", "1e300TB"]
    assert main([*SMALL, *argv]) == 2
    assert "--drive-bytes: must be a finite number of bytes, got '1e300TB'" in one_line_error(
        capsys
    )


def test_drive_writes_past_a_float_s_bytes_a_day_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``1e308dwpd`` of a 2 TB drive came to inf blocks a second: the run went on as if no
    budget had been given (the same writes), unsaid."""
    argv = ["--admission", "recommended", "--write-budget", "1e308dwpd", "--drive-bytes", "2TB"]
    assert main([*SMALL, *argv]) == 1
    assert (
        one_line_error(capsys)
        .rstrip()
        .endswith(
            "a write budget of 1e+308 drive writes per day comes to more bytes a day than a float "
            "holds on its drive: give a finite one, or leave it out for no budget"
        )
    )


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (["--trace", "{tmp}/no\nsuch", "--format", "mooncake"], 1, "no\\nsuch: cannot read trace"),
        (["--json", "{tmp}/no\nsuch/x.json"], 1, "no such directory: {tmp}/no\\nsuch"),
        (["x\ny"], 2, "unrecognized arguments: x\\ny"),
    ],
)
def test_a_line_break_in_an_argument_keeps_the_error_on_one_line(
    tmp_path: Path, args: list[str], status: int, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", "--no-progress", *(arg.format(tmp=tmp_path) for arg in args)]
    assert main(argv) == status
    assert message.format(tmp=tmp_path) in one_line_error(capsys)


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        (["--json", "{tmp}/out", "--plot-dir", "{tmp}/out"], "--json {tmp}/out is the --plot-dir"),
        (
            ["--csv", "{tmp}/hit_ratio_vs_writes.png", "--plot-dir", "{tmp}/"],
            "is the plot hit_ratio_vs_writes.png that --plot-dir writes",
        ),
    ],
)
def test_a_result_file_where_the_plots_go_is_refused_before_the_sweep(
    tmp_path: Path, outputs: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The plot directory's creation failed after the sweep, or a plot overwrote the CSV."""
    argv = ["sweep", "--requests", "20", "--cpu-blocks", "10", "--jobs", "1", "--no-progress"]
    assert main([*argv, *(arg.format(tmp=tmp_path) for arg in outputs)]) == 1
    assert message.format(tmp=tmp_path) in one_line_error(capsys)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--disk-gb-per-s", "1e-308", "must be >= 1e-09, got 1e-308"),
        ("--disk-latency-ms", "1e308", "must be <= 604,800,000, got 1e308"),
        ("--remote-gb-per-s", "1e-10", "must be >= 1e-09, got 1e-10"),
        ("--remote-latency-ms", "6.1e8", "must be <= 604,800,000, got 6.1e8"),
    ],
)
def test_a_tier_model_whose_times_overflow_is_a_usage_error(
    option: str, value: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The disk tier's modelled read time was inf: the table said "-inf s" of prefill saved,
    and the JSON held -Infinity, which no JSON reader takes."""
    disk = ["--disk-dir", str(tmp_path), "--disk-blocks", "100"]
    assert main([*SMALL, *disk, "--cpu-blocks", "30", option, value]) == 2
    assert f"argument {option}: {message}" in one_line_error(capsys)


LONG_NUMBER = "9" * 100_000 + "x"
"""Digits that are no write budget or size: the number's pattern could split them between
its whole and its fractional part (the point was optional) at every place, so a refusal
took time quadratic in their length (8,000 digits 8 s, these about 20 minutes)."""


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--write-budget", LONG_NUMBER], "argument --write-budget"),
        (["--write-budget", "1dwpd", "--drive-bytes", LONG_NUMBER], "argument --drive-bytes"),
        (
            ["--disk-dir", ".", "--disk-blocks", "8", "--disk-write-budget", LONG_NUMBER],
            "argument --disk-write-budget",
        ),
    ],
)
def test_a_long_write_budget_or_drive_size_is_refused_at_once(argv: list[str], option: str) -> None:
    argv = [*SMALL, "--admission", "recommended", *argv]
    result = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=60, check=False)
    _assert_one_line(result, 2, option)


def test_a_prefill_time_near_a_float_s_limit_is_short(capsys: pytest.CaptureFixture[str]) -> None:
    """A prefill rate near zero gives times of 10^300 s: the table printed each of them with
    every digit and separator, a row of over 800 characters."""
    argv = [*SMALL, "--gpu-blocks", "1000", "--cpu-blocks", "100", "--prefill-tokens-per-s"]
    assert main([*argv, "1e-300"]) == 0
    [row] = [line for line in capsys.readouterr().out.splitlines() if "prefill time" in line]
    assert len(row) < 120 and "e+30" in row, row


@pytest.mark.parametrize(
    ("value", "places", "shown"),
    [
        (2733075595264.099, 3, "2.73e+12 s"),
        (-2.7e12, 1, "-2.7e+12 s"),
        (999_999_999_999.0, 1, "999,999,999,999.0 s"),
        (1234.5678, 3, "1,234.568 s"),
        (None, 3, "-"),
    ],
)
def test_seconds_are_grouped_and_past_a_trillion_in_scientific_notation(
    value: float | None, places: int, shown: str
) -> None:
    """A disk tier's modelled read time read ``modelled 2733075595264.099 s``, beside a
    prefill time of ``-2,733,075,593,061.5 s`` in the row above."""
    from kvoffload.cli.output import seconds

    assert seconds(value, places) == shown
