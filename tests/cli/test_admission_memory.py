"""A tier whose admission layer the machine cannot hold is refused before any work, naming
the size as typed and the option that chose the rule, and the memory it would exceed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from cli_helpers import one_line_error

from kvoffload.cli.main import main

SMALL = ["--requests", "5", "--no-progress"]
HUGE = 10**20
"""Blocks whose admission sketch no machine holds (some 10^13 GiB)."""
HUGE_DISK = 10**15
"""As many on disk: a slot file within the largest file size, a sketch of 10^8 GiB."""
BOUND = re.compile(r": an admission frequency sketch of [\d,]+ sightings would need about \S+ "
                   r"GiB of memory, more than the [\d,.]+ GiB available\n$")  # fmt: skip


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], size: str) -> None:
    assert main(argv) == 1
    err = one_line_error(capsys)
    assert err.startswith(f"kvoffload: error: {size}"), err
    assert BOUND.search(err), err


def _unreadable_trace(tmp_path: Path) -> str:
    """A trace whose first record is malformed: reading it fails, so an error about the
    tier's size shows that the size was checked before the workload was read."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("{not json\n")
    return str(trace)


@pytest.mark.parametrize(
    ("options", "size"),
    [
        (
            ["--cpu-blocks", str(HUGE), "--admission", "recommended"],
            f"--cpu-blocks {HUGE} with --admission recommended",
        ),
        (
            ["--disk-dir", "DIR", "--disk-blocks", str(HUGE_DISK), "--disk-admission", "sketch"],
            f"--disk-blocks {HUGE_DISK} with --disk-admission sketch",
        ),
    ],
)
def test_simulate_refuses_a_typed_block_count_before_reading_the_trace(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, options: list[str], size: str
) -> None:
    options = [str(tmp_path) if word == "DIR" else word for word in options]
    argv = ["simulate", "--trace", _unreadable_trace(tmp_path), "--no-progress", *options]
    _refused(capsys, argv, size)


@pytest.mark.parametrize(
    ("options", "size"),
    [
        (
            ["--cpu-gb", "1e12", "--admission", "recommended"],
            "--cpu-gb 1e+12 (512,000,000,000,000 blocks) with --admission recommended",
        ),
        (
            ["--disk-dir", "DIR", "--disk-gb", "1e12", "--disk-admission", "recommended"],
            "--disk-gb 1e+12 (512,000,000,000,000 blocks) with --disk-admission recommended",
        ),
    ],
)
def test_simulate_names_a_size_in_gib_and_its_blocks(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, options: list[str], size: str
) -> None:
    options = [str(tmp_path) if word == "DIR" else word for word in options]
    _refused(capsys, ["simulate", *SMALL, *options], size)


@pytest.mark.parametrize(
    ("capacities", "size"),
    [
        (["--cpu-blocks", f"100,{HUGE}"], f"--cpu-blocks {HUGE}"),
        (["--cpu-gb", "1,1e12"], "--cpu-gb 1e+12 (512,000,000,000,000 blocks)"),
    ],
)
def test_sweep_refuses_before_the_first_run(
    capsys: pytest.CaptureFixture[str], capacities: list[str], size: str
) -> None:
    """The run that cannot start came after a run that could: it failed once that one had
    taken its time (and its table was shown), naming the simulator's ``cpu_blocks``."""
    argv = ["sweep", *SMALL, "--jobs", "1", "--admissions", "none,recommended", *capacities]
    _refused(capsys, argv, f"{size} with --admissions recommended")
    assert capsys.readouterr().out == ""


def test_sweep_checks_a_typed_block_count_before_reading_the_trace(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["sweep", "--trace", _unreadable_trace(tmp_path), "--no-progress", "--jobs", "1"]
    argv += ["--cpu-blocks", str(HUGE), "--admissions", "sketch"]
    _refused(capsys, argv, f"--cpu-blocks {HUGE} with --admissions sketch")
