"""Every number the command line reads is judged as written, and every size has a bound
checked before any work: the options that each slipped past that one check."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from cli_helpers import one_line_error

from kvoffload.admission.budget import BYTES_PER_S, DWPD, WriteBudget
from kvoffload.cli import options
from kvoffload.cli.main import main
from kvoffload.core.errors import InvalidArgumentError
from kvoffload.sim.generators import parse_mix

SMALL = ["--requests", "20", "--no-progress"]
TOO_MANY = str(2**72 + 1)
"""One block more than any capacity in GiB can give: 2**50 GiB in blocks of 256 bytes
(the tiny layout's, one token per block)."""


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0.99999999999999999999", "must be >= 1, got 0.99999999999999999999"),
        ("600000.0000000000000001", "must be <= 600,000, got 600000.0000000000000001"),
    ],
)
@pytest.mark.parametrize("command", [["simulate", *SMALL], ["bench", "tiers"]])
def test_a_disk_timeout_is_judged_as_written(
    command: list[str], value: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``0.99999999999999999999`` reads as the float 1.0, and passed the 1 ms minimum."""
    given = ["--disk-dir", str(tmp_path), "--disk-blocks", "8"] if command[0] == "simulate" else []
    assert main([*command, *given, "--disk-timeout-ms", value]) == 2
    assert f"--disk-timeout-ms: {message}" in one_line_error(capsys)


@pytest.mark.parametrize("value", ["1e-400", "-1e-400", "1e-400TB", "0", "0.5"])
def test_every_drive_size_below_a_byte_says_so(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``1e-400`` said "too small to tell from 0" where ``-1e-400`` said "must be >= 1 byte":
    both are below a byte, as ``0.5`` is."""
    budget = ["--admission", "recommended", "--write-budget", "1dwpd"]
    assert main(["simulate", *SMALL, *budget, f"--drive-bytes={value}"]) == 2
    assert f"--drive-bytes: must be >= 1 byte, got '{value}'" in one_line_error(capsys)


@pytest.mark.parametrize(
    ("text", "budget"),
    [
        ("1_000", WriteBudget(1000.0)),
        ("0.2_5/ref", WriteBudget(0.25)),
        ("1_000MB/s", WriteBudget(1e9, BYTES_PER_S)),
        ("1e1_0B/s", WriteBudget(1e10, BYTES_PER_S)),
        ("1_0dwpd", WriteBudget(10.0, DWPD)),
    ],
)
def test_a_write_budget_takes_underscores_as_other_numbers_do(
    text: str, budget: WriteBudget
) -> None:
    """``--rate 1_000`` was taken and ``--write-budget 1_000`` refused as no known form."""
    assert options.WRITE_BUDGET(text) == budget


def test_a_drive_size_takes_underscores() -> None:
    assert options.DRIVE_BYTES("1_920GB") == 1_920 * 10**9


@pytest.mark.parametrize("text", ["1__000", "_1", "1_", "1_.5", "1e_3"])
def test_underscores_out_of_place_are_refused(text: str) -> None:
    """Only where Python's float() takes them: one between two digits."""
    with pytest.raises(InvalidArgumentError, match="write budget"):
        WriteBudget.parse(text)


def test_a_write_budget_with_underscores_runs(capsys: pytest.CaptureFixture[str]) -> None:
    budget = ["--admission", "recommended", "--write-budget", "1_000"]
    assert main(["simulate", *SMALL, "--no-bound", *budget]) == 0
    assert "error" not in capsys.readouterr().err


def test_a_block_past_any_memory_is_refused_by_its_option(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--block-mib 1e300``: the memory check said "about inf GiB"."""
    assert main(["bench", "tiers", "--block-mib", "1e300"]) == 2
    assert "--block-mib: must be <= 1,152,921,504,606,846,976, got 1e300" in one_line_error(capsys)


def test_a_huge_memory_figure_is_short(capsys: pytest.CaptureFixture[str]) -> None:
    """Within the bound, a size past memory is a figure a reader takes in, not 18 digits."""
    assert main(["bench", "tiers", "--block-mib", "1e18"]) == 1
    assert re.search(r"would need about \d\.\d+e\+\d+ GiB of memory", one_line_error(capsys))


def test_the_block_bound_is_what_the_largest_size_in_gib_gives() -> None:
    assert options.cpu_blocks_for_gib(options.MAX_GIB, "tiny", 1) == options.MAX_BLOCKS
    assert options.BLOCKS_OR_NONE(str(options.MAX_BLOCKS)) == options.MAX_BLOCKS


@pytest.mark.parametrize(
    ("command", "args"),
    [
        (["simulate", "--admission", "recommended"], ["--cpu-blocks", TOO_MANY]),
        (["simulate"], ["--gpu-blocks", TOO_MANY]),
        (["sweep"], ["--gpu-blocks", TOO_MANY]),
        (["simulate"], ["--disk-dir", "d", "--disk-blocks", TOO_MANY]),
        (["sweep"], ["--remote-blocks", TOO_MANY]),
    ],
)
def test_a_size_in_blocks_has_the_bound_of_a_size_in_gib(
    command: list[str], args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--cpu-blocks`` had no bound where ``--cpu-gb`` had one: with ``--admission
    recommended`` a huge one was refused by the sketch's memory check, naming ``cpu_blocks``,
    and in a sweep only as its first run started."""
    option = args[-2]
    assert main([*command, *SMALL, *args]) == 2
    assert f"{option}: must be <= {options.MAX_BLOCKS}, got {TOO_MANY}" in one_line_error(capsys)


def test_bench_blocks_have_the_bound_too(capsys: pytest.CaptureFixture[str]) -> None:
    """Past a float's range, the memory check's product raised OverflowError: a traceback."""
    assert main(["bench", "tiers", "--blocks", "1" + "0" * 400]) == 2
    assert f"--blocks: must be <= {options.MAX_BLOCKS}" in one_line_error(capsys)


def test_a_sweep_refuses_too_many_blocks_before_the_workload(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Not as the run with the list's second capacity started (the admission sketch's
    memory check, naming ``cpu_blocks``)."""
    args = ["--admissions", "recommended", "--cpu-blocks", f"8,{TOO_MANY}", "--jobs", "1"]
    assert main(["sweep", *SMALL, *args]) == 1
    message = f"--cpu-blocks values must be <= {options.MAX_BLOCKS}, got {TOO_MANY}"
    assert message in one_line_error(capsys)


@pytest.mark.parametrize("mix", ["chat=", "chat= ", "rag=1,chat="])
def test_a_mix_entry_with_an_empty_weight_is_refused(
    mix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``chat=`` was taken as ``chat``, weight 1."""
    assert main(["simulate", *SMALL, "--mix", mix]) == 1
    assert "gives 'chat' no weight after '='" in one_line_error(capsys)


def test_a_kind_alone_still_weighs_one() -> None:
    assert parse_mix("chat,rag=2") == {"chat": 1.0, "rag": 2.0}


@pytest.mark.parametrize(
    "argv", [["simulate", "--trace", "-"], ["sweep", "--trace", "-"], ["trace-stats", "-"]]
)
def test_a_trace_from_standard_input_is_refused_as_such(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """It said "-: cannot read trace: No such file or directory"."""
    assert main([*argv, "--no-progress"]) == 1
    assert "a trace must be a file, not standard input" in one_line_error(capsys)
