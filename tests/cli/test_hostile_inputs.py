"""Hostile input ends in one line on stderr and a non-zero status, never a traceback or a hang.

In-process through ``main`` where nothing could hang; in a subprocess with a
timeout where the old behaviour was to loop or read forever.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import needs_two_cpus, one_line_error

from compiled import needs
from kvoffload import CPUOffloadingManager, FilterReusedOffloadingManager, block_id_key
from kvoffload.admission import available_admissions
from kvoffload.admission.budget import WriteBudget
from kvoffload.admission.reuse_counts import MAX_TRACKED_KEYS, CompiledReuseCounts
from kvoffload.cli import options
from kvoffload.cli.main import main
from kvoffload.cli.output import one_line
from kvoffload.managers import build_manager
from kvoffload.sim.plots import PLOT_FILES

CLI = [sys.executable, "-c", "import sys; from kvoffload.cli.main import main; sys.exit(main())"]
SMALL = ["simulate", "--requests", "30", "--no-progress", "--no-bound"]
RECORD = '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}'


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The CLI in its own process; ``timeout`` only stops a hang on a loaded machine."""
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rate", "nan"], "--rate: must be a finite number"),
        (["--rate", "inf"], "--rate: must be a finite number"),
        (["--rate", "0"], "--rate: must be > 0"),
        (["--cpu-gb", "nan"], "--cpu-gb: must be a finite number"),
        (["--cpu-gb", "-1"], "--cpu-gb: must be >= 0"),
        (["--gpu-gb", "inf"], "--gpu-gb: must be a finite number"),
        (["--gpu-gb", "0"], "--gpu-gb: must be > 0"),
        (["--gpu-gb", "1e300"], "--gpu-gb: must be <= 1,125,899,906,842,624, got 1e300"),
        (["--cpu-gb", "1e300"], "--cpu-gb: must be <= 1,125,899,906,842,624, got 1e300"),
        (["--gpu-blocks", "0"], "--gpu-blocks: must be >= 1"),
        (["--gpu-blocks", "1e3"], "--gpu-blocks: expected an integer"),
        (["--cpu-blocks", "-4"], "--cpu-blocks: must be >= 0"),
        (["--requests", "0"], "--requests: must be >= 1"),
        (["--block-size", "-16"], "--block-size: must be >= 1"),
        (["--seed", "-1"], "--seed: must be >= 0"),
        (["--store-threshold", "2.5"], "--store-threshold: expected an integer"),
        (["--store-threshold", str(2**63)], f"--store-threshold: must be <= {2**62}"),
        (["--concurrency", "0"], "--concurrency: must be >= 1"),
        (["--max-tracker-size", "-3"], "--max-tracker-size: must be >= 1"),
        # Refused only by the reuse filter as the run started, not naming the option.
        (["--max-tracker-size", str(10**20)], f"--max-tracker-size: must be <= {MAX_TRACKED_KEYS}"),
        (["--prefill-tokens-per-s", "inf"], "must be a finite number"),
        (["--decode-tokens-per-s", "nan"], "must be a finite number"),
        (["--transfer-gb-per-s", "-0.5"], "must be > 0"),
        (["--partial-block", "maybe"], "invalid choice: 'maybe'"),
    ],
)
def test_bad_numbers_are_usage_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*SMALL, *args]) == 2
    assert message in one_line_error(capsys)


@pytest.mark.parametrize("attached", [False, True])
@pytest.mark.parametrize(
    ("command", "option", "value", "status", "message"),
    [
        ("simulate", "--cpu-gb", "-1e-400", 2, "argument --cpu-gb: must be >= 0, got -1e-400"),
        ("simulate", "--cpu-gb", "1e-400", 2, "--cpu-gb: 1e-400 is too small to tell from 0"),
        ("simulate", "--gpu-gb", "-inf", 2, "--gpu-gb: must be a finite number, got '-inf'"),
        ("simulate", "--disk-gb", "-1e-400", 2, "argument --disk-gb: must be > 0, got -1e-400"),
        ("simulate", "--disk-latency-ms", "-1e-400", 2, "--disk-latency-ms: must be >= 0"),
        ("simulate", "--write-budget", "-1e-400", 2, "--write-budget: must be >= 0, got -1e-400"),
        ("simulate", "--write-budget", "1e-400", 2, "1e-400 is too small to tell from 0"),
        (
            "simulate",
            "--drive-bytes",
            "-1e-400",
            2,
            "--drive-bytes: must be >= 1 byte, got '-1e-400'",
        ),
        ("sweep", "--disk-write-budget", "-1e-400", 2, "--disk-write-budget: must be >= 0"),
        ("sweep", "--cpu-gb", "-1e-400", 1, "--cpu-gb: must be >= 0, got -1e-400"),
        ("sweep", "--cpu-gb", "1e-400,2", 1, "--cpu-gb: 1e-400 is too small to tell from 0"),
        ("simulate", "--mix", "rag=-1e-400", 1, "mix weight for 'rag': must be >= 0, got -1e-400"),
        ("sweep", "--mix", "chat=1,rag=1e-400", 1, "'rag': 1e-400 is too small to tell from 0"),
        ("sweep", "--cpu-blocks", "-1,2", 1, "--cpu-blocks values must be >= 0, got -1"),
    ],
)
def test_a_negative_or_vanishing_number_is_refused_in_either_spelling(
    command: str,
    option: str,
    value: str,
    status: int,
    message: str,
    attached: bool,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``-1e-400`` reads as -0.0, which passed ``>= 0``: ``--cpu-gb=-1e-400`` ran with no
    offload tier. ``1e-400`` reads as 0, and ran with none too. And after its option
    (``--cpu-gb -1e-400``) argparse took it for an option: "expected one argument"."""
    given = [f"{option}={value}"] if attached else [option, value]
    jobs = ["--jobs", "1"] if command == "sweep" else []
    assert main([command, "--requests", "20", "--no-progress", *jobs, *given]) == status
    assert message in one_line_error(capsys)


@pytest.mark.parametrize("flag", ["--no-progress", "--progress"])
def test_a_negative_looking_trace_after_a_flag_stays_the_trace(
    flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A negative number after an option is attached to it as its value, but a flag takes
    none: ``--no-progress -1`` read a trace named ``-1``, as argparse always did, and was
    made ``--no-progress=-1`` ("ignored explicit argument '-1'")."""
    monkeypatch.chdir(tmp_path)
    record = '{"timestamp": 0, "input_length": 32, "output_length": 1, "hash_ids": [1, 2]}\n'
    (tmp_path / "-1").write_text(record)
    assert main(["trace-stats", "--block-size", "16", flag, "-1", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["refs"] == 2


def test_minus_zero_is_zero() -> None:
    """No -0.0 reaches a configuration, where ``0 < x`` and ``copysign`` would disagree."""
    assert math.copysign(1.0, options.SIZE_GIB("-0")) == 1.0
    assert math.copysign(1.0, options.parse_floats("-0.0", "--cpu-gb")[0]) == 1.0
    assert math.copysign(1.0, WriteBudget.parse("-0").amount) == 1.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mix", "chat=nan"], "--mix chat=nan: mix weight for 'chat': must be a finite"),
        (["--mix", "chat=inf,rag=1"], "must be a finite number, got 'inf'"),
        (["--mix", "chat=-1,rag=1"], "must be >= 0, got -1"),
        # Refused by the generator without naming the option.
        (["--mix", "chat=0"], "--mix chat=0: mix 'chat=0' gives every kind weight 0"),
        (["--mix", "video=1"], "--mix video=1: unknown workload kind 'video'"),
        (["--mix", ","], "--mix ,: mix ',' has an entry without a kind; known: chat, rag, "),
        (["--mix", "chat=1,"], "mix 'chat=1,' has an entry without a kind"),
        (["--mix", "=1"], "mix '=1' has an entry without a kind"),
        (
            ["--mix", "rag=1, chat=1e309"],
            "mix weight for 'chat': must be a finite number, got '1e309'",
        ),
        (
            ["--gpu-blocks", "1000000000000"],
            "--gpu-blocks 1000000000000 (a GPU prefix cache of 1,000,000,000,000 blocks)",
        ),
        # Refused by the GPU cache as the run started, naming no option.
        (["--gpu-gb", "1e9"], "--gpu-gb 1e+09 (a GPU prefix cache of 512,000,000,000 blocks)"),
        # Refused by the generator as "1,000,000,000,000,000 synthetic requests".
        (
            ["--requests", "1000000000000000"],
            "--requests 1000000000000000 of the default mix at 16 tokens per block would "
            "need about ",
        ),
        (["--json", "/nonexistent/dir/out.json"], "no such directory"),
        (["--csv", "/"], "--csv /: is a directory"),
    ],
)
def test_bad_values_found_before_work(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*SMALL, *args]) == 1
    assert message in one_line_error(capsys)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cpu-gb", "1,nan"], "--cpu-gb: must be a finite number, got 'nan'"),
        (["--cpu-gb", "inf"], "--cpu-gb: must be a finite number, got 'inf'"),
        (["--cpu-gb", "1,1e300"], "--cpu-gb: must be <= 1,125,899,906,842,624, got 1e300"),
        (["--cpu-gb", "1, 1e309"], "--cpu-gb: must be a finite number, got '1e309'"),
        (["--cpu-gb", "-0.50"], "--cpu-gb: must be >= 0, got -0.50"),
        (["--cpu-blocks", "8,-01"], "--cpu-blocks values must be >= 0, got -01"),
        (["--cpu-blocks", "8,-1"], "--cpu-blocks values must be >= 0, got -1"),
        (["--thresholds", "0,-2"], "--thresholds values must be >= 0, got -2"),
        (["--thresholds", f"0,{10**20}"], f"--thresholds values must be <= {2**62}, got {10**20}"),
        (["--policies", "lru,nope"], "unknown cache policy 'nope'"),
    ],
)
def test_bad_sweep_lists(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", "--requests", "20", "--jobs", "1", "--no-progress", *args]) == 1
    assert message in one_line_error(capsys)


@needs(CompiledReuseCounts)
@pytest.mark.parametrize(
    "command",
    [
        [*SMALL, "--store-threshold", "2"],
        ["sweep", *SMALL[1:-1], "--thresholds", "2", "--jobs", "1"],
    ],
)
def test_a_tracker_size_beyond_memory_names_the_option(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The compiled table, filled up front, was refused as a run built it, naming no option
    (in a sweep, after the runs before it)."""
    assert main([*command, "--max-tracker-size", str(10**12)]) == 1
    message = f"--max-tracker-size {10**12} (a reuse count table of 1,000,000,000,000 keys)"
    assert message in one_line_error(capsys)


def test_sweep_bad_tracker_size_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """It failed the sweep's first run, after the workload was drawn."""
    assert main(["sweep", "--thresholds", "2", "--max-tracker-size", str(10**20)]) == 2
    assert f"--max-tracker-size: must be <= {MAX_TRACKED_KEYS}" in one_line_error(capsys)


def test_sweep_bad_jobs_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", "--jobs", "0"]) == 2
    assert "--jobs: must be >= 1" in one_line_error(capsys)


def test_output_paths_are_checked_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The trace is bad too; the output path is reported, so it was checked first.
    bad_trace = tmp_path / "bad.jsonl"
    bad_trace.write_text("{\n")
    assert main(["simulate", "--trace", str(bad_trace), "--json", str(tmp_path / "no/x")]) == 1
    assert "no such directory" in one_line_error(capsys)
    a_file = tmp_path / "file"
    a_file.write_text("")
    argv = ["sweep", "--trace", str(bad_trace), "--plot-dir", str(a_file / "plots")]
    assert main(argv) == 1
    assert "--plot-dir" in one_line_error(capsys)


@pytest.mark.skipif(
    not os.access("/proc/self/status", os.W_OK),
    reason="needs Linux's /proc and root, for whom os.access calls it writable",
)
def test_a_result_file_in_a_directory_that_takes_no_new_file_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--json /proc/self/status`` passed the check (root may write anything, says
    ``os.access``) and failed only when the results were written, after the run. The bad
    trace shows that the path was checked first."""
    bad_trace = tmp_path / "bad.jsonl"
    bad_trace.write_text("{\n")
    assert main(["simulate", "--trace", str(bad_trace), "--json", "/proc/self/status"]) == 1
    assert "--json /proc/self/status: cannot write a file in /proc/" in one_line_error(capsys)
    assert main(["simulate", "--trace", str(bad_trace), "--json", str(tmp_path / "r.json")]) == 1
    assert "bad.jsonl" in one_line_error(capsys)
    assert [p.name for p in tmp_path.iterdir()] == ["bad.jsonl"]  # no probe left behind


@pytest.mark.parametrize(
    "command",
    [
        ["simulate", "--trace", "TRACE", "--json"],
        ["simulate", "--trace", "TRACE", "--csv"],
        ["sweep", "--trace", "TRACE", "--jobs", "1", "--csv"],
        ["trace-stats", "TRACE", "--json"],
    ],
)
@pytest.mark.parametrize("ending", ["/", "/."])
def test_a_result_path_ending_in_a_slash_is_no_file_name(
    command: list[str], ending: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--json results/`` (a directory meant, not made yet) wrote a file named ``results``,
    where a later ``mkdir results`` then failed; the shell's ``> results/`` refuses it."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(RECORD + "\n")
    path = f"{tmp_path / 'results'}{ending}"
    argv = [str(trace) if arg == "TRACE" else arg for arg in command]
    assert main([*argv, path, "--no-progress"]) == 1
    assert f"{path}: names a directory, which does not exist" in one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]


@pytest.mark.parametrize("command", [SMALL, ["trace-stats", "TRACE"]])
def test_a_result_file_name_past_the_file_system_names_the_option(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--json`` with a name longer than the file system takes said "kvoffload: error: File
    name too long: PATH", naming no option."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(RECORD + "\n")
    out = tmp_path / ("j" * (os.pathconf(tmp_path, "PC_NAME_MAX") + 1))
    argv = [str(trace) if word == "TRACE" else word for word in command]
    assert main([*argv, "--json", str(out)]) == 1
    assert one_line_error(capsys) == f"kvoffload: error: --json {out}: File name too long\n"


@pytest.mark.parametrize("below", ["", "plots"])
def test_a_plot_dir_through_a_dangling_link_is_refused_before_the_run(
    below: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A symbolic link to a directory not there (yet) passed the check; the sweep ran, then
    making the directory failed on the link: "kvoffload: error: File exists: PATH"."""
    bad_trace = tmp_path / "bad.jsonl"  # read only if the plot directory passed
    bad_trace.write_text("{\n")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone" / "plots")
    plot_dir = link / below if below else link
    assert main(["sweep", "--trace", str(bad_trace), "--plot-dir", str(plot_dir)]) == 1
    assert one_line_error(capsys) == (
        f"kvoffload: error: --plot-dir {plot_dir}: {link} is a symbolic link to "
        f"{tmp_path / 'gone' / 'plots'}, which does not exist\n"
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bad.jsonl", "link"]


@pytest.mark.parametrize("below", ["", "missing"])
def test_a_plot_dir_name_past_the_file_system_is_refused_before_the_run(
    below: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory name longer than the file system takes passed the check (only what exists
    was looked at); the whole sweep ran, then making the directory failed with "kvoffload:
    error: File name too long: PATH", naming no option and hiding the finished runs' table."""
    bad_trace = tmp_path / "bad.jsonl"  # read only if the plot directory passed
    bad_trace.write_text("{\n")
    name = "p" * (os.pathconf(tmp_path, "PC_NAME_MAX") + 1)
    plot_dir = tmp_path / below / name if below else tmp_path / name
    assert main(["sweep", "--trace", str(bad_trace), "--plot-dir", str(plot_dir)]) == 1
    assert one_line_error(capsys).startswith(
        f"kvoffload: error: --plot-dir {plot_dir}: the name {name[:16]}... is longer than"
    )
    assert [path.name for path in tmp_path.iterdir()] == ["bad.jsonl"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[" * 100_000 + "\n", ":1: JSON nested too deeply"),
        (
            '{"timestamp": 0, "input_length": 5000, "output_length": 1, "hash_ids": [1, 2]}\n',
            ":1: 2 hash_ids for an input_length of 5000 tokens; 512-token blocks make that 9 or 10",
        ),
        (
            RECORD
            + '\n{"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": []}\n',
            ":2: 0 hash_ids for an input_length of 1024 tokens",
        ),
        (
            '{"timestamp": 1e999, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n',
            "'timestamp' is not a number",
        ),
        (
            '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1e400]}\n',
            "non-integer",
        ),
        ("\n\n", "the trace has no records"),
        ("[1, 2]\n", ":1: expected a JSON object per line"),
        (  # json keeps the last silently: read as a request at 5 ms
            RECORD + "\n" + RECORD.replace("{", '{"timestamp": 5, ') + "\n",
            ":2: the record names field 'timestamp' twice",
        ),
    ],
)
def test_hostile_trace_lines(
    tmp_path: Path, content: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(content)
    assert main(["simulate", "--trace", str(trace), "--no-progress"]) == 1
    assert message in one_line_error(capsys)


def test_a_json_lines_trace_named_csv_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Read as CSV, its first record was the header: "missing field 'timestamp'" on line 2."""
    trace = tmp_path / "t.csv"
    trace.write_text(f"{RECORD}\n{RECORD}\n")
    assert main(["simulate", "--trace", str(trace), "--no-progress"]) == 1
    message = f"{trace}:1: a JSON object, not a CSV header; a trace named *.csv is read as CSV"
    assert message in one_line_error(capsys)


def test_binary_and_directory_traces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    binary = tmp_path / "t.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert main(["simulate", "--trace", str(binary)]) == 1
    assert "not a UTF-8 text file" in one_line_error(capsys)
    assert main(["simulate", "--trace", str(tmp_path), "--format", "mooncake"]) == 1
    assert "cannot read trace" in one_line_error(capsys)


def _assert_one_line(result: subprocess.CompletedProcess[str], status: int, message: str) -> None:
    assert result.returncode == status, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert message in result.stderr


def _many_records(path: Path, count: int = 400) -> Path:
    """More records than the first read of a file takes (8 KiB), so a reread shows."""
    path.write_text(
        "".join(RECORD.replace('"timestamp": 0', f'"timestamp": {i}') + "\n" for i in range(count))
    )
    return path


def _from_a_pipe(command: list[str], trace: Path) -> subprocess.CompletedProcess[str]:
    """``command`` with ``trace``'s lines from a pipe (bash's ``<(cat ...)``) as its last
    argument."""
    line = " ".join(shlex.quote(arg) for arg in command)
    return subprocess.run(
        ["bash", "-c", f"{line} <(cat {shlex.quote(str(trace))})"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_trace_from_a_pipe_loses_no_records(tmp_path: Path) -> None:
    """Detecting the format once read the first chunk of the pipe and threw it away."""
    trace = _many_records(tmp_path / "t.jsonl")
    result = _from_a_pipe([*CLI, "trace-stats", "--json", "-"], trace)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["requests"] == 400


@needs_two_cpus
def test_sweep_refuses_a_trace_it_could_read_only_once(tmp_path: Path) -> None:
    """Every worker process reads the trace again: from a pipe, they would get nothing
    (here, with nobody writing the pipe, the first read would wait forever)."""
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    result = run_cli("sweep", "--trace", str(fifo), "--jobs", "2", "--no-progress")
    _assert_one_line(
        result, 1, f"--trace {fifo}: with --jobs 2 each worker process reads the trace again"
    )
    assert result.stderr.rstrip().endswith("save it to a file first, or pass --jobs 1")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_sweep_of_one_job_replays_a_trace_from_a_pipe(tmp_path: Path) -> None:
    """With --jobs 1 the runs use the workload read once, as simulate does: a pipe was
    refused all the same, and a compressed trace had to be saved first."""
    trace = _many_records(tmp_path / "t.jsonl")
    sweep = [*CLI, "sweep", "--cpu-blocks", "0,4", "--policies", "lru", "--thresholds", "0"]
    sweep += ["--jobs", "1", "--json", "-", "--trace"]
    result = _from_a_pipe(sweep, trace)
    assert result.returncode == 0, result.stderr
    piped = json.loads(result.stdout)
    from_file = run_cli(*sweep[len(CLI) :], str(trace))
    assert from_file.returncode == 0, from_file.stderr
    timing = {"wall_seconds", "refs_per_second", "manager_us_per_block", "workload"}
    expected = json.loads(from_file.stdout)
    assert [r["refs"] for r in piped] == [400 * 2, 400 * 2]
    assert [{k: v for k, v in r.items() if k not in timing} for r in piped] == [
        {k: v for k, v in r.items() if k not in timing} for r in expected
    ]


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_endless_trace_is_refused_not_read_forever() -> None:
    result = run_cli("simulate", "--trace", "/dev/zero", "--format", "mooncake")
    _assert_one_line(result, 1, "/dev/zero:1: line longer than 16,777,216 characters")


def test_nan_rate_does_not_loop() -> None:
    result = run_cli("simulate", "--rate", "nan", "--no-progress")
    _assert_one_line(result, 2, "--rate: must be a finite number")


def test_mix_weights_near_the_float_maximum_do_not_loop() -> None:
    """Their sum once overflowed to inf, the arrival rates to nan, and drawing never ended."""
    mix = "chat=1e308,rag=1e308"
    result = run_cli("simulate", "--requests", "10", "--no-bound", "--mix", mix, "--json", "-")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["workload"] == "synthetic(chat=0.5+rag=0.5, seed=0)"


@pytest.mark.parametrize(("rate", "requests"), [("5e-324", "10"), ("1e-306", "2000")])
def test_a_rate_whose_arrivals_overflow_is_refused_not_looped(rate: str, requests: str) -> None:
    """An underflowed session rate divided by zero; infinite arrivals were drawn forever.
    The error named the generator's ``rate``, not the option."""
    result = run_cli("simulate", "--requests", requests, "--no-bound", "--rate", rate)
    _assert_one_line(result, 1, f"kvoffload: error: --rate {rate} is too low: arrival times")


@pytest.mark.parametrize(
    "args",
    [
        ["--mix", "rag=1e308"],
        ["--mix", "chat=1e-320,rag=1e308"],
        ["--rate", "1e308", "--mix", "chat=2"],
    ],
)
def test_a_session_rate_past_a_float_is_drawn_not_looped(args: list[str]) -> None:
    """The rate times a kind's weight overflowed: every session then started at 0, and the
    draw waited forever for one that started later."""
    result = run_cli("simulate", "--requests", "10", "--no-bound", "--json", "-", *args)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["requests"] == 10


def test_library_rejects_a_single_key_where_keys_are_expected() -> None:
    tier = CPUOffloadingManager(8)
    key = block_id_key(1)
    for call in (tier.prepare_store, tier.lookup, tier.touch, tier.prepare_load):
        with pytest.raises(TypeError, match="expects an iterable of keys, got a single bytes"):
            call(key)
    assert tier.num_free_blocks == 8
    filtered = FilterReusedOffloadingManager(tier)
    for call in (filtered.prepare_store, filtered.lookup):
        with pytest.raises(TypeError, match="got a single"):
            call(b"abc")
    with pytest.raises(TypeError, match="got a single str"):
        tier.complete_store("abc")


@pytest.mark.parametrize("threshold", [2.5, "2", True])
def test_library_rejects_a_non_integer_store_threshold(threshold: object) -> None:
    with pytest.raises(ValueError, match="store_threshold must be an integer"):
        FilterReusedOffloadingManager(CPUOffloadingManager(8), threshold)  # type: ignore[arg-type]
    # build_manager once took 1.5 for "below 2: no filter".
    for value in (threshold, 1.5):
        with pytest.raises(ValueError, match="store_threshold must be an integer"):
            build_manager(8, store_threshold=value)  # type: ignore[arg-type]


def test_library_lists_the_admission_names() -> None:
    known = f"unknown admission 'bogus'; known: {', '.join(available_admissions())}"
    with pytest.raises(ValueError, match=re.escape(known)):
        build_manager(8, admission="bogus")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--admission", "bogus"],
            f"--admission: unknown admission 'bogus'; known: {', '.join(available_admissions())}",
        ),
        (["--policy", "bogus"], "--policy: unknown cache policy 'bogus'; known: arc, lru"),
        (["--kv-events-endpoint", "bogus"], "'bogus': expected tcp://HOST:PORT or ipc://PATH"),
        (["--kv-events-endpoint", "inproc://x"], "'inproc://x': expected tcp://HOST:PORT"),
        (["--kv-events-endpoint", "tcp://127.0.0.1"], "'tcp://127.0.0.1': expected tcp://"),
        (["--kv-events-endpoint", "tcp://127.0.0.1:99999"], "port must be 0..65535 or *"),
        (["--kv-events-endpoint", "tcp://10.255.255.254:5557"], "cannot bind"),
        # Refused by ZMQ once the workload was built: "cannot bind KV events to ...".
        (
            ["--kv-events-endpoint", "tcp://256.1.1.1:5557"],
            "--kv-events-endpoint 'tcp://256.1.1.1:5557': cannot bind: no interface or host "
            "named '256.1.1.1'",
        ),
        (
            ["--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-replay-endpoint", "x"],
            "--kv-events-replay-endpoint 'x': expected tcp://HOST:PORT",
        ),
        (
            ["--kv-events-endpoint", "ipc:///tmp/e", "--kv-events-replay-endpoint", "ipc:///tmp/e"],
            "--kv-events-endpoint and --kv-events-replay-endpoint are both 'ipc:///tmp/e'",
        ),
        (
            ["--kv-events-replay-endpoint", "tcp://127.0.0.1:0"],
            "--kv-events-replay-endpoint needs --kv-events-endpoint",
        ),
        (
            ["--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-topic", "\udcff"],
            "--kv-events-topic must be UTF-8 text",
        ),
        (["--serve-after", "5"], "--serve-after needs --kv-events-endpoint or --metrics-port"),
    ],
)
def test_bad_names_and_endpoints_are_refused_before_the_workload(
    tmp_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The trace is bad too: an error naming the option shows it was checked first."""
    trace = tmp_path / "bad.jsonl"
    trace.write_text("{\n")
    assert main(["simulate", "--trace", str(trace), "--no-progress", *args]) == 1
    assert message in one_line_error(capsys)


def test_an_endpoint_may_name_a_host_or_an_interface(capsys: pytest.CaptureFixture[str]) -> None:
    """ZMQ binds a host name it resolves and an interface's name: neither is refused."""
    pytest.importorskip("zmq")
    interface = socket.if_nameindex()[0][1]
    events = ["--kv-events-endpoint", "tcp://localhost:0"]
    events += ["--kv-events-replay-endpoint", f"tcp://{interface}:0"]
    assert main([*SMALL, *events, "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 30


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--admissions", "none,bogus"], "--admissions: unknown admission 'bogus'; known: "),
        (["--policies", ",,"], "--policies needs at least one value, got ',,'"),
        (["--policies", "lru,nope"], "--policies: unknown cache policy 'nope'; known: "),
        (["--admissions", " , "], "--admissions needs at least one value"),
        (["--thresholds", ",,"], "--thresholds needs at least one value"),
        (["--cpu-blocks", ","], "--cpu-blocks needs at least one value"),
        (["--cpu-gb", ""], "--cpu-gb needs at least one value"),
    ],
)
def test_bad_sweep_names_are_refused_before_the_workload(
    tmp_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text("{\n")
    assert main(["sweep", "--trace", str(trace), "--jobs", "1", "--no-progress", *args]) == 1
    assert message in one_line_error(capsys)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--metrics-port", "nan"], "--metrics-port: expected an integer, got 'nan'"),
        # Out of range, the port and the wait were refused after parsing, status 1, and the
        # wait shown as its float ("got 1e+300").
        (["--metrics-port", "-1"], "--metrics-port: must be >= 0, got -1"),
        (["--metrics-port", "70000"], "--metrics-port: must be <= 65535, got 70000"),
        (["--metrics-port", "0", "--serve-after", "1e300"], "must be <= 604,800, got 1e300"),
        (["--metrics-port", "0", "--serve-after", "nan"], "--serve-after: must be a finite"),
        (["--metrics-port", "0", "--serve-after", "inf"], "--serve-after: must be a finite"),
        (["--metrics-port", "0", "--serve-after", "-1"], "--serve-after: must be >= 0"),
        (["--partial-block", "bogus"], "invalid choice: 'bogus'"),
    ],
)
def test_bad_observe_numbers_are_usage_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*SMALL, *args]) == 2
    assert message in one_line_error(capsys)


def test_sweep_bad_partial_block_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", "--partial-block", "bogus"]) == 2
    assert "invalid choice: 'bogus'" in one_line_error(capsys)


@pytest.mark.parametrize(
    "option", ["--kv-events-endpoint", "--kv-events-replay-endpoint", "--metrics-port"]
)
def test_a_port_in_use_is_refused_before_the_workload(
    tmp_path: Path, option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text("{\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        endpoint = f"tcp://127.0.0.1:{port}"
        args = {
            "--kv-events-endpoint": ["--kv-events-endpoint", endpoint],
            "--kv-events-replay-endpoint": [
                "--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-replay-endpoint", endpoint
            ],
            "--metrics-port": ["--metrics-port", str(port)],
        }[option]  # fmt: skip
        assert main(["simulate", "--trace", str(trace), "--no-progress", *args]) == 1
    err = one_line_error(capsys)
    assert option in err and "cannot bind: the port is in use" in err


def test_an_endless_serve_after_is_refused_not_slept() -> None:
    result = run_cli("simulate", "--metrics-port", "0", "--serve-after", "inf", "--no-progress")
    _assert_one_line(result, 2, "--serve-after: must be a finite number")


def _watch_first_run(
    process: subprocess.Popen[bytes],
) -> tuple[bytearray, threading.Event, threading.Thread]:
    """A thread copying a sweep's stderr into the returned bytes, and an event set once its
    first of 60 runs is done or it ended (the caller's assertions then say which)."""
    seen = bytearray()
    first_done = threading.Event()

    def watch() -> None:
        assert process.stderr is not None
        while chunk := process.stderr.read1(4096):
            seen.extend(chunk)
            if b" 1/60 " in seen:
                first_done.set()
        first_done.set()

    reader = threading.Thread(target=watch, daemon=True)
    reader.start()
    return seen, first_done, reader


@needs_two_cpus
def test_ctrl_c_stops_a_sweep_and_keeps_finished_runs(tmp_path: Path) -> None:
    folder = tmp_path / "new\nline"  # the one line that names the files stays one line
    folder.mkdir()
    out_json, out_csv = folder / "runs.json", folder / "runs.csv"
    capacities = ",".join(str(1000 * (i + 1)) for i in range(12))
    # A shell's background job (`nohup ... &`, some CI runners) starts with Ctrl-C ignored, and
    # a child inherits that: this one takes Ctrl-C as an interactive terminal's child does.
    interactive = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    argv = [*CLI[:2], interactive + CLI[2], "sweep", "--requests", "2000", "--seed", "3"]
    argv += ["--gpu-blocks", "3000", "--cpu-blocks", capacities, "--jobs", "2", "--progress"]
    argv += ["--json", str(out_json), "--csv", str(out_csv)]
    with subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL) as process:
        seen, first_done, reader = _watch_first_run(process)
        try:
            first_done.wait(120)
            assert process.poll() is None, f"ended early: {seen.decode(errors='replace')}"
            process.send_signal(signal.SIGINT)
            sent = time.monotonic()
            status = process.wait(timeout=60)
            stopped_after = time.monotonic() - sent
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        reader.join(timeout=10)
    err = seen.decode(errors="replace").split("\n")[-2]
    assert status == 130
    assert "Traceback" not in seen.decode(errors="replace")
    assert err.startswith("kvoffload: interrupted: sweep interrupted after "), err
    assert one_line(f"written to {out_json} and {out_csv}") in err
    runs = json.loads(out_json.read_text())
    assert 1 <= len(runs) < 48
    assert len(out_csv.read_text().splitlines()) == len(runs) + 1
    assert stopped_after < 30  # generous: it would otherwise run the remaining configurations


@pytest.mark.parametrize("command", [SMALL, ["trace-stats", "TRACE"]])
def test_json_to_dev_stdout_is_the_json_alone(tmp_path: Path, command: list[str]) -> None:
    """``--json /dev/stdout`` is ``--json -`` by another name: the table used to follow the
    JSON on stdout, and a script reading it got invalid JSON."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text(RECORD + "\n")
    argv = [str(trace) if word == "TRACE" else word for word in command]
    result = run_cli(*argv, "--json", "/dev/stdout")
    assert result.returncode == 0, result.stderr
    assert isinstance(json.loads(result.stdout), dict)


def test_dev_stdout_and_dash_are_one_output() -> None:
    result = run_cli(*SMALL, "--json", "/dev/stdout", "--csv", "-")
    _assert_one_line(result, 1, "would both write to standard output")


def _workers(pid: int) -> set[int]:
    """The worker processes ``pid`` spawned (not its resource tracker, which ends on its own
    once the parent has gone)."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # not a process, or gone
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in command:
            found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@needs_two_cpus
def test_sigterm_stops_a_sweep_and_its_workers(tmp_path: Path) -> None:
    """SIGTERM (``kill``, ``timeout``, a service manager) used to end the parent on the spot,
    leaving each worker to finish its run (minutes, on a large workload) unwatched."""
    out_json = tmp_path / "runs.json"
    capacities = ",".join(str(1000 * (i + 1)) for i in range(12))
    argv = [*CLI, "sweep", "--requests", "2000", "--seed", "3", "--gpu-blocks", "3000"]
    argv += ["--cpu-blocks", capacities, "--jobs", "2", "--progress", "--json", str(out_json)]
    with subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL) as process:
        seen, first_done, reader = _watch_first_run(process)
        workers: set[int] = set()
        try:
            first_done.wait(120)
            assert process.poll() is None, f"ended early: {seen.decode(errors='replace')}"
            workers = _workers(process.pid)
            assert len(workers) >= 2, workers
            process.send_signal(signal.SIGTERM)
            status = process.wait(timeout=60)
            # Stopped and reaped before the sweep exits; not, each would still be mid-run.
            left = {pid for pid in workers if _alive(pid)}
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            for pid in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        reader.join(timeout=10)
    text = seen.decode(errors="replace")
    assert left == set(), f"workers left running: {left}"
    assert status == 130 and "Traceback" not in text, text
    err = text.split("\n")[-2]
    assert err.startswith("kvoffload: interrupted: sweep interrupted after "), err
    assert 1 <= len(json.loads(out_json.read_text())) < 48


def test_an_interrupted_sweep_with_no_finished_run_keeps_an_earlier_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C before any run finished used to overwrite an earlier sweep's --json with ``[]``
    (the --csv file, with no row to write, was already left alone)."""
    from kvoffload.sim import sweep as sim_sweep

    def interrupted(*run: object) -> None:
        raise KeyboardInterrupt  # Ctrl-C during the first run

    earlier = '[{"policy": "lru"}]\n'
    out_json, out_csv = tmp_path / "runs.json", tmp_path / "runs.csv"
    out_json.write_text(earlier)
    out_csv.write_text("policy\nlru\n")
    monkeypatch.setattr(sim_sweep, "_run_on", interrupted)
    args = ["sweep", "--requests", "30", "--jobs", "1", "--no-progress"]
    status = main([*args, "--json", str(out_json), "--csv", str(out_csv)])
    err = capsys.readouterr().err
    assert status == 130
    expected = (
        "kvoffload: interrupted: sweep interrupted after 0 of 16 runs; no run had finished; "
        f"{out_json} and {out_csv} not written\n"
    )
    assert err == expected
    assert out_json.read_text() == earlier
    assert out_csv.read_text() == "policy\nlru\n"


DRAWN_THEN = """
import os, signal, sys
from pathlib import Path
from typing import Any
from matplotlib.figure import Figure
from kvoffload.cli.main import main

signal.signal(signal.SIGINT, signal.default_int_handler)
render = Figure.savefig
rendered = []
then, plot_dir = sys.argv[1], sys.argv[-1]

def savefig(figure, *args, **kwargs):
    rendered.append(figure)
    if len(rendered) == 2 and then == "ctrl-c":  # as the second plot is drawn
        os.kill(os.getpid(), signal.SIGINT)
    if len(rendered) == 2 and then == "a file at the plot directory":
        Path(plot_dir).write_text("")
    return render(figure, *args, **kwargs)

Figure.savefig = savefig
sys.exit(main(sys.argv[2:]))
"""
"""A sweep whose second plot being drawn is followed by ``argv[1]``: Ctrl-C, or a file made
where its ``--plot-dir`` (the last argument) is to be."""


def _sweep_drawn_then(then: str, *argv: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    sweep = ["sweep", "--requests", "30", "--jobs", "1", "--no-progress", "--cpu-blocks", "0,50"]
    sweep += ["--policies", "lru", "--thresholds", "0"]
    kwargs.setdefault("stdout", subprocess.PIPE)
    return subprocess.run(
        [sys.executable, "-c", DRAWN_THEN, then, *sweep, *argv],
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
        check=False,
        **kwargs,
    )


def test_ctrl_c_while_plotting_keeps_the_earlier_plots_and_says_what_was_written(
    tmp_path: Path,
) -> None:
    """Ctrl-C once every run had finished, as the plots were drawn: the first plot had
    replaced the earlier sweep's (a set from two sweeps), and the one line,
    "kvoffload: interrupted", said neither that --json had been written nor showed the runs."""
    pytest.importorskip("matplotlib")
    plots = tmp_path / "plots"
    plots.mkdir()
    for name in PLOT_FILES:
        (plots / name).write_bytes(b"the earlier plot")
    out_json = tmp_path / "runs.json"
    result = _sweep_drawn_then("ctrl-c", "--json", str(out_json), "--plot-dir", str(plots))
    assert result.returncode == 130
    assert result.stderr == (
        "kvoffload: interrupted: sweep interrupted while plotting, after its 2 runs; "
        f"the runs were written to {out_json}; no plot was written\n"
    )
    assert len(json.loads(out_json.read_text())) == 2
    assert "offload" in result.stdout  # the runs' table
    assert {p.name: p.read_bytes() for p in plots.iterdir()} == dict.fromkeys(
        PLOT_FILES, b"the earlier plot"
    )


def test_a_plot_dir_that_cannot_be_made_after_the_runs_names_the_option(tmp_path: Path) -> None:
    """The plot directory checked before the sweep, but not makeable once its runs were done
    (here a file put there meanwhile): "kvoffload: error: File exists: PATH", naming no
    option, and the finished runs' table was not shown."""
    pytest.importorskip("matplotlib")
    plot_dir = tmp_path / "plots"
    result = _sweep_drawn_then("a file at the plot directory", "--plot-dir", str(plot_dir))
    assert result.returncode == 1
    assert result.stderr == f"kvoffload: error: --plot-dir {plot_dir}: cannot write: File exists\n"
    assert "offload" in result.stdout  # the runs' table


@pytest.mark.parametrize(
    ("then", "status", "line"),
    [
        ("a file at the plot directory", 1, "kvoffload: error: --plot-dir {}: cannot write: "),
        ("ctrl-c", 130, "kvoffload: interrupted: sweep interrupted while plotting, "),
    ],
)
def test_a_stopped_sweep_whose_table_meets_a_reader_gone_keeps_its_status_and_line(
    then: str, status: int, line: str, tmp_path: Path
) -> None:
    """``kvoffload sweep ... | head -1`` whose plots fail, or that Ctrl-C stops, after its
    table: the table, left in stdout's buffer (Python's default), was written only at exit,
    which a reader gone by then turned into "Exception ignored ... BrokenPipeError" below
    the error line and status 120 (1 where Ctrl-C's 130 was due)."""
    pytest.importorskip("matplotlib")
    plot_dir = tmp_path / "plots"
    env = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = _sweep_drawn_then(then, "--plot-dir", str(plot_dir), stdout=write_end, env=env)
    finally:
        os.close(write_end)
    assert result.returncode == status
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(line.format(plot_dir)), result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--disk-dir", "d", "--disk-gb", "nan"], "--disk-gb: must be a finite number"),
        (["--disk-dir", "d", "--disk-gb", "inf"], "--disk-gb: must be a finite number"),
        (["--disk-dir", "d", "--disk-gb", "-1"], "--disk-gb: must be > 0"),
        (["--disk-dir", "d", "--disk-gb", "1e300"], "--disk-gb: must be <= 1,125,899,906,842,624"),
        (["--disk-dir", "d", "--disk-blocks", "-1"], "--disk-blocks: must be >= 1"),
        (["--disk-dir", "d", "--disk-blocks", "1e12"], "--disk-blocks: expected an integer"),
        (["--disk-gb-per-s", "nan"], "--disk-gb-per-s: must be a finite number"),
        (["--remote-gb-per-s", "0"], "--remote-gb-per-s: must be >= 1e-09, got 0"),
        (["--disk-latency-ms", "inf"], "--disk-latency-ms: must be a finite number"),
        (["--remote-latency-ms", "-1"], "--remote-latency-ms: must be >= 0"),
        (["--tier-store-threshold", "1.5"], "--tier-store-threshold: expected an integer"),
        (["--tier-store-threshold", "-1"], "--tier-store-threshold: must be >= 0"),
        (["--tier-store-threshold", str(2**62 + 1)], f"--tier-store-threshold: must be <= {2**62}"),
    ],
)
@pytest.mark.parametrize("command", ["simulate", "sweep"])
def test_bad_tier_numbers_are_usage_errors(
    command: str, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, "--requests", "20", "--no-progress", *args]) == 2
    assert message in one_line_error(capsys)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--disk-dir", "{tmp}/a-file", "--disk-gb", "1"], "is not a directory"),
        (["--disk-dir", "{tmp}/a-file/d", "--disk-gb", "1"], "is not an existing directory"),
        (["--disk-dir", "{tmp}/no/d", "--disk-blocks", "8"], "no is not an existing directory"),
        (["--disk-dir", "{tmp}/d"], "--disk-dir needs a size: --disk-gb or --disk-blocks"),
        (["--disk-dir", "", "--disk-blocks", "8"], "--disk-dir must be a non-empty path"),
        (["--disk-dir", "{tmp}/d", "--disk-blocks", str(10**20)], "--disk-blocks: a disk tier of"),
        (["--disk-gb", "1"], "--disk-gb needs --disk-dir"),
        (["--disk-policy", "lru"], "--disk-policy needs --disk-dir"),
        # Read by a lower tier's model only: without the tier they were ignored, unsaid.
        (["--disk-gb-per-s", "2"], "--disk-gb-per-s needs --disk-dir"),
        (["--disk-latency-ms", "0"], "--disk-latency-ms needs --disk-dir"),
        (["--remote-gb-per-s", "2"], "--remote-gb-per-s models the remote tier: it needs"),
        (["--remote-latency-ms", "1"], "--remote-latency-ms models the remote tier: it needs"),
        (["--remote-blocks", "100"], "--remote-blocks is the shared tier's size as"),
        (["--tier-store-threshold", "3"], "--tier-store-threshold filters writes to the tiers"),
        (
            ["--disk-dir", "{tmp}/d", "--disk-blocks", "8", "--disk-policy", "bogus"],
            "--disk-policy: unknown cache policy 'bogus'",
        ),
        (["--remote", "bogus://x"], "--remote: remote tier URL 'bogus://x' must start with"),
        (["--remote", "redis://127.0.0.1:1/0"], "--remote: remote tier redis://127.0.0.1:1/0 is"),
    ],
)
@pytest.mark.parametrize("command", ["simulate", "sweep"])
def test_bad_tier_options_are_refused_before_the_workload(
    tmp_path: Path, command: str, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The trace is bad too: an error naming the tier option shows it was checked first.
    ``{tmp}`` is this test's directory, which holds a plain file ``a-file``.
    """
    (tmp_path / "a-file").write_text("x")
    trace = tmp_path / "bad.jsonl"
    trace.write_text("{\n")
    common = ["--trace", str(trace), "--no-progress"]
    extra = ["--jobs", "1"] if command == "sweep" else []
    args = [arg.format(tmp=tmp_path) for arg in args]
    assert main([command, *common, *extra, *args]) == 1
    assert message in one_line_error(capsys)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("command", ["simulate", "sweep"])
def test_a_disk_size_below_one_block_names_the_option_and_the_block(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--disk-gb 0.01`` of 64 MiB blocks was "a disk tier (--disk-dir) needs a size of >= 1
    block: --disk-gb or --disk-blocks", as if no size had been given."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(RECORD + "\n")
    args = ["--trace", str(trace), "--no-progress", "--disk-dir", str(tmp_path / "d")]
    assert main([command, *args, "--disk-gb", "0.01"]) == 1
    assert one_line_error(capsys).startswith(
        "kvoffload: error: --disk-gb 0.01 holds no block of 64 MiB (llama-3.1-8b, 512 tokens)"
    )
    assert not (tmp_path / "d").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_unwritable_disk_dir_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    assert main([*SMALL, "--disk-dir", str(locked / "d"), "--disk-blocks", "8"]) == 1
    assert "is not writable" in one_line_error(capsys)


@pytest.mark.parametrize(
    ("command", "data_plane"),
    [("simulate", []), ("sweep", []), ("simulate", ["--data-plane", "--layout", "tiny"])],
)
def test_a_disk_dir_whose_file_system_does_not_answer_is_refused_by_its_deadline(
    tmp_path: Path,
    command: str,
    data_plane: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The command's own checks of --disk-dir (is it a writable directory; with real bytes,
    does the tier fit) ran on the main thread with no deadline: on a hung FUSE mount the
    command waited as long as the mount did (113 s), not the tier's --disk-timeout-ms.
    Here the check that hangs is the one a hung mount stops: the directory's access check,
    or the free space of its file system."""
    answer = threading.Event()

    def hung(*args: object, **kwargs: object) -> object:
        answer.wait(60)
        raise OSError("the file system came back too late")

    monkeypatch.setattr(os, "access" if not data_plane else "statvfs", hung)
    extra = ["--jobs", "1", "--cpu-gb", "0.001"] if command == "sweep" else ["--cpu-blocks", "64"]
    argv = [command, "--requests", "10", "--no-progress", *extra, *data_plane]
    argv += ["--disk-dir", str(tmp_path), "--disk-blocks", "8", "--disk-timeout-ms", "200"]
    statuses: list[int] = []
    run = threading.Thread(target=lambda: statuses.append(main(argv)), daemon=True)
    run.start()
    run.join(30)
    answer.set()  # the thread left waiting ends
    assert statuses == [1]
    message = f"kvoffload: error: --disk-dir {tmp_path}: did not answer within 0.2 s\n"
    assert one_line_error(capsys) == message


@pytest.mark.parametrize(
    ("size", "blocks"),
    [(["--disk-blocks", str(10**20)], "100,000,000,000,000,000,000"), (["--disk-gb", "1e15"], "")],
)
@pytest.mark.parametrize("command", ["simulate", "sweep"])
def test_a_disk_tier_past_the_largest_file_is_refused_not_listed(
    tmp_path: Path, command: str, size: list[str], blocks: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its free slots were once listed up front: all memory, then SIGKILL."""
    extra = ["--jobs", "1"] if command == "sweep" else []
    argv = [command, "--requests", "10", "--no-progress", "--cpu-blocks", "200", *extra]
    assert main([*argv, "--disk-dir", str(tmp_path / "d"), *size]) == 1
    err = one_line_error(capsys)
    assert f"{size[0]}: a disk tier of {blocks}" in err and "past the largest file size" in err
    assert not (tmp_path / "d").exists()


def test_a_disk_tier_beyond_the_file_system_is_refused_with_real_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    args = ["--disk-dir", str(tmp_path / "d"), "--disk-blocks", str(10**15), "--data-plane"]
    assert main([*SMALL, *args]) == 1
    assert "does not fit the" in one_line_error(capsys)
    assert not (tmp_path / "d").exists()


def test_a_wrong_remote_password_is_refused_before_the_workload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tier_servers import ValkeyProcess

    server = ValkeyProcess(tmp_path / "auth", password="right-one")
    server.start()
    try:
        trace = tmp_path / "bad.jsonl"
        trace.write_text("{\n")
        url = f"redis://:wrong@127.0.0.1:{server.port}/0?timeout_ms=2000"
        for command, extra in (("simulate", []), ("sweep", ["--jobs", "1"])):
            args = [command, "--trace", str(trace), "--no-progress", *extra, "--remote", url]
            assert main(args) == 1
            err = one_line_error(capsys)
            assert "--remote: remote tier" in err and "authentication failed" in err
            assert "wrong" not in err.replace("WRONGPASS", "")
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("command", "size"),
    [
        (["simulate", "--gpu-blocks", "10"], "--gpu-blocks 10 (a GPU prefix cache of 10 blocks)"),
        (["simulate", "--gpu-gb", "0.01"], "--gpu-gb 0.01 (a GPU prefix cache of 5 blocks)"),
        pytest.param(
            ["sweep", "--jobs", "2", "--gpu-blocks", "10"],
            "--gpu-blocks 10 (a GPU prefix cache of 10 blocks)",
            marks=needs_two_cpus,
        ),
    ],
)
def test_a_gpu_smaller_than_the_longest_request_is_named_before_any_run(
    command: list[str], size: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The engine refused it as the run started, naming no option ("give the GPU more
    blocks"); a sweep started its workers and reported it as its first run's failure."""
    assert main([*command, "--requests", "5", "--no-progress"]) == 1
    assert one_line_error(capsys) == (
        f"kvoffload: error: {size} cannot hold the workload's longest request, of 414 blocks; "
        "give the GPU at least that many\n"
    )


def test_a_kv_events_topic_without_the_events_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It was ignored, unsaid: no events were published under it or any other topic."""
    argv = ["simulate", "--requests", "5", "--no-progress", "--kv-events-topic", "mine"]
    assert main(argv) == 1
    assert one_line_error(capsys) == (
        "kvoffload: error: --kv-events-topic needs --kv-events-endpoint\n"
    )


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--cpu-gb", "1,,2"),
        ("--cpu-gb", "1,2,"),
        ("--cpu-blocks", ",64"),
        ("--thresholds", "1, ,2"),
        ("--policies", "lru,,arc"),
    ],
)
def test_a_sweep_list_with_an_empty_item_is_refused(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty item was dropped, so ``--cpu-gb 1,,2`` ran two capacities where a third
    was likely meant; ``--mix`` refuses one, and so do the sweep's lists now."""
    assert main(["sweep", "--requests", "5", "--no-progress", flag, value]) == 1
    assert one_line_error(capsys) == (
        f"kvoffload: error: {flag} {value!r} has an empty item between its commas\n"
    )
