"""Bad input ends with one line on stderr and exit status 1, never a traceback."""

from __future__ import annotations

import json
import os
import resource
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import one_line_error

from kvoffload.cli.main import main
from kvoffload.sim.plots import PLOT_FILES

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
        (["--gpu-blocks", "3"], "--gpu-blocks 3 (a GPU prefix cache of 3 blocks) cannot hold"),
        (["--gpu-blocks", "1"], "--gpu-blocks 1 (a GPU prefix cache of 1 block) cannot hold"),
        (["--json", "/nonexistent/dir/out.json"], "/nonexistent/dir/out.json"),
        # The option, not the run's field name (it said "gpu_blocks ... must be >= 1").
        (["--gpu-gb", "0.001"], "--gpu-gb 0.001 holds no block of 2 MiB"),
        # A CPU size too small for one block ran silently with no offload tier.
        (["--cpu-gb", "0.001"], "--cpu-gb 0.001 holds no block of 2 MiB"),
        # A trace schema without a trace, and a kind named twice in a mix, went unsaid.
        (["--format", "qwen"], "--format qwen names a trace's schema: give --trace"),
        (["--mix", "chat=1,chat=2"], "names 'chat' twice"),
        # A device without the data plane, which alone places blocks, was ignored.
        (["--device", "cuda"], "--device cuda places the data plane's GPU blocks: it needs"),
        # A drive size alone was taken and ignored.
        (["--drive-bytes", "1TB"], "--drive-bytes is the drive a budget in drive writes"),
        # Beside a budget in another unit it was taken and ignored too.
        (
            ["--admission", "recommended", "--write-budget", "200MB/s", "--drive-bytes", "1TB"],
            "no budget given is one (--write-budget: 200 MB/s): give it in drive writes per day",
        ),
        (
            ["--admission", "recommended", "--write-budget", "0.2", "--drive-bytes", "1TB"],
            "no budget given is one (--write-budget: 0.2 writes per block reference)",
        ),
        # Lower tiers sit below the CPU tier: without one, the disk tier was dropped unsaid.
        (
            ["--cpu-blocks", "0", "--disk-dir", "/tmp/kvoffload-no-cpu", "--disk-blocks", "9"],
            "sits below the CPU tier",
        ),
    ],
)
def test_bad_arguments(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, *args]) == 1
    assert message in one_line_error(capsys)


@pytest.mark.parametrize("command", ["simulate", "sweep"])
def test_an_unknown_layout_is_refused_before_the_trace_is_read(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was found only once the whole trace had been read, and named no option."""
    missing = tmp_path / "not-there.jsonl"
    assert main([command, "--trace", str(missing), "--layout", "gpt-9", "--no-progress"]) == 1
    assert one_line_error(capsys).startswith("kvoffload: error: --layout: unknown KV layout")


def test_a_missing_trace_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--trace", "/nonexistent/trace.jsonl", "--format", "mooncake"]
    assert main(argv) == 1
    assert "cannot read trace" in one_line_error(capsys)


@pytest.mark.parametrize(
    ("option", "value"),
    [("--requests", "100"), ("--seed", "3"), ("--mix", "chat"), ("--rate", "2")],
)
@pytest.mark.parametrize("command", [["simulate"], ["sweep", "--jobs", "1"]])
def test_a_synthetic_option_with_a_trace_is_refused(
    tmp_path: Path,
    command: list[str],
    option: str,
    value: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--trace t.jsonl --requests 100`` replayed the whole trace, the option ignored unsaid
    (as ``--format`` without a trace is refused)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 16, "output_length": 1, "hash_ids": [1]}\n')
    argv = [*command, "--trace", str(trace), "--block-size", "16", option, value]
    assert main([*argv, "--no-progress"]) == 1
    err = one_line_error(capsys)
    assert f"{option} shapes a synthetic workload, and --trace replays the trace's own" in err


def test_sweep_bad_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", "--requests", "20", "--cpu-blocks", "10,lots", "--jobs", "1"]) == 1
    assert "comma-separated integers" in one_line_error(capsys)


def test_sweep_names_a_gpu_size_too_small_for_one_block(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", "--requests", "20", "--gpu-gb", "0.001", "--jobs", "1"]) == 1
    assert "--gpu-gb 0.001 holds no block" in one_line_error(capsys)


def test_sweep_names_a_cpu_size_too_small_for_one_block(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", "--requests", "20", "--cpu-gb", "0,0.001", "--jobs", "1"]) == 1
    assert "--cpu-gb 0.001 holds no block" in one_line_error(capsys)


@pytest.mark.parametrize("capacities", [["--cpu-blocks", "0,200"], ["--cpu-gb", "0,1"]])
@pytest.mark.parametrize("lower", ["disk", "remote"])
def test_sweep_refuses_no_cpu_tier_above_a_lower_tier_before_the_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], capacities: list[str], lower: str
) -> None:
    """As ``simulate`` refuses it: the 0 row ran with no disk or shared tier, unsaid. Refused
    before the trace is read, and before a --remote server is reached (none listens here)."""
    tiers = {
        "disk": ["--disk-dir", str(tmp_path / "disk"), "--disk-blocks", "500"],
        "remote": ["--remote", "redis://127.0.0.1:1"],
    }[lower]
    missing = tmp_path / "not-there.jsonl"
    argv = ["sweep", "--trace", str(missing), "--jobs", "1", "--no-progress", *capacities]
    assert main([*argv, *tiers]) == 1
    option = capacities[0]
    assert one_line_error(capsys) == (
        "kvoffload: error: a disk or shared tier (--disk-dir, --remote) sits below the CPU "
        f"tier, and {option} 0 leaves none: drop 0 from {option}\n"
    )


def test_usage_errors_are_argparse_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--no-such-flag"]) == 2
    assert "unrecognized arguments: --no-such-flag" in one_line_error(capsys)
    assert main([]) == 2
    assert "required: COMMAND" in one_line_error(capsys)


@pytest.mark.parametrize(
    "command", [["simulate"], ["sweep"], ["trace-stats", "t.csv"], ["bench", "tiers"]]
)
def test_an_unknown_option_points_at_its_command_s_help(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Not at ``kvoffload --help``, which does not list the command's options."""
    assert main([*command, "--no-such-flag"]) == 2
    line = one_line_error(capsys)
    wanted = " ".join(word for word in command if word != "t.csv")
    assert line.endswith(
        f"unrecognized arguments: --no-such-flag (see kvoffload {wanted} --help)\n"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--remote-gb", "50"],  # was --remote-gb-per-s 50, a bandwidth
        ["sweep", "--thresh", "2"],
        ["trace-stats", "t.jsonl", "--block", "16"],
        ["bench", "tiers", "--round", "1"],
    ],
)
def test_an_option_is_taken_only_by_its_full_name(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse took a prefix of an option for it, silently: ``--remote-gb 50``, meant as a
    size beside ``--disk-gb``, set the shared tier's bandwidth to 50 GB/s."""
    assert main(argv) == 2
    assert f"unrecognized arguments: {' '.join(argv[-2:])}" in one_line_error(capsys)


def _limited_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (512, 512))


def _with_little_room(command: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    """``command`` in a process whose files may not pass 512 bytes: a full disk's writes.
    It writes no bytecode: Python keeps a ``.pyc`` cut at the cap as it is (its write is not
    checked for a short count), and every later import of that module fails."""
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        preexec_fn=_limited_file_size,
        env={**os.environ, **env, "PYTHONDONTWRITEBYTECODE": "1"},
    )


def _run_with_little_room(argv: list[str]) -> subprocess.CompletedProcess[str]:
    cli = "import sys; from kvoffload.cli.main import main; sys.exit(main())"
    return _with_little_room([sys.executable, "-c", cli, *argv])


def test_a_process_with_little_room_leaves_no_cut_bytecode(tmp_path: Path) -> None:
    """The session writes bytecode (tests/conftest.py): a module first imported under the cap
    was kept cut, and 88 of matplotlib's then failed every later import in one run."""
    (tmp_path / "padded.py").write_text(f"PADDING = {'x' * 4096!r}\n")
    first = _with_little_room([sys.executable, "-c", "import padded"], PYTHONPATH=str(tmp_path))
    assert first.returncode == 0, first.stderr
    again = subprocess.run(
        [sys.executable, "-c", "import padded"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert again.returncode == 0, again.stderr


@pytest.mark.parametrize("option", ["--json", "--csv"])
def test_a_failed_write_keeps_the_earlier_file_and_names_the_path(
    tmp_path: Path, option: str
) -> None:
    """The file was once truncated first, so a full disk (here: a file size limit) left
    it destroyed, and the error named no path."""
    old = tmp_path / "old.out"
    old.write_text("the earlier run\n")
    result = _run_with_little_room([*SMALL, "--no-bound", option, str(old)])
    assert result.returncode == 1
    assert result.stderr == f"kvoffload: error: {option} {old}: cannot write: File too large\n"
    assert old.read_text() == "the earlier run\n"
    assert [p.name for p in tmp_path.iterdir()] == ["old.out"]  # no temporary file left


def test_a_failed_plot_keeps_the_earlier_one_and_names_the_path(tmp_path: Path) -> None:
    """A plot was saved straight to its path: a full disk (here: a file size limit) left it
    truncated over the earlier sweep's, and the error named no path."""
    # Imported here, matplotlib writes its font cache where the command will read it: on a
    # machine without one the command's first import failed to save it, and said so.
    pytest.importorskip("matplotlib.font_manager")
    plots = tmp_path / "plots"
    plots.mkdir()
    for name in PLOT_FILES:
        (plots / name).write_bytes(b"the earlier plot")
    argv = ["sweep", "--requests", "30", "--jobs", "1", "--no-progress", "--cpu-blocks", "0,50"]
    result = _run_with_little_room([*argv, "--plot-dir", str(plots)])
    assert result.returncode == 1
    first = plots / PLOT_FILES[0]
    assert result.stderr == f"kvoffload: error: --plot-dir {first}: cannot write: File too large\n"
    assert {p.name: p.read_bytes() for p in plots.iterdir()} == dict.fromkeys(
        PLOT_FILES, b"the earlier plot"
    )  # and no temporary file left


def test_a_result_file_is_replaced_keeping_its_mode_and_links(tmp_path: Path) -> None:
    real = tmp_path / "real.json"
    real.write_text("{}")
    real.chmod(0o640)
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert main([*SMALL, "--no-bound", "--json", str(link)]) == 0
    assert link.is_symlink() and json.loads(real.read_text())["requests"] == 50
    assert stat.S_IMODE(real.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real.json"]


@pytest.mark.parametrize(
    "argv",
    [
        [*SMALL, "--json", ""],
        [*SMALL, "--csv", ""],
        [*SMALL, "--layout", ""],
        ["sweep", "--requests", "50", "--plot-dir", ""],
        ["trace-stats", "t.jsonl", "--json", ""],
        [*SMALL, "--trace", ""],
        ["sweep", "--trace", ""],
        ["bench", "tiers", "--dir", ""],
        [*SMALL, "--data-plane", "--device", ""],
    ],
)
def test_an_empty_output_or_layout_is_refused(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--json "$OUT"`` with ``OUT`` unset used to run and write no file (status 0), and
    ``--layout ""`` to take the default model's layout, both unsaid; ``--trace ""`` said
    ". cannot read trace: Is a directory", and ``bench tiers --dir ""`` measured the
    current directory's disk."""
    option = argv[-2]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvoffload: error: argument {option}: must not be empty"), err
    assert err.count("\n") == 1


def test_an_empty_trace_path_is_refused_naming_the_argument(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["trace-stats", ""]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvoffload: error: argument path: must not be empty"), err
    assert err.count("\n") == 1


@pytest.mark.parametrize("command", ["simulate", "sweep", "trace-stats"])
def test_a_link_into_a_missing_directory_is_refused_before_the_run(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The file is written where the link leads: its directory was checked only after the
    run, which then ended in "cannot write", the run lost."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 16, "output_length": 1, "hash_ids": [1]}\n')
    link = tmp_path / "out.json"
    link.symlink_to(tmp_path / "gone" / "out.json")
    args = [trace.as_posix()] if command == "trace-stats" else ["--trace", trace.as_posix()]
    assert main([command, *args, "--json", str(link)]) == 1
    err = one_line_error(capsys)
    assert f"--json {link}: no such directory: {tmp_path / 'gone'}" in err


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        (["--json", "{tmp}/x.out", "--csv", "{tmp}/x.out"], "--json {tmp}/x.out and --csv"),
        (["--json", "{tmp}/x.out", "--csv", "{tmp}/./x.out"], "are one file; give each its own"),
        (["--json", "{tmp}/t.jsonl"], "--json {tmp}/t.jsonl is the --trace file being read"),
        (["--csv", "{tmp}/link.jsonl"], "--csv {tmp}/link.jsonl is the --trace file being read"),
        (["--json", "-", "--csv", "-"], "--json - and --csv - would both write to standard output"),
    ],
)
@pytest.mark.parametrize("command", ["simulate", "sweep"])
def test_outputs_that_would_clobber_each_other_or_the_trace_are_refused(
    tmp_path: Path,
    command: str,
    outputs: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """They once wrote one over the other, over the trace, or both to stdout, mixed."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 16, "output_length": 1, "hash_ids": [1]}\n')
    (tmp_path / "link.jsonl").symlink_to(trace)
    before = trace.read_text()
    argv = [command, "--trace", str(trace), "--block-size", "16", "--no-progress"]
    argv += ["--jobs", "1"] if command == "sweep" else ["--no-bound"]
    assert main([*argv, *(arg.format(tmp=tmp_path) for arg in outputs)]) == 1
    assert message.format(tmp=tmp_path) in one_line_error(capsys)
    assert trace.read_text() == before and not (tmp_path / "x.out").exists()


def test_trace_stats_checks_its_output_before_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("{\n")  # malformed: an error about it would mean it was read first
    assert main(["trace-stats", str(trace), "--json", str(trace)]) == 1
    assert f"--json {trace} is the trace file being read" in one_line_error(capsys)
    assert main(["trace-stats", str(trace), "--json", "/nonexistent/x.json"]) == 1
    assert "--json /nonexistent/x.json: no such directory" in one_line_error(capsys)


def _close_stdout() -> None:
    os.close(1)


def _cli(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    code = "import sys; from kvoffload.cli.main import main; sys.exit(main())"
    return subprocess.run(
        [sys.executable, "-c", code, *argv],
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
        check=False,
        **kwargs,
    )


def test_a_closed_stdout_is_no_traceback() -> None:
    """Started with stdout closed (``>&-``), the table once died in an AttributeError."""
    result = _cli([*SMALL, "--no-bound"], preexec_fn=_close_stdout)
    assert (result.returncode, result.stderr) == (0, "")
    result = _cli([*SMALL, "--no-bound", "--json", "-"], preexec_fn=_close_stdout)
    assert result.returncode == 1
    assert result.stderr == "kvoffload: error: --json -: standard output is closed\n"


def _close_stderr() -> None:
    os.close(2)


@pytest.mark.parametrize("progress", ["--progress", "--no-progress", None])
def test_a_closed_stderr_leaves_the_run_and_its_table(progress: str | None) -> None:
    """Started with stderr closed (``2>&-``, as some cron lines are), deciding whether to show
    progress died in an AttributeError, whose traceback went nowhere: status 1, no table."""
    argv = ["simulate", "--requests", "50", "--no-bound", *([progress] if progress else [])]
    code = "import sys; from kvoffload.cli.main import main; sys.exit(main())"
    result = subprocess.run(
        [sys.executable, "-c", code, *argv],
        stdout=subprocess.PIPE,
        text=True,
        timeout=120,
        check=False,
        preexec_fn=_close_stderr,
    )
    assert result.returncode == 0
    assert "total hit ratio" in result.stdout


def _environment(unbuffered: bool) -> dict[str, str]:
    """This process's environment, with ``PYTHONUNBUFFERED=1`` or without it."""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.mark.parametrize("unbuffered", [True, False], ids=["unbuffered", "buffered"])
def test_a_reader_that_has_gone_ends_the_output_quietly(unbuffered: bool) -> None:
    """``kvoffload ... | head``: status 1, no "Broken pipe" error and no traceback. Buffered
    (Python's default, which this test's own environment may not have), the table was
    written at exit: "Exception ignored ... BrokenPipeError" and status 120."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        for extra in ([], ["--json", "-"]):
            result = _cli(
                [*SMALL, "--no-bound", *extra], stdout=write_end, env=_environment(unbuffered)
            )
            assert (result.returncode, result.stderr) == (1, "")
    finally:
        os.close(write_end)


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        ["simulate", "--help"],
        ["sweep", "--help"],
        ["trace-stats", "--help"],
        ["bench", "--help"],
        ["bench", "tiers", "--help"],
        ["bench", "transfer", "--help"],
    ],
    ids=" ".join,
)
def test_help_and_version_to_a_reader_that_has_gone_end_quietly(argv: list[str]) -> None:
    """``kvoffload --help | true``: status 1 and nothing on stderr, as a run's table. Help
    and version end the parser with SystemExit before the run's own flush, so a text that
    fit standard output's buffer was written only at exit: "Exception ignored ...
    BrokenPipeError" and status 120."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = _cli(argv, stdout=write_end, env=_environment(unbuffered=False))
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (1, "")


@pytest.mark.parametrize(
    ("argv", "status"),
    [
        (["simulate", "--bogus"], 2),
        (["simulate", "--trace", "/nonexistent/trace.jsonl"], 1),
        ([*SMALL, "--no-bound"], 1),
        (["--help"], 1),
    ],
    ids=["usage error", "error", "run", "help"],
)
def test_errors_to_a_reader_that_has_gone_keep_their_status(argv: list[str], status: int) -> None:
    """``kvoffload ... 2>&1 | true``: the error line meets a reader gone too. It stayed in
    stderr's buffer, whose last flush at exit failed: "Exception ignored ..." to nowhere
    and status 120, not the usage error's 2 or the error's 1."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from kvoffload.cli.main import main; sys.exit(main())",
                *argv,
            ],
            stdout=write_end,
            stderr=write_end,
            env=_environment(unbuffered=False),
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)
    assert result.returncode == status


LONG_SWEEP = ["sweep", "--requests", "20", "--cpu-blocks", "100,200,300,400,500", "--jobs", "1"]
LONG_SWEEP += ["--policies", "lru,arc,sieve,slru,s3fifo", "--thresholds", "0,2,3", "--no-progress"]
"""75 runs: a table of more than the 8 KiB that standard output buffers."""


@pytest.mark.parametrize(
    ("argv", "unbuffered"),
    [
        # print() writes a text and its newline apart, at once under PYTHONUNBUFFERED=1
        # (common in containers): a reader gone after the first write failed the run.
        ([*SMALL, "--no-bound"], True),
        (["trace-stats", "{tmp}/t.jsonl"], True),
        # A table past the buffer was written at once and its newline only at exit, which
        # a reader gone by then turned into "Exception ignored ... BrokenPipeError", status 120.
        ([*LONG_SWEEP, "--plot-dir", "{tmp}"], False),
    ],
    ids=["simulate", "trace-stats", "sweep"],
)
def test_the_output_reaches_stdout_in_one_write(
    argv: list[str], unbuffered: bool, tmp_path: Path
) -> None:
    """``kvoffload ... | head -1``: whatever reads standard output gets the whole table in
    one write, so a reader that takes its first line and goes fails no run (docs/setup.md,
    Errors). A SOCK_SEQPACKET pair keeps each write a message of its own."""
    (tmp_path / "t.jsonl").write_text(
        '{"timestamp": 0, "input_length": 1200, "output_length": 50, "hash_ids": [0, 1, 2]}\n'
    )
    argv = [word.replace("{tmp}", str(tmp_path)) for word in argv]
    reader, writer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with reader, writer:
        result = _cli(argv, stdout=writer.fileno(), env=_environment(unbuffered))
        writer.close()
        writes = list(iter(lambda: reader.recv(1 << 20), b""))
    assert (result.returncode, result.stderr) == (0, "")
    assert len(writes) == 1, [write[-80:] for write in writes]
    assert writes[0].endswith(b"\n")
